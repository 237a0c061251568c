"""LayerNorm spellings -> flash.layer_norm / flash.add_layer_norm.

Anchors: `aten.layer_norm` (F.layer_norm, nn.LayerNorm) and the root of a hand-written
variance: `rsqrt(var + eps)` multiplying, or `sqrt(var + eps)` dividing, `x - x.mean(-1,
keepdim=True)`, where var is `x.var(-1, keepdim=True, unbiased=False)`, `torch.var_mean(...)[0]`
or `((x - mean) ** 2).mean(-1, keepdim=True)`. From the normalised value the walk goes down
through the weight product and the bias sum (1-D tensors of the hidden size that keep the
dtype), as far as each step holds. An fp32 upcast of a half x is looked through when the
result comes back to x's dtype (the op computes in fp32 itself). A norm whose input is
`a + b` then becomes add_layer_norm, as for RMSNorm. Roots of anything but a centred
variance are RMSNorm's business and are not reported here, so this family runs before it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..graph import A, cast_dtype, dtype_of, is_op, last_dim, number, only_user, other_operand, val
from ..report import Report
from ._shared import Unmatched, arg, known_equal, rewrite_norms, same_value

FLASH = torch.ops.flash
HALF = (torch.float16, torch.bfloat16)
VARIANCE = (A.var.dim, A.var.correction)
VAR_MEAN = (A.var_mean.dim, A.var_mean.correction)
# the anchors of hand-written LayerNorm: root -> (name, how it meets x - mean)
ROOTS = {A.rsqrt.default: ("rsqrt", "multiply"), A.sqrt.default: ("sqrt", "divide")}


@dataclass
class Match:
    x: fx.Node
    weight: fx.Node | None
    bias: fx.Node | None
    eps: float
    out: fx.Node  # the node whose value the fused op replaces


def _last_dim_keepdim(node: fx.Node, dims) -> bool:
    return bool(arg(node, "keepdim", False)) and dims is not None and last_dim(dims, val(node.args[0]).dim())


def _centered(node) -> fx.Node | None:
    """x for `x - x.mean(-1, keepdim=True)`."""
    if not is_op(node, A.sub.Tensor) or node.kwargs.get("alpha", 1) != 1:
        return None
    x, mean = node.args[:2]
    if is_op(mean, A.mean.dim) and same_value(mean.args[0], x) and _last_dim_keepdim(mean, mean.args[1]):
        return x
    return None


def _variance(v) -> tuple[fx.Node, Unmatched | None] | None:
    """(x, problem) when v is a variance of x over the last dim (problem: why it is not
    LayerNorm's, None if none); None when v is no centred variance at all."""
    if is_op(v, operator.getitem) and v.args[1] == 0 and is_op(v.args[0], *VAR_MEAN):
        v = v.args[0]
    if is_op(v, *VARIANCE, *VAR_MEAN):
        if v.target in (A.var.dim, A.var_mean.dim):
            biased = arg(v, "unbiased", True) is False
        else:
            biased = number(arg(v, "correction", 1)) == 0.0
        if not _last_dim_keepdim(v, arg(v, "dim")):
            return v.args[0], Unmatched("the variance is not over the last dimension with keepdim=True")
        if not biased:
            return v.args[0], Unmatched("the variance is unbiased (x.var() defaults to unbiased=True); "
                                        "LayerNorm uses unbiased=False")
        return v.args[0], None
    if not is_op(v, A.mean.dim):
        return None
    sq = v.args[0]
    if is_op(sq, A.pow.Tensor_Scalar) and number(sq.args[1]) == 2.0 or is_op(sq, A.square.default):
        x = _centered(sq.args[0])
    elif is_op(sq, A.mul.Tensor) and same_value(sq.args[0], sq.args[1]):
        x = _centered(sq.args[0])
    else:
        return None
    if x is None:
        return None
    if not _last_dim_keepdim(v, v.args[1]):
        return x, Unmatched("the variance is not over the last dimension with keepdim=True")
    return x, None


def _param(node, hidden) -> bool:
    """node can serve as weight or bias: a float 1-D tensor of the hidden size."""
    v = val(node)
    return (isinstance(v, torch.Tensor) and v.dim() == 1 and v.dtype.is_floating_point
            and known_equal(v.shape[0], hidden))


def _affine(out: fx.Node) -> tuple[fx.Node, fx.Node | None, fx.Node | None]:
    """(out, weight, bias) after absorbing `* weight` then `+ bias` that keep out's dtype."""
    hidden, weight, bias = val(out).shape[-1], None, None
    nxt = only_user(out)
    if is_op(nxt, A.mul.Tensor) and dtype_of(nxt) == dtype_of(out) and _param(other_operand(nxt, out), hidden):
        weight, out, nxt = other_operand(nxt, out), nxt, only_user(nxt)
    if (is_op(nxt, A.add.Tensor) and nxt.kwargs.get("alpha", 1) == 1 and dtype_of(nxt) == dtype_of(out)
            and _param(other_operand(nxt, out), hidden)):
        bias, out = other_operand(nxt, out), nxt
    return out, weight, bias


def _finish(x: fx.Node, out: fx.Node, weight, bias, eps: float, affine: bool) -> Match:
    """Look through an fp32 upcast of a half x whose result returns to x's dtype (before or
    after the affine part, absorbed here when affine is set)."""
    x0 = x.args[0] if cast_dtype(x) == torch.float32 and dtype_of(x.args[0]) in HALF else None

    def cast_back(n: fx.Node) -> fx.Node:
        nxt = only_user(n)
        if x0 is not None and dtype_of(n) != dtype_of(x0) and cast_dtype(nxt) == dtype_of(x0):
            return nxt
        return n

    out = cast_back(out)
    if affine:
        out, weight, bias = _affine(out)
        out = cast_back(out)
    if x0 is not None and dtype_of(out) == dtype_of(x0):
        x = x0
    return Match(x, weight, bias, eps, out)


def _match_root(root: fx.Node) -> Match | Unmatched | None:
    """From rsqrt(var + eps) or sqrt(var + eps); None when var is not a centred variance."""
    inner, eps = root.args[0], 0.0
    if is_op(inner, A.add.Tensor, A.add.Scalar):
        a, b = inner.args[:2]
        inner, eps = (a, b) if _variance(a) is not None else (b, a)
    found = _variance(inner)
    if found is None:
        return None
    x, problem = found
    if problem:
        return problem
    if number(eps) is None:
        return Unmatched("eps is not a constant (a tensor or a dynamic float)")
    norm = only_user(root)
    name, verb = ROOTS[root.target]
    if root.target == A.rsqrt.default:
        centered = other_operand(norm, root) if is_op(norm, A.mul.Tensor) else None
    else:
        centered = norm.args[0] if is_op(norm, A.div.Tensor) and norm.args[1] is root else None
    if not same_value(_centered(centered), x):
        return Unmatched(f"{name}(var + eps) does not {verb} x - mean(x) of the same x (or is used elsewhere)")
    return _finish(x, norm, None, None, float(number(eps)), affine=True)


def _match_aten(n: fx.Node) -> Match | Unmatched:
    x, shape = n.args[0], n.args[1]
    eps = arg(n, "eps", 1e-5)
    if len(shape) != 1:
        return Unmatched("normalized_shape covers more than the last dimension")
    if number(eps) is None:
        return Unmatched("eps is not a constant (dynamic float); compile with specialize_float")
    return _finish(x, n, arg(n, "weight"), arg(n, "bias"), float(eps), affine=False)


def rewrite(gm: fx.GraphModule, report: Report) -> None:
    anchors = [(n, "F.layer_norm", _match_aten)
               for n in gm.graph.find_nodes(op="call_function", target=A.layer_norm.default)]
    anchors += [(n, name, _match_root) for root, (name, _) in ROOTS.items()
                for n in gm.graph.find_nodes(op="call_function", target=root)]
    rewrite_norms(gm, report, anchors, "layer_norm", "add_layer_norm", "LayerNorm", "F.layer_norm",
                  lambda m: ((m.x, m.weight, m.bias, m.eps), {}))
