"""lm-head matmul + cross-entropy, bf16: `python -m torch_flash.bench linear_cross_entropy`.

Implementations: ours (torch_flash.linear_cross_entropy, the public op: its autograd forward
computes the gradients too and the backward hands them out, so fwd+bwd is timed like the others,
the forward with a graph then torch.autograd.grad; "fwd" runs the op without grad, which skips
the gradients), ours compiled by torch.compile(backend="flash") (GPU only), eager
F.linear then F.cross_entropy on the logits upcast to fp32 (HF), torch.compile of it, and
Liger-Kernel's LigerFusedLinearCrossEntropyFunction and quack's chunked_linear_cross_entropy
where installed. Timed eagerly only: calls of milliseconds, whose host cost is noise.
"fwd+bwd, frozen lm-head" differentiates for the hidden states alone, as LoRA training does.
No bias, mean reduction, upstream gradient 1. Compute-bound: ms and peak memory only (peak_mb:
beyond what existed before the call, the gradients included). Rows: {op, shape, pass, impl, ms,
tbps (None), peak_mb}.
--targets: the target point (TARGET_SHAPE) alone, forward + backward in TARGET_ROUNDS rounds, each
round's ratio to torch.compile kept (rows add vs_compile, round_ratios, rounds_faster and the
targets' verdicts, and quack's speed and memory where it ran); ours also with chunk_size set to Liger's chunk ("ours, Liger's chunk"), the
same memory as Liger's.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch._library.triton import set_wrap_triton_enabled

from ._common import compile_fresh, median_or_none, optional_peer, peak_memory, time_rounds, within_budget
from .cross_entropy import measure, no_grad, plot_rows, with_grad

# (tokens, hidden, vocabulary): LLaMA-3 8B's lm-head, then 70B's, whose 8192 tokens all fit
# in dweight's memory (kernels/triton/linear_cross_entropy.py, _resident_chunk), then GPT-2 small's (a
# small hidden size, a vocabulary not divisible by 16)
SHAPES = [(8192, 4096, 128256), (8192, 8192, 128256), (8192, 768, 50257)]
QUICK = [(2048, 2048, 32000)]
CPU_SHAPES = [(8, 32, 64)]  # smoke run under TRITON_INTERPRET=1 (a program per 16 classes)
# The target: forward + backward at LLaMA-3 8B's lm-head no slower than torch.compile of linear +
# cross_entropy, within the extra memory of Liger's fused kernel (1.45 GB measured).
# The two sides are about 1 % apart, as far as single rounds move: --targets times this point
# alone in more rounds and keeps each round's ratio.
TARGET_SHAPE, TARGET_ROUNDS, TARGET_PEAK_BYTES = (8192, 4096, 128256), 25, 1.45e9


def _eager(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def _liger():
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except ImportError:
        return None
    return lambda h, w, t: LigerFusedLinearCrossEntropyFunction.apply(h, w, t)[0]


def _quack():
    """quack's fused (chunked) linear cross-entropy as f(h, w, t) where importable."""
    return optional_peer("quack.linear_cross_entropy", "chunked_linear_cross_entropy")


def _flash_compiled(op):
    """torch.compile(backend="flash") of op, the path of a model compiled with the flash
    backend; called with wrap_triton's tracing hook on (bench.__main__ turns it off for the
    launchers), through which torch.compile traces the inference op's kernels."""
    compiled = torch.compile(op, backend="flash")

    def call(*args):
        with set_wrap_triton_enabled(True):
            return compiled(*args)
    return call


def _ours(device: str) -> dict:
    """Our implementations by name: the op, and on a GPU the op compiled with the flash backend
    (under the Triton interpreter torch.compile cannot trace the kernels). Call it after
    compile_fresh, whose reset would drop the compiled one's graphs."""
    from ..ops.linear_cross_entropy import linear_cross_entropy
    ours = {"ours": linear_cross_entropy}
    if device == "cuda":
        ours["ours, compiled"] = _flash_compiled(linear_cross_entropy)
    return ours


