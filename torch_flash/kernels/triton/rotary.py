"""Triton rotary embedding kernel (GPT-NeoX and GPT-J layouts), in place or out of place.

x is (B, H, S, D) with any strides and a contiguous last dim, or (total, H, D) packed with
cu_seqlens (B + 1,). cos/sin are tables (S_ro, rd/2) indexed by position, or per token
(B or 1, S, rd/2) for dense x. Token s of sequence b sits at position
s + seqlen_offset + seqlen_offsets[b].
The first rd = 2 * cos.shape[-1] dims rotate, in halves (GPT-NeoX: x[i] with x[i + rd/2]) or
in pairs (GPT-J: x[2i] with x[2i + 1]); the rest pass through. conjugate rotates by -theta
(the backward). fp32 math, output in x's dtype. A position outside the table (only possible
with tensor offsets, which the op validates on the reference path) leaves its token unrotated
rather than reading out of bounds.

A program rotates BLOCK_S tokens of BLOCK_H heads of one sequence, loading cos/sin once for
all its heads. Packed sequences find their sequence by a binary search in cu_seqlens, so the
grid needs no max_seqlen and no host synchronisation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import _dispatch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _configs() -> list[triton.Config]:
    # The interpreter cannot time configs, and small tiles keep it fast.
    if _dispatch.triton_interpret():
        return [triton.Config({"BLOCK_S": 4, "BLOCK_H": 2}, num_warps=4)]
    return [triton.Config({"BLOCK_S": s, "BLOCK_H": h}, num_warps=w)
            for s, h, w in ((8, 4, 4), (16, 2, 4), (16, 4, 4), (32, 2, 4), (32, 4, 8), (64, 1, 4))]


@triton.autotune(configs=_configs(), key=["RD2", "TAIL", "INTERLEAVED", "IS_VARLEN", "PER_TOKEN"],
                 restore_value=["OUT"])  # tuning runs the kernel repeatedly, in place too
@triton.jit
def _rotary_kernel(X, OUT, COS, SIN, CU_SEQLENS, OFFSETS,
                   seqlen, nheads, seqlen_ro, seqlen_offset, nseq, search_steps,
                   stride_xb, stride_xh, stride_xs, stride_ob, stride_oh, stride_os, stride_cb, stride_cs,
                   RD2: tl.constexpr, TAIL: tl.constexpr, INTERLEAVED: tl.constexpr,
                   CONJUGATE: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                   PER_TOKEN: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_TAIL: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_b = tl.program_id(1).to(tl.int64)
    s = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    h = tl.program_id(2).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_range = s < seqlen
    if IS_VARLEN:
        # s indexes the packed tokens; sequence b holds [cu[b], cu[b + 1])
        lo = tl.zeros([BLOCK_S], dtype=tl.int32)
        hi = tl.zeros([BLOCK_S], dtype=tl.int32) + nseq
        for _ in range(search_steps):
            mid = (lo + hi) // 2
            right = tl.load(CU_SEQLENS + mid) <= s
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
        b = lo
        pos = s - tl.load(CU_SEQLENS + b)
        valid = in_range & (s < tl.load(CU_SEQLENS + nseq))
    else:
        b = pid_b
        pos = s
        valid = in_range
    if not PER_TOKEN:  # per-token tables are indexed by (sequence, token) instead
        pos += seqlen_offset
        if HAS_OFFSETS:
            pos += tl.load(OFFSETS + b, mask=b < nseq, other=0).to(tl.int64)
    valid &= (pos >= 0) & (pos < seqlen_ro)
    cs = b * stride_cb + pos * stride_cs
    k = tl.arange(0, BLOCK_K)
    cs_mask = valid[:, None] & (k < RD2)[None, :]
    # masked lanes get the identity rotation: tokens past the sequences are copied unchanged
    cos = tl.load(COS + cs[:, None] + k[None, :], mask=cs_mask, other=1.0).to(tl.float32)[None, :, :]
    sin = tl.load(SIN + cs[:, None] + k[None, :], mask=cs_mask, other=0.0).to(tl.float32)[None, :, :]
    if CONJUGATE:
        sin = -sin

    xrow = X + pid_b * stride_xb + h[:, None, None] * stride_xh + s[None, :, None] * stride_xs
    orow = OUT + pid_b * stride_ob + h[:, None, None] * stride_oh + s[None, :, None] * stride_os
    tile = (h < nheads)[:, None, None] & in_range[None, :, None]
    if INTERLEAVED:
        j = tl.arange(0, 2 * BLOCK_K)
        mask = tile & (j < 2 * RD2)[None, None, :]
        xx = tl.load(xrow + j[None, None, :], mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(xx, [BLOCK_H, BLOCK_S, BLOCK_K, 2]))
        o = tl.reshape(tl.join(x1 * cos - x2 * sin, x1 * sin + x2 * cos), [BLOCK_H, BLOCK_S, 2 * BLOCK_K])
        tl.store(orow + j[None, None, :], o.to(OUT.dtype.element_ty), mask=mask)
    else:
        kk = k[None, None, :]
        mask = tile & (kk < RD2)
        x1 = tl.load(xrow + kk, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xrow + RD2 + kk, mask=mask, other=0.0).to(tl.float32)
        tl.store(orow + kk, (x1 * cos - x2 * sin).to(OUT.dtype.element_ty), mask=mask)
        tl.store(orow + RD2 + kk, (x1 * sin + x2 * cos).to(OUT.dtype.element_ty), mask=mask)
    if TAIL > 0:  # out of place: dims past the rotary dim pass through
        t = 2 * RD2 + tl.arange(0, BLOCK_TAIL)[None, None, :]
        mask = tile & (t < 2 * RD2 + TAIL)
        tl.store(orow + t, tl.load(xrow + t, mask=mask), mask=mask)


def rotary_supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel serves this x (B, H, S, D) or (total, H, D) with these tables."""
    return (_dispatch.triton_can_run(x.device) and x.dtype in DTYPES and x.dim() in (3, 4)
            and (x.stride(-1) == 1 or x.shape[-1] == 1) and cos.dtype in DTYPES and sin.dtype in DTYPES
            and cos.dim() in (2, 3) and cos.shape == sin.shape and 0 < 2 * cos.shape[-1] <= x.shape[-1]
            and (cos.dim() == 2 or (x.dim() == 4 and cos.shape[0] in (1, x.shape[0]))))


