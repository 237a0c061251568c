"""Attention spellings -> flash.attention.

Anchors: `aten.scaled_dot_product_attention` (F.scaled_dot_product_attention) and softmax.
From a softmax over the last dim the walk goes up through an fp32 upcast, the mask
(additive `+ m`, `masked_fill(c, -inf)`, `where(c, s, -inf)`), a tanh softcap, the scale
(`* c`, `/ c`, or none when q is pre-scaled) to `q @ k^T` with k possibly repeated for
GQA (repeat_kv's expand + reshape, or repeat_interleave over heads); and down through a
cast back, dropout and `@ v` (v repeated like k). Masks become `attn_bias` (bool keep-mask
or additive float), which keeps the model's semantics exactly; rows the mask hides
entirely give 0 where softmax over -inf gives NaN.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..graph import (A, cast_dtype, dtype_of, insert_call, is_op, last_dim, location, number,
                     only_user, split_const, val)
from ..report import Report, Site
from ._shared import call_checked, known_equal, replace

FLASH = torch.ops.flash
SOFTMAX = (A.softmax.int, A._softmax.default)
MATMUL = (A.matmul.default,)


@dataclass
class Match:
    q: fx.Node
    k: fx.Node
    v: fx.Node
    out: fx.Node
    scale: float
    attn_bias: fx.Node | None = None
    negate_mask: bool = False  # masked_fill masks say where to hide: the op wants where to keep
    softcap: float = 0.0
    dropout_p: float = 0.0
    causal: bool = False


def _unrepeat(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(kv, n_rep) when node repeats kv's heads n_rep times in repeat_kv order (head h reads
    kv head h // n_rep); (node, 1) when it is not a repeat; None for a repeat of another order."""
    v = val(node)
    if is_op(node, A.repeat_interleave.self_int):
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if dim in (1, -3) and isinstance(node.args[1], int):
            return node.args[0], node.args[1]
        return None
    if is_op(node, A.reshape.default, A.view.default, A._unsafe_view.default):
        e = node.args[0]
        if is_op(e, A.expand.default):
            src = e.args[0]
            sv, ev = val(src), val(e)
            # repeat_kv: x[:, :, None] (B, Hkv, 1, S, D) expanded to (B, Hkv, n, S, D), then merged
            if sv.dim() == 5 and ev.dim() == 5 and sv.shape[2] == 1 and v.dim() == 4:
                base = src.args[0] if is_op(src, A.unsqueeze.default) else None
                if base is not None and val(base).dim() == 4 and v.shape[1] == ev.shape[1] * ev.shape[2]:
                    return base, int(ev.shape[2])
    if is_op(node, A.repeat.default):
        return None
    return node, 1


def _scores(node: fx.Node, m: Match) -> tuple[fx.Node, fx.Node] | str:
    """Walk from the softmax input up to q @ k^T; fills scale/mask/softcap on m; returns (q, k^T)."""
    cur = node
    if cast_dtype(cur) == torch.float32:
        cur = cur.args[0]
    if is_op(cur, A.add.Tensor) and all(isinstance(a, fx.Node) for a in cur.args[:2]):
        a, b = cur.args[:2]
        # the scores are the operand with the matmul below them; the other is the mask
        cur, m.attn_bias = (a, b) if _reaches_matmul(a) else (b, a)
    elif is_op(cur, A.masked_fill.Scalar) and number(cur.args[2]) == -math.inf:
        m.attn_bias, m.negate_mask, cur = cur.args[1], True, cur.args[0]
    elif is_op(cur, A.where.self) and number(cur.args[2]) is None and _is_neg_inf_fill(cur.args[2]):
        m.attn_bias, cur = cur.args[0], cur.args[1]
    if cast_dtype(cur) == torch.float32:
        cur = cur.args[0]
    # softcap: c * tanh(s / c)
    if is_op(cur, A.mul.Tensor):
        t, c = split_const(cur)
        if is_op(t, A.tanh.default) and is_op(t.args[0], A.div.Tensor):
            inner, c2 = split_const(t.args[0])
            if c is not None and c == c2:
                m.softcap, cur = c, inner
    scale = 1.0
    if is_op(cur, A.mul.Tensor, A.div.Tensor):
        base, c = split_const(cur)
        if base is None:
            return "the scores are scaled by a tensor, not a constant"
        scale, cur = (c if cur.target == A.mul.Tensor else 1.0 / c), base
    if not is_op(cur, *MATMUL):
        return "the softmax input is not (q @ k^T) times a constant, plus an optional mask"
    m.scale = scale
    return cur.args[0], cur.args[1]


def _reaches_matmul(node: fx.Node, depth: int = 6) -> bool:
    for _ in range(depth):
        if is_op(node, *MATMUL):
            return True
        if not isinstance(node, fx.Node) or node.op != "call_function" or not node.args:
            return False
        node = node.args[0]
    return False