def _liger_chunk(n: int, hid: int, v: int) -> int:
    """The tokens per chunk of Liger-Kernel's fused linear cross-entropy (0.8.5,
    ops/fused_linear_cross_entropy.py: the next power of 2 of N / ceil(V / H), at most N): 256
    at 8192 x 4096 x 128256."""
    return min(n, 1 << max(0, math.ceil(math.log2(math.ceil(n / math.ceil(v / hid))))))


def _inputs(n: int, hid: int, v: int, device: str):
    h = torch.randn(n, hid, device=device, dtype=torch.bfloat16)
    w = torch.randn(v, hid, device=device, dtype=torch.bfloat16) * hid**-0.5
    return h, w, torch.randint(0, v, (n,), device=device)


def _sign_test(faster: int, rounds: int) -> float:
    """One-sided p-value of faster or more of rounds won if each round were a coin toss."""
    return sum(math.comb(rounds, k) for k in range(faster, rounds + 1)) / 2**rounds


def run_targets(device: str) -> list[dict]:
    """The target point, ours and Liger against torch.compile in TARGET_ROUNDS interleaved rounds
    (3 on CPU: a smoke run of tiny shapes); ratios are torch.compile's ms / the impl's, per round."""
    n, hid, v = TARGET_SHAPE if device == "cuda" else CPU_SHAPES[0]
    h, w, t = _inputs(n, hid, v, device)
    compiled = compile_fresh(_eager)
    ours = _ours(device)
    ours["ours, Liger's chunk"] = functools.partial(ours["ours"], chunk_size=_liger_chunk(n, hid, v))
    impls = {**ours, "compile": compiled, "liger": _liger(), "quack": _quack()}
    fns = {k: with_grad(f, h, w, t) for k, f in impls.items() if f is not None}
    times = time_rounds(fns, rounds=TARGET_ROUNDS if device == "cuda" else 3)
    peaks = {k: peak_memory(fn) if device == "cuda" and times[k] else None for k, fn in fns.items()}
    rows = []
    for impl, ms in times.items():
        row = {"op": "linear_cross_entropy", "shape": [n, hid, v], "pass": "fwd+bwd", "impl": impl,
               "ms": median_or_none(ms), "tbps": None, "peak_mb": None if peaks[impl] is None else peaks[impl] / 2**20}
        if impl != "compile" and ms and times["compile"]:
            ratios = [c / o for c, o in zip(times["compile"], ms)]
            faster = sum(r > 1 for r in ratios)
            row.update(vs_compile=median_or_none(ratios), round_ratios=ratios, rounds_faster=faster,
                       sign_test_p=_sign_test(faster, len(ratios)))
            print(f"  {impl:>8}: {row['ms']:9.3f} ms, x{row['vs_compile']:.4f} torch.compile (rounds "
                  f"{min(ratios):.4f}-{max(ratios):.4f}, faster in {faster} of {len(ratios)}, sign test p = "
                  f"{row['sign_test_p']:.2g})" + ("" if peaks[impl] is None else f", peak {row['peak_mb']:.0f} MiB"))
        rows.append(row)
    ours = next(r for r in rows if r["impl"] == "ours")
    if "vs_compile" in ours:
        ours["met_speed"] = ours["vs_compile"] >= 1.0
    if peaks["ours"] is not None:
        ours["met_memory"] = peaks["ours"] <= TARGET_PEAK_BYTES
        ours["vs_liger_peak"] = None if not peaks.get("liger") else peaks["ours"] / peaks["liger"]
    quack = next((r for r in rows if r["impl"] == "quack" and r["ms"] is not None), None)
    if quack is not None and ours["ms"] is not None:
        ours["vs_quack"] = quack["ms"] / ours["ms"]
        ours["met_quack"] = ours["vs_quack"] >= 1.0 and (peaks["ours"] is None or peaks["ours"] <= peaks["quack"])
    return rows


