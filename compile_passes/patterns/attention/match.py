"""Matching softmax(q @ k^T) @ v from its softmax: the walk up the scores to the q-k product
(matmul, bmm/baddbmm or a two-operand einsum in any layout), reading every step on the way
(casts, the scale by mul/div or baddbmm's alpha, a scale from a dynamic head dim or read from
a one-value tensor, a tanh softcap, added terms, masked_fill/where masks, views between
(B*H, ...) and (B, H, ...)), then down from the softmax through casts, dropout and merging
views to the product with v. The steps fold into a Match (operands.py), whose masks
masks.py then sorts into a window and attn_bias."""
from __future__ import annotations

import math
import string
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ...graph import A, cast_dtype, dtype_of, is_op, last_dim, number, only_user, val
from .._shared import Unmatched, arg, known_equal, same_value
from .masks import fold_masks
from .nodes import MASKED, VIEWS, concrete, constant, copies, merges, op_kind, same_shape, shape_of, target_name
from .operands import Match, Operand, Part, fill_operands, scale_operand, transposed, unmerged, unviewed
from .sinks import row_max_shift, sink_column, sliced_off


# _safe_softmax (math SDPA's) gives 0 on a row of -inf only, as flash.attention does
SOFTMAX = (A.softmax.int, A._softmax.default, A._safe_softmax.default)


@dataclass
class Step:
    """One step between the q-k product and the softmax, as the walk reads it."""
    kind: str  # cast | scale | symscale | tensorscale | softcap | add | keep
    # | heads ((B*H, ...) viewed as (B, H, ...)) | merge ((B, H, ...) viewed as (B*H, ...))
    node: fx.Node
    value: Any = None
    part: Part | None = None


# -- the products

LETTERS = string.ascii_letters


def _einsum(node: fx.Node) -> tuple[list[str], str] | None:
    """Subscripts of a two-operand einsum (ellipses spelled out), or None."""
    eq, ops = node.args[0].replace(" ", ""), node.args[1]
    if len(ops) != 2:
        return None
    lhs, _, rhs = eq.partition("->")
    ins = lhs.split(",")
    ell = ""
    if "..." in eq:
        n = max(val(o).dim() - (len(s) - 3) for o, s in zip(ops, ins) if "..." in s)
        ell = "".join([ch for ch in LETTERS if ch not in eq][:n])
        ins = [s.replace("...", ell[n - (val(o).dim() - (len(s) - 3)):]) for o, s in zip(ops, ins)]
        rhs = rhs.replace("...", ell)
    if "->" not in eq:  # implicit output: the ellipsis, then the letters used once, sorted
        joined = "".join(ins)
        rhs = ell + "".join(sorted(ch for ch in set(joined) - set(ell) if joined.count(ch) == 1))
    if any(len(set(s)) != len(s) for s in ins + [rhs]):
        return None
    return ins, rhs


def _perm(src: str, order: str) -> tuple | None:
    """The permutation taking subscripts src to order; None when it is the identity."""
    p = tuple(src.index(ch) for ch in order)
    return None if p == tuple(range(len(p))) else p


def _permuted(x: fx.Node, src: str, order: str) -> Operand:
    p = _perm(src, order)
    return Operand(x) if p is None else Operand(x).then(A.permute.default, list(p))


def _qk(product: fx.Node) -> tuple[Any, Any, list[Step]] | Unmatched:
    """(q, k^T node or a k Operand, extra steps) of the q-k product."""
    if is_op(product, A.matmul.default, A.bmm.default):
        a, b = product.args
        if val(a).dim() != val(b).dim():
            return Unmatched("q and k^T have different ranks")
        return a, b, []
    if is_op(product, A.baddbmm.default):
        inp, a, b = product.args[:3]
        beta, alpha = arg(product, "beta", 1), arg(product, "alpha", 1)
        if number(alpha) is None or number(beta) is None:
            return Unmatched("baddbmm's alpha or beta is not a constant")
        steps = [Step("scale", product, float(alpha))]
        if beta != 0:  # beta == 0 ignores the input (torch.empty in GPT-2's reordered path)
            steps.append(Step("add", product, part=Part("add", inp, float(beta))))
        return a, b, steps
    parsed = _einsum(product)
    if parsed is None:
        return Unmatched("the einsum is not a two-operand product with distinct subscripts")
    (sa, sb), out = parsed
    contracted = set(sa) & set(sb) - set(out)
    qi, ki = set(sa) - set(sb), set(sb) - set(sa)
    batch = [ch for ch in out if ch in sa and ch in sb]
    if (len(contracted) != 1 or len(qi) != 1 or len(ki) != 1 or set(out) != set(batch) | qi | ki
            or out[-2:] != qi.pop() + ki.pop()):
        return Unmatched(f"the einsum {product.args[0]!r} is not q.k over the head dim with "
                         "(..., queries, keys) last")
    d = contracted.pop()
    a, b = product.args[1]
    return (_permuted(a, sa, "".join(batch) + out[-2] + d),
            _permuted(b, sb, "".join(batch) + out[-1] + d), [])


