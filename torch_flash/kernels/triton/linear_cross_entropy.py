"""Triton linear cross-entropy (flash.linear_cross_entropy: the lm-head and cross-entropy in one).

Token chunks; per chunk the logits come from cuBLAS column-major (weight @ hidden.T, in the
input dtype: that GEMM runs faster than its transpose), a column kernel (_ce_cols_kernel: blocks
of adjacent tokens, the vocabulary split across programs whose row statistics _ce_combine_kernel
joins) adds the bias and turns them into their gradient in place, and two more GEMMs give
dhidden's rows and dweight. The (N, V) logits never exist; the first chunk keeps its logits in
dweight's own memory (_resident_chunk).

The loss formula and the row helpers these kernels share: cross_entropy.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import _dispatch
from ...reference.cross_entropy import LossOptions
from .cross_entropy import (DTYPES, INDEX_DTYPES, _LN2, _LOG2E, _capped, _dz, _flat, _grad_coefs, _loss,
                            _n_valid, _online_lse, _reduce)
from .launch import cdiv, launch, next_power_of_2
from .scalars import fp32


# Budget for one chunk's logits in linear_cross_entropy (chunk_size=0): 256 MiB is 1024 rows of
# a 128k bf16 vocabulary, 1/8 of an 8192-token batch; bigger chunks add memory, smaller ones add
# GEMM launches and dweight roundings (see lce_fwd).
LCE_CHUNK_BYTES = 256 * 2**20
# Where dweight is computed, a chunk may hold up to 1/LCE_DWEIGHT_SHARE of dweight's bytes of
# logits: at least hidden / 3 rows. Every chunk reads and writes the whole dweight (4*V*H bytes
# in bf16) for 6*rows*V*H FLOPs of GEMMs, so the rows, not the bytes, set that overhead, paid in
# joules at the GPU's power cap (docs/perf.md, "Linear cross-entropy"). At 8192 x 4096 x 128256,
# 4096 + 1024 tokens are resident and the other 3072 split evenly under that cap: 3 x 1024.
LCE_DWEIGHT_SHARE = 3
# Chunk rows are rounded to a multiple of this (GEMM tile) where the chunk is that large.
LCE_ROW_ALIGN = 128
# Every chunk's token count is a multiple of this, a ragged chunk padded (_pad_rows), and so
# is the resident chunk's stride: cuBLAS runs a GEMM whose token extent or leading dimension is
# not in slower sm80 kernels, and Triton specializes the loss kernels on sizes and strides
# divisible by 16 (a ragged chunk made its GEMMs several times slower).
LCE_PITCH = 16
# The resident chunk's dweight GEMM runs in class slices of s = min(this, V // 2) rows, its
# logits shifted far enough that each slice writes only consumed logits (_resident_layout): at
# 4096 hidden and 4096 + 1024 tokens, GEMMs of 2048 x 4096 x 5120.
LCE_DWEIGHT_SLICE = 2048
# Its dhidden is summed in fp32 pieces of tokens whose two fp32 buffers take this much: at
# hidden 8192 a whole 8192-token chunk would take 512 MiB, more than Liger-Kernel's memory.
LCE_DH_PIECE_BYTES = 32 * 2**20
# _ce_cols_kernel's (rows per block (tokens, adjacent in memory), classes per block, warps,
# programs per SM) for its statistics and its gradient pass
LCE_COLS_STATS = (1024, 16, 4, 2)
LCE_COLS_GRAD = (1024, 16, 4, 4)
# _ce_combine_kernel: splits and rows per block; narrow row blocks spread its serial loop over
# the splits across more SMs
LCE_COMBINE_BLOCK_S = 128
LCE_COMBINE_BLOCK_R = 32


@triton.jit
def _biased(x, B, cols, n_cols, HAS_BIAS: tl.constexpr):
    """A (BLOCK_V, BLOCK_R) block of column-major logits in fp32, plus B[cols] per class."""
    x = x.to(tl.float32)
    if HAS_BIAS:
        x += tl.load(B + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[:, None]
    return x


@triton.jit
def _block_z(ptrs, mask, cols, c1, B, softcap, inv_softcap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """(z, tanh) of _capped for the (BLOCK_V, BLOCK_R) block of column-major logits at ptrs
    (classes cols, mask: what to read), the bias added in fp32."""
    return _capped(_biased(tl.load(ptrs, mask=mask, other=0.0), B, cols, c1, HAS_BIAS), softcap, inv_softcap, SOFTCAP)


@triton.jit
def _stats_block(ptrs, mask, cols, c1, B, m2, d, z_sum, softcap, inv_softcap, HAS_BIAS: tl.constexpr,
                 SUM_Z: tl.constexpr, SOFTCAP: tl.constexpr):
    """(m2, d, z_sum) with the (BLOCK_V, BLOCK_R) block of column-major logits at ptrs folded in
    (classes cols, mask: what to read)."""
    z, _ = _block_z(ptrs, mask, cols, c1, B, softcap, inv_softcap, HAS_BIAS, SOFTCAP)
    m2, d = _online_lse(m2, d, tl.where(mask, z * _LOG2E, float("-inf")))
    if SUM_Z:
        z_sum += tl.sum(tl.where(mask, z, 0.0), 0)
    return m2, d, z_sum


@triton.jit
def _grad_block(ptrs, mask, cols, c1, B, t_col, valid, lse2, coef, smooth, hit_w, softcap, inv_softcap,
                HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """Overwrites the block at ptrs (as _stats_block's) with its gradient, rows as _grad_coefs's."""
    z, th = _block_z(ptrs, mask, cols, c1, B, softcap, inv_softcap, HAS_BIAS, SOFTCAP)
    dz = _dz(z, th, lse2[None, :], coef[None, :], smooth[None, :], hit_w[None, :], cols[:, None] == t_col[None, :],
             SOFTCAP)
    # ignored rows (w = 0) get 0, also where exp2 overflowed against their lse of 0
    tl.store(ptrs, tl.where(valid[None, :], dz, 0.0).to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _ce_cols_kernel(X, B, T, Lse, ZT, ZSum, NValid, n_rows, n_cols, vocab_start, n_classes, split_cols,
                    stride_x, stride_stats, ignore_index, label_smoothing, z_loss, softcap, inv_softcap,
                    FORWARD: tl.constexpr, HAS_BIAS: tl.constexpr, MEAN: tl.constexpr, SUM_Z: tl.constexpr,
                    SOFTCAP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """Column-major logits: X[c * stride_x + r] (+ B[c] where HAS_BIAS, added in fp32) is class
    vocab_start + c (of n_classes) of row r, c < n_cols, r < n_rows. A program takes BLOCK_R
    rows and a split of split_cols columns, so each load is BLOCK_V runs of BLOCK_R adjacent
    rows.
    FORWARD, program (i, j): rows [i BLOCK_R, ...), split j; writes the split's lse, z at the
    target (0 if it lies elsewhere) and sum of z (SUM_Z) of each row to
    Lse/ZT/ZSum[j * stride_stats + r], fp32, 0 on ignored rows (_ce_combine_kernel joins them).
    Else: overwrites X with the gradient for an upstream gradient of 1 (1 / NValid[0] for MEAN),
    Lse[r] being the whole row's lse, programs in the reverse order so that the first ones find
    in L2 what the forward read last."""
    label_smoothing, z_loss = fp32(label_smoothing), fp32(z_loss)
    softcap, inv_softcap = fp32(softcap), fp32(inv_softcap)
    pid_r, pid_s = tl.program_id(0), tl.program_id(1)
    if not FORWARD:
        pid_r, pid_s = tl.num_programs(0) - 1 - pid_r, tl.num_programs(1) - 1 - pid_s
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    t = tl.load(T + rows, mask=row_ok, other=ignore_index)
    valid = row_ok & (t != ignore_index)
    c0 = pid_s * split_cols
    c1 = tl.minimum(c0 + split_cols, n_cols)
    t_local = t - vocab_start
    hit = valid & (t_local >= c0) & (t_local < c1)
    t_col = tl.where(hit, t_local, -1).to(tl.int32)
    # 64-bit column offsets (columns x stride_x may pass 2^31 elements: 8192 x 256k), then
    # pointers advanced a block at a time; masks constant along the rows (row_ok, not valid)
    # keep the loads vectorized: ignored rows are read, and dropped below
    ptrs = X + (c0.to(tl.int64) + tl.arange(0, BLOCK_V)[:, None]) * stride_x + rows[None, :]
    step = BLOCK_V * stride_x
    # whole class blocks first, masked by row only, then the partial one: with a class mask in
    # the loop, which Triton cannot prove uniform over a block for a class count not divisible
    # by 16, the loop ran far slower
    full = c0 + (c1 - c0) // BLOCK_V * BLOCK_V
    tail_cols = full + tl.arange(0, BLOCK_V)
    tail_mask = (tail_cols < c1)[:, None] & row_ok[None, :]
    if FORWARD:
        m2 = tl.full([BLOCK_R], float("-inf"), tl.float32)
        d = tl.zeros([BLOCK_R], dtype=tl.float32)
        z_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
        for off in range(c0, full, BLOCK_V):
            m2, d, z_sum = _stats_block(ptrs, row_ok[None, :], off + tl.arange(0, BLOCK_V), c1, B, m2, d, z_sum,
                                        softcap, inv_softcap, HAS_BIAS, SUM_Z, SOFTCAP)
            ptrs += step
        if full < c1:
            m2, d, z_sum = _stats_block(ptrs, tail_mask, tail_cols, c1, B, m2, d, z_sum, softcap, inv_softcap,
                                        HAS_BIAS, SUM_Z, SOFTCAP)
        x_t = tl.load(X + t_col.to(tl.int64) * stride_x + rows, mask=hit, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x_t += tl.load(B + t_col, mask=hit, other=0.0).to(tl.float32)
        z_t, _ = _capped(x_t, softcap, inv_softcap, SOFTCAP)
        out = pid_s * stride_stats + rows
        tl.store(Lse + out, tl.where(valid, (m2 + tl.log2(d)) * _LN2, 0.0), mask=row_ok)
        tl.store(ZT + out, tl.where(hit, z_t, 0.0), mask=row_ok)
        if SUM_Z:
            tl.store(ZSum + out, tl.where(valid, z_sum, 0.0), mask=row_ok)
    else:
        lse2 = tl.load(Lse + rows, mask=row_ok, other=0.0) * _LOG2E
        w = tl.full([BLOCK_R], 1.0, tl.float32)
        if MEAN:
            w = w / tl.load(NValid).to(tl.float32)
        w = tl.where(valid, w, 0.0)
        coef, smooth, hit_w = _grad_coefs(w, lse2, z_loss, label_smoothing, n_classes)
        for off in range(c0, full, BLOCK_V):
            _grad_block(ptrs, row_ok[None, :], off + tl.arange(0, BLOCK_V), c1, B, t_col, valid, lse2, coef,
                        smooth, hit_w, softcap, inv_softcap, HAS_BIAS, SOFTCAP)
            ptrs += step
        if full < c1:
            _grad_block(ptrs, tail_mask, tail_cols, c1, B, t_col, valid, lse2, coef, smooth, hit_w, softcap,
                        inv_softcap, HAS_BIAS, SOFTCAP)


@triton.jit
def _ce_combine_kernel(LseS, ZTS, ZSumS, T, Lse, Loss, n_rows, n_splits, stride_stats, ignore_index,
                       n_classes, label_smoothing, z_loss, SUM_Z: tl.constexpr, BLOCK_S: tl.constexpr,
                       BLOCK_R: tl.constexpr):
    """Rows [program_id(0) BLOCK_R, ...): the whole row's lse (log-add-exp of the n_splits
    splits' LseS[j * stride_stats + r]) and loss (with the sums of ZTS, ZSumS) to Lse[r],
    Loss[r]; 0 on ignored rows, NaN where the target lies outside the vocabulary."""
    label_smoothing, z_loss = fp32(label_smoothing), fp32(z_loss)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    t = tl.load(T + rows, mask=row_ok, other=ignore_index)
    valid = row_ok & (t != ignore_index)
    m2 = tl.full([BLOCK_R], float("-inf"), tl.float32)
    d = tl.zeros([BLOCK_R], dtype=tl.float32)
    z_t = tl.zeros([BLOCK_R], dtype=tl.float32)
    z_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        splits = s0 + tl.arange(0, BLOCK_S)
        mask = (splits < n_splits)[:, None] & row_ok[None, :]
        offs = splits[:, None] * stride_stats + rows[None, :]
        m2, d = _online_lse(m2, d, tl.load(LseS + offs, mask=mask, other=float("-inf")) * _LOG2E)
        z_t += tl.sum(tl.load(ZTS + offs, mask=mask, other=0.0), 0)
        if SUM_Z:
            z_sum += tl.sum(tl.load(ZSumS + offs, mask=mask, other=0.0), 0)
    lse = tl.where(valid, (m2 + tl.log2(d)) * _LN2, 0.0)
    lse = tl.where(valid & ((t < 0) | (t >= n_classes)), float("nan"), lse)
    tl.store(Lse + rows, lse, mask=row_ok)
    tl.store(Loss + rows, _loss(lse, z_t, z_sum, z_loss, label_smoothing, n_classes, SUM_Z), mask=row_ok)


@triton.jit
def _scale_kernel(X, G, n, BLOCK: tl.constexpr):
    """X[:n] *= G[0] unless G[0] == 1, on a grid of a few programs per SM that stride over X:
    the upstream gradient is read here, on the device, so the host never waits for it. G is
    rounded to X's dtype first, as torch's x.mul_(g.to(x.dtype)) does."""
    g = tl.load(G).to(X.dtype.element_ty).to(tl.float32)
    if g != 1.0:
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, step):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(X + offs, mask=mask)
            tl.store(X + offs, (x.to(tl.float32) * g).to(X.dtype.element_ty), mask=mask)


SCALE_BLOCK = 4096
SCALE_PROGRAMS_PER_SM = 4


def scale_unless_one_(tensors, grad_loss: torch.Tensor) -> None:
    """Multiplies each tensor in place by the one-element grad_loss; for contiguous ones the
    pass is skipped when it is 1 (the usual loss.backward()), without reading it on the host."""
    g = grad_loss.reshape(1)
    for x in tensors:
        if x.numel() == 0:
            continue
        if not x.is_contiguous():
            x.mul_(g.to(x.dtype))  # still no host read, only no skip
            continue
        programs = min(cdiv(x.numel(), SCALE_BLOCK), SCALE_PROGRAMS_PER_SM * _dispatch.sm_count(x.device))
        launch(_scale_kernel, (programs,), x, g, x.numel(), BLOCK=SCALE_BLOCK)


def lce_supports(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                 bias: torch.Tensor | None) -> bool:
    """Whether lce_fwd serves hidden (..., H), weight (V, H), target (...), bias (V,) or None."""
    return (hidden.dtype in DTYPES and hidden.dim() >= 1
            and weight.dim() == 2 and weight.dtype == hidden.dtype and weight.shape[0] > 0
            and weight.shape[1] == hidden.shape[-1] and weight.device == hidden.device
            and (bias is None or (bias.dtype == hidden.dtype and tuple(bias.shape) == (weight.shape[0],)
                                  and bias.device == hidden.device))
            and target.dtype in INDEX_DTYPES and tuple(target.shape) == tuple(hidden.shape[:-1])
            and target.device == hidden.device)


def lce_chunk_rows(n_rows: int, n_cols: int, dtype: torch.dtype, chunk_size: int = 0,
                   dweight_hidden: int = 0) -> int:
    """Rows per token chunk: chunk_size if given, else as many as keep the chunk's logits within
    LCE_CHUNK_BYTES, or within 1/LCE_DWEIGHT_SHARE of a (n_cols, dweight_hidden) dweight where
    one is computed (dweight_hidden > 0) and that is more, spread evenly over the chunks that
    needs (rounded up to LCE_ROW_ALIGN)."""
    if chunk_size > 0:
        return chunk_size
    cap = max(1, LCE_CHUNK_BYTES // (n_cols * dtype.itemsize), dweight_hidden // LCE_DWEIGHT_SHARE)
    if cap >= LCE_ROW_ALIGN:
        cap -= cap % LCE_ROW_ALIGN
    even = cdiv(n_rows, max(1, cdiv(n_rows, cap)))
    aligned = cdiv(even, LCE_ROW_ALIGN) * LCE_ROW_ALIGN
    return max(1, min(cap, aligned if cap >= LCE_ROW_ALIGN else even))


def lce_plan(n_rows: int, n_cols: int, hid: int, dtype: torch.dtype, chunk_size: int = 0,
             dweight: bool = True) -> tuple[int, int]:
    """(tokens of the resident chunk, rows per chunk after it) of lce_fwd. Where dweight is
    computed, the first tokens keep their logits in dweight's memory (_resident_chunk): H of
    them fit there, and more in the chunk buffer, which is not in use yet: by default one
    chunk's worth more; with chunk_size given, as many more as keep the buffer within
    chunk_size rows of logits (_resident_within). The rest go lce_chunk_rows at a time."""
    if not dweight or n_cols < 2 or hid == 0:
        return 0, lce_chunk_rows(n_rows, n_cols, dtype, chunk_size, hid if dweight else 0)
    if chunk_size:
        resident = _resident_within(n_rows, n_cols, hid, chunk_size)
    else:
        resident = min(n_rows, hid)
        if resident < n_rows:
            resident = min(n_rows, resident + lce_chunk_rows(n_rows - resident, n_cols, dtype, 0, hid))
    if resident < n_rows:  # rounded up as padding would (the same buffer): only the last chunk pads
        resident = min(n_rows, _pitch(resident))
    return resident, chunk_size or lce_chunk_rows(n_rows - resident, n_cols, dtype, 0, hid)


def _resident_layout(rows: int, n_cols: int, hid: int) -> tuple[int, int, int, int]:
    """(s, stride, shift, head) of a resident chunk of rows tokens in a (n_cols, hid) dweight.

    Classes [0, head) keep their logits in dweight's memory, class v at element (v + shift) *
    stride, token r at + r; classes [head, V) in the chunk buffer, (V - head, rows) contiguous.
    The dweight GEMM then writes class slices [a, b) of at most s rows in order, elements
    [a * H, b * H), and must not overwrite logits of class a or later, which start at (a +
    shift) * stride: with stride = max(rows, H) rounded up to LCE_PITCH and shift = ceil(s * H
    / stride), b * H <= (a + s) * H <= (a + shift) * stride. head is as many classes as fit
    below V * H, rounded down to a multiple of 16, which Triton specializes the loss kernels on
    (it costs at most 15 classes of buffer)."""
    s = max(1, min(LCE_DWEIGHT_SLICE, n_cols // 2))
    stride = _pitch(max(rows, hid))
    shift = cdiv(s * hid, stride)
    head = max(0, min(n_cols, n_cols * hid // stride - shift))
    return s, stride, shift, head - head % 16


def _pitch(rows: int) -> int:
    """rows rounded up to a multiple of LCE_PITCH."""
    return cdiv(rows, LCE_PITCH) * LCE_PITCH


def _pad_rows(h_c: torch.Tensor, t_c: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's hidden states (rows, H) and targets (rows,), padded to _pitch(rows) rows with
    zero states and ignored targets, whose gradients are zero; unchanged where rows is a
    multiple of LCE_PITCH. ignore_index fits the targets' dtype (the ops check)."""
    rows = h_c.shape[0]
    if rows % LCE_PITCH == 0:
        return h_c, t_c
    h_p = h_c.new_zeros(_pitch(rows), h_c.shape[1])
    h_p[:rows] = h_c
    t_p = t_c.new_full((_pitch(rows),), ignore_index)
    t_p[:rows] = t_c
    return h_p, t_p


def _resident_share(rows: int, n_cols: int, hid: int) -> int:
    """Elements of the chunk buffer that a resident chunk of rows tokens (padded) fills: the
    logits of the classes beyond _resident_layout's head."""
    return (n_cols - _resident_layout(_pitch(rows), n_cols, hid)[3]) * _pitch(rows)


def _resident_within(n_rows: int, n_cols: int, hid: int, chunk_size: int) -> int:
    """The most tokens, up to H + chunk_size, whose resident chunk fills no more of the chunk
    buffer than chunk_size rows of logits; min(N, H, chunk_size) at least (its share is the
    last s classes, s <= V / 2). At 8192 x 4096 x 128256 and chunk_size 256: 4272 tokens, then
    16 chunks, where a resident chunk of 256 left 31."""
    lo, hi = min(n_rows, hid, chunk_size), min(n_rows, hid + chunk_size)
    while lo < hi:  # the share grows with the tokens
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _resident_share(mid, n_cols, hid) <= chunk_size * n_cols else (lo, mid - 1)
    return lo


def _cols_grid(config, n_cols: int, n_rows: int, device: torch.device, block: int | None):
    """(grid, split_cols, BLOCK_R, BLOCK_V, warps) of _ce_cols_kernel over (n_cols, n_rows) logits
    for config (BLOCK_R, BLOCK_V, warps, programs per SM): column splits enough for that many
    programs, and no more: a program past them starts a second wave. block forces BLOCK_V
    (tests)."""
    block_r, block_v, warps, per_sm = config
    block_r = min(block_r, next_power_of_2(n_rows))
    block_v = block or block_v
    row_blocks = cdiv(n_rows, block_r)
    splits = max(1, min(per_sm * _dispatch.sm_count(device) // row_blocks, cdiv(n_cols, block_v)))
    split = cdiv(cdiv(n_cols, splits), block_v) * block_v
    return (row_blocks, cdiv(n_cols, split)), split, block_r, block_v, warps


def _chunk_losses(shards, t, n_valid, n_classes, opts: LossOptions, reduction: str, write_grad: bool,
                  block: int | None) -> torch.Tensor:
    """fp32 losses (rows,) of a chunk of rows whose logits lie column-major in shards, a list of
    (x (n_cols, rows) with unit row stride, class of x's first column, bias (n_cols,) or None)
    that together hold all n_classes classes; the kernel adds the bias in fp32 (cuBLAS, given a
    bias along the rows of its output, rounds the product and the sum apart). write_grad:
    overwrite each shard with its gradient for an upstream gradient of 1 (mean's 1 / n_valid
    folded in). Three passes: per-split row statistics, their combination into each row's lse
    and loss, the gradient."""
    n_rows = t.shape[0]
    kw = dict(ignore_index=opts.ignore_index, label_smoothing=opts.label_smoothing, z_loss=opts.z_loss,
              softcap=opts.softcap, inv_softcap=1.0 / opts.softcap if opts.softcap > 0 else 0.0,
              MEAN=reduction == "mean", SUM_Z=opts.label_smoothing > 0, SOFTCAP=opts.softcap > 0)

    def run(x, v0, b, plan, lse, z_t, z_sum, forward):
        grid, split, block_r, block_v, warps = plan
        launch(_ce_cols_kernel, grid, x, b, t, lse, z_t, z_sum, n_valid, n_rows, x.shape[0], v0, n_classes,
               split, x.stride(0), n_rows, **kw, FORWARD=forward, HAS_BIAS=b is not None, BLOCK_R=block_r,
               BLOCK_V=block_v, num_warps=warps)

    stats = [_cols_grid(LCE_COLS_STATS, x.shape[0], n_rows, x.device, block) for x, _, _ in shards]
    n_splits = sum(plan[0][1] for plan in stats)
    lse_s, z_t_s, z_sum_s = torch.empty(3, n_splits, n_rows, dtype=torch.float32, device=t.device)
    first = 0
    for (x, v0, b), plan in zip(shards, stats):
        run(x, v0, b, plan, lse_s[first:], z_t_s[first:], z_sum_s[first:], True)
        first += plan[0][1]
    lse, losses = torch.empty(2, n_rows, dtype=torch.float32, device=t.device)
    block_r = min(LCE_COMBINE_BLOCK_R, next_power_of_2(n_rows))
    launch(_ce_combine_kernel, (cdiv(n_rows, block_r),), lse_s, z_t_s, z_sum_s, t, lse, losses, n_rows,
           n_splits, n_rows, opts.ignore_index, n_classes, opts.label_smoothing, opts.z_loss,
           SUM_Z=opts.label_smoothing > 0, BLOCK_S=LCE_COMBINE_BLOCK_S, BLOCK_R=block_r)
    if write_grad:
        for x, v0, b in reversed(shards):  # the reverse of the forward's order, for L2
            run(x, v0, b, _cols_grid(LCE_COLS_GRAD, x.shape[0], n_rows, x.device, block), lse, None, None, False)
    return losses


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated and returned in fp32 (half inputs: cuBLAS's fp32 output on CUDA)."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _resident_chunk(h_c, t_c, weight, bias, dh_rows, dw, db, buf, layout, n_valid, opts, reduction, block):
    """The first chunk where dweight is computed, its logits held in dweight's own memory.

    dweight (V, H) is not written before the first chunk's dweight GEMM, so that chunk keeps
    the logits of most classes there, column-major (token r of class v at dweight's element
    (v + shift) * stride + r), and those of the last classes in buf, the chunk buffer; layout
    is _resident_layout's (s, stride, shift, head) for this chunk, which also sized buf. The
    dweight GEMM then runs in class slices in order, each writing dweight rows whose logits it
    or an earlier slice has read. Up to H tokens cost no memory
    beyond a few thousand classes in buf; tokens beyond H fill buf as a chunk would, but their
    dweight share is written once, with no read-modify-write (docs/perf.md, "Linear
    cross-entropy"). dhidden sums the two parts in fp32, token pieces at a time, and is
    rounded once. h_c and t_c come padded (_pad_rows), dh_rows has the real tokens' rows.
    Returns the chunk's losses, padding included."""
    n_cols, hid = weight.shape
    rows = h_c.shape[0]
    s, stride, shift, head = layout
    main = dw.as_strided((head, rows), (stride, 1), dw.storage_offset() + shift * stride)
    tail = buf[:(n_cols - head) * rows].view(n_cols - head, rows)
    parts = [(x, cls) for x, cls in ((main, slice(0, head)), (tail, slice(head, n_cols))) if x.shape[0]]
    for x, cls in parts:
        torch.mm(weight[cls], h_c.t(), out=x)
    losses = _chunk_losses([(x, cls.start, None if bias is None else bias[cls]) for x, cls in parts], t_c,
                           n_valid, n_cols, opts, reduction, True, block)
    if dh_rows is not None:
        piece = max(1, LCE_DH_PIECE_BYTES // (8 * hid) // LCE_PITCH) * LCE_PITCH  # an fp32 sum and part
        for r0 in range(0, dh_rows.shape[0], piece):
            tok = slice(r0, r0 + piece)
            acc = _mm_fp32(main[:, tok].t(), weight[:head])
            acc += _mm_fp32(tail[:, tok].t(), weight[head:])
            out = dh_rows[tok]
            out.copy_(acc[:out.shape[0]])
    if db is not None:
        for x, cls in parts:
            db[cls] += x.sum(1, dtype=torch.float32)
    for a in range(0, head, s):
        b = min(a + s, head)
        torch.mm(main[a:b], h_c, out=dw[a:b])
    torch.mm(tail, h_c, out=dw[head:])  # every class in dweight's memory consumed by now
    return losses


def lce_fwd(hidden, weight, target, bias, *, ignore_index, label_smoothing, z_loss, softcap, reduction,
            chunk_size=0, grads=(True, True, True), block=None, n_valid=None):
    """cross_entropy(hidden @ weight.T + bias, target): (loss, dhidden, dweight, dbias).

    hidden (..., H), weight (V, H), target (...), bias (V,) or None, one dtype of DTYPES. The
    gradients are for an upstream gradient of 1 (the backward scales them by grad_loss), in the
    inputs' dtypes and shapes (dhidden, dweight contiguous). grads says which of (dhidden,
    dweight, dbias) to compute: the others are None (a frozen lm-head saves the dweight buffer
    and its GEMM), as are all three for reduction "none" (its per-row grad_loss is only known
    in the backward, which recomputes) and dbias without a bias. n_valid: the non-ignored rows as a
    device scalar, where the caller has it (cross_entropy.target_summary).

    Per chunk of tokens, cuBLAS computes the logits column-major (weight @ hidden_chunk.T, in the
    inputs' dtype, rounded once: the bias is added in fp32 by the loss kernels), which
    _chunk_losses turns into their gradient in place, and two more GEMMs give dhidden's rows and
    dweight's share. Where dweight is computed, the first tokens keep their logits in dweight
    itself and the chunk buffer (_resident_chunk); the others go in chunks of lce_chunk_rows
    through that buffer, each adding into dweight (lce_plan).

    Memory beyond the inputs: the outputs, an fp32 dbias, the larger of one chunk's logits and
    the resident chunk's share of the buffer, and while the resident chunk runs its two fp32
    dhidden pieces; at 8192 tokens x 4096 x 128256 bf16: 1.05 GB + 67 MB + 279 MB + 34 MB = 1.43
    GB (5120 resident tokens, then 3 chunks of 1024); at hidden 8192 all 8192 tokens are
    resident: 2.10 GB + 134 MB + 34 MB + 34 MB = 2.30 GB.
    dweight accumulates in weight's dtype through cuBLAS (fp32 inside each GEMM, rounded once
    per chunk): an fp32 accumulator would triple dweight's memory for bf16 weights. The resident
    chunk rounds its share once, like PyTorch.
    """
    # int(): traced by torch.compile with a vocabulary or hidden size gone dynamic (a second
    # size seen), Inductor failed to decompose the kernels (torch 2.11: AssertionError in
    # replace_by_example, e.g. 1024 x 768 x 128256 then 128000 classes); both are fixed for a
    # model, so the graph specializes on them, guarded, and only the token count may vary
    n_cols, hid = int(weight.shape[0]), int(weight.shape[1])
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    t = _flat(target)
    h = hidden.reshape(t.shape[0], hid)  # not -1: H may be 0
    n_rows = h.shape[0]
    if n_valid is None:
        n_valid = _n_valid(t, ignore_index)
    want_dh, want_dw, want_db = (want and reduction != "none" for want in grads)
    want_db = want_db and bias is not None
    dh = hidden.new_empty(hidden.shape) if want_dh else None
    dw = weight.new_empty(weight.shape) if want_dw else None
    db = torch.zeros(n_cols, dtype=torch.float32, device=hidden.device) if want_db else None
    if dw is not None and n_rows == 0:
        dw.zero_()
    write_grad = want_dh or want_dw or want_db
    dh_rows = None if dh is None else dh.view(h.shape)
    # each chunk's losses go to buffers of their own, joined at the end: traced by Inductor, a
    # kernel writing slices of one buffer becomes a chain of slice copies that torch 2.11
    # miscompiled into an out-of-bounds read
    losses = []
    done, rows = lce_plan(n_rows, n_cols, hid, hidden.dtype, chunk_size, dw is not None)
    layout = _resident_layout(_pitch(done), n_cols, hid) if done else None
    tail = _resident_share(done, n_cols, hid) if done else 0
    buf = h.new_empty(max(tail, _pitch(min(rows, n_rows - done)) * n_cols))
    if done:
        losses.append(_resident_chunk(*_pad_rows(h[:done], t[:done], ignore_index), weight, bias,
                                      None if dh is None else dh_rows[:done], dw, db, buf, layout, n_valid, opts,
                                      reduction, block)[:done])
    for start in range(done, n_rows, rows):
        sl = slice(start, start + rows)
        n_c = min(rows, n_rows - start)
        h_c, t_c = _pad_rows(h[sl], t[sl], ignore_index)
        logits = buf[:h_c.shape[0] * n_cols].view(n_cols, h_c.shape[0])
        torch.mm(weight, h_c.t(), out=logits)
        losses.append(_chunk_losses([(logits, 0, bias)], t_c, n_valid, n_cols, opts, reduction, write_grad,
                                    block)[:n_c])
        if dh is not None and h_c.shape[0] == n_c:
            torch.mm(logits.t(), weight, out=dh_rows[sl])
        elif dh is not None:  # padded: the padding's rows go nowhere
            dh_rows[sl] = torch.mm(logits.t(), weight)[:n_c]
        if dw is not None and start == 0:
            torch.mm(logits, h_c, out=dw)
        elif dw is not None:
            dw.addmm_(logits, h_c)
        if db is not None:
            db += logits.sum(1, dtype=torch.float32)
    if db is not None:
        db = db.to(bias.dtype)
    if not losses:
        losses = [h.new_empty(0, dtype=torch.float32)]
    # one chunk: no cat, whose list argument the eager fast path cannot replay
    losses = losses[0] if len(losses) == 1 else torch.cat(losses)
    return _reduce(losses, target, n_valid, reduction), dh, dw, db
