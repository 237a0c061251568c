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
from ._autograd import (ARG, DTYPE_OF, GRAD, GRAD_OR_NONE, SAVED, Spec, Src, call, grad_or_empty,
                        register_autograd_spec, triton_op)
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


register_autograd_spec(_rms_norm, Spec(
    save=("x", "weight"),
    backward="rms_norm_backward",
    backward_args=(Src(GRAD, 0), Src(SAVED, 0), Src(SAVED, 1), Src(ARG, "eps"), Src(ARG, "weight_offset"),
                   Src(ARG, "cast_before_weight")),
    grads=(("x", 0, None), ("weight", 1, None))))
# the sum's gradient reaches x and residual, each in its own dtype
register_autograd_spec(_add_rms_norm, Spec(
    outputs=(0, 1),
    save=(1, "weight"),
    backward="add_rms_norm_backward",
    backward_args=(Src(GRAD, 0), Src(GRAD_OR_NONE, 1), Src(SAVED, 0), Src(SAVED, 1), Src(ARG, "eps"),
                   Src(ARG, "weight_offset"), Src(ARG, "cast_before_weight"), Src(DTYPE_OF, "x")),
    grads=(("x", 0, "x"), ("residual", 0, "residual"), ("weight", 1, None))))


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
