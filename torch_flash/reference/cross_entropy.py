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


def _safe_index(target: Tensor, ignore_index: int) -> Tensor:
    """(rows, 1) int64 gather index; ignored rows point at class 0 (masked later)."""
    return torch.where(target != ignore_index, target, 0).long().unsqueeze(-1)


def row_losses(logits: Tensor, target: Tensor, opts: LossOptions) -> tuple[Tensor, Tensor]:
    """(loss, lse) of each row of a (rows, V) chunk, both 0 on ignored rows; (rows,) in the
    compute dtype."""
    z = _capped(logits.to(compute_dtype(logits.dtype)), opts.softcap)
    lse = torch.logsumexp(z, -1)
    z_t = z.gather(-1, _safe_index(target, opts.ignore_index)).squeeze(-1)
    # (1 - eps)(lse - z_t) + eps(lse - mean z), with the mean only paid for when eps > 0
    loss = lse - z_t
    if opts.label_smoothing > 0:
        loss = loss + opts.label_smoothing * (z_t - z.mean(-1))
    if opts.z_loss > 0:
        loss = loss + opts.z_loss * lse.square()
    valid = target != opts.ignore_index
    return torch.where(valid, loss, 0.0), torch.where(valid, lse, 0.0)


def row_grads(logits: Tensor, target: Tensor, grad_rows: Tensor, opts: LossOptions) -> Tensor:
    """d(sum_i grad_rows[i] * loss_i) / d logits for a (rows, V) chunk, in the compute dtype.

    grad_rows (rows,) must be 0 on ignored rows. dloss/dz_j = p_j (1 + 2 z_loss lse)
    - (1 - eps) [j == t] - eps / V, times dz/dx = 1 - tanh^2 under softcap.
    """
    x = logits.to(compute_dtype(logits.dtype))
    z = _capped(x, opts.softcap)
    lse = torch.logsumexp(z, -1, keepdim=True)
    g = grad_rows.to(x.dtype).unsqueeze(-1)
    scale = g * (1 + 2 * opts.z_loss * lse) if opts.z_loss > 0 else g
    # in-place only on temporaries created here, never on the caller's logits
    dz = (z - lse).exp_().mul_(scale)
    eps = opts.label_smoothing
    dz.scatter_add_(-1, _safe_index(target, opts.ignore_index), -(1 - eps) * g)
    if eps > 0:
        dz.sub_(g * (eps / x.shape[-1]))
    if opts.softcap > 0:
        dz.mul_(z.div_(opts.softcap).square_().neg_().add_(1))
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
                           opts: LossOptions = LossOptions(), reduction: str = "mean") -> Tensor:
    """dlogits (..., V) in logits' dtype (contiguous): the only logits-sized allocation."""
    n_classes = logits.shape[-1]
    x, t = logits.reshape(-1, n_classes), target.reshape(-1)
    g = grad_rows(grad_loss, target, opts.ignore_index, reduction, compute_dtype(logits.dtype))
    dlogits = logits.new_empty(logits.shape)
    out = dlogits.view(-1, n_classes)
    for rows in row_slices(x.shape[0], rows_per_chunk(n_classes, logits.dtype)):
        out[rows] = row_grads(x[rows], t[rows], g[rows], opts)
    return dlogits
