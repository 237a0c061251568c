"""What a matched attention site hands flash.attention: Match, its q, k and v Operands (a
node and the view ops the rewrite applies to it) and the Parts of the scores that are not
q @ k^T (added terms, masks). fill_operands folds constant scales out of q and k into the
op's scale, reads a scale computed from a dynamic head dim as the op's default, and undoes
GQA's repeats of k and v (repeat_kv's expand + reshape, repeat_interleave, an expand of one
head), which the op reads as kv head h // n."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ...graph import A, dtype_of, is_op, number, val
from .._shared import Unmatched, arg, known_equal
from .nodes import FUNCTIONAL, VIEWS, concrete, constant, copies, int_arg, merges, op_kind, same_shape, shape_of
from .windows import Window


@dataclass
class Operand:
    """A tensor for the op: node, then the view ops (op, extra args) applied at rewrite time."""
    node: fx.Node
    ops: tuple = ()

    def then(self, op, *args) -> "Operand":
        return Operand(self.node, self.ops + ((op, args),))


@dataclass
class Part:
    """One term of the scores: `add` s + mult * node; `keep` hides the scores where node
    differs from positive: adds fill there, or sets the score to fill (overwrite: masked_fill
    and where on the scores), fill being -inf or a large negative value."""
    kind: str
    node: fx.Node
    mult: float = 1.0
    positive: bool = True
    fill: float = -math.inf
    overwrite: bool = False
    heads: int = 0  # H when node is a (B*H, ...) term of scores the op sees as (B, H, ...)


@dataclass
class Match:
    q: Operand
    k: Operand
    v: Operand
    out: fx.Node  # the node flash.attention's result replaces
    out_ops: tuple = ()  # view ops from (B, Hq, Sq, Dv) to out's layout
    merged: bool = False  # (B*H, S, D) tensors, run as B*H heads of one batch
    heads: int = 0  # H: (B*H, ...) tensors viewed as (B, H, ...) for the op
    scale: float | None = 1.0  # None: D ** -0.5
    sym: list = field(default_factory=list)  # (node, divides) scales computed from dynamic sizes
    runtime: list = field(default_factory=list)  # (node, divides) one-element scale tensors, folded into q
    softcap: float = 0.0
    dropout_p: float = 0.0
    window: Window = Window()
    parts: list = field(default_factory=list)  # what stays attn_bias
    uniform_rows: bool = False  # rows the parts (finite overwrites) hide entirely average v (masks.py)
    zero_rows: bool = False  # the model's scores less q @ k^T as attn_bias, q = 0 where they are all (rewrite.py)
    alibi: Any = None  # alibi.Alibi: the op's alibi_slopes, proven from a term of the scores
    sinks: Any = None  # Operand of the op's sinks (H,): a column joined to the scores (sinks.py)
    notes: list = field(default_factory=list)  # why a term that looks like ALiBi stayed attn_bias
    chain: list = field(default_factory=list)  # nodes the op makes dead (in-place ones included)


def transposed(kt: Any) -> Operand:
    """k from k^T: the transpose's input when it is one, else a transpose of kT."""
    if isinstance(kt, Operand):
        return kt
    r = val(kt).dim()
    if (is_op(kt, A.transpose.int) and {kt.args[1] % r, kt.args[2] % r} == {r - 2, r - 1}
            or is_op(kt, A.permute.default) and [d % r for d in kt.args[1]] == [*range(r - 2), r - 1, r - 2]):
        return Operand(kt.args[0])
    return Operand(kt).then(A.transpose.int, -2, -1)


def scale_operand(node: Any) -> tuple[fx.Node, float] | None:
    """(x, c) for node = x * c or x / c with c a constant and x of node's shape and dtype."""
    t = op_kind(node)
    if t not in (A.mul.Tensor, A.div.Tensor):
        return None
    a, b = node.args[:2]
    for x, c in ((a, b), (b, a)) if t == A.mul.Tensor else ((a, b),):
        k = constant(c)
        if isinstance(x, fx.Node) and k is not None and k != 0 and same_shape(shape_of(x), shape_of(node)) \
                and dtype_of(x) == dtype_of(node):
            return x, (k if t == A.mul.Tensor else 1.0 / k)
    return None


def _unscaled(op: Operand) -> tuple[Operand, float]:
    """op with scalar multiplications of its tensor folded out, and their product."""
    factor, node = 1.0, op.node
    while (s := scale_operand(node)) is not None and FUNCTIONAL.get(node.target) is None:
        node, c = s
        factor *= c
    return Operand(node, op.ops), factor


