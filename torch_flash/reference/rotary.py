"""Plain-PyTorch rotary position embedding (RoPE): the formula the kernels follow.

x is (B, H, S, D), or (total, H, D) packed with cu_seqlens (B + 1,). cos/sin are a table
(S_ro, rd / 2) indexed by position, or (B or 1, S, rd / 2) already gathered per token.
Token s of sequence b sits at position s + seqlen_offset + seqlen_offsets[b]. The first
rd = 2 * cos.shape[-1] dims are rotated, the rest pass through. Pairs are
(x[i], x[i + rd/2]) (GPT-NeoX, interleaved=False) or (x[2i], x[2i + 1]) (GPT-J):
(x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos); conjugate=True rotates by -theta.
Computed in fp32 (fp64 for fp64 inputs); differentiable.
"""
from __future__ import annotations

import torch

from ._common import compute_dtype


def positions(x, seqlen_offset=0, seqlen_offsets=None, cu_seqlens=None) -> torch.Tensor:
    """int64 position of every token: (S,) or (B, S) for (B, H, S, D) x, (total,) when packed."""
    if cu_seqlens is None:
        pos = torch.arange(x.shape[-2], device=x.device) + seqlen_offset
        return pos if seqlen_offsets is None else pos + seqlen_offsets.long()[:, None]
    starts = cu_seqlens.long()
    token = torch.arange(x.shape[0], device=x.device)
    seq = torch.searchsorted(starts[1:], token, right=True)  # the sequence of each token
    pos = token - starts[seq] + seqlen_offset
    return pos if seqlen_offsets is None else pos + seqlen_offsets.long()[seq]


def _tables_for(x, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens):
    """cos and sin broadcastable against x[..., :rd/2]."""
    if cos.dim() == 3:  # already gathered, (B or 1, S, rd/2)
        return cos.unsqueeze(1), sin.unsqueeze(1)
    pos = positions(x, seqlen_offset, seqlen_offsets, cu_seqlens)
    # heads sit before the sequence dim in (B, H, S, D), after the token dim in (total, H, D)
    heads = -3 if cu_seqlens is None else -2
    return cos[pos].unsqueeze(heads), sin[pos].unsqueeze(heads)


def rotate(x, cos, sin, interleaved=False):
    """Rotate the pairs of x (..., rd) by angles with cos/sin (..., rd/2) broadcastable to them."""
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, -1)
    o1, o2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    return torch.stack((o1, o2), -1).flatten(-2) if interleaved else torch.cat((o1, o2), -1)


def rotary(x, cos, sin, interleaved=False, seqlen_offset=0, seqlen_offsets=None, cu_seqlens=None,
           conjugate=False):
    """RoPE of x (see the module doc); returns a tensor shaped like x in x's dtype."""
    cdt = compute_dtype(x.dtype, cos.dtype)
    rd = 2 * cos.shape[-1]
    c, s = (t.to(cdt) for t in _tables_for(x, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens))
    rotated = rotate(x[..., :rd].to(cdt), c, -s if conjugate else s, interleaved).to(x.dtype)
    return torch.cat((rotated, x[..., rd:]), -1)


def rotary_(x, cos, sin, interleaved=False, seqlen_offset=0, seqlen_offsets=None, cu_seqlens=None,
            conjugate=False):
    """rotary in x's own storage: writes x[..., :rd] only; returns x."""
    rd = 2 * cos.shape[-1]
    x[..., :rd].copy_(rotary(x[..., :rd], cos, sin, interleaved, seqlen_offset, seqlen_offsets, cu_seqlens,
                             conjugate))
    return x


def rotary_qk(q, k, cos, sin, interleaved=False, seqlen_offset=0, seqlen_offsets=None, cu_seqlens=None,
              conjugate=False):
    """(rotary of q, rotary of k): one set of positions, any head counts."""
    return tuple(rotary(t, cos, sin, interleaved, seqlen_offset, seqlen_offsets, cu_seqlens, conjugate)
                 for t in (q, k))


def rotary_qk_(q, k, cos, sin, interleaved=False, seqlen_offset=0, seqlen_offsets=None, cu_seqlens=None,
               conjugate=False):
    """rotary_qk in q's and k's own storage; returns (q, k)."""
    return tuple(rotary_(t, cos, sin, interleaved, seqlen_offset, seqlen_offsets, cu_seqlens, conjugate)
                 for t in (q, k))


def rotary_cos_sin(seqlen, rotary_dim, base=10000.0, device=None, dtype=torch.float32):
    """(cos, sin) tables (seqlen, rotary_dim / 2): angle pos * base^(-2i / rotary_dim)."""
    cdt = compute_dtype(dtype)
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, device=device, dtype=cdt) / rotary_dim)
    freqs = torch.outer(torch.arange(seqlen, device=device, dtype=cdt), inv_freq)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)
