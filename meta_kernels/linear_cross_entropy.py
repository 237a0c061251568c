"""Fakes for flash.linear_cross_entropy, flash.linear_cross_entropy_backward,
flash.linear_cross_entropy_with_grads and flash.linear_cross_entropy_scale_."""
import torch

from torch_flash.ops.cross_entropy import LossOptions, check_grad_loss, loss_shape
from torch_flash.ops._checks import check
from torch_flash.ops.linear_cross_entropy import check_args, check_scale_args
from torch_flash.reference._common import compute_dtype


@torch.library.register_fake("flash::linear_cross_entropy")
def linear_cross_entropy(hidden, weight, target, bias=None, *, ignore_index=-100, label_smoothing=0.0,
                         z_loss=0.0, softcap=0.0, reduction="mean", chunk_size=0):
    check_args("linear_cross_entropy", hidden, weight, target, bias,
               LossOptions(ignore_index, label_smoothing, z_loss, softcap), reduction, chunk_size)
    return hidden.new_empty(loss_shape(target, reduction), dtype=compute_dtype(hidden.dtype))


def _grads(hidden, weight, bias, *wanted):
    """(dhidden, dweight, dbias) as the ops return them: empty where not wanted or no bias."""
    return tuple(hidden.new_empty(0) if t is None or not want else t.new_empty(t.shape)
                 for t, want in zip((hidden, weight, bias), wanted))


@torch.library.register_fake("flash::linear_cross_entropy_backward")
def linear_cross_entropy_backward(grad_loss, hidden, weight, target, bias, *, ignore_index=-100,
                                  label_smoothing=0.0, z_loss=0.0, softcap=0.0, reduction="mean",
                                  chunk_size=0, grad_hidden=True, grad_weight=True, grad_bias=True,
                                  check_targets=True):
    op = "linear_cross_entropy_backward"
    check_args(op, hidden, weight, target, bias,
               LossOptions(ignore_index, label_smoothing, z_loss, softcap), reduction, chunk_size)
    check_grad_loss(op, grad_loss, target, reduction)
    return _grads(hidden, weight, bias, grad_hidden, grad_weight, grad_bias)


@torch.library.register_fake("flash::linear_cross_entropy_with_grads")
def linear_cross_entropy_with_grads(hidden, weight, target, bias=None, *, ignore_index=-100,
                                    label_smoothing=0.0, z_loss=0.0, softcap=0.0, reduction="mean",
                                    chunk_size=0, grad_hidden=True, grad_weight=True, grad_bias=True,
                                    check_targets=True):
    check(reduction != "none", "linear_cross_entropy_with_grads",
          "reduction='none' needs the per-row gradient: use the backward op")
    loss = linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index,
                                label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                                reduction=reduction, chunk_size=chunk_size)
    return loss, *_grads(hidden, weight, bias, grad_hidden, grad_weight, grad_bias)


@torch.library.register_fake("flash::linear_cross_entropy_scale_")
def linear_cross_entropy_scale_(grad, grad_loss):
    check_scale_args("linear_cross_entropy_scale_", grad, grad_loss)
