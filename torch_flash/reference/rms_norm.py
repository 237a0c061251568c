"""Plain-PyTorch RMSNorm: the formula the kernels and the compile-pass patterns follow.

y = xhat * (w + weight_offset), xhat = x * rsqrt(mean(x^2, -1) + eps), statistics in fp32.
cast_before_weight=True (HF LLaMA, T5): xhat is cast to x.dtype, then multiplied by the
weight in the promoted dtype of x and w. False (Gemma): the product is taken in fp32
and cast to x.dtype. These functions are differentiable and double as the CPU path.
"""
from __future__ import annotations

import torch

from ._common import compute_dtype, reduce_leading


def _rstd(xf: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _normalize(xf, out_dtype, weight, eps, weight_offset, cast_before_weight):
    xhat = xf * _rstd(xf, eps)
    if weight is None:
        return xhat.to(out_dtype)
    if cast_before_weight:
        return xhat.to(out_dtype) * (weight + weight_offset)
    return (xhat * (weight.to(xf.dtype) + weight_offset)).to(out_dtype)


def rms_norm(x, weight=None, eps=1e-6, weight_offset=0.0, cast_before_weight=True):
    return _normalize(x.to(compute_dtype(x.dtype)), x.dtype, weight, eps, weight_offset,
                      cast_before_weight)


def add_rms_norm(x, residual, weight=None, eps=1e-6, weight_offset=0.0,
                 cast_before_weight=True, residual_in_fp32=False):
    """(rms_norm(x + residual), x + residual); the sum is stored in fp32 on request, and
    y is in x's dtype either way (normalised from the sum as stored)."""
    cdt = compute_dtype(x.dtype, residual.dtype)
    residual_out = (x.to(cdt) + residual.to(cdt)).to(torch.float32 if residual_in_fp32 else x.dtype)
    y = _normalize(residual_out.to(cdt), x.dtype, weight, eps, weight_offset, cast_before_weight)
    return y, residual_out


def rms_norm_backward(grad_y, x, weight, eps, weight_offset, cast_before_weight, out_dtype=None):
    """(dx, dweight) of rms_norm (dweight None without a weight); dx in the compute dtype.

    out_dtype is the dtype xhat was rounded to before the weight product (x.dtype for
    rms_norm; add_rms_norm normalises an fp32 sum but rounds to the input's dtype)."""
    cdt = compute_dtype(x.dtype, grad_y.dtype)
    xf = x.to(cdt)
    rstd = _rstd(xf, eps)
    xhat = xf * rstd
    g = grad_y.to(cdt)
    dxhat = g if weight is None else g * (weight.to(cdt) + weight_offset)
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    dw = None
    if weight is not None:
        # the weight multiplied xhat as rounded to out_dtype, so its gradient uses that
        h = xhat.to(out_dtype or x.dtype).to(cdt) if cast_before_weight else xhat
        dw = reduce_leading(g * h, x.shape[-1]).to(weight.dtype)
    return dx, dw
