"""Fakes for flash.layer_norm, flash.add_layer_norm, their _with_stats forms and backward ops."""
import torch

from torch_flash.ops.layer_norm import check_args, check_backward_args


def _param_grad(param, like):
    return like.new_empty(0) if param is None else torch.empty_like(param)


def _stats(x):
    """Each row's fp32 mean and rstd."""
    return tuple(x.new_empty(x.shape[:-1], dtype=torch.float32) for _ in range(2))


@torch.library.register_fake("flash::layer_norm")
def layer_norm(x, weight=None, bias=None, eps=1e-5, *, weight_offset=0.0, out_dtype=None):
    check_args("layer_norm", x, weight, bias, eps, out_dtype=out_dtype)
    return torch.empty_like(x, dtype=out_dtype)


@torch.library.register_fake("flash::layer_norm_with_stats")
def layer_norm_with_stats(x, weight=None, bias=None, eps=1e-5, *, weight_offset=0.0, out_dtype=None):
    check_args("layer_norm_with_stats", x, weight, bias, eps, out_dtype=out_dtype)
    return torch.empty_like(x, dtype=out_dtype), *_stats(x)


@torch.library.register_fake("flash::layer_norm_backward")
def layer_norm_backward(grad_y, x, weight, bias, eps, weight_offset, mean=None, rstd=None):
    check_backward_args("layer_norm_backward", grad_y, None, x, weight, bias, eps, mean, rstd)
    return torch.empty_like(x), _param_grad(weight, x), _param_grad(bias, x)


def _add_outputs(op, x, residual, weight, bias, eps, residual_in_fp32, out_dtype):
    check_args(op, x, weight, bias, eps, residual, out_dtype)
    return (torch.empty_like(x, dtype=out_dtype),
            torch.empty_like(x, dtype=torch.float32 if residual_in_fp32 else x.dtype))


@torch.library.register_fake("flash::add_layer_norm")
def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, *, weight_offset=0.0,
                   residual_in_fp32=False, out_dtype=None):
    return _add_outputs("add_layer_norm", x, residual, weight, bias, eps, residual_in_fp32, out_dtype)


@torch.library.register_fake("flash::add_layer_norm_with_stats")
def add_layer_norm_with_stats(x, residual, weight=None, bias=None, eps=1e-5, *, weight_offset=0.0,
                              residual_in_fp32=False, out_dtype=None):
    return (*_add_outputs("add_layer_norm_with_stats", x, residual, weight, bias, eps, residual_in_fp32, out_dtype),
            *_stats(x))


@torch.library.register_fake("flash::add_layer_norm_backward")
def add_layer_norm_backward(grad_y, grad_residual_out, residual_out, weight, bias, eps, weight_offset,
                            mean=None, rstd=None):
    check_backward_args("add_layer_norm_backward", grad_y, grad_residual_out, residual_out, weight, bias, eps,
                        mean, rstd, "residual_out")
    return torch.empty_like(residual_out), _param_grad(weight, residual_out), _param_grad(bias, residual_out)
