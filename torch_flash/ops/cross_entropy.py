"""flash.cross_entropy: schema, dispatch, autograd, public function.

Shapes: logits (..., V) float, target (...) int64/int32; the loss is (...) for
reduction="none", else a scalar, in fp32 for fp16/bf16 logits and in logits' dtype
otherwise. Formula and chunking: torch_flash/reference/cross_entropy.py. With a gradient
needed, the forward runs flash.cross_entropy_with_lse and the backward reuses each row's
log-sum-exp, so the only logits-sized tensor it allocates is dlogits (on GPU, Triton kernels
in torch_flash/kernels/triton/cross_entropy.py: the forward reads the logits once, the
backward reads them once and writes dlogits once). inplace_backward=True writes dlogits over the
logits instead (flash.cross_entropy_backward_inplace), so no logits-sized tensor is allocated.

Vocab-parallel mode (process_group given): each rank holds a vocabulary shard; per-shard row
statistics (flash.cross_entropy_shard_stats) are combined by two all-reduces (MAX of the lse,
then one SUM of the rescaled exp-sums, target logits and logit sums) through functional
collectives, so it traces under torch.compile; the backward is local (the gradient op with the
whole row's lse), with no communication.
"""
from __future__ import annotations

import collections
import os
from typing import Callable, Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode


from .. import _dispatch
from ..kernels.triton import launch as _launch
from ..reference import cross_entropy as ref
from ..reference._common import compute_dtype
from . import _fast
from ._autograd import (ARG, CONST, GRAD, NONE, SAVED, Spec, Src, autograd_rule, call, register_autograd_spec,
                        triton_op)
from ._checks import INDEX_DTYPES, check, check_same_device, check_tensor, fail
from ._plans import Plans

LossOptions = ref.LossOptions
REDUCTIONS = ("mean", "sum", "none")


