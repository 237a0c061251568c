"""RMSNorm and LayerNorm, alone and with the fused residual add, forward and backward, bf16:
`python -m torch_flash.bench norm`.

Implementations: ours (the flash ops as the public functions call them, so that the eager rows
carry the host cost users see: _ours), eager (F.rms_norm / F.layer_norm after the add),
torch.compile of the naive model code (on CPU, a smoke run, with backend="aot_eager"),
Liger-Kernel and quack where installed (neither has a fused-residual LayerNorm; quack's
LayerNorm has no autograd: its forward and backward functions are timed). Widths 64 to 65536
at 2^27 elements (2^26 at 16384). Bytes moved = each input read once + each output written
once; GB/s is set against a device copy of the same byte count timed in the same run (the
ceiling). On a GPU every pass is timed twice: "eager" (calls back to back, the host's launch
cost included) and "graph" (CUDA graph replay: the kernels alone).
Rows: {op, shape, pass, timing, impl, ms, gbps, frac_of_copy}.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..testing.llama import rms_norm as _naive_rms  # HF LlamaRMSNorm
from ._common import (compile_fresh, copy_bandwidth, median_or_none, optional_peer, over_retained_graphs,
                      per_stream, pick, report_unavailable, time_rounds, within_budget)

SHAPES = [(1 << 21, 64), (1 << 19, 256), (65536, 1024), (32768, 4096), (16384, 8192), (4096, 16384),
          (2048, 65536)]
QUICK = [(4096, 1024)]
CPU_SHAPES = [(8, 256)]  # smoke run under TRITON_INTERPRET=1
EPS = 1e-6
# eager: calls back to back (host cost included); graph: CUDA graph replay (the kernels alone)
TIMINGS = {"cuda": ("eager", "graph"), "cpu": ("eager",)}


def time_impls(rows: list[dict], impls: dict[str, Callable[[], object] | None], nbytes: int, device: str,
               graph: bool = False, **labels) -> None:
    """Time each impl (None: not available; interleaved rounds, median ms), append one row per
    impl plus the copy ceiling; graph: replay CUDA graphs (median_ms)."""
    ceiling = copy_bandwidth(nbytes, device)
    where = " ".join(str(v) for v in labels.values())
    print(f"{where}: copy {ceiling / 1e9:.0f} GB/s for {nbytes / 1e6:.1f} MB")
    times = time_rounds({impl: fn for impl, fn in impls.items() if fn is not None}, graph=graph)
    for impl, fn in impls.items():
        ms = median_or_none(times.get(impl))
        gbps = None if ms is None else nbytes / (ms * 1e-3) / 1e9
        rows.append({**labels, "impl": impl, "ms": ms, "gbps": gbps,
                     "frac_of_copy": None if gbps is None else gbps * 1e9 / ceiling})
        if ms is not None:
            print(f"  {impl:>12}: {ms:8.4f} ms {gbps:7.0f} GB/s  {gbps * 1e9 / ceiling:5.2f} of copy")
    rows.append({**labels, "impl": "copy", "ms": nbytes / ceiling * 1e3, "gbps": ceiling / 1e9,
                 "frac_of_copy": 1.0})


def plot_bars(data: dict, path: str, panel_keys: tuple[str, ...]) -> None:
    """Grouped bars of frac_of_copy: one panel per value of panel_keys, shapes on the x axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if r["impl"] != "copy"]
    panel_keys = tuple(k for k in panel_keys if any(k in r for r in rows))  # older runs: no timing
    panels = list(dict.fromkeys(tuple(r[k] for k in panel_keys) for r in rows))  # in run order
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    cols = min(len(panels), 4)
    grid_rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(grid_rows, cols, figsize=(4.5 * cols, 4 * grid_rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        sub = [r for r in rows if tuple(r[k] for k in panel_keys) == panel]
        shapes = list(dict.fromkeys(str(tuple(r["shape"])) for r in sub))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            vals = {str(tuple(r["shape"])): r["frac_of_copy"] or 0.0 for r in sub if r["impl"] == impl}
            ax.bar([j + i * width for j in range(len(shapes))], [vals.get(s, 0.0) for s in shapes], width,
                   label=impl)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, fontsize=8, rotation=30, ha="right")
        ax.set_title(" ".join(map(str, panel)))
        ax.set_ylabel("fraction of copy bandwidth")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{data['suite']} on {data['env']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _naive_ln(x, w, b, eps: float = EPS):
    h = x.float()
    hc = h - h.mean(-1, keepdim=True)
    return (hc * torch.rsqrt(hc.pow(2).mean(-1, keepdim=True) + eps) * w.float() + b.float()).to(x.dtype)


def _with_residual(norm):
    """norm(x, w, b) as f(x, r, w, b): with a residual r, the decoder layer's
    `residual = x + residual; x = norm(residual)`, returning (y, residual)."""
    def f(x, r, w, b):
        if r is None:
            return norm(x, w, b)
        h = x + r
        return norm(h, w, b), h
    return f


def _naive(is_rms: bool):
    return _with_residual((lambda x, w, b: _naive_rms(x, w, EPS)) if is_rms else _naive_ln)


def _eager(is_rms: bool):
    return _with_residual((lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, EPS)) if is_rms
                          else (lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS)))


