"""flash.linear_cross_entropy: the lm-head matmul fused with cross-entropy.

Shapes: hidden (..., H), weight (V, H) (nn.Linear layout), bias (V,) or None, target (...);
loss = cross_entropy(hidden @ weight.T + bias, target, ...) with flash.cross_entropy's
options, output shape and dtype. Token chunks of `chunk_size` rows (0: as many as keep a
chunk's logits, in the inputs' dtype, within a fixed budget, or within a third of dweight
where that is computed and larger) mean the (N, V) logits never exist; where dweight is
computed, the first tokens (H of them and up to one chunk more) keep theirs in dweight's own
memory before it is written and in the chunk buffer (kernels/triton/linear_cross_entropy.py,
_resident_chunk, lce_plan). With gradients needed
(mean/sum), the forward runs flash.linear_cross_entropy_with_grads, which also computes the
gradients chunk by chunk, and the backward hands them out scaled in
place (no second dweight-sized buffer; no pass at all for an upstream gradient of 1); "none", a
second backward through a retained graph, and create_graph=True recompute each chunk's logits in
the backward (flash.linear_cross_entropy_backward, which is not differentiable again).
See torch_flash/reference/linear_cross_entropy.py.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch._functorch import config as functorch_config

from .. import _dispatch
from ..reference import linear_cross_entropy as ref
from ..reference._common import compute_dtype
from ._autograd import (ARG, DEFAULT, GRAD, REQUIRES_GRAD, SAVED, Spec, Src, call, grad_or_empty, launching_directly,
                        register_autograd_via, register_body, register_fast_spec, triton_op)
from ._checks import check, check_same_device, check_same_dtype, check_tensor, fail
from ..reference import cross_entropy as ce_ref
from .cross_entropy import (LossOptions, TargetCheck, check_grad_loss, check_options, check_ranks_agree,
                            check_target, combine_shard_stats, vocab_shard)


def check_args(op: str, hidden, weight, target, bias, opts: LossOptions, reduction: str,
               chunk_size: int) -> None:
    check_tensor(op, "hidden", hidden, min_ndim=1)
    check_tensor(op, "weight", weight, ndim=2)
    check(weight.shape[0] > 0, op, f"weight must have at least one row (class), got shape {tuple(weight.shape)}")
    check(weight.shape[1] == hidden.shape[-1], op,
          f"weight has shape {tuple(weight.shape)} (V, H) but hidden has hidden size {hidden.shape[-1]}")
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1)
        check(bias.shape[0] == weight.shape[0], op,
              f"bias has {bias.shape[0]} elements but weight has {weight.shape[0]} rows (classes)")
    check_same_dtype(op, hidden=hidden, weight=weight, bias=bias)
    check_target(op, target, hidden.shape[:-1], "hidden", opts.ignore_index)
    check_options(op, opts, reduction)
    check(chunk_size >= 0, op, f"chunk_size must be >= 0 (0 picks it), got {chunk_size}")
    check_same_device(op, hidden=hidden, weight=weight, target=target, bias=bias)


def _backend(op: str, hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor]) -> str:
    def serves():
        from ..kernels.triton.linear_cross_entropy import lce_supports
        return lce_supports(hidden, weight, target, bias)
    return _dispatch.select(op, hidden, triton=serves)


def _grads_or_empty(hidden: Tensor, dh, dw, db) -> tuple[Tensor, Tensor, Tensor]:
    """The ops' gradient outputs: an empty tensor for each one not computed (or no bias)."""
    return grad_or_empty(dh, hidden), grad_or_empty(dw, hidden), grad_or_empty(db, hidden)


def _triton_lce(hidden, weight, target, bias, opts: LossOptions, reduction: str, chunk_size: int,
                grads: tuple[bool, bool, bool], targets: TargetCheck):
    """lce_fwd with the op's output dtypes: (loss, dhidden, dweight, dbias), empty where not
    computed; n_valid from the target check where it has one."""
    from ..kernels.triton.linear_cross_entropy import lce_fwd
    loss, dh, dw, db = lce_fwd(hidden, weight, target, bias, **opts._asdict(), reduction=reduction,
                               chunk_size=chunk_size, grads=grads, n_valid=targets.n_valid)
    return loss.to(compute_dtype(hidden.dtype)), *_grads_or_empty(hidden, dh, dw, db)


