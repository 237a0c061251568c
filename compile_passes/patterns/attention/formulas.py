"""Keep formulas: boolean formulas over the indices of a tensor, built from affine atoms
`sum(coef * index[dim]) + c >= 0` with and, or and not. The index algebra (index.py) writes
what a mask built in the graph holds as one; windows.py proves a band from it. Dims are those
of the tensor the formula describes; offsets may be SymInts. The constructors fold constants,
so TRUE and FALSE are the only constant formulas."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch.fx.experimental.symbolic_shapes import statically_known_true


@dataclass(frozen=True)
class Const:
    value: bool


@dataclass(frozen=True)
class Ge:
    """sum(coef * index[dim] for dim, coef in lin) + c >= 0; lin sorted by dim, no zero coef."""
    lin: tuple
    c: Any


@dataclass(frozen=True)
class And:
    f: Any
    g: Any


@dataclass(frozen=True)
class Or:
    f: Any
    g: Any


@dataclass(frozen=True)
class Not:
    f: Any


Formula = Const | Ge | And | Or | Not
TRUE, FALSE = Const(True), Const(False)


def f_and(f: Formula, g: Formula) -> Formula:
    if f == FALSE or g == FALSE:
        return FALSE
    return g if f == TRUE else f if g == TRUE else And(f, g)


def f_or(f: Formula, g: Formula) -> Formula:
    if f == TRUE or g == TRUE:
        return TRUE
    return g if f == FALSE else f if g == FALSE else Or(f, g)


def f_not(f: Formula) -> Formula:
    if isinstance(f, Const):
        return Const(not f.value)
    return f.f if isinstance(f, Not) else Not(f)


def atom(lin: dict, c: Any) -> Formula:
    """sum(lin[d] * index[d]) + c >= 0, folded to a constant when it is one."""
    lin = tuple(sorted((d, k) for d, k in lin.items() if k != 0))
    if not lin:
        if statically_known_true(c >= 0):
            return TRUE
        if statically_known_true(c < 0):
            return FALSE
    return Ge(lin, c)


def f_map(f: Formula, form: Callable[[dict, Any], tuple[dict, Any]]) -> Formula:
    """f with every affine form (lin dict, c) replaced by form(lin, c)."""
    match f:
        case Const():
            return f
        case Ge(lin, c):
            return atom(*form(dict(lin), c))
        case Not(g):
            return f_not(f_map(g, form))
        case And(a, b):
            return f_and(f_map(a, form), f_map(b, form))
        case Or(a, b):
            return f_or(f_map(a, form), f_map(b, form))


def nnf(f: Formula) -> Formula:
    """f with negations pushed onto the atoms (not(e >= 0) is -e - 1 >= 0)."""
    match f:
        case Not(Const(value)):
            return Const(not value)
        case Not(Ge(lin, c)):
            return atom({d: -k for d, k in lin}, -c - 1)
        case Not(Not(g)):
            return nnf(g)
        case Not(And(a, b)):
            return Or(nnf(Not(a)), nnf(Not(b)))
        case Not(Or(a, b)):
            return And(nnf(Not(a)), nnf(Not(b)))
        case And(a, b):
            return And(nnf(a), nnf(b))
        case Or(a, b):
            return Or(nnf(a), nnf(b))
    return f