def _liger(is_rms: bool, residual: bool):
    """Liger-Kernel's function for this norm as f(x, r, w, b), None where it has none (no fused
    residual LayerNorm) or is not installed."""
    try:
        if is_rms and residual:
            from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
            return lambda x, r, w, b: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "llama", False)
        if is_rms:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
            return lambda x, r, w, b: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)
        if not residual:
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction
            return lambda x, r, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)
    except ImportError:
        pass
    return None


def _quack(is_rms: bool, residual: bool, inputs: list, grads):
    """quack's (forward, backward) for this norm, None where it has none (fused-residual
    LayerNorm) or is not importable. Its LayerNorm is two functions without autograd (fp32
    weight and bias), timed as such; its RMSNorm an autograd function, as autograd_pair times it."""
    if is_rms:
        rmsnorm = optional_peer("quack", "rmsnorm")
        if rmsnorm is None:
            return None
        return autograd_pair(lambda x, r, w, b: rmsnorm(x, w, residual=r, eps=EPS, prenorm=residual), inputs, grads)
    fwd, bwd = optional_peer("quack.rmsnorm", "layernorm_fwd"), optional_peer("quack.rmsnorm", "layernorm_bwd")
    if residual or fwd is None or bwd is None:
        return None
    x, _, w, b = inputs
    w32, b32 = w.float(), b.float()
    try:  # the statistics its backward reads
        _, rstd, mean = fwd(x, w32, b32, EPS, return_rstd=True, return_mean=True)
    except Exception as e:  # e.g. no GPU it supports
        report_unavailable("quack", e)
        return None
    return (lambda: fwd(x, w32, b32, EPS), lambda: bwd(x, w32, grads, rstd, mean))


def autograd_pair(f, inputs: list, grads):
    """(forward without a graph, backward through one recorded forward) of a differentiable f
    of `inputs` (None entries pass through); grads matches f's output(s). The forward and its
    leaves are recorded once per stream (per_stream says why)."""
    def record():
        leaves = [None if t is None else t.detach().requires_grad_() for t in inputs]
        return f(*leaves), [t for t in leaves if t is not None]

    recorded = per_stream(record)

    def fwd():
        with torch.no_grad():
            return f(*inputs)

    def bwd():
        out, leaves = recorded()
        return torch.autograd.grad(out, leaves, grads, retain_graph=True)

    return fwd, bwd


# (op, RMSNorm?, fused residual?)
OPS = (("rms_norm", True, False), ("layer_norm", False, False),
       ("add_rms_norm", True, True), ("add_layer_norm", False, True))