def _is_product(n: Any) -> bool:
    if is_op(n, A.matmul.default, A.bmm.default, A.baddbmm.default):
        return True
    return is_op(n, A.einsum.default) and len(n.args[1]) == 2


def _pv(node: Any, p: fx.Node, rank: int) -> tuple[Any, tuple] | Unmatched:
    """(v or a v Operand, view ops from (B, H, Sq, Dv) to the product's layout) of p @ v."""
    if is_op(node, A.matmul.default, A.bmm.default):
        if node.args[0] is not p:
            return Unmatched("the probabilities are the right operand of the product with v")
        if val(node.args[1]).dim() != rank:
            return Unmatched("v and the probabilities have different ranks")
        return node.args[1], ()
    if not (is_op(node, A.einsum.default) and len(node.args[1]) == 2 and p in node.args[1]):
        return Unmatched("the probabilities are not multiplied by v")
    parsed = _einsum(node)
    if parsed is None:
        return Unmatched("the einsum with v has repeated subscripts")
    ins, out = parsed
    i = node.args[1].index(p)
    sp, sv = ins[i], ins[1 - i]
    batch, qs, ks = sp[:-2], sp[-2], sp[-1]
    dv = set(sv) - set(sp)
    if (len(sp) != rank or len(dv) != 1 or set(sv) != set(batch) | {ks} | dv
            or set(out) != set(batch) | {qs} | dv):
        return Unmatched(f"the einsum {node.args[0]!r} is not probabilities @ v over the keys")
    d = dv.pop()
    p_out = _perm(batch + qs + d, out)
    return _permuted(node.args[1][1 - i], sv, batch + ks + d), (() if p_out is None else
                                                                ((A.permute.default, (list(p_out),)),))


# -- the walk

def _walk(node: Any, shape: tuple, steps: list) -> fx.Node | Unmatched:
    """Walk up from the softmax input to the q-k product, appending the steps passed (from the
    softmax upwards). shape: the scores' shape, which every step keeps."""
    cur = node
    while True:
        if not isinstance(cur, fx.Node) or cur.op != "call_function":
            return Unmatched("the softmax input is not computed from q @ k^T")
        if _is_product(cur):
            if not same_shape(shape_of(cur), shape):
                return Unmatched("q @ k^T is broadcast to a larger shape by a mask or bias")
            return cur
        t, src = op_kind(cur), cur.args[0] if cur.args else None
        if cast_dtype(cur) is not None:
            steps.append(Step("cast", cur))
            cur = src
            continue
        if (t in VIEWS and len(shape) == 4 and val(src).dim() == 3
                and known_equal(shape[0] * shape[1], shape_of(src)[0]) and same_shape(shape_of(src)[1:], shape[2:])):
            steps.append(Step("heads", cur, shape[:2]))  # (B*H, Sq, Sk) scores viewed as (B, H, Sq, Sk)
            shape, cur = shape_of(src), src
            continue
        if t in VIEWS and len(shape) == 3 and merges(src, cur):
            steps.append(Step("merge", cur, shape_of(src)[:2]))  # (B, H, Sq, Sk) scores viewed as (B*H, Sq, Sk)
            shape, cur = shape_of(src), src
            continue
        if not same_shape(shape_of(cur), shape):
            return Unmatched(f"the scores change shape at {target_name(cur)} before the softmax")
        if t in (A.mul.Tensor, A.div.Tensor):
            step = _scale_step(cur)
            if isinstance(step, Unmatched):
                return step
            steps.append(step[0])
            cur = step[1]
            continue
        if t in (A.add.Tensor, A.sub.Tensor):
            return _walk_add(cur, shape, steps)
        if t in (A.masked_fill.Scalar, A.masked_fill.Tensor):
            fill = constant(cur.args[2])
            if fill is None or fill > MASKED:
                return Unmatched(f"masked scores are set to {cur.args[2]}, not -inf or a large negative value")
            steps.append(Step("keep", cur, part=Part("keep", cur.args[1], positive=False, fill=fill, overwrite=True)))
            cur = src
            continue
        if t in (A.where.self, A.where.ScalarOther, A.where.ScalarSelf):
            c, a, b = cur.args[:3]
            fa, fb = constant(a), constant(b)
            scores, fill, positive = (a, fb, True) if fa is None else (b, fa, False)
            if fill is None or fill > MASKED:
                return Unmatched("torch.where picks between the scores and something other than -inf or a large "
                                 "negative value")
            steps.append(Step("keep", cur, part=Part("keep", c, positive=positive, fill=fill, overwrite=True)))
            cur = scores
            continue
        return Unmatched(f"the scores pass through {target_name(cur)} between q @ k^T and the softmax")