def unrepeat(op: Operand, head: int = 1) -> tuple[Operand, int] | None:
    """(kv, n) when op repeats kv's heads (dim `head`) n times in repeat_kv order (head h
    reads kv head h // n); (op, 1) when it repeats nothing; None for another order (tile)."""
    node = op.node
    if op.ops:
        return op, 1
    v = val(node)
    if is_op(node, A.transpose.int):
        a, b = (d % v.dim() for d in node.args[1:3])
        if head in (a, b):
            inner = unrepeat(Operand(node.args[0]), b if head == a else a)
            if inner is None:
                return None
            kv, n = inner
            return (Operand(node), 1) if n == 1 else (kv.then(A.transpose.int, *node.args[1:3]), n)
    if is_op(node, A.repeat_interleave.self_int):
        dim = arg(node, "dim")
        n = concrete(int_arg(node.args[1]))
        if dim is not None and dim % v.dim() == head and n is not None:
            return Operand(node.args[0]), n
        return None
    if is_op(node, *VIEWS) or is_op(node, A.flatten.using_ints):
        e = node.args[0]
        while copies(e):  # core ATen's reshape clones the expand first
            e = e.args[0]
        if is_op(e, A.expand.default):
            src, ev = e.args[0], val(e)
            # x.unsqueeze(head + 1).expand(..., Hkv, n, ...) merged back into one head dim
            if (ev.dim() == v.dim() + 1 and is_op(src, A.unsqueeze.default) and src.args[1] % ev.dim() == head + 1
                    and known_equal(val(src).shape[head + 1], 1)
                    and same_shape(shape_of(src.args[0])[:head], tuple(v.shape[:head]))
                    and same_shape(shape_of(src.args[0])[head + 1:], tuple(v.shape[head + 1:]))
                    and known_equal(v.shape[head], ev.shape[head] * ev.shape[head + 1])):
                n = concrete(ev.shape[head + 1])
                return None if n is None else (Operand(src.args[0]), n)
    if is_op(node, A.expand.default):
        src = node.args[0]
        s = shape_of(src)
        # one kv head broadcast over all query heads (MQA); nothing else expanded
        if (len(s) == v.dim() and known_equal(s[head], 1) and not known_equal(v.shape[head], 1)
                and all(known_equal(a, b) for i, (a, b) in enumerate(zip(s, v.shape)) if i != head)):
            n = concrete(v.shape[head])
            return None if n is None else (Operand(src), n)
    if is_op(node, A.repeat.default) and any(r != 1 for r in node.args[1]):
        return None
    return op, 1


def unviewed(x: Any, heads: int) -> Any:
    """The (B, heads, S, D) tensor whose (B*heads, S, D) view x is, through copies (core ATen's
    matmul: expand, then view as bmm's operand); else x."""
    if not is_op(x, *VIEWS):
        return x
    src = x.args[0]
    while copies(src):
        src = src.args[0]
    return src if merges(src, x) and known_equal(shape_of(src)[1], heads) else x


def unmerged(x: Any, heads: int) -> Operand:
    """A (B*H, S, D) operand as (B, H, S, D); a 4-D one as it is."""
    x = x if isinstance(x, Operand) else Operand(x)
    return x.then(A.unflatten.int, 0, [-1, heads]) if val(x.node).dim() == 3 else x


def _head_power(x: Any, d: Any) -> float | None:
    """e when x computes d ** e from the (symbolic) head dim d: sym_float, ** and sqrt."""
    if not isinstance(x, fx.Node):
        return None
    v = val(x)
    if isinstance(v, torch.SymInt) and known_equal(v, d):
        return 1.0
    if x.op != "call_function":
        return None
    if x.target in (torch.sym_float, operator.pos):
        return _head_power(x.args[0], d)
    if x.target in (math.sqrt, torch._sym_sqrt):
        base = _head_power(x.args[0], d)
        return None if base is None else base / 2
    if x.target is operator.pow and number(x.args[1]) is not None:
        base = _head_power(x.args[0], d)
        return None if base is None else base * number(x.args[1])
    if x.target is operator.truediv and number(x.args[0]) == 1:
        base = _head_power(x.args[1], d)
        return None if base is None else -base
    return None


def fill_operands(m: Match, q: Any, kt: Any, v: Any) -> Match | Unmatched:
    """Fill m.q/k/v: scales folded out of q and k, GQA repeats undone."""
    q, c = _unscaled(q if isinstance(q, Operand) else Operand(q))
    m.scale *= c
    if not isinstance(kt, Operand):  # (an einsum gives k itself)
        kt, c = _unscaled(Operand(kt))
        m.scale *= c
        kt = transposed(kt.node)
    k, c = _unscaled(kt)
    m.scale *= c
    v = v if isinstance(v, Operand) else Operand(v)
    if not m.merged:
        uk, uv = unrepeat(k), unrepeat(v)
        if uk is None or uv is None:
            return Unmatched("k/v heads are repeated in tile order (x.repeat), not repeat_kv's; "
                             "GQA reads kv head h // n")
        (k, nk), (v, nv) = uk, uv
        if nk != nv:
            return Unmatched(f"k is repeated {nk} times per head but v {nv} times")
        k, c = _unscaled(k)
        m.scale *= c
    m.q, m.k, m.v = q, k, v
    if m.sym:
        perm = next((a[0] for op, a in q.ops if op == A.permute.default), None)
        d = shape_of(q.node)[-1 if perm is None else perm[-1]]
        powers = [_head_power(x, d) for x, _ in m.sym]
        if None in powers or sum(-e if div else e for e, (_, div) in zip(powers, m.sym)) != -0.5 \
                or not math.isclose(m.scale, 1.0):
            return Unmatched("the scores are scaled by a value computed from dynamic sizes other than "
                             "1/sqrt(head dim)")
        m.scale = None  # flash.attention's default, D ** -0.5
    return m
