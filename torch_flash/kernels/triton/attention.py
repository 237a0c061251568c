"""Triton flash attention (FlashAttention-2 style), forward, dense and varlen; the backward's
kernels (attention_backward.py) share this file's device helpers, tile classes and launch
arguments.

Layouts: dense q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), any strides with a
contiguous last dim; varlen q (total_q, Hq, D), k/v (total_k, Hkv, D|Dv) with int32
cu_seqlens (batch + 1,). One set of kernels serves both: a program reads its sequence's
first row and length from cu_seqlens (varlen) or takes row 0 and the dense lengths, and a
"batch stride" of 0 turns the dense addressing into the packed one.

Visibility of key j from query i (diag = Sk - Sq, bottom-right aligned):
    i + diag - window_left <= j <= i + diag + window_right,  causal => window_right = 0,
then ALiBi (-slope * |i + diag - j|, slope of the program's (batch, head) read from a (H,) or
(B, H) tensor: no bias matrix) and the bias / boolean mask. Scores are kept in log2 units
(log2(e) folded into the scale) so the softmax uses exp2; lse is returned in natural log.
Each loop over the other sequence is split into block ranges that need the visibility mask
(edges of the band, sequence ends) and a middle range that does not; blocks outside the band
are never visited. Attention sinks (a logit per q head, no value) start the forward's online
softmax as an already seen column; the lse includes them, so the backward needs nothing more.
Dropout regenerates its keep mask from a counter-based RNG keyed on (batch * Hq + head, i, j),
so no mask is stored.

Every kernel is launched through kernels/triton/launch.py (wrap_triton when traced) so that the
`flash` ops (triton_op) stay traceable by torch.compile / AOTInductor; autotuning uses
configs/key/reset_to_zero only.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...reference import attention as ref
from .launch import cdiv, launch_as, next_power_of_2
from .scalars import fp32

_LOG2E = tl.constexpr(1.4426950408889634)
_MASK_FILL = tl.constexpr(ref.MASK_FILL)
_MASK_SCORE = tl.constexpr(ref.MASK_SCORE)
_LN2 = tl.constexpr(0.6931471805599453)
# A window side of -1 (unbounded) becomes this many positions: far past any sequence, small
# enough that i + diag +/- window stays inside int32.
_UNBOUNDED = 1 << 30
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MIN_HEAD_DIM, _MAX_HEAD_DIM = 16, 256  # tl.dot needs K >= 16; 256 bounds the tiles in SRAM


# --------------------------------------------------------------------------------------
# Autotune configs per tile class (_tile_class): half precision by head dim (the padded D and
# Dv) and fp32, whose exact ("ieee") dots run on CUDA cores and need small tiles. Chosen for
# H100 from sm_90 builds without spills (the forward's BLOCK_M 128) and SRAM within 227 KB;
# the backward's are in attention_backward.py. The interpreter gets one tiny config:
# autotuning it is useless.
# --------------------------------------------------------------------------------------
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The interpreter multiplies the raw bits of bfloat16 dot operands (triton-lang/triton#11584):
# there, and only there, such dots run on fp32 copies (exact products, as on tensor cores).
_UPCAST_BF16_DOT = tl.constexpr(_INTERPRET)


def _configs(*shapes):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) tuples -> triton.Config list."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for m, n, w, s in shapes]


_CONFIGS = {  # class: forward configs
    "d64": _configs((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)),
    "d128": _configs((128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)),
    "d256": _configs((128, 32, 8, 3), (64, 32, 4, 3), (128, 64, 8, 2)),
    "fp32": _configs((32, 16, 4, 2), (32, 32, 4, 2), (32, 32, 8, 2)),
}
_TINY = _configs((16, 16, 1, 1))
# TORCH_FLASH_AUTOTUNE=0: the first config of each list only (fast compiles, e.g. in tests)
_AUTOTUNE = os.environ.get("TORCH_FLASH_AUTOTUNE", "1") != "0"

# SEQ_BUCKET (a power of two of the longer sequence) keeps one tuning per size class.
_KEY = ["SEQ_BUCKET", "HEAD_DIM", "HEAD_DIM_V", "IS_CAUSAL", "BIAS_KIND", "DROPOUT", "ALIBI"]


def _tuned(fn, configs, **kw):
    """fn autotuned over configs: the first only with TORCH_FLASH_AUTOTUNE=0, _TINY under the
    interpreter."""
    configs = _TINY if _INTERPRET else configs if _AUTOTUNE else configs[:1]
    return triton.autotune(configs=configs, key=_KEY, **kw)(fn)


def _tile_class(q, args: dict) -> str:
    """The tile class (key of _CONFIGS) of a call: fp32, or half precision by the wider padded
    head dim."""
    if q.dtype == torch.float32:
        return "fp32"
    width = max(args["BLOCK_D"], args["BLOCK_DV"])
    return "d64" if width <= 64 else "d128" if width <= 128 else "d256"


# --------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------
@triton.jit
def _seq_bounds(start, end, SEQ, IS_VARLEN: tl.constexpr):
    """(first row as int64, length) of sequence b from its offsets start = Cu[b], end = Cu[b + 1]
    (ignored unless IS_VARLEN). The kernels load those themselves: torch's mutation analysis takes
    every argument of a helper whose result addresses a store as written, and cu_seqlens counted as
    written were cloned and copied back by Inductor (an assertion under dynamic shapes in 2.11)."""
    if IS_VARLEN:
        start = start.to(tl.int64)
        return start, (end.to(tl.int64) - start).to(tl.int32)
    else:
        return tl.full([], 0, tl.int64), SEQ


@triton.jit
def _load_tile(base, rows, stride, n_rows, cols, N_COLS: tl.constexpr, BLOCK_COLS: tl.constexpr,
               MASK_ROWS: tl.constexpr):
    """rows x BLOCK_COLS tile of a row-major matrix; rows past n_rows and pad columns read 0.
    Row offsets are int64: one sequence of one head may span more than 2^31 elements."""
    ptrs = base + rows.to(tl.int64)[:, None] * stride + cols[None, :]
    if MASK_ROWS:
        return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS), other=0.0)
    elif N_COLS != BLOCK_COLS:
        return tl.load(ptrs, mask=cols[None, :] < N_COLS, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _store_tile(base, rows, stride, n_rows, cols, N_COLS: tl.constexpr, value):
    ptrs = base + rows.to(tl.int64)[:, None] * stride + cols[None, :]
    tl.store(ptrs, value, mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS))


@triton.jit
def _dot(a, b, acc, DOT_PREC: tl.constexpr):
    if _UPCAST_BF16_DOT:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def _tanh(x):
    # exp of -2|x| never overflows; libdevice's tanh is not available under the interpreter
    e = tl.math.exp2(tl.abs(x) * (-2.0 * _LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _alibi(s, slope, dist):
    """s - slope * |dist|: ALiBi for query/key pairs dist positions from the diagonal (slope in
    the units of s; dist int or fp32). Shared with the decoding kernel."""
    return s - slope * tl.abs(dist.to(tl.float32))


@triton.jit
def _alibi_slope(alibi_base, ALIBI: tl.constexpr):
    """The ALiBi slope of one (batch, head) in log2 units, 0 without ALiBi."""
    if ALIBI:
        return tl.load(alibi_base) * _LOG2E
    else:
        return 0.0


@triton.jit
def _positions(start, j0, BLOCK: tl.constexpr):
    """start + arange(BLOCK) - j0 in fp32 with one int-to-float conversion (a conversion per
    element runs at a fraction of the FP32 rate); exact below 2^24."""
    return (start - j0).to(tl.float32) + tl.arange(0, BLOCK).to(tl.float32)


@triton.jit
def _alibi_fold(row_lo, col_lo, ROWS: tl.constexpr, COLS: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """How a tile scores ALiBi's bias -slope * |i - j| (rows at key positions row_lo + [0, ROWS),
    keys col_lo + [0, COLS)): 1.0 where every pair has j <= i (the bias is slope * j - slope *
    i), -1.0 where every pair has j >= i (slope * i - slope * j), 0.0 across the diagonal (the
    distance itself). The row term is left out of the scores and put into the row's shift
    (_alibi_shift): one FMA a score where the distance takes a subtraction, an absolute value
    and a multiply. Causal tiles fold as 1.0: their visible pairs all have j <= i."""
    if IS_CAUSAL:
        return 1.0
    else:
        return tl.where(col_lo + (COLS - 1) <= row_lo, 1.0, tl.where(col_lo >= row_lo + (ROWS - 1), -1.0, 0.0))


@triton.jit
def _alibi_shift(ai, slope, fold, ALIBI: tl.constexpr):
    """The row shift of ALiBi's scores folded as `fold` (_alibi_fold), 0 without ALiBi; log2
    units. A folded score is the true one plus this shift: the lse, running max and sink logit
    carry it. ai are the rows' positions from the tile's origin j0 (near the diagonal, so the
    shifted scores stay small)."""
    if ALIBI:
        return fold * slope * ai
    else:
        return 0.0


@triton.jit
def _scores(qk, i, j, seq_q, seq_k, diag, window_left, window_right, bias_base, stride_bm, stride_bn,
            qk_scale, softcap, slope, fold, ai, aj, BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr,
            ALIBI: tl.constexpr, IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    """Scores in log2 units for a tile of q.k products; i, j broadcast to the tile (either
    orientation). Returns (scores, tanh of the capped logits; the softcap gradient needs it).
    With SOFTCAP, qk_scale = scale / softcap and softcap is pre-multiplied by log2(e); slope
    (ALiBi) is in log2 units too, ai and aj the rows' and columns' positions in fp32, fold the
    tile's (_alibi_fold: the scores are shifted per row by _alibi_shift)."""
    if SOFTCAP:
        t = _tanh(qk * qk_scale)
        s = t * softcap
    else:
        t = qk
        s = qk * qk_scale
    if ALIBI:
        if IS_CAUSAL:
            s = s + slope * aj
        elif fold != 0.0:
            s = s + (fold * slope) * aj
        else:
            s = _alibi(s, slope, ai - aj)
    if BIAS_KIND != 0:
        ptrs = bias_base + i.to(tl.int64) * stride_bm + j * stride_bn
        inside = (i < seq_q) & (j < seq_k)
        if BIAS_KIND == 1:
            bias = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
            # a finite mask fill (HF's finfo.min) scores MASK_SCORE: see reference/attention.py
            fill = (bias <= _MASK_FILL) & (bias != float("-inf"))
            s = tl.where(fill, _MASK_SCORE * _LOG2E, s + bias * _LOG2E)
        else:
            s = tl.where(tl.load(ptrs, mask=inside, other=0) != 0, s, float("-inf"))
    if MASKED:
        visible = ((i < seq_q) & (j < seq_k) & (j <= i + diag + window_right)
                   & (j >= i + diag - window_left))
        s = tl.where(visible, s, float("-inf"))
    return s, t