def _walk_add(node: fx.Node, shape: tuple, steps: list) -> fx.Node | Unmatched:
    """The walk through s + b, s - b or b + s: the operand the product is above is s."""
    a, b = node.args[:2]
    alpha = number(node.kwargs.get("alpha", 1))
    if alpha is None:
        return Unmatched("the scores are added with a non-constant alpha")
    sign = alpha if op_kind(node) == A.add.Tensor else -alpha
    if not isinstance(b, fx.Node) or constant(b) is not None:
        steps.append(Step("cast", node))  # + a constant: softmax does not see it
        return _walk(a, shape, steps)
    first = []
    top = _walk(a, shape, first)
    if isinstance(top, fx.Node):
        steps += [Step("add", node, part=Part("add", b, sign))] + first
        return top
    second = []
    if sign == 1 and isinstance(a, fx.Node) and isinstance(top2 := _walk(b, shape, second), fx.Node):
        steps += [Step("add", node, part=Part("add", a))] + second
        return top2
    return top


def _scale_step(node: fx.Node) -> tuple[Step, fx.Node] | Unmatched:
    """The step a multiplication or division of the scores is: softcap, scale, or a scale
    computed from a symbolic head dim (dynamic shapes)."""
    cap = _softcap(node)
    if cap is not None:
        return Step("softcap", node, cap[1]), cap[0]
    s = scale_operand(node)
    if s is not None:
        return Step("scale", node, s[1]), s[0]
    a, b = node.args[:2]
    div = op_kind(node) == A.div.Tensor
    for x, c in ((a, b),) if div else ((a, b), (b, a)):
        if isinstance(x, fx.Node) and isinstance(val(c), (torch.SymFloat, torch.SymInt)):
            return Step("symscale", node, (c, div)), x
    for x, c in ((a, b),) if div else ((a, b), (b, a)):
        # a scale the model reads at run time (an input or buffer: Inductor's _sfdp patterns)
        if (isinstance(x, fx.Node) and same_shape(shape_of(x), shape_of(node)) and dtype_of(x) == dtype_of(node)
                and isinstance(c, fx.Node) and isinstance(val(c), torch.Tensor) and val(c).numel() == 1
                and val(c).is_floating_point()):
            return Step("tensorscale", node, (c, div)), x
    return Unmatched("the scores are multiplied by a tensor that is not one value")


def _softcap(node: fx.Node) -> tuple[fx.Node, float] | None:
    """(s, c) for node = c * tanh(s / c)."""
    s = scale_operand(node)
    if s is None or not is_op(s[0], A.tanh.default):
        return None
    inner = scale_operand(s[0].args[0])
    c = s[1]
    if inner is None or c <= 0 or not math.isclose(inner[1] * c, 1.0, rel_tol=1e-6):
        return None
    return inner[0], c


