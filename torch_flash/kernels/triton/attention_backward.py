"""Triton flash attention backward (FlashAttention-2 style), dense and varlen: the kernels and
launcher of flash.attention_backward. Layouts, visibility, the scores and the dropout mask are
the forward's (attention.py), whose device helpers and launch arguments these kernels share.

delta = rowsum(dO * O) - grad_lse; one kernel per key block accumulates dK/dV over query
blocks (looping over the q heads of a GQA group, so no atomics there); dQ comes either from
atomics in that kernel (default) or from a separate kernel per query block
(deterministic=True: bitwise reproducible). Dropout regenerates the forward's keep mask.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import (_INTERPRET, _LOG2E, _absent, _alibi_fold, _alibi_shift, _alibi_slope, _bhm, _bias_args,
                        _block_ranges, _block_start, _configs, _dot, _dropout_keep, _flags, _grid, _inputs, _key_ranges,
                        _layout_order, _load_tile, _loop_plan, _lse_strides, _mask_args, _positions, _pow2, _scale,
                        _scores, _seq_bounds, _shape_args, _store_tile, _tile_class, _tuned)
from .launch import cdiv, launch_as
from .scalars import fp32

# Autotune configs per tile class (see attention.py): dK/dV keep BLOCK_N key rows resident
# while BLOCK_M query rows stream; dQ, like the forward, takes BLOCK_M 128 where it fits.
_CONFIGS = {  # class: (dK/dV, dQ)
    "d64": (_configs((32, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3)),
            _configs((128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3))),
    "d128": (_configs((32, 128, 8, 3), (32, 64, 8, 3), (64, 64, 8, 3), (16, 128, 8, 3)),
             _configs((128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3))),
    "d256": (_configs((32, 32, 8, 2), (16, 64, 8, 2), (32, 32, 4, 2)),
             _configs((64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2))),
    "fp32": (_configs((32, 16, 4, 2), (16, 32, 4, 2), (32, 16, 8, 2), (16, 32, 8, 2)),
             _configs((32, 16, 4, 2), (32, 16, 8, 2), (32, 32, 4, 2))),
}
_DELTA_TILE = 256 if _INTERPRET else 8192  # rows x padded Dv of one delta program


# --------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------
@triton.jit
def _query_ranges(n0, seq_q, seq_k, diag, window_left, window_right, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Query block ranges for the key rows [n0, n0 + BLOCK_N) (see _block_ranges). A key block
    running past seq_k is masked throughout (its pad columns must not reach dQ)."""
    lo = tl.maximum(n0 - diag - window_right, 0)
    hi = tl.minimum(n0 + BLOCK_N - diag + window_left, seq_q)
    full_lo = tl.maximum(n0 + BLOCK_N - 1 - diag - window_right, 0)
    full_hi = tl.minimum(n0 - diag + window_left + 1, seq_q)
    full_hi = tl.where(n0 + BLOCK_N <= seq_k, full_hi, 0)
    return _block_ranges(lo, hi, full_lo, full_hi, BLOCK_M)


