"""ALiBi proofs: whether a term added to the scores is per-head slopes times a position bias
that flash.attention computes from `alibi_slopes` (-slope * |i + Sk - Sq - j|, query i, key j),
up to a constant per query row, which softmax does not see.

A term is ALiBi-like when it is a product `slopes * positions` (through casts, views, slices,
expands, a negation or a constant factor, and Bloom's (B*H, 1, Sk) repeat or reshape) whose
slopes vary only over heads (and batch) and whose positions vary only over queries and keys
(and batch). The positions must be an index-only tensor that the index algebra (index.py)
reads as an affine a*j + b*i + c, or the absolute value of one; the proof then needs:

- |a*(j - i) + c| with c = -a*(Sk - Sq): ALiBi itself, with any mask;
- a*j + b*i + c (Bloom's and MPT's slope * key position): a*j - a*(i + Sk - Sq) differs from
  it by a constant per row, and equals -a*|i + Sk - Sq - j| on the keys that a causal mask
  (window right 0) leaves visible: only then;
- |a*(j - i) + c| under such a mask where its sign is fixed there: the affine case.

Positions read from data (Bloom's cumsum of a run-time attention mask: ALiBi only for left or
right padding, which a graph cannot show), slopes that need a gradient, a bias held in half
precision (rounded where the op's is not), or a diagonal elsewhere stay attn_bias, with the
reason. masks.py calls candidate() on each added term and prove() once the masks' band is
known."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...graph import A, cast_dtype, dtype_of, is_op, val
from .._shared import Unmatched, known_equal, learned
from .index import SHAPE_OPS, Index, Val
from .nodes import SAME, VIEWS, concrete, constant, op_kind, shape_of
from .operands import Operand, Part
from .windows import Window

EXACT = (torch.float32, torch.float64)


@dataclass
class Alibi:
    """flash.attention's alibi_slopes: factor * slopes, slopes read as (Hq,) or (B, Hq) through
    its ops; slopes None: one slope, factor, for every head (heads of them at rewrite)."""
    slopes: Operand | None
    factor: float
    heads: int = 0


@dataclass
class Candidate:
    """An ALiBi-like term before its proof: the bias is kappa * slopes * (|q| if absolute else q),
    q an affine int Val over the op's (B, Hq, Sq, Sk) scores."""
    part: Part
    slopes: Operand | None
    kappa: float
    q: Val
    absolute: bool


class _Through(Index):
    """The index algebra over the chain from a product up to the added term, the product standing
    for `seed`; the steps that only scale (their factor is counted apart) pass values through."""

    def __init__(self, product: fx.Node, seed: Val, scaling: set):
        super().__init__()
        self.memo[product] = seed
        self.scaling = scaling

    def _eval(self, n: fx.Node) -> Val | None:
        if n in self.scaling:
            return self._arg(n, 0, shape_of(n))
        return super()._eval(n)


def _scaled(node: fx.Node) -> tuple[fx.Node, float] | None:
    """(x, c) for node = -x, x * c or x / c with c a constant of x's shape (a step that only
    scales; an integer x becomes float exactly)."""
    t = op_kind(node)
    if t == A.neg.default:
        return node.args[0], -1.0
    if t not in (A.mul.Tensor, A.div.Tensor):
        return None
    a, b = node.args[:2]
    for x, c in ((a, b), (b, a)) if t == A.mul.Tensor else ((a, b),):
        k = constant(c)
        if isinstance(x, fx.Node) and k is not None and k != 0 and known_equal(val(x).numel(), val(node).numel()):
            return x, (k if t == A.mul.Tensor else 1.0 / k)
    return None


def _top(part: Part, shape: tuple):
    """(node, to_op, nodes passed) where to_op maps a Val over node's shape to the op's
    (B, Hq, Sq, Sk): the part itself (broadcast), or under a (B*H, x, y) term of (B, H) scores
    the (H, x, y) tensor it repeats B times or the (B, H, ...) one it merges (Bloom's alibi)."""
    node, passed = part.node, [part.node]
    if not (part.heads and val(node).dim() == 3 and not known_equal(shape_of(node)[0], 1)):
        return node, lambda v: v.to(shape), passed
    while cast_dtype(node) is not None or is_op(node, *SAME):
        node = node.args[0]
        passed.append(node)
    unflat = (shape[0], shape[1]) + shape_of(part.node)[1:]  # the (B, H, x, y) the op reads

    def to_op(sub):
        return lambda v: v.remap(unflat, sub).to(shape)

    src = node.args[0] if node.args else None
    if is_op(node, A.repeat.default) and list(node.args[1])[1:] == [1, 1] and val(src).dim() == 3:
        if known_equal(shape_of(src)[0], shape[1]):
            return src, to_op({0: (1, 1, 0), 1: (2, 1, 0), 2: (3, 1, 0)}), passed + [node]
    if is_op(node, *VIEWS):
        s = shape_of(src)
        rest = [d for d in range(2, len(s)) if not known_equal(s[d], 1)]
        dst = [d for d in (2, 3) if not known_equal(unflat[d], 1)]
        if (len(s) >= 2 and known_equal(s[0], shape[0]) and known_equal(s[1], shape[1]) and len(rest) == len(dst)
                and all(known_equal(s[a], unflat[b]) for a, b in zip(rest, dst))):
            sub = {0: (0, 1, 0), 1: (1, 1, 0)}
            sub.update({d: ((dst[rest.index(d)], 1, 0) if d in rest else (None, 1, 0)) for d in range(2, len(s))})
            return src, to_op(sub), passed + [node]
    return None