def _fold(steps: list[Step], m: Match, merged: bool) -> Unmatched | None:
    """Apply the steps in computation order onto m's scale, softcap and parts; None or why not.
    merged: the product is (B*H, Sq, Sk); its terms are marked for a (B, H) op (m.heads)."""
    for st in reversed(steps):
        m.chain.append(st.node)
        if st.kind in ("heads", "merge"):
            merged = st.kind == "merge"
        if st.part is not None and merged:
            st.part.heads = m.heads
        if st.kind in ("scale", "symscale", "tensorscale"):
            if m.softcap:
                return Unmatched("the scores are scaled after the tanh softcap")
            if st.kind == "symscale":
                if m.parts:
                    return Unmatched("a mask or bias is added before a scale computed from a dynamic size")
                m.sym.append(st.value)
                continue
            if st.kind == "tensorscale":
                if m.parts:
                    return Unmatched("a mask or bias is added before a scale read from a tensor")
                m.runtime.append(st.value)  # any sign: q * c @ k^T is (q @ k^T) * c
                continue
            if st.value < 0:
                return Unmatched("the scores are multiplied by a negative constant")
            m.scale *= st.value
            for p in m.parts:
                p.mult *= st.value  # (s + b) * c = s * c + b * c; masks stay masks
        elif st.kind == "softcap":
            if m.softcap or m.parts:
                return Unmatched("the tanh softcap comes after a mask or bias "
                                 "(flash.attention applies it before)")
            m.softcap = st.value
        elif st.kind in ("add", "keep"):
            m.parts.append(st.part)
    return None


def _depends_on(x: fx.Node, target: fx.Node, order: dict) -> bool:
    """target is among x's inputs (nodes before target in the graph are skipped)."""
    seen, todo = set(), [x]
    while todo:
        n = todo.pop()
        if n is target:
            return True
        if n in seen or order.get(n, math.inf) < order[target]:
            continue
        seen.add(n)
        # expand_as(mask, scores) reads only the scores' shape (Inductor's _sfdp patterns)
        todo.extend([n.args[0]] if is_op(n, A.expand_as.default) else n.all_input_nodes)
    return False


def _all_masked(cond: Any, x: Any, dim: Any) -> list[fx.Node] | None:
    """The nodes of cond when it is core ATen's "every x of the row is -inf":
    all(x == -inf, dim, True), or not(any(not(x == -inf), dim, True))."""
    nodes = []
    negated = is_op(cond, A.logical_not.default)
    if negated:
        nodes.append(cond)
        cond = cond.args[0]
    if not (is_op(cond, A.any.dim) if negated else is_op(cond, A.all.dim)) or not arg(cond, "keepdim"):
        return None
    if not (isinstance(dim, int) and cond.args[1] % val(x).dim() == dim % val(x).dim()):
        return None
    nodes.append(cond)
    eq = cond.args[0]
    if negated:
        if not is_op(eq, A.logical_not.default):
            return None
        nodes.append(eq)
        eq = eq.args[0]
    if not (is_op(eq, A.eq.Scalar) and eq.args[0] is x and number(eq.args[1]) == -math.inf):
        return None
    return nodes + [eq]


def softmax_of(n: fx.Node) -> tuple[Any, Any, list[fx.Node]] | None:
    """(x, dim, the nodes computing it) when n is softmax(x, dim): a softmax op, core ATen's
    decomposition exp(x - amax(x, dim, True)) / sum(exp(x - amax(x, dim, True)), dim, True), or
    that of math SDPA's _safe_softmax, where(every x of the row is -inf, 0, softmax(x))."""
    if is_op(n, *SOFTMAX):
        return n.args[0], n.args[1], [n]
    if is_op(n, A.where.self):
        cond, zeros, out = n.args[:3]
        inner = softmax_of(out) if isinstance(out, fx.Node) else None
        if inner is None or not (is_op(zeros, A.full_like.default, A.zeros_like.default) and zeros.args[0] is out
                                 and (is_op(zeros, A.zeros_like.default) or number(zeros.args[1]) == 0)):
            return None
        x, dim, nodes = inner
        rows = _all_masked(cond, x, dim)
        return None if rows is None else (x, dim, [n, zeros, *rows, *nodes])
    if not is_op(n, A.div.Tensor):
        return None
    e, total = n.args[:2]
    if not (is_op(total, A.sum.dim_IntList) and total.args[0] is e and arg(total, "keepdim")
            and is_op(e, A.exp.default) and is_op(e.args[0], A.sub.Tensor) and not e.args[0].kwargs):
        return None
    x, top = e.args[0].args
    dim = total.args[1]
    if not (is_op(top, A.amax.default) and same_value(top.args[0], x) and arg(top, "keepdim")
            and list(top.args[1]) == list(dim)):
        return None
    return x, dim, [n, total, e, e.args[0], top]


