"""Fakes for flash.layer_norm, flash.add_layer_norm and their backward ops."""
import torch

from torch_flash.ops.layer_norm import check_args


def _param_grad(param, like):
    return like.new_empty(0) if param is None else torch.empty_like(param)


@torch.library.register_fake("flash::layer_norm")
def layer_norm(x, weight=None, bias=None, eps=1e-5, *, weight_offset=0.0):
    check_args("layer_norm", x, weight, bias, eps)
    return torch.empty_like(x)


@torch.library.register_fake("flash::layer_norm_backward")
def layer_norm_backward(grad_y, x, weight, bias, eps, weight_offset):
    return torch.empty_like(x), _param_grad(weight, x), _param_grad(bias, x)


@torch.library.register_fake("flash::add_layer_norm")
def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, *, weight_offset=0.0,
                   residual_in_fp32=False):
    check_args("add_layer_norm", x, weight, bias, eps, residual)
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.float32 if residual_in_fp32 else x.dtype)


@torch.library.register_fake("flash::add_layer_norm_backward")
def add_layer_norm_backward(grad_y, grad_residual_out, residual_out, weight, bias, eps, weight_offset):
    return torch.empty_like(residual_out), _param_grad(weight, residual_out), _param_grad(bias, residual_out)
