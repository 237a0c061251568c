"""flash.rms_norm and flash.add_rms_norm: schemas, dispatch, autograd, public functions.

Shapes: x (..., N), weight (N,) or None, residual like x. Statistics in fp32; see
torch_flash/reference/rms_norm.py for the exact dtype rules (LLaMA vs Gemma).
The backward recomputes the per-row rstd from x instead of saving it: the backward
reads x anyway, so this costs no memory traffic and keeps the schema a single output.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..reference import rms_norm as ref
from ._autograd import call, grad_or_empty, triton_op
from ._checks import FLOAT_DTYPES, check
from ._norm import check_args, check_grads, laid_out_like, triton_backward, triton_forward


def check_backward_args(op: str, grad_y, grad_residual_out, x, weight, eps, x_name: str = "x",
                        x_dtype: Optional[torch.dtype] = None) -> None:
    """x_dtype: add_rms_norm_backward's dtype of the forward's x, that xhat was rounded to (an
    integer one would round xhat silently into a wrong dweight)."""
    check_args(op, x, weight, eps)
    check_grads(op, grad_y, grad_residual_out, x, x_name)
    if x_dtype is not None:
        check(x_dtype in FLOAT_DTYPES, op, f"x_dtype must be a floating dtype, got {x_dtype}")


def y_dtype(x_dtype: torch.dtype, weight, cast_before_weight: bool,
            out_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """dtype of y: out_dtype where given, else the model's own rule (see the reference)."""
    if out_dtype is not None:
        return out_dtype
    if weight is not None and cast_before_weight:
        return torch.promote_types(x_dtype, weight.dtype)
    return x_dtype


@triton_op("flash::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, *,
              weight_offset: float = 0.0, cast_before_weight: bool = True,
              out_dtype: Optional[torch.dtype] = None) -> Tensor:
    fused = triton_forward("rms_norm", lambda: check_args("rms_norm", x, weight, eps, out_dtype=out_dtype),
                           x, weight, None, None, eps=eps, is_rms=True,
                           weight_offset=weight_offset, cast_before_weight=cast_before_weight,
                           residual_in_fp32=False, out_dtype=out_dtype)
    if fused is not None:
        return fused[0]
    y = ref.rms_norm(x, weight, eps, weight_offset, cast_before_weight)
    return y.to(out_dtype or y.dtype)


@triton_op("flash::rms_norm_backward", mutates_args=())
def _rms_norm_backward(grad_y: Tensor, x: Tensor, weight: Optional[Tensor], eps: float,
                       weight_offset: float, cast_before_weight: bool) -> tuple[Tensor, Tensor]:
    grads = triton_backward("rms_norm_backward",
                            lambda: check_backward_args("rms_norm_backward", grad_y, None, x, weight, eps),
                            grad_y, None, x, weight, None, eps=eps, is_rms=True,
                            weight_offset=weight_offset, cast_before_weight=cast_before_weight,
                            out_dtype=x.dtype)
    if grads is not None:
        dx, dw = grads[:2]
    else:
        dx, dw = ref.rms_norm_backward(grad_y, x, weight, eps, weight_offset, cast_before_weight)
        dx = laid_out_like(x, dx)
    return dx, grad_or_empty(dw, x)


@triton_op("flash::add_rms_norm", mutates_args=())
def _add_rms_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, *,
                  weight_offset: float = 0.0, cast_before_weight: bool = True,
                  residual_in_fp32: bool = False, out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    fused = triton_forward("add_rms_norm", lambda: check_args("add_rms_norm", x, weight, eps, residual, out_dtype),
                           x, weight, None, residual, eps=eps, is_rms=True,
                           weight_offset=weight_offset, cast_before_weight=cast_before_weight,
                           residual_in_fp32=residual_in_fp32, out_dtype=out_dtype)
    if fused is not None:
        return fused
    y, residual_out = ref.add_rms_norm(x, residual, weight, eps, weight_offset, cast_before_weight,
                                       residual_in_fp32)
    return laid_out_like(x, y, out_dtype or y.dtype), laid_out_like(x, residual_out, residual_out.dtype)


