"""flash.layer_norm and flash.add_layer_norm: schemas, dispatch, autograd, public functions.

Shapes: x (..., N), weight and bias (N,) or None, residual like x. Statistics and affine
in fp32, y in x's dtype (torch_flash/reference/layer_norm.py has the formula). With a
gradient needed, the forward runs the internal flash.(add_)layer_norm_with_stats, which also
returns each row's fp32 mean and rstd (M floats each), and the backward ops take them, so
that the Triton backward needs one cross-warp reduction round per row tile instead of two
(the mean's, then the row sums'). Without them the backward ops recompute the statistics.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..reference import layer_norm as ref
from ._autograd import (ARG, GRAD, GRAD_OR_NONE, SAVED, Spec, Src, call, grad_or_empty, register_autograd_spec,
                        triton_op)
from ._checks import check, check_same_device, check_tensor
from ._norm import check_args as _check_x_weight_residual
from ._norm import check_grads, laid_out_like, triton_backward, triton_forward


def check_args(op: str, x, weight, bias, eps, residual=None, out_dtype=None) -> None:
    _check_x_weight_residual(op, x, weight, eps, residual, out_dtype)
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1)
        check(bias.shape[0] == x.shape[-1], op,
              f"bias has {bias.shape[0]} elements but x has hidden size {x.shape[-1]}")
        check_same_device(op, x=x, bias=bias)


def check_backward_args(op: str, grad_y, grad_residual_out, x, weight, bias, eps, mean, rstd,
                        x_name: str = "x") -> None:
    """The backward ops' arguments (x: residual_out in the add variant): as the forward's, the
    upstream gradients shaped like x, the forward's statistics if given."""
    check_args(op, x, weight, bias, eps)
    check_grads(op, grad_y, grad_residual_out, x, x_name)
    check_stats(op, x, mean, rstd)


def check_stats(op: str, x, mean, rstd) -> None:
    """mean and rstd (the forward's, for the backward): both or neither, fp32, x.shape[:-1]."""
    check((mean is None) == (rstd is None), op, "mean and rstd must be given together or not at all")
    if rstd is None:
        return
    for name, t in (("mean", mean), ("rstd", rstd)):
        check_tensor(op, name, t, dtypes=(torch.float32,))
        check(t.shape == x.shape[:-1], op,
              f"{name} has shape {tuple(t.shape)}, expected x's shape without the last dim {tuple(x.shape[:-1])}")
    check_same_device(op, x=x, mean=mean, rstd=rstd)


def _forward(op: str, x, residual, weight, bias, eps, weight_offset, residual_in_fp32, stats: bool, out_dtype):
    """(y, residual_out or None), plus (mean, rstd) with stats, on the path select() picks."""
    fused = triton_forward(op, lambda: check_args(op, x, weight, bias, eps, residual, out_dtype),
                           x, weight, bias, residual, eps=eps, is_rms=False, weight_offset=weight_offset,
                           cast_before_weight=False, residual_in_fp32=residual_in_fp32, stats=stats,
                           out_dtype=out_dtype)
    if fused is not None:
        return fused
    if residual is None:
        y, *rest = ref.layer_norm_with_stats(x, weight, bias, eps, weight_offset)
        y = y.to(out_dtype or y.dtype)
        return (y, None, *rest) if stats else (y, None)
    y, ro, *rest = ref.add_layer_norm_with_stats(x, residual, weight, bias, eps, weight_offset, residual_in_fp32)
    y, ro = laid_out_like(x, y, out_dtype), laid_out_like(x, ro, ro.dtype)
    return (y, ro, *rest) if stats else (y, ro)


@triton_op("flash::layer_norm", mutates_args=())
def _layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                eps: float = 1e-5, *, weight_offset: float = 0.0, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    return _forward("layer_norm", x, None, weight, bias, eps, weight_offset, False, False, out_dtype)[0]


@triton_op("flash::layer_norm_with_stats", mutates_args=())
def _layer_norm_with_stats(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                           eps: float = 1e-5, *, weight_offset: float = 0.0,
                           out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd): flash.layer_norm and each row's fp32 statistics (x.shape[:-1]) as the
    forward used them, for flash.layer_norm_backward (the autograd forward of flash.layer_norm)."""
    y, _, mean, rstd = _forward("layer_norm_with_stats", x, None, weight, bias, eps, weight_offset, False, True,
                                out_dtype)
    return y, mean, rstd


def _backward(op: str, grad_y, grad_residual_out, x, weight, bias, eps, weight_offset, mean, rstd):
    """(dx + grad_residual_out, dweight or None, dbias or None), dx in x's dtype and layout.
    The reference recomputes the statistics (exact in fp64, where fp32 stats would not be)."""
    def check():
        check_backward_args(op, grad_y, grad_residual_out, x, weight, bias, eps, mean, rstd,
                            "residual_out" if op.startswith("add_") else "x")
    grads = triton_backward(op, check, grad_y, grad_residual_out, x, weight, bias, mean, rstd, eps=eps,
                            is_rms=False, weight_offset=weight_offset, cast_before_weight=False,
                            out_dtype=x.dtype)
    if grads is not None:
        return grads
    dx, dw, db = ref.layer_norm_backward(grad_y, x, weight, bias, eps, weight_offset)
    return laid_out_like(x, dx if grad_residual_out is None else dx + grad_residual_out), dw, db


@triton_op("flash::layer_norm_backward", mutates_args=())
def _layer_norm_backward(grad_y: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                         eps: float, weight_offset: float, mean: Optional[Tensor] = None,
                         rstd: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (dx, dweight, dbias); dweight/dbias are empty where weight/bias is None. mean and
    rstd: flash.layer_norm_with_stats's, or None to recompute them from x."""
    dx, dw, db = _backward("layer_norm_backward", grad_y, None, x, weight, bias, eps, weight_offset, mean, rstd)
    return dx, grad_or_empty(dw, x), grad_or_empty(db, x)


