"""Rotary embedding spellings -> flash.rotary.

Anchors: the rotation of the pairs, HF's rotate_half `cat((-x[..., d/2:], x[..., :d/2]), -1)`
(slices or chunk) and GPT-J's rotate_every_two `stack((-x[..., 1::2], x[..., ::2]),
-1).flatten(-2)`. From it the walk goes down to `x * cos + rotate(x) * sin` (operands in
either order) and, for partial rotary (GPT-NeoX, Phi), to `cat((that, x_full[..., rd:]), -1)`
where x = x_full[..., :rd]. cos and sin must be proven to repeat their halves: each is
walked up through casts, cos/sin, constant scales and ops that keep rows whole
(unsqueeze, indexing or slicing leading dims, reshapes that keep the last dim) to
`cat((f, f), -1)` of one tensor (`repeat_interleave(f, 2, -1)` for GPT-J). The op then
reads each table's first half, `cos[..., :rd/2]` (every other column for GPT-J), as a
per-token (B or 1, S, rd/2) or (S, rd/2) table. x is (B, H, S, D) with tables broadcast
over the heads, or (B, S, H, D) (GPT-J), which the op reads through a transposed view.

The halves written out (gpt-oss): `cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)` with x1, x2
the halves of x (chunk or slices) and c, s tables of one column per pair, read as they are.

The complex spelling of Meta's LLaMA (also torchtitan, Llama 4): anchor `view_as_real(xc * f)`
with xc = view_as_complex(x.float().reshape(..., D/2, 2)) and f a complex table, then
flattened back to x's shape (and cast to x's dtype). Multiplying by a + ib turns each
adjacent pair exactly as the interleaved op does with cos = a and sin = b, so the real and
imaginary parts of f are the tables, whatever their modulus, with no halves to prove; the
backward, conj(f) times the gradient, is the op's own. The same product in real arithmetic
(torchtune, gpt-fast): `stack((x0 * c - x1 * s, x1 * c + x0 * s), -1).flatten(3)` over the
[..., 0] and [..., 1] of x's pairs and of a (..., D/2, 2) table.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..graph import (WRAPPED_ARG, A, cast_dtype, dtype_of, getitem, insert_call, is_op, last_dim, location, only_user,
                     other_operand, split_const, val, wrapped_output)
from ..report import Report, Site
from ._shared import (HALF, RESHAPES, Unmatched, arg, call_checked, conclude, keeps_rows, known_equal, learned,
                      replace, same_value)

FLASH = torch.ops.flash
END = 2**63 - 1  # what x[..., a:] traces to as a slice end
UNARY = (A.cos.default, A.sin.default)
ROTATIONS = {A.cat.default: "rotate_half", A.flatten.using_ints: "rotate_every_two"}  # anchor -> name


@dataclass
class Match:
    x: fx.Node  # (B, H, S, D) or (B, S, H, D)
    cos: fx.Node  # as the model broadcasts them against the rotated dims
    sin: fx.Node
    interleaved: bool
    out: fx.Node  # the node whose value the fused op replaces
    halves: bool = True  # cos/sin span rd columns (their halves repeat); else rd/2, one per pair


def _last_slice(n) -> tuple[fx.Node, object, object, object] | None:
    """(x, start, end, step) for x[..., start:end:step], sizes possibly symbolic, an open or
    overlong end given as the last dim's size."""
    if not is_op(n, A.slice.Tensor) or not last_dim(n.args[1], val(n.args[0]).dim()):
        return None
    x, full = n.args[0], val(n.args[0]).shape[-1]
    start, end, step = (val(a) if isinstance(a, fx.Node) else a
                        for a in (arg(n, "start"), arg(n, "end"), arg(n, "step", 1)))
    if end is None or isinstance(end, int) and (end == END or isinstance(full, int) and end > full):
        end = full
    return x, 0 if start is None else start, end, step


def _half(n, which: int) -> fx.Node | None:
    """x when n is x's first (which=0) or second half along the last dim (slices or chunk)."""
    if is_op(n, operator.getitem) and n.args[1] == which and is_op(n.args[0], A.chunk.default, A.split.Tensor):
        parts, x = n.args[0], n.args[0].args[0]
        if parts.target == A.chunk.default:
            two = arg(parts, "chunks") == 2
        else:
            size = arg(parts, "split_size")
            two = known_equal(2 * (val(size) if isinstance(size, fx.Node) else size), val(x).shape[-1])
        return x if two and last_dim(arg(parts, "dim", 0), val(x).dim()) else None
    s = _last_slice(n)
    if s is None or not known_equal(s[3], 1):
        return None
    x, start, end, _ = s
    full = val(x).shape[-1]
    if which == 0:
        ok = known_equal(start, 0) and known_equal(2 * end, full)
    else:
        ok = known_equal(2 * start, full) and known_equal(end, full)
    return x if ok else None


