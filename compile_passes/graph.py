"""Graph helpers for the rewrites: normalisation and small queries on pre-dispatch ATen IR."""
from __future__ import annotations

import contextlib
import numbers
import operator
from typing import Any

import torch
import torch.fx as fx

A = torch.ops.aten

CASTS = (A.to.dtype, A._to_copy.default, A.to.dtype_layout, A.type_as.default)
# Node meta of an ExportedProgram's placeholder: the number its one-element lifted constant holds.
LIFTED_VALUE = "flash_lifted_value"


def is_op(node: Any, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def val(node: Any):
    """The FakeTensor (or SymInt) a node computes, None for non-nodes."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def dtype_of(node: Any) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def number(x: Any) -> float | None:
    """A Python number argument (SymFloats from dynamic shapes are not constants)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Number):
        return None
    return float(x)


def split_const(node: fx.Node) -> tuple[fx.Node | None, float | None]:
    """For a binary op with one tensor node and one Python number, (node, number)."""
    a, b = node.args[0], node.args[1]
    if isinstance(a, fx.Node) and number(b) is not None:
        return a, number(b)
    if isinstance(b, fx.Node) and number(a) is not None:
        return b, number(a)
    return None, None


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The target dtype if node is a pure dtype cast, else None."""
    if not is_op(node, *CASTS):
        return None
    return dtype_of(node)


def strip_casts(node: Any) -> Any:
    """Walk up through dtype casts to the value they convert."""
    while isinstance(node, fx.Node) and cast_dtype(node) is not None:
        node = node.args[0]
    return node


def only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def other_operand(node: fx.Node, known: fx.Node) -> Any:
    a, b = node.args[0], node.args[1]
    if a is known:
        return b
    if b is known:
        return a
    return None


def last_dim(dims: Any, ndim: int) -> bool:
    dims = [dims] if isinstance(dims, int) else list(dims)
    return len(dims) == 1 and dims[0] in (-1, ndim - 1)


def location(node: fx.Node) -> str:
    """Where the user wrote it: the last frame of the stack trace, or the module path."""
    trace = node.meta.get("stack_trace")
    if trace:
        frames = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
        if frames:
            return frames[-1].replace("File ", "")
    stack = node.meta.get("nn_module_stack")
    if stack:
        return list(stack.values())[-1][0]
    return node.name


# export's spelling of a region under another grad or autocast mode (`@torch.no_grad()`,
# `torch.autocast(enabled=False)`), and a region of torch.utils.checkpoint: one node that runs
# a subgraph, its outputs read by getitem
WRAPS = (torch.ops.higher_order.wrap_with_set_grad_enabled, torch.ops.higher_order.wrap_with_autocast,
         torch.ops.higher_order.tag_activation_checkpoint)
# torch.cond(pred, true_fn, false_fn, operands): a subgraph a branch, both given the operands
COND = torch.ops.higher_order.cond
# Node meta of a region's placeholder: the node of the outer graph passed for it.
WRAPPED_ARG = "flash_wrapped_arg"


def _subgraph_arg(wrap: fx.Node) -> int | None:
    """The index of the get_attr argument of a WRAPS node that names its subgraph."""
    return next((i for i, a in enumerate(wrap.args) if isinstance(a, fx.Node) and a.op == "get_attr"), None)


def _module(node: Any) -> fx.GraphModule | None:
    """The graph module a get_attr node names."""
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None
    module = operator.attrgetter(node.target)(node.graph.owning_module)
    return module if isinstance(module, fx.GraphModule) else None


def subgraph(wrap: fx.Node) -> fx.GraphModule | None:
    """The subgraph a WRAPS node runs."""
    i = _subgraph_arg(wrap)
    return None if i is None else _module(wrap.args[i])


def wrap_name(wrap: fx.Node) -> str:
    """The wrap as a user reads it: its op and mode arguments, `wrap_with_autocast(cpu, torch.bfloat16,
    True, False)` (device, dtype, enabled, cache) or `wrap_with_set_grad_enabled(False)`."""
    if wrap.target is torch.ops.higher_order.tag_activation_checkpoint:
        return "a torch.utils.checkpoint region"
    mode = ", ".join(str(a) for a in wrap.args[:_subgraph_arg(wrap)])
    return f"{wrap.target.__name__}({mode})"


def regions(node: fx.Node) -> list[tuple[str, fx.GraphModule, tuple]]:
    """The subgraphs node runs, each as (name a user reads, subgraph, the outer nodes passed
    for its placeholders): a WRAPS node's one, torch.cond's two branches; [] for other nodes."""
    if is_op(node, *WRAPS) and (sub := subgraph(node)) is not None:
        return [(wrap_name(node), sub, tuple(node.args[_subgraph_arg(node) + 1:]))]
    if is_op(node, COND):
        _, true_fn, false_fn, operands = node.args[:4]
        return [(f"torch.cond's {which} branch", _module(fn), tuple(operands))
                for which, fn in (("true", true_fn), ("false", false_fn)) if _module(fn) is not None]
    return []


def regions_of(gm: fx.GraphModule) -> list[tuple[str, fx.GraphModule, tuple]]:
    """regions() of gm's nodes, each subgraph once (named by the first node that runs it). A
    subgraph several nodes run with different operands gets no outer nodes: what one caller
    passes proves nothing of the others'."""
    found: dict[int, tuple[str, fx.GraphModule, tuple]] = {}
    for n in gm.graph.nodes:
        for name, sub, outer in regions(n):
            if id(sub) not in found:
                found[id(sub)] = (name, sub, outer)
            elif found[id(sub)][2] != outer:
                found[id(sub)] = (found[id(sub)][0], sub, ())
    return list(found.values())


