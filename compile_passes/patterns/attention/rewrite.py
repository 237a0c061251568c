"""The rewrite: flash.attention in the place of each matched site. Builds q, k and v from
their Operands, attn_bias from the Parts left (bool masks and'ed, float terms summed with
masks as 0 / -inf), a fresh dropout seed per call, then the views back to the model's
layout and dtype; the replaced chain is erased where nothing else reads it. rewrite() is the
family's entry point: every softmax over the last dim and every SDPA call is a site."""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from ...graph import A, dtype_of, insert_call, location, strip_casts, val
from ...report import Report, Site
from .._shared import Unmatched, call_checked, conclude, known_equal, replace
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


def _bias(graph: fx.Graph, before: fx.Node, parts: list[Part], fills: bool = False) -> fx.Node | None:
    """attn_bias from the parts left: the and of the keep-masks (bool), or, with float terms,
    their sum with the masks as 0 / -inf. fills: overwrites add their own (scaled) fill
    instead, in the model's order (Match.zero_rows)."""
    if not parts:
        return None
    masks, floats = [], []
    for p in parts:
        node = p.node
        if p.heads and val(node).dim() == 3 and not known_equal(shape_of(node)[0], 1):
            node = _emit(graph, before, A.unflatten.int, node, 0, [-1, p.heads])  # as the op's (B, H, ...)
        if fills and p.overwrite:
            keep, hide = (0.0, p.fill * p.mult) if p.positive else (p.fill * p.mult, 0.0)
            floats.append(_emit(graph, before, A.where.Scalar, node, keep, hide))
        elif p.kind == "add":
            x = node
            if not dtype_of(x).is_floating_point:  # an added bool or int tensor adds its values
                x = _emit(graph, before, A._to_copy.default, x, dtype=torch.float32)
            floats.append(x if p.mult == 1 else _emit(graph, before, A.mul.Tensor, x, p.mult))
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
    bias = _bias(g, at, m.parts, fills=m.zero_rows)
    if m.zero_rows:  # Match.zero_rows: q = 0 on the rows the overwrites hide entirely
        rows = _hidden_rows(g, at, [p for p in m.parts if p.overwrite])
        q = _emit(g, at, A.masked_fill.Scalar, q, rows, 0.0)
        # those rows' terms less their max, the same softmax: the op's lse keeps log(Sk) exact
        # there (at the fill's magnitude fp32 rounds it: 3e-4 off the model's mean of v)
        top = _emit(g, at, A.amax.default, bias, [-1], True)
        bias = _emit(g, at, A.where.self, rows, _emit(g, at, A.sub.Tensor, bias, top), bias)
    if m.merged:
        q, k, v = (_emit(g, at, A.unsqueeze.default, x, 0) for x in (q, k, v))
        if bias is not None and val(bias).dim() == 3:
            bias = _emit(g, at, A.unsqueeze.default, bias, 0)
    seed = _seed(g, at, q) if m.dropout_p > 0 else None
    w = m.window
    node = call_checked(g, at, FLASH.attention.default, (q, k, v, bias, seed),
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
    if val(at).is_contiguous() and not val(out).is_contiguous():
        out = _emit(g, at, A.contiguous.default, out)
    if dtype_of(out) != dtype_of(at):
        out = _emit(g, at, A._to_copy.default, out, dtype=dtype_of(at))
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