def _every_other(n, which: int) -> fx.Node | None:
    """x when n is x[..., which::2]."""
    s = _last_slice(n)
    if s is None:
        return None
    x, start, end, step = s
    ok = known_equal(start, which) and known_equal(step, 2) and known_equal(end, val(x).shape[-1])
    return x if ok else None


def _rotated(rot: fx.Node) -> tuple[fx.Node, bool] | None:
    """(x, interleaved) when rot is rotate_half(x) or rotate_every_two(x)."""
    if is_op(rot, A.cat.default) and last_dim(arg(rot, "dim", 0), val(rot).dim()) and len(rot.args[0]) == 2:
        neg, first = rot.args[0]
        if is_op(neg, A.neg.default):
            x = _half(first, 0)
            if x is not None and same_value(_half(neg.args[0], 1), x):
                return x, False
        return None
    if is_op(rot, A.flatten.using_ints) and last_dim(arg(rot, "end_dim", -1), val(rot.args[0]).dim()):
        st = rot.args[0]
        if (is_op(st, A.stack.default) and last_dim(arg(st, "dim", 0), val(st).dim()) and len(st.args[0]) == 2
                and arg(rot, "start_dim", 0) % val(st).dim() == val(st).dim() - 2):
            neg, even = st.args[0]
            if is_op(neg, A.neg.default):
                x = _every_other(even, 0)
                if x is not None and same_value(_every_other(neg.args[0], 1), x):
                    return x, True
    return None


def _table_source(n: fx.Node) -> fx.Node | None:
    """The input of an op that maps each row of it to a row of its output, the same function
    applied to every element (casts, cos/sin, scaling by a constant) or moving rows whole; for
    an output of a region export wraps (tables made under no_grad), where it is computed; for
    an input of a wrapped region (a checkpointed layer), what the wrap passes."""
    if n.op == "placeholder" and isinstance(n.meta.get(WRAPPED_ARG), fx.Node):
        return n.meta[WRAPPED_ARG]
    if keeps_rows(n) or cast_dtype(n) is not None or is_op(n, *UNARY):
        return n.args[0]
    if is_op(n, A.mul.Tensor, A.div.Tensor):
        return split_const(n)[0]
    return wrapped_output(n)


def _repeats_halves(t: fx.Node, interleaved: bool) -> bool:
    """t is cat((f, f), -1) of one f (repeat_interleave(f, 2, -1) when interleaved) after
    row-wise ops only, so its two halves (its even and odd columns) are equal."""
    cur = t
    while cur is not None:
        if interleaved and is_op(cur, A.repeat_interleave.self_int):
            dim = arg(cur, "dim")
            return cur.args[1] == 2 and dim is not None and last_dim(dim, val(cur).dim())
        if not interleaved and is_op(cur, A.cat.default) and last_dim(arg(cur, "dim", 0), val(cur).dim()):
            parts = cur.args[0]
            return len(parts) == 2 and same_value(parts[0], parts[1])
        cur = _table_source(cur)
    return False


def _match(rot: fx.Node) -> Match | Unmatched | None:
    """From the rotation down to x * cos + rotate(x) * sin; None when rot rotates nothing."""
    found = _rotated(rot)
    if found is None:
        return None
    x, interleaved = found
    term = only_user(rot)
    if not is_op(term, A.mul.Tensor):
        return Unmatched("rotate(x) is not multiplied by a sin table (or is used elsewhere)")
    sin, add = other_operand(term, rot), only_user(term)
    plain = other_operand(add, term) if is_op(add, A.add.Tensor) and add.kwargs.get("alpha", 1) == 1 else None
    if not is_op(plain, A.mul.Tensor) or not any(same_value(a, x) for a in plain.args[:2]):
        return Unmatched("rotate(x) * sin is not added to x * cos")
    cos = plain.args[1] if same_value(plain.args[0], x) else plain.args[0]
    rotary_dim, out = val(x).shape[-1], add
    # partial rotary: cat((rotary of x_full[..., :rd], x_full[..., rd:]), -1)
    part, nxt = _last_slice(x), only_user(add)
    if (part is not None and known_equal(part[1], 0) and known_equal(part[3], 1) and is_op(nxt, A.cat.default)
            and last_dim(arg(nxt, "dim", 0), val(nxt).dim()) and len(nxt.args[0]) == 2 and nxt.args[0][0] is add):
        rest = _last_slice(nxt.args[0][1])
        if (rest is not None and same_value(rest[0], part[0]) and known_equal(rest[1], rotary_dim)
                and known_equal(rest[2], val(part[0]).shape[-1]) and known_equal(rest[3], 1)):
            x, out = part[0], nxt
    for name, table in (("cos", cos), ("sin", sin)):
        if not _repeats_halves(table, interleaved):
            how = "repeat_interleave(freqs, 2, -1)" if interleaved else "torch.cat((freqs, freqs), -1)"
            return Unmatched(f"{name} is not proven to repeat its halves ({how} computed in the graph); "
                             f"a table whose halves differ is not a rotation of pairs")
    return Match(x, cos, sin, interleaved, out)