def _ours(op: str, x, r, w, b, g, g_res) -> tuple[Callable, Callable]:
    """(forward, backward) of flash.<op> as the public functions call the ops (the compiled fast
    path where built): the forward as inference runs it, the backward op as autograd runs it,
    on the normalised tensor (x + r with a residual), LayerNorm's from the saved mean / rstd."""
    from ..ops._autograd import call
    if op == "rms_norm":
        return (lambda: call("rms_norm", x, w, EPS),
                lambda: call("rms_norm_backward", g, x, w, EPS, 0.0, True))
    if op == "add_rms_norm":
        h = call("add_rms_norm", x, r, w, EPS)[1]
        return (lambda: call("add_rms_norm", x, r, w, EPS),
                lambda: call("add_rms_norm_backward", g, g_res, h, w, EPS, 0.0, True, x.dtype))
    if op == "layer_norm":
        _, mean, rstd = call("layer_norm_with_stats", x, w, b, EPS)
        return (lambda: call("layer_norm", x, w, b, EPS),
                lambda: call("layer_norm_backward", g, x, w, b, EPS, 0.0, mean, rstd))
    _, h, mean, rstd = call("add_layer_norm_with_stats", x, r, w, b, EPS)
    return (lambda: call("add_layer_norm", x, r, w, b, EPS),
            lambda: call("add_layer_norm_backward", g, g_res, h, w, b, EPS, 0.0, mean, rstd))


def _pick_ops(spec: str | None) -> tuple:
    """The OPS named in spec (comma-separated; None: all): a GPU call of at most 10 minutes
    fits about two of them."""
    if not spec:
        return OPS
    names = pick("norm", spec, [op[0] for op in OPS], "op")
    return tuple(op for op in OPS if op[0] in names)


def _compile_baseline(fn: Callable, device: str) -> Callable:
    """torch.compile of fn as compile_fresh gives it; on CPU (a smoke run, its times no
    measurement) with backend="aot_eager": Inductor's cold C++ builds took 46 of the run's 65 s."""
    if device != "cpu":
        return compile_fresh(fn)
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager")


@over_retained_graphs
def run(args) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = CPU_SHAPES if device == "cpu" else (QUICK if args.quick else SHAPES)
    rows: list[dict] = []
    for (op, is_rms, residual), shape in within_budget(
            "norm", args, [(op, shape) for op in _pick_ops(getattr(args, "configs", None)) for shape in shapes]):
        liger = _liger(is_rms, residual)
        compiled = _compile_baseline(_naive(is_rms), device)
        m, n = shape
        x = torch.randn(shape, device=device, dtype=torch.bfloat16)
        r = torch.randn_like(x) if residual else None
        w = torch.randn(n, device=device, dtype=torch.bfloat16)
        b = None if is_rms else torch.randn(n, device=device, dtype=torch.bfloat16)
        g = torch.randn_like(x)
        grads = (g, torch.randn_like(x)) if residual else g
        inputs = [x, r, w, b]
        pairs = {"eager": autograd_pair(_eager(is_rms), inputs, grads),
                 "compile": autograd_pair(compiled, inputs, grads),
                 "liger": None if liger is None else autograd_pair(liger, inputs, grads),
                 "quack": _quack(is_rms, residual, inputs, grads)}
        ours = _ours(op, x, r, w, b, g, grads[1] if residual else None)
        params = 1 if is_rms else 2  # weight (and bias) vectors
        e = x.element_size()
        tensors = 2 if residual else 1  # x (and residual): in, y (and residual out): out
        fwd_bytes = 2 * tensors * m * n * e + params * n * e
        bwd_bytes = (3 + residual) * m * n * e + (1 + params) * n * e  # dy (, dresidual), x: in; dx: out
        for pass_, i, nbytes in (("forward", 0, fwd_bytes), ("backward", 1, bwd_bytes)):
            impls = {"ours": ours[i], **{k: None if p is None else p[i] for k, p in pairs.items()}}
            for timing in TIMINGS[device]:
                time_impls(rows, impls, nbytes, device, graph=timing == "graph", op=op, shape=list(shape),
                           timing=timing, **{"pass": pass_})
    return rows


def plot(data: dict, path: str) -> None:
    plot_bars(data, path, ("op", "pass", "timing"))
