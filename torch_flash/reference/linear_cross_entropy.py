"""Plain-PyTorch lm-head + cross-entropy that never materialises the full (N, V) logits.

loss = cross_entropy(hidden @ weight.T + bias, target) with cross_entropy's exact math
(torch_flash/reference/cross_entropy.py). Token rows are processed in chunks: each
chunk's logits are computed in hidden's dtype (as the unfused nn.Linear would), turned
into per-row losses or logit gradients by cross_entropy's per-chunk helpers, and freed.
The backward recomputes each chunk's logits instead of saving them.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cross_entropy as ce
from ._common import compute_dtype

LossOptions = ce.LossOptions


def chunk_logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """(rows, H) -> (rows, V) logits of one chunk."""
    return F.linear(hidden, weight, bias)


def row_chunks(hidden: Tensor, weight: Tensor, chunk_size: int):
    """hidden as (N, H) and the row slices of its chunks."""
    h = hidden.reshape(hidden.shape[:-1].numel(), hidden.shape[-1])  # not -1: H may be 0
    return h, ce.row_slices(h.shape[0], ce.rows_per_chunk(weight.shape[0], hidden.dtype, chunk_size))


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None,
                         opts: LossOptions = LossOptions(), reduction: str = "mean",
                         chunk_size: int = 0) -> Tensor:
    """hidden (..., H), weight (V, H), target (...), bias (V,) -> loss as cross_entropy's."""
    h, chunks = row_chunks(hidden, weight, chunk_size)
    t = target.reshape(-1)
    losses = h.new_empty(h.shape[0], dtype=compute_dtype(hidden.dtype))
    for rows in chunks:
        losses[rows] = ce.row_losses(chunk_logits(h[rows], weight, bias), t[rows], opts)[0]
    return ce.reduce(losses, target, opts.ignore_index, reduction)


def linear_cross_entropy_backward(grad_loss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor,
                                  bias: Optional[Tensor] = None, opts: LossOptions = LossOptions(),
                                  reduction: str = "mean", chunk_size: int = 0,
                                  grads: tuple[bool, bool, bool] = (True, True, True)):
    """(dhidden, dweight, dbias) in the dtypes of hidden, weight, bias; grads says which to
    compute, the others are None (dbias also without bias).

    dweight and dbias accumulate over chunks in fp32 (fp64 for fp64) from the fp32 logit
    gradients; dhidden's matmul runs in hidden's dtype, as the unfused backward would,
    so the weight is never copied to fp32.
    """
    cdt = compute_dtype(hidden.dtype)
    h, chunks = row_chunks(hidden, weight, chunk_size)
    t = target.reshape(-1)
    g = ce.grad_rows(grad_loss, target, opts.ignore_index, reduction, cdt)
    dhidden = hidden.new_empty(hidden.shape) if grads[0] else None
    dweight = weight.new_zeros(weight.shape, dtype=cdt) if grads[1] else None
    dbias = bias.new_zeros(bias.shape, dtype=cdt) if grads[2] and bias is not None else None
    for rows in chunks:
        dz = ce.row_grads(chunk_logits(h[rows], weight, bias), t[rows], g[rows], opts)
        if dweight is not None:
            dweight.addmm_(dz.T, h[rows].to(cdt))
        if dbias is not None:
            dbias += dz.sum(0)
        if dhidden is not None:
            dhidden.view(h.shape)[rows] = dz.to(hidden.dtype) @ weight
    return (dhidden, None if dweight is None else dweight.to(weight.dtype),
            None if dbias is None else dbias.to(bias.dtype))


def linear_cross_entropy_with_grads(hidden: Tensor, weight: Tensor, target: Tensor,
                                    bias: Optional[Tensor] = None, opts: LossOptions = LossOptions(),
                                    reduction: str = "mean", chunk_size: int = 0,
                                    grads: tuple[bool, bool, bool] = (True, True, True)):
    """(loss, dhidden, dweight, dbias) for an upstream gradient of 1 ("mean" or "sum")."""
    loss = linear_cross_entropy(hidden, weight, target, bias, opts, reduction, chunk_size)
    return (loss, *linear_cross_entropy_backward(torch.ones_like(loss), hidden, weight, target, bias,
                                                 opts, reduction, chunk_size, grads))


def linear_cross_entropy_scale_(grad: Tensor, grad_loss: Tensor) -> None:
    """grad *= grad_loss in place (grad_loss: one element)."""
    grad.mul_(grad_loss.reshape(()).to(grad.dtype))
