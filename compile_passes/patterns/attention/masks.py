"""Mask proofs: the terms and masks added to the scores of one site (Parts) sorted into
those that provably keep a band around the bottom-right diagonal, which become the op's
causal / window arguments, and those that stay attn_bias. Sums are split into their terms
and keep conditions into their and-ed pieces (HF's causal & padding: causal=True plus the
padding piece). Masks built in the graph are read by the index algebra (index.py); pieces
made of constants only are evaluated at compile time. Where a mask that is not a band may
hide a query row entirely with a finite fill, the model's own terms go in unsplit. A term
proven to be ALiBi (alibi.py) becomes the op's alibi_slopes first."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.fx as fx

from ...graph import A, cast_dtype, dtype_of, is_op, number
from .._shared import Unmatched
from . import alibi
from .formulas import FALSE, TRUE, Formula, atom, f_and, f_not, f_or
from .index import AND, NOT, OR, Index, Val, as_float
from .nodes import MASKED, MASKED_FILL, SAME, WHERE, constant, evaluated, op_kind
from .operands import Match, Part
from .windows import Window, window_of


def _conjuncts(node: fx.Node, positive: bool) -> list[tuple[fx.Node, bool]]:
    """The and-ed pieces of a keep condition (node == positive), through not, casts to bool and
    expand (ops that keep the pieces right-aligned with the whole)."""
    t = op_kind(node)
    if (t in AND and positive) or (t in OR and not positive):
        return [piece for a in node.args[:2] if isinstance(a, fx.Node) for piece in _conjuncts(a, positive)]
    if t in NOT:
        return _conjuncts(node.args[0], not positive)
    if ((t in (A.expand.default, A.expand_as.default) or cast_dtype(node) == torch.bool)
            and dtype_of(node.args[0]) == torch.bool):
        return _conjuncts(node.args[0], positive)
    if cast_dtype(node) == torch.bool and op_kind(node.args[0]) in WHERE:
        # where(c, 0, fill).bool() is not c (MPT's float mask cast to the bool it masked_fills by)
        c, a, b = node.args[0].args[:3]
        x, y = constant(a), constant(b)
        if isinstance(c, fx.Node) and x is not None and y is not None and (x == 0) != (y == 0):
            return _conjuncts(c, positive if x != 0 else not positive)
    return [(node, positive)]


def _unwrap(node: Any) -> Any:
    """node through copies and expand_as (the op broadcasts attn_bias itself)."""
    while is_op(node, *SAME, A.expand_as.default):
        node = node.args[0]
    return node


def _keep_of(part: Part) -> list[Part] | None:
    """An added mask as a keep part and what it adds where it keeps: `where(c, x, v)`,
    `where(c, v, x)`, `masked_fill(x, c, v)` with v hiding (x = 0 for a plain mask; T5's
    SDPA path masks its position bias this way)."""
    n = _unwrap(part.node)
    t = op_kind(n)
    if t in WHERE:
        c, a, b = n.args[:3]
        for x, fill, positive in ((a, b, True), (b, a, False)):
            v = constant(fill)
            if v is not None and v * part.mult <= MASKED:
                return [Part("keep", c, positive=positive, fill=v * part.mult)] + _added(x, part.mult)
    if t in MASKED_FILL:
        v = constant(n.args[2])
        if v is not None and v * part.mult <= MASKED:
            return [Part("keep", n.args[1], positive=False, fill=v * part.mult)] + _added(n.args[0], part.mult)
    return None


def _added(x: Any, mult: float) -> list[Part]:
    """x * mult as an added term; none when it is a constant (softmax does not see it)."""
    return [] if constant(x) is not None or not isinstance(x, fx.Node) else [Part("add", x, mult)]


def _summands(node: Any, mult: float) -> list[Part]:
    """node * mult as a list of added terms (through +, - and broadcasting adds)."""
    node = _unwrap(node)
    t = op_kind(node)
    alpha = number(node.kwargs.get("alpha", 1)) if t in (A.add.Tensor, A.sub.Tensor) else None
    if alpha is None or not all(isinstance(a, fx.Node) for a in node.args[:2]):
        return [Part("add", node, mult)]
    sign = alpha if t == A.add.Tensor else -alpha
    return _summands(node.args[0], mult) + _summands(node.args[1], mult * sign)


# A keep piece made of constants is evaluated at compile time up to this many elements: a causal
# mask of 32k x 32k tokens (HF eager attention builds one; left as attn_bias, it would rule out
# every causal kernel). The band check below works in row chunks of BAND_CHUNK_ELEMENTS.
CONSTANT_MASK_ELEMENTS = 1 << 30
BAND_CHUNK_ELEMENTS = 1 << 24


def _evaluated(node: fx.Node) -> torch.Tensor | None:
    """node's value computed now (nodes.evaluated) when it is a bool tensor, else None."""
    out = evaluated(node, CONSTANT_MASK_ELEMENTS)
    return out if out is not None and out.dtype == torch.bool else None


