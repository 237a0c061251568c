"""Attention spellings -> flash.attention.

Anchors: softmax over the last dim (math SDPA's `_safe_softmax` included), and
`aten.scaled_dot_product_attention` (its is_causal, attn_mask, scale, dropout_p and
enable_gqa map onto the op's arguments).

From a softmax the walk goes up a chain of elementwise steps to the q-k product:
dtype casts; the scale (`* c`, `/ c`, baddbmm's alpha, or folded into q or k before the
product, as math SDPA's sqrt(scale) into q and k^T; c a constant, or a one-value tensor
read at run time, which goes into q as q * c);
a tanh softcap `c * tanh(s / c)`; additive terms (`+ bias`, `- bias`, baddbmm's
input); masks (`masked_fill(m, v)`, `where(m, s, v)` with v = -inf or a large negative value
such as finfo.min). The product is `q @ k^T`, bmm/baddbmm on merged (B*H, S, D) tensors
(run as B*H heads of one batch, or as (B, H) where the scores or the probabilities are
viewed so: MBart's mask added in a 4-D view, Bloom's ALiBi as baddbmm's input), or an
einsum in any layout; k and v may be repeated for GQA (repeat_kv's expand + reshape,
repeat_interleave over heads, or an expand of one head).
Down from the softmax: a cast back, dropout, and the product with v.

Masks built inside the graph are read by an index algebra (_Index): a tensor made from
arange, ones/full, triu/tril, comparisons, where/masked_fill and logical ops is a predicate
over the query and key indices. One that provably keeps a band around the bottom-right
diagonal (j - i within fixed offsets of Sk - Sq) becomes `causal` / window arguments and no
tensor. Sums of terms and and-ed keep conditions are split first, so HF's causal & padding
mask becomes causal=True plus the padding piece. Everything else -- masks that arrive as
inputs, ALiBi and T5 biases, a chunked or top-left causal pattern -- becomes `attn_bias`,
which keeps the model's semantics.

Exactness. A rewrite computes what the model computes, to the op's tolerance, on every query
row that sees at least one key: a score hidden with -inf or a value <= -1e4 (finfo.min in
HF models) weighs exp(-1e4 + s) = 0 in fp32 next to any visible score above -9900, so both
fills hide alike. A row that -inf masks hide entirely gives 0 (as SDPA and FlashAttention
do) where the model gives NaN. A finite fill makes the model average v over the keys it
fills on such a row (HF eager, left-padded query rows): where a mask that is not a band
(padding) may hide a whole row, nothing is split and the model's own terms go in as
attn_bias, which flash.attention reads alike (_masks); a finite fill that overwrites the
scores there (masked_fill) also cuts the rows' gradient to q and k, and is left alone.
Dropout draws its own mask (flash.attention's Philox stream), so training with dropout
matches the model in distribution, not bit for bit.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import string
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..graph import A, cast_dtype, dtype_of, insert_call, is_op, last_dim, location, number, val
from ..report import Report, Site
from ._shared import arg, call_checked, known_equal, replace

FLASH = torch.ops.flash
# _safe_softmax (math SDPA's) gives 0 on a row of -inf only, as flash.attention does
SOFTMAX = (A.softmax.int, A._softmax.default, A._safe_softmax.default)
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


def _kind(node: Any):
    """The functional op a node computes (in-place ops as their out-of-place forms)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"):
        return None
    return FUNCTIONAL.get(node.target) or SCALAR.get(node.target, node.target)


def _shape(node: Any) -> tuple:
    return tuple(val(node).shape)


