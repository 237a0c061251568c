"""Existing SDPA calls: `aten.scaled_dot_product_attention` (F.scaled_dot_product_attention)
read as a Match. is_causal, attn_mask, scale, dropout_p and enable_gqa map onto the op's
arguments: SDPA's top-left causal diagonal becomes the op's bottom-right one where Sq >= Sk
(a right window of Sq - Sk), k and v repeated for GQA before the call are read unrepeated,
and the mask goes through the same proofs as masks built before a softmax (masks.py)."""
from __future__ import annotations

import torch
import torch.fx as fx

from ...graph import dtype_of, number, val
from .._shared import Unmatched, arg
from .masks import fold_masks
from .nodes import concrete
from .operands import Match, Operand, Part, unrepeat
from .windows import Window


def match_sdpa(n: fx.Node) -> Match | Unmatched:
    """The site of an SDPA call n."""
    q, k, v = n.args[:3]
    mask = arg(n, "attn_mask")
    dropout_p = number(arg(n, "dropout_p", 0.0))
    causal, scale = arg(n, "is_causal", False), arg(n, "scale")
    if val(q).dim() not in (3, 4) or val(k).dim() != val(q).dim() or val(v).dim() != val(q).dim():
        return Unmatched("SDPA inputs are not 4-D (batch, heads, seq, dim) or 3-D (batch, seq, dim)")
    if scale is not None and number(scale) is None:
        return Unmatched("scale is not a constant")
    if dropout_p is None:
        return Unmatched("dropout_p is not a constant")
    if causal and mask is not None:
        return Unmatched("both attn_mask and is_causal are given")
    m = Match(Operand(q), Operand(k), Operand(v), n, merged=val(q).dim() == 3,
              scale=None if scale is None else number(scale), dropout_p=dropout_p)
    if not m.merged:  # k and v repeated for GQA before the call
        uk, uv = unrepeat(m.k), unrepeat(m.v)
        if uk is not None and uv is not None and uk[1] == uv[1]:
            m.k, m.v = uk[0], uv[0]
    sq, sk = val(q).shape[-2], val(k).shape[-2]
    if causal:
        # SDPA's causal diagonal is top-left: key j <= query i, i.e. right = Sq - Sk
        right = concrete(sq - sk)
        if right is None or right < 0:
            return Unmatched("is_causal with fewer queries than keys (or sizes of unknown order): SDPA aligns "
                             "the diagonal top-left, flash.attention bottom-right")
        m.window = Window(-1, right)
    if mask is not None:
        m.parts = [Part("keep", mask) if dtype_of(mask) == torch.bool else Part("add", mask)]
        return fold_masks(m, tuple(val(q).shape[:-2]) + (sq, sk)) or m
    return m
