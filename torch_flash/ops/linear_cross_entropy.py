"""flash.linear_cross_entropy: the lm-head matmul fused with cross-entropy.

Shapes: hidden (..., H), weight (V, H) (nn.Linear layout), bias (V,) or None, target (...);
loss = cross_entropy(hidden @ weight.T + bias, target, ...) with flash.cross_entropy's
options, output shape and dtype. Token chunks of `chunk_size` rows (0: as many as keep a
chunk's fp32 logits within a fixed budget) mean the (N, V) logits never exist; the backward
recomputes each chunk's logits. See torch_flash/reference/linear_cross_entropy.py.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from .. import _dispatch
from ..reference import linear_cross_entropy as ref
from ._autograd import grad_or_empty
from ._checks import check, check_same_device, check_same_dtype, check_tensor
from .cross_entropy import (LossOptions, check_grad_loss, check_options, check_target,
                            check_target_values, loss_setup)


def check_args(op: str, hidden, weight, target, bias, opts: LossOptions, reduction: str,
               chunk_size: int) -> None:
    check_tensor(op, "hidden", hidden, min_ndim=1)
    check_tensor(op, "weight", weight, ndim=2)
    check(weight.shape[0] > 0, op, f"weight must have at least one row (class), got shape {tuple(weight.shape)}")
    check(weight.shape[1] == hidden.shape[-1], op,
          f"weight has shape {tuple(weight.shape)} (V, H) but hidden has hidden size {hidden.shape[-1]}")
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1)
        check(bias.shape[0] == weight.shape[0], op,
              f"bias has {bias.shape[0]} elements but weight has {weight.shape[0]} rows (classes)")
    check_same_dtype(op, hidden=hidden, weight=weight, bias=bias)
    check_target(op, target, hidden.shape[:-1], "hidden")
    check_options(op, opts, reduction)
    check(chunk_size >= 0, op, f"chunk_size must be >= 0 (0 picks it), got {chunk_size}")
    check_same_device(op, hidden=hidden, weight=weight, target=target, bias=bias)


def _backend(op: str, t: Tensor) -> str:
    # Only the reference path exists so far; select() still rejects a forced backend.
    return _dispatch.select(op, t.device, triton=False)


@triton_op("flash::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                          ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                          softcap: float = 0.0, reduction: str = "mean", chunk_size: int = 0) -> Tensor:
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    check_args("linear_cross_entropy", hidden, weight, target, bias, opts, reduction, chunk_size)
    _backend("linear_cross_entropy", hidden)
    check_target_values("linear_cross_entropy", target, weight.shape[0], ignore_index)
    return ref.linear_cross_entropy(hidden, weight, target, bias, opts, reduction, chunk_size)


@triton_op("flash::linear_cross_entropy_backward", mutates_args=())
def _linear_cross_entropy_backward(grad_loss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor,
                                   bias: Optional[Tensor], *, ignore_index: int = -100,
                                   label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float = 0.0,
                                   reduction: str = "mean",
                                   chunk_size: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """(dhidden, dweight, dbias); dbias is empty when there is no bias."""
    op = "linear_cross_entropy_backward"
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    check_args(op, hidden, weight, target, bias, opts, reduction, chunk_size)
    check_grad_loss(op, grad_loss, target, reduction)
    _backend(op, hidden)
    check_target_values(op, target, weight.shape[0], ignore_index)
    dh, dw, db = ref.linear_cross_entropy_backward(grad_loss, hidden, weight, target, bias, opts,
                                                   reduction, chunk_size)
    return dh, dw, grad_or_empty(db, weight)


def _setup(ctx, inputs, keyword_only_inputs, output):
    hidden, weight, target, bias = inputs
    ctx.save_for_backward(hidden, weight, target, bias)
    loss_setup(ctx, keyword_only_inputs)
    ctx.chunk_size = keyword_only_inputs["chunk_size"]


def _backward(ctx, grad_loss):
    hidden, weight, target, bias = ctx.saved_tensors
    dh, dw, db = torch.ops.flash.linear_cross_entropy_backward(
        grad_loss, hidden, weight, target, bias, **ctx.options, chunk_size=ctx.chunk_size)
    return dh, dw, None, (db if bias is not None else None)


_linear_cross_entropy.register_autograd(_backward, setup_context=_setup)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                         softcap: float = 0.0, reduction: str = "mean",
                         chunk_size: Optional[int] = None) -> Tensor:
    """cross_entropy(hidden @ weight.T + bias, target) without materialising the logits.

    hidden (..., H), weight (V, H) as nn.Linear's, bias (V,) or None, target (...) class
    indices; options, output shape and dtype as torch_flash.cross_entropy. Tokens are
    processed chunk_size rows at a time (None: picked so a chunk's fp32 logits stay
    within a fixed memory budget). Gradients for hidden, weight and bias.
    """
    return torch.ops.flash.linear_cross_entropy(
        hidden, weight, target, bias, ignore_index=ignore_index, label_smoothing=label_smoothing,
        z_loss=z_loss, softcap=softcap, reduction=reduction, chunk_size=chunk_size or 0)
