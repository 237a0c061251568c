"""The index algebra: what a tensor built from indices alone (arange, ones/full, triu/tril,
comparisons, where/masked_fill, logical ops, views and slices) holds, as a function of its
indices: an affine integer, a keep formula (formulas.py) or float cases. Index evaluates the
subgraph under a node into a Val, or None where the value depends on data (an input, a
parameter, a random op) or on an op it does not model. masks.py reads masks built in the
graph through it."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ...graph import A, cast_dtype, number, val
from .._shared import arg, known_equal
from .formulas import FALSE, TRUE, Formula, atom, f_and, f_map, f_not, f_or
from .nodes import MASKED_FILL, SAME, VIEWS, WHERE, concrete, constant, int_arg, op_kind



@dataclass(frozen=True)
class Val:
    """What an index-only tensor holds, as a function of its indices. kind "int": the affine
    sum(lin[d] * index[d]) + const; "bool": a formula; "float": cases ((formula, value), ...)
    whose formulas partition the indices."""
    kind: str
    shape: tuple
    lin: tuple = ()
    const: Any = 0
    formula: Formula = TRUE
    cases: tuple = ()

    def remap(self, shape: tuple, sub: dict) -> "Val":
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
            return Val("int", shape, tuple(sorted(lin.items())), c)
        if self.kind == "bool":
            return Val("bool", shape, formula=f_map(self.formula, form))
        return Val("float", shape, cases=_cases(tuple((f_map(f, form), v) for f, v in self.cases)))

    def to(self, shape: tuple) -> "Val | None":
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
            merged[key] = (f_or(merged[key][0], f), v) if key in merged else (f, v)
    return tuple(merged.values())


def _const_val(value: Any, dtype: torch.dtype, shape: tuple) -> Val | None:
    if dtype == torch.bool:
        return Val("bool", shape, formula=TRUE if value else FALSE)
    if dtype.is_floating_point:
        x = constant(value)
        return None if x is None else Val("float", shape, cases=((TRUE, x),))
    iv = int_arg(value)
    return None if iv is None else Val("int", shape, const=iv)


def _scalar(x: Any) -> Val | None:
    """A Python scalar (or a node computing a size) as a 0-d value."""
    if isinstance(x, bool):
        return Val("bool", (), formula=TRUE if x else FALSE)
    iv = int_arg(x)
    if iv is not None:
        return Val("int", (), const=iv)
    n = number(x)
    return None if n is None else Val("float", (), cases=((TRUE, n),))


def _as_bool(v: Val) -> Val | None:
    if v.kind == "bool":
        return v
    if v.kind == "int":
        lin = dict(v.lin)
        # x != 0 for an integer affine x: x >= 1 or -x >= 1
        pos = atom(lin, v.const - 1)
        neg = atom({d: -k for d, k in lin.items()}, -v.const - 1)
        return Val("bool", v.shape, formula=f_or(pos, neg))
    f = FALSE
    for g, x in v.cases:
        if x != 0:
            f = f_or(f, g)
    return Val("bool", v.shape, formula=f)


def as_float(v: Val, dtype: torch.dtype) -> Val | None:
    if v.kind == "bool":
        return Val("float", v.shape, cases=_cases(((v.formula, 1.0), (f_not(v.formula), 0.0))))
    if v.kind == "float":
        # rounding to the target dtype (finfo(float32).min becomes -inf in fp16)
        return Val("float", v.shape, cases=_cases(
            tuple((f, torch.tensor(x, dtype=dtype).item()) for f, x in v.cases)))
    # integers stay integers where the dtype holds them exactly
    return v if dtype in (torch.float32, torch.float64) else None


def _numeric(v: Val) -> Val | None:
    """v as float cases: bools as 1/0, integer constants as themselves (affine ones: None)."""
    if v.kind == "int":
        c = concrete(v.const)
        return None if v.lin or c is None else Val("float", v.shape, cases=((TRUE, float(c)),))
    return as_float(v, torch.float64)


def _compare(op: str, a: Val, b: Val, shape: tuple) -> Val | None:
    a, b = a.to(shape), b.to(shape)
    if a is None or b is None:
        return None
    if a.kind == "int" and b.kind == "int":
        lin = dict(a.lin)
        for d, k in b.lin:
            lin[d] = lin.get(d, 0) - k
        c = a.const - b.const  # a - b = lin . idx + c
        neg = {d: -k for d, k in lin.items()}
        ge, le = atom(lin, c), atom(neg, -c)
        f = {"ge": ge, "gt": atom(lin, c - 1), "le": le, "lt": atom(neg, -c - 1),
             "eq": f_and(ge, le)}.get(op)
        f = f_not(f_and(ge, le)) if op == "ne" else f
        return Val("bool", shape, formula=f)
    if a.kind == "bool" and b.kind == "bool" and op in ("eq", "ne"):
        same = f_or(f_and(a.formula, b.formula), f_and(f_not(a.formula), f_not(b.formula)))
        return Val("bool", shape, formula=same if op == "eq" else f_not(same))
    a, b = _numeric(a), _numeric(b)
    if a is None or b is None:
        return None
    test = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt,
            "eq": operator.eq, "ne": operator.ne}[op]
    f = FALSE
    for fa, x in a.cases:
        for fb, y in b.cases:
            if test(x, y):
                f = f_or(f, f_and(fa, fb))
    return Val("bool", shape, formula=f)


def _binary(fn, a: Val, b: Val, shape: tuple) -> Val | None:
    """Elementwise fn of two float-valued (or bool, as 0/1) values."""
    a, b = a.to(shape), b.to(shape)
    a, b = (None if x is None else _numeric(x) for x in (a, b))
    if a is None or b is None:
        return None
    return Val("float", shape, cases=_cases(tuple(
        (f_and(fa, fb), fn(x, y)) for fa, x in a.cases for fb, y in b.cases)))


def _where(c: Val, a: Val, b: Val, shape: tuple) -> Val | None:
    c, a, b = (None if t is None else t.to(shape) for t in (c, a, b))
    if c is None or a is None or b is None:
        return None
    c = _as_bool(c)
    if a.kind == "bool" and b.kind == "bool":
        return Val("bool", shape, formula=f_or(f_and(c.formula, a.formula),
                                               f_and(f_not(c.formula), b.formula)))
    a, b = _numeric(a), _numeric(b)
    if a is None or b is None:
        return None
    return Val("float", shape, cases=_cases(
        tuple((f_and(c.formula, f), x) for f, x in a.cases)
        + tuple((f_and(f_not(c.formula), f), x) for f, x in b.cases)))


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


class Index:
    """Evaluates the index-only subgraph under a node into a Val; None where a value
    depends on data (an input, a parameter, a random op) or on an op it does not model."""

    DEPTH = 64  # masks are a few ops deep; deeper chains are data

    def __init__(self):
        self.memo: dict = {}
        self.depth = 0

    def __call__(self, x: Any) -> Val | None:
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

    def _eval(self, n: fx.Node) -> Val | None:
        v = val(n)
        if not isinstance(v, torch.Tensor):
            return _scalar(n)
        if n.op != "call_function":
            return None
        shape, t = tuple(v.shape), op_kind(n)
        if t in (A.arange.default, A.arange.start, A.arange.start_step):
            if v.dtype.is_floating_point and v.dtype not in (torch.float32, torch.float64):
                return None
            start = int_arg(n.args[0]) if t != A.arange.default else 0
            step = int_arg(arg(n, "step", 1)) if t == A.arange.start_step else 1  # core ATen omits step=1
            if start is None or concrete(step) is None:
                return None
            return Val("int", shape, ((0, concrete(step)),) if not known_equal(shape[0], 1) else (), start)
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
                return as_float(x, v.dtype)
            return x if x.kind == "int" else None
        if t in COMPARE:
            a, b = self(n.args[0]), self(n.args[1])
            return None if a is None or b is None else _compare(COMPARE[t], a, b, shape)
        if t in AND + OR:
            a, b = self._arg(n, 0, shape), self._arg(n, 1, shape)
            if a is None or b is None or a.kind != "bool" or b.kind != "bool":
                return None
            return Val("bool", shape, formula=(f_and if t in AND else f_or)(a.formula, b.formula))
        if t in NOT:
            a = self(n.args[0])
            return None if a is None or a.kind != "bool" else Val("bool", shape, formula=f_not(a.formula))
        if t in (A.add.Tensor, A.sub.Tensor, A.mul.Tensor, A.neg.default):
            return self._arith(n, t, shape)
        if t in WHERE:
            return _where(self(n.args[0]), self(n.args[1]), self(n.args[2]), shape)
        if t in MASKED_FILL:
            return _where(self(n.args[1]), self(n.args[2]), self(n.args[0]), shape)
        if t in (A.triu.default, A.tril.default):
            x, k = self(n.args[0]), int_arg(n.args[1] if len(n.args) > 1 else n.kwargs.get("diagonal", 0))
            if x is None or k is None or len(shape) < 2:
                return None
            r, c = len(shape) - 2, len(shape) - 1
            # triu keeps col - row >= k, tril keeps col - row <= k; the rest becomes 0
            keep = atom({c: 1, r: -1}, -k) if t == A.triu.default else atom({c: -1, r: 1}, k)
            zero = _const_val(0, torch.bool if x.kind == "bool" else torch.float64, ())
            return _where(Val("bool", shape, formula=keep), x, zero, shape)
        if t == A.cumsum.default:
            return self._cumsum(n, shape)
        return self._shape_op(n, t, shape) if t in SHAPE_OPS else None

    def _cumsum(self, n: fx.Node, shape: tuple) -> Val | None:
        """cumsum of a constant c along a dim: c * (index + 1) (positions counted from a mask of
        ones); of anything else, not affine."""
        x = self(n.args[0])
        if x is not None and x.kind == "bool" and x.formula in (TRUE, FALSE):
            x = Val("int", x.shape, const=int(x.formula == TRUE))
        if x is not None and x.kind == "float" and len(x.cases) == 1 and float(x.cases[0][1]).is_integer():
            x = Val("int", x.shape, const=int(x.cases[0][1]))
        if x is None or x.kind != "int" or x.lin or concrete(x.const) is None:
            return None
        x = x.to(shape)
        d = n.args[1] % len(shape)
        return Val("int", shape, ((d, x.const),) if x.const and not known_equal(shape[d], 1) else (), x.const)

    def _arg(self, n: fx.Node, i: int, shape: tuple) -> Val | None:
        x = self(n.args[i])
        return None if x is None else x.to(shape)

    def _arith(self, n: fx.Node, t, shape: tuple) -> Val | None:
        if t == A.neg.default:
            a, b, t = Val("int", (), const=0), self(n.args[0]), A.sub.Tensor
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
                k = concrete(a.const)
                if k is None:
                    return None
                return Val("int", shape, tuple((d, c * k) for d, c in b.lin), b.const * a.const)
            sign = alpha if t == A.add.Tensor else -alpha
            lin = dict(a.lin)
            for d, c in b.lin:
                lin[d] = lin.get(d, 0) + sign * c
            return Val("int", shape, tuple(sorted(lin.items())), a.const + sign * b.const)
        if t == A.mul.Tensor and a.kind == "bool" and b.kind == "bool":
            a, b = a.to(shape), b.to(shape)
            return None if a is None or b is None else Val("bool", shape, formula=f_and(a.formula, b.formula))
        fn = {A.add.Tensor: lambda x, y: x + alpha * y, A.sub.Tensor: lambda x, y: x - alpha * y,
              A.mul.Tensor: operator.mul}[t]
        return _binary(fn, a, b, shape)

    def _shape_op(self, n: fx.Node, t, shape: tuple) -> Val | None:
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
            step = concrete(n.args[4] if len(n.args) > 4 else 1)
            start = int_arg(start)
            if start is None or step is None:
                return None
            if concrete(start) is not None and concrete(start) < 0:
                start = start + old[d]
            return x.remap(shape, {i: ((i, step, start) if i == d else (i, 1, 0)) for i in range(r)})
        if t == A.select.int:
            d, i0 = n.args[1] % r, int_arg(n.args[2])
            if i0 is None:
                return None
            if concrete(i0) is not None and concrete(i0) < 0:
                i0 = i0 + old[d]
            return x.remap(shape, {i: ((None, 1, i0) if i == d else (i - (i > d), 1, 0)) for i in range(r)})
        return None
