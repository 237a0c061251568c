"""Cross-entropy over large vocabularies, bf16: `python -m torch_flash.bench cross_entropy`.

Implementations: ours (the launchers of torch_flash/kernels/triton/cross_entropy.py): "ours"
is ce_fwd then ce_bwd from the saved lse into a new dlogits, "ours-inplace" is ce_fwd writing
the gradient over the logits (Liger-style), "ours-inplace_backward" is the public
torch_flash.cross_entropy(..., inplace_backward=True) through autograd (the backward writes the
gradient over the logits: its peak_mb shows no logits-sized buffer); eager F.cross_entropy on logits upcast to fp32 (as
HF models do), torch.compile of it, and Liger-Kernel's LigerCrossEntropyFunction and quack's
cross_entropy where installed. On a GPU each pass is timed eagerly and as CUDA graph replay
(timing "graph": the kernels alone, norm.TIMINGS); peak_mb comes with the eager rows.
Bytes counted: the logits read once (forward), read twice and the gradient written once
(forward+backward), whatever an implementation really moves; TB/s is set against a device copy
timed in the same run. The backward is for an upstream gradient of 1 (loss.backward()).
peak_mb: peak allocation beyond what existed before the call, outputs included.
Rows: {op, shape, pass, timing, impl, ms, tbps, peak_mb}.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ._common import (compile_fresh, copy_bandwidth, median_or_none, optional_peer, peak_memory, per_stream,
                      time_rounds, within_budget)
from .norm import TIMINGS

# a failed capture leaks its graph's memory pool, so these are not tried (the next shapes would OOM)
NOT_CAPTURABLE = {"liger": "its forward reads the count of targets back to the host, .item()"}
SHAPES = [(8192, 128256), (4096, 256000), (32768, 32000)]  # (tokens, vocabulary)
QUICK = [(2048, 32000)]
CPU_SHAPES = [(4, 256)]  # smoke run under TRITON_INTERPRET=1
# Vocabulary blocks tried for ours (fwd+bwd) on the first shape, to check the launch rule.
BLOCK_SWEEP = (4096, 8192, 16384, 32768)
OPTIONS = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0, reduction="mean")


def measure(rows: list[dict], impls: dict[str, Callable[[], object] | None], nbytes: int | None,
            graph: bool = False, **labels) -> None:
    """Time each impl (None: not available; interleaved rounds, median ms; graph: CUDA graph
    replay) and, timed eagerly, its peak memory; append one row per impl."""
    where = " ".join(str(v) for v in labels.values())
    print(where)
    if graph:
        for impl in NOT_CAPTURABLE.keys() & {k for k, fn in impls.items() if fn is not None}:
            print(f"    {impl}: not timed in a graph ({NOT_CAPTURABLE[impl]})")
        impls = {k: None if k in NOT_CAPTURABLE else fn for k, fn in impls.items()}
    times = time_rounds({impl: fn for impl, fn in impls.items() if fn is not None}, graph=graph)
    for impl, fn in impls.items():
        ms = median_or_none(times.get(impl))
        peak = peak_memory(fn) / 2**20 if ms is not None and torch.cuda.is_available() and not graph else None
        tbps = None if ms is None or nbytes is None else nbytes / (ms * 1e-3) / 1e12
        rows.append({**labels, "impl": impl, "ms": ms, "tbps": tbps, "peak_mb": peak})
        if ms is not None:
            print(f"  {impl:>22}: {ms:9.3f} ms" + (f" {tbps:6.2f} TB/s" if tbps is not None else "")
                  + (f" peak {peak:9.1f} MB" if peak is not None else ""))


def copy_row(rows: list[dict], nbytes: int, device: str, **labels) -> None:
    """The ceiling: a device copy moving nbytes, as a row of impl "copy"."""
    bw = copy_bandwidth(nbytes, device)
    rows.append({**labels, "impl": "copy", "ms": nbytes / bw * 1e3, "tbps": bw / 1e12, "peak_mb": None})
    print(f"  {'copy':>22}: {nbytes / bw * 1e3:9.3f} ms {bw / 1e12:6.2f} TB/s")


def with_grad(f: Callable, *inputs: torch.Tensor, frozen: tuple[int, ...] = ()) -> Callable[[], object]:
    """Forward with a graph and the backward of f(*inputs)'s scalar loss (first output if a
    tuple), for the floating-point inputs but those at the positions in frozen."""
    leaves = [t.detach().requires_grad_(i not in frozen) if t.is_floating_point() else t
              for i, t in enumerate(inputs)]

    def run():
        out = f(*leaves)
        loss = out[0] if isinstance(out, tuple) else out
        return torch.autograd.grad(loss, [t for t in leaves if t.requires_grad])

    return run


def no_grad(f: Callable, *inputs: torch.Tensor) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return f(*inputs)

    return run


def plot_rows(data: dict, path: str, value: str, ylabel: str) -> None:
    """Grouped bars of `value`: one panel per pass (and timing), shapes on the x axis, one bar
    per impl (the block sweep, impl "ours[...]", is left out)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if "[" not in r["impl"] and r[value] is not None]
    rows = [{**r, "pass": " ".join(filter(None, (r["pass"], r.get("timing"))))} for r in rows]
    passes = list(dict.fromkeys(r["pass"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(1, len(passes), figsize=(5 * len(passes), 4), squeeze=False)
    for ax, pass_ in zip(axes[0], passes):
        sub = [r for r in rows if r["pass"] == pass_]
        shapes = list(dict.fromkeys(str(tuple(r["shape"])) for r in sub))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            vals = {str(tuple(r["shape"])): r[value] for r in sub if r["impl"] == impl}
            ax.bar([j + i * width for j in range(len(shapes))], [vals.get(s, 0.0) for s in shapes], width,
                   label=impl)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, fontsize=8)
        ax.set_title(f"{data['suite']} {pass_}")
        ax.set_ylabel(ylabel)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{data['suite']} on {data['env']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _eager(x, t):
    return F.cross_entropy(x.float(), t)


def _liger():
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    except ImportError:
        return None
    return lambda x, t: LigerCrossEntropyFunction.apply(x, t, None)[0]


def run(args) -> list[dict]:
    from ..kernels.triton.cross_entropy import ce_bwd, ce_fwd
    from ..ops.cross_entropy import cross_entropy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = CPU_SHAPES if device == "cpu" else (QUICK if args.quick else SHAPES)
    liger = _liger()
    quack = optional_peer("quack", "cross_entropy")
    rows: list[dict] = []
    for n, v in within_budget("cross_entropy", args, shapes):
        compiled = compile_fresh(_eager)
        x = torch.randn(n, v, device=device, dtype=torch.bfloat16) * 4
        t = torch.randint(0, v, (n,), device=device)
        one = torch.ones((), device=device)
        # Liger and ours-inplace overwrite their logits with the gradient: each gets its own copy
        x_ours, x_liger = x.clone(), x.clone()
        labels = dict(op="cross_entropy", shape=[n, v])

        def ours(block=None):
            loss, lse, _ = ce_fwd(x, t, block=block, **OPTIONS)
            return ce_bwd(one, x, t, lse, block=block, **OPTIONS)

        def ours_inplace():
            return ce_fwd(x_ours, t, grad_logits_out=x_ours, **OPTIONS)[2]

        # inplace_backward refuses leaves: the logits are an intermediate, as a model's lm-head
        # output (after the first call they hold gradients, which time the same as logits)
        source = x.clone().requires_grad_()
        logits_ib = per_stream(lambda: source * 1)

        def ours_inplace_backward():
            logits = logits_ib()
            loss = cross_entropy(logits, t, inplace_backward=True, **OPTIONS)
            return torch.autograd.grad(loss, logits)

        ref = _eager(x, t).item()
        got = ce_fwd(x, t, **OPTIONS)[0].item()
        print(f"{n}x{v}: loss ours {got:.6f}, eager fp32 {ref:.6f}")
        nbytes = x.numel() * x.element_size()
        fwd = {"ours": lambda: ce_fwd(x, t, **OPTIONS), "eager": no_grad(_eager, x, t),
               "compile": no_grad(compiled, x, t), "liger": None if liger is None else no_grad(liger, x_liger, t),
               "quack": None if quack is None else no_grad(quack, x, t)}
        for timing in TIMINGS[device]:
            measure(rows, fwd, nbytes, graph=timing == "graph", **labels, **{"pass": "fwd"}, timing=timing)
        copy_row(rows, nbytes, device, **labels, **{"pass": "fwd"})
        both = {"ours": ours, "ours-inplace": ours_inplace, "ours-inplace_backward": ours_inplace_backward,
                "eager": with_grad(_eager, x, t),
                "compile": with_grad(compiled, x, t),
                "liger": None if liger is None else with_grad(liger, x_liger, t),
                "quack": None if quack is None else with_grad(quack, x, t)}
        sweep = ({f"ours[block={b}]": (lambda b=b: ours(b)) for b in BLOCK_SWEEP}
                 if device == "cuda" and not args.quick and (n, v) == shapes[0] else {})
        for timing in TIMINGS[device]:
            measure(rows, {**both, **(sweep if timing == "eager" else {})}, 3 * nbytes, graph=timing == "graph",
                    **labels, **{"pass": "fwd+bwd"}, timing=timing)
        copy_row(rows, 3 * nbytes, device, **labels, **{"pass": "fwd+bwd"})
        del x, x_ours, x_liger, source, logits_ib
    return rows


def plot(data: dict, path: str) -> None:
    plot_rows(data, path, "tbps", "TB/s (logits bytes counted)")