def _half_times_table(p: Any) -> tuple[fx.Node, int, fx.Node] | None:
    """(x, which half, table) when p is x's first (0) or second (1) half along the last dim
    times a table, in either order."""
    if not is_op(p, A.mul.Tensor):
        return None
    for h, table in (p.args[:2], p.args[1::-1]):
        for which in (0, 1):
            x = _half(h, which) if isinstance(h, fx.Node) else None
            if x is not None and isinstance(table, fx.Node):
                return x, which, table
    return None


def _match_half_products(cat: fx.Node) -> Match | Unmatched | None:
    """cat((x1 * c - x2 * s, x2 * c + x1 * s), -1), x1 and x2 the halves of x, c and s tables
    of rd/2 columns (gpt-oss's _apply_rotary_emb); None when cat is not two such terms."""
    if not (last_dim(arg(cat, "dim", 0), val(cat).dim()) and len(cat.args[0]) == 2):
        return None
    first, second = cat.args[0]
    if (not (is_op(first, A.sub.Tensor) and is_op(second, A.add.Tensor))
            or any(n.kwargs.get("alpha", 1) != 1 for n in (first, second))):
        return None
    # (x, which half, the table) of x1 * c, x2 * s, then the second term's two in either order
    products = [_half_times_table(p) for term in (first, second) for p in term.args[:2]]
    if None in products:
        return None
    x = products[0][0]
    if not all(same_value(p[0], x) for p in products):
        return Unmatched("the products take halves of different tensors")
    (_, w0, c), (_, w1, s) = products[:2]

    def in_second(which, table):
        return any(w == which and same_value(t, table) for _, w, t in products[2:])
    if (w0, w1) != (0, 1) or not (in_second(1, c) and in_second(0, s)):
        return Unmatched("the half products are not the rotation (x1 * c - x2 * s, x2 * c + x1 * s)")
    if not (known_equal(2 * val(c).shape[-1], val(x).shape[-1]) and known_equal(2 * val(s).shape[-1], val(x).shape[-1])):
        return Unmatched("cos/sin do not have one column per pair of x's halves")
    return Match(x, c, s, False, cat, halves=False)


def _pair_source(pairs: Any) -> fx.Node | None:
    """x when pairs is x reshaped to (..., D/2, 2): adjacent elements of its last dim as pairs."""
    if not is_op(pairs, *RESHAPES, A.unflatten.int):
        return None
    x = pairs.args[0]
    xv, pv = val(x), val(pairs)
    ok = (isinstance(xv, torch.Tensor) and xv.dim() == pv.dim() - 1 and known_equal(pv.shape[-1], 2)
          and known_equal(2 * pv.shape[-2], xv.shape[-1])
          and all(known_equal(a, b) for a, b in zip(pv.shape[:-2], xv.shape[:-1])))
    return x if ok else None


def _unpairs(out: Any, x: fx.Node) -> bool:
    """out puts the (..., D/2, 2) pairs back into x's shape (flatten of the last two dims, or a reshape)."""
    if not is_op(out, A.flatten.using_ints, *RESHAPES):
        return False
    d = val(out.args[0]).dim()
    if is_op(out, A.flatten.using_ints) and not (out.args[1] % d == d - 2 and last_dim(arg(out, "end_dim", -1), d)):
        return False
    return val(out).dim() == val(x).dim() and all(known_equal(a, b) for a, b in zip(val(out).shape, val(x).shape))


def _pairs_match(graph: fx.Graph, x: fx.Node, table: fx.Node, out: fx.Node) -> Match:
    """The match of a rotation of x's adjacent pairs by a (..., D/2, 2) table of (cos, sin)."""
    # the op takes x in its own dtype and computes in fp32, as the model does after x.float()
    if cast_dtype(x) == torch.float32 and dtype_of(x.args[0]) in HALF:
        x = x.args[0]
    cos, sin = (insert_call(graph, out, A.select.int, (table, -1, i)) for i in (0, 1))
    return Match(x, cos, sin, True, out, halves=False)