def _is_neg_inf_fill(node) -> bool:
    if isinstance(node, fx.Node) and is_op(node, A.full.default, A.scalar_tensor.default):
        return number(node.args[-1] if is_op(node, A.full.default) else node.args[0]) == -math.inf
    return number(node) == -math.inf


def _key(kt: fx.Node) -> fx.Node | None:
    """k from k^T = k.transpose(-1, -2) (either order of the dims)."""
    if is_op(kt, A.transpose.int) and sorted(d % 4 for d in kt.args[1:3]) == [2, 3]:
        return kt.args[0]
    return None


def _match(softmax: fx.Node) -> Match | str:
    if not last_dim(softmax.args[1], val(softmax).dim()):
        return "softmax is not over the last dimension"
    if val(softmax).dim() != 4:
        return "scores are not 4-D (batch, heads, queries, keys); merged batch*heads is not matched yet"
    m = Match(None, None, None, None, 1.0)
    qkt = _scores(softmax.args[0], m)
    if isinstance(qkt, str):
        return qkt
    q, kt = qkt
    k = _key(kt)
    if k is None:
        return "the key operand is not k.transpose(-1, -2)"
    # down: cast back, dropout, @ v
    cur, nxt = softmax, only_user(softmax)
    if nxt is not None and cast_dtype(nxt) is not None:
        cur, nxt = nxt, only_user(nxt)
    if is_op(nxt, A.dropout.default):
        pr = number(nxt.args[1])
        if pr is None:
            return "dropout probability is not a constant"
        m.dropout_p, cur, nxt = pr, nxt, only_user(nxt)
    if not is_op(nxt, *MATMUL) or nxt.args[0] is not cur:
        return "the probabilities are not multiplied by v (or are used elsewhere, e.g. returned as weights)"
    v = nxt.args[1]
    uk, uv = _unrepeat(k), _unrepeat(v)
    if uk is None or uv is None:
        return "k/v heads are repeated in an order other than repeat_kv's (tile), which GQA does not match"
    (k, nk), (v, nv) = uk, uv
    if nk != nv:
        return "k and v are repeated a different number of times"
    m.q, m.k, m.v, m.out = q, k, v, nxt
    if dtype_of(q) != dtype_of(k) or dtype_of(k) != dtype_of(v):
        return "q, k and v have different dtypes"
    return m


def _replace(gm: fx.GraphModule, m: Match) -> str:
    """flash.attention in m.out's place: "" when done, else why not."""
    bias = m.attn_bias
    if bias is not None and m.negate_mask:
        bias = insert_call(gm.graph, m.out, A.logical_not.default, (bias,))
    node = call_checked(gm.graph, m.out, FLASH.attention.default, (m.q, m.k, m.v, bias),
                        {"scale": m.scale, "causal": m.causal, "softcap": m.softcap, "dropout_p": m.dropout_p})
    return node if isinstance(node, str) else replace(gm.graph, m.out, node, "attention")


def _match_sdpa(n: fx.Node) -> Match | str:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    args = dict(zip(names, n.args))
    args.update(n.kwargs)
    q, k, v = args["query"], args["key"], args["value"]
    if val(q).dim() != 4:
        return "SDPA inputs are not 4-D (batch, heads, seq, dim)"
    scale = args.get("scale")
    if scale is not None and number(scale) is None:
        return "scale is not a constant"
    dropout_p = args.get("dropout_p", 0.0)
    if number(dropout_p) is None:
        return "dropout_p is not a constant"
    causal = bool(args.get("is_causal", False))
    if causal and not known_equal(val(q).shape[-2], val(k).shape[-2]):
        return "is_causal with Sq != Sk (SDPA aligns top-left, flash.attention bottom-right)"
    return Match(q, k, v, n, number(scale) if scale is not None else val(q).shape[-1] ** -0.5,
                 attn_bias=args.get("attn_mask"), dropout_p=float(dropout_p), causal=causal)


def rewrite(gm: fx.GraphModule, report: Report) -> None:
    anchors = [(n, "F.scaled_dot_product_attention", _match_sdpa)
               for n in gm.graph.find_nodes(op="call_function", target=A.scaled_dot_product_attention.default)]
    anchors += [(n, "softmax", _match) for target in SOFTMAX
                for n in gm.graph.find_nodes(op="call_function", target=target)]
    for n, anchor, match in anchors:
        site = Site("attention", location(n), anchor)
        report.add(site)
        m = match(n)
        if isinstance(m, str):
            site.reason = m if anchor != "softmax" else f"softmax not rewritten to attention: {m}"
            continue
        site.reason = _replace(gm, m)
        if not site.reason:
            site.op = "attention"
