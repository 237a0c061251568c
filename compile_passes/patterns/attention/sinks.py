"""Attention sinks as models write them (gpt-oss's eager attention): one more column per head
joined to the scores before the softmax and sliced off its result,

    col = sinks.reshape(1, -1, 1, 1).expand(B, -1, Sq, -1)          # (B, H, Sq, 1)
    p = softmax(cat([s, col], -1) - rowmax, -1)[..., :-1]           # rowmax optional

which is flash.attention's `sinks` (H,). A row-max subtraction before any softmax changes
nothing (softmax is shift invariant) and is read away wherever it appears."""
from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from ...graph import A, cast_dtype, is_op, last_dim, number, only_user, val
from .._shared import Unmatched, arg
from .nodes import VIEWS, concrete, same_shape, shape_of
from .operands import Operand


def row_max_shift(x: Any) -> tuple[Any, list[fx.Node]]:
    """(y, the nodes) where x = y - max(y, -1, keepdim) (max.dim's values or amax), else (x, [])."""
    if not (is_op(x, A.sub.Tensor) and not x.kwargs):
        return x, []
    y, top = x.args[:2]
    nodes = [x, top]
    if is_op(top, A.amax.default):
        ok = top.args[0] is y and arg(top, "keepdim") and last_dim(top.args[1], val(y).dim())
    elif is_op(top, operator.getitem) and top.args[1] == 0 and is_op(top.args[0], A.max.dim):
        mx = top.args[0]
        nodes.append(mx)
        ok = mx.args[0] is y and arg(mx, "keepdim") and last_dim(mx.args[1], val(y).dim())
    else:
        ok = False
    return (y, nodes) if ok else (x, [])


def _uncast(n: Any, nodes: list) -> Any:
    """n's input before any casts, the casts appended to nodes."""
    while cast_dtype(n) is not None:
        nodes.append(n)
        n = n.args[0]
    return n


def _per_head(col: Any, shape: tuple) -> tuple[Operand, list[fx.Node]] | Unmatched:
    """The (H,) tensor a (B, H, Sq, 1) column repeats: expand(view(t, [1, H, 1, 1])), casts
    allowed around the view."""
    if not is_op(col, A.expand.default):
        return Unmatched("the column joined to the scores is not a per-head value expanded over the rows")
    nodes = [col]
    cur = _uncast(col.args[0], nodes)
    if not (is_op(cur, *VIEWS, A.unsqueeze.default) and same_shape(shape_of(cur), (1, shape[1], 1, 1))):
        return Unmatched("the column joined to the scores is not one value per head")
    nodes.append(cur)
    src = _uncast(cur.args[0], nodes)
    if not (isinstance(src, fx.Node) and val(src).dim() == 1 and same_shape(shape_of(src), (shape[1],))):
        return Unmatched("the column joined to the scores does not come from a (heads,) tensor")
    return Operand(src), nodes


def sink_column(x: Any) -> tuple[Any, Operand, list[fx.Node]] | Unmatched | None:
    """(the scores, the sinks (H,), the nodes) where x = cat([scores, per-head column], -1),
    None where x is no cat."""
    if not is_op(x, A.cat.default):
        return None
    parts, dim = x.args[0], arg(x, "dim", 0)
    shape = shape_of(x)
    if len(shape) != 4 or not last_dim(dim, 4) or len(parts) != 2:
        return Unmatched("the scores are joined to more than one column per head before the softmax")
    s, col = parts
    if concrete(shape_of(col)[-1]) != 1:
        return Unmatched("a tensor joined to the scores before the softmax is not one column (a sink) last")
    found = _per_head(col, shape)
    if isinstance(found, Unmatched):
        return found
    return s, found[0], [x, *found[1]]


def sliced_off(p: fx.Node, keys: Any) -> fx.Node | Unmatched:
    """The slice p[..., :keys] that drops the sink column off the probabilities p."""
    cut = only_user(p)
    if not (is_op(cut, A.slice.Tensor) and last_dim(arg(cut, "dim", 0), val(p).dim())
            and number(arg(cut, "start") or 0) == 0 and arg(cut, "step", 1) == 1):
        return Unmatched("the probabilities keep the sink column (no slice [..., :-1] after the softmax)")
    end = concrete(arg(cut, "end"))
    if end is None or not (end == -1 or end == concrete(keys)):
        return Unmatched("the slice after the softmax does not drop exactly the sink column")
    return cut
