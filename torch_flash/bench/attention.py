"""Attention benchmark: our Triton kernels and, where torch_flash._C is built, the Hopper
kernels of csrc/attention (cuda-sm90), vs FlashAttention 4 (fa4: flash-attn-4's CuTe DSL
kernels, where importable) and SDPA's flash, cuDNN and efficient backends (flash-op is
flash.attention as dispatched: the CUDA kernels where they serve, Triton otherwise; the -det
rows are the backwards in deterministic mode, with a fixed dQ accumulation order).

Standard grid: bf16, 32k tokens per batch, hidden 2048 (H = 2048 / D), D in {64, 128},
S in {1k, 4k, 16k} (B = 32k / S), causal and not; --gqa G: H / G K/V heads, each shared by G
query heads (FLOPs as without). Inputs are (B, S, H, D) buffers viewed as
(B, H, S, D), as a model produces them, and every implementation runs on the same tensors in
the same process. FLOPs: 4*B*H*S*S*D, halved for causal; backward counts 2.5x the forward.
The backward is timed alone: ours from the saved out/lse, the autograd ones as
torch.autograd.grad over a retained graph (no .grad accumulation). Every implementation of a
grid point is timed in interleaved rounds (_common.time_rounds): ms are medians over rounds,
ratios medians of the rounds' ratios.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from .. import _extension
from ._common import median_or_none, median_ratio, pick, report_unavailable, time_rounds, within_budget

TOKENS, HIDDEN = 32 * 1024, 2048
HEAD_DIMS, SEQLENS = (64, 128), (1024, 4096, 16384)
BASELINES = ("fa4", "sdpa-flash", "sdpa-cudnn")


def _sdpa(backend_name: str) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def fn(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                    enable_gqa=k.shape[1] != q.shape[1])
    return fn


def _flash_op(q, k, v, causal):
    import torch_flash  # noqa: F401  (registers torch.ops.flash)
    return torch.ops.flash.attention(q, k, v, causal=causal)


@functools.cache
def _fa4() -> Callable | None:
    """FlashAttention 4's flash_attn_func on our (B, H, S, D) views of (B, S, H, D) buffers, or
    None where flash-attn-4 is not importable."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:
        report_unavailable("fa4", e)
        return None

    def fn(q, k, v, causal):
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
    return fn


AUTOGRAD_IMPLS = {
    "flash-op": _flash_op,
    "sdpa-flash": _sdpa("FLASH_ATTENTION"),
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa-efficient": _sdpa("EFFICIENT_ATTENTION"),
}


def _flags(causal: bool) -> dict:
    return dict(scale=None, causal=causal, window_left=-1, window_right=-1, softcap=0.0,
                dropout_p=0.0, dropout_seed=None)


def _tflops(b, h, s, d, causal, pass_, ms):
    flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0) * (2.5 if pass_ == "bwd" else 1.0)
    return None if ms is None else flops / (ms * 1e-3) / 1e12


