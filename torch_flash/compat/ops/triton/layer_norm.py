"""flash_attn.ops.triton.layer_norm over flash.layer_norm / rms_norm / add_*_norm: layer_norm_fn,
rms_norm_fn, layer_norm_linear_fn, RMSNorm, and the references FlashAttention's tests use
(layer_norm_ref, rms_norm_ref), with FlashAttention's signatures and dtype rules:

- x (..., N); out in out_dtype (default x's dtype), the weights' math in fp32;
- residual_out = x (+ x1) (+ residual) in residual's dtype, or fp32 with residual_in_fp32 and no
  residual, else x's dtype; prenorm=True also returns it;
- zero_centered_weight: the weights are stored as w - 1 (flash ops' weight_offset=1.0).

The fused path serves x (+ residual) -> norm. rowscale, dropout (a Bernoulli mask per element,
returned with return_dropout_mask=True) and the parallel input x1 are applied in fp32 before it
(unfused, exact); weight1/bias1 normalise the same residual_out a second time.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ....ops.layer_norm import add_layer_norm, layer_norm
from ....ops.rms_norm import add_rms_norm, rms_norm


def _fail(fn: str, msg: str):
    raise ValueError(f"torch_flash.compat.{fn}: {msg}")


def _norm(x, weight, bias, eps, offset, is_rms_norm, out_dtype, residual=None, residual_fp32=False):
    """(y, x + residual or None) through the fused ops; RMSNorm's bias is added in fp32 after."""
    fp32_y = is_rms_norm and bias is not None
    dtype = torch.float32 if fp32_y else out_dtype
    if is_rms_norm:
        kw = dict(weight_offset=offset, cast_before_weight=False, out_dtype=dtype)
        y, s = (rms_norm(x, weight, eps, **kw), None) if residual is None else \
            add_rms_norm(x, residual, weight, eps, residual_in_fp32=residual_fp32, **kw)
    else:
        kw = dict(weight_offset=offset, out_dtype=dtype)
        y, s = (layer_norm(x, weight, bias, eps, **kw), None) if residual is None else \
            add_layer_norm(x, residual, weight, bias, eps, residual_in_fp32=residual_fp32, **kw)
    if fp32_y:
        y = (y + bias.float()).to(out_dtype)
    return y, s


def _dropout(x: Tensor, p: float):
    keep = torch.rand_like(x, dtype=torch.float32) >= p
    return x.masked_fill(~keep, 0.0) / (1.0 - p), keep


def _layer_norm_fn(fn, x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                   residual_in_fp32, zero_centered_weight, is_rms_norm, return_dropout_mask, out_dtype, out,
                   residual_out):
    for name, t in (("residual", residual), ("x1", x1)):
        if t is not None and t.shape != x.shape:
            _fail(fn, f"{name} has shape {tuple(t.shape)}, expected x's {tuple(x.shape)}")
    if x1 is not None and rowscale is not None:
        _fail(fn, "rowscale is not supported with the parallel input x1 (as FlashAttention)")
    if bias1 is not None and weight1 is None:
        _fail(fn, "bias1 needs weight1")
    out_dtype = out_dtype or x.dtype
    res_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)
    offset = 1.0 if zero_centered_weight else 0.0
    masks = [None, None]
    h = x
    if rowscale is not None or dropout_p > 0 or x1 is not None:
        h = x.float()
        if rowscale is not None:
            h = h * rowscale.reshape(x.shape[:-1]).unsqueeze(-1)
        if dropout_p > 0:
            h, masks[0] = _dropout(h, dropout_p)
        if x1 is not None:
            h1 = x1.float()
            if dropout_p > 0:
                h1, masks[1] = _dropout(h1, dropout_p)
            h = h + h1
    if residual is None:
        y, _ = _norm(h, weight, bias, eps, offset, is_rms_norm, out_dtype)
        s = h.to(res_dtype)
    else:
        y, s = _norm(h, weight, bias, eps, offset, is_rms_norm, out_dtype, residual, res_dtype == torch.float32)
        s = s.to(res_dtype)
    outs = [y]
    if weight1 is not None:
        outs.append(_norm(s, weight1, bias1, eps, offset, is_rms_norm, out_dtype)[0])
    if out is not None:  # caller-provided buffers, as FlashAttention's (copy_ keeps the autograd graph)
        outs[0] = out.view_as(y).copy_(y)
    if prenorm:
        outs.append(s if residual_out is None else residual_out.view_as(s).copy_(s))
    if return_dropout_mask:
        outs += masks
    return outs[0] if len(outs) == 1 else tuple(outs)


def layer_norm_fn(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor] = None,
                  x1: Optional[Tensor] = None, weight1: Optional[Tensor] = None, bias1: Optional[Tensor] = None,
                  eps: float = 1e-6, dropout_p: float = 0.0, rowscale: Optional[Tensor] = None,
                  prenorm: bool = False, residual_in_fp32: bool = False, zero_centered_weight: bool = False,
                  is_rms_norm: bool = False, return_dropout_mask: bool = False,
                  out_dtype: Optional[torch.dtype] = None, out: Optional[Tensor] = None,
                  residual_out: Optional[Tensor] = None):
    """LayerNorm (RMSNorm with is_rms_norm) of rowscale * dropout(x) + dropout(x1) + residual.
    Returns out, then out1 (weight1), then residual_out (prenorm), then the two dropout masks
    (return_dropout_mask; None where not drawn), a tuple when more than one."""
    return _layer_norm_fn("layer_norm_fn", x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale,
                          prenorm, residual_in_fp32, zero_centered_weight, is_rms_norm, return_dropout_mask,
                          out_dtype, out, residual_out)