@triton.jit
def _dropout_keep(seed, bh, i, j, dropout_p):
    """Keep mask of dropout for a tile; philox counters (j, i, batch*Hq + head, 0) make it a
    pure function of the position, so the backward regenerates it with any block shape."""
    ci = (i + j * 0).to(tl.uint32)
    cj = (j + i * 0).to(tl.uint32)
    zero = ci * 0
    r, _, _, _ = tl.philox(seed, cj, ci, zero + bh.to(tl.uint32), zero)
    return tl.uint_to_uniform_float(r) >= dropout_p


@triton.jit
def _block_ranges(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Block starts covering [lo, hi), split as masked [a, b), unmasked [b, c), masked [c, hi):
    the unmasked blocks lie inside [full_lo, full_hi), where every pair is visible. Returns
    (a, b, c, hi), all >= 0 and a <= b <= c."""
    hi = tl.maximum(hi, lo)
    a = (lo // BLOCK) * BLOCK
    b = tl.minimum(tl.maximum(a, tl.cdiv(full_lo, BLOCK) * BLOCK), tl.cdiv(hi, BLOCK) * BLOCK)
    c = tl.maximum(b, (tl.maximum(full_hi, 0) // BLOCK) * BLOCK)
    return a, b, c, hi


@triton.jit
def _key_ranges(m0, seq_q, seq_k, diag, window_left, window_right, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Key block ranges for the query rows [m0, m0 + BLOCK_M) (see _block_ranges)."""
    lo = tl.maximum(m0 + diag - window_left, 0)
    hi = tl.minimum(m0 + BLOCK_M + diag + window_right, seq_k)
    full_lo = tl.maximum(m0 + BLOCK_M - 1 + diag - window_left, 0)
    full_hi = tl.minimum(m0 + diag + window_right + 1, seq_k)
    return _block_ranges(lo, hi, full_lo, full_hi, BLOCK_N)


@triton.jit
def _loop_plan(MASKED: tl.constexpr, a, b, c, hi, BLOCK: tl.constexpr):
    """The blocks of one loop as (first, n_first, second, n_blocks) for _block_start: the
    masked loop takes both edges [a, b) and [c, hi), the unmasked loop the middle [b, c).
    One loop per kind (not three) keeps the code, and the registers, of a kernel small."""
    if MASKED:
        n_lead = (b - a) // BLOCK
        return a, n_lead, c, n_lead + tl.cdiv(tl.maximum(hi - c, 0), BLOCK)
    else:
        n_mid = (c - b) // BLOCK
        return b, n_mid, b, n_mid


@triton.jit
def _block_start(r, first, n_first, second, BLOCK: tl.constexpr):
    """Start of the r-th block of a loop: n_first blocks from `first`, then from `second`."""
    return tl.where(r < n_first, first + r * BLOCK, second + (r - n_first) * BLOCK)


# --------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, bias_base, stride_bm,
               stride_bn, seed, bh, offs_m, seq_q, seq_k, diag, window_left, window_right,
               qk_scale, softcap, slope, fold, ai, j0, dropout_p, first, n_first, second, n_blocks,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr,
               ALIBI: tl.constexpr, IS_CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Online softmax over the key blocks of one loop (see _loop_plan); ai, j0: ALiBi's rows and
    origin, fold the running state's (_alibi_fold). Returns acc, l_i, m_i, fold."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for r in range(0, n_blocks):
        start = _block_start(r, first, n_first, second, BLOCK_N)
        offs_n = start + tl.arange(0, BLOCK_N)
        if ALIBI and not IS_CAUSAL:  # a new fold moves the running max (l and acc are relative to it)
            tile_fold = _alibi_fold(j0, start, BLOCK_M, BLOCK_N, IS_CAUSAL)
            m_i = m_i + (tile_fold - fold) * slope * ai
            fold = tile_fold
        k = _load_tile(k_base, offs_n, stride_kn, seq_k, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        qk = _dot(q, tl.trans(k), None, DOT_PREC)
        s, _ = _scores(qk, offs_m[:, None], offs_n[None, :], seq_q, seq_k, diag, window_left,
                       window_right, bias_base, stride_bm, stride_bn, qk_scale, softcap, slope, fold, ai[:, None],
                       _positions(start, j0, BLOCK_N)[None, :], BIAS_KIND, SOFTCAP, ALIBI, IS_CAUSAL, MASKED)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(_dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], dropout_p), p, 0.0)
        v = _load_tile(v_base, offs_n, stride_vn, seq_k, offs_dv, HEAD_DIM_V, BLOCK_DV, MASKED)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i, fold


