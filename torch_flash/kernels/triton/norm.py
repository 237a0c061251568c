"""Triton RMSNorm / LayerNorm forward, optionally fused with a residual add, and what the
backward (norm_backward.py) shares with it: the dtype rules, tile choice and row views.

One kernel family serves both norms (IS_RMS constexpr). x is (..., N), processed as M rows of N.
Statistics are fp32. Dtype rules follow torch_flash/reference/rms_norm.py and layer_norm.py:

* y = xhat * (w + weight_offset) + b, xhat = (x - mean) * rstd (RMSNorm: mean = 0, rstd from
  mean(x^2)). cast_before_weight=True (HF LLaMA): xhat is rounded to x's dtype and multiplied
  by (w + weight_offset) rounded to w's dtype, y in promote(x, w). False (Gemma, LayerNorm): the
  affine is fp32 and y is x's dtype. LayerNorm callers pass cast_before_weight=False.
* With a residual: residual_out = x + residual, stored in fp32 or x's dtype, and y is computed
  from residual_out as stored (y still in the dtype above, xhat still rounded to x's dtype).
* The forward can also store each row's fp32 mean and rstd (stats=True) for the backward.

A row that fits one block (N <= BLOCK_N) is read once and kept in registers. Longer rows: the
forward loops over column blocks, statistics first (Chan's merge of per-block mean and M2, so
no cancellation from sum(x^2) - N mean^2), then a second pass normalises. There is no limit on N.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import _dispatch
from .launch import cdiv, launch_as, next_power_of_2
from .scalars import fp32

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Widest column block held in registers per row; longer rows loop over column blocks.
FWD_MAX_BLOCK = 16384
# Target elements per program tile: short rows are processed several at a time.
TILE = 4096

_ROUND_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _configs(warps: tuple[int, ...]) -> list[triton.Config]:
    # The interpreter cannot time configs; one is enough for correctness there.
    if _dispatch.triton_interpret():
        return [triton.Config({}, num_warps=4)]
    return [triton.Config({}, num_warps=w) for w in warps]


@triton.jit
def _round(x, CODE: tl.constexpr):
    """x (fp32) rounded to fp32 / fp16 / bf16 (CODE 0 / 1 / 2), returned as fp32."""
    if CODE == 1:
        x = x.to(tl.float16).to(tl.float32)
    elif CODE == 2:
        x = x.to(tl.bfloat16).to(tl.float32)
    return x


@triton.jit
def _stats_update(x, mask, off, N, mean, m2, IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Merge one column block (columns off.. of each row; masked entries are 0) into the
    running (mean, M2) of each row. RMSNorm keeps mean = 0 and M2 = sum(x^2)."""
    if IS_RMS:
        m2 += tl.sum(x * x, axis=1)
    else:
        nb = tl.minimum(N - off, BLOCK_N).to(tl.float32)
        seen = off * 1.0
        mean_b = tl.sum(x, axis=1) / nb
        d = tl.where(mask, x - mean_b[:, None], 0.0)
        delta = mean_b - mean
        mean += delta * (nb / (seen + nb))
        m2 += tl.sum(d * d, axis=1) + delta * delta * (seen * nb / (seen + nb))
    return mean, m2


@triton.jit
def _ptrs(P, rows, cols, stride):
    """Pointers to the (rows, cols) tile of the matrix at P with row stride `stride` (64-bit)."""
    return P + rows.to(tl.int64)[:, None] * stride + cols[None, :]


@triton.jit
def _tile(P, rows, cols, mask, stride):
    """A (rows, cols) tile of the matrix at P, in fp32, 0 outside the mask."""
    return tl.load(_ptrs(P, rows, cols, stride), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_sum(X, R, RO, rows, cols, mask, stride_x, stride_r, stride_ro, HAS_RES: tl.constexpr):
    """x (or x + residual, stored to RO and returned as stored) of one tile, in fp32."""
    x = _tile(X, rows, cols, mask, stride_x)
    if HAS_RES:
        s = (x + _tile(R, rows, cols, mask, stride_r)).to(RO.dtype.element_ty)
        tl.store(_ptrs(RO, rows, cols, stride_ro), s, mask=mask)
        x = s.to(tl.float32)
    return x


@triton.jit
def _normalize_store(x, mean, rstd, W, B, Y, rows, cols, mask, col_mask, stride_y, weight_offset,
                     IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                     CAST_BEFORE_W: tl.constexpr, ROUND: tl.constexpr):
    """y of one tile from its x (fp32) and the row statistics, stored in Y's dtype."""
    if IS_RMS:
        y = x * rstd[:, None]
    else:
        y = (x - mean[:, None]) * rstd[:, None]
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0)
        if CAST_BEFORE_W:
            wo = (w.to(tl.float32) + weight_offset).to(W.dtype.element_ty).to(tl.float32)
            y = _round(y, ROUND) * wo[None, :]
        else:
            y = y * (w.to(tl.float32) + weight_offset)[None, :]
    if HAS_B:
        y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(_ptrs(Y, rows, cols, stride_y), y.to(Y.dtype.element_ty), mask=mask)


