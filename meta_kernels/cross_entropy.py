"""Fakes for flash.cross_entropy, its backward ops and its vocab-parallel statistics."""
import torch

from torch_flash.ops.cross_entropy import (LossOptions, check_args, check_backward_args, check_inplace_layout,
                                           check_shard, loss_shape)
from torch_flash.reference._common import compute_dtype


@torch.library.register_fake("flash::cross_entropy")
def cross_entropy(logits, target, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                  softcap=0.0, reduction="mean", inplace_backward=False):
    check_args("cross_entropy", logits, target,
               LossOptions(ignore_index, label_smoothing, z_loss, softcap), reduction)
    if inplace_backward:
        check_inplace_layout("cross_entropy", logits)
    return logits.new_empty(loss_shape(target, reduction), dtype=compute_dtype(logits.dtype))


@torch.library.register_fake("flash::cross_entropy_with_lse")
def cross_entropy_with_lse(logits, target, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                           softcap=0.0, reduction="mean"):
    loss = cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                         z_loss=z_loss, softcap=softcap, reduction=reduction)
    return loss, logits.new_empty(target.shape, dtype=compute_dtype(logits.dtype))


def _check_backward(op, grad_loss, logits, target, lse, ignore_index, label_smoothing, z_loss, softcap,
                    reduction, vocab_start, vocab_size):
    check_backward_args(op, grad_loss, logits, target, lse,
                        LossOptions(ignore_index, label_smoothing, z_loss, softcap), reduction,
                        vocab_start, vocab_size)


@torch.library.register_fake("flash::cross_entropy_backward")
def cross_entropy_backward(grad_loss, logits, target, lse=None, *, ignore_index=-100, label_smoothing=0.0,
                           z_loss=0.0, softcap=0.0, reduction="mean", vocab_start=0, vocab_size=None):
    _check_backward("cross_entropy_backward", grad_loss, logits, target, lse, ignore_index, label_smoothing,
                    z_loss, softcap, reduction, vocab_start, vocab_size)
    return logits.new_empty(logits.shape)


@torch.library.register_fake("flash::cross_entropy_backward_inplace")
def cross_entropy_backward_inplace(grad_loss, logits, target, lse=None, *, ignore_index=-100,
                                   label_smoothing=0.0, z_loss=0.0, softcap=0.0, reduction="mean",
                                   vocab_start=0, vocab_size=None):
    op = "cross_entropy_backward_inplace"
    check_inplace_layout(op, logits)
    _check_backward(op, grad_loss, logits, target, lse, ignore_index, label_smoothing, z_loss, softcap,
                    reduction, vocab_start, vocab_size)


@torch.library.register_fake("flash::cross_entropy_shard_stats")
def cross_entropy_shard_stats(logits, target, *, vocab_start=0, vocab_size=None, ignore_index=-100,
                              softcap=0.0):
    op = "cross_entropy_shard_stats"
    check_args(op, logits, target, LossOptions(ignore_index=ignore_index, softcap=softcap), "none")
    check_shard(op, logits, vocab_start, vocab_size)
    return tuple(logits.new_empty(target.shape, dtype=compute_dtype(logits.dtype)) for _ in range(3))
