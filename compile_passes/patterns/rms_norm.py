"""RMSNorm spellings -> flash.rms_norm / flash.add_rms_norm.

Anchors: `rsqrt(mean(x^2, -1, keepdim=True) + eps)` (hand-written: LLaMA, Gemma, T5,
Mistral, Qwen2 ...) and `aten.rms_norm` (F.rms_norm, nn.RMSNorm). From the rsqrt the
walk goes down through `x * rsqrt` (T5: the statistics of x.float() scale the half x),
optional casts and the weight product, deciding the dtype rule (cast before the weight:
LLaMA, T5; product in fp32: Gemma) and the weight offset ((1 + w): Gemma). Then a norm
whose input is `a + b` of equal shapes and dtypes (or a reshape of it) becomes
add_rms_norm, the sum's other users reading its residual output.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..graph import (A, cast_dtype, dtype_of, is_op, last_dim, number, only_user, other_operand,
                     split_const, strip_casts, val)
from ..report import Report
from ._shared import Unmatched, rewrite_norms, same_value

FLASH = torch.ops.flash
HALF = (torch.float16, torch.bfloat16)


@dataclass
class Match:
    x: fx.Node
    weight: fx.Node | None
    eps: float
    weight_offset: float
    cast_before_weight: bool
    out: fx.Node  # the node whose value the fused op replaces


def _weight(node) -> tuple[fx.Node | None, float]:
    """(w, offset) for w, w.float(), 1 + w, (1 + w).float(), ...; (None, 0) otherwise."""
    base = strip_casts(node)
    offset = 0.0
    if is_op(base, A.add.Tensor):
        base, c = split_const(base)
        if base is None:
            return None, 0.0
        offset = c
        base = strip_casts(base)
    v = val(base)
    if isinstance(v, torch.Tensor) and v.dim() == 1:
        return base, offset
    return None, 0.0


def _match(rsqrt: fx.Node) -> Match | Unmatched:
    add = rsqrt.args[0]
    if not is_op(add, A.add.Tensor, A.add.Scalar):
        return Unmatched("rsqrt input is not mean(x^2) + eps")
    mean, eps = split_const(add)
    if not is_op(mean, A.mean.dim) or eps is None:
        return Unmatched("rsqrt input is not mean(x^2) + eps with a constant eps")
    sq = mean.args[0]
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if is_op(sq, A.pow.Tensor_Scalar) and number(sq.args[1]) == 2.0:
        xs = sq.args[0]
    elif is_op(sq, A.mul.Tensor) and sq.args[0] is sq.args[1]:
        xs = sq.args[0]
    else:
        return Unmatched("the mean is not over x^2")
    if not keepdim or not last_dim(mean.args[1], val(xs).dim()):
        return Unmatched("the mean is not over the last dimension with keepdim=True")
    upcast = cast_dtype(xs) == torch.float32 and dtype_of(xs.args[0]) in HALF
    norm = only_user(rsqrt)
    scaled = other_operand(norm, rsqrt) if is_op(norm, A.mul.Tensor) else None
    # T5 takes the statistics of x.float() but scales the half x itself (promoted to fp32:
    # the same product)
    if not (same_value(scaled, xs) or upcast and scaled is xs.args[0]):
        return Unmatched("rsqrt(...) is not multiplied by the same x (or is used elsewhere)")
    x = xs.args[0] if upcast else xs  # the op computes half inputs in fp32 itself
    x_dtype = dtype_of(x)

    out, weight, offset, cast_before = norm, None, 0.0, True
    nxt = only_user(out)
    if nxt is not None and cast_dtype(nxt) == x_dtype and x is not xs:
        out, nxt = nxt, only_user(nxt)  # LLaMA: cast back, then the weight
        if is_op(nxt, A.mul.Tensor):
            weight, offset = _weight(other_operand(nxt, out))
            if weight is not None:
                out = nxt
    elif is_op(nxt, A.mul.Tensor):
        weight, offset = _weight(other_operand(nxt, out))
        if weight is not None:  # Gemma: weight product in fp32, then cast back
            out, cast_before = nxt, False
            after = only_user(out)
            if after is not None and cast_dtype(after) == x_dtype:
                out = after
            elif dtype_of(out) != x_dtype:
                x = xs  # the model keeps the fp32 result: normalise the fp32 tensor
    if weight is not None and val(weight).shape[0] != val(x).shape[-1]:
        return Unmatched("the weight does not match the hidden size")
    return Match(x, weight, eps, offset, cast_before, out)


def _match_aten(n: fx.Node) -> Match | Unmatched:
    x, shape = n.args[0], n.args[1]
    weight = n.args[2] if len(n.args) > 2 else n.kwargs.get("weight")
    eps = n.args[3] if len(n.args) > 3 else n.kwargs.get("eps")
    if len(shape) != 1:
        return Unmatched("normalized_shape covers more than the last dimension")
    if weight is not None and dtype_of(weight) != dtype_of(x):
        return Unmatched("weight dtype differs from the input's")
    if eps is None:
        eps = torch.finfo(dtype_of(x)).eps
    elif number(eps) is None:
        return Unmatched("eps is not a constant (dynamic float); compile with specialize_float")
    return Match(x, weight, float(eps), 0.0, False, n)


def rewrite(gm: fx.GraphModule, report: Report) -> None:
    anchors = [(n, "rsqrt", _match) for n in gm.graph.find_nodes(op="call_function", target=A.rsqrt.default)]
    anchors += [(n, "F.rms_norm", _match_aten)
                for n in gm.graph.find_nodes(op="call_function", target=A.rms_norm.default)]
    rewrite_norms(gm, report, anchors, "rms_norm", "add_rms_norm", "RMSNorm", "F.rms_norm",
                  lambda m: ((m.x, m.weight, m.eps), {"weight_offset": m.weight_offset,
                                                      "cast_before_weight": m.cast_before_weight}))