@contextlib.contextmanager
def wrapped_args(sub: fx.GraphModule, outer: tuple):
    """Within it, each placeholder of a region's subgraph holds under WRAPPED_ARG the node the
    outer graph passes for it (what `learned` follows out of the subgraph), and under
    LIFTED_VALUE that node's lifted constant where it has one."""
    inner = list(sub.graph.find_nodes(op="placeholder"))
    for p, a in zip(inner, outer):
        p.meta[WRAPPED_ARG] = a
        if isinstance(a, fx.Node) and LIFTED_VALUE in a.meta:
            p.meta[LIFTED_VALUE] = a.meta[LIFTED_VALUE]
    try:
        yield
    finally:
        for p in inner:
            p.meta.pop(WRAPPED_ARG, None)
            p.meta.pop(LIFTED_VALUE, None)


def wrapped_output(node: Any) -> fx.Node | None:
    """For getitem(wrap, i) of a WRAPS node: the node of its subgraph that computes output i."""
    if not (is_op(node, operator.getitem) and is_op(node.args[0], *WRAPS)):
        return None
    module = subgraph(node.args[0])
    if module is None:
        return None
    outputs = next(iter(module.graph.find_nodes(op="output"))).args[0]
    out = outputs[node.args[1]] if isinstance(outputs, (tuple, list)) else None
    return out if isinstance(out, fx.Node) else None


def fake_call(op, *args, **kwargs):
    """Run op on the FakeTensors of node arguments: the output metadata of a new node."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_leaves, tree_map

    def to_val(a):
        return val(a) if isinstance(a, fx.Node) else a

    fargs, fkwargs = tree_map(to_val, args), tree_map(to_val, kwargs)
    # the values' own mode: under a Dynamo backend the ambient TracingContext holds another
    mode = next(a.fake_mode for a in tree_leaves(fargs) if isinstance(a, FakeTensor))
    with mode:
        return op(*fargs, **fkwargs)


def insert_call(graph: fx.Graph, before: fx.Node, op, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """Insert op(args) before a node, with its `val` meta filled in."""
    kwargs = kwargs or {}
    with graph.inserting_before(before):
        node = graph.call_function(op, args, kwargs)
    node.meta["val"] = fake_call(op, *args, **kwargs)
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in before.meta:
            node.meta[key] = before.meta[key]
    return node


def getitem(graph: fx.Graph, node: fx.Node, i: int) -> fx.Node:
    with graph.inserting_after(node):
        g = graph.call_function(operator.getitem, (node, i))
    g.meta["val"] = val(node)[i]
    return g


def same_meta(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape))


@contextlib.contextmanager
def lifted_values(ep: torch.export.ExportedProgram):
    """Within it, each placeholder of ep's graph that lifts a one-element tensor constant holds
    that constant's number under LIFTED_VALUE. Export lifts a tensor the model made while traced
    (transformers' `torch.tensor(0.0)` mask fill) to an input, where make_fx keeps an attribute;
    the value is fixed at export. Parameters and buffers are not read: they may change after."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.export.graph_signature import InputKind

    names = {s.arg.name: ep.constants.get(s.target) for s in ep.graph_signature.input_specs
             if s.kind == InputKind.CONSTANT_TENSOR}
    marked = []
    for n in ep.graph.find_nodes(op="placeholder"):
        t = names.get(n.name)
        if isinstance(t, torch.Tensor) and t.numel() == 1 and not is_fake(t) and t.device.type != "meta":
            n.meta[LIFTED_VALUE] = t.item()
            marked.append(n)
    try:
        yield
    finally:
        for n in marked:
            n.meta.pop(LIFTED_VALUE, None)


def normalize(gm: fx.GraphModule) -> None:
    """Remove nodes that hide patterns without computing anything: aliases, `.to(dtype)` to
    the dtype a tensor already has (aten.to returns its input then, so aliasing is
    unchanged), metadata asserts that torch.export puts beside .to(), and dropout in eval
    mode or with p=0 (HF models training with dropout 0): aten.dropout returns its input."""
    g = gm.graph
    for n in list(g.nodes):
        noop_to = (is_op(n, A.to.dtype) and len(n.args) == 2 and not n.kwargs
                   and dtype_of(n.args[0]) == n.args[1])
        if noop_to or is_op(n, A.alias.default):
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)
        elif is_op(n, A._assert_tensor_metadata.default) and not n.users:
            g.erase_node(n)
        elif is_op(n, A.dropout.default) and (
                (n.args[2] if len(n.args) > 2 else n.kwargs.get("train")) is False
                or number(n.args[1] if len(n.args) > 1 else n.kwargs.get("p")) == 0.0):
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)
