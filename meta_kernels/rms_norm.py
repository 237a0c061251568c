"""Fakes for flash.rms_norm, flash.add_rms_norm and their backward ops."""
import torch

from torch_flash.ops.rms_norm import check_args, check_backward_args, y_dtype


@torch.library.register_fake("flash::rms_norm")
def rms_norm(x, weight=None, eps=1e-6, *, weight_offset=0.0, cast_before_weight=True, out_dtype=None):
    check_args("rms_norm", x, weight, eps, out_dtype=out_dtype)
    return torch.empty_like(x, dtype=y_dtype(x.dtype, weight, cast_before_weight, out_dtype))


@torch.library.register_fake("flash::rms_norm_backward")
def rms_norm_backward(grad_y, x, weight, eps, weight_offset, cast_before_weight):
    check_backward_args("rms_norm_backward", grad_y, None, x, weight, eps)
    return torch.empty_like(x), x.new_empty(0) if weight is None else torch.empty_like(weight)


@torch.library.register_fake("flash::add_rms_norm")
def add_rms_norm(x, residual, weight=None, eps=1e-6, *, weight_offset=0.0,
                 cast_before_weight=True, residual_in_fp32=False, out_dtype=None):
    check_args("add_rms_norm", x, weight, eps, residual, out_dtype)
    y = torch.empty_like(x, dtype=y_dtype(x.dtype, weight, cast_before_weight, out_dtype))
    return y, torch.empty_like(x, dtype=torch.float32 if residual_in_fp32 else x.dtype)


@torch.library.register_fake("flash::add_rms_norm_backward")
def add_rms_norm_backward(grad_y, grad_residual_out, residual_out, weight, eps, weight_offset,
                          cast_before_weight, x_dtype):
    check_backward_args("add_rms_norm_backward", grad_y, grad_residual_out, residual_out, weight, eps,
                        "residual_out", x_dtype)
    dw = residual_out.new_empty(0) if weight is None else torch.empty_like(weight)
    return torch.empty_like(residual_out), dw
