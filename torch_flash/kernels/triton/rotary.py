"""Triton rotary embedding kernels (GPT-NeoX and GPT-J layouts), of x or of q and k in one
launch, in place or out of place.

x is (B, H, S, D) with any strides and a contiguous last dim, or (total, H, D) packed with
cu_seqlens (B + 1,). cos/sin are tables (S_ro, rd/2) indexed by position, or per token
(B or 1, S, rd/2) for dense x. Token s of sequence b sits at position
s + seqlen_offset + seqlen_offsets[b].
The first rd = 2 * cos.shape[-1] dims rotate, in halves (GPT-NeoX: x[i] with x[i + rd/2]) or
in pairs (GPT-J: x[2i] with x[2i + 1]); the rest pass through. conjugate rotates by -theta
(the backward). fp32 math, output in x's dtype. A position outside the table (only possible
with tensor offsets, which the op validates in eager calls) leaves its token unrotated
rather than reading out of bounds.

A program rotates BLOCK_S tokens of BLOCK_H heads of one sequence, loading cos/sin once for
all its heads; the 1-D grid runs over head blocks first, then token blocks, then sequences
(any batch size: CUDA caps a second grid axis at 65535). _rotary_qk_kernel
rotates q and k (same shape but for their head counts, GQA) in one launch: its head blocks
are q's, then k's. Packed sequences find their sequence by a binary search in cu_seqlens, so
the grid needs no max_seqlen and no host synchronisation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import _dispatch
from .launch import cdiv, launch_as, next_power_of_2

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _configs() -> list[triton.Config]:
    # The interpreter cannot time configs, and small tiles keep it fast.
    if _dispatch.triton_interpret():
        return [triton.Config({"BLOCK_S": 4, "BLOCK_H": 2}, num_warps=4)]
    return [triton.Config({"BLOCK_S": s, "BLOCK_H": h}, num_warps=w)
            for s, h, w in ((8, 4, 4), (16, 2, 4), (16, 4, 4), (32, 2, 4), (32, 4, 8), (64, 1, 4))]


@triton.jit
def _rotate_heads(X, OUT, h, nheads, stride_xb, stride_xh, stride_xs, stride_ob, stride_oh, stride_os,
                  pid_b, s, in_range, cos, sin, RD2: tl.constexpr, TAIL: tl.constexpr,
                  INTERLEAVED: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_TAIL: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate heads h (BLOCK_H,) of tokens s (BLOCK_S,) of X into OUT; cos/sin (1, BLOCK_S, BLOCK_K)."""
    xrow = X + pid_b * stride_xb + h[:, None, None] * stride_xh + s[None, :, None] * stride_xs
    orow = OUT + pid_b * stride_ob + h[:, None, None] * stride_oh + s[None, :, None] * stride_os
    tile = (h < nheads)[:, None, None] & in_range[None, :, None]
    k = tl.arange(0, BLOCK_K)
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


@triton.jit
def _tables(COS, SIN, CU_SEQLENS, OFFSETS, pid_b, s, seqlen, seqlen_ro, seqlen_offset, nseq, search_steps,
            stride_cb, stride_cs, RD2: tl.constexpr, CONJUGATE: tl.constexpr, IS_VARLEN: tl.constexpr,
            HAS_OFFSETS: tl.constexpr, PER_TOKEN: tl.constexpr, BLOCK_K: tl.constexpr):
    """(cos, sin, in_range): fp32 cos/sin (1, BLOCK_S, BLOCK_K) of tokens s (BLOCK_S,) of
    sequence pid_b (of the packed tokens s when IS_VARLEN), and which tokens exist. A token of a
    sequence whose position misses the table (offsets or cu_seqlens that the op's checks of CPU
    tensors refuse; GPU ones are not read on the host) rotates to NaN, never out of bounds."""
    in_range = s < seqlen
    if IS_VARLEN:
        # s indexes the packed tokens; sequence b holds [cu[b], cu[b + 1])
        lo = tl.zeros([s.shape[0]], dtype=tl.int32)
        hi = tl.zeros([s.shape[0]], dtype=tl.int32) + nseq
        for _ in range(search_steps):
            mid = (lo + hi) // 2
            right = tl.load(CU_SEQLENS + mid) <= s
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
        b = lo
        pos = s - tl.load(CU_SEQLENS + b)
        in_seq = in_range & (s < tl.load(CU_SEQLENS + nseq))
    else:
        b = pid_b
        pos = s
        in_seq = in_range
    if not PER_TOKEN:  # per-token tables are indexed by (sequence, token) instead
        pos += seqlen_offset
        if HAS_OFFSETS:
            pos += tl.load(OFFSETS + b, mask=b < nseq, other=0).to(tl.int64)
    inside = (pos >= 0) & (pos < seqlen_ro)
    valid = in_seq & inside
    cs = b * stride_cb + pos * stride_cs
    k = tl.arange(0, BLOCK_K)
    cs_mask = valid[:, None] & (k < RD2)[None, :]
    # masked lanes get the identity rotation: tokens past the sequences are copied unchanged
    cos = tl.load(COS + cs[:, None] + k[None, :], mask=cs_mask, other=1.0).to(tl.float32)
    cos = tl.where((in_seq & ~inside)[:, None], float("nan"), cos)[None, :, :]
    sin = tl.load(SIN + cs[:, None] + k[None, :], mask=cs_mask, other=0.0).to(tl.float32)[None, :, :]
    if CONJUGATE:
        sin = -sin
    return cos, sin, in_range