def _same_shape(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(known_equal(x, y) for x, y in zip(a, b))


def _concrete(x: Any) -> int | None:
    """x as a Python int when it is one (a SymInt whose expression is a constant included)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        return x.node.maybe_as_int()
    return None


def _int_arg(x: Any) -> Any:
    """An int or SymInt argument (a node computing a size included), else None."""
    if isinstance(x, fx.Node):
        x = val(x)
    return x if isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool) else None


def _constant(x: Any) -> float | None:
    """x as a Python number: a number, or a one-element tensor the graph fills with one
    (torch.full([], c), scalar_tensor, zeros/ones), through casts."""
    n = number(x)
    if n is not None or not isinstance(x, fx.Node):
        return n
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
    if cast_dtype(x) is not None or is_op(x, *SAME, A.lift_fresh_copy.default, A.to.device):
        return _constant(x.args[0])
    return None


# ------------------------------------------------------------------------- index algebra
#
# A formula is ("const", bool), ("ge", ((dim, coef), ...), c) meaning
# sum(coef * index[dim]) + c >= 0, or ("and" | "or", f, g), ("not", f). Dims are those of
# the tensor the formula describes; sizes and offsets may be SymInts.

TRUE, FALSE = ("const", True), ("const", False)


def _f_and(f, g):
    if f == FALSE or g == FALSE:
        return FALSE
    return g if f == TRUE else f if g == TRUE else ("and", f, g)


def _f_or(f, g):
    if f == TRUE or g == TRUE:
        return TRUE
    return g if f == FALSE else f if g == FALSE else ("or", f, g)


def _f_not(f):
    if f[0] == "const":
        return ("const", not f[1])
    return f[1] if f[0] == "not" else ("not", f)


def _atom(lin: dict, c: Any):
    """sum(lin[d] * index[d]) + c >= 0, folded to a constant when it is one."""
    lin = tuple(sorted((d, k) for d, k in lin.items() if k != 0))
    if not lin:
        if statically_known_true(c >= 0):
            return TRUE
        if statically_known_true(c < 0):
            return FALSE
    return ("ge", lin, c)


def _f_map(f, form):
    """f with every affine form (lin dict, c) replaced by form(lin, c)."""
    if f[0] == "const":
        return f
    if f[0] == "ge":
        return _atom(*form(dict(f[1]), f[2]))
    if f[0] == "not":
        return _f_not(_f_map(f[1], form))
    return (_f_and if f[0] == "and" else _f_or)(_f_map(f[1], form), _f_map(f[2], form))


@dataclass(frozen=True)
class _Val:
    """What an index-only tensor holds, as a function of its indices. kind "int": the affine
    sum(lin[d] * index[d]) + const; "bool": a formula; "float": cases ((formula, value), ...)
    whose formulas partition the indices."""
    kind: str
    shape: tuple
    lin: tuple = ()
    const: Any = 0
    formula: Any = TRUE
    cases: tuple = ()

    def remap(self, shape: tuple, sub: dict) -> "_Val":
        """The same values over new dims: old index[d] = mult * new index[nd] + offset for
        sub[d] = (nd or None, mult, offset). Coefficients of size-1 dims are dropped."""
        unit = {i for i, s in enumerate(shape) if known_equal(s, 1)}

        def form(lin, c):
            out = {}
            for d, k in lin.items():
                nd, mult, off = sub[d]
                c = c + k * off
                if nd is not None and nd not in unit:
                    out[nd] = out.get(nd, 0) + k * mult
            return out, c

        if self.kind == "int":
            lin, c = form(dict(self.lin), self.const)
            return _Val("int", shape, tuple(sorted(lin.items())), c)
        if self.kind == "bool":
            return _Val("bool", shape, formula=_f_map(self.formula, form))
        return _Val("float", shape, cases=_cases(tuple((_f_map(f, form), v) for f, v in self.cases)))

    def to(self, shape: tuple) -> "_Val | None":
        """Broadcast to shape (right-aligned), None when the shapes do not broadcast."""
        r, n = len(self.shape), len(shape)
        if r > n or not all(known_equal(s, 1) or known_equal(s, t) for s, t in zip(self.shape, shape[n - r:])):
            return None
        return self.remap(shape, {d: (d + n - r, 1, 0) for d in range(r)})


def _cases(cases) -> tuple:
    """Cases with impossible ones dropped and equal values merged."""
    merged: dict = {}
    for f, v in cases:
        if f != FALSE:
            key = "nan" if v != v else v
            merged[key] = (_f_or(merged[key][0], f), v) if key in merged else (f, v)
    return tuple(merged.values())


def _const_val(value: Any, dtype: torch.dtype, shape: tuple) -> _Val | None:
    if dtype == torch.bool:
        return _Val("bool", shape, formula=TRUE if value else FALSE)
    if dtype.is_floating_point:
        x = _constant(value)
        return None if x is None else _Val("float", shape, cases=((TRUE, x),))
    iv = _int_arg(value)
    return None if iv is None else _Val("int", shape, const=iv)


def _scalar(x: Any) -> _Val | None:
    """A Python scalar (or a node computing a size) as a 0-d value."""
    if isinstance(x, bool):
        return _Val("bool", (), formula=TRUE if x else FALSE)
    iv = _int_arg(x)
    if iv is not None:
        return _Val("int", (), const=iv)
    n = number(x)
    return None if n is None else _Val("float", (), cases=((TRUE, n),))


def _as_bool(v: _Val) -> _Val | None:
    if v.kind == "bool":
        return v
    if v.kind == "int":
        lin = dict(v.lin)
        # x != 0 for an integer affine x: x >= 1 or -x >= 1
        pos = _atom(lin, v.const - 1)
        neg = _atom({d: -k for d, k in lin.items()}, -v.const - 1)
        return _Val("bool", v.shape, formula=_f_or(pos, neg))
    f = FALSE
    for g, x in v.cases:
        if x != 0:
            f = _f_or(f, g)
    return _Val("bool", v.shape, formula=f)


def _as_float(v: _Val, dtype: torch.dtype) -> _Val | None:
    if v.kind == "bool":
        return _Val("float", v.shape, cases=_cases(((v.formula, 1.0), (_f_not(v.formula), 0.0))))
    if v.kind == "float":
        # rounding to the target dtype (finfo(float32).min becomes -inf in fp16)
        return _Val("float", v.shape, cases=_cases(
            tuple((f, torch.tensor(x, dtype=dtype).item()) for f, x in v.cases)))
    # integers stay integers where the dtype holds them exactly
    return v if dtype in (torch.float32, torch.float64) else None


def _numeric(v: _Val) -> _Val | None:
    """v as float cases: bools as 1/0, integer constants as themselves (affine ones: None)."""
    if v.kind == "int":
        c = _concrete(v.const)
        return None if v.lin or c is None else _Val("float", v.shape, cases=((TRUE, float(c)),))
    return _as_float(v, torch.float64)


def _compare(op: str, a: _Val, b: _Val, shape: tuple) -> _Val | None:
    a, b = a.to(shape), b.to(shape)
    if a is None or b is None:
        return None
    if a.kind == "int" and b.kind == "int":
        lin = dict(a.lin)
        for d, k in b.lin:
            lin[d] = lin.get(d, 0) - k
        c = a.const - b.const  # a - b = lin . idx + c
        neg = {d: -k for d, k in lin.items()}
        ge, le = _atom(lin, c), _atom(neg, -c)
        f = {"ge": ge, "gt": _atom(lin, c - 1), "le": le, "lt": _atom(neg, -c - 1),
             "eq": _f_and(ge, le)}.get(op)
        f = _f_not(_f_and(ge, le)) if op == "ne" else f
        return _Val("bool", shape, formula=f)
    if a.kind == "bool" and b.kind == "bool" and op in ("eq", "ne"):
        same = _f_or(_f_and(a.formula, b.formula), _f_and(_f_not(a.formula), _f_not(b.formula)))
        return _Val("bool", shape, formula=same if op == "eq" else _f_not(same))
    a, b = _numeric(a), _numeric(b)
    if a is None or b is None:
        return None
    test = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt,
            "eq": operator.eq, "ne": operator.ne}[op]
    f = FALSE
    for fa, x in a.cases:
        for fb, y in b.cases:
            if test(x, y):
                f = _f_or(f, _f_and(fa, fb))
    return _Val("bool", shape, formula=f)


def _binary(fn, a: _Val, b: _Val, shape: tuple) -> _Val | None:
    """Elementwise fn of two float-valued (or bool, as 0/1) values."""
    a, b = a.to(shape), b.to(shape)
    a, b = (None if x is None else _numeric(x) for x in (a, b))
    if a is None or b is None:
        return None
    return _Val("float", shape, cases=_cases(tuple(
        (_f_and(fa, fb), fn(x, y)) for fa, x in a.cases for fb, y in b.cases)))


def _where(c: _Val, a: _Val, b: _Val, shape: tuple) -> _Val | None:
    c, a, b = (None if t is None else t.to(shape) for t in (c, a, b))
    if c is None or a is None or b is None:
        return None
    c = _as_bool(c)
    if a.kind == "bool" and b.kind == "bool":
        return _Val("bool", shape, formula=_f_or(_f_and(c.formula, a.formula),
                                                 _f_and(_f_not(c.formula), b.formula)))
    a, b = _numeric(a), _numeric(b)
    if a is None or b is None:
        return None
    return _Val("float", shape, cases=_cases(
        tuple((_f_and(c.formula, f), x) for f, x in a.cases)
        + tuple((_f_and(_f_not(c.formula), f), x) for f, x in b.cases)))


COMPARE = {A.ge.Tensor: "ge", A.ge.Scalar: "ge", A.gt.Tensor: "gt", A.gt.Scalar: "gt",
           A.le.Tensor: "le", A.le.Scalar: "le", A.lt.Tensor: "lt", A.lt.Scalar: "lt",
           A.eq.Tensor: "eq", A.eq.Scalar: "eq", A.ne.Tensor: "ne", A.ne.Scalar: "ne"}
AND = (A.logical_and.default, A.bitwise_and.Tensor, A.__and__.Tensor)
OR = (A.logical_or.default, A.bitwise_or.Tensor, A.__or__.Tensor)
NOT = (A.logical_not.default, A.bitwise_not.default)
FACTORIES = (A.ones.default, A.zeros.default, A.full.default, A.new_ones.default, A.new_zeros.default,
             A.new_full.default, A.ones_like.default, A.zeros_like.default, A.full_like.default,
             A.scalar_tensor.default)


SHAPE_OPS = (A.unsqueeze.default, A.squeeze.dim, A.squeeze.dims, A.squeeze.default, A.permute.default,
             A.transpose.int, A.slice.Tensor, A.select.int) + VIEWS


class _Index:
    """Evaluates the index-only subgraph under a node into a _Val; None where a value
    depends on data (an input, a parameter, a random op) or on an op it does not model."""

    DEPTH = 64  # masks are a few ops deep; deeper chains are data

    def __init__(self):
        self.memo: dict = {}
        self.depth = 0

    def __call__(self, x: Any) -> _Val | None:
        if not isinstance(x, fx.Node):
            return _scalar(x)
        if x not in self.memo:
            if self.depth >= self.DEPTH:
                return None
            self.depth += 1
            try:
                self.memo[x] = self._eval(x)
            finally:
                self.depth -= 1
        return self.memo[x]

    def _eval(self, n: fx.Node) -> _Val | None:
        v = val(n)
        if not isinstance(v, torch.Tensor):
            return _scalar(n)
        if n.op != "call_function":
            return None
        shape, t = tuple(v.shape), _kind(n)
        if t in (A.arange.default, A.arange.start, A.arange.start_step):
            if v.dtype.is_floating_point and v.dtype not in (torch.float32, torch.float64):
                return None
            ints = [_int_arg(a) for a in n.args]
            start = ints[0] if t != A.arange.default else 0
            step = ints[2] if t == A.arange.start_step else 1
            if start is None or _concrete(step) is None:
                return None
            return _Val("int", shape, ((0, _concrete(step)),) if not known_equal(shape[0], 1) else (), start)
        if t in FACTORIES:
            fill = {A.ones.default: 1, A.ones_like.default: 1, A.new_ones.default: 1, A.zeros.default: 0,
                    A.zeros_like.default: 0, A.new_zeros.default: 0}.get(t)
            if fill is None:
                fill = n.args[0] if t == A.scalar_tensor.default else n.args[2 if t == A.new_full.default else 1]
            return _const_val(fill, v.dtype, shape)
        if t in SAME or t == A.expand.default:
            return self._arg(n, 0, shape)
        if cast_dtype(n) is not None or t == A.to.device:
            x = self(n.args[0])
            if x is None:
                return None
            if v.dtype == torch.bool:
                return _as_bool(x)
            if v.dtype.is_floating_point:
                return _as_float(x, v.dtype)
            return x if x.kind == "int" else None
        if t in COMPARE:
            a, b = self(n.args[0]), self(n.args[1])
            return None if a is None or b is None else _compare(COMPARE[t], a, b, shape)
        if t in AND + OR:
            a, b = self._arg(n, 0, shape), self._arg(n, 1, shape)
            if a is None or b is None or a.kind != "bool" or b.kind != "bool":
                return None
            return _Val("bool", shape, formula=(_f_and if t in AND else _f_or)(a.formula, b.formula))
        if t in NOT:
            a = self(n.args[0])
            return None if a is None or a.kind != "bool" else _Val("bool", shape, formula=_f_not(a.formula))
        if t in (A.add.Tensor, A.sub.Tensor, A.mul.Tensor, A.neg.default):
            return self._arith(n, t, shape)
        if t in (A.where.self, A.where.ScalarOther, A.where.ScalarSelf, A.where.Scalar):
            return _where(self(n.args[0]), self(n.args[1]), self(n.args[2]), shape)
        if t in (A.masked_fill.Scalar, A.masked_fill.Tensor):
            return _where(self(n.args[1]), self(n.args[2]), self(n.args[0]), shape)
        if t in (A.triu.default, A.tril.default):
            x, k = self(n.args[0]), _int_arg(n.args[1] if len(n.args) > 1 else n.kwargs.get("diagonal", 0))
            if x is None or k is None or len(shape) < 2:
                return None
            r, c = len(shape) - 2, len(shape) - 1
            # triu keeps col - row >= k, tril keeps col - row <= k; the rest becomes 0
            keep = _atom({c: 1, r: -1}, -k) if t == A.triu.default else _atom({c: -1, r: 1}, k)
            zero = _const_val(0, torch.bool if x.kind == "bool" else torch.float64, ())
            return _where(_Val("bool", shape, formula=keep), x, zero, shape)
        return self._shape_op(n, t, shape) if t in SHAPE_OPS else None

    def _arg(self, n: fx.Node, i: int, shape: tuple) -> _Val | None:
        x = self(n.args[i])
        return None if x is None else x.to(shape)

    def _arith(self, n: fx.Node, t, shape: tuple) -> _Val | None:
        if t == A.neg.default:
            a, b, t = _Val("int", (), const=0), self(n.args[0]), A.sub.Tensor
        else:
            a, b = self(n.args[0]), self(n.args[1])
        if a is None or b is None:
            return None
        alpha = n.kwargs.get("alpha", 1)
        if a.kind == "int" and b.kind == "int":
            a, b = a.to(shape), b.to(shape)
            if a is None or b is None:
                return None
            if t == A.mul.Tensor:
                if a.lin and b.lin:
                    return None  # a product of two indices is not affine
                if a.lin:
                    a, b = b, a
                k = _concrete(a.const)
                if k is None:
                    return None
                return _Val("int", shape, tuple((d, c * k) for d, c in b.lin), b.const * a.const)
            sign = alpha if t == A.add.Tensor else -alpha
            lin = dict(a.lin)
            for d, c in b.lin:
                lin[d] = lin.get(d, 0) + sign * c
            return _Val("int", shape, tuple(sorted(lin.items())), a.const + sign * b.const)
        if t == A.mul.Tensor and a.kind == "bool" and b.kind == "bool":
            a, b = a.to(shape), b.to(shape)
            return None if a is None or b is None else _Val("bool", shape, formula=_f_and(a.formula, b.formula))
        fn = {A.add.Tensor: lambda x, y: x + alpha * y, A.sub.Tensor: lambda x, y: x - alpha * y,
              A.mul.Tensor: operator.mul}[t]
        return _binary(fn, a, b, shape)

    def _shape_op(self, n: fx.Node, t, shape: tuple) -> _Val | None:
        """Views and slices: which old index each new index reads."""
        x = self(n.args[0]) if n.args else None
        if x is None:
            return None
        old, r = x.shape, len(x.shape)
        if t == A.unsqueeze.default:
            d = n.args[1] % len(shape)
            return x.remap(shape, {i: (i + (i >= d), 1, 0) for i in range(r)})
        if t in (A.squeeze.dim, A.squeeze.dims, A.squeeze.default):
            dims = (range(r) if t == A.squeeze.default
                    else [n.args[1]] if t == A.squeeze.dim else n.args[1])
            gone = {d % r for d in dims if known_equal(old[d % r], 1)}
            keep = [i for i in range(r) if i not in gone]
            return x.remap(shape, {i: ((keep.index(i), 1, 0) if i in keep else (None, 1, 0)) for i in range(r)})
        if t in (A.permute.default, A.transpose.int):
            perm = list(n.args[1]) if t == A.permute.default else list(range(r))
            if t == A.transpose.int:
                a, b = n.args[1] % r, n.args[2] % r
                perm[a], perm[b] = perm[b], perm[a]
            return x.remap(shape, {p % r: (i, 1, 0) for i, p in enumerate(perm)})
        if t in VIEWS:
            # only views that add or drop size-1 dims keep the index map simple
            src = [i for i in range(r) if not known_equal(old[i], 1)]
            dst = [i for i in range(len(shape)) if not known_equal(shape[i], 1)]
            if len(src) != len(dst) or not all(known_equal(old[i], shape[j]) for i, j in zip(src, dst)):
                return None
            return x.remap(shape, {i: ((dst[src.index(i)], 1, 0) if i in src else (None, 1, 0)) for i in range(r)})
        if t == A.slice.Tensor:
            d = (n.args[1] if len(n.args) > 1 else 0) % r
            start = n.args[2] if len(n.args) > 2 and n.args[2] is not None else 0
            step = _concrete(n.args[4] if len(n.args) > 4 else 1)
            start = _int_arg(start)
            if start is None or step is None:
                return None
            if _concrete(start) is not None and _concrete(start) < 0:
                start = start + old[d]
            return x.remap(shape, {i: ((i, step, start) if i == d else (i, 1, 0)) for i in range(r)})
        if t == A.select.int:
            d, i0 = n.args[1] % r, _int_arg(n.args[2])
            if i0 is None:
                return None
            if _concrete(i0) is not None and _concrete(i0) < 0:
                i0 = i0 + old[d]
            return x.remap(shape, {i: ((None, 1, i0) if i == d else (i - (i > d), 1, 0)) for i in range(r)})
        return None


# ------------------------------------------------------------------------- windows

@dataclass(frozen=True)
class Window:
    """Keys j visible to query i: i + Sk - Sq - left <= j <= i + Sk - Sq + right (-1: unbounded)."""
    left: int = -1
    right: int = -1


def _nnf(f):
    """f with negations pushed onto the atoms (not(e >= 0) is -e - 1 >= 0)."""
    if f[0] == "not":
        g = f[1]
        if g[0] == "const":
            return ("const", not g[1])
        if g[0] == "ge":
            return _atom({d: -k for d, k in g[1]}, -g[2] - 1)
        if g[0] == "not":
            return _nnf(g[1])
        return ("or" if g[0] == "and" else "and", _nnf(("not", g[1])), _nnf(("not", g[2])))
    if f[0] in ("and", "or"):
        return (f[0], _nnf(f[1]), _nnf(f[2]))
    return f


def _known_max(a, b, larger: bool):
    """max (larger) or min of two bounds, None meaning unbounded on that side."""
    if a is None or b is None:
        return b if a is None else a
    if statically_known_true(a >= b):
        return a if larger else b
    if statically_known_true(b >= a):
        return b if larger else a
    raise _Unproven("bounds of unknown order")


class _Unproven(Exception):
    pass


EMPTY = "empty"


def _band(f, r: int, c: int, sq: Any, sk: Any):
    """The set of d = key - query where the formula holds, as (lo, hi) (None: unbounded) or
    EMPTY; raises _Unproven when it is not one interval of d."""
    if f[0] == "const":
        return (None, None) if f[1] else EMPTY
    if f[0] == "ge":
        lin, k = dict(f[1]), f[2]
        if set(lin) - {r, c}:
            raise _Unproven("the mask varies over batch or heads")
        a, b = lin.get(r, 0), lin.get(c, 0)
        if a == -b and b in (1, -1):
            return (-k, None) if b == 1 else (None, k)  # d >= -k, or d <= k
        # a condition on one index alone must hold everywhere or nowhere
        size, coef = (sk, b) if a == 0 else (sq, a)
        if (a == 0) == (b == 0) or coef not in (1, -1):
            raise _Unproven("the mask is not a function of key - query")
        lo, hi = (k, k + size - 1) if coef == 1 else (k - size + 1, k)  # range of coef * x + k
        if statically_known_true(lo >= 0):
            return (None, None)
        if statically_known_true(hi < 0):
            return EMPTY
        raise _Unproven("the mask cuts the query or key range at a position of unknown size")
    x, y = _band(f[1], r, c, sq, sk), _band(f[2], r, c, sq, sk)
    if f[0] == "and":
        if x is EMPTY or y is EMPTY:
            return EMPTY
        return (_known_max(x[0], y[0], True), _known_max(x[1], y[1], False))
    if x is EMPTY or (y is not EMPTY and y[0] is None and y[1] is None):
        return y
    if y is EMPTY or (x[0] is None and x[1] is None):
        return x
    raise _Unproven("the mask is a union of bands")


def _window(f, shape: tuple) -> Window | str:
    """The window a keep-formula over scores of `shape` (..., Sq, Sk) amounts to, or why not."""
    sq, sk = shape[-2], shape[-1]
    try:
        band = _band(_nnf(f), len(shape) - 2, len(shape) - 1, sq, sk)
    except _Unproven as e:
        return str(e)
    if band is EMPTY:
        return "the mask hides every key"
    lo, hi = band
    diag = sk - sq
    if hi is not None and statically_known_true(hi >= sk - 1):
        hi = None
    if lo is not None and statically_known_true(lo <= 1 - sq):
        lo = None
    right = None if hi is None else _concrete(hi - diag)
    left = None if lo is None else _concrete(diag - lo)
    if (hi is not None and right is None) or (lo is not None and left is None):
        return "the mask's diagonal is not at a fixed offset from the bottom-right one"
    if (right is not None and right < 0) or (left is not None and left < 0):
        return ("the mask hides keys on the bottom-right diagonal (e.g. a top-left causal mask with "
                "Sq != Sk, or a strictly lower triangle)")
    return Window(-1 if left is None else left, -1 if right is None else right)


# ------------------------------------------------------------------------- the match

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
    chain: list = field(default_factory=list)  # nodes the op makes dead (in-place ones included)


@dataclass
class Step:
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


def _qk(product: fx.Node) -> tuple[Any, Any, list[Step]] | str:
    """(q, k^T node or a k Operand, extra steps) of the q-k product."""
    if is_op(product, A.matmul.default, A.bmm.default):
        a, b = product.args
        if val(a).dim() != val(b).dim():
            return "q and k^T have different ranks"
        return a, b, []
    if is_op(product, A.baddbmm.default):
        inp, a, b = product.args[:3]
        beta, alpha = arg(product, "beta", 1), arg(product, "alpha", 1)
        if number(alpha) is None or number(beta) is None:
            return "baddbmm's alpha or beta is not a constant"
        steps = [Step("scale", product, float(alpha))]
        if beta != 0:  # beta == 0 ignores the input (torch.empty in GPT-2's reordered path)
            steps.append(Step("add", product, part=Part("add", inp, float(beta))))
        return a, b, steps
    parsed = _einsum(product)
    if parsed is None:
        return "the einsum is not a two-operand product with distinct subscripts"
    (sa, sb), out = parsed
    contracted = set(sa) & set(sb) - set(out)
    qi, ki = set(sa) - set(sb), set(sb) - set(sa)
    batch = [ch for ch in out if ch in sa and ch in sb]
    if (len(contracted) != 1 or len(qi) != 1 or len(ki) != 1 or set(out) != set(batch) | qi | ki
            or out[-2:] != qi.pop() + ki.pop()):
        return f"the einsum {product.args[0]!r} is not q.k over the head dim with (..., queries, keys) last"
    d = contracted.pop()
    a, b = product.args[1]
    return (_permuted(a, sa, "".join(batch) + out[-2] + d),
            _permuted(b, sb, "".join(batch) + out[-1] + d), [])


def _is_product(n: Any) -> bool:
    if is_op(n, A.matmul.default, A.bmm.default, A.baddbmm.default):
        return True
    return is_op(n, A.einsum.default) and len(n.args[1]) == 2


def _pv(node: Any, p: fx.Node, rank: int) -> tuple[Any, tuple] | str:
    """(v or a v Operand, view ops from (B, H, Sq, Dv) to the product's layout) of p @ v."""
    if is_op(node, A.matmul.default, A.bmm.default):
        if node.args[0] is not p:
            return "the probabilities are the right operand of the product with v"
        if val(node.args[1]).dim() != rank:
            return "v and the probabilities have different ranks"
        return node.args[1], ()
    if not (is_op(node, A.einsum.default) and len(node.args[1]) == 2 and p in node.args[1]):
        return "the probabilities are not multiplied by v"
    parsed = _einsum(node)
    if parsed is None:
        return "the einsum with v has repeated subscripts"
    ins, out = parsed
    i = node.args[1].index(p)
    sp, sv = ins[i], ins[1 - i]
    batch, qs, ks = sp[:-2], sp[-2], sp[-1]
    dv = set(sv) - set(sp)
    if (len(sp) != rank or len(dv) != 1 or set(sv) != set(batch) | {ks} | dv
            or set(out) != set(batch) | {qs} | dv):
        return f"the einsum {node.args[0]!r} is not probabilities @ v over the keys"
    d = dv.pop()
    p_out = _perm(batch + qs + d, out)
    return _permuted(node.args[1][1 - i], sv, batch + ks + d), (() if p_out is None else
                                                                ((A.permute.default, (list(p_out),)),))


# -- q, k, v

def _transposed(kt: Any) -> Operand:
    """k from k^T: the transpose's input when it is one, else a transpose of kT."""
    if isinstance(kt, Operand):
        return kt
    r = val(kt).dim()
    if is_op(kt, A.transpose.int) and {kt.args[1] % r, kt.args[2] % r} == {r - 2, r - 1}:
        return Operand(kt.args[0])
    return Operand(kt).then(A.transpose.int, -2, -1)


def _scale_operand(node: Any) -> tuple[fx.Node, float] | None:
    """(x, c) for node = x * c or x / c with c a constant and x of node's shape and dtype."""
    t = _kind(node)
    if t not in (A.mul.Tensor, A.div.Tensor):
        return None
    a, b = node.args[:2]
    for x, c in ((a, b), (b, a)) if t == A.mul.Tensor else ((a, b),):
        k = _constant(c)
        if isinstance(x, fx.Node) and k is not None and k != 0 and _same_shape(_shape(x), _shape(node)) \
                and dtype_of(x) == dtype_of(node):
            return x, (k if t == A.mul.Tensor else 1.0 / k)
    return None


def _unscaled(op: Operand) -> tuple[Operand, float]:
    """op with scalar multiplications of its tensor folded out, and their product."""
    factor, node = 1.0, op.node
    while (s := _scale_operand(node)) is not None and FUNCTIONAL.get(node.target) is None:
        node, c = s
        factor *= c
    return Operand(node, op.ops), factor


def _unrepeat(op: Operand, head: int = 1) -> tuple[Operand, int] | None:
    """(kv, n) when op repeats kv's heads (dim `head`) n times in repeat_kv order (head h
    reads kv head h // n); (op, 1) when it repeats nothing; None for another order (tile)."""
    node = op.node
    if op.ops:
        return op, 1
    v = val(node)
    if is_op(node, A.transpose.int):
        a, b = (d % v.dim() for d in node.args[1:3])
        if head in (a, b):
            inner = _unrepeat(Operand(node.args[0]), b if head == a else a)
            if inner is None:
                return None
            kv, n = inner
            return (Operand(node), 1) if n == 1 else (kv.then(A.transpose.int, *node.args[1:3]), n)
    if is_op(node, A.repeat_interleave.self_int):
        dim = arg(node, "dim")
        n = _concrete(_int_arg(node.args[1]))
        if dim is not None and dim % v.dim() == head and n is not None:
            return Operand(node.args[0]), n
        return None
    if is_op(node, *VIEWS) or is_op(node, A.flatten.using_ints):
        e = node.args[0]
        if is_op(e, A.expand.default):
            src, ev = e.args[0], val(e)
            # x.unsqueeze(head + 1).expand(..., Hkv, n, ...) merged back into one head dim
            if (ev.dim() == v.dim() + 1 and is_op(src, A.unsqueeze.default) and src.args[1] % ev.dim() == head + 1
                    and known_equal(val(src).shape[head + 1], 1)
                    and _same_shape(_shape(src.args[0])[:head], tuple(v.shape[:head]))
                    and _same_shape(_shape(src.args[0])[head + 1:], tuple(v.shape[head + 1:]))
                    and known_equal(v.shape[head], ev.shape[head] * ev.shape[head + 1])):
                n = _concrete(ev.shape[head + 1])
                return None if n is None else (Operand(src.args[0]), n)
    if is_op(node, A.expand.default):
        src = node.args[0]
        s = _shape(src)
        # one kv head broadcast over all query heads (MQA); nothing else expanded
        if (len(s) == v.dim() and known_equal(s[head], 1) and not known_equal(v.shape[head], 1)
                and all(known_equal(a, b) for i, (a, b) in enumerate(zip(s, v.shape)) if i != head)):
            n = _concrete(v.shape[head])
            return None if n is None else (Operand(src), n)
    if is_op(node, A.repeat.default) and any(r != 1 for r in node.args[1]):
        return None
    return op, 1


# -- the walk

def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _merges(src: Any, view: fx.Node) -> bool:
    """view is src (B, H, X, Y) viewed as (B*H, X, Y)."""
    a, b = _shape(src), _shape(view)
    return len(a) == 4 and len(b) == 3 and known_equal(a[0] * a[1], b[0]) and _same_shape(a[2:], b[1:])


def _walk(node: Any, shape: tuple, steps: list) -> fx.Node | str:
    """Walk up from the softmax input to the q-k product, appending the steps passed (from the
    softmax upwards). shape: the scores' shape, which every step keeps."""
    cur = node
    while True:
        if not isinstance(cur, fx.Node) or cur.op != "call_function":
            return "the softmax input is not computed from q @ k^T"
        if _is_product(cur):
            if not _same_shape(_shape(cur), shape):
                return "q @ k^T is broadcast to a larger shape by a mask or bias"
            return cur
        t, src = _kind(cur), cur.args[0] if cur.args else None
        if cast_dtype(cur) is not None:
            steps.append(Step("cast", cur))
            cur = src
            continue
        if (t in VIEWS and len(shape) == 4 and val(src).dim() == 3
                and known_equal(shape[0] * shape[1], _shape(src)[0]) and _same_shape(_shape(src)[1:], shape[2:])):
            steps.append(Step("heads", cur, shape[:2]))  # (B*H, Sq, Sk) scores viewed as (B, H, Sq, Sk)
            shape, cur = _shape(src), src
            continue
        if t in VIEWS and len(shape) == 3 and _merges(src, cur):
            steps.append(Step("merge", cur, _shape(src)[:2]))  # (B, H, Sq, Sk) scores viewed as (B*H, Sq, Sk)
            shape, cur = _shape(src), src
            continue
        if not _same_shape(_shape(cur), shape):
            return f"the scores change shape at {_name(cur)} before the softmax"
        if t in (A.mul.Tensor, A.div.Tensor):
            step = _scale_step(cur)
            if isinstance(step, str):
                return step
            steps.append(step[0])
            cur = step[1]
            continue
        if t in (A.add.Tensor, A.sub.Tensor):
            return _walk_add(cur, shape, steps)
        if t in (A.masked_fill.Scalar, A.masked_fill.Tensor):
            fill = _constant(cur.args[2])
            if fill is None or fill > MASKED:
                return f"masked scores are set to {cur.args[2]}, not -inf or a large negative value"
            steps.append(Step("keep", cur, part=Part("keep", cur.args[1], positive=False, fill=fill, overwrite=True)))
            cur = src
            continue
        if t in (A.where.self, A.where.ScalarOther, A.where.ScalarSelf):
            c, a, b = cur.args[:3]
            fa, fb = _constant(a), _constant(b)
            scores, fill, positive = (a, fb, True) if fa is None else (b, fa, False)
            if fill is None or fill > MASKED:
                return "torch.where picks between the scores and something other than -inf or a large negative value"
            steps.append(Step("keep", cur, part=Part("keep", c, positive=positive, fill=fill, overwrite=True)))
            cur = scores
            continue
        return f"the scores pass through {_name(cur)} between q @ k^T and the softmax"


def _walk_add(node: fx.Node, shape: tuple, steps: list) -> fx.Node | str:
    """The walk through s + b, s - b or b + s: the operand the product is above is s."""
    a, b = node.args[:2]
    alpha = number(node.kwargs.get("alpha", 1))
    if alpha is None:
        return "the scores are added with a non-constant alpha"
    sign = alpha if _kind(node) == A.add.Tensor else -alpha
    if not isinstance(b, fx.Node) or _constant(b) is not None:
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


def _scale_step(node: fx.Node) -> tuple[Step, fx.Node] | str:
    """The step a multiplication or division of the scores is: softcap, scale, or a scale
    computed from a symbolic head dim (dynamic shapes)."""
    cap = _softcap(node)
    if cap is not None:
        return Step("softcap", node, cap[1]), cap[0]
    s = _scale_operand(node)
    if s is not None:
        return Step("scale", node, s[1]), s[0]
    a, b = node.args[:2]
    div = _kind(node) == A.div.Tensor
    for x, c in ((a, b),) if div else ((a, b), (b, a)):
        if isinstance(x, fx.Node) and isinstance(val(c), (torch.SymFloat, torch.SymInt)):
            return Step("symscale", node, (c, div)), x
    for x, c in ((a, b),) if div else ((a, b), (b, a)):
        # a scale the model reads at run time (an input or buffer: Inductor's _sfdp patterns)
        if (isinstance(x, fx.Node) and _same_shape(_shape(x), _shape(node)) and dtype_of(x) == dtype_of(node)
                and isinstance(c, fx.Node) and isinstance(val(c), torch.Tensor) and val(c).numel() == 1
                and val(c).is_floating_point()):
            return Step("tensorscale", node, (c, div)), x
    return "the scores are multiplied by a tensor that is not one value"


def _softcap(node: fx.Node) -> tuple[fx.Node, float] | None:
    """(s, c) for node = c * tanh(s / c)."""
    s = _scale_operand(node)
    if s is None or not is_op(s[0], A.tanh.default):
        return None
    inner = _scale_operand(s[0].args[0])
    c = s[1]
    if inner is None or c <= 0 or not math.isclose(inner[1] * c, 1.0, rel_tol=1e-6):
        return None
    return inner[0], c


def _fold(steps: list[Step], m: Match, merged: bool) -> str:
    """Apply the steps in computation order onto m's scale, softcap and parts; "" or why not.
    merged: the product is (B*H, Sq, Sk); its terms are marked for a (B, H) op (m.heads)."""
    for st in reversed(steps):
        m.chain.append(st.node)
        if st.kind in ("heads", "merge"):
            merged = st.kind == "merge"
        if st.part is not None and merged:
            st.part.heads = m.heads
        if st.kind in ("scale", "symscale", "tensorscale"):
            if m.softcap:
                return "the scores are scaled after the tanh softcap"
            if st.kind == "symscale":
                if m.parts:
                    return "a mask or bias is added before a scale computed from a dynamic size"
                m.sym.append(st.value)
                continue
            if st.kind == "tensorscale":
                if m.parts:
                    return "a mask or bias is added before a scale read from a tensor"
                m.runtime.append(st.value)  # any sign: q * c @ k^T is (q @ k^T) * c
                continue
            if st.value < 0:
                return "the scores are multiplied by a negative constant"
            m.scale *= st.value
            for p in m.parts:
                p.mult *= st.value  # (s + b) * c = s * c + b * c; masks stay masks
        elif st.kind == "softcap":
            if m.softcap or m.parts:
                return "the tanh softcap comes after a mask or bias (flash.attention applies it before)"
            m.softcap = st.value
        elif st.kind in ("add", "keep"):
            m.parts.append(st.part)
    return ""


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
        todo.extend(n.all_input_nodes)
    return False


def _single_user(n: fx.Node) -> fx.Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def _match(softmax: fx.Node, order: dict) -> Match | str:
    ndim = val(softmax).dim()
    if not last_dim(softmax.args[1], ndim):
        return "softmax is not over the last dimension"
    if ndim not in (3, 4):
        return f"the scores are {ndim}-D, not (batch, heads, queries, keys) or (batch*heads, queries, keys)"
    steps: list = []
    product = _walk(softmax.args[0], _shape(softmax), steps)
    if isinstance(product, str):
        return product
    qk = _qk(product)
    if isinstance(qk, str):
        return qk
    q, kt, extra = qk
    steps.extend(reversed(extra))
    views = [st.value for st in steps if st.kind in ("heads", "merge")]
    if views and isinstance(q, Operand):
        return "an einsum over merged batch*heads is viewed back into (batch, heads)"
    m = Match(None, None, None, None, merged=ndim == 3 and not views)
    # down: casts, dropout, the probabilities viewed as (B*H, Sq, Sk), @ v
    cur, chain = softmax, [softmax]
    nxt = _single_user(cur)
    while (is_op(nxt, A.dropout.default) or (nxt is not None and cast_dtype(nxt) is not None)
           or (is_op(nxt, *VIEWS) and _merges(cur, nxt))):
        if is_op(nxt, A.dropout.default):
            p = number(nxt.args[1])
            if p is None:
                return "the dropout probability is not a constant"
            if m.dropout_p:
                return "dropout is applied twice"
            m.dropout_p = p
        elif is_op(nxt, *VIEWS):
            views.append(_shape(cur)[:2])
        cur = nxt
        chain.append(cur)
        nxt = _single_user(cur)
    if nxt is None:
        return "the probabilities are used more than once (e.g. also returned as attention weights)"
    if views:  # merged (B*H, ...) tensors viewed as (B, H, ...): the op runs on those
        m.heads = _concrete(views[0][1])
        if m.heads is None:
            return "(batch*heads) tensors are viewed as (batch, heads) with a head count that is not a constant"
    pv = _pv(nxt, cur, val(cur).dim())
    if isinstance(pv, str):
        return pv
    v, m.out_ops = pv
    m.out = nxt
    if m.heads:
        q, kt, v = (_unmerged(x, m.heads) for x in (q, _transposed(kt), v))
        if val(nxt).dim() == 3:
            m.out_ops += ((A.flatten.using_ints, (0, 1)),)
    err = _fold(steps, m, val(product).dim() == 3)
    if err:
        return err
    if any(_depends_on(p.node, product, order) for p in m.parts):
        return "a term added to the scores is itself computed from the scores"
    m.chain += chain + [product]
    m = _operands(m, q, kt, v)
    if isinstance(m, Match):
        return _masks(m, tuple(views[0]) + _shape(softmax)[-2:] if views else _shape(softmax)) or m
    return m


def _unmerged(x: Any, heads: int) -> Operand:
    """A (B*H, S, D) operand as (B, H, S, D); a 4-D one as it is."""
    x = x if isinstance(x, Operand) else Operand(x)
    return x.then(A.unflatten.int, 0, [-1, heads]) if val(x.node).dim() == 3 else x


def _operands(m: Match, q: Any, kt: Any, v: Any) -> Match | str:
    """Fill m.q/k/v: scales folded out of q and k, GQA repeats undone."""
    q, c = _unscaled(q if isinstance(q, Operand) else Operand(q))
    m.scale *= c
    if not isinstance(kt, Operand):  # (an einsum gives k itself)
        kt, c = _unscaled(Operand(kt))
        m.scale *= c
        kt = _transposed(kt.node)
    k, c = _unscaled(kt)
    m.scale *= c
    v = v if isinstance(v, Operand) else Operand(v)
    if not m.merged:
        uk, uv = _unrepeat(k), _unrepeat(v)
        if uk is None or uv is None:
            return "k/v heads are repeated in tile order (x.repeat), not repeat_kv's; GQA reads kv head h // n"
        (k, nk), (v, nv) = uk, uv
        if nk != nv:
            return f"k is repeated {nk} times per head but v {nv} times"
        k, c = _unscaled(k)
        m.scale *= c
    m.q, m.k, m.v = q, k, v
    if m.sym:
        perm = next((a[0] for op, a in q.ops if op == A.permute.default), None)
        d = _shape(q.node)[-1 if perm is None else perm[-1]]
        powers = [_head_power(x, d) for x, _ in m.sym]
        if None in powers or sum(-e if div else e for e, (_, div) in zip(powers, m.sym)) != -0.5 \
                or not math.isclose(m.scale, 1.0):
            return "the scores are scaled by a value computed from dynamic sizes other than 1/sqrt(head dim)"
        m.scale = None  # flash.attention's default, D ** -0.5
    return m


# ------------------------------------------------------------------------- masks -> window

def _conjuncts(node: fx.Node, positive: bool) -> list[tuple[fx.Node, bool]]:
    """The and-ed pieces of a keep condition (node == positive), through not, casts to bool and
    expand (ops that keep the pieces right-aligned with the whole)."""
    t = _kind(node)
    if (t in AND and positive) or (t in OR and not positive):
        return [piece for a in node.args[:2] if isinstance(a, fx.Node) for piece in _conjuncts(a, positive)]
    if t in NOT:
        return _conjuncts(node.args[0], not positive)
    if (t == A.expand.default or cast_dtype(node) == torch.bool) and dtype_of(node.args[0]) == torch.bool:
        return _conjuncts(node.args[0], positive)
    return [(node, positive)]


def _unwrap(node: Any) -> Any:
    while is_op(node, *SAME):
        node = node.args[0]
    return node


def _keep_of(part: Part) -> list[Part] | None:
    """An added mask as a keep part and what it adds where it keeps: `where(c, x, v)`,
    `where(c, v, x)`, `masked_fill(x, c, v)` with v hiding (x = 0 for a plain mask; T5's
    SDPA path masks its position bias this way)."""
    n = _unwrap(part.node)
    t = _kind(n)
    if t in (A.where.self, A.where.ScalarOther, A.where.ScalarSelf, A.where.Scalar):
        c, a, b = n.args[:3]
        for x, fill, positive in ((a, b, True), (b, a, False)):
            v = _constant(fill)
            if v is not None and v * part.mult <= MASKED:
                return [Part("keep", c, positive=positive, fill=v * part.mult)] + _added(x, part.mult)
    if t in (A.masked_fill.Scalar, A.masked_fill.Tensor):
        v = _constant(n.args[2])
        if v is not None and v * part.mult <= MASKED:
            return [Part("keep", n.args[1], positive=False, fill=v * part.mult)] + _added(n.args[0], part.mult)
    return None


def _added(x: Any, mult: float) -> list[Part]:
    """x * mult as an added term; none when it is a constant (softmax does not see it)."""
    return [] if _constant(x) is not None or not isinstance(x, fx.Node) else [Part("add", x, mult)]


def _summands(node: Any, mult: float) -> list[Part]:
    """node * mult as a list of added terms (through +, - and broadcasting adds)."""
    node = _unwrap(node)
    t = _kind(node)
    alpha = number(node.kwargs.get("alpha", 1)) if t in (A.add.Tensor, A.sub.Tensor) else None
    if alpha is None or not all(isinstance(a, fx.Node) for a in node.args[:2]):
        return [Part("add", node, mult)]
    sign = alpha if t == A.add.Tensor else -alpha
    return _summands(node.args[0], mult) + _summands(node.args[1], mult * sign)


# A keep piece made of constants is evaluated at compile time up to this many elements.
CONSTANT_MASK_ELEMENTS = 1 << 26


def _evaluated(node: fx.Node) -> torch.Tensor | None:
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
                if isinstance(out, torch.Tensor) and out.numel() > CONSTANT_MASK_ELEMENTS:
                    return None
    except Exception:
        return None
    out = env[node]
    return out if isinstance(out, torch.Tensor) and out.dtype == torch.bool else None


def _constant_keep(node: fx.Node, positive: bool, shape: tuple):
    """The keep formula of a constant piece (node == positive) over the scores' shape
    (..., Sq, Sk): TRUE where it keeps everything, the causal band where it equals the
    bottom-right causal mask, else None (it stays attn_bias). transformers 5.2x builds its
    causal mask from position ids gathered by index (arange made in the graph) and ands it with
    a same-sequence piece for packed sequences, which keeps everything without packing; the
    index algebra proves neither."""
    if any(not isinstance(d, int) for d in shape):
        return None
    value = _evaluated(node)
    if value is None:
        return None
    try:
        keep = (value if positive else ~value).expand(shape)
    except RuntimeError:
        return None
    if bool(keep.all()):
        return TRUE
    sq, sk = shape[-2:]
    rows = torch.arange(sq, device=keep.device)[:, None] + (sk - sq)
    causal = torch.arange(sk, device=keep.device)[None, :] <= rows
    if torch.equal(keep, causal.expand(shape)):
        r = len(shape) - 2
        return _atom({r: 1, r + 1: -1}, sk - sq)  # i - j + Sk - Sq >= 0
    return None


class _Masks:
    """Sorts the parts of one site into those that stay attn_bias (kept) and the keep-formulas
    over the scores' shape (..., Sq, Sk) that may add up to a window (bands)."""

    def __init__(self, shape: tuple):
        self.shape, self.index = shape, _Index()
        self.kept: list[Part] = []
        self.bands: list[tuple[Any, Part]] = []  # (keep formula, the part to keep if no window)
        self.finite: list[Part] = []  # parts that hide keys with a finite fill

    def value(self, node: fx.Node) -> _Val | None:
        v = self.index(node)
        return None if v is None else v.to(self.shape)

    def add(self, part: Part) -> None:
        if part.kind == "add":
            v = self.value(part.node)
            if v is not None and v.kind != "int":
                cases = [(f, x * part.mult) for f, x in _as_float(v, torch.float64).cases]
                if len(cases) == 1:
                    return  # a constant added to every score: softmax does not see it
                if all(x == 0 or x <= MASKED for _, x in cases):
                    keep = FALSE
                    for f, x in cases:
                        keep = _f_or(keep, f) if x == 0 else keep
                    self.bands.append((keep, part))
                    if any(-math.inf < x <= MASKED for _, x in cases):
                        self.finite.append(part)
                else:
                    self.kept.append(part)
                return
            keep = _keep_of(part)  # s + where(c, 0, -inf) hides as masked_fill(~c, -inf) does
            if keep is None:
                self.kept.append(part)
                return
            keep = [dataclasses.replace(k, heads=part.heads) for k in keep]
            for extra in keep[1:]:
                self.add(extra)
            part = keep[0]
        if part.fill > -math.inf:
            self.finite.append(part)
        for n, p in _conjuncts(part.node, part.positive):
            piece = dataclasses.replace(part, node=n, positive=p)
            v = self.value(n)
            if v is None or v.kind != "bool":
                keep = _constant_keep(n, p, self.shape)
                if keep is None:
                    self.kept.append(piece)
                elif keep != TRUE:
                    self.bands.append((keep, piece))
            else:
                self.bands.append((v.formula if p else _f_not(v.formula), piece))


def _masks(m: Match, shape: tuple) -> str:
    """Move the masks that provably are a band around the bottom-right diagonal from m.parts
    into m.window. Sums are split into their terms and keep conditions into their and-ed
    pieces where that finds a band (causal & padding: the causal piece becomes causal=True,
    the padding piece stays attn_bias, unless it is a constant: _constant_keep). shape: the
    scores' (..., Sq, Sk). "" when done, else why the site is left alone.

    A mask that may hide a query row entirely (one that is not a band: padding) with a finite
    fill (HF's finfo.min) makes the model average v over the keys so filled: then nothing is
    split and the model's own terms go in as attn_bias, which the op reads alike (a fill at or
    below -1e9 weighs every such key equally, gradients to q and k as the model's add gives).
    A finite fill that overwrites the scores (masked_fill) gives those rows no gradient to q
    and k, which the op cannot do: such a site is left alone."""
    sorted_ = _Masks(shape)
    for part in m.parts:
        terms = _summands(part.node, part.mult) if part.kind == "add" else [part]
        terms = [dataclasses.replace(t, heads=part.heads) for t in terms]
        split = _Masks(shape)
        for t in terms:
            split.add(t)
        if len(terms) > 1 and split.bands:
            sorted_.kept += split.kept
            sorted_.bands += split.bands
            sorted_.finite += split.finite
        else:
            sorted_.add(part)
    kept, bands = sorted_.kept, sorted_.bands
    window = None
    if bands:
        f = TRUE
        for g, _ in bands:
            f = _f_and(f, g)
        window = _window(f, shape)
        if not isinstance(window, Window):
            kept += [p for _, p in bands]
    if sorted_.finite and any(p.kind == "keep" for p in kept):
        over = next((p for p in sorted_.finite if p.overwrite), None)
        if over is not None:
            return (f"scores are set to the finite {over.fill:g} where a mask that is not causal (padding) hides "
                    "them: a query row it hides entirely averages v in the model with no gradient to q and k, "
                    "which flash.attention does not compute (fill with -inf, or add the mask)")
        return ""  # the model's own terms, unsplit
    if isinstance(window, Window):
        m.window = window
    m.parts = kept
    return ""


# ------------------------------------------------------------------------- SDPA

def _match_sdpa(n: fx.Node) -> Match | str:
    q, k, v = n.args[:3]
    mask = arg(n, "attn_mask")
    dropout_p = number(arg(n, "dropout_p", 0.0))
    causal, scale = arg(n, "is_causal", False), arg(n, "scale")
    if val(q).dim() not in (3, 4) or val(k).dim() != val(q).dim() or val(v).dim() != val(q).dim():
        return "SDPA inputs are not 4-D (batch, heads, seq, dim) or 3-D (batch, seq, dim)"
    if scale is not None and number(scale) is None:
        return "scale is not a constant"
    if dropout_p is None:
        return "dropout_p is not a constant"
    if causal and mask is not None:
        return "both attn_mask and is_causal are given"
    m = Match(Operand(q), Operand(k), Operand(v), n, merged=val(q).dim() == 3,
              scale=None if scale is None else number(scale), dropout_p=dropout_p)
    if not m.merged:  # k and v repeated for GQA before the call
        uk, uv = _unrepeat(m.k), _unrepeat(m.v)
        if uk is not None and uv is not None and uk[1] == uv[1]:
            m.k, m.v = uk[0], uv[0]
    sq, sk = val(q).shape[-2], val(k).shape[-2]
    if causal:
        # SDPA's causal diagonal is top-left: key j <= query i, i.e. right = Sq - Sk
        right = _concrete(sq - sk)
        if right is None or right < 0:
            return ("is_causal with fewer queries than keys (or sizes of unknown order): SDPA aligns the "
                    "diagonal top-left, flash.attention bottom-right")
        m.window = Window(-1, right)
    if mask is not None:
        m.parts = [Part("keep", mask) if dtype_of(mask) == torch.bool else Part("add", mask)]
        return _masks(m, tuple(val(q).shape[:-2]) + (sq, sk)) or m
    return m


# ------------------------------------------------------------------------- the rewrite

def _emit(graph: fx.Graph, before: fx.Node, op, *args, **kwargs) -> fx.Node:
    return insert_call(graph, before, op, args, kwargs)


def _build(graph: fx.Graph, before: fx.Node, x: Operand) -> fx.Node:
    node = x.node
    for op, args in x.ops:
        node = _emit(graph, before, op, node, *args)
    return node


def _bias(graph: fx.Graph, before: fx.Node, parts: list[Part]) -> fx.Node | None:
    """attn_bias from the parts left: the and of the keep-masks (bool), or, with float terms,
    their sum with the masks as 0 / -inf."""
    if not parts:
        return None
    masks, floats = [], []
    for p in parts:
        node = p.node
        if p.heads and val(node).dim() == 3 and not known_equal(_shape(node)[0], 1):
            node = _emit(graph, before, A.unflatten.int, node, 0, [-1, p.heads])  # as the op's (B, H, ...)
        if p.kind == "add":
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


def _seed(graph: fx.Graph, before: fx.Node, like: fx.Node) -> fx.Node:
    """A fresh dropout seed per call, drawn as flash.attention's public function draws it."""
    device = val(like).device
    with graph.inserting_before(before):
        node = graph.call_function(A.randint.default, (2**62, []), {"dtype": torch.int64, "device": device})
    with val(like).fake_mode:
        node.meta["val"] = torch.randint(2**62, (), dtype=torch.int64, device=device)
    return node


def _uncast(x: fx.Node) -> fx.Node:
    while cast_dtype(x) is not None:
        x = x.args[0]
    return x


def _replace(gm: fx.GraphModule, m: Match) -> str:
    """flash.attention in m.out's place: "" when done, else why not."""
    g, at = gm.graph, m.out
    q, k, v = (_build(g, at, x) for x in (m.q, m.k, m.v))
    if len({dtype_of(q), dtype_of(k), dtype_of(v)}) > 1:
        # q and k upcast to compute the scores in fp32: the op computes in fp32 anyway
        q, k, v = (_uncast(x) for x in (q, k, v))
        if len({dtype_of(q), dtype_of(k), dtype_of(v)}) > 1:
            return "q, k and v have different dtypes"
    for c, div in m.runtime:  # q * c keeps q's dtype (a one-value tensor does not promote it)
        q = _emit(g, at, A.div.Tensor if div else A.mul.Tensor, q, c)
    bias = _bias(g, at, m.parts)
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
    if isinstance(node, str):
        if seed is not None:
            g.erase_node(seed)  # dead-code elimination keeps random ops
        return node
    out = _emit(g, at, A.squeeze.dim, node, 0) if m.merged else node
    for op, args in m.out_ops:
        out = _emit(g, at, op, out, *args)
    if val(at).is_contiguous() and not val(out).is_contiguous():
        out = _emit(g, at, A.contiguous.default, out)
    if dtype_of(out) != dtype_of(at):
        out = _emit(g, at, A._to_copy.default, out, dtype=dtype_of(at))
    reason = replace(g, at, out, "attention")
    if not reason:
        _erase(g, m.chain + [at])
    return reason


def _erase(graph: fx.Graph, nodes: list) -> None:
    """Remove the replaced chain where nothing else reads it (in-place steps included, which
    dead-code elimination keeps)."""
    left = {n for n in nodes if not getattr(n, "_erased", False)}
    while dead := [n for n in left if not n.users]:
        for n in dead:
            graph.erase_node(n)
            left.discard(n)


def rewrite(gm: fx.GraphModule, report: Report) -> None:
    anchors = [(n, "F.scaled_dot_product_attention")
               for n in gm.graph.find_nodes(op="call_function", target=A.scaled_dot_product_attention.default)]
    anchors += [(n, "softmax") for t in SOFTMAX for n in gm.graph.find_nodes(op="call_function", target=t)]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n, anchor in anchors:
        site = Site("attention", location(n), anchor)
        report.add(site)
        m = _match(n, order) if anchor == "softmax" else _match_sdpa(n)
        if isinstance(m, str):
            site.reason = m if anchor != "softmax" else f"softmax not rewritten to attention: {m}"
            continue
        site.reason = _replace(gm, m)
        if not site.reason:
            site.op = "attention"
