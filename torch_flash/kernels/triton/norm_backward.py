"""Triton RMSNorm / LayerNorm backward, optionally of the residual-add variant: dx and dW/dB
(norm.py has the forward, the dtype rules and the helpers both share).

The backward recomputes each row's statistics from x (or residual_out) with the forward's
arithmetic, or reads the forward's (stats=True: LayerNorm then takes one cross-warp reduction
round per row tile instead of two). dW/dB: each program sums g * xhat over its own range of
rows (and column chunk) into one row of an fp32 (programs, N) buffer, then a second kernel sums
the programs' rows: no atomics, bitwise reproducible. A row of up to BWD_MAX_BLOCK columns (16-bit
RMSNorm: BWD_RMS_MAX_BLOCK) is held in registers; wider rows are split into BWD_CHUNK-column chunks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import _dispatch
from .launch import cdiv, launch_as, next_power_of_2
from .norm import _ROUND_CODE, _blocks, _configs, _finish, _in_rows, _out, _ptrs, _round, _tile, _vector
from .scalars import fp32

BWD_MAX_BLOCK = 8192
# Rows wider than BWD_MAX_BLOCK are split into BWD_CHUNK-column chunks: one kernel sums each
# chunk's part of the row sums, a second computes dx and the dW/dB partials chunk by chunk, each
# chunk held in registers. x and dy are read twice (5/3 of the minimal traffic): 0.55-0.58 of
# copy at 16384-65536 columns, where one program looping over the columns ran at 0.3-0.4
# (H200, scripts/sweep_norm.py; chunks of 4096 and 8192 ran as fast at two chunks a row but
# up to 20x slower at four or more for RMSNorm, which the sweep times with recomputed statistics
# and LayerNorm with saved ones: not yet understood, not spills).
BWD_CHUNK = 2048
# Backward programs per SM: BWD_ELEMENTS_PER_SM // row block, at most 2 (dW partials are
# programs x N fp32; chosen with scripts/sweep_norm.py, docs/perf.md "Constants chosen from
# measurements").
BWD_ELEMENTS_PER_SM = 8192
BWD_MAX_PROGRAMS_PER_SM = 2
# Tiles of several (short) rows: accumulate dW/dB per row of the tile and sum the rows once at
# the end, instead of a cross-warp sum every tile: 0.83-0.90 of copy against 0.27-0.74 at 64-256
# columns, 0.65-0.87 against 0.58-0.74 at 1024 (H200, scripts/sweep_norm.py narrow).
BWD_ROW_ACC = True
# Load each row tile's successor while the current one is worked on (Triton does not pipeline
# these loads itself). At 8192 columns on 16 warps the prefetched tile makes the kernel spill in
# an sm_90 compile (Triton 3.9: 111 spill instructions for RMSNorm, 218 for LayerNorm from saved
# statistics; without it 0 and 42): scripts/sweep_norm.py (part prefetch) times both.
BWD_PREFETCH = True
# 16-bit RMSNorm rows of up to BWD_RMS_MAX_BLOCK columns in one pass, the whole row a program and
# no prefetch: 0.65 of copy at (4096, 16384) against the chunks' 0.57, where LayerNorm's one
# pass runs at 0.14-0.23 (H200, scripts/sweep_norm.py part prefetch,
# docs/results/sweep_norm_prefetch/2026-11-29_h200.json).
BWD_RMS_MAX_BLOCK = 16384


@triton.jit
def _saved_stats(MEAN, RSTD, rows, row_mask, HAS_STATS: tl.constexpr):
    """The forward's (mean, rstd) of these rows, or zeros (unused) when the backward recomputes them."""
    mean = tl.zeros(rows.shape, dtype=tl.float32)
    rstd = mean
    if HAS_STATS:
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    return mean, rstd


@triton.jit
def _weight(W, cols, col_mask, weight_offset, HAS_W: tl.constexpr):
    """(w + weight_offset) in fp32 as a row to broadcast, or 1.0 without a weight."""
    wo = 1.0
    if HAS_W:
        wo = (tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset)[None, :]
    return wo


