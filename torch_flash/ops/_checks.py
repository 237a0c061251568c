"""Input validation shared by the ops and their fakes.

Every error names the op and the argument, so that a user sees `flash.attention: k has
head dim 64 but q has 128` instead of a kernel crash. The checks read only metadata, so the
fakes call the same functions and bad input fails at trace time too.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def fail(op: str, msg: str, exc: type[Exception] = ValueError):
    raise exc(f"flash.{op}: {msg}")


def check(cond: bool, op: str, msg: str) -> None:
    if not cond:
        fail(op, msg)


def check_tensor(op: str, name: str, t, *, ndim: int | tuple[int, ...] | None = None,
                 dtypes: tuple[torch.dtype, ...] | None = FLOAT_DTYPES,
                 min_ndim: int | None = None) -> None:
    # messages are formatted only on failure: these checks run on every eager call
    if not isinstance(t, torch.Tensor):
        fail(op, f"{name} must be a Tensor, got {type(t).__name__}", TypeError)
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if t.dim() not in allowed:
            fail(op, f"{name} must have {' or '.join(map(str, allowed))} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        fail(op, f"{name} must have at least {min_ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        fail(op, f"{name} has dtype {t.dtype}; expected one of {', '.join(str(d) for d in dtypes)}")


def check_like(op: str, name: str, t, like, like_name: str, *, same_dtype: bool = False) -> None:
    """t (a gradient, a saved output) is a floating tensor of exactly like's shape, on its device
    (and of its dtype with same_dtype): a broadcastable or smaller tensor would give wrong
    gradients silently, or reads out of bounds in a kernel."""
    check_tensor(op, name, t)
    if t.shape != like.shape:
        fail(op, f"{name} has shape {tuple(t.shape)}, expected {like_name}'s {tuple(like.shape)}")
    if same_dtype and t.dtype != like.dtype:
        fail(op, f"{name} has dtype {t.dtype}, expected {like_name}'s {like.dtype}")
    if t.device != like.device:
        fail(op, f"all tensors must be on one device, got {like_name} on {like.device}, {name} on {t.device}")


def check_same_device(op: str, **tensors) -> None:
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {v.device for v in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on {v.device}" for k, v in present.items())
        fail(op, f"all tensors must be on one device, got {where}")


def check_same_dtype(op: str, **tensors) -> None:
    present = {k: v for k, v in tensors.items() if v is not None}
    dtypes = {v.dtype for v in present.values()}
    if len(dtypes) > 1:
        what = ", ".join(f"{k} {v.dtype}" for k, v in present.items())
        fail(op, f"dtype mismatch: {what}")


def check_last_dim_contiguous(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.dim() > 0 and t.shape[-1] > 1 and t.numel() > 0:
            check(t.stride(-1) == 1, op,
                  f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")


def check_positive_float(op: str, name: str, value: float) -> None:
    check(value > 0.0, op, f"{name} must be > 0, got {value}")


def check_probability(op: str, name: str, value: float) -> None:
    check(0.0 <= value < 1.0, op, f"{name} must be in [0, 1), got {value}")