def _constant_keep(node: fx.Node, positive: bool, shape: tuple) -> Formula | None:
    """The keep formula of a constant piece (node == positive) over the scores' shape
    (..., Sq, Sk): TRUE where it keeps everything, the band lo <= key - query <= hi where it
    equals one (causal, a sliding window), else None (it stays attn_bias). transformers 5.2x
    builds its causal and sliding-window masks from position ids gathered by index (arange made
    in the graph) and ands them with a same-sequence piece for packed sequences, which keeps
    everything without packing; the index algebra proves none of them."""
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
    band = _band(keep.reshape(-1, *shape[-2:]))
    if band is None:
        return None
    lo, hi = band
    r = len(shape) - 2
    return f_and(atom({r: 1, r + 1: -1}, hi), atom({r: -1, r + 1: 1}, -lo))  # i - j + hi >= 0, j - i - lo >= 0


def _band(keep: torch.Tensor) -> tuple[int, int] | None:
    """(lo, hi) where every (Sq, Sk) slice of keep is lo <= key - query <= hi, else None; in
    chunks of rows, so that a 16k-token mask needs no (Sq, Sk) int64 offsets."""
    if not bool((keep == keep[:1]).all()):
        return None
    keep = keep[0]
    sq, sk = keep.shape
    rows = max(1, BAND_CHUNK_ELEMENTS // max(sk, 1))
    keys = torch.arange(sk, device=keep.device)

    def chunks():  # (rows r0.., their key - query offsets, their part of keep)
        for r0 in range(0, sq, rows):
            queries = torch.arange(r0, min(r0 + rows, sq), device=keep.device)
            yield keys[None, :] - queries[:, None], keep[r0:r0 + rows]

    lo = hi = None
    for offsets, part in chunks():  # the offsets kept: their range
        kept = offsets[part]
        if kept.numel():
            lo = int(kept.min()) if lo is None else min(lo, int(kept.min()))
            hi = int(kept.max()) if hi is None else max(hi, int(kept.max()))
    if lo is None:
        return None
    for offsets, part in chunks():  # and nothing else but them
        if not torch.equal(part, (offsets >= lo) & (offsets <= hi)):
            return None
    return lo, hi


class _Masks:
    """Sorts the parts of one site into those that stay attn_bias (kept) and the keep-formulas
    over the scores' shape (..., Sq, Sk) that may add up to a window (bands)."""

    def __init__(self, shape: tuple):
        self.shape, self.index = shape, Index()
        self.kept: list[Part] = []
        self.bands: list[tuple[Formula, Part]] = []  # (keep formula, the part to keep if no window)
        self.finite: list[Part] = []  # parts that hide keys with a finite fill

    def value(self, node: fx.Node) -> Val | None:
        v = self.index(node)
        return None if v is None else v.to(self.shape)

    def add(self, part: Part) -> None:
        if part.kind == "add":
            v = self.value(part.node)
            if v is not None and v.kind != "int":
                cases = [(f, x * part.mult) for f, x in as_float(v, torch.float64).cases]
                if len(cases) == 1:
                    return  # a constant added to every score: softmax does not see it
                if all(x == 0 or x <= MASKED for _, x in cases):
                    keep = FALSE
                    for f, x in cases:
                        keep = f_or(keep, f) if x == 0 else keep
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
                self.bands.append((v.formula if p else f_not(v.formula), piece))


def _overwrites_alone(m: Match) -> bool:
    """Every part of m sets the scores it hides to one finite fill (masked_fill(mask,
    finfo.min)), on (B, H, ...) scores without dropout. A row these masks hide entirely then
    holds that fill on every key: the model averages v over all keys, with no gradient to q
    and k; any other row sees its visible keys only, as the op does with the masks as bool."""
    fills = {p.fill for p in m.parts}
    return (len(fills) == 1 and all(p.kind == "keep" and p.overwrite for p in m.parts)
            and not m.dropout_p and not m.merged and not m.heads)


def fold_masks(m: Match, shape: tuple) -> None:
    """Move an ALiBi term that provably is one from m.parts into m.alibi (alibi.py), then the
    masks that provably are a band around the bottom-right diagonal into m.window (_fold).
    ALiBi's proof may need the band (a bias linear in the key position is ALiBi under a causal
    mask only), so the masks are sorted without the term first; where the proof fails they are
    sorted again with it, as attn_bias, and the reason is noted for explain. The op reads a
    float mask fill at or below -1e9 as the score -1e4, which must weigh nothing next to the
    keys a row sees with ALiBi's penalty on them (alibi.bounded); and where q is zeroed on
    rows (Match.zero_rows) their scores would be ALiBi's, not the model's: ALiBi stays a bias."""
    found = _alibi_term(m, shape)
    if isinstance(found, tuple):
        before = (m.parts, m.window)
        m.parts = found[0]
        band = _fold(m, shape)
        done = alibi.prove(found[1], band, shape)
        if isinstance(done, alibi.Alibi) and m.zero_rows:
            done = Unmatched("ALiBi with a padding mask that overwrites whole rows' scores after it (their q is "
                             "zeroed, so the op's ALiBi would be their scores): left as attn_bias")
        if (isinstance(done, alibi.Alibi) and any(p.kind == "add" for p in m.parts)
                and not alibi.bounded(done, shape)):
            done = Unmatched("ALiBi next to a float mask whose fill the op reads as -1e4: its penalty is not "
                             "bounded (sizes or slopes not known constants); left as attn_bias")
        if isinstance(done, alibi.Alibi):
            m.alibi = done
            return None
        m.notes.append(done.reason)
        m.parts, m.window, m.uniform_rows, m.zero_rows = before[0], before[1], False, False
    elif isinstance(found, Unmatched):
        m.notes.append(found.reason)
    _fold(m, shape)
    return None


def _alibi_term(m: Match, shape: tuple) -> tuple[list[Part], alibi.Candidate] | Unmatched | None:
    """(m.parts without the first ALiBi-like term, that term's Candidate), the reason the first
    ALiBi-like term cannot be one, or None where no term is ALiBi-like. A part that sums the term
    with others (alibi + mask) leaves those others as parts of their own."""
    why = None
    for i, part in enumerate(m.parts):
        if part.kind != "add":
            continue
        terms = [dataclasses.replace(t, heads=part.heads) for t in _summands(part.node, part.mult)]
        for j, t in enumerate(terms):
            c = alibi.candidate(t, shape)
            if isinstance(c, alibi.Candidate):
                return m.parts[:i] + terms[:j] + terms[j + 1:] + m.parts[i + 1:], c
            why = why or c
    return why


def _fold(m: Match, shape: tuple) -> Window | None:
    """Move the masks that provably are a band around the bottom-right diagonal from m.parts
    into m.window. Sums are split into their terms and keep conditions into their and-ed
    pieces where that finds a band (causal & padding: the causal piece becomes causal=True,
    the padding piece stays attn_bias, unless it is a constant: _constant_keep). shape: the
    scores' (..., Sq, Sk).

    A mask that may hide a query row entirely (one that is not a band: padding) with a finite
    fill (HF's finfo.min) makes the model average v over the keys so filled: then nothing is
    split and the model's own terms go in as attn_bias, which the op reads alike (a fill at or
    below -1e9 weighs every such key equally, gradients to q and k as the model's add gives).
    A finite fill that overwrites the scores (masked_fill) gives those rows no gradient to q
    and k: where such masks are all the site has (_overwrites_alone), the rows they hide
    entirely are computed beside the op (m.uniform_rows); else the op reads the model's
    scores less q @ k^T, term by term in its order, with q = 0 on the rows where those are the
    scores (m.zero_rows). Returns the band the masks keep keys within (as attn_bias or not),
    None where none is proven."""
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
            f = f_and(f, g)
        window = window_of(f, shape)
        if not isinstance(window, Window):
            kept += [p for _, p in bands]
    if sorted_.finite and any(p.kind == "keep" for p in kept):
        if any(p.overwrite for p in sorted_.finite):
            m.uniform_rows = _overwrites_alone(m)
            m.zero_rows = not m.uniform_rows
        return window if isinstance(window, Window) else None  # the model's own terms, unsplit
    if isinstance(window, Window):
        m.window = window
    m.parts = kept
    return window if isinstance(window, Window) else None
