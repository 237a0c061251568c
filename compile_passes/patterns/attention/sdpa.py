"""Existing SDPA calls: `aten.scaled_dot_product_attention` (F.scaled_dot_product_attention)
and `aten._scaled_dot_product_attention_math` (its math kernel, when its attention weights go
unused) read as a Match. is_causal, attn_mask, scale, dropout_p and enable_gqa map onto the op's
arguments: SDPA's top-left causal diagonal becomes the op's bottom-right one where Sq >= Sk
(a right window of Sq - Sk), k and v repeated for GQA before the call are read unrepeated,
and the mask goes through the same proofs as masks built before a softmax (masks.py)."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...graph import A, dtype_of, is_op, number, val
from .._shared import Unmatched, arg
from .masks import fold_masks
from .nodes import concrete
from .operands import Match, Operand, Part, unrepeat
from .windows import Window


# the SDPA ops and the names explain gives their sites
SDPA = {A.scaled_dot_product_attention.default: "F.scaled_dot_product_attention",
        A._scaled_dot_product_attention_math.default: "aten._scaled_dot_product_attention_math"}

# PyTorch's fused SDPA kernels, which SDPA becomes in graphs traced below the dispatcher
# (run_decompositions() on CUDA): sites, left as they are
FUSED = tuple(getattr(A, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable") if hasattr(A, name))


def _math_output(n: fx.Node) -> fx.Node | Unmatched:
    """The node reading the output of a _scaled_dot_product_attention_math call n, which
    returns (output, attention weights)."""
    if arg(n, "dropout_mask") is not None:
        return Unmatched("_scaled_dot_product_attention_math is given its own dropout_mask")
    outs = [u for u in n.users if is_op(u, operator.getitem) and u.args[1] == 0]
    if len(outs) != 1 or any(not is_op(u, operator.getitem) or u.args[1] != 0 and u.users for u in n.users):
        return Unmatched("the attention weights of _scaled_dot_product_attention_math are used")
    return outs[0]


def match_sdpa(n: fx.Node) -> Match | Unmatched:
    """The site of an SDPA call n (one of SDPA)."""
    out, chain = n, []
    if is_op(n, A._scaled_dot_product_attention_math.default):
        out = _math_output(n)
        if isinstance(out, Unmatched):
            return out
        chain = [n, *n.users]
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
    m = Match(Operand(q), Operand(k), Operand(v), out, merged=val(q).dim() == 3,
              scale=None if scale is None else number(scale), dropout_p=dropout_p, chain=chain)
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
        if out is not n and dtype_of(mask) == torch.bool:
            # F.scaled_dot_product_attention turns a bool mask into 0 / -inf before its math
            # kernel, which itself adds the mask's values as they are
            return Unmatched("a bool attn_mask given to _scaled_dot_product_attention_math itself, which adds "
                             "it as 0 / 1 (SDPA's meaning needs it as 0 / -inf)")
        m.parts = [Part("keep", mask) if dtype_of(mask) == torch.bool else Part("add", mask)]
        fold_masks(m, tuple(val(q).shape[:-2]) + (sq, sk))
    return m
