"""What ALiBi slopes and attention sinks cost flash.attention: each against the same call without
them, forward and forward + backward, bf16, D=128, 32k tokens, 16 heads, S = 4k and 16k, causal
and not; on the Triton path (use_backend("triton")) and on the default dispatch (where the call
without them takes the CUDA forward and cuDNN's backward). Medians of interleaved rounds; the
ratios (*_vs_plain) are the plain call's time over the variant's, with the sinks' own gradient
in the backward. `python scripts/alibi_sinks_cost.py OUT` writes OUT/alibi_sinks.json.
"""
from __future__ import annotations

import json

import torch

import torch_flash
from torch_flash.bench._common import env_info, median_or_none, out_dir, time_rounds


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
                fns = {}
                for name, kw in variants.items():
                    wrt = (q, k, v, *[t for t in kw.values() if t.requires_grad])  # learnt sinks too

                    def fwd(kw=kw):
                        with torch.no_grad():
                            return torch_flash.attention(q, k, v, causal=causal, **kw)

                    def fwd_bwd(kw=kw, wrt=wrt):
                        torch.autograd.grad(torch_flash.attention(q, k, v, causal=causal, **kw), wrt, g)
                    fns[name, "fwd_ms"], fns[name, "fwd_bwd_ms"] = fwd, fwd_bwd
                # the variants interleaved round by round (time_rounds), forwards and backwards apart
                with torch_flash.use_backend(backend):
                    times = {key: t for pass_ in ("fwd_ms", "fwd_bwd_ms")
                             for key, t in time_rounds({k: f for k, f in fns.items() if k[1] == pass_}).items()}
                for name in variants:
                    row = {"s": s, "causal": causal, "backend": backend or "default", "variant": name}
                    for pass_ in ("fwd_ms", "fwd_bwd_ms"):
                        row[pass_] = median_or_none(times[name, pass_])
                        plain = median_or_none(times["plain", pass_])
                        row[pass_.replace("_ms", "_vs_plain")] = (None if row[pass_] is None or plain is None
                                                                   else plain / row[pass_])
                    rows.append(row)
                    print(*(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                          flush=True)
    with open(f"{out_dir}/alibi_sinks.json", "w") as f:
        json.dump({"suite": "alibi_sinks", "env": env_info(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(out_dir(__doc__))