def match_softmax(softmax: fx.Node, order: dict) -> Match | Unmatched:
    """The site of softmax(q @ k^T) @ v around a softmax (softmax_of); order: each node's graph
    position."""
    x, dim, nodes = softmax_of(softmax)
    ndim = val(softmax).dim()
    if not last_dim(dim, ndim):
        return Unmatched("softmax is not over the last dimension")
    if ndim not in (3, 4):
        return Unmatched(f"the scores are {ndim}-D, not (batch, heads, queries, keys) or "
                         "(batch*heads, queries, keys)")
    x, around = row_max_shift(x)
    joined = sink_column(x)
    if isinstance(joined, Unmatched):
        return joined
    sinks = None
    if joined is not None:
        x, sinks, joins = joined
        around += joins
    steps: list = []
    product = _walk(x, shape_of(x), steps)
    if isinstance(product, Unmatched):
        return product
    qk = _qk(product)
    if isinstance(qk, Unmatched):
        return qk
    q, kt, extra = qk
    steps.extend(reversed(extra))
    views = [st.value for st in steps if st.kind in ("heads", "merge")]
    if views and isinstance(q, Operand):
        return Unmatched("an einsum over merged batch*heads is viewed back into (batch, heads)")
    m = Match(None, None, None, None, merged=ndim == 3 and not views, sinks=sinks)
    # down: the sink column sliced off, casts, copies, dropout, the probabilities viewed as
    # (B*H, Sq, Sk), @ v
    cur, chain = softmax, nodes + around
    if sinks is not None:
        cur = sliced_off(softmax, shape_of(x)[-1])
        if isinstance(cur, Unmatched):
            return cur
        chain.append(cur)
    nxt = only_user(cur)
    while (is_op(nxt, A.dropout.default) or (nxt is not None and cast_dtype(nxt) is not None) or copies(nxt)
           or (is_op(nxt, *VIEWS) and merges(cur, nxt))):
        if is_op(nxt, A.dropout.default):
            p = number(nxt.args[1])
            if p is None:
                return Unmatched("the dropout probability is not a constant")
            if m.dropout_p:
                return Unmatched("dropout is applied twice")
            m.dropout_p = p
        elif is_op(nxt, *VIEWS):
            views.append(shape_of(cur)[:2])
        cur = nxt
        chain.append(cur)
        nxt = only_user(cur)
    if nxt is None:
        return Unmatched("the probabilities are used more than once (e.g. also returned as attention weights)")
    if views:  # merged (B*H, ...) tensors viewed as (B, H, ...): the op runs on those
        m.heads = concrete(views[0][1])
        if m.heads is None:
            return Unmatched("(batch*heads) tensors are viewed as (batch, heads) with a head count that is "
                             "not a constant")
    pv = _pv(nxt, cur, val(cur).dim())
    if isinstance(pv, Unmatched):
        return pv
    v, m.out_ops = pv
    m.out = nxt
    if m.heads:
        q, kt, v = (unviewed(x, m.heads) for x in (q, kt, v))
        q, kt, v = (unmerged(x, m.heads) for x in (q, transposed(kt), v))
        if val(nxt).dim() == 3:
            m.out_ops += ((A.flatten.using_ints, (0, 1)),)
    err = _fold(steps, m, val(product).dim() == 3)
    if err:
        return err
    if any(_depends_on(p.node, product, order) for p in m.parts):
        return Unmatched("a term added to the scores is itself computed from the scores")
    m.chain += chain + [product]
    m = fill_operands(m, q, kt, v)
    if isinstance(m, Match):
        fold_masks(m, tuple(views[0]) + shape_of(x)[-2:] if views else shape_of(x))
        if sinks is not None:  # rows the masks hide entirely give the sink all their weight: out 0, as the op's
            m.uniform_rows = m.zero_rows = False
    return m