def check_options(op: str, opts: LossOptions, reduction: str) -> None:
    check(reduction in REDUCTIONS, op,
          f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")
    check(0.0 <= opts.label_smoothing <= 1.0, op,
          f"label_smoothing must be in [0, 1], got {opts.label_smoothing}")
    check(opts.z_loss >= 0.0, op, f"z_loss must be >= 0, got {opts.z_loss}")
    check(opts.softcap >= 0.0, op, f"softcap must be >= 0 (0 disables it), got {opts.softcap}")


def check_target(op: str, target, batch_shape, input_name: str, ignore_index: int) -> None:
    """target: class indices of batch_shape, in a dtype that holds ignore_index (compared
    with an int32 target, torch wraps the scalar: 2**40 would ignore class 0)."""
    check_tensor(op, "target", target, dtypes=INDEX_DTYPES)
    check(tuple(target.shape) == tuple(batch_shape), op,
          f"target shape {tuple(target.shape)} must equal {input_name} shape without its last "
          f"dimension, {tuple(batch_shape)}")
    info = torch.iinfo(target.dtype)
    check(info.min <= ignore_index <= info.max, op,
          f"ignore_index={ignore_index} does not fit target's dtype {target.dtype}; pass int64 targets")


def check_grad_loss(op: str, grad_loss, target, reduction: str) -> None:
    check_tensor(op, "grad_loss", grad_loss)
    want = tuple(target.shape) if reduction == "none" else ()
    check(tuple(grad_loss.shape) == want, op,
          f"grad_loss has shape {tuple(grad_loss.shape)}, expected {want} for reduction={reduction!r}")
    check_same_device(op, target=target, grad_loss=grad_loss)


class TargetCheck:
    """Targets outside [0, V) that are not ignore_index, checked without stalling the host.

    On CPU the verdict (the smallest and largest non-ignored target) is read at once. On CUDA
    it is computed on the stream and copied to pinned host memory behind an event, and
    raise_if_bad() does not wait for it where the op's kernels make such rows NaN and read no
    logit out of bounds (the Triton path): the error is raised by the first flash loss call
    (or torch_flash.synchronize()) after the GPU got there, as CUDA reports its own errors;
    set CUDA_LAUNCH_BLOCKING=1 to raise in the call itself. Waiting in every call would stall
    the host until the GPU drained its queue (a whole model's forward in training). Real
    tensors only: traced graphs and CUDA graph captures get the kernels' NaN or gather's
    bounds check; so do ops called with enabled=False from a compiled graph. The summary (the
    count of non-ignored targets, n_valid, which the loss kernels' mean reads, and the verdict)
    comes from the op's own kernels where they give it, else from target_summary where Triton
    runs, else from torch ops."""

    def __init__(self, op: str, target: Tensor, n_classes: int, ignore_index: int, enabled: bool = True,
                 summary: Optional[Tensor] = None):
        """summary: target_summary's, where the op's kernels computed it already."""
        self.op, self.n_classes, self.ignore_index = op, n_classes, ignore_index
        self.summary = self.host = self.event = None
        if (not enabled or is_fake(target) or target.numel() == 0
                or (target.is_cuda and torch.cuda.is_current_stream_capturing())):
            return
        if _PENDING or (target.is_cuda and _fast.MODULE is not None):
            raise_pending()
        if summary is None:
            if _dispatch.triton_can_run(target.device) and _dispatch.forced_backend() != "reference":
                from ..kernels.triton.cross_entropy import target_summary
                summary = target_summary(target, ignore_index)
            else:
                flat = target.reshape(-1)
                valid = flat != ignore_index
                summary = torch.stack([valid.sum(), *torch.aminmax(torch.where(valid, flat, 0))])
        self.summary = summary
        if target.is_cuda and _fast.MODULE is not None:
            return  # the fast path's module queues it (raise_if_bad)
        if target.is_cuda:
            self.host = torch.empty(3, dtype=summary.dtype, pin_memory=True).copy_(summary, non_blocking=True)
            free = _FREE_EVENTS.get(target.device)
            self.event = free.pop() if free else torch.cuda.Event()
            self.event.record()
        else:
            self.host = summary

    @property
    def n_valid(self) -> Optional[Tensor]:
        """The count of non-ignored targets as a device scalar (what the kernels' mean reads)."""
        return None if self.summary is None else self.summary[0]

    def raise_if_bad(self, wait: bool = True) -> None:
        """Raises if a target is out of range. wait=False (kernels that keep such rows NaN and in
        bounds): on CUDA only where the verdict is in already, else it joins the pending ones."""
        if self.host is None:
            if self.summary is not None:  # CUDA, through the fast path's module (csrc/fast/checks.cpp)
                if _launch.RECORDING is not None:  # a recipe replays it
                    _launch.RECORDING.checked(self.summary, self.n_classes, self.ignore_index, self.op,
                                              wait or _LAUNCH_BLOCKING)
                _fast.MODULE.fast_target_check(self.summary, self.n_classes, self.ignore_index, self.op,
                                               wait or _LAUNCH_BLOCKING)
            return
        if self.event is not None:
            if not (wait or _LAUNCH_BLOCKING or self.event.query()):
                _PENDING.append(self)
                return
            self._arrived()
        self._raise(late=False)

    def _arrived(self) -> None:
        """Waits for the verdict (at once where the event has completed); its event is reused."""
        self.event.synchronize()
        _FREE_EVENTS.setdefault(self.summary.device, []).append(self.event)
        self.event = None

    def _raise(self, late: bool) -> None:
        _, low, high = self.host.tolist()
        if low < 0 or high >= self.n_classes:
            fail(self.op, f"target contains {low if low < 0 else high}, outside [0, {self.n_classes}) and "
                          f"not ignore_index={self.ignore_index}" + (
                              " (found on the GPU after the call returned; its loss is NaN. "
                              "CUDA_LAUNCH_BLOCKING=1 raises in the call itself)" if late else ""))


# CUDA target checks whose verdict had not arrived when their op returned, oldest first
_PENDING: collections.deque[TargetCheck] = collections.deque()
_LAUNCH_BLOCKING = os.environ.get("CUDA_LAUNCH_BLOCKING", "0") == "1"
# device -> CUDA events whose verdict was read, for the next checks to record again
_FREE_EVENTS: dict[torch.device, list] = {}


def raise_pending(wait: bool = False) -> None:
    """Raises for the oldest pending target check that found a bad target, dropping the good
    ones before it; wait: also for verdicts still on their way (else those stay pending)."""
    if _fast.MODULE is not None:
        _fast.MODULE.fast_raise_pending(wait)
    while _PENDING:
        check = _PENDING[0]
        if not (wait or check.event.query()):
            return
        _PENDING.popleft()
        check._arrived()
        check._raise(late=True)


def synchronize() -> None:
    """torch.cuda.synchronize(), then the errors of flash calls that the GPU found after they
    returned (loss targets out of range, TargetCheck): for the end of a training loop, or a test."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    raise_pending(wait=True)


def check_shard(op: str, logits, vocab_start: int, vocab_size: Optional[int]) -> None:
    """logits (..., V_local) as the classes [vocab_start, vocab_start + V_local) of vocab_size
    (None: logits is the whole vocabulary)."""
    n_cols = logits.shape[-1]
    check(vocab_start >= 0, op, f"vocab_start must be >= 0, got {vocab_start}")
    if vocab_size is None:
        check(vocab_start == 0, op, f"vocab_start={vocab_start} needs vocab_size (the whole vocabulary's)")
    else:
        check(vocab_start + n_cols <= vocab_size, op,
              f"logits holds classes [{vocab_start}, {vocab_start + n_cols}), beyond vocab_size={vocab_size}")


def check_lse(op: str, lse, target, logits, vocab_size: Optional[int]) -> None:
    if lse is None:
        check(vocab_size is None or vocab_size == logits.shape[-1], op,
              "lse (the whole vocabulary's log-sum-exp of each row) is required for a vocabulary shard")
        return
    check_tensor(op, "lse", lse)
    check(tuple(lse.shape) == tuple(target.shape), op,
          f"lse has shape {tuple(lse.shape)}, expected target's shape {tuple(target.shape)}")
    check_same_device(op, logits=logits, lse=lse)


def check_inplace_layout(op: str, logits) -> None:
    """The in-place gradient overwrites logits row by row: its rows must be seen as (N, V) in
    place and not overlap. Metadata only (the fakes run it too)."""
    check_tensor(op, "logits", logits, min_ndim=1)
    stride = ref.row_stride(logits)
    n_rows = logits.numel() // max(1, logits.shape[-1])
    check(stride is not None and (n_rows <= 1 or stride >= logits.shape[-1]), op,
          f"inplace_backward=True writes the gradient over logits, which needs evenly spaced, "
          f"non-overlapping rows with a contiguous last dimension; got shape {tuple(logits.shape)} "
          f"and strides {logits.stride()} (pass logits.contiguous() or inplace_backward=False)")


def check_inplace_owner(op: str, logits: Tensor) -> None:
    """The values of a leaf that requires grad (a parameter) must survive the backward. Reads
    autograd metadata, which real tensors, Dynamo's fake tensors (mirroring the caller's leaves
    and views) and Dynamo's trace of Python (the vocab-parallel mode) carry faithfully, unlike
    the functional or proxied tensors of AOTAutograd and make_fx."""
    if not torch.compiler.is_dynamo_compiling() and (  # Dynamo cannot trace get_proxy_mode
            get_proxy_mode() is not None or isinstance(logits, FunctionalTensor)
            or torch._is_functional_tensor(logits)):
        return
    base = logits if logits._base is None else logits._base
    check(not (base.is_leaf and base.requires_grad), op,
          "inplace_backward=True overwrites logits with its gradient, but logits is a leaf tensor that "
          "requires grad (or a view of one), whose values must survive; pass inplace_backward=False")


def check_args(op: str, logits, target, opts: LossOptions, reduction: str) -> None:
    check_tensor(op, "logits", logits, min_ndim=1)
    check(logits.shape[-1] > 0, op,
          f"logits must have a non-empty last (class) dimension, got shape {tuple(logits.shape)}")
    check_target(op, target, logits.shape[:-1], "logits", opts.ignore_index)
    check_options(op, opts, reduction)
    check_same_device(op, logits=logits, target=target)


def loss_shape(target, reduction: str) -> tuple:
    return tuple(target.shape) if reduction == "none" else ()


def _backend(op: str, logits: Tensor, target: Tensor) -> str:
    def serves():
        from ..kernels.triton.cross_entropy import ce_supports
        return ce_supports(logits, target)
    return _dispatch.select(op, logits, triton=serves)


# signature -> the Triton launcher (CeFwd plan / ce_bwd), or None (the reference path)
PLANS = Plans()


def _triton_launcher(op: str, check: Callable[[], None], build: Callable, logits: Tensor, target: Tensor,
                     values: tuple) -> Optional[Callable]:
    """build(kernels/triton/cross_entropy) where the Triton path serves this call, else None;
    check(), the choice and build are made once per signature of real inputs (ops/_plans.py)."""
    def make():
        check()
        if _backend(op, logits, target) != "triton":
            return None
        from ..kernels.triton import cross_entropy as kernels
        return build(kernels)
    return PLANS.get(op, values, make)


def _forward(op: str, logits: Tensor, target: Tensor, opts: LossOptions, reduction: str):
    """(loss, lse) on the path select() picks."""
    ce_fwd = _triton_launcher(op, lambda: check_args(op, logits, target, opts, reduction),
                              lambda kernels: kernels.CeFwd(logits, target, **opts._asdict(), reduction=reduction),
                              logits, target, (logits, target, *opts, reduction))
    if ce_fwd is not None:
        loss, lse, summary = ce_fwd(logits, target)
        TargetCheck(op, target, logits.shape[-1], opts.ignore_index, summary=summary).raise_if_bad(wait=False)
        # the kernel computes in fp32; the op's contract is logits' dtype above half
        return loss.to(compute_dtype(logits.dtype)), lse
    TargetCheck(op, target, logits.shape[-1], opts.ignore_index).raise_if_bad()
    return ref.cross_entropy_with_lse(logits, target, opts, reduction)


@triton_op("flash::cross_entropy", mutates_args=())
def _cross_entropy(logits: Tensor, target: Tensor, *, ignore_index: int = -100,
                   label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float = 0.0,
                   reduction: str = "mean", inplace_backward: bool = False) -> Tensor:
    """inplace_backward only changes the backward (see cross_entropy)."""
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    if inplace_backward:
        check_inplace_layout("cross_entropy", logits)
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


def check_backward_args(op: str, grad_loss, logits, target, lse, opts: LossOptions, reduction: str,
                        vocab_start: int, vocab_size: Optional[int]) -> None:
    check_args(op, logits, target, opts, reduction)
    check_grad_loss(op, grad_loss, target, reduction)
    check_shard(op, logits, vocab_start, vocab_size)
    check_lse(op, lse, target, logits, vocab_size)


def _backward_into(op: str, grad_loss: Tensor, logits: Tensor, target: Tensor, lse: Optional[Tensor],
                   opts: LossOptions, reduction: str, vocab_start: int, vocab_size: Optional[int],
                   out: Optional[Tensor]) -> Tensor:
    """dlogits into out (None: a new tensor) on the path select() picks."""
    def check():
        check_backward_args(op, grad_loss, logits, target, lse, opts, reduction, vocab_start, vocab_size)
    ce_bwd = _triton_launcher(op, check, lambda kernels: kernels.ce_bwd, logits, target,
                              (grad_loss, logits, target, lse, *opts, reduction, vocab_start, vocab_size, out))
    targets = TargetCheck(op, target, vocab_size or logits.shape[-1], opts.ignore_index)
    shard = dict(vocab_start=vocab_start, vocab_size=vocab_size)
    if out is not None or ce_bwd is None:
        targets.raise_if_bad()  # before out (the caller's logits) is overwritten, or gather indexes with them
    if ce_bwd is not None:
        # lse None: the kernel recomputes it (one more read of the logits)
        dlogits = ce_bwd(grad_loss, logits, target, lse, **opts._asdict(), reduction=reduction, **shard, out=out,
                         n_valid=targets.n_valid)
    else:
        dlogits = ref.cross_entropy_backward(grad_loss, logits, target, opts, reduction, lse, **shard, out=out)
    targets.raise_if_bad(wait=ce_bwd is None)
    return dlogits


@triton_op("flash::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward(grad_loss: Tensor, logits: Tensor, target: Tensor,
                            lse: Optional[Tensor] = None, *,
                            ignore_index: int = -100, label_smoothing: float = 0.0,
                            z_loss: float = 0.0, softcap: float = 0.0,
                            reduction: str = "mean", vocab_start: int = 0,
                            vocab_size: Optional[int] = None) -> Tensor:
    """dlogits for the loss's upstream gradient grad_loss; lse (saved by the forward) is each
    row's whole-vocabulary log-sum-exp, recomputed when None. logits may be a vocabulary shard:
    the classes from vocab_start of vocab_size (then lse is required)."""
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    return _backward_into("cross_entropy_backward", grad_loss, logits, target, lse, opts, reduction,
                          vocab_start, vocab_size, None)


@triton_op("flash::cross_entropy_backward_inplace", mutates_args=("logits",))
def _cross_entropy_backward_inplace(grad_loss: Tensor, logits: Tensor, target: Tensor,
                                    lse: Optional[Tensor] = None, *,
                                    ignore_index: int = -100, label_smoothing: float = 0.0,
                                    z_loss: float = 0.0, softcap: float = 0.0,
                                    reduction: str = "mean", vocab_start: int = 0,
                                    vocab_size: Optional[int] = None) -> None:
    """flash.cross_entropy_backward written over logits (which it destroys), row chunk by row
    chunk (Triton: each row read whole before it is written), so no second logits-sized tensor
    exists."""
    op = "cross_entropy_backward_inplace"
    check_inplace_layout(op, logits)
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    _backward_into(op, grad_loss, logits, target, lse, opts, reduction, vocab_start, vocab_size, logits)


@triton_op("flash::cross_entropy_shard_stats", mutates_args=())
def _cross_entropy_shard_stats(logits: Tensor, target: Tensor, *, vocab_start: int = 0,
                               vocab_size: Optional[int] = None, ignore_index: int = -100,
                               softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """(lse, z_target, z_sum) of each row of logits (..., V_local), the classes from vocab_start
    of vocab_size, for the vocab-parallel loss: the log-sum-exp of the shard's (capped) logits z,
    z at the target where it lies in this shard (else 0), and the sum of z; target's shape, in
    fp32 for half logits (else logits' dtype), all 0 on ignored rows. One read of the logits."""
    op = "cross_entropy_shard_stats"
    opts = LossOptions(ignore_index=ignore_index, softcap=softcap)
    check_args(op, logits, target, opts, "none")
    check_shard(op, logits, vocab_start, vocab_size)
    targets = TargetCheck(op, target, vocab_size or logits.shape[-1], ignore_index)
    if _backend(op, logits, target) == "triton":
        from ..kernels.triton.cross_entropy import ce_stats
        stats = ce_stats(logits, target, ignore_index=ignore_index, softcap=softcap, vocab_start=vocab_start,
                         vocab_size=vocab_size)
        targets.raise_if_bad(wait=False)
        return tuple(s.to(compute_dtype(logits.dtype)) for s in stats)
    targets.raise_if_bad()
    return ref.cross_entropy_shard_stats(logits, target, opts, vocab_start)


_OPTIONS = (*LossOptions._fields, "reduction")


def _grad_logits(inplace: bool, grad_loss: Tensor, logits: Tensor, target: Tensor, lse: Tensor,
                 **options) -> Tensor:
    """The backward of both modes: dlogits as a new tensor, or written over logits (returned).
    create_graph=True (grad mode on here) takes the new tensor: autograd would take overwritten
    logits for the logits, history and all (a silently wrong second derivative), where the
    out-of-place op raises for want of an autograd formula."""
    if inplace and not torch.is_grad_enabled():
        call("cross_entropy_backward_inplace", grad_loss, logits, target, lse, **options)
        return logits
    return call("cross_entropy_backward", grad_loss, logits, target, lse, **options)


def _check_inplace(op: str, logits: Tensor) -> None:
    check_inplace_layout(op, logits)
    check_inplace_owner(op, logits)


def _forward_with_lse(*, inplace_backward, **inputs):
    """The autograd forward of inplace_backward=True (a gradient is needed)."""
    _check_inplace("cross_entropy", inputs["logits"])
    return call("cross_entropy_with_lse", **inputs)


def _setup(ctx, inputs, loss, lse):
    ctx.inplace = inputs["inplace_backward"]
    ctx.save_for_backward(inputs["logits"], inputs["target"], lse)
    ctx.options = {k: inputs[k] for k in _OPTIONS}


def _backward(ctx, grad_loss):
    logits, target, lse = ctx.saved_tensors
    return {"logits": _grad_logits(ctx.inplace, grad_loss, logits, target, lse, **ctx.options)}


# the gradient from the saved lse; inplace_backward's (written over the logits) by the rule above
register_autograd_spec(_cross_entropy, Spec(
    forward="cross_entropy_with_lse", save=("logits", "target", 1), backward="cross_entropy_backward",
    backward_args=(Src(GRAD, 0), Src(SAVED, 0), Src(SAVED, 1), Src(SAVED, 2), *(Src(ARG, n) for n in _OPTIONS),
                   Src(CONST, 0), Src(NONE)),
    grads=(("logits", 0, None),), python_if=("inplace_backward",)),
    otherwise=autograd_rule(_cross_entropy, forward=_forward_with_lse, setup_context=_setup, backward=_backward))


# --------------------------------------------------------------------------------------
# Vocab-parallel mode
# --------------------------------------------------------------------------------------
def check_ranks_agree(op: str, logits: Tensor, target: Tensor, group, name: str = "logits",
                      layout: str = "(..., V / world_size)") -> None:
    """Shard shapes, the compute dtype and the targets must match across the group's ranks: a
    mismatch would hang a collective or give each rank a different loss. One tiny blocking
    all-reduce, eager only (graphs under torch.compile skip it). logits: the vocabulary shard
    (named `name` in the error, laid out as `layout`)."""
    import torch.distributed as dist

    if torch.compiler.is_compiling() or is_fake(logits):
        return
    mine = torch.tensor([logits.shape[-1], logits.numel(), target.numel(),
                         compute_dtype(logits.dtype).itemsize, int(target.long().sum())],
                        dtype=torch.int64, device=logits.device)
    both = torch.cat([mine, -mine])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if not (torch.equal(both[:5], mine) and torch.equal(-both[5:], mine)):
        fail(op, f"the ranks of process_group disagree on the {name} shards or targets: this rank "
                 f"(rank {group.rank()}) has {name} {tuple(logits.shape)} {logits.dtype} and target "
                 f"{tuple(target.shape)}; every rank needs an equal shard {layout} and the same target")


def vocab_shard(group, n_cols: int) -> dict:
    """This rank's classes in a vocabulary split evenly over group, n_cols a rank: the
    vocab_start / vocab_size arguments of the shard ops."""
    return dict(vocab_start=group.rank() * n_cols, vocab_size=group.size() * n_cols)


def combine_shard_stats(local_lse: Tensor, z_t: Tensor, z_sum: Tensor, target: Tensor, group,
                        opts: LossOptions, vocab_size: int) -> tuple[Tensor, Tensor]:
    """(loss, lse) of each row over the whole vocabulary from every rank's
    flash.cross_entropy_shard_stats: two all-reduces (functional collectives, so it traces)."""
    import torch.distributed._functional_collectives as funcol

    top = funcol.all_reduce(local_lse, "max", group)
    # rescaled exp-sums, target logits (one shard has each) and logit sums in one SUM
    sums = funcol.all_reduce(torch.stack([(local_lse - top).exp(), z_t, z_sum]), "sum", group)
    lse = torch.where(target != opts.ignore_index, top + sums[0].log(), 0.0)
    return ref.loss_from_stats(lse, sums[1], sums[2], target, opts, vocab_size), lse


class _VocabParallel(torch.autograd.Function):
    """Loss over a vocabulary split across process_group (the shard of this rank: logits);
    gradient for this shard only (each rank gets its own)."""

    @staticmethod
    def forward(ctx, logits, target, group, opts, reduction, inplace_backward):
        shard = vocab_shard(group, logits.shape[-1])
        local_lse, z_t, z_sum = torch.ops.flash.cross_entropy_shard_stats(
            logits, target, **shard, ignore_index=opts.ignore_index, softcap=opts.softcap)
        loss, lse = combine_shard_stats(local_lse, z_t, z_sum, target, group, opts, shard["vocab_size"])
        ctx.inplace = inplace_backward
        ctx.save_for_backward(logits, target, lse)
        ctx.options = {**opts._asdict(), "reduction": reduction, **shard}
        return ref.reduce(loss.reshape(-1), target, opts.ignore_index, reduction)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse = ctx.saved_tensors
        return _grad_logits(ctx.inplace, grad_loss, logits, target, lse, **ctx.options), *[None] * 5


def _vocab_parallel(logits: Tensor, target: Tensor, group, opts: LossOptions, reduction: str,
                    inplace_backward: bool) -> Tensor:
    import torch.distributed as dist

    op = "cross_entropy"
    check(dist.is_available() and isinstance(group, dist.ProcessGroup), op,
          f"process_group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
    check_tensor(op, "logits", logits, min_ndim=1)
    check_tensor(op, "target", target, dtypes=INDEX_DTYPES)
    check_ranks_agree(op, logits, target, group)
    check_args(op, logits, target, opts, reduction)
    if inplace_backward:
        check_inplace_layout(op, logits)
        if torch.is_grad_enabled() and logits.requires_grad:
            check_inplace_owner(op, logits)
    return _VocabParallel.apply(logits, target, group, opts, reduction, inplace_backward)


def cross_entropy(logits: Tensor, target: Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float = 0.0,
                  reduction: str = "mean", inplace_backward: bool = False, process_group=None) -> Tensor:
    """Cross-entropy of logits (..., V) against class indices target (...), over any V.

    As F.cross_entropy (ignore_index, label_smoothing, reduction "mean" over non-ignored
    rows, "sum", "none"), plus z_loss * logsumexp^2 per row (PaLM) and Gemma-2 style
    logit softcapping (softcap * tanh(logits / softcap)) when softcap > 0. Math in fp32;
    the loss is fp32 for fp16/bf16 logits, else logits' dtype. Gradient for logits only.

    inplace_backward=True (as FlashAttention's): the backward writes the gradient over the
    logits' memory instead of a new tensor, saving one logits-sized buffer; the logits' values
    are destroyed then (they stay intact until the backward). logits must be an intermediate
    (not a leaf that requires grad, nor a view of one), with evenly spaced non-overlapping rows,
    and nothing else may need its values after the loss's backward: an op that saved logits for
    its own backward fails with PyTorch's "modified by an inplace operation" error. A backward with
    create_graph=True writes a new tensor instead (as flash.cross_entropy_backward; neither is
    differentiable again).

    process_group (vocab-parallel, as Megatron's VocabParallel cross-entropy): logits (..., V_local)
    is this rank's shard of the vocabulary, the classes [rank * V_local, (rank + 1) * V_local),
    with equal shards on every rank of the group (V = world_size * V_local); target holds
    global class ids and is the same on every rank. Every rank gets the loss of the whole
    vocabulary (identical on all ranks) and the gradient of its own shard. Two all-reduces of
    per-row statistics in the forward, none in the backward; eager calls add one tiny blocking
    all-reduce that checks the ranks agree (shard shapes, targets). Traces under torch.compile
    (functional collectives).
    """
    if process_group is not None:
        opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
        return _vocab_parallel(logits, target, process_group, opts, reduction, inplace_backward)
    return call("cross_entropy", logits, target, ignore_index=ignore_index,
                label_smoothing=label_smoothing, z_loss=z_loss,
                softcap=softcap, reduction=reduction,
                inplace_backward=inplace_backward)