def _match_complex(vr: fx.Node, graph: fx.Graph) -> Match | Unmatched | None:
    """From view_as_real(view_as_complex(x.reshape(..., D/2, 2)) * f) to its flattening back to
    x's shape; None when vr is not such a product. The tables are f's real and imaginary parts."""
    prod = vr.args[0]
    if not is_op(prod, A.mul.Tensor) or not all(isinstance(a, fx.Node) for a in prod.args[:2]):
        return None
    xc, f = prod.args[:2] if is_op(prod.args[0], A.view_as_complex.default) else prod.args[1::-1]
    x = _pair_source(xc.args[0]) if is_op(xc, A.view_as_complex.default) else None
    if x is None:
        return None
    if val(f).dtype != val(xc).dtype:
        return Unmatched(f"the rotation table is {val(f).dtype}, not {val(xc).dtype} as x's pairs")
    out = only_user(vr)
    if not _unpairs(out, x):
        return Unmatched("view_as_real(x * f) is not put back into x's shape")
    return _pairs_match(graph, x, insert_call(graph, out, A.view_as_real.default, (f,)), out)


def _pair_part(n: Any) -> tuple[fx.Node, int] | None:
    """(t, i) when n is t[..., i] of a last dim of 2."""
    if not is_op(n, A.select.int) or n.args[2] not in (0, 1):
        return None
    t = n.args[0]
    return (t, n.args[2]) if last_dim(n.args[1], val(t).dim()) and known_equal(val(t).shape[-1], 2) else None


def _match_pairs(flat: fx.Node, graph: fx.Graph) -> Match | Unmatched | None:
    """stack((x0 * c - x1 * s, x1 * c + x0 * s), -1) put back into x's shape, with x0, x1 the
    [..., 0] and [..., 1] of x reshaped to pairs and c, s those of a pair table (torchtune,
    gpt-fast); None when flat is not a stack of two such terms."""
    st = flat.args[0]
    if not (is_op(st, A.stack.default) and len(st.args[0]) == 2 and last_dim(arg(st, "dim", 0), val(st).dim())):
        return None
    first, second = st.args[0]
    if (not (is_op(first, A.sub.Tensor) and is_op(second, A.add.Tensor))
            or any(n.kwargs.get("alpha", 1) != 1 for n in (first, second))):
        return None
    products = []
    for term in (first, second):
        for p in term.args[:2]:
            parts = [_pair_part(a) for a in p.args[:2]] if is_op(p, A.mul.Tensor) else [None]
            if None in parts:
                return None
            products.append(frozenset(parts))
    bases = {t for p in products for t, _ in p}
    xs = [b for b in bases if _pair_source(b) is not None and _unpairs(flat, _pair_source(b))]
    if len(bases) != 2 or len(xs) != 1:
        return Unmatched("the pair products do not tell x (reshaped to pairs, flattened back) from one table")
    (table,) = bases - set(xs)
    x0, x1, c, s = (xs[0], 0), (xs[0], 1), (table, 0), (table, 1)
    if (products[:2] != [frozenset((x0, c)), frozenset((x1, s))]
            or set(products[2:]) != {frozenset((x1, c)), frozenset((x0, s))}):
        return Unmatched("the pair products are not the rotation (x0 * c - x1 * s, x1 * c + x0 * s)")
    return _pairs_match(graph, _pair_source(xs[0]), table, flat)


def _layout(m: Match) -> int | Unmatched:
    """The dim of x holding the heads (1: (B, H, S, D), 2: (B, S, H, D)), which the tables
    broadcast over while giving every position its own row; or why they do not fit."""
    xv, cv, sv = val(m.x), val(m.cos), val(m.sin)
    if xv.dim() != 4:
        return Unmatched(f"x has shape {tuple(xv.shape)}, not (B, H, S, D) or (B, S, H, D)")
    if tuple(cv.shape) != tuple(sv.shape) or cv.dim() > 4:
        return Unmatched(f"cos {tuple(cv.shape)} and sin {tuple(sv.shape)} are not tables of one shape")
    if learned(m.cos) or learned(m.sin):
        return Unmatched("cos/sin require grad, and flash.rotary gives no gradient for the tables")
    shape = (1,) * (4 - cv.dim()) + tuple(cv.shape)
    for heads, seq in ((1, 2), (2, 1)):
        if known_equal(shape[heads], 1) and known_equal(shape[seq], xv.shape[seq]) and cv.dim() >= 4 - seq:
            return heads
    return Unmatched(f"cos/sin of shape {tuple(cv.shape)} do not give each position its own angles, "
                     "shared by all heads")


