"""Window proofs: whether a keep formula over the scores (..., Sq, Sk) (formulas.py) keeps
exactly a band of key - query offsets around the bottom-right diagonal, which flash.attention
computes as `causal` / `window_left` / `window_right` instead of reading a mask. The proof is
exact or it fails with the reason: conditions on batch or heads, on one index alone at a
position of unknown size, unions of bands, or a diagonal not at a fixed offset from the
bottom-right one all leave the mask as attn_bias."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.fx.experimental.symbolic_shapes import statically_known_true

from .._shared import Unmatched
from .formulas import And, Const, Formula, Ge, Or, nnf
from .nodes import concrete


@dataclass(frozen=True)
class Window:
    """Keys j visible to query i: i + Sk - Sq - left <= j <= i + Sk - Sq + right (-1: unbounded)."""
    left: int = -1
    right: int = -1


class _Unproven(Exception):
    pass


EMPTY = "empty"


def _known_max(a, b, larger: bool):
    """max (larger) or min of two bounds, None meaning unbounded on that side."""
    if a is None or b is None:
        return b if a is None else a
    if statically_known_true(a >= b):
        return a if larger else b
    if statically_known_true(b >= a):
        return b if larger else a
    raise _Unproven("bounds of unknown order")


def _atom_band(lin: tuple, k: Any, r: int, c: int, sq: Any, sk: Any):
    """_band of the atom sum(lin) + k >= 0."""
    lin = dict(lin)
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


def _band(f: Formula, r: int, c: int, sq: Any, sk: Any):
    """The set of d = key - query where the formula (negations on its atoms: nnf) holds, as
    (lo, hi) (None: unbounded) or EMPTY; raises _Unproven when it is not one interval of d."""
    match f:
        case Const(value):
            return (None, None) if value else EMPTY
        case Ge(lin, k):
            return _atom_band(lin, k, r, c, sq, sk)
        case And(f1, f2):
            x, y = _band(f1, r, c, sq, sk), _band(f2, r, c, sq, sk)
            if x is EMPTY or y is EMPTY:
                return EMPTY
            return (_known_max(x[0], y[0], True), _known_max(x[1], y[1], False))
        case Or(f1, f2):
            x, y = _band(f1, r, c, sq, sk), _band(f2, r, c, sq, sk)
            if x is EMPTY or (y is not EMPTY and y[0] is None and y[1] is None):
                return y
            if y is EMPTY or (x[0] is None and x[1] is None):
                return x
    raise _Unproven("the mask is a union of bands")


def window_of(f: Formula, shape: tuple) -> Window | Unmatched:
    """The window a keep-formula over scores of `shape` (..., Sq, Sk) amounts to, or why not."""
    sq, sk = shape[-2], shape[-1]
    try:
        band = _band(nnf(f), len(shape) - 2, len(shape) - 1, sq, sk)
    except _Unproven as e:
        return Unmatched(str(e))
    if band is EMPTY:
        return Unmatched("the mask hides every key")
    lo, hi = band
    diag = sk - sq
    if hi is not None and statically_known_true(hi >= sk - 1):
        hi = None
    if lo is not None and statically_known_true(lo <= 1 - sq):
        lo = None
    right = None if hi is None else concrete(hi - diag)
    left = None if lo is None else concrete(diag - lo)
    if (hi is not None and right is None) or (lo is not None and left is None):
        return Unmatched("the mask's diagonal is not at a fixed offset from the bottom-right one")
    if (right is not None and right < 0) or (left is not None and left < 0):
        return Unmatched("the mask hides keys on the bottom-right diagonal (e.g. a top-left causal mask "
                         "with Sq != Sk, or a strictly lower triangle)")
    return Window(-1 if left is None else left, -1 if right is None else right)
