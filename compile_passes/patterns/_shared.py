"""Helpers shared by several pattern families: arguments by schema name, structural equality
of two graph values, static equality of (symbolic) sizes, shape ops that keep rows whole,
inserting a flash op only where its own checks accept the values and it computes what it
replaces, the residual-add fusion of the norm families, and Unmatched, what every family's
matching returns where a site is left alone."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..graph import (WRAPPED_ARG, A, cast_dtype, dtype_of, fake_call, getitem, insert_call, is_op, last_dim, location,
                     same_meta, val)


@dataclass(frozen=True)
class Unmatched:
    """Why a candidate site is left alone, in words a user can act on (explain prints it)."""
    reason: str


def arg(node: fx.Node, name: str, default: Any = None) -> Any:
    """The argument `name` of an ATen call, positional or keyword, or default when absent."""
    names = [a.name for a in node.target._schema.arguments]
    i = names.index(name)
    if i < len(node.args):
        return node.args[i]
    return node.kwargs.get(name, default)


def known_equal(a: Any, b: Any) -> bool:
    """a == b for sizes that may be symbolic, without adding a guard: True only when proven."""
    return statically_known_true(a == b)


def same_value(a: Any, b: Any, depth: int = 4) -> bool:
    """a and b compute the same value: the same node, or the same deterministic op on the same
    arguments (models often write `x.float()` or `x - mean` twice, which traces to two nodes)."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y, depth) for x, y in zip(a, b))
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return not isinstance(a, fx.Node) and not isinstance(b, fx.Node) and type(a) is type(b) and a == b
    if (depth == 0 or a.op != "call_function" or a.target != b.target
            or torch.Tag.nondeterministic_seeded in getattr(a.target, "tags", ())):
        return False
    return (same_value(a.args, b.args, depth - 1) and a.kwargs.keys() == b.kwargs.keys()
            and all(same_value(a.kwargs[k], b.kwargs[k], depth - 1) for k in a.kwargs))


RESHAPES = (A.view.default, A.reshape.default, A._unsafe_view.default)
ROW_RESHAPES = (*RESHAPES, A.expand.default)


def keeps_rows(n: Any) -> bool:
    """n is a shape op (or copy) that moves whole rows of its input's last dim, unchanged, to
    rows of its output: the same op then serves a tensor whose last dim differs."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.args
            and isinstance(val(n.args[0]), torch.Tensor) and isinstance(val(n), torch.Tensor)):
        return False
    if is_op(n, A.clone.default, A.contiguous.default):
        return True
    v, s = val(n), val(n.args[0])
    if v.dim() == 0 or s.dim() == 0 or not known_equal(v.shape[-1], s.shape[-1]):
        return False
    if is_op(n, *ROW_RESHAPES):
        return True  # row-major: with the last size unchanged, rows stay rows
    if is_op(n, A.flatten.using_ints):
        return not last_dim(arg(n, "end_dim", -1), s.dim())
    if is_op(n, A.unsqueeze.default):
        return not last_dim(n.args[1], v.dim())
    if is_op(n, A.slice.Tensor, A.select.int, A.squeeze.dim):
        return not last_dim(n.args[1], s.dim())
    if is_op(n, A.transpose.int):
        return not any(last_dim(d, s.dim()) for d in n.args[1:3])
    if is_op(n, A.permute.default):
        return last_dim(n.args[1][-1], s.dim())
    if is_op(n, A.index.Tensor):
        return len(n.args[1]) < s.dim() or n.args[1][-1] is None
    return False


def learned(t: fx.Node) -> bool:
    """t depends on an input or attribute that requires grad (the ops give rotary tables and
    ALiBi slopes no gradient). Inputs are read from their fake values, or Dynamo's example
    values where a retrace kept them; a wrapped subgraph's input from what the wrap passes."""
    seen, stack = set(), [t]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and isinstance(n.meta.get(WRAPPED_ARG), fx.Node):
            stack.append(n.meta[WRAPPED_ARG])
            continue
        if n.op == "placeholder" and any(getattr(n.meta.get(k), "requires_grad", False)
                                         for k in ("val", "example_value")):
            return True
        if n.op == "get_attr" and getattr(operator.attrgetter(n.target)(n.graph.owning_module), "requires_grad", False):
            return True
        stack.extend(n.all_input_nodes)
    return False


def call_checked(graph: fx.Graph, before: fx.Node, op, args: tuple,
                 kwargs: dict | None = None) -> fx.Node | Unmatched:
    """insert_call, or the op's own message when its argument checks reject these values."""
    try:
        fake_call(op, *args, **(kwargs or {}))
    except ValueError as e:
        return Unmatched(str(e))
    return insert_call(graph, before, op, args, kwargs)


