"""Host time of one eager call, ours against the alternatives, at shapes whose kernels take a
few microseconds (so the host, not the GPU, sets the pace): `python scripts/host_overhead.py OUT`.

Each case runs CALLS calls back to back without synchronising, in interleaved rounds, and
reports the median wall time per call (us). With the GPU idle behind the host this is the
cost a small model pays per op in eager mode. Also writes cProfile listings of ours
(host_overhead_profile.txt) so that the time can be attributed: our checks and launchers,
torch's custom-op dispatch, Triton's launcher. Writes host_overhead.json.
"""
from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import torch_flash
from torch_flash.bench._common import env_info

CALLS, ROUNDS = 300, 7
dev, bf16 = "cuda", torch.bfloat16


def _liger(module: str, name: str):
    try:
        return getattr(__import__(f"liger_kernel.ops.{module}", fromlist=[name]), name)
    except ImportError:
        return None


def _grad(f, *leaves):
    """f's forward with a graph, then the gradients of its outputs into those of leaves it used."""
    def run():
        out = f()
        outs = out if isinstance(out, tuple) else (out,)
        return torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs], allow_unused=True)
    return run


def cases() -> dict[str, dict]:
    x = torch.randn(16, 1024, device=dev, dtype=bf16, requires_grad=True)
    w = torch.randn(1024, device=dev, dtype=bf16, requires_grad=True)
    logits = torch.randn(16, 4096, device=dev, dtype=bf16, requires_grad=True)
    logits_liger = logits.detach().clone().requires_grad_()
    tgt = torch.randint(0, 4096, (16,), device=dev)
    q = torch.randn(1, 8, 64, 64, device=dev, dtype=bf16, requires_grad=True)
    k = torch.randn(1, 8, 64, 64, device=dev, dtype=bf16, requires_grad=True)
    v = torch.randn(1, 8, 64, 64, device=dev, dtype=bf16, requires_grad=True)
    cos, sin = torch_flash.rotary_cos_sin(64, 64, device=dev)
    hf_cos, hf_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    h = torch.randn(16, 256, device=dev, dtype=bf16, requires_grad=True)
    lm = torch.randn(1024, 256, device=dev, dtype=bf16, requires_grad=True)
    lm_t = torch.randint(0, 1024, (16,), device=dev)

    rms_liger = _liger("rms_norm", "LigerRMSNormFunction")
    ce_liger = _liger("cross_entropy", "LigerCrossEntropyFunction")
    rope_liger = _liger("rope", "LigerRopeFunction")
    lce_liger = _liger("fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyFunction")

    def half_rot(t):
        a, b = t.chunk(2, -1)
        return torch.cat((-b, a), -1)

    fwd = {
        "rms_norm": {
            "torch (F.rms_norm)": lambda: F.rms_norm(x, (1024,), w, 1e-6),
            "ours": lambda: torch_flash.rms_norm(x, w, 1e-6),
            "liger": rms_liger and (lambda: rms_liger.apply(x, w, 1e-6)),
        },
        "cross_entropy": {
            "torch (F.cross_entropy)": lambda: F.cross_entropy(logits, tgt),
            "ours": lambda: torch_flash.cross_entropy(logits, tgt),
            # Liger writes the gradient into the logits: its own copy
            "liger": ce_liger and (lambda: ce_liger.apply(logits_liger, tgt, None)[0]),
        },
        "rotary_qk": {
            "torch (HF apply_rotary_pos_emb)": lambda: (q * hf_cos + half_rot(q) * hf_sin,
                                                         k * hf_cos + half_rot(k) * hf_sin),
            "ours": lambda: torch_flash.rotary_qk(q, k, cos, sin),
            "liger": rope_liger and (lambda: rope_liger.apply(q, k, hf_cos, hf_sin)),
        },
        "attention": {
            "torch (SDPA)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "ours": lambda: torch_flash.attention(q, k, v, causal=True),
        },
        "linear_cross_entropy": {
            "torch (F.linear + F.cross_entropy)": lambda: F.cross_entropy(F.linear(h, lm).float(), lm_t),
            "ours": lambda: torch_flash.linear_cross_entropy(h, lm, lm_t),
            "liger": lce_liger and (lambda: lce_liger.apply(h, lm, lm_t)[0]),
        },
    }
    leaves = {"rms_norm": (x, w), "cross_entropy": (logits, logits_liger), "rotary_qk": (q, k),
              "attention": (q, k, v), "linear_cross_entropy": (h, lm)}
    out = {}
    for op, impls in fwd.items():
        impls = {k: f for k, f in impls.items() if f}
        out[f"{op} fwd"] = {k: _no_grad(f) for k, f in impls.items()}
        out[f"{op} fwd+bwd"] = {k: _grad(f, *leaves[op]) for k, f in impls.items()}
    return out


def _no_grad(f):
    def run():
        with torch.no_grad():
            return f()
    return run


def per_call_us(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    end = time.perf_counter()
    torch.cuda.synchronize()
    return (end - start) / CALLS * 1e6


def main(out_dir: str) -> None:
    all_cases = cases()
    rows = []
    for case, impls in all_cases.items():
        for fn in impls.values():
            for _ in range(3):
                fn()  # compile, autotune, warm caches
        samples = {k: [] for k in impls}
        names = list(impls)
        for r in range(ROUNDS):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in (order if r % 2 == 0 else order[::-1]):
                samples[name].append(per_call_us(impls[name]))
        for name, s in samples.items():
            rows.append({"case": case, "impl": name, "us": statistics.median(s)})
            print(f"{case:28s} {name:36s} {rows[-1]['us']:8.1f} us", flush=True)

    text = io.StringIO()
    for case in ("rms_norm fwd", "rms_norm fwd+bwd", "cross_entropy fwd+bwd", "attention fwd+bwd"):
        fn = all_cases[case]["ours"]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(CALLS):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        text.write(f"==== {case}, ours, {CALLS} calls\n")
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
    with open(f"{out_dir}/host_overhead_profile.txt", "w") as f:
        f.write(text.getvalue())
    with open(f"{out_dir}/host_overhead.json", "w") as f:
        json.dump({"env": env_info(), "calls": CALLS, "rounds": ROUNDS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