def _qkv(d: int, s: int, b: int, gqa: int = 1) -> tuple[torch.Tensor, ...]:
    """q (B, H, S, D) and k, v (B, H / gqa, S, D), views of (B, S, H, D) buffers."""
    return tuple(torch.randn(b, s, HIDDEN // d // heads, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                 for heads in (1, gqa, gqa))


def _deterministic(fn: Callable, *args):
    """fn(*args) under torch.use_deterministic_algorithms(True): the kernel's fixed-order dQ."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return fn(*args)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


# every implementation the bench knows (--configs picks some)
IMPLS = ("triton", "triton-det", "cuda-sm90", "cuda-sm90-det", "fa4", *AUTOGRAD_IMPLS)


def _time_point(d: int, s: int, b: int, causal: bool, impls: frozenset = frozenset(IMPLS),
                gqa: int = 1) -> list[dict]:
    from torch_flash.kernels.triton import attention as tk, attention_backward as tkb
    h = HIDDEN // d
    q, k, v = _qkv(d, s, b, gqa)
    dout = torch.randn_like(q)
    flags = _flags(causal)
    fns: dict[tuple[str, str], Callable] = {}

    fns["triton", "fwd"] = lambda: tk.attention_fwd(q, k, v, None, **flags)
    if _extension.loaded():  # the Hopper kernels of csrc/attention
        fns["cuda-sm90", "fwd"] = lambda: torch.ops.flash.attention_fwd_sm90(q, k, v, d ** -0.5, causal)
        if d in _extension.build_info().get("backward_hdims", ()):
            o, l = torch.ops.flash.attention_fwd_sm90(q, k, v, d ** -0.5, causal)
            fns["cuda-sm90", "bwd"] = lambda o=o, l=l: torch.ops.flash.attention_bwd_sm90(
                dout, q, k, v, o, l, d ** -0.5, causal)
            fns["cuda-sm90-det", "bwd"] = lambda o=o, l=l: _deterministic(
                torch.ops.flash.attention_bwd_sm90, dout, q, k, v, o, l, d ** -0.5, causal)
    if impls & {"triton", "triton-det"}:
        out, lse = tk.attention_fwd(q, k, v, None, **flags)
        for impl, det in (("triton", False), ("triton-det", True)):
            fns[impl, "bwd"] = lambda det=det: tkb.attention_bwd(
                dout, None, q, k, v, None, out, lse, **flags, bias_requires_grad=False, deterministic=det)

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fa4 = _fa4() if "fa4" in impls else None
    for impl, fn in {**({"fa4": fa4} if fa4 else {}), **AUTOGRAD_IMPLS}.items():
        if impl not in impls:
            continue
        fns[impl, "fwd"] = lambda fn=fn: fn(q, k, v, causal)
        try:
            o = fn(*leaves, causal)
        except Exception as e:  # the baseline cannot run here: no backward to time either
            report_unavailable(impl, e)
            continue
        fns[impl, "bwd"] = lambda o=o: torch.autograd.grad(o, leaves, dout, retain_graph=True)
    fns = {key: fn for key, fn in fns.items() if key[0] in impls}
    # forwards and backwards interleave apart: a 30 ms backward just before a forward would
    # lower the clocks that forward starts at
    times = {key: t for pass_ in ("fwd", "bwd")
             for key, t in time_rounds({k: f for k, f in fns.items() if k[1] == pass_}).items()}

    rows = []
    for (impl, pass_), ms_rounds in times.items():
        ms = median_or_none(ms_rounds)
        row = {"d": d, "s": s, "b": b, "h": h, "hkv": h // gqa, "causal": causal, "pass": pass_, "impl": impl,
               "ms": ms, "tflops": _tflops(b, h, s, d, causal, pass_, ms)}
        for base in BASELINES:  # speedup of this impl over the baseline (their ms / our ms)
            row[f"vs_{base}"] = median_ratio(times.get((base, pass_)), ms_rounds)
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row: dict) -> str:
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)
    ratios = "  ".join(f"{k[3:]} x{fmt(row[k], '.2f')}" for k in row if k.startswith("vs_"))
    heads = f"h={row['h']}/{row['hkv']}" if row.get("hkv", row["h"]) != row["h"] else f"h={row['h']}"
    return (f"d={row['d']:<4d} s={row['s']:<6d} b={row['b']:<3d} {heads:<6s} "
            f"{'causal' if row['causal'] else 'full  '} {row['pass']} {row['impl']:<15s} "
            f"{fmt(row['ms'], '9.3f')} ms {fmt(row['tflops'], '7.1f')} TFLOP/s  {ratios}")


# The Hopper forward's targets, x SDPA-cuDNN: 1.05 at D=128, S=16k without a mask,
# 1.0 at every other point from S=4k. --targets times only these forwards, in more rounds, and
# keeps each round's ratio: single rounds move by several percent.
TARGET_SEQLENS, TARGET_ROUNDS = (4096, 16384), 9


def target(d: int, s: int, causal: bool) -> float:
    return 1.05 if (d, s, causal) == (128, 16384, False) else 1.0


def run_targets() -> list[dict]:
    if not _extension.loaded():
        raise SystemExit("--targets needs torch_flash._C (python -m torch_flash build)")
    rows = []
    for d in HEAD_DIMS:
        for s in TARGET_SEQLENS:
            for causal in (False, True):
                b, h = TOKENS // s, HIDDEN // d
                q, k, v = _qkv(d, s, b)
                fns = {impl: (lambda fn=AUTOGRAD_IMPLS[impl]: fn(q, k, v, causal))
                       for impl in ("flash-op", "sdpa-cudnn")}
                fns["cuda-sm90"] = lambda: torch.ops.flash.attention_fwd_sm90(q, k, v, d ** -0.5, causal)
                times = time_rounds(fns, rounds=TARGET_ROUNDS)
                for impl in ("flash-op", "cuda-sm90"):
                    ratios = [c / o for c, o in zip(times["sdpa-cudnn"], times[impl])]
                    ms = median_or_none(times[impl])
                    row = {"d": d, "s": s, "b": b, "h": h, "causal": causal, "pass": "fwd",
                           "impl": impl, "ms": ms, "tflops": _tflops(b, h, s, d, causal, "fwd", ms),
                           "vs_sdpa-cudnn": median_or_none(ratios), "round_ratios": ratios,
                           "target": target(d, s, causal)}
                    row["met"] = row["vs_sdpa-cudnn"] >= row["target"]
                    rows.append(row)
                    print(f"d={d:<4d} s={s:<6d} {'causal' if causal else 'full  '} {impl:10s} "
                          f"x{row['vs_sdpa-cudnn']:.3f} cuDNN (rounds {min(ratios):.3f}-{max(ratios):.3f}, "
                          f"target {row['target']:.2f}: {'met' if row['met'] else 'MISSED'})", flush=True)
                torch.cuda.empty_cache()
    return rows


def run(args) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("the attention benchmark needs a CUDA GPU")
    if getattr(args, "targets", False):
        return run_targets()
    if getattr(args, "quick", False):
        points = [(64, 1024, 2, True)]
    else:
        hdims = pick("attention", getattr(args, "hdims", None), HEAD_DIMS, "head dim")
        points = [(d, s, TOKENS // s, causal) for d in hdims for s in SEQLENS
                  for causal in (False, True)]
    impls = frozenset(pick("attention", getattr(args, "configs", None), IMPLS, "implementation"))
    rows = []
    gqa = getattr(args, "gqa", 1)
    for d in sorted({d for d, *_ in points}):
        if HIDDEN // d % gqa:
            raise SystemExit(f"--gqa {gqa}: the grid's {HIDDEN // d} query heads at D={d} are not a multiple of it")
    for d, s, b, causal in within_budget("attention", args, points):
        rows += _time_point(d, s, b, causal, impls, gqa)
        torch.cuda.empty_cache()
    return rows


def plot(data: dict, png_path: str) -> None:
    """Grouped bars of TFLOP/s per grid point and implementation, forward and backward panels;
    for a --targets run, the ratios to cuDNN with each round's spread and the targets."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    if rows and "round_ratios" in rows[0]:
        _plot_targets(plt, data, png_path)
        return
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(14, 9))
    for ax, pass_ in zip(axes, ("fwd", "bwd")):
        sel = [r for r in rows if r["pass"] == pass_]
        points = list(dict.fromkeys((r["d"], r["s"], r["causal"]) for r in sel))
        width = 0.8 / max(1, len(impls))
        for n, impl in enumerate(impls):
            by_point = {(r["d"], r["s"], r["causal"]): r["tflops"] for r in sel if r["impl"] == impl}
            ys = [by_point.get(p) or 0.0 for p in points]
            ax.bar([x + n * width for x in range(len(points))], ys, width, label=impl)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(points))])
        ax.set_xticklabels([f"d{d} s{s // 1024}k\n{'causal' if c else 'full'}" for d, s, c in points])
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"attention {pass_} (bf16, {TOKENS // 1024}k tokens, hidden {HIDDEN}) on "
                     f"{data.get('env', {}).get('device', '?')}")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(ncol=len(impls), fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def _plot_targets(plt, data: dict, png_path: str) -> None:
    rows = data["rows"]
    points = list(dict.fromkeys((r["d"], r["s"], r["causal"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(impls)
    for n, impl in enumerate(impls):
        by_point = {(r["d"], r["s"], r["causal"]): r for r in rows if r["impl"] == impl}
        xs = [x + n * width for x in range(len(points))]
        mid = [by_point[p]["vs_sdpa-cudnn"] for p in points]
        low = [m - min(by_point[p]["round_ratios"]) for m, p in zip(mid, points)]
        high = [max(by_point[p]["round_ratios"]) - m for m, p in zip(mid, points)]
        ax.bar(xs, mid, width, yerr=[low, high], capsize=3, label=f"{impl} (median, rounds' range)")
    for x, p in enumerate(points):
        ax.hlines(target(*p), x - width / 2, x + 0.8 - width / 2, colors="k", linestyles="--")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(points))])
    ax.set_xticklabels([f"d{d} s{s // 1024}k\n{'causal' if c else 'full'}" for d, s, c in points])
    ax.set_ylim(0.8, 1.2)
    ax.set_ylabel("x SDPA-cuDNN (forward)")
    ax.set_title(f"Hopper attention forward vs cuDNN, {len(rows[0]['round_ratios'])} rounds; dashed: target "
                 f"({data.get('env', {}).get('device', '?')}, {data.get('env', {}).get('date', '?')[:10]})")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
