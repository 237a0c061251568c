"""Causal attention with fewer queries than keys (a prefill after a cached prefix), which the
Hopper kernel serves since its mask is aligned bottom-right: flash.attention on its CUDA path
and on its Triton path (torch_flash.use_backend), and SDPA with causal_lower_right, interleaved
rounds on the same inputs. Needs an sm_90 GPU and torch_flash._C.

    python scripts/bench_causal_prefill.py OUT.json

H100, 2026-11-22 (docs/perf/attention_causal_prefill.json): CUDA 1.13x-1.25x the Triton path,
560 TFLOP/s at D=128 (SDPA 0.71x-0.81x of Triton).
"""
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
import torch_flash
from torch_flash.bench._common import env_info, median_ratio, time_rounds, out_dir

# (batch, q heads, kv heads, Sq, Sk, D)
SHAPES = [(4, 32, 8, 2048, 8192, 128), (1, 32, 8, 4096, 16384, 128), (8, 32, 32, 1024, 4096, 64)]


def on_backend(name: str, q, k, v):
    """flash.attention(q, k, v, causal=True) on the backend `name` (torch_flash.use_backend)."""
    def fn():
        with torch_flash.use_backend(name):
            return torch_flash.attention(q, k, v, causal=True)
    return fn


def main(out: str) -> None:
    rows = []
    for b, hq, hkv, sq, sk, d in SHAPES:
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        ke, ve = (t.repeat_interleave(hq // hkv, 1) for t in (k, v))
        mask = causal_lower_right(sq, sk)
        fns = {"cuda": on_backend("cuda", q, k, v), "triton": on_backend("triton", q, k, v),
               "sdpa-lower-right": lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)}
        outs = {n: f().float() for n, f in fns.items()}
        ref = outs["sdpa-lower-right"]
        times = time_rounds(fns, rounds=7)
        flops = 4 * b * hq * d * (sq * sk - sq * sq / 2)
        for n in fns:
            ms = statistics.median(times[n])
            row = dict(b=b, hq=hq, hkv=hkv, sq=sq, sk=sk, d=d, impl=n, ms=ms, tflops=flops / ms / 1e9,
                       vs_triton=median_ratio(times["triton"], times[n]),
                       rel_diff_vs_sdpa=((outs[n] - ref).norm() / ref.norm()).item())
            rows.append(row)
            print(f"B={b} Hq={hq} Hkv={hkv} Sq={sq} Sk={sk} D={d} {n:18s} {ms:7.3f} ms {row['tflops']:6.0f} TFLOP/s "
                  f"x{row['vs_triton']:.2f} triton  diff {row['rel_diff_vs_sdpa']:.1e}", flush=True)
    with open(out, "w") as f:
        json.dump({"suite": "causal_prefill", "env": env_info(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(out_dir(__doc__))