def rms_norm_fn(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor] = None,
                x1: Optional[Tensor] = None, weight1: Optional[Tensor] = None, bias1: Optional[Tensor] = None,
                eps: float = 1e-6, dropout_p: float = 0.0, rowscale: Optional[Tensor] = None,
                prenorm: bool = False, residual_in_fp32: bool = False, zero_centered_weight: bool = False,
                return_dropout_mask: bool = False, out_dtype: Optional[torch.dtype] = None,
                out: Optional[Tensor] = None, residual_out: Optional[Tensor] = None):
    """layer_norm_fn with is_rms_norm=True."""
    return _layer_norm_fn("rms_norm_fn", x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale,
                          prenorm, residual_in_fp32, zero_centered_weight, True, return_dropout_mask, out_dtype, out,
                          residual_out)


def layer_norm_linear_fn(x: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor], linear_weight: Tensor,
                         linear_bias: Optional[Tensor], residual: Optional[Tensor] = None, eps: float = 1e-6,
                         prenorm: bool = False, residual_in_fp32: bool = False, is_rms_norm: bool = False):
    """F.linear(norm(x + residual)) (under autocast, in its dtype); prenorm also returns residual_out."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
    y, *rest = _layer_norm_fn("layer_norm_linear_fn", x, norm_weight, norm_bias, residual, None, None, None, eps,
                              0.0, None, True, residual_in_fp32, False, is_rms_norm, False, dtype, None, None)
    dtype = dtype or y.dtype
    out = F.linear(y.to(dtype), linear_weight.to(dtype), None if linear_bias is None else linear_bias.to(dtype))
    return (out, rest[0]) if prenorm else out


class RMSNorm(torch.nn.Module):
    """FlashAttention's RMSNorm(hidden_size, eps, dropout_p, zero_centered_weight): forward(x,
    residual=None, prenorm=False, residual_in_fp32=False) -> rms_norm_fn(...)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dropout_p: float = 0.0,
                 zero_centered_weight: bool = False, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.drop = torch.nn.Dropout(dropout_p) if dropout_p > 0.0 else None
        self.zero_centered_weight = zero_centered_weight
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        (torch.nn.init.zeros_ if self.zero_centered_weight else torch.nn.init.ones_)(self.weight)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return rms_norm_fn(x, self.weight, self.bias, residual=residual, eps=self.eps,
                           dropout_p=self.drop.p if self.drop is not None and self.training else 0.0,
                           prenorm=prenorm, residual_in_fp32=residual_in_fp32,
                           zero_centered_weight=self.zero_centered_weight)


def _ref(norm, x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
         zero_centered_weight, dropout_mask, dropout_mask1, upcast):
    """FlashAttention's test references, one body for both norms: norm(x, w, b) on the sum."""
    dtype = x.dtype
    up = (lambda t: None if t is None else t.float()) if upcast else (lambda t: t)
    x, weight, bias, residual, x1, weight1, bias1 = map(up, (x, weight, bias, residual, x1, weight1, bias1))
    if zero_centered_weight:
        weight = weight + 1.0
        weight1 = None if weight1 is None else weight1 + 1.0
    if rowscale is not None:
        x = x * rowscale[..., None]
    if dropout_p > 0.0:
        drop = lambda t, m: (t.masked_fill(~m, 0.0) / (1.0 - dropout_p) if m is not None  # noqa: E731
                             else F.dropout(t, p=dropout_p))
        x = drop(x, dropout_mask)
        x1 = None if x1 is None else drop(x1, dropout_mask1)
    if x1 is not None:
        x = x + x1
    if residual is not None:
        x = (x + residual).to(x.dtype)
    outs = [norm(x, weight, bias).to(dtype)]
    if weight1 is not None:
        outs.append(norm(x, weight1, bias1).to(dtype))
    if prenorm:
        outs.append(x)
    return outs[0] if len(outs) == 1 else tuple(outs)


def layer_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                   rowscale=None, prenorm=False, zero_centered_weight=False, dropout_mask=None, dropout_mask1=None,
                   upcast=False):
    """FlashAttention's plain-PyTorch LayerNorm reference (its tests' ground truth)."""
    def norm(h, w, b):
        return F.layer_norm(h.to(w.dtype), h.shape[-1:], weight=w, bias=b, eps=eps)
    return _ref(norm, x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                zero_centered_weight, dropout_mask, dropout_mask1, upcast)


def rms_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                 rowscale=None, prenorm=False, zero_centered_weight=False, dropout_mask=None, dropout_mask1=None,
                 upcast=False):
    """FlashAttention's plain-PyTorch RMSNorm reference (its tests' ground truth)."""
    def norm(h, w, b):
        y = h * (1 / torch.sqrt(h.square().mean(dim=-1, keepdim=True) + eps)) * w
        return y if b is None else y + b
    return _ref(norm, x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                zero_centered_weight, dropout_mask, dropout_mask1, upcast)
