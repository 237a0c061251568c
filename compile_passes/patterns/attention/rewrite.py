"""The rewrite: flash.attention in the place of each matched site. Builds q, k and v from
their Operands, attn_bias from the Parts left (bool masks and'ed, float terms summed with
masks as 0 / -inf), alibi_slopes from a proven ALiBi term, a fresh dropout seed per call,
then the views back to the model's layout and dtype; the replaced chain is erased where
nothing else reads it. rewrite() is the family's entry point: every softmax over the last dim
and every SDPA call is a site."""
from __future__ import annotations

import functools
import math

import torch
import torch.fx as fx

from ...graph import A, dtype_of, insert_call, location, strip_casts, val
from ...report import Report, Site
from .._shared import Unmatched, call_checked, conclude, known_equal, readers_accept, replace
from .match import SOFTMAX, match_softmax, softmax_of
from .nodes import concrete, shape_of
from .operands import Match, Operand, Part
from .sdpa import FUSED, SDPA, match_sdpa

FLASH = torch.ops.flash


def _emit(graph: fx.Graph, before: fx.Node, op, *args, **kwargs) -> fx.Node:
    return insert_call(graph, before, op, args, kwargs)


def _build(graph: fx.Graph, before: fx.Node, x: Operand) -> fx.Node:
    node = x.node
    for op, args in x.ops:
        node = _emit(graph, before, op, node, *args)
    return node


def _layout(graph: fx.Graph, before: fx.Node, p: Part) -> fx.Node:
    """p's tensor in the op's layout: a (B*H, ...) term of scores the op sees as (B, H, ...)
    unflattened."""
    if p.heads and val(p.node).dim() == 3 and not known_equal(shape_of(p.node)[0], 1):
        return _emit(graph, before, A.unflatten.int, p.node, 0, [-1, p.heads])
    return p.node


def _term(graph: fx.Graph, before: fx.Node, p: Part, node: fx.Node) -> fx.Node:
    """An added part as a float term: its values times mult."""
    if not dtype_of(node).is_floating_point:  # an added bool or int tensor adds its values
        node = _emit(graph, before, A._to_copy.default, node, dtype=torch.float32)
    return node if p.mult == 1 else _emit(graph, before, A.mul.Tensor, node, p.mult)


def _bias(graph: fx.Graph, before: fx.Node, parts: list[Part]) -> fx.Node | None:
    """attn_bias from the parts left: the and of the keep-masks (bool), or, with float terms,
    their sum with the masks as 0 / -inf."""
    if not parts:
        return None
    masks, floats = [], []
    for p in parts:
        node = _layout(graph, before, p)
        if p.kind == "add":
            floats.append(_term(graph, before, p, node))
        else:
            masks.append(node if p.positive else _emit(graph, before, A.logical_not.default, node))
    if floats:
        floats += [_emit(graph, before, A.where.Scalar, c, 0.0, -math.inf) for c in masks]
        terms, op = floats, A.add.Tensor
    else:
        terms, op = masks, A.logical_and.default
    out = terms[0]
    for t in terms[1:]:
        out = _emit(graph, before, op, out, t)
    return out


def _model_bias(graph: fx.Graph, before: fx.Node, parts: list[Part], like: fx.Node) -> tuple[fx.Node, fx.Node]:
    """(attn_bias, the keys some overwrite hides) for Match.zero_rows: the model's scores less
    q @ k^T, step by step in its order, so that q = 0 gives the model's scores exactly: an
    overwrite sets its (scaled) fill where it hides, a keep part adds its fill there, an added
    term its values. In fp32, or float64 for float64 q (like): finfo(float64).min is -inf in fp32."""
    dtype = torch.promote_types(dtype_of(like), torch.float32)
    out = zero = _emit(graph, before, A.new_zeros.default, like, [], dtype=dtype)
    hidden = None
    for p in parts:
        node = _layout(graph, before, p)
        if p.kind == "add":
            out = _emit(graph, before, A.add.Tensor, out, _term(graph, before, p, node))
            continue
        hide = _emit(graph, before, A.logical_not.default, node) if p.positive else node
        filled = _emit(graph, before, A.where.ScalarSelf, hide, p.fill * p.mult, out if p.overwrite else zero)
        if p.overwrite:
            hidden = hide if hidden is None else _emit(graph, before, A.logical_or.default, hidden, hide)
        out = filled if p.overwrite else _emit(graph, before, A.add.Tensor, out, filled)
    return out, hidden


