"""What ALiBi slopes and attention sinks cost flash.attention: each against the same call without
them, forward and forward + backward, bf16, D=128, 32k tokens, 16 heads, S = 4k and 16k, causal
and not; on the Triton path (use_backend("triton")) and on the default dispatch (where the call
without them takes the CUDA forward and cuDNN's backward). `python scripts/alibi_sinks_cost.py OUT`
writes OUT/alibi_sinks.json.
"""
from __future__ import annotations

import json

import torch
import triton.testing

import torch_flash
from torch_flash.bench._common import env_info, out_dir


def main(out_dir: str) -> None:
    rows = []
    dev = torch.device("cuda")
    for s in (4096, 16384):
        b, h, d = 32768 // s, 16, 128
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)
        variants = {"plain": {}, "alibi": {"alibi_slopes": torch.rand(h, device=dev) * 0.1},
                    "sinks": {"sinks": torch.randn(h, device=dev, requires_grad=True)}}
        for causal in (False, True):
            for backend in ("triton", None):
                for name, kw in variants.items():
                    def fwd():
                        with torch.no_grad():
                            return torch_flash.attention(q, k, v, causal=causal, **kw)

                    def fwd_bwd():
                        torch.autograd.grad(torch_flash.attention(q, k, v, causal=causal, **kw), (q, k, v), g)
                    with torch_flash.use_backend(backend):
                        times = {"fwd_ms": triton.testing.do_bench(fwd, rep=200),
                                 "fwd_bwd_ms": triton.testing.do_bench(fwd_bwd, rep=300)}
                    rows.append({"s": s, "causal": causal, "backend": backend or "default", "variant": name,
                                 **times})
                    print(*(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    with open(f"{out_dir}/alibi_sinks.json", "w") as f:
        json.dump({"suite": "alibi_sinks", "env": env_info(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(out_dir(__doc__))