@triton_op("flash::add_rms_norm_backward", mutates_args=())
def _add_rms_norm_backward(grad_y: Tensor, grad_residual_out: Optional[Tensor], residual_out: Tensor,
                           weight: Optional[Tensor], eps: float, weight_offset: float,
                           cast_before_weight: bool, x_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Returns (d(x + residual), dweight); the caller casts the first to x's and residual's dtypes."""
    def check():
        check_backward_args("add_rms_norm_backward", grad_y, grad_residual_out, residual_out, weight, eps,
                            "residual_out", x_dtype)
    grads = triton_backward("add_rms_norm_backward", check, grad_y, grad_residual_out, residual_out, weight,
                            None, eps=eps, is_rms=True, weight_offset=weight_offset,
                            cast_before_weight=cast_before_weight, out_dtype=x_dtype)
    if grads is not None:
        dsum, dw = grads[:2]
    else:
        dsum, dw = ref.rms_norm_backward(grad_y, residual_out, weight, eps, weight_offset,
                                         cast_before_weight, out_dtype=x_dtype)
        if grad_residual_out is not None:
            dsum = dsum + grad_residual_out
        dsum = laid_out_like(residual_out, dsum)
    return dsum, grad_or_empty(dw, residual_out)


def _rms_setup(ctx, inputs, keyword_only_inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps
    ctx.weight_offset = keyword_only_inputs["weight_offset"]
    ctx.cast_before_weight = keyword_only_inputs["cast_before_weight"]


def _rms_backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    dx, dw = call("rms_norm_backward", grad_y, x, weight, ctx.eps, ctx.weight_offset,
                  ctx.cast_before_weight)
    return dx, (dw if weight is not None else None), None


def _add_rms_setup(ctx, inputs, keyword_only_inputs, output):
    x, residual, weight, eps = inputs
    _, residual_out = output
    ctx.save_for_backward(residual_out, weight)
    ctx.eps = eps
    ctx.weight_offset = keyword_only_inputs["weight_offset"]
    ctx.cast_before_weight = keyword_only_inputs["cast_before_weight"]
    ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype


def _add_rms_backward(ctx, grad_y, grad_residual_out):
    residual_out, weight = ctx.saved_tensors
    dsum, dw = call("add_rms_norm_backward",
                    grad_y, grad_residual_out, residual_out, weight, ctx.eps, ctx.weight_offset,
                    ctx.cast_before_weight, ctx.x_dtype)
    return dsum.to(ctx.x_dtype), dsum.to(ctx.residual_dtype), (dw if weight is not None else None), None


_rms_norm.register_autograd(_rms_backward, setup_context=_rms_setup)
_add_rms_norm.register_autograd(_add_rms_backward, setup_context=_add_rms_setup)


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, *,
             weight_offset: float = 0.0, cast_before_weight: bool = True,
             out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """RMSNorm over the last dimension of x (..., N).

    weight_offset=1.0 gives Gemma's (1 + w). cast_before_weight=True follows HF LLaMA
    (normalise in fp32, cast to x.dtype, then multiply by w); False follows Gemma
    (multiply in fp32, then cast). Returns a tensor shaped like x, cast to out_dtype if given
    (written so by the kernel where y is fp32: autocast's fp32 residual stream feeding bf16
    matmuls needs no cast pass).
    """
    return call("rms_norm", x, weight, eps, weight_offset=weight_offset,
                cast_before_weight=cast_before_weight, out_dtype=out_dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, *,
                 weight_offset: float = 0.0, cast_before_weight: bool = True,
                 residual_in_fp32: bool = False, out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """Pre-norm residual block: returns (rms_norm(x + residual), x + residual).

    The sum is returned in x's dtype, or fp32 with residual_in_fp32=True (and the norm
    then reads the fp32 sum). One pass over memory instead of an add and a norm. residual may
    have another float dtype than x. out_dtype: as in rms_norm.
    """
    return call("add_rms_norm", x, residual, weight, eps, weight_offset=weight_offset,
                cast_before_weight=cast_before_weight,
                residual_in_fp32=residual_in_fp32, out_dtype=out_dtype)