def replace(graph: fx.Graph, old: fx.Node, new: fx.Node, op_name: str) -> Unmatched | None:
    """Let new (the result of flash.<op_name>) take old's place: None when done, else why not.
    Under autocast new may be in the half dtype that every reader of an fp32 old computes in
    (see autocast_dtype): one rounding of the fp32 value either way, as the ops compute in fp32."""
    if same_meta(val(new), val(old)):
        old.replace_all_uses_with(new)
        return None
    if (tuple(val(new).shape) == tuple(val(old).shape) and dtype_of(new) in HALF
            and autocast_dtype(old) == dtype_of(new)):
        retype(graph, old, new)
        return None
    graph.erase_node(new)
    return Unmatched(f"flash.{op_name} would give {dtype_of(new)} {tuple(val(new).shape)} where the model "
                     f"computes {dtype_of(old)} {tuple(val(old).shape)}")


# ops whose result depends on their input's strides, not only its values
STRIDED_READERS = (A.as_strided, A.as_strided_copy, A.as_strided_scatter, A._reshape_alias, A._reshape_alias_copy,
                   A.sym_stride, A.sym_storage_offset)


def readers_accept(old: fx.Node, new: torch.Tensor) -> bool:
    """Whether every reader of old computes the same values from new, old's value laid out
    otherwise (a fused op's output in its own layout). Readers are run again on fake values, in
    graph order, wherever an input's layout changed. False where one raises (a `.view` of the
    model's contiguous tensor), mutates, reads strides (STRIDED_READERS), is not an ATen op, or
    is the graph's output (whose strides the caller sees). True: their `val` meta is updated to
    the new layouts, which later patterns read."""
    import operator

    from torch.utils._pytree import tree_leaves, tree_map

    changed = {old: new}
    waiting = set(old.users)  # readers of a changed node not yet visited: the walk ends with them
    node = old.next
    while waiting:
        if node in waiting:
            waiting.discard(node)
            if node.op != "call_function":
                return False
            if node.target is operator.getitem:
                out = changed[node.args[0]][node.args[1]]
            elif (not isinstance(node.target, torch._ops.OpOverload) or node.target._schema.is_mutable
                  or node.target.overloadpacket in STRIDED_READERS):
                return False
            else:
                args, kwargs = tree_map(lambda a: changed.get(a, val(a)) if isinstance(a, fx.Node) else a,
                                        (node.args, node.kwargs))
                try:
                    out = fake_call(node.target, *args, **kwargs)
                except Exception:  # a reader that cannot take this layout (view's RuntimeError)
                    return False
            if any(isinstance(a, torch.Tensor) and a.stride() != b.stride()
                   for a, b in zip(tree_leaves(out), tree_leaves(val(node)))):
                changed[node] = out
                waiting.update(node.users)
        node = node.next
    for node, v in changed.items():
        if node is not old:
            node.meta["val"] = v
    return True


def conclude(site, failed: Unmatched | None, op: str) -> None:
    """Record on a report Site that it became flash.<op>, or why that failed."""
    if failed is None:
        site.op = op
    else:
        site.reason = failed.reason


def fuse_residual(gm: fx.GraphModule, norm: fx.Node, fused_op) -> bool:
    """norm = op(a + b, *rest, **kw) -> fused_op(a, b, *rest, **kw) returning (y, a + b): y
    replaces norm and the second output replaces the sum for its other users. The sum may
    reach the norm through reshapes that nothing else reads (OPT flattens the tokens:
    norm((a + b).view(-1, d))); a and b are then reshaped alike, as the sum is elementwise."""
    top = norm.args[0]  # the value the residual output replaces
    s, shapes = top, []
    while is_op(s, *RESHAPES) and (s is top or len(s.users) == 1):
        shapes.append(s.args[1])
        s = s.args[0]
    if (not is_op(s, A.add.Tensor) or len(s.args) != 2 or s.kwargs.get("alpha", 1) != 1
            or s is not top and len(s.users) != 1):
        return False
    a, b = s.args
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)
            and all(isinstance(val(t), torch.Tensor) and val(t).dtype.is_floating_point for t in (a, b))
            and tuple(val(a).shape) == tuple(val(b).shape) == tuple(val(s).shape)):
        return False
    # the op stores the sum in x's dtype: x is the operand the sum's type promotion kept
    # (autocast's fp32 residual stream plus a bf16 branch sums in fp32)
    if dtype_of(a) != dtype_of(s):
        a, b = b, a
    if dtype_of(a) != dtype_of(s):
        return False
    # users of the sum may sit between it and the norm, so the fused op goes right after the
    # value it replaces: the norm's other arguments (weight, bias) must already exist there
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if any(order[r] > order[top] for r in norm.all_input_nodes):
        return False
    new = []
    for shape in reversed(shapes):
        a, b = (insert_call(gm.graph, norm, A.reshape.default, (t, shape)) for t in (a, b))
        new += [a, b]
    fused = insert_call(gm.graph, norm, fused_op, (a, b, *norm.args[1:]), dict(norm.kwargs))
    y, res = getitem(gm.graph, fused, 0), getitem(gm.graph, fused, 1)
    norm.replace_all_uses_with(y)
    top.replace_all_uses_with(res)
    gm.graph.erase_node(norm)
    anchor = top
    for node in (*new, fused, y, res):
        anchor.append(node)
        anchor = node
    return True


