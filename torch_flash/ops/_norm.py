"""What flash.rms_norm and flash.layer_norm (and their residual variants) share: the checks of
x, weight and residual, the layout of reference-path results, and the Triton kernels of
torch_flash/kernels/triton/norm.py and norm_backward.py behind one pair of plan tables
(ops/_plans.py)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .. import _dispatch
from ._checks import FLOAT_DTYPES, check, check_like, check_same_device, check_tensor
from ._plans import Plans


def check_args(op: str, x, weight, eps, residual=None, out_dtype=None) -> None:
    check_tensor(op, "x", x, min_ndim=1)
    check(x.shape[-1] > 0, op, f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if weight is not None:
        check_tensor(op, "weight", weight, ndim=1)
        check(weight.shape[0] == x.shape[-1], op,
              f"weight has {weight.shape[0]} elements but x has hidden size {x.shape[-1]}")
    if residual is not None:
        check_tensor(op, "residual", residual)
        check(residual.shape == x.shape, op,
              f"residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)}")
    check(eps >= 0.0, op, f"eps must be >= 0, got {eps}")
    check(out_dtype is None or out_dtype in FLOAT_DTYPES, op, f"out_dtype must be a floating dtype, got {out_dtype}")
    check_same_device(op, x=x, weight=weight, residual=residual)


def check_grads(op: str, grad_y, grad_residual_out, x, x_name: str) -> None:
    """The norm backward ops' upstream gradients: shaped like x, the tensor normalised (x_name:
    residual_out in the add variants)."""
    check_like(op, "grad_y", grad_y, x, x_name)
    if grad_residual_out is not None:
        check_like(op, "grad_residual_out", grad_residual_out, x, x_name)


def laid_out_like(like: Tensor, values: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """values (a reference-path result) in empty_like(like)'s strides and dtype (default like's):
    the layout the fakes promise and the Triton launchers write. The reference's elementwise
    ops take their layout from whichever operand TensorIterator favours (a contiguous rstd
    over a permuted x, a permuted residual over an expanded x)."""
    return torch.empty_like(like, dtype=dtype or like.dtype).copy_(values)


def _use_triton(op: str, x: Tensor, weight) -> bool:
    def serves():
        from ..kernels.triton.norm import norm_supports
        return norm_supports(x, weight)
    return _dispatch.select(op, x, triton=serves) == "triton"


# signature -> NormFwd / NormBwd plan (None: the reference path), for all four norm ops
FORWARD_PLANS, BACKWARD_PLANS = Plans(), Plans()


def triton_forward(op: str, check: Callable[[], None], x, weight, bias, residual, **flags):
    """(y, residual_out or None) from torch_flash/kernels/triton/norm.py when it serves this
    call, else None. check() runs the op's argument checks; they and the choice of path are
    made once per signature of real inputs (ops/_plans.py). flags: eps, is_rms, weight_offset,
    cast_before_weight, residual_in_fp32, and optionally stats=True (then also each row's
    (mean, rstd)). Serves the RMSNorm and LayerNorm ops alike."""
    def make():
        check()
        if not _use_triton(op, x, weight):
            return None
        from ..kernels.triton.norm import NormFwd
        return NormFwd(x, weight, bias, residual, **flags)
    plan = FORWARD_PLANS.get(op, (x, weight, bias, residual, *flags.values()), make)
    return None if plan is None else plan(x, weight, bias, residual)


def triton_backward(op: str, check: Callable[[], None], grad_y, grad_residual_out, x, weight, bias,
                    mean=None, rstd=None, **flags):
    """(dx, dweight or None, dbias or None) from the Triton kernel, or None when it does not
    serve this call; check() as in triton_forward. flags: eps, is_rms, weight_offset,
    cast_before_weight, out_dtype; mean and rstd: the forward's statistics (else recomputed)."""
    def make():
        check()
        if not _use_triton(op, x, weight):
            return None
        from ..kernels.triton.norm_backward import NormBwd
        return NormBwd(grad_y, grad_residual_out, x, weight, bias, mean=mean, rstd=rstd, **flags)
    values = (grad_y, grad_residual_out, x, weight, bias, mean, rstd, *flags.values())
    plan = BACKWARD_PLANS.get(op, values, make)
    return None if plan is None else plan(grad_y, grad_residual_out, x, weight, bias, mean, rstd)