@triton.autotune(configs=_configs((4, 8, 16, 32)), key=["N", "BLOCK_N", "ROWS"])
@triton.jit
def _norm_fwd_kernel(X, R, W, B, Y, RO, MEAN, RSTD, M, N, stride_x, stride_r, stride_y, stride_ro,
                     eps, weight_offset,
                     IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr,
                     HAS_B: tl.constexpr, CAST_BEFORE_W: tl.constexpr, ROUND: tl.constexpr,
                     STORE_STATS: tl.constexpr, ONE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                     ROWS: tl.constexpr):
    eps, weight_offset = fp32(eps), fp32(weight_offset)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    zero = tl.zeros([ROWS], dtype=tl.float32)
    if ONE_BLOCK:  # whole row in registers: one read
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load_sum(X, R, RO, rows, cols, mask, stride_x, stride_r, stride_ro, HAS_RES)
        mean, m2 = _stats_update(x, mask, 0, N, zero, zero, IS_RMS, BLOCK_N)
        rstd = tl.rsqrt(m2 / N + eps)
        _normalize_store(x, mean, rstd, W, B, Y, rows, cols, mask, col_mask, stride_y, weight_offset,
                         IS_RMS, HAS_W, HAS_B, CAST_BEFORE_W, ROUND)
    else:
        mean, m2 = zero, zero
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = _load_sum(X, R, RO, rows, cols, mask, stride_x, stride_r, stride_ro, HAS_RES)
            mean, m2 = _stats_update(x, mask, off, N, mean, m2, IS_RMS, BLOCK_N)
        rstd = tl.rsqrt(m2 / N + eps)
        if HAS_RES:  # the second pass reads residual_out back: make every thread's stores visible
            tl.debug_barrier()
        for off in range(0, N, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            if HAS_RES:
                x = _tile(RO, rows, cols, mask, stride_ro)
            else:
                x = _tile(X, rows, cols, mask, stride_x)
            _normalize_store(x, mean, rstd, W, B, Y, rows, cols, mask, col_mask, stride_y, weight_offset,
                             IS_RMS, HAS_W, HAS_B, CAST_BEFORE_W, ROUND)
    if STORE_STATS:  # for the backward (MEAN, RSTD: M fp32 each, indexed by row)
        tl.store(MEAN + rows, mean, mask=row_mask)
        tl.store(RSTD + rows, rstd, mask=row_mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor | None:
    """(rows, n) view of t (..., n) when its rows share one stride and the last dim is
    contiguous, else None."""
    if t.is_contiguous():  # the common case, without the stride walk (host time per call)
        return t.view(-1, n)
    if n > 1 and t.stride(-1) != 1:
        return None
    lead = [(s, st) for s, st in zip(t.shape[:-1], t.stride()[:-1]) if s != 1]
    if any(st0 != st1 * s1 for (_, st0), (s1, st1) in zip(lead, lead[1:])):
        return None
    return t.as_strided((t.numel() // n, n), (lead[-1][1] if lead else n, 1))


def _in_rows(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if t is None:
        return None
    rows = _rows(t, n)
    return rows if rows is not None else t.contiguous().view(-1, n)


def _out(like: torch.Tensor, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(out, dst, row_stride): out shaped like `like` with empty_like's strides (what the fakes
    promise); the kernel writes the rows of dst, row_stride apart. dst is out itself where its
    rows share one stride: the kernel is handed out, not a row view of it, because Inductor (which
    traces into the op) clones a view a kernel writes and copies it back, a pass over every
    output. Where a permutation of the leading dims leaves out without one row stride, dst is a
    contiguous (M, n) buffer that _finish copies into out."""
    out = torch.empty_like(like, dtype=dtype)
    if out.is_contiguous():
        return out, out, n
    rows = _rows(out, n)
    if rows is not None:
        return out, out, rows.stride(0)
    return out, torch.empty(out.numel() // n, n, dtype=dtype, device=out.device), n


def _finish(out: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if dst is not out:
        out.copy_(dst.view(out.shape))
    return out


def _vector(t: torch.Tensor | None) -> torch.Tensor | None:
    # the kernels index weight, bias and the row statistics densely (rows in x's row order)
    return None if t is None else t.contiguous()


def _blocks(n: int, cap: int, block_n: int | None) -> tuple[int, int]:
    """(BLOCK_N, ROWS): the column block (block_n, or the row's width up to cap) and the rows per
    program tile."""
    block = block_n or min(next_power_of_2(n), cap)
    return block, max(1, min(64, TILE // block))


def norm_supports(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether these kernels serve x (..., N) with this weight (asked where Triton runs)."""
    return (x.dtype in DTYPES and x.dim() >= 1
            and x.shape[-1] > 0 and (weight is None or weight.dtype in DTYPES))


class NormFwd:
    """norm_fwd's decisions for one signature of its arguments (shapes, dtypes, flags): made
    once, then called with the tensors of every launch of that signature (the ops keep them per
    signature, torch_flash/ops/rms_norm.py). Flags as norm_fwd."""

    def __init__(self, x, weight, bias, residual, *, eps, is_rms, weight_offset, cast_before_weight,
                 residual_in_fp32, stats=False, out_dtype=None, block_n=None):
        self.n = n = x.shape[-1]
        y_dtype = (torch.promote_types(x.dtype, weight.dtype) if weight is not None and cast_before_weight
                   else x.dtype)
        if out_dtype is not None and y_dtype == torch.float32:
            y_dtype = out_dtype
        self.y_dtype, self.out_dtype = y_dtype, out_dtype or y_dtype
        self.ro_dtype = torch.float32 if residual_in_fp32 else x.dtype
        self.stats = stats
        self.m = x.numel() // n
        block, rows_per_tile = _blocks(n, FWD_MAX_BLOCK, block_n)
        self.grid = (cdiv(self.m, rows_per_tile),)
        self.scalars = (eps, weight_offset)
        self.consts = dict(IS_RMS=is_rms, HAS_RES=residual is not None, HAS_W=weight is not None,
                           HAS_B=bias is not None, CAST_BEFORE_W=cast_before_weight, ROUND=_ROUND_CODE[x.dtype],
                           STORE_STATS=stats, ONE_BLOCK=block >= n, BLOCK_N=block, ROWS=rows_per_tile)
        self.launcher = None

    def __call__(self, x, weight, bias, residual):
        n = self.n
        y, y_dst, y_stride = _out(x, n, self.y_dtype)
        ro = ro_dst = None
        ro_stride = 0
        if residual is not None:
            ro, ro_dst, ro_stride = _out(x, n, self.ro_dtype)
        mean = rstd = None
        if self.stats:
            mean, rstd = (torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device) for _ in range(2))
        if self.m > 0:
            x_rows, r_rows = _in_rows(x, n), _in_rows(residual, n)
            args = (x_rows, r_rows, _vector(weight), _vector(bias), y_dst, ro_dst, mean, rstd, self.m, n,
                    x_rows.stride(0), 0 if r_rows is None else r_rows.stride(0), y_stride, ro_stride,
                    *self.scalars)
            self.launcher = launch_as(self.launcher, _norm_fwd_kernel, self.grid, args, self.consts)
            _finish(y, y_dst)
            if ro is not None:
                _finish(ro, ro_dst)
        if y.dtype != self.out_dtype:  # no pass where the kernel stored out_dtype
            y = y.to(self.out_dtype)
        return (y, ro, mean, rstd) if self.stats else (y, ro)


def norm_fwd(x, weight, bias, residual, **flags):
    """y = norm(x [+ residual]) over the last dim of x (..., N); returns (y, residual_out or None),
    and with stats=True also (mean, rstd): each row's statistics as this kernel used them, fp32,
    shaped x.shape[:-1] (RMSNorm's mean is 0), for norm_bwd.

    flags: eps, is_rms, weight_offset, cast_before_weight, residual_in_fp32, stats=False,
    out_dtype=None, block_n=None. weight, bias: (N,) or None (RMSNorm takes no bias). out_dtype: y
    as cast to it, stored so by the kernel where y is computed in fp32 (one rounding either way).
    block_n forces the column block (a power of 2; tests use a small one so that the multi-block
    loop runs).
    """
    return NormFwd(x, weight, bias, residual, **flags)(x, weight, bias, residual)