def run(args) -> list[dict]:
    from ..kernels.triton.linear_cross_entropy import lce_plan
    from ..ops.linear_cross_entropy import linear_cross_entropy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if getattr(args, "targets", False):
        return run_targets(device)
    shapes = CPU_SHAPES if device == "cpu" else (QUICK if args.quick else SHAPES)
    liger, quack = _liger(), _quack()
    rows: list[dict] = []
    for n, hid, v in within_budget("linear_cross_entropy", args, shapes):
        compiled = compile_fresh(_eager)
        ours = _ours(device)
        h, w, t = _inputs(n, hid, v, device)
        labels = dict(op="linear_cross_entropy", shape=[n, hid, v])
        ref = _eager(h, w, t).item()
        got = linear_cross_entropy(h, w, t).item()
        resident, chunk_rows = lce_plan(n, v, hid, h.dtype)
        rest = f"then {chunk_rows}-token chunks" if resident < n else "no other chunk"
        print(f"{n}x{hid}x{v}: with dweight {resident} tokens resident (in it and the chunk buffer), {rest}; "
              f"loss ours {got:.6f}, eager {ref:.6f}")
        fwd = {**{k: no_grad(f, h, w, t) for k, f in ours.items()},
               "eager": no_grad(_eager, h, w, t), "compile": no_grad(compiled, h, w, t),
               "liger": None if liger is None else no_grad(liger, h, w, t),
               "quack": None if quack is None else no_grad(quack, h, w, t)}
        measure(rows, fwd, None, **labels, **{"pass": "fwd"})
        for pass_, frozen in (("fwd+bwd", ()), ("fwd+bwd, frozen lm-head", (1,))):
            impls = {**ours, "eager": _eager, "compile": compiled, "liger": liger, "quack": quack}
            measure(rows, {k: None if f is None else with_grad(f, h, w, t, frozen=frozen) for k, f in impls.items()},
                    None, **labels, **{"pass": pass_})
    return rows


def plot(data: dict, path: str) -> None:
    """Bars of ms per pass and shape; for a --targets run, each round's ratio to torch.compile
    and the peak memory, against the targets."""
    if any("round_ratios" in r for r in data["rows"]):
        _plot_targets(data, path)
    else:
        plot_rows(data, path, "ms", "ms (lower is better)")


def plot_time_memory(ax, rows: list[dict], compiled: str) -> None:
    """Median ms against peak extra memory, a labelled point per row with both ({impl, ms,
    peak_mb}), the row impl == compiled as a horizontal line and the memory target as a
    vertical one."""
    measured = [r for r in rows if r["peak_mb"] is not None and r["ms"] is not None]
    for i, row in enumerate(measured):
        gb = row["peak_mb"] * 2**20 / 1e9
        ax.plot(gb, row["ms"], "o")
        ax.annotate(row["impl"], (gb, row["ms"]), textcoords="offset points", xytext=(5, 4 - 15 * (i % 2)),
                    fontsize=8)  # alternately above and below: points may share a place
    ms = next((r["ms"] for r in measured if r["impl"] == compiled), None)
    if ms is not None:
        ax.axhline(ms, color="k", ls=":", lw=1, label="torch.compile's time")
    ax.axvline(TARGET_PEAK_BYTES / 1e9, color="k", ls="--", lw=1, label="target memory: 1.45 GB")
    ax.set_xlabel("peak extra memory, GB")
    ax.set_ylabel("ms, median (lower is better)")
    ax.legend(fontsize=8, loc="upper right")


def _plot_targets(data: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for row in rows:  # the rounds of the target's comparison; the others' ratios are in the JSON
        if row["impl"] in ("ours", "ours, compiled") and "round_ratios" in row:
            left.plot(range(1, len(row["round_ratios"]) + 1), row["round_ratios"], "o-", ms=3,
                      label=f"{row['impl']} (median x{row['vs_compile']:.4f})")
    left.axhline(1.0, color="k", ls="--", lw=1, label="torch.compile (target: no slower)")
    left.set_xlabel("round")
    left.set_ylabel("x torch.compile's speed, per round")
    left.legend(fontsize=8)
    plot_time_memory(right, rows, "compile")  # the target is the corner below both lines
    n, hid, v = rows[0]["shape"]
    fig.suptitle(f"linear cross-entropy fwd+bwd, {n} x {hid} x {v} bf16, on {data['env']['device']} "
                 f"({data['env']['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