def _hidden_rows(graph: fx.Graph, before: fx.Node, parts: list[Part]) -> fx.Node:
    """(..., Sq, 1): the query rows that the keep parts hide on every key."""
    hidden = None
    for p in parts:
        h = _emit(graph, before, A.logical_not.default, p.node) if p.positive else p.node
        hidden = h if hidden is None else _emit(graph, before, A.logical_or.default, hidden, h)
    return _emit(graph, before, A.all.dim, hidden, -1, True)


def _uniform_rows(graph: fx.Graph, before: fx.Node, parts: list[Part], v: fx.Node, out: fx.Node) -> fx.Node:
    """out (B, H, Sq, Dv) with the query rows that the keep parts hide on every key set to v's
    mean over the keys, as the model computes them (Match.uniform_rows); no gradient reaches
    out there, so none reaches q and k. v: (B, Hkv, Sk, Dv), query head h reading kv head
    h // (H / Hkv)."""
    rows = _hidden_rows(graph, before, parts)
    mean = _emit(graph, before, A.mean.dim, v, [-2], True)
    n = concrete(val(out).shape[1] // val(v).shape[1])  # checked by _replace
    if n != 1:
        mean = _emit(graph, before, A.repeat_interleave.self_int, mean, n, 1)
    return _emit(graph, before, A.where.self, rows, mean, out)


def _zero_rows(graph: fx.Graph, before: fx.Node, parts: list[Part], q: fx.Node) -> tuple[fx.Node, fx.Node]:
    """(q, attn_bias) for Match.zero_rows: q = 0 on the rows where every key the softmax
    weighs (bias above -inf) is one an overwrite hides, whose scores in the model are then the
    bias alone, with no gradient to q and k; those rows' bias less its max, the same softmax,
    so that the op's lse keeps log(Sk) exact there (at the fill's magnitude fp32 rounds it:
    3e-4 off the model's mean of v). A row of -inf only is left to the op (0)."""
    e = functools.partial(_emit, graph, before)
    bias, hidden = _model_bias(graph, before, parts, q)
    weighed = e(A.gt.Scalar, bias, -math.inf)
    only_hidden = e(A.all.dim, e(A.logical_or.default, hidden, e(A.logical_not.default, weighed)), -1, True)
    rows = e(A.logical_and.default, only_hidden, e(A.any.dim, weighed, -1, True))
    q = e(A.masked_fill.Scalar, q, rows, 0.0)
    top = e(A.amax.default, bias, [-1], True)
    return q, e(A.where.self, rows, e(A.sub.Tensor, bias, top), bias)


def _slopes(graph: fx.Graph, before: fx.Node, m: Match, q: fx.Node) -> fx.Node | None:
    """alibi_slopes, fp32 (Hq,) or (B, Hq): the graph's slope tensor times the proven factor, or
    one slope for every head."""
    a = m.alibi
    if a is None:
        return None
    if a.slopes is None:
        return _emit(graph, before, A.new_full.default, q, [a.heads], a.factor, dtype=torch.float32)
    node = _build(graph, before, a.slopes)
    if dtype_of(node) != torch.float32:
        node = _emit(graph, before, A._to_copy.default, node, dtype=torch.float32)
    return node if a.factor == 1 else _emit(graph, before, A.mul.Tensor, node, a.factor)


def _seed(graph: fx.Graph, before: fx.Node, like: fx.Node) -> fx.Node:
    """A fresh dropout seed per call, drawn as flash.attention's public function draws it."""
    device = val(like).device
    with graph.inserting_before(before):
        node = graph.call_function(A.randint.default, (2**62, []), {"dtype": torch.int64, "device": device})
    with val(like).fake_mode:
        node.meta["val"] = torch.randint(2**62, (), dtype=torch.int64, device=device)
    return node


def _replace(gm: fx.GraphModule, m: Match) -> Unmatched | None:
    """flash.attention in m.out's place: None when done, else why not."""
    g, at = gm.graph, m.out
    q, k, v = (_build(g, at, x) for x in (m.q, m.k, m.v))
    if len({dtype_of(q), dtype_of(k), dtype_of(v)}) > 1:
        # q and k upcast to compute the scores in fp32: the op computes in fp32 anyway
        q, k, v = (strip_casts(x) for x in (q, k, v))
        if len({dtype_of(q), dtype_of(k), dtype_of(v)}) > 1:
            return Unmatched("q, k and v have different dtypes")
    if m.uniform_rows and concrete(val(q).shape[1] // val(v).shape[1]) is None:
        return Unmatched("a padding mask hides whole query rows, and the head counts are not constants")
    for c, div in m.runtime:  # q * c keeps q's dtype (a one-value tensor does not promote it)
        q = _emit(g, at, A.div.Tensor if div else A.mul.Tensor, q, c)
    # the op reads rows of the head dim: a strided one (a transposed input) is copied, as SDPA does
    q, k, v = (x if known_equal(val(x).stride(-1), 1) else _emit(g, at, A.contiguous.default, x) for x in (q, k, v))
    if m.zero_rows:
        q, bias = _zero_rows(g, at, m.parts, q)
    else:
        bias = _bias(g, at, m.parts)
    if m.merged:
        q, k, v = (_emit(g, at, A.unsqueeze.default, x, 0) for x in (q, k, v))
        if bias is not None and val(bias).dim() == 3:
            bias = _emit(g, at, A.unsqueeze.default, bias, 0)
    seed = _seed(g, at, q) if m.dropout_p > 0 else None
    slopes = _slopes(g, at, m, q)
    sinks = None if m.sinks is None else _build(g, at, m.sinks)
    w = m.window
    node = call_checked(g, at, FLASH.attention.default, (q, k, v, bias, seed, slopes, sinks),
                        {"scale": m.scale, "causal": w.right == 0, "window_left": w.left,
                         "window_right": w.right if w.right > 0 else -1,
                         "softcap": m.softcap, "dropout_p": m.dropout_p})
    if isinstance(node, Unmatched):
        if seed is not None:
            g.erase_node(seed)  # dead-code elimination keeps random ops
        return node
    if m.uniform_rows:
        node = _uniform_rows(g, at, m.parts, v, node)
    out = _emit(g, at, A.squeeze.dim, node, 0) if m.merged else node
    for op, args in m.out_ops:
        out = _emit(g, at, op, out, *args)
    if dtype_of(out) != dtype_of(at):
        out = _emit(g, at, A._to_copy.default, out, dtype=dtype_of(at))
    # the op's out is laid out like q: a copy into the model's contiguous layout only where a
    # reader needs it (a .view); HF's transpose(1, 2).contiguous() after the product with v
    # then copies nothing, where two copies would undo each other's transpose
    if val(at).is_contiguous() and not val(out).is_contiguous() and not readers_accept(at, val(out)):
        out = _emit(g, at, A.contiguous.default, out)
    failed = replace(g, at, out, "attention")
    if failed is None:
        _erase(g, m.chain + [at])
    return failed


def _erase(graph: fx.Graph, nodes: list) -> None:
    """Remove the replaced chain where nothing else reads it (in-place steps included, which
    dead-code elimination keeps)."""
    left = {n for n in nodes if not getattr(n, "_erased", False)}
    while dead := [n for n in left if not n.users]:
        for n in dead:
            graph.erase_node(n)
            left.discard(n)


def rewrite(gm: fx.GraphModule, report: Report) -> None:
    """Rewrite every attention site of gm to flash.attention, adding each to report."""
    for t in FUSED:
        for n in gm.graph.find_nodes(op="call_function", target=t):
            report.add(Site("attention", location(n), f"aten.{t.__name__.split('.')[0]}",
                            reason="a fused SDPA kernel already (the graph was traced below SDPA): left as it is"))
    anchors = [(n, name) for t, name in SDPA.items() for n in gm.graph.find_nodes(op="call_function", target=t)]
    found = {n: softmax_of(n) for t in (A.where.self, *SOFTMAX, A.div.Tensor)
             for n in gm.graph.find_nodes(op="call_function", target=t)}
    # a softmax inside a larger one (decomposed _safe_softmax) is that one's site
    inner = {x for n, of in found.items() if of is not None for x in of[2] if x is not n}
    anchors += [(n, "softmax") for n, of in found.items() if of is not None and n not in inner]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n, anchor in anchors:
        site = Site("attention", location(n), anchor)
        report.add(site)
        m = match_softmax(n, order) if anchor == "softmax" else match_sdpa(n)
        if isinstance(m, Unmatched):
            site.reason = m.reason if anchor != "softmax" else f"softmax not rewritten to attention: {m.reason}"
            continue
        conclude(site, _replace(gm, m), "attention")
        if site.rewritten and m.notes:
            site.reason = "; ".join(m.notes)
