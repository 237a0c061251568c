"""flash.cross_entropy: schema, dispatch, autograd, public function.

Shapes: logits (..., V) float, target (...) int64/int32; the loss is (...) for
reduction="none", else a scalar, in fp32 for fp16/bf16 logits and in logits' dtype
otherwise. Formula and chunking: torch_flash/reference/cross_entropy.py. The backward
recomputes the per-row log-sum-exp from the logits instead of saving it, so the only
logits-sized tensor it allocates is dlogits (on GPU: Triton kernels in
torch_flash/kernels/triton/cross_entropy.py; forward one read of the logits, backward two
reads and one write).
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op

from .. import _dispatch
from ..reference import cross_entropy as ref
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


@triton_op("flash::cross_entropy", mutates_args=())
def _cross_entropy(logits: Tensor, target: Tensor, *, ignore_index: int = -100,
                   label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float = 0.0,
                   reduction: str = "mean") -> Tensor:
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    check_args("cross_entropy", logits, target, opts, reduction)
    check_target_values("cross_entropy", target, logits.shape[-1], ignore_index)
    if _backend("cross_entropy", logits, target) == "triton":
        from ..kernels.triton.cross_entropy import ce_fwd
        loss = ce_fwd(logits, target, **opts._asdict(), reduction=reduction)[0]
        # the kernel computes in fp32; the op's contract is logits' dtype above half
        return loss.to(torch.promote_types(logits.dtype, torch.float32))
    return ref.cross_entropy(logits, target, opts, reduction)


@triton_op("flash::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward(grad_loss: Tensor, logits: Tensor, target: Tensor, *,
                            ignore_index: int = -100, label_smoothing: float = 0.0,
                            z_loss: float = 0.0, softcap: float = 0.0,
                            reduction: str = "mean") -> Tensor:
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    check_args("cross_entropy_backward", logits, target, opts, reduction)
    check_grad_loss("cross_entropy_backward", grad_loss, target, reduction)
    check_target_values("cross_entropy_backward", target, logits.shape[-1], ignore_index)
    if _backend("cross_entropy_backward", logits, target) == "triton":
        from ..kernels.triton.cross_entropy import ce_bwd
        # lse=None: the kernel recomputes it (one more read of the logits than saving it)
        return ce_bwd(grad_loss, logits, target, None, **opts._asdict(), reduction=reduction)
    return ref.cross_entropy_backward(grad_loss, logits, target, opts, reduction)


def loss_setup(ctx, keyword_only_inputs) -> None:
    """Keeps the loss options on ctx (shared with linear_cross_entropy's autograd)."""
    ctx.options = {k: keyword_only_inputs[k] for k in (*LossOptions._fields, "reduction")}


def _setup(ctx, inputs, keyword_only_inputs, output):
    logits, target = inputs
    ctx.save_for_backward(logits, target)
    loss_setup(ctx, keyword_only_inputs)


def _backward(ctx, grad_loss):
    logits, target = ctx.saved_tensors
    return torch.ops.flash.cross_entropy_backward(grad_loss, logits, target, **ctx.options), None


_cross_entropy.register_autograd(_backward, setup_context=_setup)


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
