"""Fakes for flash.cross_entropy and flash.cross_entropy_backward."""
import torch

from torch_flash.ops.cross_entropy import LossOptions, check_args, check_grad_loss, loss_shape
from torch_flash.reference._common import compute_dtype


@torch.library.register_fake("flash::cross_entropy")
def cross_entropy(logits, target, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                  softcap=0.0, reduction="mean"):
    check_args("cross_entropy", logits, target,
               LossOptions(ignore_index, label_smoothing, z_loss, softcap), reduction)
    return logits.new_empty(loss_shape(target, reduction), dtype=compute_dtype(logits.dtype))


@torch.library.register_fake("flash::cross_entropy_with_lse")
def cross_entropy_with_lse(logits, target, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                           softcap=0.0, reduction="mean"):
    loss = cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                         z_loss=z_loss, softcap=softcap, reduction=reduction)
    return loss, logits.new_empty(target.shape, dtype=compute_dtype(logits.dtype))


@torch.library.register_fake("flash::cross_entropy_backward")
def cross_entropy_backward(grad_loss, logits, target, lse=None, *, ignore_index=-100, label_smoothing=0.0,
                           z_loss=0.0, softcap=0.0, reduction="mean"):
    op = "cross_entropy_backward"
    check_args(op, logits, target, LossOptions(ignore_index, label_smoothing, z_loss, softcap), reduction)
    check_grad_loss(op, grad_loss, target, reduction)
    return logits.new_empty(logits.shape)