@triton.jit
def _lse_log2(lse):
    # a row that sees no key has lse = -inf and only -inf scores: exp2(-inf - 0) = 0, no NaN
    return tl.where(lse == float("-inf"), 0.0, lse * _LOG2E)


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------
@triton.jit
def _attn_bwd_delta(Out, DO, GradLse, Delta, CuQ, Lse, Sinks, SinkPart,
                    stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
                    stride_lb, stride_lh, H, SEQ_Q,
                    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_GRAD_LSE: tl.constexpr,
                    IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, SINK_GRAD: tl.constexpr):
    """delta = rowsum(dO * O) - grad_lse (fp32, laid out like lse). SINK_GRAD: also the block's
    share of the sink's gradient, sum over its rows of -exp(sink - lse) * delta, into
    SinkPart[b, h, row block] (ref.sink_grad)."""
    # grid (row blocks, heads, batch), as the forward's
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, seq_q = _seq_bounds(tl.load(CuQ + b, mask=IS_VARLEN), tl.load(CuQ + b + 1, mask=IS_VARLEN),
                                 SEQ_Q, IS_VARLEN)
    m0 = tl.program_id(0) * BLOCK_M
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    part = SinkPart + (b64 * H + h64) * tl.num_programs(0) + tl.program_id(0)
    if m0 >= seq_q:
        if SINK_GRAD:
            tl.store(part, 0.0)
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    o = _load_tile(Out + b64 * stride_ob + h64 * stride_oh + q_start * stride_om, offs_m, stride_om,
                   seq_q, offs_dv, HEAD_DIM_V, BLOCK_DV, True)
    do = _load_tile(DO + b64 * stride_dob + h64 * stride_doh + q_start * stride_dom, offs_m,
                    stride_dom, seq_q, offs_dv, HEAD_DIM_V, BLOCK_DV, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = b64 * stride_lb + h64 * stride_lh + q_start + offs_m
    if HAS_GRAD_LSE:
        delta -= tl.load(GradLse + row, mask=offs_m < seq_q, other=0.0)
    tl.store(Delta + row, delta, mask=offs_m < seq_q)
    if SINK_GRAD:
        lse = tl.load(Lse + row, mask=offs_m < seq_q, other=float("-inf"))
        # a row that sees nothing (lse = -inf) gets no probability for its sink either
        p_sink = tl.exp2((tl.load(Sinks + h).to(tl.float32) - lse) * _LOG2E)
        p_sink = tl.where(lse == float("-inf"), 0.0, p_sink)
        tl.store(part, -tl.sum(p_sink * delta, 0))


@triton.jit
def _bwd_kv_inner(dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, bias_base,
                  dbias_base, alibi_base, stride_qh, stride_qm, stride_doh, stride_dom, stride_dqh, stride_dqm,
                  stride_lh, stride_bh, stride_bm, stride_bn, stride_dbh, stride_dbm, stride_dbn, stride_ah,
                  seed, bh0, group, offs_n, j0, seq_q, seq_k, diag, window_left, window_right,
                  sm_scale, qk_scale, softcap, dropout_p, first, n_first, second, n_blocks,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BIAS_KIND: tl.constexpr, BIAS_GRAD: tl.constexpr,
                  SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, IS_CAUSAL: tl.constexpr, DROPOUT: tl.constexpr,
                  ATOMIC_DQ: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr):
    """Accumulates dK, dV of one key block over the query blocks of one loop (see _loop_plan)
    of each of the `group` q heads sharing it (bases point at the group's first head). Heads
    and blocks run as one flat loop: a nested head loop made the compiler spill registers.
    Works on transposed tiles (keys x queries) so that no operand of dK/dV needs a transpose.
    j0: ALiBi's column origin (_alibi_fold)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    aj = (offs_n - j0).to(tl.float32)  # once: the key rows stay
    for it in range(0, group * n_blocks):
        g = it // n_blocks
        start = _block_start(it - g * n_blocks, first, n_first, second, BLOCK_M)
        offs_m = start + tl.arange(0, BLOCK_M)
        ai = _positions(start + diag, j0, BLOCK_M)
        g = g.to(tl.int64)
        bh = bh0 + g.to(tl.int32)
        q = _load_tile(q_base + g * stride_qh, offs_m, stride_qm, seq_q, offs_d, HEAD_DIM, BLOCK_D,
                       MASKED)
        do = _load_tile(do_base + g * stride_doh, offs_m, stride_dom, seq_q, offs_dv, HEAD_DIM_V,
                        BLOCK_DV, MASKED)
        rows = g * stride_lh + offs_m
        if MASKED:
            lse = tl.load(lse_base + rows, mask=offs_m < seq_q, other=0.0)
            delta = tl.load(delta_base + rows, mask=offs_m < seq_q, other=0.0)
        else:
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        qk_t = _dot(k, tl.trans(q), None, DOT_PREC)
        slope = _alibi_slope(alibi_base + g * stride_ah, ALIBI)
        fold = _alibi_fold(start + diag, j0, BLOCK_M, offs_n.shape[0], IS_CAUSAL)
        s_t, t_t = _scores(qk_t, offs_m[None, :], offs_n[:, None], seq_q, seq_k, diag, window_left,
                           window_right, bias_base + g * stride_bh, stride_bm, stride_bn, qk_scale, softcap,
                           slope, fold, ai[None, :], aj[:, None], BIAS_KIND, SOFTCAP, ALIBI, IS_CAUSAL, MASKED)
        lse2 = _lse_log2(lse) + _alibi_shift(ai, slope, fold, ALIBI)
        p_t = tl.math.exp2(s_t - lse2[None, :])
        dp_t = _dot(v, tl.trans(do), None, DOT_PREC)
        if DROPOUT:
            keep = _dropout_keep(seed, bh, offs_m[None, :], offs_n[:, None], dropout_p)
            inv_keep = 1.0 / (1.0 - dropout_p)
            pd_t = tl.where(keep, p_t * inv_keep, 0.0)
            dp_t = tl.where(keep, dp_t * inv_keep, 0.0)
        else:
            pd_t = p_t
        dv = _dot(pd_t.to(do.dtype), do, dv, DOT_PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        if BIAS_GRAD:
            ptrs = (dbias_base + g * stride_dbh + offs_m[None, :].to(tl.int64) * stride_dbm
                    + offs_n[:, None] * stride_dbn)
            tl.store(ptrs, ds_t, mask=(offs_m[None, :] < seq_q) & (offs_n[:, None] < seq_k))
        if SOFTCAP:
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk = _dot(ds_t.to(q.dtype), q, dk, DOT_PREC)
        if ATOMIC_DQ:
            dq = _dot(tl.trans(ds_t.to(k.dtype)), k, None, DOT_PREC) * sm_scale
            ptrs = dq_base + g * stride_dqh + offs_m.to(tl.int64)[:, None] * stride_dqm + offs_d[None, :]
            tl.atomic_add(ptrs, dq, mask=(offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM),
                          sem="relaxed")
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DQ, DK, DV, Lse, Delta, Bias, DBias, Seed, CuQ, CuK, Alibi,
                   stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                   stride_dqb, stride_dqh, stride_dqm, stride_dkb, stride_dkh, stride_dkn,
                   stride_dvb, stride_dvh, stride_dvn, stride_lb, stride_lh,
                   stride_bb, stride_bh, stride_bm, stride_bn,
                   stride_dbb, stride_dbh, stride_dbm, stride_dbn, stride_ab, stride_ah,
                   H, GROUP, SEQ_Q, SEQ_K, SEQ_BUCKET, sm_scale, qk_scale, softcap, dropout_p,
                   window_left, window_right,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, IS_CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr,
                   BIAS_GRAD: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                   ATOMIC_DQ: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: BLOCK_N key rows of one (batch, kv head); loops over the q heads of its
    group, so dK/dV are written once, without atomics. Also dbias, and dQ with ATOMIC_DQ."""
    sm_scale, qk_scale = fp32(sm_scale), fp32(qk_scale)
    softcap, dropout_p = fp32(softcap), fp32(dropout_p)
    hk = tl.program_id(1)  # grid (key blocks, kv heads, batch), as the forward's
    b = tl.program_id(2)
    q_start, seq_q = _seq_bounds(tl.load(CuQ + b, mask=IS_VARLEN), tl.load(CuQ + b + 1, mask=IS_VARLEN),
                                 SEQ_Q, IS_VARLEN)
    k_start, seq_k = _seq_bounds(tl.load(CuK + b, mask=IS_VARLEN), tl.load(CuK + b + 1, mask=IS_VARLEN),
                                 SEQ_K, IS_VARLEN)
    n0 = tl.program_id(0) * BLOCK_N
    if n0 >= seq_k:
        return
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = _load_tile(K + b64 * stride_kb + hk64 * stride_kh + k_start * stride_kn, offs_n, stride_kn,
                   seq_k, offs_d, HEAD_DIM, BLOCK_D, True)
    v = _load_tile(V + b64 * stride_vb + hk64 * stride_vh + k_start * stride_vn, offs_n, stride_vn,
                   seq_k, offs_dv, HEAD_DIM_V, BLOCK_DV, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    seed = tl.load(Seed) if DROPOUT else 0
    diag = seq_k - seq_q
    a, b_, c, hi = _query_ranges(n0, seq_q, seq_k, diag, window_left, window_right, BLOCK_M, BLOCK_N)
    h64 = hk64 * GROUP  # the group's first q head
    q_base = Q + b64 * stride_qb + h64 * stride_qh + q_start * stride_qm
    do_base = DO + b64 * stride_dob + h64 * stride_doh + q_start * stride_dom
    dq_base = DQ + b64 * stride_dqb + h64 * stride_dqh + q_start * stride_dqm
    row = b64 * stride_lb + h64 * stride_lh + q_start
    bias_base = Bias + b64 * stride_bb + h64 * stride_bh
    dbias_base = DBias + b64 * stride_dbb + h64 * stride_dbh
    alibi_base = Alibi + b64 * stride_ab + h64 * stride_ah
    bh0 = (b * H + h64).to(tl.int32)
    for phase in tl.static_range(2):
        first, n_first, second, n_blocks = _loop_plan(phase == 0, a, b_, c, hi, BLOCK_M)
        dk, dv = _bwd_kv_inner(dk, dv, k, v, q_base, do_base, dq_base, Lse + row, Delta + row,
                               bias_base, dbias_base, alibi_base, stride_qh, stride_qm, stride_doh, stride_dom,
                               stride_dqh, stride_dqm, stride_lh, stride_bh, stride_bm, stride_bn,
                               stride_dbh, stride_dbm, stride_dbn, stride_ah, seed, bh0, GROUP, offs_n, n0,
                               seq_q, seq_k, diag, window_left, window_right, sm_scale, qk_scale, softcap,
                               dropout_p, first, n_first, second, n_blocks, HEAD_DIM, HEAD_DIM_V,
                               BLOCK_D, BLOCK_DV, BIAS_KIND, BIAS_GRAD, SOFTCAP, ALIBI, IS_CAUSAL, DROPOUT,
                               ATOMIC_DQ, DOT_PREC, BLOCK_M, phase == 0)
    _store_tile(DK + b64 * stride_dkb + hk64 * stride_dkh + k_start * stride_dkn, offs_n, stride_dkn,
                seq_k, offs_d, HEAD_DIM, (dk * sm_scale).to(DK.dtype.element_ty))
    _store_tile(DV + b64 * stride_dvb + hk64 * stride_dvh + k_start * stride_dvn, offs_n, stride_dvn,
                seq_k, offs_dv, HEAD_DIM_V, dv.to(DV.dtype.element_ty))


@triton.jit
def _bwd_q_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, bias_base,
                 stride_bm, stride_bn, seed, bh, offs_m, seq_q, seq_k, diag, window_left,
                 window_right, qk_scale, softcap, slope, ai, j0, dropout_p, first, n_first, second, n_blocks,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr,
                 ALIBI: tl.constexpr, IS_CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Accumulates dQ (unscaled) of one query block over the key blocks of one loop; lse2 in
    log2 units, shifted by _alibi_shift for ALiBi's rows ai and origin j0: once by the caller
    where the fold is fixed (causal), per key block here where it is not."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for r in range(0, n_blocks):
        start = _block_start(r, first, n_first, second, BLOCK_N)
        offs_n = start + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base, offs_n, stride_kn, seq_k, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        v = _load_tile(v_base, offs_n, stride_vn, seq_k, offs_dv, HEAD_DIM_V, BLOCK_DV, MASKED)
        qk = _dot(q, tl.trans(k), None, DOT_PREC)
        if ALIBI and not IS_CAUSAL:
            fold = _alibi_fold(j0, start, ai.shape[0], BLOCK_N, IS_CAUSAL)
            lse_tile = lse2 + _alibi_shift(ai, slope, fold, ALIBI)
        else:
            fold, lse_tile = 1.0, lse2
        s, t = _scores(qk, offs_m[:, None], offs_n[None, :], seq_q, seq_k, diag, window_left,
                       window_right, bias_base, stride_bm, stride_bn, qk_scale, softcap, slope, fold, ai[:, None],
                       _positions(start, j0, BLOCK_N)[None, :], BIAS_KIND, SOFTCAP, ALIBI, IS_CAUSAL, MASKED)
        p = tl.math.exp2(s - lse_tile[:, None])
        dp = _dot(do, tl.trans(v), None, DOT_PREC)
        if DROPOUT:
            keep = _dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], dropout_p)
            dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = _dot(ds.to(k.dtype), k, dq, DOT_PREC)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, DQ, Lse, Delta, Bias, Seed, CuQ, CuK, Alibi,
                 stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                 stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh,
                 stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah,
                 H, GROUP, SEQ_Q, SEQ_K, SEQ_BUCKET, sm_scale, qk_scale, softcap, dropout_p,
                 window_left, window_right,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, IS_CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr,
                 SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr,
                 DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: dQ of BLOCK_M query rows of one (batch, q head), no atomics."""
    sm_scale, qk_scale = fp32(sm_scale), fp32(qk_scale)
    softcap, dropout_p = fp32(softcap), fp32(dropout_p)
    # grid (row blocks, heads, batch), as the forward's
    h = tl.program_id(1)
    b = tl.program_id(2)
    bh = b * H + h
    q_start, seq_q = _seq_bounds(tl.load(CuQ + b, mask=IS_VARLEN), tl.load(CuQ + b + 1, mask=IS_VARLEN),
                                 SEQ_Q, IS_VARLEN)
    k_start, seq_k = _seq_bounds(tl.load(CuK + b, mask=IS_VARLEN), tl.load(CuK + b + 1, mask=IS_VARLEN),
                                 SEQ_K, IS_VARLEN)
    m0 = tl.program_id(0) * BLOCK_M
    if m0 >= seq_q:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = (h // GROUP).to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(Q + b64 * stride_qb + h64 * stride_qh + q_start * stride_qm, offs_m, stride_qm,
                   seq_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_tile(DO + b64 * stride_dob + h64 * stride_doh + q_start * stride_dom, offs_m,
                    stride_dom, seq_q, tl.arange(0, BLOCK_DV), HEAD_DIM_V, BLOCK_DV, True)
    row = b64 * stride_lb + h64 * stride_lh + q_start + offs_m
    lse2 = _lse_log2(tl.load(Lse + row, mask=offs_m < seq_q, other=0.0))
    delta = tl.load(Delta + row, mask=offs_m < seq_q, other=0.0)
    k_base = K + b64 * stride_kb + hk64 * stride_kh + k_start * stride_kn
    v_base = V + b64 * stride_vb + hk64 * stride_vh + k_start * stride_vn
    bias_base = Bias + b64 * stride_bb + h64 * stride_bh
    slope = _alibi_slope(Alibi + b64 * stride_ab + h64 * stride_ah, ALIBI)
    seed = tl.load(Seed) if DROPOUT else 0
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    diag = seq_k - seq_q
    j0 = m0 + diag
    ai = _positions(m0 + diag, j0, BLOCK_M)
    if ALIBI and IS_CAUSAL:
        lse2 += _alibi_shift(ai, slope, 1.0, ALIBI)
    a, b_, c, hi = _key_ranges(m0, seq_q, seq_k, diag, window_left, window_right, BLOCK_M, BLOCK_N)
    for phase in tl.static_range(2):
        first, n_first, second, n_blocks = _loop_plan(phase == 0, a, b_, c, hi, BLOCK_N)
        dq = _bwd_q_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, bias_base,
                          stride_bm, stride_bn, seed, bh, offs_m, seq_q, seq_k, diag, window_left,
                          window_right, qk_scale, softcap, slope, ai, j0, dropout_p, first, n_first, second,
                          n_blocks, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BIAS_KIND, SOFTCAP,
                          ALIBI, IS_CAUSAL, DROPOUT, DOT_PREC, BLOCK_N, phase == 0)
    _store_tile(DQ + b64 * stride_dqb + h64 * stride_dqh + q_start * stride_dqm, offs_m, stride_dqm,
                seq_q, offs_d, HEAD_DIM, (dq * sm_scale).to(DQ.dtype.element_ty))


# --------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------
# class -> (dK/dV, dQ) kernels; the autotuner zeroes the atomic dQ accumulator before each
# timed run of dK/dV. Kept unwrapped, as the forward's (attention.py _KERNELS).
_KERNELS = {cls: (_tuned(_attn_bwd_dkdv, dkdv, reset_to_zero=["DQ"]), _tuned(_attn_bwd_dq, dq))
            for cls, (dkdv, dq) in _CONFIGS.items()}


def _rows(t):
    """A view the kernels can address: last dim contiguous (grad_out may come expanded)."""
    return t if t.stride(-1) == 1 else t.contiguous()


class AttentionBwd:
    """The backward's decisions for one signature of its arguments, as AttentionFwd: called with
    the tensors of each call, returns (dq, dk, dv, dbias or None, dsinks or None), dq/dk/dv laid
    out like q/k/v (ref.layout_strides; packed sequences: contiguous). deterministic=True computes
    dQ in its own pass, else by fp32 atomics. With sinks, their gradient comes from the delta pass
    (ref.sink_grad: per row block, summed per head in torch)."""

    def __init__(self, grad_out, grad_lse, q, k, v, attn_bias, out, lse, cu_q, cu_k, n_batch, seq_q, seq_k,
                 flags, bias_requires_grad, deterministic, sinks=None):
        self.bias_grad = bool(bias_requires_grad) and attn_bias is not None and attn_bias.is_floating_point()
        self.dbias_shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])  # per (b, h, i, j)
        self.empty = q.numel() == 0 or k.numel() == 0
        self.deterministic = deterministic
        self.sink_grad = sinks is not None
        # the gradients laid out like q, k and v, their strides from meta tensors (the calls
        # allocate alike)
        self.grad_orders = tuple(_layout_order(t, cu_q is not None) for t in (q, k, v))
        self.grad_strides = tuple(torch.empty_permuted(t.shape, order, device="meta").stride()
                                  for t, order in zip((q, k, v), self.grad_orders))
        if self.empty:
            return
        args = _shape_args(q, k, v, cu_q, cu_k, seq_q, seq_k)
        grad_out, out = _rows(grad_out), _rows(out)
        lse_strides = _lse_strides(lse)
        self.delta_grid = _grid(seq_q, q.shape[1], n_batch)  # the dQ pass's too
        self.delta_scalars, self.sink_parts = delta_args(out, grad_out, lse, grad_lse is not None, n_batch,
                                                         seq_q, self.sink_grad)
        tensors = ("Q", "K", "V", "CuQ", "CuK", "Seed", "Bias")
        common = {name: value for name, value in (
            *_bhm(grad_out, "do", "m").items(), *lse_strides.items(), ("sm_scale", _scale(q, flags["scale"])),
            *args.items(), *_mask_args(q, **flags).items(), *_bias_args(q, k, attn_bias).items())
            if name not in tensors}
        self.dropout = common["DROPOUT"]
        dq, dk, dv = (torch.empty_strided(t.shape, st, device="meta") for t, st in zip((q, k, v), self.grad_strides))
        dbias_full = torch.empty(self.dbias_shape, device="meta") if self.bias_grad else None
        self.dkdv_kernel, self.dq_kernel = _KERNELS[_tile_class(q, args)]
        self.dkdv_grid = _grid(seq_k, k.shape[1], n_batch, "BLOCK_N")
        self.dkdv_scalars = dict(**_bhm(dq, "dq", "m"), **_bhm(dk, "dk", "n"), **_bhm(dv, "dv", "n"),
                                 **_db_strides(dbias_full), BIAS_GRAD=self.bias_grad,
                                 ATOMIC_DQ=not deterministic, **common)
        self.dq_scalars = dict(**_bhm(dq, "dq", "m"), **common)
        self.absent = _absent(q)
        self.launchers = [None, None, None]

    def __call__(self, grad_out, grad_lse, q, k, v, attn_bias, out, lse, cu_q, cu_k, dropout_seed, alibi_slopes,
                 sinks=None):
        dq, dk, dv = (torch.empty_permuted(t.shape, order, dtype=t.dtype, device=t.device)
                      for t, order in zip((q, k, v), self.grad_orders))
        dbias_full = (torch.zeros(self.dbias_shape, dtype=torch.float32, device=q.device) if self.bias_grad
                      else None)
        if self.empty:
            dq.zero_(), dk.zero_(), dv.zero_()
            dsinks = None if sinks is None else torch.zeros_like(sinks)
            return dq, dk, dv, _sum_to_bias(dbias_full, attn_bias), dsinks
        absent, launchers = self.absent, self.launchers
        grad_out, out = _rows(grad_out), _rows(out)
        delta = torch.empty_like(lse)
        parts = (torch.empty(self.sink_parts, dtype=torch.float32, device=q.device) if self.sink_grad
                 else absent["DBias"])
        tensors = _inputs(absent, self.dropout, q, k, v, attn_bias, cu_q, cu_k, dropout_seed, alibi_slopes)
        grad_lse = lse if grad_lse is None else grad_lse.to(torch.float32).expand_as(lse).contiguous()
        launchers[0] = launch_as(launchers[0], _attn_bwd_delta, self.delta_grid, (),
                                 dict(Out=out, DO=grad_out, GradLse=grad_lse, Delta=delta, CuQ=tensors["CuQ"],
                                      Lse=lse, Sinks=absent["Sinks"] if sinks is None else sinks, SinkPart=parts,
                                      **self.delta_scalars))
        tensors.update(DO=grad_out, Lse=lse, Delta=delta)
        # fp32 atomics land in a buffer of dq's layout (the kernel writes both by dq's strides)
        dq_buf = dq if self.deterministic else dq.new_empty_strided(
            q.shape, self.grad_strides[0], dtype=torch.float32).zero_()
        launchers[1] = launch_as(launchers[1], self.dkdv_kernel, self.dkdv_grid, (),
                                 dict(DQ=dq_buf, DK=dk, DV=dv, DBias=absent["DBias"] if dbias_full is None
                                      else dbias_full, **tensors, **self.dkdv_scalars))
        if self.deterministic:
            launchers[2] = launch_as(launchers[2], self.dq_kernel, self.delta_grid, (),
                                     dict(DQ=dq, **tensors, **self.dq_scalars))
        else:
            dq.copy_(dq_buf)
        dsinks = parts.sum((0, 2)).to(sinks.dtype) if self.sink_grad else None
        return dq, dk, dv, _sum_to_bias(dbias_full, attn_bias), dsinks


def delta_args(out, grad_out, lse, has_grad_lse: bool, n_batch: int, seq_q: int, sink_grad: bool):
    """(_attn_bwd_delta's scalar arguments, the shape of its sink-gradient parts (B, Hq, row
    blocks)) for out and grad_out (last dims contiguous: _rows), dense or packed, and their lse;
    its grid is _grid(seq_q, Hq, n_batch)."""
    heads, dv = out.shape[1], out.shape[-1]  # (B, Hq, Sq, Dv) or (T, Hq, Dv)
    block_dv = _pow2(dv)
    scalars = dict(**_bhm(out, "o", "m"), **_bhm(grad_out, "do", "m"), **_lse_strides(lse), H=heads, SEQ_Q=seq_q,
                   HEAD_DIM_V=dv, BLOCK_DV=block_dv, HAS_GRAD_LSE=has_grad_lse, IS_VARLEN=out.dim() == 3,
                   BLOCK_M=max(16, _DELTA_TILE // block_dv), SINK_GRAD=sink_grad)
    return scalars, (n_batch, heads, cdiv(seq_q, scalars["BLOCK_M"]))


def _backward(grad_out, grad_lse, q, k, v, attn_bias, out, lse, cu_q, cu_k, n_batch, seq_q, seq_k,
              flags, bias_requires_grad, deterministic):
    plan = AttentionBwd(grad_out, grad_lse, q, k, v, attn_bias, out, lse, cu_q, cu_k, n_batch, seq_q, seq_k,
                        flags, bias_requires_grad, deterministic)
    return plan(grad_out, grad_lse, q, k, v, attn_bias, out, lse, cu_q, cu_k, flags["dropout_seed"],
                flags["alibi_slopes"])[:4]


def _db_strides(dbias_full) -> dict:
    s = dbias_full.stride() if dbias_full is not None else (0, 0, 0, 0)
    return dict(zip(("stride_dbb", "stride_dbh", "stride_dbm", "stride_dbn"), s))


def _sum_to_bias(dbias_full, attn_bias):
    if dbias_full is None:
        return None
    return dbias_full.sum_to_size(attn_bias.shape).to(attn_bias.dtype)


def attention_bwd(grad_out, grad_lse, q, k, v, attn_bias, out, lse, *, scale, causal, window_left,
                  window_right, softcap, dropout_p, dropout_seed, bias_requires_grad,
                  deterministic=False, alibi_slopes=None):
    """Gradients of attention.attention_fwd: (dq, dk, dv, dbias or None); grad_lse may be None;
    dbias has attn_bias's shape and dtype. deterministic=True computes dQ without atomics
    (bitwise reproducible, one more pass over K and V)."""
    flags = _flags(scale, causal, window_left, window_right, softcap, dropout_p, dropout_seed, alibi_slopes)
    return _backward(grad_out, grad_lse, q, k, v, attn_bias, out, lse, None, None, q.shape[0],
                     q.shape[2], k.shape[2], flags, bias_requires_grad, deterministic)


def attention_varlen_bwd(grad_out, grad_lse, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, out, lse, *, scale, causal, window_left, window_right, softcap,
                         dropout_p, dropout_seed, deterministic=False, alibi_slopes=None):
    """Gradients of attention.attention_varlen_fwd: (dq, dk, dv)."""
    flags = _flags(scale, causal, window_left, window_right, softcap, dropout_p, dropout_seed, alibi_slopes)
    dq, dk, dv, _ = _backward(grad_out, grad_lse, q, k, v, None, out, lse, cu_seqlens_q, cu_seqlens_k,
                              cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k, flags, False,
                              deterministic)
    return dq, dk, dv
