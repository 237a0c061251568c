"""Plain-PyTorch LayerNorm: the formula the kernels and the compile-pass patterns follow.

y = (x - mean) * rstd * (w + weight_offset) + b over the last dim, rstd = rsqrt(var + eps)
with the biased variance. Statistics and affine in fp32 (fp64 stays fp64), y cast to
x.dtype once at the end, as F.layer_norm. These functions are differentiable and double
as the CPU path.
"""
from __future__ import annotations

import torch

from ._common import compute_dtype, reduce_leading


def _xhat(xf: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normalised x, mean, rstd) in xf's dtype; the statistics keep the reduced dim."""
    mean = xf.mean(-1, keepdim=True)
    xc = xf - mean
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return xc * rstd, mean, rstd


def _normalize(xf, out_dtype, weight, bias, eps, weight_offset):
    """(y, mean, rstd): y in out_dtype, each row's statistics in fp32 shaped xf.shape[:-1]."""
    y, mean, rstd = _xhat(xf, eps)
    if weight is not None:
        y = y * (weight.to(xf.dtype) + weight_offset)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(out_dtype), mean.squeeze(-1).float(), rstd.squeeze(-1).float()


def residual_add(x, residual, residual_in_fp32):
    """x + residual summed in the compute dtype, stored in x's dtype or fp32 on request."""
    cdt = compute_dtype(x.dtype, residual.dtype)
    return (x.to(cdt) + residual.to(cdt)).to(torch.float32 if residual_in_fp32 else x.dtype)


def layer_norm_with_stats(x, weight=None, bias=None, eps=1e-5, weight_offset=0.0):
    """(layer_norm(x), mean, rstd): each row's statistics in fp32, shaped x.shape[:-1]."""
    return _normalize(x.to(compute_dtype(x.dtype)), x.dtype, weight, bias, eps, weight_offset)


def layer_norm(x, weight=None, bias=None, eps=1e-5, weight_offset=0.0):
    return layer_norm_with_stats(x, weight, bias, eps, weight_offset)[0]


def add_layer_norm_with_stats(x, residual, weight=None, bias=None, eps=1e-5, weight_offset=0.0,
                              residual_in_fp32=False):
    """(y, residual_out, mean, rstd): add_layer_norm and the fp32 statistics of residual_out's rows."""
    residual_out = residual_add(x, residual, residual_in_fp32)
    stats = _normalize(residual_out.to(compute_dtype(x.dtype, residual.dtype)), x.dtype, weight, bias,
                       eps, weight_offset)
    return stats[0], residual_out, *stats[1:]


def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, weight_offset=0.0,
                   residual_in_fp32=False):
    """(layer_norm(x + residual), x + residual); y is in x's dtype, normalised from the
    sum as stored (x's dtype, or fp32 with residual_in_fp32)."""
    return add_layer_norm_with_stats(x, residual, weight, bias, eps, weight_offset, residual_in_fp32)[:2]


def layer_norm_backward(grad_y, x, weight, bias, eps, weight_offset):
    """(dx, dweight, dbias) of layer_norm, recomputing mean and rstd from x; dx in the
    compute dtype, dweight/dbias in their parameter's dtype (None where it is absent)."""
    cdt = compute_dtype(x.dtype, grad_y.dtype)
    xhat, _, rstd = _xhat(x.to(cdt), eps)
    g = grad_y.to(cdt)
    dxhat = g if weight is None else g * (weight.to(cdt) + weight_offset)
    dx = rstd * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    n = x.shape[-1]
    dw = None if weight is None else reduce_leading(g * xhat, n).to(weight.dtype)
    db = None if bias is None else reduce_leading(g, n).to(bias.dtype)
    return dx, dw, db