def rotary_apply(x, cos, sin, *, interleaved, seqlen_offset, seqlen_offsets, cu_seqlens, conjugate,
                 out=None):
    """Rotate x (B, H, S, D), or (total, H, D) with cu_seqlens, into out (new if None; out=x
    rotates in place; any out must have x's shape and a contiguous last dim). seqlen_offset:
    int; seqlen_offsets: (B,) int tensor or None (tables only, not per-token cos/sin).
    Returns out."""
    if out is None:
        out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    # cos and sin share one set of strides in the kernel; tables are small
    cos, sin = cos.contiguous(), sin.contiguous()
    per_token = cos.dim() == 3
    if cu_seqlens is not None:
        seqlen, nheads, d = x.shape
        nbatch, nseq = 1, cu_seqlens.shape[0] - 1
        xs = (0, x.stride(1), x.stride(0))
        os_ = (0, out.stride(1), out.stride(0))
    else:
        nbatch, nheads, seqlen, d = x.shape
        nseq = nbatch
        xs = (x.stride(0), x.stride(1), x.stride(2))
        os_ = (out.stride(0), out.stride(1), out.stride(2))
    rd2 = cos.shape[-1]
    tail = 0 if out is x else d - 2 * rd2

    def grid(meta):
        return triton.cdiv(seqlen, meta["BLOCK_S"]), nbatch, triton.cdiv(nheads, meta["BLOCK_H"])

    torch.library.wrap_triton(_rotary_kernel)[grid](
        x, out, cos, sin, cu_seqlens, seqlen_offsets,
        seqlen, nheads, cos.shape[-2], seqlen_offset, nseq, max(nseq - 1, 0).bit_length(),
        *xs, *os_, cos.stride(0) if per_token and cos.shape[0] > 1 else 0, cos.stride(-2),
        RD2=rd2, TAIL=tail, INTERLEAVED=interleaved, CONJUGATE=conjugate, IS_VARLEN=cu_seqlens is not None,
        HAS_OFFSETS=seqlen_offsets is not None, PER_TOKEN=per_token, BLOCK_K=triton.next_power_of_2(rd2),
        BLOCK_TAIL=triton.next_power_of_2(max(tail, 1)))
    return out