def _walk(top: fx.Node):
    """Down from top through casts, copies, shape ops and scaling steps to the first other node:
    (that node, the product of the scaling factors, the scaling nodes, the nodes passed)."""
    node, factor, scaling, chain = top, 1.0, set(), []
    while isinstance(node, fx.Node) and node.op == "call_function":
        chain.append(node)
        s = _scaled(node)
        if s is not None:
            scaling.add(node)
            node, factor = s[0], factor * s[1]
            continue
        t = op_kind(node)
        if cast_dtype(node) is not None or t in SAME + SHAPE_OPS or t in (A.expand.default, A.to.device):
            node = node.args[0]
            continue
        break
    return node, factor, scaling, chain


def _positions(node: Any) -> tuple[Val, float, bool] | None:
    """(affine int Val, sign, absolute) of an index-only position tensor: casts, negations,
    constant factors and one abs over an affine one."""
    sign, absolute = 1.0, False
    while isinstance(node, fx.Node):
        s = _scaled(node)
        if s is not None:
            node, sign = s[0], sign * s[1]
        elif cast_dtype(node) is not None or is_op(node, *SAME):
            node = node.args[0]
        elif is_op(node, A.abs.default) and not absolute:
            node, absolute = node.args[0], True
        else:
            break
    v = Index()(node) if isinstance(node, fx.Node) else None
    return None if v is None or v.kind != "int" else (v, sign, absolute)


def _dims(x: fx.Node, product: fx.Node) -> list[int]:
    """The dims of product's shape where x (broadcast into it) is not of size 1."""
    s, p = shape_of(x), shape_of(product)
    return [d + len(p) - len(s) for d in range(len(s)) if not known_equal(s[d], 1)]


def _mapped(product, dim, scaling, top, to_op, shifted: bool = False) -> int | None:
    """The op's dim that dim of the product becomes on the way up, None if not one dim as is
    (shifted: or sliced from an offset on)."""
    seed = Val("int", shape_of(product), ((dim, 1),), 0)
    v = _Through(product, seed, scaling)(top)
    v = None if v is None else to_op(v)
    if (v is None or v.kind != "int" or len(v.lin) != 1 or v.lin[0][1] != 1
            or not (shifted or known_equal(v.const, 0))):
        return None
    return v.lin[0][0]


def _slopes(s: fx.Node, product: fx.Node, scaling, top, to_op, shape: tuple) -> Operand | None:
    """The slope tensor s (broadcast into product) as (Hq,) or (B, Hq), or None where its varying
    dims are not heads (and batch) in that order."""
    dims = _dims(s, product)
    ops = [_mapped(product, d, scaling, top, to_op) for d in dims]
    if any(o not in (0, 1) for o in ops) or ops != sorted(set(ops)) or 1 not in ops:
        return None
    sizes = shape_of(product)
    if not all(known_equal(sizes[d], shape[o]) for d, o in zip(dims, ops)):
        return None  # heads sliced on the way
    return Operand(s).then(A.reshape.default, [shape[0], shape[1]] if 0 in ops else [shape[1]])