@triton.jit
def _program_block(seqlen, head_blocks, BLOCK_S: tl.constexpr):
    """(sequence, token block, head block) of this program: the one grid axis runs over the
    head blocks first, so programs launched together cover all heads of the same tokens (one
    stretch of memory for (B, S, H, D) layouts, one read of the tokens' cos/sin), then the
    token blocks, then the batch (on one axis: a second one holds at most 65535 on CUDA)."""
    pid = tl.program_id(0).to(tl.int64)
    per_seq = tl.cdiv(seqlen, BLOCK_S) * head_blocks
    block = pid % per_seq
    return pid // per_seq, block // head_blocks, block % head_blocks


_KEY = ["RD2", "TAIL", "INTERLEAVED", "IS_VARLEN", "PER_TOKEN"]


@triton.autotune(configs=_configs(), key=_KEY, restore_value=["OUT"])  # tuning reruns it, in place too
@triton.jit
def _rotary_kernel(X, OUT, COS, SIN, CU_SEQLENS, OFFSETS,
                   seqlen, nheads, seqlen_ro, seqlen_offset, nseq, search_steps,
                   stride_xb, stride_xh, stride_xs, stride_ob, stride_oh, stride_os, stride_cb, stride_cs,
                   RD2: tl.constexpr, TAIL: tl.constexpr, INTERLEAVED: tl.constexpr,
                   CONJUGATE: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                   PER_TOKEN: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_TAIL: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_b, pid_s, pid_h = _program_block(seqlen, tl.cdiv(nheads, BLOCK_H), BLOCK_S)
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    cos, sin, in_range = _tables(COS, SIN, CU_SEQLENS, OFFSETS, pid_b, s, seqlen, seqlen_ro, seqlen_offset, nseq,
                                 search_steps, stride_cb, stride_cs, RD2, CONJUGATE, IS_VARLEN, HAS_OFFSETS,
                                 PER_TOKEN, BLOCK_K)
    _rotate_heads(X, OUT, pid_h * BLOCK_H + tl.arange(0, BLOCK_H), nheads,
                  stride_xb, stride_xh, stride_xs, stride_ob, stride_oh, stride_os,
                  pid_b, s, in_range, cos, sin, RD2, TAIL, INTERLEAVED, BLOCK_K, BLOCK_TAIL, BLOCK_S, BLOCK_H)


# A kernel of its own rather than _rotary_kernel with k optional: an autotuned kernel cannot
# restore a None argument on triton 3.6, and passing q again for k would alias two written
# arguments, which functionalization (torch.compile) copies back one after the other.
@triton.autotune(configs=_configs(), key=_KEY, restore_value=["QOUT", "KOUT"])
@triton.jit
def _rotary_qk_kernel(Q, QOUT, K, KOUT, COS, SIN, CU_SEQLENS, OFFSETS,
                      seqlen, nheads_q, nheads_k, seqlen_ro, seqlen_offset, nseq, search_steps,
                      stride_qb, stride_qh, stride_qs, stride_qob, stride_qoh, stride_qos,
                      stride_kb, stride_kh, stride_ks, stride_kob, stride_koh, stride_kos, stride_cb, stride_cs,
                      RD2: tl.constexpr, TAIL: tl.constexpr, INTERLEAVED: tl.constexpr,
                      CONJUGATE: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                      PER_TOKEN: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_TAIL: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    # the head blocks of q, then those of k
    q_blocks = tl.cdiv(nheads_q, BLOCK_H)
    pid_b, pid_s, pid_h = _program_block(seqlen, q_blocks + tl.cdiv(nheads_k, BLOCK_H), BLOCK_S)
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    cos, sin, in_range = _tables(COS, SIN, CU_SEQLENS, OFFSETS, pid_b, s, seqlen, seqlen_ro, seqlen_offset, nseq,
                                 search_steps, stride_cb, stride_cs, RD2, CONJUGATE, IS_VARLEN, HAS_OFFSETS,
                                 PER_TOKEN, BLOCK_K)
    if pid_h < q_blocks:
        _rotate_heads(Q, QOUT, pid_h * BLOCK_H + tl.arange(0, BLOCK_H), nheads_q,
                      stride_qb, stride_qh, stride_qs, stride_qob, stride_qoh, stride_qos,
                      pid_b, s, in_range, cos, sin, RD2, TAIL, INTERLEAVED, BLOCK_K, BLOCK_TAIL, BLOCK_S, BLOCK_H)
    else:
        _rotate_heads(K, KOUT, (pid_h - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H), nheads_k,
                      stride_kb, stride_kh, stride_ks, stride_kob, stride_koh, stride_kos,
                      pid_b, s, in_range, cos, sin, RD2, TAIL, INTERLEAVED, BLOCK_K, BLOCK_TAIL, BLOCK_S, BLOCK_H)


def rotary_supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel serves this x (B, H, S, D) or (total, H, D) with these tables."""
    return (x.dtype in DTYPES and x.dim() in (3, 4)
            and (x.stride(-1) == 1 or x.shape[-1] == 1) and cos.dtype in DTYPES and sin.dtype in DTYPES
            and cos.dim() in (2, 3) and cos.shape == sin.shape and 0 < 2 * cos.shape[-1] <= x.shape[-1]
            and (cos.dim() == 2 or (x.dim() == 4 and cos.shape[0] in (1, x.shape[0]))))


class Rotate:
    """One launch's decisions for a signature of its arguments (shapes, strides, dtypes, flags):
    the kernel, grid and every scalar argument, made once, then called with the tensors of
    each launch of that signature (the ops keep them per signature, torch_flash/ops/rotary.py).
    pairs: ((x, out),) for _rotary_kernel or ((q, q_out), (k, k_out)) for _rotary_qk_kernel,
    whose arguments run in the same order; out may be x (in place), else it has x's layout."""

    def __init__(self, pairs, cos, sin, *, interleaved, seqlen_offset, seqlen_offsets, cu_seqlens, conjugate):
        self.empty = all(x.numel() == 0 for x, _ in pairs)
        per_token = cos.dim() == 3
        packed = cu_seqlens is not None
        x = pairs[0][0]
        if packed:
            seqlen, d = x.shape[0], x.shape[-1]
            nbatch, nseq = 1, cu_seqlens.shape[0] - 1
        else:
            nbatch, _, seqlen, d = x.shape
            nseq = nbatch
        heads = [x.shape[1] for x, _ in pairs]
        rd2 = cos.shape[-1]
        tail = 0 if pairs[0][1] is x else d - 2 * rd2

        def strides(t):  # (batch, head, token); a packed tensor has no batch dim
            return (0, t.stride(1), t.stride(0)) if packed else (t.stride(0), t.stride(1), t.stride(2))

        def grid(meta):
            return nbatch * cdiv(seqlen, meta["BLOCK_S"]) * sum(cdiv(h, meta["BLOCK_H"]) for h in heads),

        # cos and sin share one set of strides in the kernel (contiguous copies: tables are small)
        table = cos.contiguous()
        self.kernel = _rotary_kernel if len(pairs) == 1 else _rotary_qk_kernel
        self.grid = grid
        self.scalars = (seqlen, *heads, cos.shape[-2], seqlen_offset, nseq, max(nseq - 1, 0).bit_length(),
                        *(st for pair in pairs for t in pair for st in strides(t)),
                        table.stride(0) if per_token and cos.shape[0] > 1 else 0, table.stride(-2))
        self.consts = dict(RD2=rd2, TAIL=tail, INTERLEAVED=interleaved, CONJUGATE=conjugate, IS_VARLEN=packed,
                           HAS_OFFSETS=seqlen_offsets is not None, PER_TOKEN=per_token,
                           BLOCK_K=next_power_of_2(rd2), BLOCK_TAIL=next_power_of_2(max(tail, 1)))
        self.launcher = None

    def __call__(self, pairs, cos, sin, seqlen_offsets, cu_seqlens) -> None:
        if self.empty:
            return
        args = (*(t for pair in pairs for t in pair), cos.contiguous(), sin.contiguous(), cu_seqlens,
                seqlen_offsets, *self.scalars)
        self.launcher = launch_as(self.launcher, self.kernel, self.grid, args, self.consts)


def rotate(pairs, cos, sin, **flags) -> None:
    """One launch over pairs (as Rotate); flags: interleaved, seqlen_offset, seqlen_offsets,
    cu_seqlens, conjugate."""
    Rotate(pairs, cos, sin, **flags)(pairs, cos, sin, flags["seqlen_offsets"], flags["cu_seqlens"])


def rotary_apply(x, cos, sin, *, out=None, **flags):
    """Rotate x (B, H, S, D), or (total, H, D) with cu_seqlens, into out (new if None; out=x
    rotates in place; any out must have x's shape and a contiguous last dim). flags:
    interleaved, seqlen_offset (int), seqlen_offsets ((B,) int tensor or None: tables only, not
    per-token cos/sin), cu_seqlens, conjugate. Returns out."""
    out = torch.empty_like(x) if out is None else out
    rotate(((x, out),), cos, sin, **flags)
    return out


def rotary_apply_qk(q, k, cos, sin, *, q_out=None, k_out=None, **flags):
    """rotary_apply of q and k in one launch: k has q's shape and dtype but its own head count
    (dim 1). q_out/k_out: new if None, or q and k themselves (in place, both or neither).
    Returns (q_out, k_out)."""
    q_out = torch.empty_like(q) if q_out is None else q_out
    k_out = torch.empty_like(k) if k_out is None else k_out
    if (q_out is q) != (k_out is k):
        raise ValueError("rotary_apply_qk: rotate q and k both in place or both out of place")
    rotate(((q, q_out), (k, k_out)), cos, sin, **flags)
    return q_out, k_out