@triton.jit
def _grad_tile(x, g, wo, mean, rstd, mask, IS_RMS: tl.constexpr):
    """(xhat, dxhat = g * (w + offset)) of one tile in fp32; xhat is 0 outside the mask."""
    if not IS_RMS:
        x = x - mean[:, None]
    return tl.where(mask, x * rstd[:, None], 0.0), g * wo


@triton.jit
def _residual_grad(GR, rows, cols, mask, stride, HAS_GRES: tl.constexpr):
    """The tile of the gradient of residual_out, or 0.0 without one (loaded early by the callers,
    so that its latency hides behind the math)."""
    gr = 0.0
    if HAS_GRES:
        gr = _tile(GR, rows, cols, mask, stride)
    return gr


@triton.jit
def _dx_store(xhat, dxhat, c1, c2, rstd, gr, DX, rows, cols, mask, stride_dx,
              IS_RMS: tl.constexpr, HAS_GRES: tl.constexpr):
    """dx = rstd * (dxhat - xhat * c1 - c2) (+ gr, the gradient of residual_out), with
    c1 = mean(dxhat * xhat) and c2 = mean(dxhat) (unused by RMSNorm)."""
    dx = dxhat - xhat * c1[:, None]
    if not IS_RMS:
        dx -= c2[:, None]
    dx *= rstd[:, None]
    if HAS_GRES:
        dx += gr
    tl.store(_ptrs(DX, rows, cols, stride_dx), dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _add3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _row_sums(x, g, wo, mask, N, eps, mean, rstd, IS_RMS: tl.constexpr, HAS_STATS: tl.constexpr):
    """Statistics and the backward's row sums of whole rows held in registers: (mean, rstd, c1,
    c2, xhat, dxhat) with c1 = mean(dxhat * xhat), c2 = mean(dxhat). With HAS_STATS, mean and
    rstd are the forward's and both sums take one cross-warp round. Without, they are
    recomputed: since xhat = (x - mean) * rstd, c1 = rstd * mean(dxhat * (x - mean)), so the
    sums that need rstd are taken in the same multi-operand reduction as sum((x - mean)^2), one
    round (LayerNorm: after the mean's) where computing rstd first would take two more."""
    if HAS_STATS:
        xhat, dxhat = _grad_tile(x, g, wo, mean, rstd, mask, IS_RMS)
        c1, c2 = tl.reduce((dxhat * xhat, dxhat), 1, _add2)
        c1, c2 = c1 / N, c2 / N
    else:
        dxhat = g * wo
        if IS_RMS:
            mean = tl.zeros([x.shape[0]], dtype=tl.float32)
            d = x
            m2, s1 = tl.reduce((x * x, dxhat * x), 1, _add2)
            s2 = mean
        else:
            mean = tl.sum(x, axis=1) / N
            d = tl.where(mask, x - mean[:, None], 0.0)
            m2, s1, s2 = tl.reduce((d * d, dxhat * d, dxhat), 1, _add3)
        rstd = tl.rsqrt(m2 / N + eps)
        c1, c2 = s1 * rstd / N, s2 / N
        xhat = tl.where(mask, d * rstd[:, None], 0.0)
    return mean, rstd, c1, c2, xhat, dxhat


@triton.jit
def _param_grads(g, xhat, mask, CAST_BEFORE_W: tl.constexpr, ROUND: tl.constexpr, ROW_ACC: tl.constexpr):
    """This tile's contributions to dW and dB: summed over its rows, or per row (ROW_ACC, for
    an accumulator that sums its rows once, after the loop)."""
    h = xhat
    if CAST_BEFORE_W:
        h = _round(xhat, ROUND)
    # rows past the end have g = 0 but may have NaN xhat (rstd of a zero row with eps = 0)
    dw = tl.where(mask, g * h, 0.0)
    db = g
    if not ROW_ACC:  # one return: Triton 3.6 checks a return after a constexpr-if's return too
        dw, db = tl.sum(dw, axis=0), tl.sum(g, axis=0)
    return dw, db


@triton.autotune(configs=_configs((4, 8, 16)), key=["N", "BLOCK_N", "ROWS"])
@triton.jit
def _norm_bwd_sums_kernel(G, X, W, MEAN, RSTD, PART, M, N, stride_g, stride_x, weight_offset,
                          IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_STATS: tl.constexpr,
                          CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """The backward's row sums over one column chunk of rows split into column chunks, into
    PART (M, CHUNKS, 4) fp32 (CHUNKS a power of 2; chunks past the row's end sum nothing): with
    the forward's statistics (sum(dxhat * xhat), sum(dxhat), -, -); without, the chunk's own
    mean and M2 of x (RMSNorm: 0 and sum(x^2)), sum(dxhat * (x - chunk mean)) and sum(dxhat),
    which _split_sums merges as Chan's update (no cancellation)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    x = _tile(X, rows, cols, mask, stride_x)
    wo = _weight(W, cols, col_mask, weight_offset, HAS_W)
    dxhat = _tile(G, rows, cols, mask, stride_g) * wo
    zero = tl.zeros([ROWS], dtype=tl.float32)
    if HAS_STATS:
        mean, rstd = _saved_stats(MEAN, RSTD, rows, row_mask, HAS_STATS)
        xhat, _ = _grad_tile(x, dxhat, 1.0, mean, rstd, mask, IS_RMS)
        s0, s1 = tl.reduce((dxhat * xhat, dxhat), 1, _add2)
        s2, s3 = zero, zero
    else:
        s0 = zero
        d = x
        if not IS_RMS:
            s0 = tl.sum(x, axis=1) / tl.maximum(tl.minimum(N - chunk * BLOCK_N, BLOCK_N), 1).to(tl.float32)
            d = tl.where(mask, x - s0[:, None], 0.0)
        s1, s2, s3 = tl.reduce((d * d, dxhat * d, dxhat), 1, _add3)
    part = PART + (rows.to(tl.int64) * CHUNKS + chunk) * 4
    tl.store(part, s0, mask=row_mask)
    tl.store(part + 1, s1, mask=row_mask)
    tl.store(part + 2, s2, mask=row_mask)
    tl.store(part + 3, s3, mask=row_mask)


@triton.jit
def _split_sums(PART, rows, row_mask, N, eps, mean, rstd, IS_RMS: tl.constexpr, HAS_STATS: tl.constexpr,
                CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(mean, rstd, c1, c2) of rows split into column chunks, from _norm_bwd_sums_kernel's sums
    (merged in a fixed order: bitwise reproducible); mean and rstd are the forward's with HAS_STATS."""
    k = tl.arange(0, CHUNKS)
    part = PART + (rows.to(tl.int64)[:, None] * CHUNKS + k[None, :]) * 4
    m = row_mask[:, None]
    p0 = tl.load(part, mask=m, other=0.0)
    p1 = tl.load(part + 1, mask=m, other=0.0)
    if HAS_STATS:
        c1 = tl.sum(p0, axis=1) / N
        c2 = tl.sum(p1, axis=1) / N
    else:
        p2 = tl.load(part + 2, mask=m, other=0.0)
        p3 = tl.load(part + 3, mask=m, other=0.0)
        nb = tl.maximum(tl.minimum(N - k * BLOCK_N, BLOCK_N), 0).to(tl.float32)[None, :]
        mean = tl.sum(p0 * nb, axis=1) / N
        dm = p0 - mean[:, None]  # each chunk's mean from the row's
        m2, s1, s2 = tl.reduce((p1 + nb * dm * dm, p2 + dm * p3, p3), 1, _add3)
        rstd = tl.rsqrt(m2 / N + eps)
        c1, c2 = s1 * rstd / N, s2 / N
    return mean, rstd, c1, c2


@triton.autotune(configs=_configs((4, 8, 16, 32)), key=["N", "BLOCK_N", "ROWS", "PREFETCH"])
@triton.jit
def _norm_bwd_kernel(G, GR, X, W, MEAN, RSTD, PART, DX, DWP, DBP, M, N, stride_g, stride_gr, stride_x,
                     stride_dx, eps, weight_offset,
                     IS_RMS: tl.constexpr, HAS_GRES: tl.constexpr, HAS_W: tl.constexpr,
                     HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, CAST_BEFORE_W: tl.constexpr,
                     ROUND: tl.constexpr, HAS_STATS: tl.constexpr, CHUNKS: tl.constexpr,
                     BLOCK_N: tl.constexpr, ROWS: tl.constexpr, ROW_ACC: tl.constexpr,
                     PREFETCH: tl.constexpr):
    """dx and the dW/dB partials of a column chunk held in registers (the whole row where
    CHUNKS = 1, else the row sums come from PART, as _split_sums reads them): program (p, c)
    owns rows [p*M//P, (p+1)*M//P) (at least one, as P <= M), chunk c and chunk c's columns of
    row p of the partials."""
    eps, weight_offset = fp32(eps), fp32(weight_offset)
    pid = tl.program_id(0).to(tl.int64)
    row_start = (pid * M) // tl.num_programs(0)
    row_end = ((pid + 1) * M) // tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    # With HAS_DB, w + offset is read again (from L1) per row tile rather than held for the
    # whole loop, where dB's accumulator would make the row's registers spill; without dB,
    # holding it is faster (docs/perf.md, "Tried and not kept")
    if not HAS_DB:
        wo = _weight(W, cols, col_mask, weight_offset, HAS_W)
    if ROW_ACC:  # a cross-warp reduction once per program rather than once per row tile
        dw = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        db = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    else:
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        rows = row_start + tl.arange(0, ROWS)
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        x_next = tl.load(_ptrs(X, rows, cols, stride_x), mask=mask, other=0.0)
        g_next = tl.load(_ptrs(G, rows, cols, stride_g), mask=mask, other=0.0)
        mean_next, rstd_next = _saved_stats(MEAN, RSTD, rows, rows < row_end, HAS_STATS)
    for r0 in range(row_start, row_end, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        if PREFETCH:
            x = x_next.to(tl.float32)
            g = g_next.to(tl.float32)
            mean, rstd = mean_next, rstd_next
        else:
            x = _tile(X, rows, cols, mask, stride_x)
            g = _tile(G, rows, cols, mask, stride_g)
            mean, rstd = _saved_stats(MEAN, RSTD, rows, row_mask, HAS_STATS)
        gr = _residual_grad(GR, rows, cols, mask, stride_gr, HAS_GRES)
        if PREFETCH:  # one program per SM is all the registers allow: its loads overlap its math
            next_mask = (rows + ROWS < row_end)[:, None] & col_mask[None, :]
            x_next = tl.load(_ptrs(X, rows + ROWS, cols, stride_x), mask=next_mask, other=0.0)
            g_next = tl.load(_ptrs(G, rows + ROWS, cols, stride_g), mask=next_mask, other=0.0)
            mean_next, rstd_next = _saved_stats(MEAN, RSTD, rows + ROWS, rows + ROWS < row_end, HAS_STATS)
        if HAS_DB:
            wo = _weight(W, cols, col_mask, weight_offset, HAS_W)
        if CHUNKS == 1:
            mean, rstd, c1, c2, xhat, dxhat = _row_sums(x, g, wo, mask, N, eps, mean, rstd, IS_RMS, HAS_STATS)
        else:
            mean, rstd, c1, c2 = _split_sums(PART, rows, row_mask, N, eps, mean, rstd, IS_RMS, HAS_STATS,
                                             CHUNKS, BLOCK_N)
            xhat, dxhat = _grad_tile(x, g, wo, mean, rstd, mask, IS_RMS)
        _dx_store(xhat, dxhat, c1, c2, rstd, gr, DX, rows, cols, mask, stride_dx, IS_RMS, HAS_GRES)
        dw_t, db_t = _param_grads(g, xhat, mask, CAST_BEFORE_W, ROUND, ROW_ACC)
        dw += dw_t
        db += db_t
    if ROW_ACC:
        dw = tl.sum(dw, axis=0)
        db = tl.sum(db, axis=0)
    if HAS_DW:
        tl.store(DWP + pid * N + cols, dw, mask=col_mask)
    if HAS_DB:
        tl.store(DBP + pid * N + cols, db, mask=col_mask)


@triton.jit
def _sum_parts_kernel(PARTS, OUT0, OUT1, n_parts, N, HAS_OUT1: tl.constexpr, BLOCK: tl.constexpr,
                      ROWS: tl.constexpr):
    """OUT{p}[cols] = sum over the programs' partial rows PARTS[p, :, cols] (fp32, (n_params,
    n_parts, N)), in a fixed order, stored in OUT{p}'s dtype: dW and dB in one launch."""
    param = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < N
    base = PARTS + param.to(tl.int64) * n_parts * N
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for r0 in range(0, n_parts, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        acc += tl.load(base + rows.to(tl.int64)[:, None] * N + cols[None, :],
                       mask=(rows < n_parts)[:, None] & col_mask[None, :], other=0.0)
    total = tl.sum(acc, axis=0)
    if param == 0:
        tl.store(OUT0 + cols, total.to(OUT0.dtype.element_ty), mask=col_mask)
    if HAS_OUT1:
        if param == 1:
            tl.store(OUT1 + cols, total.to(OUT1.dtype.element_ty), mask=col_mask)


# _sum_parts_kernel's tile: columns per program and partial rows per step. 32 columns give
# 256 programs at N = 4096 for two parameters, enough to stream the partials (wider tiles:
# docs/perf.md, "Tried and not kept").
SUM_BLOCK = 32
SUM_ROWS = 64


def _bwd_programs(m: int, block: int, chunks: int, device: torch.device) -> int:
    """Backward programs along the rows, each owning a range of rows in each of the row's
    `chunks` column chunks: a few per SM in all (fewer for wide rows)."""
    if device.type != "cuda":
        return min(m, 2)  # interpreter: two programs still exercise the partial-sum reduction
    per_sm = max(1, min(BWD_MAX_PROGRAMS_PER_SM, BWD_ELEMENTS_PER_SM // block))
    return min(m, max(1, _dispatch.sm_count(device) * per_sm // chunks))


class NormBwd:
    """norm_bwd's decisions for one signature of its arguments, as NormFwd."""

    def __init__(self, grad_y, grad_residual_out, x, weight, bias, *, eps, is_rms, weight_offset,
                 cast_before_weight, out_dtype, mean=None, rstd=None, block_n=None):
        self.n = n = x.shape[-1]
        self.m = m = x.numel() // n
        widest_whole = BWD_RMS_MAX_BLOCK if is_rms and x.element_size() <= 2 else BWD_MAX_BLOCK  # in registers
        block, rows_per_tile = _blocks(n, widest_whole if n <= widest_whole else BWD_CHUNK, block_n)
        self.chunks = chunks = cdiv(n, block)
        self.programs = _bwd_programs(m, block, chunks, x.device) if m > 0 else 0
        self.scalars = (eps, weight_offset)
        self.consts = dict(IS_RMS=is_rms, HAS_GRES=grad_residual_out is not None, HAS_W=weight is not None,
                           HAS_DW=weight is not None, HAS_DB=bias is not None, CAST_BEFORE_W=cast_before_weight,
                           ROUND=_ROUND_CODE.get(out_dtype, 0), HAS_STATS=rstd is not None,
                           CHUNKS=next_power_of_2(chunks), BLOCK_N=block, ROWS=rows_per_tile,
                           ROW_ACC=BWD_ROW_ACC and rows_per_tile > 1,
                           PREFETCH=BWD_PREFETCH and block <= BWD_MAX_BLOCK)
        self.sums_consts = {k: self.consts[k] for k in ("IS_RMS", "HAS_W", "HAS_STATS", "CHUNKS", "BLOCK_N",
                                                         "ROWS")}
        self.sums_grid = (cdiv(m, rows_per_tile), self.consts["CHUNKS"])  # chunks past the row: zeros
        n_outs = (weight is not None) + (bias is not None)
        self.sum_grid = (cdiv(n, SUM_BLOCK), n_outs)
        self.sum_consts = dict(HAS_OUT1=n_outs == 2, BLOCK=SUM_BLOCK, ROWS=SUM_ROWS)
        self.launchers = [None, None, None]

    def __call__(self, grad_y, grad_residual_out, x, weight, bias, mean=None, rstd=None):
        n, m = self.n, self.m
        dx, dx_dst, dx_stride = _out(x, n, x.dtype)
        if m == 0:
            return (dx, None if weight is None else torch.zeros_like(weight),
                    None if bias is None else torch.zeros_like(bias))
        g_rows, gr_rows, x_rows = _in_rows(grad_y, n), _in_rows(grad_residual_out, n), _in_rows(x, n)
        # dW and dB partials in one buffer, so that one reduction kernel finishes both
        n_params = (weight is not None) + (bias is not None)
        parts = torch.empty(n_params, self.programs, n, dtype=torch.float32, device=x.device)
        dwp = parts[0] if weight is not None else None
        dbp = parts[-1] if bias is not None else None
        w, mean, rstd = _vector(weight), _vector(mean), _vector(rstd)
        part = None
        if self.chunks > 1:  # each chunk's share of the row sums
            part = torch.empty(m, self.consts["CHUNKS"], 4, dtype=torch.float32, device=x.device)
            args = (g_rows, x_rows, w, mean, rstd, part, m, n, g_rows.stride(0), x_rows.stride(0), self.scalars[1])
            self.launchers[2] = launch_as(self.launchers[2], _norm_bwd_sums_kernel, self.sums_grid, args,
                                          self.sums_consts)
        args = (g_rows, gr_rows, x_rows, w, mean, rstd, part, dx_dst, dwp, dbp, m, n,
                g_rows.stride(0), 0 if gr_rows is None else gr_rows.stride(0), x_rows.stride(0), dx_stride,
                *self.scalars)
        self.launchers[0] = launch_as(self.launchers[0], _norm_bwd_kernel, (self.programs, self.chunks), args,
                                      self.consts)
        dw, db = (None if p is None else torch.empty(p.shape, dtype=p.dtype, device=x.device)
                  for p in (weight, bias))
        outs = [t for t in (dw, db) if t is not None]
        if outs:
            # one launch sums the partials and writes both in their dtypes (torch's sum and two
            # casts were three kernels after the main one)
            args = (parts, outs[0], outs[1] if len(outs) == 2 else None, self.programs, n)
            self.launchers[1] = launch_as(self.launchers[1], _sum_parts_kernel, self.sum_grid, args,
                                          self.sum_consts)
        return _finish(dx, dx_dst), dw, db


def norm_bwd(grad_y, grad_residual_out, x_or_residual_out, weight, bias, *, mean=None, rstd=None, **flags):
    """Gradients of norm_fwd: (dx, dweight or None, dbias or None).

    x_or_residual_out is the tensor that was normalised (x, or residual_out of the add variant);
    dx is its gradient in its dtype, plus grad_residual_out when given (the add variant's
    d(x + residual)). flags: eps, is_rms, weight_offset, cast_before_weight, out_dtype (the dtype
    xhat was rounded to before the weight product: x's dtype; with cast_before_weight it enters
    dweight), block_n=None. dweight/dbias in their parameter's dtype. mean, rstd:
    norm_fwd(stats=True)'s statistics (fp32, x.shape[:-1]), both or neither; without them the
    kernel recomputes them from x.
    """
    plan = NormBwd(grad_y, grad_residual_out, x_or_residual_out, weight, bias, mean=mean, rstd=rstd, **flags)
    return plan(grad_y, grad_residual_out, x_or_residual_out, weight, bias, mean, rstd)