@triton_op("flash::add_layer_norm", mutates_args=())
def _add_layer_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor] = None,
                    bias: Optional[Tensor] = None, eps: float = 1e-5, *, weight_offset: float = 0.0,
                    residual_in_fp32: bool = False, out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    return _forward("add_layer_norm", x, residual, weight, bias, eps, weight_offset, residual_in_fp32, False,
                    out_dtype)


@triton_op("flash::add_layer_norm_with_stats", mutates_args=())
def _add_layer_norm_with_stats(x: Tensor, residual: Tensor, weight: Optional[Tensor] = None,
                               bias: Optional[Tensor] = None, eps: float = 1e-5, *, weight_offset: float = 0.0,
                               residual_in_fp32: bool = False,
                               out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, residual_out, mean, rstd): flash.add_layer_norm and the fp32 statistics of each row of
    residual_out (x.shape[:-1]), for flash.add_layer_norm_backward."""
    return _forward("add_layer_norm_with_stats", x, residual, weight, bias, eps, weight_offset,
                    residual_in_fp32, True, out_dtype)


@triton_op("flash::add_layer_norm_backward", mutates_args=())
def _add_layer_norm_backward(grad_y: Tensor, grad_residual_out: Optional[Tensor], residual_out: Tensor,
                             weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                             weight_offset: float, mean: Optional[Tensor] = None,
                             rstd: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (d(x + residual), dweight, dbias); the caller casts the first to x's and
    residual's dtypes. mean and rstd: flash.add_layer_norm_with_stats's, or None."""
    dsum, dw, db = _backward("add_layer_norm_backward", grad_y, grad_residual_out, residual_out, weight, bias,
                             eps, weight_offset, mean, rstd)
    return dsum, grad_or_empty(dw, residual_out), grad_or_empty(db, residual_out)


# with a gradient, the forward keeps each row's statistics for the backward
register_autograd_spec(_layer_norm, Spec(
    forward="layer_norm_with_stats",
    save=("x", "weight", "bias", 1, 2),
    backward="layer_norm_backward",
    backward_args=(Src(GRAD, 0), Src(SAVED, 0), Src(SAVED, 1), Src(SAVED, 2), Src(ARG, "eps"),
                   Src(ARG, "weight_offset"), Src(SAVED, 3), Src(SAVED, 4)),
    grads=(("x", 0, None), ("weight", 1, None), ("bias", 2, None))))
register_autograd_spec(_add_layer_norm, Spec(
    forward="add_layer_norm_with_stats",
    outputs=(0, 1),
    save=(1, 2, 3, "weight", "bias"),
    backward="add_layer_norm_backward",
    backward_args=(Src(GRAD, 0), Src(GRAD_OR_NONE, 1), Src(SAVED, 0), Src(SAVED, 3), Src(SAVED, 4),
                   Src(ARG, "eps"), Src(ARG, "weight_offset"), Src(SAVED, 1), Src(SAVED, 2)),
    grads=(("x", 0, "x"), ("residual", 0, "residual"), ("weight", 1, None), ("bias", 2, None))))


def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5, *, weight_offset: float = 0.0, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """LayerNorm over the last dimension of x (..., N), as F.layer_norm(x, (N,), weight, bias, eps).

    weight_offset adds a constant to the weight (1.0 for models that store w - 1).
    Returns a tensor shaped like x, in x's dtype or cast to out_dtype (written so by the
    kernel where x is fp32: autocast's fp32 residual stream feeding bf16 matmuls).
    """
    return call("layer_norm", x, weight, bias, eps, weight_offset=weight_offset, out_dtype=out_dtype)


def add_layer_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor] = None,
                   bias: Optional[Tensor] = None, eps: float = 1e-5, *, weight_offset: float = 0.0,
                   residual_in_fp32: bool = False, out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """Pre-norm residual block: returns (layer_norm(x + residual), x + residual).

    The sum is returned in x's dtype, or fp32 with residual_in_fp32=True (and the norm
    then reads the fp32 sum). One pass over memory instead of an add and a norm. residual may
    have another float dtype than x. out_dtype: as in layer_norm.
    """
    return call("add_layer_norm", x, residual, weight, bias, eps, weight_offset=weight_offset,
                residual_in_fp32=residual_in_fp32, out_dtype=out_dtype)
