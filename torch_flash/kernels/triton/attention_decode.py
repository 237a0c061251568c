"""Triton KV-cache decoding: append (with rotary), split-KV attention, and the combine step.

Layouts as flash.attention_decode: q (B, Hq, Sq, D); caches (B, Hkv, S_max, D|Dv), or paged
(num_blocks, Hkv, block_size, D|Dv) with block_table (B, max_blocks); any strides with a
contiguous last dim. cache_seqlens (B,) int32/int64 stays on the device: nothing here reads
its values on the host, so a decoding step can be captured in a CUDA graph.

Three launches:
1. `_append_kernel` writes k_new/v_new at positions cache_seqlens[b] + s of each sequence
   (k rotated first when rotary tables are given).
2. `_decode_kernel`: one program per (batch, kv head, split). The q heads of one kv head and
   the Sq queries form the rows of one tile (GQA: the cache is read once per kv head). The
   keys a sequence's queries can see, [lo, L) (lo from the window and cache_leftpad), are cut
   into `num_splits` equal chunks of whole key blocks *inside the kernel*, from the sequence's
   real length, so every split gets its share of the work however full the cache is; the host
   picks num_splits from shapes only (batch x kv heads, capacity, SM count). q is rotated on
   load when tables are given.
3. With more than one split, `_combine_kernel` merges the partial (out, lse) of the splits.

Scores are kept in log2 units (log2(e) folded into the scale, and into ALiBi's slopes, read per
row from the (Hq,) or (B, Hq) slopes), lse is returned in natural log; a query that sees no key
gets out 0 and lse -inf (its sink's logit with sinks: the first split starts its online softmax
from that column, so the combine step counts it once).

Bad index data cannot be validated on the host without a synchronisation, so the kernels
guard themselves: nothing is read or written outside the caches and the block table, and a
sequence whose cache_seqlens is negative or too large for the cache, whose cache_leftpad is
outside [0, cache_seqlens], or whose used block_table entries fall outside the pool, gets NaN
out and lse (the op validates these eagerly on CPU).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ... import _dispatch
from .attention import _LN2, _LOG2E, _UNBOUNDED, _alibi, _dot, _tanh
from .launch import cdiv, launch_as, next_power_of_2
from .scalars import fp32

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # bounds the tiles kept in SRAM
MAX_SPLITS = 256
_MAX_BLOCK_M = 64  # query rows (q heads of a group x Sq) per program; more rows -> more programs
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_AUTOTUNE = os.environ.get("TORCH_FLASH_AUTOTUNE", "1") != "0"


def _configs(*shapes):
    """(BLOCK_N, num_warps, num_stages) tuples -> triton.Config list."""
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in shapes]


# Tile classes by the bytes of one key row of K plus V (shared memory per pipeline stage).
# The first config of each list must compile for every head dim of its class (it runs alone
# with TORCH_FLASH_AUTOTUNE=0); the interpreter gets one tiny config.
if _INTERPRET:
    _CONFIGS = {"narrow": _configs((16, 1, 1)), "wide": _configs((16, 1, 1))}
else:
    _CONFIGS = {
        # up to 512 B per key (D = Dv = 128 in bf16). One config, at or near the best at every
        # point from B=1 / 128k to B=32 / 32k (scripts/sweep_decode.py, docs/perf.md), where an
        # autotuned pick made at one point (its key cannot see the keys per split) is not.
        "narrow": _configs((128, 4, 3)),
        # up to 2 KB per key (D = Dv = 256 in fp32)
        "wide": _configs((32, 4, 2), (64, 4, 2), (32, 8, 3), (16, 4, 3)),
    }
_KEY = ["BLOCK_D", "BLOCK_DV", "BLOCK_M", "PAGED", "SPLIT"]


# --------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------
@triton.jit
def _slots(table, b, pos, ok, page, num_pages, PAGED: tl.constexpr):
    """Physical (block, offset) of the logical positions pos of sequence b, and ok narrowed to
    the slots that exist; table: the block table's entries for pos (PAGED). The kernels load
    those themselves: torch's mutation analysis takes a helper's arguments as written where its
    result addresses a store (the block table cloned and copied back under compile). A
    contiguous cache is one block per sequence (block b)."""
    if PAGED:
        blk = table.to(tl.int64)
        return blk, pos % page, ok & (blk >= 0) & (blk < num_pages)
    else:
        return (pos * 0 + b).to(tl.int64), pos, ok


@triton.jit
def _load_rows(rows, row_ok, d, pos, COS, SIN, stride_c, seq_ro, HEAD_DIM: tl.constexpr,
               RD2: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr):
    """[R, BLOCK_D] tile whose row r starts at pointer rows[r]; pad rows/columns read 0. With
    ROTARY, rotated by the angles of positions pos (R,) in fp32 and rounded back to the
    element dtype (as flash.rotary): pairs (d, d + RD2) (GPT-NeoX) or (2i, 2i + 1) (GPT-J)
    over the first 2 * RD2 dims. A row whose position misses the table (cache_seqlens that the
    op's checks of CPU tensors refuse) rotates to NaN, never read out of bounds."""
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(rows[:, None] + d[None, :], mask=mask, other=0.0)
    if ROTARY:
        rot = d < 2 * RD2
        if INTERLEAVED:
            partner = d ^ 1
            freq = d // 2
            first = d % 2 == 0
        else:
            partner = tl.where(d < RD2, d + RD2, d - RD2)
            freq = tl.where(d < RD2, d, d - RD2)
            first = d < RD2
        partner = tl.where(rot, partner, d)
        xp = tl.load(rows[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        in_table = row_ok & (pos >= 0) & (pos < seq_ro)
        table = pos.to(tl.int64)[:, None] * stride_c + freq[None, :]
        cmask = in_table[:, None] & rot[None, :]
        c = tl.load(COS + table, mask=cmask, other=1.0).to(tl.float32)
        c = tl.where((row_ok & ~in_table)[:, None] & rot[None, :], float("nan"), c)
        s = tl.load(SIN + table, mask=cmask, other=0.0).to(tl.float32)
        # first of a pair: x1 cos - x2 sin; second: x2 cos + x1 sin
        x = (x.to(tl.float32) * c + xp * tl.where(first[None, :], -s, s)).to(x.dtype)
    return x


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------
@triton.jit
def _append_kernel(KN, VN, KC, VC, SEQLENS, BT, COS, SIN,
                   stride_knb, stride_knh, stride_kns, stride_vnb, stride_vnh, stride_vns,
                   stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs,
                   stride_bt, stride_c, SNEW, CAPACITY, PAGE, NUM_PAGES, SEQ_RO,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, RD2: tl.constexpr, ROTARY: tl.constexpr,
                   INTERLEAVED: tl.constexpr, PAGED: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program: BLOCK_S new tokens of one (batch, kv head), k (rotated) and v."""
    # grid (token blocks, kv heads, batch): CUDA caps the y and z axes at 65535, B * Hkv can pass it
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    pos = tl.load(SEQLENS + b).to(tl.int64) + s
    # never write outside the cache, whatever cache_seqlens holds
    ok = (s < SNEW) & (pos >= 0) & (pos < CAPACITY)
    pos = tl.where(ok, pos, 0).to(tl.int32)
    table = pos
    if PAGED:
        table = tl.load(BT + b64 * stride_bt + pos // PAGE, mask=ok, other=0)
    blk, off, ok = _slots(table, b, pos, ok, PAGE, NUM_PAGES, PAGED)
    d = tl.arange(0, BLOCK_D)
    k = _load_rows(KN + b64 * stride_knb + h * stride_knh + s.to(tl.int64) * stride_kns, s < SNEW, d,
                   pos, COS, SIN, stride_c, SEQ_RO, HEAD_DIM, RD2, ROTARY, INTERLEAVED)
    kc = KC + blk * stride_kcb + h * stride_kch + off.to(tl.int64) * stride_kcs
    tl.store(kc[:, None] + d[None, :], k, mask=ok[:, None] & (d < HEAD_DIM)[None, :])
    dv = tl.arange(0, BLOCK_DV)
    v = _load_rows(VN + b64 * stride_vnb + h * stride_vnh + s.to(tl.int64) * stride_vns, s < SNEW, dv,
                   pos, COS, SIN, stride_c, SEQ_RO, HEAD_DIM_V, RD2, False, INTERLEAVED)
    vc = VC + blk * stride_vcb + h * stride_vch + off.to(tl.int64) * stride_vcs
    tl.store(vc[:, None] + dv[None, :], v, mask=ok[:, None] & (dv < HEAD_DIM_V)[None, :])


@triton.jit
def _decode_kernel(Q, KC, VC, SEQLENS, BT, COS, SIN, Alibi, Sinks, LEFTPAD, Out, Lse, OutP, LseP,
                   stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn, stride_bt, stride_c, stride_ab, stride_ah,
                   HKV, GROUP, SQ, SNEW, CAPACITY, PAGE, NUM_PAGES, SEQ_RO, NUM_SPLITS,
                   qk_scale, softcap, window_left, window_right,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, RD2: tl.constexpr, ROTARY: tl.constexpr,
                   INTERLEAVED: tl.constexpr, PAGED: tl.constexpr, SOFTCAP: tl.constexpr,
                   ALIBI: tl.constexpr, SINKS: tl.constexpr, HAS_LEFTPAD: tl.constexpr, SPLIT: tl.constexpr,
                   DOT_PREC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: BLOCK_M rows (q head g of the group, query i) of one (batch, kv head) over
    one split of the keys. Writes out/lse, or with SPLIT the split's partial (out, lse)."""
    qk_scale, softcap = fp32(qk_scale), fp32(softcap)
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HKV
    hk = (bh % HKV).to(tl.int64)
    b64 = b.to(tl.int64)
    n_cached = tl.load(SEQLENS + b).to(tl.int64)
    bad = (n_cached < 0) | (n_cached + SNEW > CAPACITY)
    if HAS_LEFTPAD:  # the sequence's keys are slots [first, seq_k)
        first = tl.load(LEFTPAD + b).to(tl.int64)
        bad = bad | (first < 0) | (first > n_cached)
        first = tl.where(bad, 0, first).to(tl.int32)
    else:
        first = 0
    seq_k = tl.where(bad, 0, n_cached + SNEW).to(tl.int32)  # keys of this sequence

    r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < GROUP * SQ
    g = r // SQ
    i = r % SQ
    head = hk * GROUP + g
    d = tl.arange(0, BLOCK_D)
    q_rows = Q + b64 * stride_qb + head.to(tl.int64) * stride_qh + i.to(tl.int64) * stride_qm
    # q sits at cache_seqlens + i for the rotation (as the new keys), at seq_k - SQ + i for the mask
    q = _load_rows(q_rows, row_ok, d, n_cached.to(tl.int32) + i, COS, SIN, stride_c, SEQ_RO, HEAD_DIM,
                   RD2, ROTARY, INTERLEAVED)
    q_pos = seq_k - SQ + i
    if ALIBI:  # per row: its q head's slope, in log2 units
        slope = tl.load(Alibi + b64 * stride_ab + head.to(tl.int64) * stride_ah, mask=row_ok, other=0.0) * _LOG2E

    # keys any row sees: [max(seq_k - SQ - window_left, first), seq_k), cut into NUM_SPLITS chunks of blocks
    lo = (tl.maximum(seq_k - SQ - window_left, first) // BLOCK_N) * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(seq_k - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_k)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if SINKS:  # split 0 has seen the sink column: running max its logit, weight 1 (0 at -inf)
        sink = tl.load(Sinks + head, mask=row_ok, other=float("-inf")).to(tl.float32) * _LOG2E
        m_i = tl.where(split == 0, sink, float("-inf"))
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    else:
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    dv = tl.arange(0, BLOCK_DV)
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        in_seq = (j < end) & (j >= first)  # slots before `first` are padding, their blocks unread
        table = j
        if PAGED:
            table = tl.load(BT + b.to(tl.int64) * stride_bt + j // PAGE, mask=in_seq, other=0)
        blk, off, ok = _slots(table, b, j, in_seq, PAGE, NUM_PAGES, PAGED)
        if PAGED:  # a used block_table entry outside the pool
            bad = bad | (tl.max((in_seq & ~ok).to(tl.int32), 0) > 0)
        k = tl.load((KC + blk * stride_kb + hk * stride_kh + off.to(tl.int64) * stride_kn)[:, None]
                    + d[None, :], mask=ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        qk = _dot(q, tl.trans(k), None, DOT_PREC)
        if SOFTCAP:
            s = _tanh(qk * qk_scale) * softcap
        else:
            s = qk * qk_scale
        rel = j[None, :] - q_pos[:, None]
        if ALIBI:
            s = _alibi(s, slope[:, None], rel)
        visible = ok[None, :] & (rel <= window_right) & (rel >= -window_left)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load((VC + blk * stride_vb + hk * stride_vh + off.to(tl.int64) * stride_vn)[:, None]
                    + dv[None, :], mask=ok[:, None] & (dv < HEAD_DIM_V)[None, :], other=0.0)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PREC)
        m_i = m_new

    seen = l_i > 0.0
    acc = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
    acc = tl.where(bad, float("nan"), acc)
    lse = tl.where(bad, float("nan"), lse)
    row = bh.to(tl.int64) * (GROUP * SQ) + r  # row of the contiguous (B, Hq, Sq) outputs
    omask = row_ok[:, None] & (dv < HEAD_DIM_V)[None, :]
    if SPLIT:
        prow = row * NUM_SPLITS + split
        tl.store(LseP + prow, lse, mask=row_ok)
        tl.store(OutP + prow[:, None] * HEAD_DIM_V + dv[None, :], acc, mask=omask)
    else:
        tl.store(Lse + row, lse, mask=row_ok)
        tl.store(Out + row[:, None] * HEAD_DIM_V + dv[None, :], acc.to(Out.dtype.element_ty), mask=omask)


@triton.jit
def _combine_kernel(OutP, LseP, Out, Lse, NUM_SPLITS, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
    """One program: one output row, merged from its NUM_SPLITS partial (out, lse):
    lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s. NaN in any split wins."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_SPLITS)
    lse_s = tl.load(LseP + row * NUM_SPLITS + sp, mask=sp < NUM_SPLITS, other=float("-inf"))
    has_nan = tl.sum((lse_s != lse_s).to(tl.int32), 0) > 0
    lse_s = tl.where(lse_s != lse_s, float("-inf"), lse_s)
    m = tl.max(lse_s, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lse_s - m), 0)
    dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for c in range(0, NUM_SPLITS, SPLIT_CHUNK):
        s = c + tl.arange(0, SPLIT_CHUNK)
        w = tl.exp(tl.load(LseP + row * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf")) - m)
        o = tl.load(OutP + (row * NUM_SPLITS + s)[:, None] * HEAD_DIM_V + dv[None, :],
                    mask=(s < NUM_SPLITS)[:, None] & (dv < HEAD_DIM_V)[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)
    lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    out = tl.where(has_nan, float("nan"), out)
    lse = tl.where(has_nan, float("nan"), lse)
    tl.store(Lse + row, lse)
    tl.store(Out + row * HEAD_DIM_V + dv, out.to(Out.dtype.element_ty), mask=dv < HEAD_DIM_V)


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------
def _tuned(configs):
    configs = configs if _AUTOTUNE else configs[:1]
    return triton.autotune(configs=configs, key=_KEY)(_decode_kernel)


# Unwrapped, wrapped per launch: see kernels/triton/attention.py _KERNELS.
_DECODE = {cls: _tuned(configs) for cls, configs in _CONFIGS.items()}


def _pow2(n: int) -> int:
    return max(16, next_power_of_2(n))


def supports(q, k_cache, v_cache, rotary_cos=None) -> bool:
    """Whether the kernels serve these (already validated) inputs: fp16/bf16/fp32 tensors, head
    dims 1..256, fp16/bf16/fp32 rotary tables."""
    return (q.dtype in DTYPES
            and all(0 < t.shape[-1] <= MAX_HEAD_DIM for t in (q, v_cache))
            and (rotary_cos is None or rotary_cos.dtype in DTYPES))


def auto_num_splits(programs: int, keys: int, device: torch.device) -> int:
    """Splits of the keys per (batch, kv head, row block), from shapes only (no host sync):
    enough programs for about four waves of the GPU's SMs, each split at least four key blocks
    of 64 (the combine step and the partial outputs cost little next to the cache reads).
    programs: batch x kv heads x row blocks; keys: the most keys a query can see (the cache
    capacity, or less under a sliding window)."""
    want = cdiv(4 * _dispatch.sm_count(device), max(programs, 1))
    return max(1, min(want, cdiv(keys, 4 * 64), MAX_SPLITS))


class DecodeFwd:
    """decode_fwd's decisions for one signature of its arguments (shapes, strides, dtypes,
    flags): grids, splits and every scalar argument of its launches, made once and then called
    with the tensors of each call of that signature (the op keeps them per signature,
    torch_flash/ops/attention_decode.py)."""

    def __init__(self, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, rotary_cos, rotary_sin,
                 alibi_slopes=None, sinks=None, cache_leftpad=None, *, scale, causal, window_left, window_right, softcap,
                 rotary_interleaved, num_splits=0):
        B, Hq, Sq, D = q.shape
        Hkv, page, Dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[-1]
        self.paged = paged = block_table is not None
        capacity = block_table.shape[1] * page if paged else page
        # pointer arguments of disabled features are never read (distinct, so nothing aliases)
        self.absent = q.new_empty(0, dtype=torch.int32)
        self.rotary = rotary = rotary_cos is not None
        cos = rotary_cos.contiguous() if rotary else self.absent
        snew = 0 if k_new is None else k_new.shape[2]
        common = dict(stride_bt=block_table.contiguous().stride(0) if paged else 0,
                      stride_c=cos.stride(0) if rotary else 0, SNEW=snew, CAPACITY=capacity, PAGE=page,
                      NUM_PAGES=k_cache.shape[0], SEQ_RO=cos.shape[0] if rotary else 0, HEAD_DIM_V=Dv,
                      BLOCK_D=_pow2(D), BLOCK_DV=_pow2(Dv), RD2=cos.shape[1] if rotary else 0, ROTARY=rotary,
                      INTERLEAVED=bool(rotary_interleaved), PAGED=paged)
        self.append = None
        if snew and B * Hkv:
            block_s = min(16, next_power_of_2(snew))
            self.append = ((cdiv(snew, block_s), Hkv, B),
                           dict(**_strides(k_new, "kn", "b", "h", "s"), **_strides(v_new, "vn", "b", "h", "s"),
                                **_strides(k_cache, "kc", "b", "h", "s"), **_strides(v_cache, "vc", "b", "h", "s"),
                                **common, HEAD_DIM=D, BLOCK_S=block_s))
        self.out_shape, self.lse_shape = (B, Hq, Sq, Dv), (B, Hq, Sq)
        self.empty = B * Hq * Sq * Dv == 0
        group = Hq // Hkv
        block_m = _pow2(min(group * Sq, _MAX_BLOCK_M))
        m_blocks = cdiv(group * Sq, block_m)
        if num_splits <= 0:
            keys = capacity if window_left < 0 else min(capacity, Sq + window_left)
            num_splits = auto_num_splits(B * Hkv * m_blocks, keys, q.device)
        num_splits = min(num_splits, MAX_SPLITS)
        self.split = split = num_splits > 1
        self.parts = ((B * Hq * Sq, num_splits, Dv), (B * Hq * Sq, num_splits))  # partial (out, lse) per split
        scale = D ** -0.5 if scale is None else scale
        width = (_pow2(D) + _pow2(Dv)) * q.element_size()
        self.kernel = _DECODE["narrow" if width <= 512 else "wide"]
        self.grid = (B * Hkv, num_splits, m_blocks)
        self.alibi = alibi_slopes is not None
        # (Hq,) slopes: batch stride 0
        alibi_strides = (((0,) if alibi_slopes.dim() == 1 else ()) + alibi_slopes.stride() if self.alibi
                         else (0, 0))
        self.scalars = dict(
            **dict(zip(("stride_ab", "stride_ah"), alibi_strides)), ALIBI=self.alibi, SINKS=sinks is not None,
            HAS_LEFTPAD=cache_leftpad is not None,
            **_strides(q, "q", "b", "h", "m"), **_strides(k_cache, "k", "b", "h", "n"),
            **_strides(v_cache, "v", "b", "h", "n"), **common, HKV=Hkv, GROUP=group, SQ=Sq, NUM_SPLITS=num_splits,
            qk_scale=scale / softcap if softcap > 0 else scale * _LOG2E.value, softcap=softcap * _LOG2E.value,
            window_left=window_left if window_left >= 0 else _UNBOUNDED,
            window_right=0 if causal else (window_right if window_right >= 0 else _UNBOUNDED),
            HEAD_DIM=D, SOFTCAP=softcap > 0, SPLIT=split,
            DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", BLOCK_M=block_m)
        block_splits = next_power_of_2(num_splits)
        self.combine = ((B * Hq * Sq,), dict(NUM_SPLITS=num_splits, HEAD_DIM_V=Dv, BLOCK_DV=_pow2(Dv),
                                             BLOCK_SPLITS=block_splits, SPLIT_CHUNK=min(block_splits, 16)))
        self.launchers = [None, None, None]

    def __call__(self, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, rotary_cos, rotary_sin,
                 alibi_slopes=None, sinks=None, cache_leftpad=None):
        absent, launchers = self.absent, self.launchers
        # the kernels index these 1-D / row-major (no-ops for the usual tensors)
        tables = dict(SEQLENS=cache_seqlens.contiguous(), BT=block_table.contiguous() if self.paged else absent,
                      COS=rotary_cos.contiguous() if self.rotary else absent,
                      SIN=rotary_sin.contiguous() if self.rotary else absent)
        if self.append is not None:
            grid, scalars = self.append
            launchers[0] = launch_as(launchers[0], _append_kernel, grid, (),
                                     dict(KN=k_new, VN=v_new, KC=k_cache, VC=v_cache, **tables, **scalars))
        out = q.new_empty(self.out_shape)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        if self.empty:
            return out, lse
        if self.split:
            out_p, lse_p = (torch.empty(shape, dtype=torch.float32, device=q.device) for shape in self.parts)
        else:
            out_p = lse_p = lse.new_empty(0)
        launchers[1] = launch_as(launchers[1], self.kernel, self.grid, (),
                                 dict(Q=q, KC=k_cache, VC=v_cache, Out=out, Lse=lse, OutP=out_p, LseP=lse_p,
                                      Alibi=alibi_slopes if self.alibi else absent,
                                      Sinks=absent if sinks is None else sinks.contiguous(),
                                      LEFTPAD=absent if cache_leftpad is None else cache_leftpad.contiguous(),
                                      **tables, **self.scalars))
        if self.split:
            grid, scalars = self.combine
            launchers[2] = launch_as(launchers[2], _combine_kernel, grid, (),
                                     dict(OutP=out_p, LseP=lse_p, Out=out, Lse=lse, **scalars))
        return out, lse


def decode_fwd(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, rotary_cos, rotary_sin,
               alibi_slopes=None, sinks=None, cache_leftpad=None, **flags):
    """Append k_new/v_new (B, Hkv, Snew, D|Dv) to the caches in place, then attend. Arguments as
    flash.attention_decode (validated by the op); flags: scale, causal, window_left, window_right,
    softcap, rotary_interleaved, num_splits=0 (picked by auto_num_splits; else at most
    MAX_SPLITS). Returns out (B, Hq, Sq, Dv) contiguous in q's dtype and lse (B, Hq, Sq) fp32."""
    tensors = (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, rotary_cos, rotary_sin, alibi_slopes,
               sinks, cache_leftpad)
    return DecodeFwd(*tensors, **flags)(*tensors)


def _strides(t, name: str, *dims: str) -> dict:
    """stride_<name><dim> of the first len(dims) dims of t."""
    return {f"stride_{name}{dim}": t.stride(n) for n, dim in enumerate(dims)}
