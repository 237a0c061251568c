"""Triton cross-entropy over any vocabulary size (the lm-head + cross-entropy built on it:
linear_cross_entropy.py).

Formula (torch_flash/reference/cross_entropy.py), per row x (V,) with target t, eps =
label_smoothing, z = softcap * tanh(x / softcap) (z = x without softcap), lse = logsumexp(z):
    loss   = (1 - eps) (lse - z[t]) + eps (lse - mean z) + z_loss lse^2     (0 on ignored rows)
    dloss/dx_j = [p_j (1 + 2 z_loss lse) - eps / V - (1 - eps) [j == t]] (1 - tanh^2),  p = exp(z - lse)
Math in fp32 whatever the logits' dtype; loss and lse are fp32.

One program per row (or, with Knobs.programs, a persistent grid of fewer programs that each take
rows that many apart), looping over vocabulary blocks, so V has no limit (256k and more) and the
row offset is 64-bit (8192 x 256k logits exceed 2^31 elements). A forward sweep keeps an online
log-sum-exp (block max, rescaled running sum; exp2 in log2 units). Where the gradient is wanted
with the loss (Liger-style, for an upstream gradient of 1 with mean's 1 / n_valid folded in), a
second sweep writes it, possibly over the logits themselves; ce_bwd instead rebuilds it from the
saved lse in one read and one write. Ignored rows read nothing and get a zero gradient.

Block size and warps follow a fixed rule (_launch_config) rather than autotuning: tuning reruns
the kernel, and the in-place variants would need a logits-sized restore copy for that. Knobs
override the rule's launch for a sweep (scripts/sweep_cross_entropy.py) without changing the
arithmetic of an element.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import _dispatch
from ...reference.cross_entropy import row_stride
from .launch import launch, launch_as, next_power_of_2
from .scalars import fp32

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)

# Widest vocabulary block, elements per thread and warps per program (16 at most). The
# gradient sweep runs backwards so that its first reads hit what the lse sweep left in L2, which
# wider blocks help where it overwrites the logits; writing another buffer, 8192 columns lead
# (docs/perf.md, "Cross-entropy": the bench's ours[block=N] rows).
MAX_BLOCK = 8192
MAX_BLOCK_IN_PLACE = 16384
ELEMENTS_PER_THREAD = 16
MAX_WARPS = 16
# A launch that writes no gradient (the loss or the lse alone) takes narrower blocks of more
# elements a thread, fewer warps to reduce across: 4096 x 4 warps ran at 0.95-1.00 of a device
# copy against 0.77-0.84 for 8192 x 16 (H200, 2026-11-28, five shapes from 8192 x 32000 to
# 16384 x 128256: scripts/sweep_cross_entropy.py, docs/results/sweep_cross_entropy).
MAX_BLOCK_NO_GRAD = 4096
ELEMENTS_PER_THREAD_NO_GRAD = 32

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _capped(x, softcap, inv_softcap, SOFTCAP: tl.constexpr):
    """(z, tanh(x / softcap)): the softcapped logits and the tanh their gradient needs."""
    if SOFTCAP:
        # tanh from exp2 of -2|y|, which never overflows (libdevice is not in the interpreter)
        y = x * inv_softcap
        e = tl.exp2(tl.abs(y) * (-2.0 * _LOG2E))
        th = (1.0 - e) / (1.0 + e)
        th = tl.where(y < 0, -th, th)
        return softcap * th, th
    else:
        return x, x


@triton.jit
def _online_lse(m2, d, z2):
    """(m2, d) -> (m2, d) with the block z2 (log2 units) folded in along axis 0: the running
    max and the sum of exp2(z2 - max)."""
    m_new = tl.maximum(m2, tl.max(z2, 0))
    # while every logit so far is -inf (masked classes), shift by 0: exp2(-inf - -inf) is NaN
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    d = d * tl.exp2(m2 - m_use) + tl.sum(tl.exp2(z2 - tl.expand_dims(m_use, 0)), 0)
    return m_new, d


@triton.jit
def _grad_coefs(w, lse2, z_loss, label_smoothing, n_classes):
    """(coef, smooth, hit_w) of a row of weight w (0 on ignored rows) and lse2 (log2 units):
    its gradient is p coef - smooth - hit_w [j == t]."""
    coef = w * (1.0 + 2.0 * z_loss * (lse2 * _LN2))
    return coef, w * label_smoothing / n_classes, w * (1.0 - label_smoothing)


@triton.jit
def _dz(z, th, lse2, coef, smooth, hit_w, is_target, SOFTCAP: tl.constexpr):
    """The gradient at the capped logits z (th: their tanh) of rows given by _grad_coefs."""
    dz = tl.exp2(z * _LOG2E - lse2) * coef - smooth
    dz = tl.where(is_target, dz - hit_w, dz)
    if SOFTCAP:
        dz *= 1.0 - th * th
    return dz


@triton.jit
def _loss(lse, z_t, z_sum, z_loss, label_smoothing, n_classes, SUM_Z: tl.constexpr):
    """A row's loss from its whole-vocabulary statistics (0 for an ignored row's zeros)."""
    loss = lse - z_t + z_loss * lse * lse
    if SUM_Z:
        loss += label_smoothing * (z_t - z_sum / n_classes)
    return loss


@triton.jit(do_not_specialize=["n_rows"])
def _ce_kernel(X, T, Loss, Lse, ZT, ZSum, G, Out, NValid, n_rows, n_cols, n_classes, vocab_start,
               stride_x, stride_out, stride_g, ignore_index, label_smoothing, z_loss, softcap, inv_softcap,
               FORWARD: tl.constexpr, STATS: tl.constexpr, WRITE_GRAD: tl.constexpr,
               HAS_GRAD_LOSS: tl.constexpr, MEAN: tl.constexpr, SUM_Z: tl.constexpr, SOFTCAP: tl.constexpr,
               BLOCK: tl.constexpr, ROW_LOOP: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Row program_id(0) of X (n_rows, n_cols), or with ROW_LOOP the rows program_id(0) +
    k num_programs(0) (a persistent grid); X holds the columns [vocab_start, vocab_start + n_cols)
    of a vocabulary of n_classes. FORWARD: write Lse[row] and either Loss[row] or, STATS, ZT[row]
    (z at the target if it falls in X, else 0) and ZSum[row] (all fp32, 0 on ignored rows); else
    read Lse[row] (the whole row's). SUM_Z: sum z (label smoothing, STATS). WRITE_GRAD: write the
    row's gradient to Out, scaled by G[row * stride_g] (HAS_GRAD_LOSS, else 1) and by
    1 / NValid[0] (MEAN). Out may be X. NUM_STAGES: software-pipeline stages of the vocabulary
    loops (None: not pipelined)."""
    label_smoothing, z_loss = fp32(label_smoothing), fp32(z_loss)
    softcap, inv_softcap = fp32(softcap), fp32(inv_softcap)
    pid, programs = tl.program_id(0), tl.num_programs(0)
    # without ROW_LOOP a loop of one trip of constant bounds, which the compiler folds away; with
    # it, values hoisted out of the row loop would stay live across it (80 registers instead of 64
    # on sm_90 at BLOCK 16384, one program a SM instead of two)
    n_trips = tl.cdiv(n_rows - pid, programs) if ROW_LOOP else 1
    for trip in tl.range(0, n_trips, disable_licm=True):
        row = (pid + trip * programs).to(tl.int64)
        x_row = X + row * stride_x
        t = tl.load(T + row)
        valid = t != ignore_index
        t_local = t - vocab_start
        hit = valid & (t_local >= 0) & (t_local < n_cols)
        t_col = tl.where(hit, t_local, -1).to(tl.int32)
        if FORWARD:
            lse2 = tl.zeros([], dtype=tl.float32)  # log2 units
            z_t = tl.zeros([], dtype=tl.float32)
            z_sum = tl.zeros([], dtype=tl.float32)
            if valid:
                m2 = tl.full([], float("-inf"), tl.float32)
                d = tl.zeros([], dtype=tl.float32)
                for off in tl.range(0, n_cols, BLOCK, num_stages=NUM_STAGES):
                    cols = off + tl.arange(0, BLOCK)
                    mask = cols < n_cols
                    z, _ = _capped(tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32),
                                   softcap, inv_softcap, SOFTCAP)
                    m2, d = _online_lse(m2, d, tl.where(mask, z * _LOG2E, float("-inf")))
                    if SUM_Z:
                        z_sum += tl.sum(tl.where(mask, z, 0.0), 0)
                lse2 = m2 + tl.log2(d)
                z_t, _ = _capped(tl.load(x_row + t_col, mask=hit, other=0.0).to(tl.float32),
                                 softcap, inv_softcap, SOFTCAP)
            # a target outside the vocabulary (not ignore_index) makes lse, so loss and gradient, NaN:
            # the signal compiled calls get, where eager calls also raise (ops/cross_entropy.py)
            lse2 = tl.where(valid & ((t < 0) | (t >= n_classes)), float("nan"), lse2)
            lse = lse2 * _LN2
            tl.store(Lse + row, lse)
            if STATS:
                tl.store(ZT + row, z_t)
                tl.store(ZSum + row, z_sum)
            else:
                # ignored rows: lse = z_t = z_sum = 0, so their loss is 0
                tl.store(Loss + row, _loss(lse, z_t, z_sum, z_loss, label_smoothing, n_classes, SUM_Z))
        else:
            lse2 = tl.load(Lse + row).to(tl.float32) * _LOG2E
        if WRITE_GRAD:
            if HAS_GRAD_LOSS:
                w = tl.load(G + row * stride_g).to(tl.float32)
            else:
                w = tl.full([], 1.0, tl.float32)
            if MEAN:
                w = w / tl.load(NValid).to(tl.float32)
            w = tl.where(valid, w, 0.0)  # also drops mean's inf when no row is valid
            coef, smooth, hit_w = _grad_coefs(w, lse2, z_loss, label_smoothing, n_classes)
            out_row = Out + row * stride_out
            n_read = tl.where(valid, n_cols, 0)  # ignored rows read nothing: with w = 0 they get 0
            # backwards: the blocks the first sweep read last are the likeliest still in L2
            n_blocks = tl.cdiv(n_cols, BLOCK)
            for i in tl.range(0, n_blocks, num_stages=NUM_STAGES):
                cols = (n_blocks - 1 - i) * BLOCK + tl.arange(0, BLOCK)
                mask = cols < n_cols
                z, th = _capped(tl.load(x_row + cols, mask=cols < n_read, other=0.0).to(tl.float32),
                                softcap, inv_softcap, SOFTCAP)
                dz = _dz(z, th, lse2, coef, smooth, hit_w, cols == t_col, SOFTCAP)
                tl.store(out_row + cols, dz.to(Out.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------
class Knobs(NamedTuple):
    """Launch settings of _ce_kernel beyond the block, for sweeps; None keeps the default launch.
    num_warps: warps per program (default: _launch_config's rule). num_stages: software-pipeline
    stages of the vocabulary loops (tl.range: later blocks' loads in flight while one is reduced).
    programs: a persistent grid of at most this many programs, each looping over rows that many
    apart (l2_programs sizes one), instead of one program per row."""
    num_warps: int | None = None
    num_stages: int | None = None
    programs: int | None = None


def l2_programs(n_rows: int, row_bytes: int, device: torch.device, l2_fraction: float) -> int:
    """Programs of a persistent grid whose rows in flight (one a program, row_bytes each) fill
    l2_fraction of the device's L2 cache, so that a second sweep over a row can find it there; at
    least one a SM (none idle), at most n_rows. Off the GPU (the interpreter): one a SM."""
    sms = _dispatch.sm_count(device)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
    return max(1, min(n_rows, max(sms, int(l2_fraction * l2) // row_bytes)))


def _launch_config(n_cols: int, block: int | None, in_place: bool, knobs: Knobs = Knobs(), grad: bool = True
                   ) -> tuple[int, int, dict]:
    """(BLOCK, num_warps, the row-loop and pipeline constexprs) for rows of n_cols, whose gradient
    the launch writes if grad, over them if in_place; block forces the block (tests loop over
    small ones)."""
    cap, per_thread = ((MAX_BLOCK_IN_PLACE if in_place else MAX_BLOCK, ELEMENTS_PER_THREAD) if grad
                       else (MAX_BLOCK_NO_GRAD, ELEMENTS_PER_THREAD_NO_GRAD))
    block = block or min(cap, next_power_of_2(n_cols))
    warps = knobs.num_warps or max(1, min(MAX_WARPS, block // (32 * per_thread)))
    return block, warps, dict(ROW_LOOP=knobs.programs is not None, NUM_STAGES=knobs.num_stages)


def _programs(n_rows: int, knobs: Knobs) -> int:
    """_ce_kernel's grid over n_rows rows."""
    return n_rows if knobs.programs is None else max(1, min(n_rows, knobs.programs))


def _row_view(t: torch.Tensor, n_cols: int) -> torch.Tensor | None:
    """t (..., n_cols) as an (N, n_cols) view sharing its memory when its rows are contiguous and
    evenly spaced (any slicing of the last dim, a transposed batch of one...), else None."""
    stride = row_stride(t)
    return None if stride is None else t.as_strided((t.numel() // n_cols, n_cols), (stride, 1))


def _as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """t (..., n_cols) as (N, n_cols) rows the kernel can read: a view, else a contiguous copy."""
    rows = _row_view(t, n_cols)
    return rows if rows is not None else t.contiguous().view(-1, n_cols)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """t as the dense 1-D array the kernel indexes by row (reshape alone keeps a 1-D stride)."""
    return t.reshape(-1).contiguous()


def _writable_rows(out: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, int, bool]:
    """(what the kernel writes for out, its row stride, whether it is a buffer to copy into out
    afterwards). out itself where its rows are evenly spaced, not a row view of it: Inductor
    (which traces into the ops) clones a view a kernel writes and copies it back, a pass over
    the whole gradient."""
    rows = _row_view(out, shape[1])
    if rows is not None and (shape[0] <= 1 or rows.stride(0) >= shape[1]):  # rows must not overlap
        return out, rows.stride(0), False
    return torch.empty(shape, dtype=out.dtype, device=out.device), shape[1], True


def _n_valid(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Non-ignored rows as a device scalar: the kernels read it, so the host never syncs."""
    return (target != ignore_index).sum()


# Targets per step of _target_summary_kernel's one program (int64: 32 KiB a step).
SUMMARY_BLOCK = 4096
_SENTINEL: tl.constexpr = tl.constexpr(2**62)


@triton.jit
def _target_summary_kernel(T, Out, Losses, Loss, n, ignore_index, REDUCE: tl.constexpr, MEAN: tl.constexpr,
                           BLOCK: tl.constexpr):
    """Out (3,) int64: how many of the n targets T are not ignore_index, and the least and the
    greatest of those (0 and 0 if none). REDUCE: also Loss[0], the sum of the n fp32 Losses
    (divided by that count where MEAN: NaN if none), in a fixed order. One program, one pass."""
    count = tl.zeros((BLOCK,), tl.int64)
    low = tl.full((BLOCK,), _SENTINEL, tl.int64)
    high = tl.full((BLOCK,), -_SENTINEL, tl.int64)
    total = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        t = tl.load(T + offs, mask=offs < n, other=ignore_index).to(tl.int64)
        valid = t != ignore_index
        count += valid.to(tl.int64)
        low = tl.minimum(low, tl.where(valid, t, _SENTINEL))
        high = tl.maximum(high, tl.where(valid, t, -_SENTINEL))
        if REDUCE:
            total += tl.load(Losses + offs, mask=offs < n, other=0.0)
    n_valid = tl.sum(count, axis=0)
    tl.store(Out, n_valid)
    tl.store(Out + 1, tl.where(n_valid > 0, tl.min(low, axis=0), 0))
    tl.store(Out + 2, tl.where(n_valid > 0, tl.max(high, axis=0), 0))
    if REDUCE:
        loss = tl.sum(total, axis=0)
        if MEAN:
            loss = loss / n_valid.to(tl.float32)
        tl.store(Loss, loss)


def _summary_block(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of _target_summary_kernel for n targets."""
    block = min(SUMMARY_BLOCK, max(64, next_power_of_2(n)))
    return block, max(1, min(8, block // 512))


def target_summary(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """(n_valid, min, max) of the non-ignored targets as a (3,) int64 device tensor, in one launch
    (what the ops' target check and the kernels' mean need; torch ops took six)."""
    t = _flat(target)
    out = torch.empty(3, dtype=torch.int64, device=t.device)
    block, warps = _summary_block(t.numel())
    launch(_target_summary_kernel, (1,), t, out, None, None, t.numel(), ignore_index, REDUCE=False, MEAN=False,
           BLOCK=block, num_warps=warps)
    return out


def _launch(x, t, *, loss, lse, grad_loss, out, n_valid, ignore_index, label_smoothing, z_loss,
            softcap, reduction, block=None, stats=None, vocab_start=0, vocab_size=None, in_place=False,
            out_stride=None, knobs=Knobs()):
    """One _ce_kernel launch over the rows of x (N, V). loss and stats None: read lse instead of
    writing it; stats (z_t, z_sum): write those instead of the loss; out None: no gradient, else
    rows out_stride apart (default out.stride(0)); in_place: out is x's memory; grad_loss None:
    an upstream gradient of 1. x holds the classes from vocab_start of vocab_size (default: x is
    the whole vocabulary)."""
    n_rows, n_cols = x.shape
    if n_rows == 0:
        return
    block, num_warps, loop = _launch_config(n_cols, block, in_place, knobs, grad=out is not None)
    g = grad_loss.reshape(-1) if grad_loss is not None else None
    z_t, z_sum = (None, None) if stats is None else stats
    launch(
        _ce_kernel, (_programs(n_rows, knobs),),
        x, t, loss, lse, z_t, z_sum, g, out, n_valid, n_rows, n_cols, vocab_size or n_cols, vocab_start,
        x.stride(0), 0 if out is None else out_stride or out.stride(0),
        0 if g is None or g.numel() == 1 else g.stride(0),
        ignore_index, label_smoothing, z_loss, softcap, 1.0 / softcap if softcap > 0 else 0.0,
        FORWARD=loss is not None or stats is not None, STATS=stats is not None, WRITE_GRAD=out is not None,
        HAS_GRAD_LOSS=g is not None, MEAN=reduction == "mean", SUM_Z=label_smoothing > 0 or stats is not None,
        SOFTCAP=softcap > 0, BLOCK=block, **loop, num_warps=num_warps)


def _reduce(losses: torch.Tensor, target: torch.Tensor, n_valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-row fp32 losses (N,) -> the op's output; mean over non-ignored rows (nan if none)."""
    if reduction == "none":
        return losses.view(target.shape)
    total = losses.sum()
    return total / n_valid if reduction == "mean" else total


def ce_supports(logits: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether these kernels serve logits (..., V) with class indices target (...)."""
    return (logits.dtype in DTYPES and logits.dim() >= 1
            and logits.shape[-1] > 0 and target.dtype in INDEX_DTYPES
            and tuple(target.shape) == tuple(logits.shape[:-1]) and target.device == logits.device)


def ce_fwd(logits, target, *, ignore_index, label_smoothing, z_loss, softcap, reduction,
           grad_logits_out=None, block=None, n_valid=None, knobs=Knobs()):
    """Cross-entropy of logits (..., V) against target (...): (loss, lse, grad or None).

    loss: fp32, target's shape for reduction="none", else a scalar. lse: fp32 (...), the
    log-sum-exp of each row's (capped) logits, 0 on ignored rows, NaN (so loss and gradient too)
    where the target is outside [0, V) and not ignore_index. grad_logits_out (shaped like
    logits, any dtype of DTYPES; may be logits itself) receives d(loss)/d(logits) for an upstream
    gradient of 1 (per row for "none"), in a second sweep over each row; the backward then only
    scales it by grad_loss. block forces the vocabulary block (a power of 2). n_valid: the
    non-ignored rows as a device scalar, where the caller has it (target_summary). knobs: see
    Knobs.
    """
    n_cols = logits.shape[-1]
    x, t = _as_rows(logits, n_cols), _flat(target)
    losses = torch.empty(t.shape[0], dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(losses)
    if n_valid is None:
        n_valid = _n_valid(t, ignore_index)
    dst, dst_stride, copy_back = ((None, None, False) if grad_logits_out is None
                                  else _writable_rows(grad_logits_out, x.shape))
    _launch(x, t, loss=losses, lse=lse, grad_loss=None, out=dst, n_valid=n_valid,
            ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
            reduction=reduction, block=block, in_place=grad_logits_out is logits and not copy_back,
            out_stride=dst_stride, knobs=knobs)
    if copy_back:
        grad_logits_out.copy_(dst.view(grad_logits_out.shape))
    return _reduce(losses, target, n_valid, reduction), lse.view(target.shape), grad_logits_out


class CeFwd:
    """The loss forward (ce_fwd without a gradient) for one signature of its arguments, as the
    op keeps it (ops/_plans.py): two launches, the row losses then one program that reduces them
    and summarises the targets. Returns (loss, lse, summary): summary as target_summary's. block
    and knobs: the row launch's, as in ce_fwd."""

    def __init__(self, logits, target, *, ignore_index, label_smoothing, z_loss, softcap, reduction,
                 block=None, knobs=Knobs()):
        self.n_cols = n_cols = logits.shape[-1]
        self.n_rows = target.numel()
        self.stride = row_stride(logits) if self.n_rows > 0 else None
        self.reduction, self.shape = reduction, target.shape
        block, num_warps, loop = _launch_config(n_cols, block, False, knobs, grad=False)
        self.programs = _programs(self.n_rows, knobs)
        self.scalars = (ignore_index, label_smoothing, z_loss, softcap, 1.0 / softcap if softcap > 0 else 0.0)
        self.consts = dict(FORWARD=True, STATS=False, WRITE_GRAD=False, HAS_GRAD_LOSS=False, MEAN=False,
                           SUM_Z=label_smoothing > 0, SOFTCAP=softcap > 0, BLOCK=block, **loop,
                           num_warps=num_warps)
        block, warps = _summary_block(self.n_rows)
        self.summary_consts = dict(REDUCE=reduction != "none", MEAN=reduction == "mean", BLOCK=block,
                                   num_warps=warps)
        self.launchers = [None, None]

    def __call__(self, logits, target):
        n_rows, n_cols = self.n_rows, self.n_cols
        x = (logits.contiguous().view(-1, n_cols) if self.stride is None
             else logits.as_strided((n_rows, n_cols), (self.stride, 1)))
        t = _flat(target)
        losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(losses)
        summary = torch.empty(3, dtype=torch.int64, device=logits.device)
        reduced = self.reduction != "none"
        loss = torch.empty((), dtype=torch.float32, device=logits.device) if reduced else losses.view(self.shape)
        if n_rows > 0:
            args = (x, t, losses, lse, None, None, None, None, None, n_rows, n_cols, n_cols, 0, x.stride(0), 0, 0,
                    *self.scalars)
            self.launchers[0] = launch_as(self.launchers[0], _ce_kernel, (self.programs,), args, self.consts)
        args = (t, summary, losses, loss if reduced else None, n_rows, self.scalars[0])
        self.launchers[1] = launch_as(self.launchers[1], _target_summary_kernel, (1,), args, self.summary_consts)
        return loss, lse.view(self.shape), summary


def ce_stats(logits, target, *, ignore_index, softcap, vocab_start=0, vocab_size=None, block=None):
    """Row statistics of logits (..., V_local), the classes from vocab_start of a vocabulary of
    vocab_size (default V_local): (lse, z_target, z_sum), fp32 (...), 0 on ignored rows; z_target
    is 0 where the row's target lies in another shard, lse NaN where it lies outside the
    vocabulary. One read of the logits."""
    n_cols = logits.shape[-1]
    x, t = _as_rows(logits, n_cols), _flat(target)
    lse, z_t, z_sum = (torch.empty(t.shape[0], dtype=torch.float32, device=logits.device) for _ in range(3))
    _launch(x, t, loss=None, lse=lse, grad_loss=None, out=None, n_valid=None, ignore_index=ignore_index,
            label_smoothing=0.0, z_loss=0.0, softcap=softcap, reduction="none", block=block,
            stats=(z_t, z_sum), vocab_start=vocab_start, vocab_size=vocab_size)
    return lse.view(target.shape), z_t.view(target.shape), z_sum.view(target.shape)


def ce_bwd(grad_loss, logits, target, lse, *, ignore_index, label_smoothing, z_loss, softcap, reduction,
           vocab_start=0, vocab_size=None, out=None, block=None, n_valid=None, knobs=Knobs()):
    """dlogits (..., V) from ce_fwd's lse: one read of logits, one write of out (default: a new
    contiguous tensor like logits; may be logits itself). grad_loss: target's shape for
    reduction="none", else a scalar. lse None: the same kernel recomputes it first (a backward
    that needs nothing saved but the inputs, for one more read of the logits). A vocabulary shard
    (classes from vocab_start of vocab_size) needs lse, the whole row's log-sum-exp. n_valid and
    knobs as in ce_fwd."""
    n_cols = logits.shape[-1]
    x, t = _as_rows(logits, n_cols), _flat(target)
    if out is None:
        out = logits.new_empty(logits.shape)
    dst, dst_stride, copy_back = _writable_rows(out, x.shape)
    scratch = torch.empty(t.shape[0], dtype=torch.float32, device=x.device) if lse is None else None
    _launch(x, t, loss=scratch, lse=torch.empty_like(scratch) if lse is None else _flat(lse),
            grad_loss=grad_loss, out=dst,
            n_valid=(n_valid if n_valid is not None else _n_valid(t, ignore_index)) if reduction == "mean" else None,
            ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
            reduction=reduction, block=block, vocab_start=vocab_start, vocab_size=vocab_size,
            in_place=out is logits and not copy_back, out_stride=dst_stride, knobs=knobs)
    if copy_back:
        out.copy_(dst.view(out.shape))
    return out


# --------------------------------------------------------------------------------------
# Linear + cross-entropy
# --------------------------------------------------------------------------------------