HALF = (torch.float16, torch.bfloat16)
# ops autocast runs in its half dtype, casting each floating operand to it first
AUTOCAST_HALF_OPS = (A.linear.default, A.mm.default, A.matmul.default, A.bmm.default, A.addmm.default,
                     A.baddbmm.default, A.scaled_dot_product_attention.default)
# ops that move their first argument's elements without computing on them
MOVES = (*ROW_RESHAPES, A.transpose.int, A.permute.default, A.t.default, A.unsqueeze.default, A.squeeze.dim,
         A.slice.Tensor, A.narrow.default, A.select.int, A.clone.default, A.contiguous.default,
         A.flatten.using_ints, A.unflatten.int)


def autocast_dtype(node: fx.Node) -> torch.dtype | None:
    """D when node is fp32 and every reader of it, through ops that only move its elements, is
    an op that autocast runs in the half dtype D (its output D, node cast to D first) or a
    cast to D: the value in D is then all the model uses (the fp32 residual stream read by
    the next linear, HF's rotary output in fp32 from fp32 cos/sin, read by SDPA or cast back
    to q's dtype). None otherwise."""
    if dtype_of(node) != torch.float32:
        return None
    found, stack = set(), [node]
    while stack:
        cur = stack.pop()
        if not cur.users:
            return None  # nothing reads it: nothing proves the fp32 value unwanted
        for u in cur.users:  # a graph output is a reader of neither kind
            if is_op(u, *MOVES) and u.args[0] is cur:
                stack.append(u)
            elif is_op(u, *AUTOCAST_HALF_OPS) or cast_dtype(u) is not None and u.args[0] is cur:
                found.add(dtype_of(u))
            else:
                return None
    return found.pop() if len(found) == 1 and found <= set(HALF) else None


def retype(graph: fx.Graph, old: fx.Node, new: fx.Node) -> None:
    """Give old's readers new, old's value in the dtype autocast_dtype(old) found: the ops that
    move elements are made again on new (so their values carry its dtype for the patterns
    after this one) and the old ones erased, the autocast ops read new as they are; old is
    left without readers."""
    for u in list(old.users):
        if is_op(u, *MOVES) and u.args[0] is old:
            retype(graph, u, insert_call(graph, u, u.target, (new, *u.args[1:]), dict(u.kwargs)))
            graph.erase_node(u)
        else:
            u.replace_input_with(old, new)


def write_autocast_dtype(graph: fx.Graph, norm: fx.Node) -> fx.Node:
    """norm (a flash norm op) again with out_dtype=D where its y is fp32 and autocast_dtype(y) is
    D: the op then writes y in D itself, no cast pass after it, and its backward reads the
    matmul's D gradient without a cast pass back. Same values: one rounding of the fp32 y."""
    dtype = autocast_dtype(norm)
    if dtype is None:
        return norm
    new = insert_call(graph, norm, norm.target, norm.args, {**norm.kwargs, "out_dtype": dtype})
    retype(graph, norm, new)
    graph.erase_node(norm)
    return new


def rewrite_norms(gm: fx.GraphModule, report, anchors, op: str, fused_op: str, label: str,
                  direct: str, call_args) -> None:
    """The site loop of the norm families. anchors: (node, anchor name, match) with match(node)
    -> a match, an Unmatched, or None (not a candidate at all). call_args(match) -> (args,
    kwargs) of flash.<op>. Reasons of hand-written spellings read "looks like <label> but ...";
    those of the `direct` anchor (the F.* call) stand alone. A rewritten norm whose input is a
    residual add then becomes flash.<fused_op>."""
    from ..report import Site

    flash = torch.ops.flash
    rewritten = {}
    for n, anchor, match in anchors:
        m = match(n)
        if m is None:
            continue
        site = Site("norm", location(n), anchor)
        report.add(site)
        if isinstance(m, Unmatched):
            site.reason = m.reason if anchor == direct else f"looks like {label} but {m.reason}"
            continue
        args, kwargs = call_args(m)
        node = call_checked(gm.graph, m.out, getattr(flash, op).default, args, kwargs)
        conclude(site, node if isinstance(node, Unmatched) else replace(gm.graph, m.out, node, op), op)
        if site.rewritten:
            rewritten[write_autocast_dtype(gm.graph, node)] = site
    gm.graph.eliminate_dead_code()
    for node, site in rewritten.items():
        if fuse_residual(gm, node, getattr(flash, fused_op).default):
            site.op = fused_op