def _half_table(graph: fx.Graph, before: fx.Node, t: fx.Node, m: Match, heads: int) -> fx.Node:
    """t's first half (even columns when interleaved; all of it without halves) without the
    heads dim: (B or 1, S, rd/2) or (S, rd/2)."""
    if not m.halves:
        h = t
    elif m.interleaved:
        h = insert_call(graph, before, A.slice.Tensor, (t, -1, 0, END, 2))
    else:
        h = getitem(graph, insert_call(graph, before, A.chunk.default, (t, 2, -1)), 0)
    dim = heads - (4 - val(t).dim())
    return insert_call(graph, before, A.squeeze.dim, (h, dim)) if dim >= 0 else h


def _replace(gm: fx.GraphModule, m: Match) -> Unmatched | None:
    """Put flash.rotary in the place of m.out; None when done, else why not."""
    heads = _layout(m)
    if isinstance(heads, Unmatched):
        return heads
    graph = gm.graph
    cos, sin = (_half_table(graph, m.out, t, m, heads) for t in (m.cos, m.sin))
    x = m.x if heads == 1 else insert_call(graph, m.out, A.transpose.int, (m.x, 1, 2))
    node = call_checked(graph, m.out, FLASH.rotary.default, (x, cos, sin), {"interleaved": m.interleaved})
    if isinstance(node, Unmatched):
        return node
    if heads == 2:
        node = insert_call(graph, m.out, A.transpose.int, (node, 1, 2))
    return replace(graph, m.out, node, "rotary")


def _pair_qk(gm: fx.GraphModule) -> None:
    """q and k rotated by the same tables (HF's apply_rotary_pos_emb and every spelling above
    rotate both): two flash.rotary calls with equal tables and flags become one flash.rotary_qk,
    one launch instead of two, placed at the second. What is computed from the first between the
    two (the transpose back of a (B, S, H, D) layout, a cast) moves after it; the second's
    arguments must not be among that."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    # in graph order, so that each call pairs with the next one of its tables (k after q)
    calls = sorted(graph.find_nodes(op="call_function", target=FLASH.rotary.default), key=order.__getitem__)
    taken: set[fx.Node] = set()
    for i, first in enumerate(calls):
        if first in taken or len(first.args) != 3:
            continue
        for second in calls[i + 1:]:
            if (second in taken or len(second.args) != 3 or first.kwargs != second.kwargs
                    or not same_value(first.args[1:], second.args[1:])):
                continue
            nodes = list(graph.nodes)  # merges move nodes: positions as they are now
            between = nodes[nodes.index(first) + 1:nodes.index(second)]
            moved = {first}
            for n in between:
                if any(i in moved for i in n.all_input_nodes):
                    moved.add(n)
            if any(i in moved for i in second.all_input_nodes):
                continue
            args = (first.args[0], second.args[0], *first.args[1:])
            qk = call_checked(graph, second, FLASH.rotary_qk.default, args, first.kwargs)
            if isinstance(qk, Unmatched):
                continue
            outs = [getitem(graph, qk, j) for j in (1, 0)][::-1]  # each right after qk: qk, [0], [1]
            for old, new in zip((first, second), outs):
                old.replace_all_uses_with(new)
                graph.erase_node(old)
            after = outs[-1]
            for n in between:
                if n in moved:
                    after.append(n)
                    after = n
            taken |= {first, second}
            break


def rewrite(gm: fx.GraphModule, report: Report) -> None:
    anchors = [(n, name) for target, name in ROTATIONS.items()
               for n in gm.graph.find_nodes(op="call_function", target=target)]
    anchors += [(n, "view_as_real") for n in gm.graph.find_nodes(op="call_function", target=A.view_as_real.default)]
    for n, anchor in anchors:
        m = _match_complex(n, gm.graph) if anchor == "view_as_real" else _match(n)
        if m is None and anchor == "rotate_every_two":
            m, anchor = _match_pairs(n, gm.graph), "stack of pair products"
        if m is None and anchor == "rotate_half":
            m, anchor = _match_half_products(n), "cat of half products"
        if m is None:
            continue
        # where x * cos + rotate(x) * sin is written, which tells q from k
        site = Site("rotary", location(m.out if isinstance(m, Match) else n), anchor)
        report.add(site)
        conclude(site, m if isinstance(m, Unmatched) else _replace(gm, m), "rotary")
    gm.graph.eliminate_dead_code()
    _pair_qk(gm)