def candidate(part: Part, shape: tuple) -> Candidate | Unmatched | None:
    """The ALiBi-like term `part` over the op's scores of `shape` (B, Hq, Sq, Sk) before its
    proof; Unmatched where it is ALiBi-like but cannot be one; None where it is not ALiBi-like."""
    if part.kind != "add" or len(shape) != 4:
        return None
    top = _top(part, shape)
    if top is None:
        return None
    top, to_op, passed = top
    end, factor, scaling, chain = _walk(top)
    if is_op(end, A.mul.Tensor) and all(isinstance(a, fx.Node) for a in end.args[:2]):
        found = None
        for s, p in (end.args[:2], end.args[1::-1]):
            slopes = _slopes(s, end, scaling, top, to_op, shape)
            if slopes is None:
                continue
            pos = [_mapped(end, d, scaling, top, to_op, shifted=True) for d in _dims(p, end)]
            if set(pos) <= {0, 2, 3} and set(pos) & {2, 3}:
                found = s, p, slopes
                break
        if found is None:
            return None
        s, p, slopes = found
        if any((dtype_of(n) or torch.float32).is_floating_point and dtype_of(n) not in EXACT
               for n in passed + chain):
            return Unmatched("an ALiBi-like bias is computed in half precision (rounded, where the op's ALiBi is "
                             "not): left as attn_bias")
    else:
        s, p, slopes = None, end, None
    read = _positions(p)
    if read is None:
        if s is None:
            return None
        return Unmatched("an ALiBi-like bias (per-head slopes times a tensor over queries and keys) whose positions "
                         "are not built from indices alone (Bloom's: the cumsum of an attention mask, ALiBi only for "
                         "left or right padding, which the graph does not show); left as attn_bias")
    seed, sign, absolute = read
    product = end if s is not None else p
    q = _Through(product, seed.to(shape_of(product)), scaling)(top)
    q = None if q is None else to_op(q)
    if q is None or q.kind != "int":
        return None if s is None else Unmatched("the positions of an ALiBi-like bias do not map onto the scores' "
                                                "query and key dims; left as attn_bias")
    if s is None and not dict(q.lin).get(3):
        return None  # constant along the keys: not a position bias
    if any((dtype_of(n) or torch.float32).is_floating_point and dtype_of(n) not in EXACT for n in passed + chain):
        return None  # positions in half precision, rounded
    if s is not None and learned(s):
        return Unmatched("ALiBi slopes that require grad (flash.attention gives alibi_slopes none): "
                         "left as attn_bias")
    return Candidate(part, slopes, part.mult * factor * sign, q, absolute)


def prove(c: Candidate, window: Window | None, shape: tuple) -> Alibi | Unmatched:
    """The op's slopes for c where the masks keep keys within `window` (None: no band proven)."""
    lin = dict(c.q.lin)
    a, b, k = lin.pop(3, 0), lin.pop(2, 0), c.q.const
    sq, sk = shape[2], shape[3]
    causal = window is not None and window.right == 0
    if lin and (c.absolute or set(lin) != {0}):
        return Unmatched("an ALiBi-like bias varies over heads in its positions: left as attn_bias")
    if c.absolute:
        if b != -a or a == 0:
            return Unmatched("an ALiBi-like bias |a*j + b*i + c| is not a distance between query and key: "
                             "left as attn_bias")
        if known_equal(k, -a * (sk - sq)):
            return _alibi(c, -c.kappa * abs(a), shape)  # kappa * |a| * |i + Sk - Sq - j|
        # a causal mask keeps j - i <= Sk - Sq, where a*(j - i) + k may keep one sign
        if causal and a > 0 and statically_known_true(a * (sk - sq) + k <= 0):
            return _alibi(c, -c.kappa * a, shape)
        if causal and a < 0 and statically_known_true(a * (sk - sq) + k >= 0):
            return _alibi(c, c.kappa * a, shape)
        return Unmatched("an ALiBi-like bias measures |i - j| from another diagonal than the bottom-right one, "
                         "where flash.attention's ALiBi does: left as attn_bias")
    if not causal:
        return Unmatched("an ALiBi-like bias linear in the key position (slope * j) is ALiBi only under a causal "
                         "mask, which this site does not have: left as attn_bias")
    return _alibi(c, c.kappa * a, shape)  # a*j - a*(i + Sk - Sq) on keys j <= i + Sk - Sq


def _alibi(c: Candidate, factor: float, shape: tuple) -> Alibi | Unmatched:
    if c.slopes is not None:
        return Alibi(c.slopes, factor)
    heads = concrete(shape[1])
    if heads is None:
        return Unmatched("a position bias with one slope for all heads, whose head count is not a constant: "
                         "left as attn_bias")
    return Alibi(None, factor, heads)


def bounded(a: Alibi, shape: tuple) -> bool:
    """Whether every ALiBi term is above -5000 (scores sq + sk apart at most), so that a mask fill
    at or below -1e9, which the op reads as the score -1e4, still weighs nothing next to any key
    the row sees: the slopes evaluated now (computed from constants in the graph) and the sizes
    static. A slope tensor the model holds (a buffer) may change: not read."""
    from .nodes import evaluated

    sq, sk = concrete(shape[2]), concrete(shape[3])
    if sq is None or sk is None:
        return False
    if a.slopes is None:
        top = abs(a.factor)
    else:
        s = evaluated(a.slopes.node, 1 << 20)
        if s is None or not s.is_floating_point():
            return False
        top = abs(a.factor) * float(s.abs().max()) if s.numel() else 0.0
    return math.isfinite(top) and top * (sq + sk) <= 5000