@triton_op("flash::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                          ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                          softcap: float = 0.0, reduction: str = "mean", chunk_size: int = 0) -> Tensor:
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    check_args("linear_cross_entropy", hidden, weight, target, bias, opts, reduction, chunk_size)
    targets = TargetCheck("linear_cross_entropy", target, weight.shape[0], ignore_index)
    if _backend("linear_cross_entropy", hidden, weight, target, bias) == "triton":
        loss = _triton_lce(hidden, weight, target, bias, opts, reduction, chunk_size, (False,) * 3, targets)[0]
        targets.raise_if_bad(wait=False)
        return loss
    targets.raise_if_bad()
    return ref.linear_cross_entropy(hidden, weight, target, bias, opts, reduction, chunk_size)


# The two ops that accumulate dweight chunk by chunk are custom ops, not triton ops: Inductor
# traces into a triton op, and in the traced chunk loop the in-place dweight accumulation
# (addmm_) became out-of-place GEMMs alternating between two dweight-sized buffers. At 8192 x
# 4096 x 128256 bf16 on the H100 (torch 2.11), the autograd forward under torch.compile peaked
# at 3.0 GB against 1.4 GB eagerly, and forward + backward took 46 ms against 41. They run in
# training graphs only, which AOTInductor does not package (flash.linear_cross_entropy, the
# inference op, stays a triton op).
@torch.library.custom_op("flash::linear_cross_entropy_with_grads", mutates_args=())
@launching_directly
def _linear_cross_entropy_with_grads(hidden: Tensor, weight: Tensor, target: Tensor,
                                     bias: Optional[Tensor] = None, *, ignore_index: int = -100,
                                     label_smoothing: float = 0.0, z_loss: float = 0.0,
                                     softcap: float = 0.0, reduction: str = "mean", chunk_size: int = 0,
                                     grad_hidden: bool = True, grad_weight: bool = True,
                                     grad_bias: bool = True,
                                     check_targets: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, dhidden, dweight, dbias) for an upstream gradient of 1, in one pass over the
    chunks: the autograd forward of flash.linear_cross_entropy for "mean"/"sum", so that its
    backward only scales (three matmuls in all, like the unfused model, not four). A gradient
    whose grad_* flag is False is not computed (a frozen lm-head costs no dweight GEMM or
    buffer) and comes back empty, as dbias does without a bias. check_targets=False (what a
    compiled graph passes) skips TargetCheck, whose verdict the host would wait for."""
    op = "linear_cross_entropy_with_grads"
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    check_args(op, hidden, weight, target, bias, opts, reduction, chunk_size)
    check(reduction != "none", op, "reduction='none' needs the per-row gradient: use the backward op")
    targets = TargetCheck(op, target, weight.shape[0], ignore_index, check_targets)
    grads = (grad_hidden, grad_weight, grad_bias)
    if _backend(op, hidden, weight, target, bias) == "triton":
        out = _triton_lce(hidden, weight, target, bias, opts, reduction, chunk_size, grads, targets)
        targets.raise_if_bad(wait=False)
        return out
    targets.raise_if_bad()
    loss, dh, dw, db = ref.linear_cross_entropy_with_grads(hidden, weight, target, bias, opts,
                                                          reduction, chunk_size, grads)
    return loss, *_grads_or_empty(hidden, dh, dw, db)


@torch.library.custom_op("flash::linear_cross_entropy_backward", mutates_args=())
@launching_directly
def _linear_cross_entropy_backward(grad_loss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor,
                                   bias: Optional[Tensor], *, ignore_index: int = -100,
                                   label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float = 0.0,
                                   reduction: str = "mean", chunk_size: int = 0, grad_hidden: bool = True,
                                   grad_weight: bool = True, grad_bias: bool = True,
                                   check_targets: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(dhidden, dweight, dbias); each one whose grad_* flag is False is not computed and comes
    back empty, as dbias does without a bias. check_targets as the with_grads op's."""
    op = "linear_cross_entropy_backward"
    opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    check_args(op, hidden, weight, target, bias, opts, reduction, chunk_size)
    check_grad_loss(op, grad_loss, target, reduction)
    targets = TargetCheck(op, target, weight.shape[0], ignore_index, check_targets)
    grads = (grad_hidden, grad_weight, grad_bias)
    if reduction != "none" and _backend(op, hidden, weight, target, bias) == "triton":
        _, *out = _triton_lce(hidden, weight, target, bias, opts, reduction, chunk_size, grads, targets)
        targets.raise_if_bad(wait=False)
        return tuple(t * grad_loss.to(t.dtype) for t in out)
    targets.raise_if_bad()
    return _grads_or_empty(hidden, *ref.linear_cross_entropy_backward(
        grad_loss, hidden, weight, target, bias, opts, reduction, chunk_size, grads))


register_body(_linear_cross_entropy_with_grads)
register_body(_linear_cross_entropy_backward)

_OPTIONS = (*LossOptions._fields, "reduction", "chunk_size")
# input -> the gradient ops' flag that asks for its gradient
_GRAD_FLAGS = {"hidden": "grad_hidden", "weight": "grad_weight", "bias": "grad_bias"}


def _forward(needs_grad, **inputs):
    """Autograd forward: loss and the gradients of the inputs in needs_grad together, except for
    reduction="none" whose per-row upstream gradient only the backward knows (it recomputes the
    logits)."""
    flags = {flag: name in needs_grad for name, flag in _GRAD_FLAGS.items()}
    if inputs["reduction"] == "none":
        return torch.ops.flash.linear_cross_entropy(**inputs), (flags, None)
    loss, *grads = call("linear_cross_entropy_with_grads",
                        **inputs, **flags, check_targets=not _dispatch.symbolic(inputs["hidden"]))
    return loss, (flags, grads)


def _setup(ctx, inputs, loss, state):
    ctx.options = {k: inputs[k] for k in _OPTIONS}
    # for the recompute path; the inputs are alive anyway, so saving them costs no memory.
    # grads is a plain attribute, not saved: the backward scales them in place, which would
    # trip the saved-tensor version check
    ctx.save_for_backward(inputs["hidden"], inputs["weight"], inputs["target"], inputs["bias"])
    ctx.flags, ctx.grads = state


def _scale_unless_one_(grads, grad_loss: Tensor) -> None:
    """grads *= grad_loss in place, nothing for the usual 1. The Triton kernel reads grad_loss
    on the device: a host read (Liger-Kernel's .item()) would stall the host until the forward
    has run, leaving the GPU idle while the next launches are prepared (about 1 ms a step at
    8192 x 4096 x 128256 on an H100)."""
    if _dispatch.select("linear_cross_entropy_backward", grad_loss, triton=lambda: True) == "triton":  # any gradient
        from ..kernels.triton.linear_cross_entropy import scale_unless_one_
        scale_unless_one_(grads, grad_loss)
    elif grad_loss.item() != 1:
        for t in grads:
            t.mul_(grad_loss.to(t.dtype))


def check_scale_args(op: str, grad, grad_loss) -> None:
    """grad: a float tensor; grad_loss: one element on its device (metadata only: the fake
    runs it too)."""
    check_tensor(op, "grad", grad)
    check_tensor(op, "grad_loss", grad_loss)
    check(grad_loss.numel() == 1, op, f"grad_loss must have one element, got shape {tuple(grad_loss.shape)}")
    check_same_device(op, grad=grad, grad_loss=grad_loss)


def _keeps_graph() -> bool:
    """Whether this runs inside a backward that keeps its graph for another (retain_graph or
    create_graph)."""
    return torch._C._current_graph_task_id() != -1 and torch._C._autograd._get_current_graph_task_keep_graph()


@torch.library.custom_op("flash::linear_cross_entropy_scale_", mutates_args=("grad",))
@launching_directly
def _linear_cross_entropy_scale_(grad: Tensor, grad_loss: Tensor) -> None:
    """grad *= grad_loss in place, no pass for 1 (read on the device): what a compiled graph's
    backward does to a gradient its forward computed (flash.linear_cross_entropy_with_grads),
    as the eager backward does; a traced graph cannot branch on grad_loss, and a multiply reads
    and writes all of dweight (0.8-1.5 ms a step on an H100 at 8192 x 4096-8192 x 128256).
    grad_loss: one element. Inside a backward that keeps its graph it raises: a later backward
    would find grad scaled already and, where the first handed grad out, change the caller's
    result; torch.compile refuses those backwards itself while its saved buffers are donated,
    the only graphs that use this op (see _backward)."""
    op = "linear_cross_entropy_scale_"
    check_scale_args(op, grad, grad_loss)
    if _keeps_graph():
        fail(op, "cannot run in a backward with retain_graph=True or create_graph=True: the compiled graph "
                 "hands out the gradients its forward computed, scaled in place", RuntimeError)
    _scale_unless_one_([grad], grad_loss)


def _backward(ctx, grad_loss):
    grads = ctx.grads
    if grads is not None and _dispatch.symbolic(grad_loss) and functorch_config.donated_buffer:
        # traced, and AOTAutograd donates the forward's buffers to the backward (its default):
        # the gradients are scaled in place, no pass for 1, and handed out. Such a backward
        # runs once: AOTAutograd refuses retain_graph / create_graph for it, and the op raises
        # where a graph it did not donate keeps its graph
        for t in grads:
            if t.numel():
                torch.ops.flash.linear_cross_entropy_scale_(t, grad_loss)
        dh, dw, db = grads
    elif grads is not None and _dispatch.symbolic(grad_loss):
        # traced without donation: a pure multiply, the compiler plans the memory, ctx.grads
        # stays intact for a later backward
        dh, dw, db = (t * grad_loss.to(t.dtype) for t in grads)
    elif grads is not None and not torch.is_grad_enabled():
        # eager, first backward: give the forward's gradients away (the graph, alive as long
        # as the loss, stops holding a dweight-sized buffer, and AccumulateGrad can take them
        # without a copy) and scale them in place
        ctx.grads = None
        dh, dw, db = grads
        _scale_unless_one_(grads, grad_loss)
    else:
        # reduction="none", a later backward through a retained graph (the first one's results
        # belong to the caller now), or create_graph=True (grad mode on here): the forward's
        # gradients are constants, a second derivative through them would silently lack its
        # Hessian term, where the backward op raises for want of an autograd formula. Recompute
        hidden, weight, target, bias = ctx.saved_tensors
        dh, dw, db = torch.ops.flash.linear_cross_entropy_backward(
            grad_loss, hidden, weight, target, bias, **ctx.options, **ctx.flags,
            check_targets=not _dispatch.symbolic(grad_loss))
    got = dict(zip(_GRAD_FLAGS, (dh, dw, db)))
    return {name: got[name] if ctx.flags[flag] else None for name, flag in _GRAD_FLAGS.items()}


register_body(_linear_cross_entropy_scale_, mutated=(0,))
register_autograd_via(_linear_cross_entropy, forward=_forward, setup_context=_setup,
                      backward=_backward, pass_needs_grad=True)
# The same rule for the eager fast path's C++ node: the forward computes the gradients the
# inputs need, the first backward hands them out scaled in place, a later one (or one keeping
# its graph) recomputes; reduction="none" takes the rule above.
_GRAD_SOURCES = tuple((flag, Src(REQUIRES_GRAD, name)) for name, flag in _GRAD_FLAGS.items())
register_fast_spec(_linear_cross_entropy, Spec(
    forward="linear_cross_entropy_with_grads", forward_args=_GRAD_SOURCES, outputs=(0,),
    save=("hidden", "weight", "target", "bias"),
    backward="linear_cross_entropy_backward",
    backward_args=(Src(GRAD, 0), Src(SAVED, 0), Src(SAVED, 1), Src(SAVED, 2), Src(SAVED, 3),
                   *(Src(ARG, name) for name in _OPTIONS), *(src for _, src in _GRAD_SOURCES),
                   Src(DEFAULT)),
    grads=(("hidden", 0, None), ("weight", 1, None), ("bias", 2, None)),
    python_if=(("reduction", "none"),), handout=(1, 2, 3), scale="linear_cross_entropy_scale_"))


# --------------------------------------------------------------------------------------
# Vocab-parallel mode
# --------------------------------------------------------------------------------------
class _VocabParallel(torch.autograd.Function):
    """Loss over a vocabulary whose lm-head rows (weight, bias) are split across process_group,
    chunk by chunk of tokens: each chunk's shard logits give per-row statistics
    (flash.cross_entropy_shard_stats), combined across the ranks as flash.cross_entropy's
    vocab-parallel mode combines them. The backward recomputes each chunk's logits, takes the
    shard's logit gradient with the whole row's lse (flash.cross_entropy_backward), and sums
    dhidden over the group (hidden is replicated)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, group, opts, reduction, chunk_size):
        shard = vocab_shard(group, weight.shape[0])
        h, chunks = ref.row_chunks(hidden, weight, chunk_size)
        t = target.reshape(-1)
        cdt = compute_dtype(hidden.dtype)
        local_lse, z_t, z_sum = (h.new_empty(h.shape[0], dtype=cdt) for _ in range(3))
        for rows in chunks:
            stats = torch.ops.flash.cross_entropy_shard_stats(
                ref.chunk_logits(h[rows], weight, bias), t[rows], **shard, ignore_index=opts.ignore_index,
                softcap=opts.softcap)
            for into, value in zip((local_lse, z_t, z_sum), stats):
                into[rows] = value
        loss, lse = combine_shard_stats(local_lse, z_t, z_sum, t, group, opts, shard["vocab_size"])
        ctx.save_for_backward(hidden, weight, target, bias, lse)
        ctx.group, ctx.chunk_size = group, chunk_size
        ctx.options = {**opts._asdict(), **shard}
        ctx.reduction = reduction
        return ce_ref.reduce(loss, target, opts.ignore_index, reduction)

    @staticmethod
    def backward(ctx, grad_loss):
        import torch.distributed._functional_collectives as funcol

        hidden, weight, target, bias, lse = ctx.saved_tensors
        want_dh, want_dw, _, want_db = ctx.needs_input_grad[:4]
        cdt = compute_dtype(hidden.dtype)
        h, chunks = ref.row_chunks(hidden, weight, ctx.chunk_size)
        t = target.reshape(-1)
        g = ce_ref.grad_rows(grad_loss, target, ctx.options["ignore_index"], ctx.reduction, cdt)
        dh = h.new_empty(h.shape) if want_dh else None
        # fp32 accumulators across chunks (fp64 for fp64), as the reference's
        dw = weight.new_zeros(weight.shape, dtype=cdt) if want_dw else None
        db = bias.new_zeros(bias.shape, dtype=cdt) if want_db and bias is not None else None
        for rows in chunks:
            dz = call("cross_entropy_backward", g[rows], ref.chunk_logits(h[rows], weight, bias), t[rows],
                      lse[rows], **ctx.options, reduction="none")
            if dh is not None:
                dh[rows] = dz @ weight
            if dw is not None:
                dw.addmm_(dz.T.to(cdt), h[rows].to(cdt))
            if db is not None:
                db += dz.sum(0, dtype=cdt)
        if dh is not None:
            dh = funcol.all_reduce(dh, "sum", ctx.group).wait().reshape(hidden.shape)
        return (dh, None if dw is None else dw.to(weight.dtype), None,
                None if db is None else db.to(bias.dtype), None, None, None, None)


def _vocab_parallel(hidden, weight, target, bias, group, opts: LossOptions, reduction: str,
                    chunk_size: int) -> Tensor:
    import torch.distributed as dist

    op = "linear_cross_entropy"
    check(dist.is_available() and isinstance(group, dist.ProcessGroup), op,
          f"process_group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
    check_args(op, hidden, weight, target, bias, opts, reduction, chunk_size)
    check_ranks_agree(op, weight, target, group, name="weight", layout="(V / world_size, H)")
    return _VocabParallel.apply(hidden, weight, target, bias, group, opts, reduction, chunk_size)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                         softcap: float = 0.0, reduction: str = "mean",
                         chunk_size: Optional[int] = None, process_group=None) -> Tensor:
    """cross_entropy(hidden @ weight.T + bias, target) without materialising the logits.

    hidden (..., H), weight (V, H) as nn.Linear's, bias (V,) or None, target (...) class
    indices; options, output shape and dtype as torch_flash.cross_entropy. Tokens are
    processed chunk_size rows at a time (None: picked so a chunk's logits, in the inputs'
    dtype, stay within 256 MiB, or within a third of dweight where the weight needs a gradient
    and that is more: every chunk reads and writes all of dweight; a smaller chunk_size takes
    less memory and more time). Where the weight needs a gradient, the first H tokens need no
    chunk memory: their logits live in the weight gradient's memory before it is written; up
    to one chunk's worth more join them in the chunk buffer (with chunk_size given, as many as
    it holds), and only the tokens after those go in chunks. Gradients for hidden, weight and
    bias.

    process_group (vocab-parallel, as tensor-parallel training shards the lm-head): weight
    (V_local, H) and bias (V_local,) are this rank's rows, the classes [rank * V_local, (rank + 1)
    * V_local), equal on every rank of the group; hidden and target (global class ids) are the
    same on every rank. Every rank gets the loss of the whole vocabulary and the gradients of
    its own weight and bias rows; hidden's gradient is summed over the group, so every rank
    holds the whole of it. Two all-reduces of per-row statistics in the forward and one of
    hidden's size in the backward, which recomputes each chunk's logits (four GEMMs in all
    where the single-device op runs three).
    """
    if process_group is not None:
        opts = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
        return _vocab_parallel(hidden, weight, target, bias, process_group, opts, reduction, chunk_size or 0)
    return call("linear_cross_entropy",
                hidden, weight, target, bias, ignore_index=ignore_index, label_smoothing=label_smoothing,
                z_loss=z_loss, softcap=softcap, reduction=reduction, chunk_size=chunk_size or 0)
