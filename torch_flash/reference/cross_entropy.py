"""Plain-PyTorch cross-entropy over the last dimension: the formula the kernels and the
compile-pass patterns follow, and the CPU path of flash.cross_entropy (its per-chunk loss
and gradient also serve flash.linear_cross_entropy).

Per row of logits x (V,) with target t, eps = label_smoothing (as PyTorch's):
    z    = softcap * tanh(x / softcap)        (z = x when softcap == 0)
    lse  = logsumexp(z)
    loss = (1 - eps) * (lse - z[t]) + eps * (lse - mean(z)) + z_loss * lse**2
Rows whose target is ignore_index lose 0 and get no gradient. Math in fp32 (fp64 stays
fp64). Rows are processed in chunks, so temporaries are O(chunk * V) whatever V is; a
logits layout that cannot be viewed as (rows, V) is copied once first.

A vocabulary shard (vocab-parallel mode) holds the columns [vocab_start, vocab_start + V_local)
of a vocabulary of vocab_size classes. Its row statistics (lse, z[t] where t falls in the shard
else 0, sum of z) combine across shards into the whole row's (log-add-exp of the lse, sums of
the rest), from which loss_from_stats gives the loss; the shard's gradient needs only the whole
row's lse: dloss/dz_j = p_j (1 + 2 z_loss lse) - (1 - eps) [j == t] - eps / vocab_size.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

import torch
from torch import Tensor

from ._common import compute_dtype

# Bytes of one chunk's logits in the compute dtype; each chunk needs a few of these.
CHUNK_BYTES = 256 * 2**20


class LossOptions(NamedTuple):
    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float = 0.0


def rows_per_chunk(n_classes: int, dtype: torch.dtype, chunk_size: int = 0) -> int:
    """chunk_size rows if given, else as many as keep a (rows, n_classes) chunk within CHUNK_BYTES."""
    if chunk_size > 0:
        return chunk_size
    return max(1, CHUNK_BYTES // (n_classes * compute_dtype(dtype).itemsize))


def row_slices(n_rows: int, rows: int) -> Iterator[slice]:
    for start in range(0, n_rows, rows):
        yield slice(start, start + rows)


def _capped(x: Tensor, softcap: float) -> Tensor:
    return softcap * torch.tanh(x / softcap) if softcap > 0 else x


def row_stride(t: Tensor) -> int | None:
    """The distance between consecutive rows of t (..., V) seen as (N, V) rows with a contiguous
    last dimension, or None when its rows are not evenly spaced that way (seeing them needs a
    copy). Metadata only; rows may overlap (stride < V) where a batch dim is expanded."""
    n_cols = t.shape[-1]
    if n_cols > 1 and t.stride(-1) != 1:
        return None
    lead = [(n, s) for n, s in zip(t.shape[:-1], t.stride()[:-1]) if n != 1]
    if any(outer != inner * n for (_, outer), (n, inner) in zip(lead, lead[1:])):
        return None
    return lead[-1][1] if lead else n_cols


def _shard_index(target: Tensor, ignore_index: int, vocab_start: int, n_cols: int) -> tuple[Tensor, Tensor]:
    """((rows, 1) int64 gather index into the shard, (rows,) whether the row's target is in it);
    rows whose target is ignored or elsewhere point at column 0 (masked by the caller)."""
    local = target.long() - vocab_start
    hit = (target != ignore_index) & (local >= 0) & (local < n_cols)
    return torch.where(hit, local, 0).unsqueeze(-1), hit


def row_stats(logits: Tensor, target: Tensor, opts: LossOptions, vocab_start: int = 0,
              sum_z: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
    """(lse, z_target, z_sum) of each row of a (rows, V_local) chunk of a vocabulary shard, (rows,)
    in the compute dtype, all 0 on ignored rows: the log-sum-exp of z, z at the target where the
    target falls in the shard (else 0), the sum of z (None unless sum_z)."""
    z = _capped(logits.to(compute_dtype(logits.dtype)), opts.softcap)
    valid = target != opts.ignore_index
    index, hit = _shard_index(target, opts.ignore_index, vocab_start, z.shape[-1])
    lse = torch.where(valid, torch.logsumexp(z, -1), 0.0)
    z_t = torch.where(hit, z.gather(-1, index).squeeze(-1), 0.0)
    z_sum = torch.where(valid, z.sum(-1), 0.0) if sum_z else None
    return lse, z_t, z_sum


def loss_from_stats(lse: Tensor, z_t: Tensor, z_sum: Tensor | None, target: Tensor, opts: LossOptions,
                    vocab_size: int) -> Tensor:
    """Each row's loss from the whole row's statistics (row_stats summed over shards, lse
    log-add-exp'ed); z_sum is only read when label_smoothing > 0. 0 on ignored rows."""
    # (1 - eps)(lse - z_t) + eps(lse - mean z), with the mean only paid for when eps > 0
    loss = lse - z_t
    if opts.label_smoothing > 0:
        loss = loss + opts.label_smoothing * (z_t - z_sum / vocab_size)
    if opts.z_loss > 0:
        loss = loss + opts.z_loss * lse.square()
    return torch.where(target != opts.ignore_index, loss, 0.0)


def row_losses(logits: Tensor, target: Tensor, opts: LossOptions) -> tuple[Tensor, Tensor]:
    """(loss, lse) of each row of a (rows, V) chunk, both 0 on ignored rows; (rows,) in the
    compute dtype."""
    lse, z_t, z_sum = row_stats(logits, target, opts, sum_z=opts.label_smoothing > 0)
    return loss_from_stats(lse, z_t, z_sum, target, opts, logits.shape[-1]), lse


def row_grads(logits: Tensor, target: Tensor, grad_rows: Tensor, opts: LossOptions,
              lse: Tensor | None = None, vocab_start: int = 0, vocab_size: int | None = None) -> Tensor:
    """d(sum_i grad_rows[i] * loss_i) / d logits for a (rows, V) chunk, in the compute dtype.

    grad_rows (rows,) must be 0 on ignored rows. dloss/dz_j = p_j (1 + 2 z_loss lse)
    - (1 - eps) [j == t] - eps / V, times dz/dx = 1 - tanh^2 under softcap. For a vocabulary
    shard (columns from vocab_start of vocab_size), lse (rows,) is the whole row's.
    """
    x = logits.to(compute_dtype(logits.dtype))
    z = _capped(x, opts.softcap)
    given_lse = lse is not None
    lse = lse.to(x.dtype).unsqueeze(-1) if given_lse else torch.logsumexp(z, -1, keepdim=True)
    g = grad_rows.to(x.dtype).unsqueeze(-1)
    scale = g * (1 + 2 * opts.z_loss * lse) if opts.z_loss > 0 else g
    # in-place only on temporaries created here, never on the caller's logits
    dz = (z - lse).exp_().mul_(scale)
    eps = opts.label_smoothing
    index, hit = _shard_index(target, opts.ignore_index, vocab_start, x.shape[-1])
    dz.scatter_add_(-1, index, torch.where(hit.unsqueeze(-1), -(1 - eps) * g, 0.0))
    if eps > 0:
        dz.sub_(g * (eps / (vocab_size or x.shape[-1])))
    if opts.softcap > 0:
        dz.mul_(z.div_(opts.softcap).square_().neg_().add_(1))
    if given_lse:  # a given lse is 0 on ignored rows: exp(z - 0) may overflow there, times g = 0
        dz.masked_fill_((target == opts.ignore_index).unsqueeze(-1), 0.0)
    return dz


def reduce(losses: Tensor, target: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """Per-row losses (N,) -> the op's output; "mean" divides by the non-ignored rows
    (nan when there are none, as F.cross_entropy)."""
    if reduction == "none":
        return losses.reshape(target.shape)
    total = losses.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum()


def grad_rows(grad_loss: Tensor, target: Tensor, ignore_index: int, reduction: str,
              dtype: torch.dtype) -> Tensor:
    """The weight of each row's loss in grad_loss * output: (N,), 0 on ignored rows."""
    valid = (target != ignore_index).reshape(-1)
    g = grad_loss.to(dtype)
    if reduction == "none":
        g = g.reshape(-1)
    elif reduction == "mean":
        g = g / valid.sum()  # inf when nothing is valid; masked to 0 below, as PyTorch
    return torch.where(valid, g, 0.0)


def cross_entropy_with_lse(logits: Tensor, target: Tensor, opts: LossOptions = LossOptions(),
                           reduction: str = "mean") -> tuple[Tensor, Tensor]:
    """logits (..., V), target (...) -> (loss, lse): loss (...) for "none", else a scalar;
    lse (...) each row's log-sum-exp (0 on ignored rows); both in the compute dtype."""
    n_classes = logits.shape[-1]
    x, t = logits.reshape(-1, n_classes), target.reshape(-1)
    losses = x.new_empty(x.shape[0], dtype=compute_dtype(logits.dtype))
    lse = torch.empty_like(losses)
    for rows in row_slices(x.shape[0], rows_per_chunk(n_classes, logits.dtype)):
        losses[rows], lse[rows] = row_losses(x[rows], t[rows], opts)
    return reduce(losses, target, opts.ignore_index, reduction), lse.reshape(target.shape)


def cross_entropy(logits: Tensor, target: Tensor, opts: LossOptions = LossOptions(),
                  reduction: str = "mean") -> Tensor:
    """logits (..., V), target (...) -> loss (...) for "none", else a scalar; compute dtype."""
    return cross_entropy_with_lse(logits, target, opts, reduction)[0]


def cross_entropy_backward(grad_loss: Tensor, logits: Tensor, target: Tensor,
                           opts: LossOptions = LossOptions(), reduction: str = "mean",
                           lse: Tensor | None = None, vocab_start: int = 0, vocab_size: int | None = None,
                           out: Tensor | None = None) -> Tensor:
    """dlogits (..., V) in logits' dtype, written into out (default: a new contiguous tensor, the
    only logits-sized allocation; out may be logits itself when row_stride(logits) gives
    non-overlapping rows: each chunk is read whole before it is overwritten). lse (...), the
    whole row's log-sum-exp, is required for a vocabulary shard and recomputed when None."""
    n_classes = logits.shape[-1]
    x, t = logits.reshape(-1, n_classes), target.reshape(-1)
    g = grad_rows(grad_loss, target, opts.ignore_index, reduction, compute_dtype(logits.dtype))
    if out is None:
        out = logits.new_empty(logits.shape)
    stride = row_stride(out)
    rows_out = out.as_strided((x.shape[0], n_classes), (stride, 1))
    lse_rows = None if lse is None else lse.reshape(-1)
    for rows in row_slices(x.shape[0], rows_per_chunk(n_classes, logits.dtype)):
        rows_out[rows] = row_grads(x[rows], t[rows], g[rows], opts,
                                   None if lse_rows is None else lse_rows[rows], vocab_start, vocab_size)
    return out


def cross_entropy_backward_inplace(grad_loss: Tensor, logits: Tensor, target: Tensor,
                                   opts: LossOptions = LossOptions(), reduction: str = "mean",
                                   lse: Tensor | None = None, vocab_start: int = 0,
                                   vocab_size: int | None = None) -> None:
    """cross_entropy_backward written over logits (no second logits-sized tensor)."""
    cross_entropy_backward(grad_loss, logits, target, opts, reduction, lse, vocab_start, vocab_size,
                           out=logits)


def cross_entropy_shard_stats(logits: Tensor, target: Tensor, opts: LossOptions = LossOptions(),
                              vocab_start: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """row_stats of logits (..., V_local), the shard from column vocab_start of the vocabulary:
    (lse, z_target, z_sum), each target's shape in the compute dtype."""
    n_cols = logits.shape[-1]
    x, t = logits.reshape(-1, n_cols), target.reshape(-1)
    stats = [x.new_empty(x.shape[0], dtype=compute_dtype(logits.dtype)) for _ in range(3)]
    for rows in row_slices(x.shape[0], rows_per_chunk(n_cols, logits.dtype)):
        for out, value in zip(stats, row_stats(x[rows], t[rows], opts, vocab_start)):
            out[rows] = value
    return tuple(s.view(target.shape) for s in stats)