@triton.jit
def _attn_fwd(Q, K, V, Out, Lse, Bias, Seed, CuQ, CuK, Alibi, Sinks,
              stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
              stride_lb, stride_lh, stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah,
              H, GROUP, SEQ_Q, SEQ_K, SEQ_BUCKET, qk_scale, softcap, dropout_p,
              window_left, window_right,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, IS_CAUSAL: tl.constexpr, BIAS_KIND: tl.constexpr,
              SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, SINKS: tl.constexpr, DROPOUT: tl.constexpr,
              IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: BLOCK_M query rows of one (batch, q head). Writes out and lse."""
    qk_scale, softcap, dropout_p = fp32(qk_scale), fp32(softcap), fp32(dropout_p)
    # grid (row blocks, heads, batch): see _grid
    h = tl.program_id(1)
    b = tl.program_id(2)
    bh = b * H + h
    q_start, seq_q = _seq_bounds(tl.load(CuQ + b, mask=IS_VARLEN), tl.load(CuQ + b + 1, mask=IS_VARLEN),
                                 SEQ_Q, IS_VARLEN)
    k_start, seq_k = _seq_bounds(tl.load(CuK + b, mask=IS_VARLEN), tl.load(CuK + b + 1, mask=IS_VARLEN),
                                 SEQ_K, IS_VARLEN)
    m0 = tl.program_id(0) * BLOCK_M
    if m0 >= seq_q:  # varlen: the grid covers the longest sequence
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = (h // GROUP).to(tl.int64)
    q_base = Q + b64 * stride_qb + h64 * stride_qh + q_start * stride_qm
    k_base = K + b64 * stride_kb + hk64 * stride_kh + k_start * stride_kn
    v_base = V + b64 * stride_vb + hk64 * stride_vh + k_start * stride_vn
    o_base = Out + b64 * stride_ob + h64 * stride_oh + q_start * stride_om
    lse_base = Lse + b64 * stride_lb + h64 * stride_lh + q_start
    bias_base = Bias + b64 * stride_bb + h64 * stride_bh
    slope = _alibi_slope(Alibi + b64 * stride_ab + h64 * stride_ah, ALIBI)
    seed = tl.load(Seed) if DROPOUT else 0

    offs_m = m0 + tl.arange(0, BLOCK_M)
    q = _load_tile(q_base, offs_m, stride_qm, seq_q, tl.arange(0, BLOCK_D), HEAD_DIM, BLOCK_D, True)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    diag = seq_k - seq_q
    j0 = m0 + diag
    ai = _positions(m0 + diag, j0, BLOCK_M)
    fold = slope * 0.0 + 1.0  # the running state's, fp32 with ALiBi
    if SINKS:  # the sink column as seen first: the running max is its logit, of weight 1 (0 at -inf)
        m_i = (tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(Sinks + h).to(tl.float32) * _LOG2E
               + _alibi_shift(ai, slope, fold, ALIBI))
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    else:
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    a, b_, c, hi = _key_ranges(m0, seq_q, seq_k, diag, window_left, window_right, BLOCK_M, BLOCK_N)
    for phase in tl.static_range(2):
        first, n_first, second, n_blocks = _loop_plan(phase == 0, a, b_, c, hi, BLOCK_N)
        acc, l_i, m_i, fold = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                         bias_base, stride_bm, stride_bn, seed, bh, offs_m, seq_q, seq_k,
                                         diag, window_left, window_right, qk_scale, softcap, slope, fold, ai,
                                         j0, dropout_p, first, n_first, second, n_blocks, HEAD_DIM, HEAD_DIM_V,
                                         BLOCK_D, BLOCK_DV, BIAS_KIND, SOFTCAP, ALIBI, IS_CAUSAL, DROPOUT,
                                         DOT_PREC, BLOCK_M, BLOCK_N, phase == 0)
    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    if DROPOUT:
        acc = acc * (1.0 / (1.0 - dropout_p))
    m_true = m_i - _alibi_shift(ai, slope, fold, ALIBI)
    lse = tl.where(seen, (m_true + tl.math.log2(tl.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
    tl.store(lse_base + offs_m, lse, mask=offs_m < seq_q)
    _store_tile(o_base, offs_m, stride_om, seq_q, tl.arange(0, BLOCK_DV), HEAD_DIM_V,
                acc.to(Out.dtype.element_ty))


# --------------------------------------------------------------------------------------
# Supported inputs and the launch arguments (the backward's too: attention_backward.py)
# --------------------------------------------------------------------------------------
def supports(q, k, v, attn_bias=None, dropout_p=0.0) -> bool:
    """Whether the kernels handle these inputs: dense (B, H, S, D) or varlen (T, H, D) tensors
    of one dtype among fp16/bf16/fp32, contiguous last dims, head dims 16..256 (D and Dv may
    differ), Hq a multiple of Hkv, a float or bool bias broadcastable to (B, Hq, Sq, Sk)."""
    ts = (q, k, v)
    if not all(isinstance(t, torch.Tensor) for t in ts) or q.dim() not in (3, 4):
        return False
    if any(t.dim() != q.dim() or t.dtype != q.dtype or t.device != q.device for t in ts):
        return False
    if q.dtype not in _DTYPES or any(t.stride(-1) != 1 for t in ts):
        return False
    d, dv = q.shape[-1], v.shape[-1]
    if k.shape[-1] != d or not all(_MIN_HEAD_DIM <= x <= _MAX_HEAD_DIM for x in (d, dv)):
        return False
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv or v.shape[1] != hkv:
        return False
    if attn_bias is not None:
        if q.dim() != 4 or not (attn_bias.is_floating_point() or attn_bias.dtype == torch.bool):
            return False
        if attn_bias.device != q.device:
            return False
        target = (q.shape[0], hq, q.shape[2], k.shape[2])
        try:
            if torch.broadcast_shapes(attn_bias.shape, target) != target:
                return False
        except RuntimeError:
            return False
    return 0.0 <= dropout_p < 1.0


def _pow2(n: int) -> int:
    return max(16, next_power_of_2(n))


def _bhm(t, name: str, row: str) -> dict:
    """(batch, head, row) strides of a dense (B, H, S, D) or packed (T, H, D) tensor, whose
    batch offset comes from cu_seqlens instead (batch stride 0)."""
    sb, sh, sm = (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 4 else (0, t.stride(1), t.stride(0))
    return {f"stride_{name}b": sb, f"stride_{name}h": sh, f"stride_{name}{row}": sm}


def _lse_strides(lse) -> dict:
    """lse is (B, H, S) dense or (H, T) varlen, rows contiguous."""
    sb, sh = (lse.stride(0), lse.stride(1)) if lse.dim() == 3 else (0, lse.stride(0))
    return {"stride_lb": sb, "stride_lh": sh}


def _shape_args(q, k, v, cu_q, cu_k, seq_q: int, seq_k: int) -> dict:
    """Arguments every attention kernel takes: tensors, strides, lengths, head dims."""
    varlen = cu_q is not None
    dummy = q.new_empty(0, dtype=torch.int32)
    return dict(Q=q, K=k, V=v, CuQ=cu_q if varlen else dummy, CuK=cu_k if varlen else dummy,
                **_bhm(q, "q", "m"), **_bhm(k, "k", "n"), **_bhm(v, "v", "n"),
                H=q.shape[1], GROUP=q.shape[1] // k.shape[1], SEQ_Q=seq_q, SEQ_K=seq_k,
                SEQ_BUCKET=_pow2(max(seq_q, seq_k)), HEAD_DIM=q.shape[-1], HEAD_DIM_V=v.shape[-1],
                BLOCK_D=_pow2(q.shape[-1]), BLOCK_DV=_pow2(v.shape[-1]), IS_VARLEN=varlen,
                DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32")


def _scale(q, scale):
    return q.shape[-1] ** -0.5 if scale is None else scale


def _mask_args(q, *, scale, causal, window_left, window_right, softcap, dropout_p, dropout_seed,
               alibi_slopes) -> dict:
    """Scalar arguments of the score / mask / dropout path, in the kernels' units. ALiBi slopes
    (H,) or (B, H) are read with a batch stride of 0 or theirs."""
    scale = _scale(q, scale)
    dropout = dropout_p > 0.0
    alibi = alibi_slopes is not None
    stride_ab, stride_ah = ((0, *alibi_slopes.stride()) if alibi and alibi_slopes.dim() == 1
                            else alibi_slopes.stride() if alibi else (0, 0))
    return dict(stride_ab=stride_ab, stride_ah=stride_ah, ALIBI=alibi,
                qk_scale=scale / softcap if softcap > 0 else scale * _LOG2E.value,
                softcap=softcap * _LOG2E.value, dropout_p=float(dropout_p),
                window_left=window_left if window_left >= 0 else _UNBOUNDED,
                window_right=0 if causal else (window_right if window_right >= 0 else _UNBOUNDED),
                Seed=(dropout_seed.to(device=q.device, dtype=torch.int64).reshape(1) if dropout
                      else q.new_empty(0, dtype=torch.int64)),
                IS_CAUSAL=bool(causal), SOFTCAP=softcap > 0, DROPOUT=dropout)


def _bias_args(q, k, attn_bias) -> dict:
    """attn_bias with broadcast strides over (B, Hq, Sq, Sk) (0 where broadcast)."""
    if attn_bias is None:
        return dict(Bias=q.new_empty(0), stride_bb=0, stride_bh=0, stride_bm=0, stride_bn=0, BIAS_KIND=0)
    full = attn_bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    sb, sh, sm, sn = full.stride()
    return dict(Bias=attn_bias, stride_bb=sb, stride_bh=sh, stride_bm=sm, stride_bn=sn,
                BIAS_KIND=2 if attn_bias.dtype == torch.bool else 1)


def _grid(rows: int, heads: int, batch: int, block: str = "BLOCK_M"):
    """(row blocks, heads, batch), in the order of a (row blocks, B * H) grid: CUDA caps the y and
    z axes at 65535, which B * H passes at realistic sizes (4096 packed sequences x 32 heads)."""
    return lambda meta: (cdiv(rows, meta[block]), heads, batch)


def _layout_order(t, varlen: bool) -> tuple:
    """The dims of an output or gradient laid out like t, outermost first (torch.empty_permuted's
    physical_layout): t's layout (ref.layout_order), or contiguous for packed sequences. Allocated
    with torch.empty_permuted (aten.empty once traced): compiled, the joint graph's CSE spares
    only aten.empty, and merged a new_empty_strided out with the backward's dq of the same layout
    (the forward then saved the empty buffer and the backward cloned it)."""
    return tuple(range(t.dim())) if varlen else ref.layout_order(t)


def _absent(q) -> dict:
    """Stand-ins for an absent Bias, Seed, CuQ, CuK or DBias (never read), typed as the
    launchers always had them."""
    no_index = q.new_empty(0, dtype=torch.int32)
    return dict(Bias=q.new_empty(0), Seed=q.new_empty(0, dtype=torch.int64), CuQ=no_index, CuK=no_index,
                DBias=q.new_empty(0, dtype=torch.float32), Alibi=q.new_empty(0, dtype=torch.float32),
                Sinks=q.new_empty(0, dtype=torch.float32))


def _inputs(absent: dict, dropout: bool, q, k, v, attn_bias, cu_q, cu_k, dropout_seed, alibi_slopes) -> dict:
    """The input tensors the forward and backward kernels share, absent ones stood in for."""
    seed = dropout_seed.to(device=q.device, dtype=torch.int64).reshape(1) if dropout else absent["Seed"]
    return dict(Q=q, K=k, V=v, Bias=absent["Bias"] if attn_bias is None else attn_bias, Seed=seed,
                CuQ=absent["CuQ"] if cu_q is None else cu_q, CuK=absent["CuK"] if cu_k is None else cu_k,
                Alibi=absent["Alibi"] if alibi_slopes is None else alibi_slopes)


def _flags(scale, causal, window_left, window_right, softcap, dropout_p, dropout_seed, alibi_slopes) -> dict:
    return dict(scale=scale, causal=causal, window_left=window_left, window_right=window_right,
                softcap=softcap, dropout_p=dropout_p, dropout_seed=dropout_seed, alibi_slopes=alibi_slopes)


# --------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------
# class -> forward kernel. Kept unwrapped: wrap_triton returns the bare kernel while an op's
# eager body runs, so a wrapper made at import (which may happen there) would stay bare and
# compiled graphs would launch it on fake tensors; launch() wraps per call.
_KERNELS = {cls: _tuned(_attn_fwd, configs) for cls, configs in _CONFIGS.items()}


class AttentionFwd:
    """The forward's decisions for one signature of its arguments (shapes, strides, dtypes,
    flags): tile class, grid and every scalar argument, made once and then called with the
    tensors of each launch of that signature (the ops keep them per signature,
    torch_flash/ops/attention.py). Returns (out, lse): out shaped like q with v's head dim and
    laid out like q (ref.layout_strides, as the ops' fakes promise; packed sequences:
    contiguous), lse fp32 (B, H, S) dense or (H, T) varlen. sinks: whether calls pass the (Hq,)
    sink logits (the backward needs only lse)."""

    def __init__(self, q, k, v, attn_bias, cu_q, cu_k, n_batch, seq_q, seq_k, flags, sinks=None):
        self.out_shape = (*q.shape[:-1], v.shape[-1])
        self.lse_shape = (q.shape[1], q.shape[0]) if cu_q is not None else q.shape[:-1]
        self.empty = any(d == 0 for d in self.out_shape)
        self.out_order = _layout_order(q, cu_q is not None)
        # the outputs' strides, from meta tensors of their shapes (the launches allocate alike)
        out = torch.empty_permuted(self.out_shape, self.out_order, device="meta")
        lse = torch.empty(self.lse_shape, device="meta")
        args = _shape_args(q, k, v, cu_q, cu_k, seq_q, seq_k)
        mask = _mask_args(q, **flags)
        bias = _bias_args(q, k, attn_bias)
        self.kernel = _KERNELS[_tile_class(q, args)]
        self.grid = _grid(seq_q, q.shape[1], n_batch)
        self.dropout = mask["DROPOUT"]
        self.absent = _absent(q)
        tensors = ("Q", "K", "V", "CuQ", "CuK", "Seed", "Bias")
        self.scalars = {name: value for name, value in (*args.items(), *mask.items(), *bias.items(),
                                                        *_bhm(out, "o", "m").items(), *_lse_strides(lse).items())
                        if name not in tensors}
        self.scalars["SINKS"] = sinks is not None
        self.launcher = None

    def __call__(self, q, k, v, attn_bias, cu_q, cu_k, dropout_seed, alibi_slopes, sinks):
        out = torch.empty_permuted(self.out_shape, self.out_order, dtype=q.dtype, device=q.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        if self.empty:
            return out, lse
        tensors = _inputs(self.absent, self.dropout, q, k, v, attn_bias, cu_q, cu_k, dropout_seed, alibi_slopes)
        sinks = self.absent["Sinks"] if sinks is None else sinks.contiguous()  # read at offset h
        self.launcher = launch_as(self.launcher, self.kernel, self.grid, (),
                                  dict(Out=out, Lse=lse, Sinks=sinks, **tensors, **self.scalars))
        return out, lse


def _forward(q, k, v, attn_bias, cu_q, cu_k, n_batch, seq_q, seq_k, flags, sinks):
    return AttentionFwd(q, k, v, attn_bias, cu_q, cu_k, n_batch, seq_q, seq_k, flags, sinks)(
        q, k, v, attn_bias, cu_q, cu_k, flags["dropout_seed"], flags["alibi_slopes"], sinks)


def attention_fwd(q, k, v, attn_bias, *, scale, causal, window_left, window_right, softcap,
                  dropout_p, dropout_seed, alibi_slopes=None, sinks=None):
    """Dense attention forward: q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), attn_bias
    None / float / bool broadcastable to (B, Hq, Sq, Sk), alibi_slopes None or fp32 (Hq,) / (B, Hq),
    sinks None or (Hq,). Returns out (B, Hq, Sq, Dv) contiguous in q's dtype and lse (B, Hq, Sq)
    fp32 (-inf, with out 0, for rows that see no key and no sink)."""
    flags = _flags(scale, causal, window_left, window_right, softcap, dropout_p, dropout_seed, alibi_slopes)
    return _forward(q, k, v, attn_bias, None, None, q.shape[0], q.shape[2], k.shape[2], flags, sinks)


def attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale,
                         causal, window_left, window_right, softcap, dropout_p, dropout_seed, alibi_slopes=None,
                         sinks=None):
    """Packed sequences: q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), int32
    cu_seqlens (batch + 1,), alibi_slopes None or fp32 (Hq,) / (batch, Hq), sinks None or (Hq,).
    max_seqlen_* only size the grid (an upper bound is fine; no host sync). Returns out
    (total_q, Hq, Dv) and lse (Hq, total_q) fp32."""
    flags = _flags(scale, causal, window_left, window_right, softcap, dropout_p, dropout_seed, alibi_slopes)
    return _forward(q, k, v, None, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q.shape[0] - 1,
                    max_seqlen_q, max_seqlen_k, flags, sinks)
