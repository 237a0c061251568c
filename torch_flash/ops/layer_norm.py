"""flash.layer_norm and flash.add_layer_norm: schemas, dispatch, autograd, public functions.

Shapes: x (..., N), weight and bias (N,) or None, residual like x. Statistics and affine
in fp32, y in x's dtype (torch_flash/reference/layer_norm.py has the formula). As for
rms_norm, the backward recomputes mean and rstd from x instead of saving them.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from ..reference import layer_norm as ref
from ._autograd import grad_or_empty
from ._checks import check, check_same_device, check_tensor
from .rms_norm import triton_backward, triton_forward
from .rms_norm import check_args as _check_x_weight_residual


def check_args(op: str, x, weight, bias, eps, residual=None) -> None:
    _check_x_weight_residual(op, x, weight, eps, residual)
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1)
        check(bias.shape[0] == x.shape[-1], op,
              f"bias has {bias.shape[0]} elements but x has hidden size {x.shape[-1]}")
        check_same_device(op, x=x, bias=bias)


@triton_op("flash::layer_norm", mutates_args=())
def _layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                eps: float = 1e-5, *, weight_offset: float = 0.0) -> Tensor:
    check_args("layer_norm", x, weight, bias, eps)
    fused = triton_forward("layer_norm", x, weight, bias, None, eps=eps, is_rms=False,
                           weight_offset=weight_offset, cast_before_weight=False, residual_in_fp32=False)
    if fused is not None:
        return fused[0]
    return ref.layer_norm(x, weight, bias, eps, weight_offset)


@triton_op("flash::layer_norm_backward", mutates_args=())
def _layer_norm_backward(grad_y: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                         eps: float, weight_offset: float) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (dx, dweight, dbias); dweight/dbias are empty where weight/bias is None."""
    grads = triton_backward("layer_norm_backward", grad_y, None, x, weight, bias, eps=eps, is_rms=False,
                            weight_offset=weight_offset, cast_before_weight=False, out_dtype=x.dtype)
    dx, dw, db = grads if grads is not None else ref.layer_norm_backward(grad_y, x, weight, bias, eps,
                                                                         weight_offset)
    return dx.to(x.dtype), grad_or_empty(dw, x), grad_or_empty(db, x)


@triton_op("flash::add_layer_norm", mutates_args=())
def _add_layer_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor] = None,
                    bias: Optional[Tensor] = None, eps: float = 1e-5, *, weight_offset: float = 0.0,
                    residual_in_fp32: bool = False) -> tuple[Tensor, Tensor]:
    check_args("add_layer_norm", x, weight, bias, eps, residual)
    fused = triton_forward("add_layer_norm", x, weight, bias, residual, eps=eps, is_rms=False,
                           weight_offset=weight_offset, cast_before_weight=False,
                           residual_in_fp32=residual_in_fp32)
    if fused is not None:
        return fused
    return ref.add_layer_norm(x, residual, weight, bias, eps, weight_offset, residual_in_fp32)


@triton_op("flash::add_layer_norm_backward", mutates_args=())
def _add_layer_norm_backward(grad_y: Tensor, grad_residual_out: Optional[Tensor], residual_out: Tensor,
                             weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                             weight_offset: float) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (d(x + residual), dweight, dbias); the caller casts the first to x's and
    residual's dtypes."""
    grads = triton_backward("add_layer_norm_backward", grad_y, grad_residual_out, residual_out, weight,
                            bias, eps=eps, is_rms=False, weight_offset=weight_offset,
                            cast_before_weight=False, out_dtype=grad_y.dtype)
    if grads is not None:
        dsum, dw, db = grads
    else:
        dsum, dw, db = ref.layer_norm_backward(grad_y, residual_out, weight, bias, eps, weight_offset)
        if grad_residual_out is not None:
            dsum = dsum + grad_residual_out
    return dsum.to(residual_out.dtype), grad_or_empty(dw, residual_out), grad_or_empty(db, residual_out)


def _present(grad: Tensor, param: Optional[Tensor]) -> Optional[Tensor]:
    return None if param is None else grad


def _ln_setup(ctx, inputs, keyword_only_inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.eps = eps
    ctx.weight_offset = keyword_only_inputs["weight_offset"]


def _ln_backward(ctx, grad_y):
    x, weight, bias = ctx.saved_tensors
    dx, dw, db = torch.ops.flash.layer_norm_backward(grad_y, x, weight, bias, ctx.eps, ctx.weight_offset)
    return dx, _present(dw, weight), _present(db, bias), None


def _add_ln_setup(ctx, inputs, keyword_only_inputs, output):
    x, residual, weight, bias, eps = inputs
    _, residual_out = output
    ctx.save_for_backward(residual_out, weight, bias)
    ctx.eps = eps
    ctx.weight_offset = keyword_only_inputs["weight_offset"]
    ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype


def _add_ln_backward(ctx, grad_y, grad_residual_out):
    residual_out, weight, bias = ctx.saved_tensors
    dsum, dw, db = torch.ops.flash.add_layer_norm_backward(
        grad_y, grad_residual_out, residual_out, weight, bias, ctx.eps, ctx.weight_offset)
    return (dsum.to(ctx.x_dtype), dsum.to(ctx.residual_dtype), _present(dw, weight), _present(db, bias),
            None)


_layer_norm.register_autograd(_ln_backward, setup_context=_ln_setup)
_add_layer_norm.register_autograd(_add_ln_backward, setup_context=_add_ln_setup)


def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5, *, weight_offset: float = 0.0) -> Tensor:
    """LayerNorm over the last dimension of x (..., N), as F.layer_norm(x, (N,), weight, bias, eps).

    weight_offset adds a constant to the weight (1.0 for models that store w - 1).
    Returns a tensor shaped like x, in x's dtype.
    """
    return torch.ops.flash.layer_norm(x, weight, bias, eps, weight_offset=weight_offset)


def add_layer_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor] = None,
                   bias: Optional[Tensor] = None, eps: float = 1e-5, *, weight_offset: float = 0.0,
                   residual_in_fp32: bool = False) -> tuple[Tensor, Tensor]:
    """Pre-norm residual block: returns (layer_norm(x + residual), x + residual).

    The sum is returned in x's dtype, or fp32 with residual_in_fp32=True (and the norm
    then reads the fp32 sum). One pass over memory instead of an add and a norm.
    """
    return torch.ops.flash.add_layer_norm(x, residual, weight, bias, eps, weight_offset=weight_offset,
                                          residual_in_fp32=residual_in_fp32)
