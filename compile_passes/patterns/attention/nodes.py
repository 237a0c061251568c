"""Reading graph nodes for the attention walk: the functional op a node computes (in-place
and Scalar overloads as their functional Tensor forms), static shapes, views that merge
(B, H) into B*H, ops that only copy, and the Python numbers that ints, SymInts and one-value
tensors filled by the graph stand for. Every other module of the family reads nodes through
these."""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ...graph import LIFTED_VALUE, A, cast_dtype, is_op, number, val
from .._shared import known_equal

# A hidden score at or below this weighs nothing next to any visible score above -9900.
MASKED = -1.0e4
# In-place steps (`s /= c`, `s.masked_fill_(m, v)`) read as their functional forms.
FUNCTIONAL = {A.add_.Tensor: A.add.Tensor, A.sub_.Tensor: A.sub.Tensor, A.mul_.Tensor: A.mul.Tensor,
              A.div_.Tensor: A.div.Tensor, A.masked_fill_.Scalar: A.masked_fill.Scalar,
              A.masked_fill_.Tensor: A.masked_fill.Tensor}
# The Scalar overloads (math SDPA's `q * sqrt(scale)`) read as the Tensor ones.
SCALAR = {A.mul.Scalar: A.mul.Tensor, A.div.Scalar: A.div.Tensor}
VIEWS = (A.view.default, A.reshape.default, A._unsafe_view.default)
SAME = (A.clone.default, A.contiguous.default, A.alias.default, A.detach.default)
WHERE = (A.where.self, A.where.ScalarOther, A.where.ScalarSelf, A.where.Scalar)
MASKED_FILL = (A.masked_fill.Scalar, A.masked_fill.Tensor)


def op_kind(node: Any):
    """The functional op a node computes (in-place ops as their out-of-place forms)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"):
        return None
    return FUNCTIONAL.get(node.target) or SCALAR.get(node.target, node.target)


def shape_of(node: Any) -> tuple:
    return tuple(val(node).shape)


def same_shape(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(known_equal(x, y) for x, y in zip(a, b))


def concrete(x: Any) -> int | None:
    """x as a Python int when it is one (a SymInt whose expression is a constant included)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        return x.node.maybe_as_int()
    return None


def int_arg(x: Any) -> Any:
    """An int or SymInt argument (a node computing a size included), else None."""
    if isinstance(x, fx.Node):
        x = val(x)
    return x if isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool) else None


def constant(x: Any) -> float | None:
    """x as a Python number: a number, or a one-element tensor the graph fills with one
    (torch.full([], c), scalar_tensor, zeros/ones) or holds as a constant (`torch.tensor(0.0)`
    in the model, as transformers' eager mask up to 5.17 writes it: an attribute of a traced
    module, an input that export lifted), through casts."""
    n = number(x)
    if n is not None or not isinstance(x, fx.Node):
        return n
    if x.op == "get_attr":
        return _held_constant(x)
    if x.op == "placeholder":
        return number(x.meta.get(LIFTED_VALUE))
    v = val(x)
    if isinstance(v, (torch.SymInt, torch.SymFloat)):
        return number(v.node.maybe_as_int() if isinstance(v, torch.SymInt) else v.node.maybe_as_float())
    if not isinstance(v, torch.Tensor) or v.numel() != 1:
        return None
    if is_op(x, A.full.default, A.new_full.default, A.full_like.default):
        return number(x.args[1 if is_op(x, A.full.default, A.full_like.default) else 2])
    if is_op(x, A.scalar_tensor.default):
        return number(x.args[0])
    if is_op(x, A.zeros.default, A.zeros_like.default, A.new_zeros.default):
        return 0.0
    if is_op(x, A.ones.default, A.ones_like.default, A.new_ones.default):
        return 1.0
    # make_fx reads a tensor constant as lift_fresh_copy(get_attr), then detach_ (torch.tensor)
    if cast_dtype(x) is not None or is_op(x, *SAME, A.lift_fresh_copy.default, A.detach_.default, A.to.device):
        return constant(x.args[0])
    return None


def _held_constant(node: fx.Node) -> float | None:
    """The value of a one-element tensor constant the traced module holds (get_attr), read off
    the real tensor (a fake one has none). Only make_fx's `_tensor_constant<i>`, a tensor the
    model made while traced: a parameter or buffer keeps its own name, and may change later."""
    from torch._subclasses.fake_tensor import is_fake

    if not str(node.target).startswith("_tensor_constant"):
        return None
    module = node.graph.owning_module
    try:
        t = operator.attrgetter(node.target)(module)
    except AttributeError:
        return None
    if (not isinstance(t, torch.Tensor) or t.numel() != 1 or t.requires_grad or is_fake(t)
            or t.device.type == "meta"):
        return None
    return number(t.item())


def merges(src: Any, view: fx.Node) -> bool:
    """view is src (B, H, X, Y) viewed as (B*H, X, Y)."""
    a, b = shape_of(src), shape_of(view)
    return len(a) == 4 and len(b) == 3 and known_equal(a[0] * a[1], b[0]) and same_shape(a[2:], b[1:])


def copies(node: Any) -> bool:
    """node is a copy of its input, values and shape alike: clone, contiguous, or an expand to
    the input's own shape (core ATen's matmul expands both operands to the broadcast shape)."""
    if is_op(node, A.clone.default, A.contiguous.default):
        return True
    return is_op(node, A.expand.default) and same_shape(shape_of(node), shape_of(node.args[0]))


def target_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def evaluated(node: fx.Node, max_elements: int) -> torch.Tensor | None:
    """node's value, computed now, when it depends on no graph input or attribute, only on
    deterministic aten ops with concrete arguments (then it is the same in every call); else
    None, as for any failure to evaluate it."""
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(n: fx.Node) -> bool:
        if n in seen:
            return True
        seen.add(n)
        if (n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload)
                or torch.Tag.nondeterministic_seeded in n.target.tags):
            return False
        if not all(visit(a) for a in n.all_input_nodes):
            return False
        order.append(n)
        return True

    if not visit(node):
        return None
    env: dict[fx.Node, Any] = {}
    try:
        with torch.utils._python_dispatch._disable_current_modes():
            for n in order:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
                if any(isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))
                       for x in torch.utils._pytree.tree_leaves((args, kwargs))):
                    return None
                env[n] = out = n.target(*args, **kwargs)
                if isinstance(out, torch.Tensor) and out.numel() > max_elements:
                    return None
    except Exception:
        return None
    out = env[node]
    return out if isinstance(out, torch.Tensor) else None
