"""lm-head matmul + cross-entropy, bf16: `python -m torch_flash.bench linear_cross_entropy`.

Implementations: ours (torch_flash.linear_cross_entropy, the public op: its autograd forward
computes the gradients too and the backward hands them out, so fwd+bwd is timed like the others,
the forward with a graph then torch.autograd.grad; "fwd" runs the op without grad, which skips
the gradients), ours under torch.compile (as the flash backend runs it; GPU only), eager
F.linear then F.cross_entropy on the logits upcast to fp32 (HF), torch.compile of it, and
Liger-Kernel's LigerFusedLinearCrossEntropyFunction where installed.
"fwd+bwd, frozen lm-head" differentiates for the hidden states alone, as LoRA training does.
No bias, mean reduction, upstream gradient 1. Compute-bound: ms and peak memory only (peak_mb:
beyond what existed before the call, the gradients included). Rows: {op, shape, pass, impl, ms,
tbps (None), peak_mb}.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._library.triton import set_wrap_triton_enabled

from ._common import compile_fresh
from .cross_entropy import measure, no_grad, plot_rows, with_grad

# (tokens, hidden, vocabulary): LLaMA-3 8B's lm-head, then 70B's, whose 8192 tokens all fit
# in dweight's memory (kernels/triton/cross_entropy.py, _resident_chunk), then GPT-2 small's (a
# small hidden size, a vocabulary not divisible by 16)
SHAPES = [(8192, 4096, 128256), (8192, 8192, 128256), (8192, 768, 50257)]
QUICK = [(2048, 2048, 32000)]
CPU_SHAPES = [(8, 32, 256)]  # smoke run under TRITON_INTERPRET=1


def _eager(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def _liger():
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except ImportError:
        return None
    return lambda h, w, t: LigerFusedLinearCrossEntropyFunction.apply(h, w, t)[0]


def _traced(fn):
    """fn with wrap_triton's tracing hook on (bench.__main__ turns it off for the launchers):
    torch.compile traces the inference op's kernels through it."""
    def call(*args):
        with set_wrap_triton_enabled(True):
            return fn(*args)
    return call


def run(args) -> list[dict]:
    from ..kernels.triton.cross_entropy import lce_plan
    from ..ops.linear_cross_entropy import linear_cross_entropy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = CPU_SHAPES if device == "cpu" else (QUICK if args.quick else SHAPES)
    liger = _liger()
    rows: list[dict] = []
    for n, hid, v in shapes:
        compiled, ours_compiled = compile_fresh(_eager, linear_cross_entropy)
        ours = {"ours": linear_cross_entropy}
        if device == "cuda":  # under the Triton interpreter torch.compile cannot trace the kernels
            ours["ours, compiled"] = _traced(ours_compiled)
        h = torch.randn(n, hid, device=device, dtype=torch.bfloat16)
        w = torch.randn(v, hid, device=device, dtype=torch.bfloat16) * hid**-0.5
        t = torch.randint(0, v, (n,), device=device)
        labels = dict(op="linear_cross_entropy", shape=[n, hid, v])
        ref = _eager(h, w, t).item()
        got = linear_cross_entropy(h, w, t).item()
        resident, chunk_rows = lce_plan(n, v, hid, h.dtype)
        rest = f"then {chunk_rows}-token chunks" if resident < n else "no other chunk"
        print(f"{n}x{hid}x{v}: with dweight {resident} tokens resident (in it and the chunk buffer), {rest}; "
              f"loss ours {got:.6f}, eager {ref:.6f}")
        fwd = {**{k: no_grad(f, h, w, t) for k, f in ours.items()},
               "eager": no_grad(_eager, h, w, t), "compile": no_grad(compiled, h, w, t),
               "liger": None if liger is None else no_grad(liger, h, w, t)}
        measure(rows, fwd, None, **labels, **{"pass": "fwd"})
        for pass_, frozen in (("fwd+bwd", ()), ("fwd+bwd, frozen lm-head", (1,))):
            impls = {**ours, "eager": _eager, "compile": compiled, "liger": liger}
            measure(rows, {k: None if f is None else with_grad(f, h, w, t, frozen=frozen) for k, f in impls.items()},
                    None, **labels, **{"pass": pass_})
    return rows


def plot(data: dict, path: str) -> None:
    plot_rows(data, path, "ms", "ms (lower is better)")
