"""flash.cross_entropy: schema, dispatch, autograd, public function.

Shapes: logits (..., V) float, target (...) int64/int32; the loss is (...) for
reduction="none", else a scalar, in fp32 for fp16/bf16 logits and in logits' dtype
otherwise. Formula and chunking: torch_flash/reference/cross_entropy.py. With a gradient
needed, the forward runs flash.cross_entropy_with_lse and the backward reuses each row's
log-sum-exp, so the only logits-sized tensor it allocates is dlogits (on GPU, Triton kernels
in torch_flash/kernels/triton/cross_entropy.py: the forward reads the logits once, the
backward reads them once and writes dlogits once).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op

from .. import _dispatch
from ..reference import cross_entropy as ref
from ..reference._common import compute_dtype
from ._autograd import register_autograd_via
from ._checks import INDEX_DTYPES, check, check_same_device, check_tensor, fail

LossOptions = ref.LossOptions
REDUCTIONS = ("mean", "sum", "none")


def check_options(op: str, opts: LossOptions, reduction: str) -> None:
    check(reduction in REDUCTIONS, op,
          f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")
    check(0.0 <= opts.label_smoothing <= 1.0, op,
          f"label_smoothing must be in [0, 1], got {opts.label_smoothing}")
    check(opts.z_loss >= 0.0, op, f"z_loss must be >= 0, got {opts.z_loss}")
    check(opts.softcap >= 0.0, op, f"softcap must be >= 0 (0 disables it), got {opts.softcap}")


def check_target(op: str, target, batch_shape, input_name: str) -> None:
    check_tensor(op, "target", target, dtypes=INDEX_DTYPES)
    check(tuple(target.shape) == tuple(batch_shape), op,
          f"target shape {tuple(target.shape)} must equal {input_name} shape without its last "
          f"dimension, {tuple(batch_shape)}")


def check_grad_loss(op: str, grad_loss, target, reduction: str) -> None:
    check_tensor(op, "grad_loss", grad_loss)
    want = tuple(target.shape) if reduction == "none" else ()
    check(tuple(grad_loss.shape) == want, op,
          f"grad_loss has shape {tuple(grad_loss.shape)}, expected {want} for reduction={reduction!r}")


def check_target_values(op: str, target: Tensor, n_classes: int, ignore_index: int) -> None:
    """Targets outside [0, V) that are not ignore_index. Reads the data (a host sync), so it
    runs on real tensors only; traced graphs rely on gather's own bounds check."""
    if is_fake(target) or target.numel() == 0:
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= n_classes))
    if bad.any():
        fail(op, f"target contains {target[bad][0].item()}, outside [0, {n_classes}) and "
                 f"not ignore_index={ignore_index}")


def check_args(op: str, logits, target, opts: LossOptions, reduction: str) -> None:
    check_tensor(op, "logits", logits, min_ndim=1)
    check(logits.shape[-1] > 0, op,
          f"logits must have a non-empty last (class) dimension, got shape {tuple(logits.shape)}")
    check_target(op, target, logits.shape[:-1], "logits")
    check_options(op, opts, reduction)
    check_same_device(op, logits=logits, target=target)


def loss_shape(target, reduction: str) -> tuple:
    return tuple(target.shape) if reduction == "none" else ()


def _backend(op: str, logits: Tensor, target: Tensor) -> str:
    triton = _dispatch.triton_can_run(logits.device)
    if triton:
        from ..kernels.triton.cross_entropy import ce_supports
        triton = ce_supports(logits, target)
    return _dispatch.select(op, logits.device, triton=triton)


def _forward(op: str, logits: Tensor, target: Tensor, opts: LossOptions, reduction: str):
    """(loss, lse) on the path select() picks."""
    check_args(op, logits, target, opts, reduction)
    check_target_values(op, target, logits.shape[-1], opts.ignore_index)
    if _backend(op, logits, target) == "triton":
        from ..kernels.triton.cross_entropy import ce_fwd
        loss, lse, _ = ce_fwd(logits, target, **opts._asdict(), reduction=reduction)
        # the kernel computes in fp32; the op's contract is logits' dtype above half
        return loss.to(compute_dtype(logits.dtype)), lse
    return ref.cross_entropy_with_lse(logits, target, opts, reduction)


@triton_op("flash::cross_entropy", mutates_args=())
def _cross_entropy(logits: Tensor, target: Tensor, *, ignore_index: int = -100,
                   label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float = 0.0,
                   reduction: str = "mean") -> Tensor:
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    return _forward("cross_entropy", logits, target, opts, reduction)[0]


@triton_op("flash::cross_entropy_with_lse", mutates_args=())
def _cross_entropy_with_lse(logits: Tensor, target: Tensor, *, ignore_index: int = -100,
                            label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float = 0.0,
                            reduction: str = "mean") -> tuple[Tensor, Tensor]:
    """(loss, lse): flash.cross_entropy and each row's log-sum-exp of the (capped) logits
    (target's shape, fp32 for half logits, 0 on ignored rows), which its backward reuses so
    that it reads the logits once instead of twice."""
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    return _forward("cross_entropy_with_lse", logits, target, opts, reduction)


@triton_op("flash::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward(grad_loss: Tensor, logits: Tensor, target: Tensor,
                            lse: Optional[Tensor] = None, *,
                            ignore_index: int = -100, label_smoothing: float = 0.0,
                            z_loss: float = 0.0, softcap: float = 0.0,
                            reduction: str = "mean") -> Tensor:
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    check_args("cross_entropy_backward", logits, target, opts, reduction)
    check_grad_loss("cross_entropy_backward", grad_loss, target, reduction)
    check_target_values("cross_entropy_backward", target, logits.shape[-1], ignore_index)
    if _backend("cross_entropy_backward", logits, target) == "triton":
        from ..kernels.triton.cross_entropy import ce_bwd
        # lse None: the kernel recomputes it (one more read of the logits)
        return ce_bwd(grad_loss, logits, target, lse, **opts._asdict(), reduction=reduction)
    return ref.cross_entropy_backward(grad_loss, logits, target, opts, reduction)


_OPTIONS = (*LossOptions._fields, "reduction")


def _setup(ctx, inputs, loss, lse):
    ctx.save_for_backward(inputs["logits"], inputs["target"], lse)
    ctx.options = {k: inputs[k] for k in _OPTIONS}


def _backward(ctx, grad_loss):
    logits, target, lse = ctx.saved_tensors
    return {"logits": torch.ops.flash.cross_entropy_backward(grad_loss, logits, target, lse,
                                                             **ctx.options)}


register_autograd_via(_cross_entropy, forward=lambda **inputs: torch.ops.flash.cross_entropy_with_lse(**inputs),
                      setup_context=_setup, backward=_backward)


def cross_entropy(logits: Tensor, target: Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float = 0.0,
                  reduction: str = "mean") -> Tensor:
    """Cross-entropy of logits (..., V) against class indices target (...), over any V.

    As F.cross_entropy (ignore_index, label_smoothing, reduction "mean" over non-ignored
    rows, "sum", "none"), plus z_loss * logsumexp^2 per row (PaLM) and Gemma-2 style
    logit softcapping (softcap * tanh(logits / softcap)) when softcap > 0. Math in fp32;
    the loss is fp32 for fp16/bf16 logits, else logits' dtype. Gradient for logits only.
    """
    return torch.ops.flash.cross_entropy(logits, target, ignore_index=ignore_index,
                                         label_smoothing=label_smoothing, z_loss=z_loss,
                                         softcap=softcap, reduction=reduction)
