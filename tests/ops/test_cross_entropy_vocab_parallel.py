"""flash.cross_entropy(..., process_group=pg), the vocab-parallel mode, over two CPU processes
(torch.multiprocessing + gloo): each rank holds half of the vocabulary; loss and logits
gradient against the unsharded float64 formula for every option and reduction, in place too,
on the reference path, the Triton kernels (interpreter) and under torch.compile; and the errors
that every rank must raise together (a target outside the vocabulary, ranks that disagree).

The two processes run every case once (one spawn: starting them costs most of the time) and
save what they got; the tests compare it with the reference here.
"""
import os
import re

import pytest
import torch
import torch.distributed as dist

from torch_flash.testing.samples import cross_entropy as ce
from _utils import TOL, assert_rel_close, error_text, run_gloo_ranks

# the module-scoped `results` (two gloo ranks, seconds to start) once per run: under pytest-xdist
# (--dist loadgroup) this file's tests run in one worker
pytestmark = pytest.mark.xdist_group("vocab_parallel")

WORLD = 2
V_LOCAL = 8
FP64, FP32, BF16 = torch.float64, torch.float32, torch.bfloat16
PLAIN, ALL = {}, {"ignore_index": 0, "label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 5.0}


def _cases():
    """name -> (batch shape, dtype, loss options, reduction, inplace_backward, how): how is
    "eager", "triton" (use_backend("triton")) or "compile" (torch.compile, aot_eager)."""
    cases = {}
    for i, opts in enumerate(ce.OPTIONS):
        for reduction in ce.REDUCTIONS:
            cases[f"opts{i}-{reduction}"] = ((3, 4), FP64, opts, reduction, False, "eager")
            cases[f"opts{i}-{reduction}-inplace"] = ((3, 4), FP64, opts, reduction, True, "eager")
    cases.update({
        "fp32-3d": ((2, 3, 2), FP32, ALL, "mean", False, "eager"),
        "bf16": ((5,), BF16, ALL, "sum", True, "eager"),
        "compile": ((3, 4), FP32, ALL, "mean", False, "compile"),
        "compile-inplace": ((3, 4), FP32, PLAIN, "none", True, "compile"),
        "empty": ((0,), FP32, PLAIN, "sum", False, "eager"),
        "all-ignored": ((3,), FP32, {"ignore_index": -100, "all_ignored": True}, "mean", False, "eager"),
    })
    if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels on CPU tensors (CI); a GPU
        # machine runs them on CUDA tensors in the other cross-entropy tests
        cases.update({
            "triton-fp32": ((2, 3), FP32, ALL, "none", False, "triton"),
            "triton-bf16-inplace": ((4,), BF16, ALL, "mean", True, "triton"),
        })
    return cases


def _inputs(name, batch, dtype, opts, reduction):
    """The whole (unsharded) logits, target and upstream gradient of a case, the same in every
    process: (logits (..., V), target (...), grad_loss)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    n_classes = V_LOCAL * WORLD
    x = (torch.randn(*batch, n_classes, generator=g, dtype=FP64) * 3).to(dtype)
    t = torch.randint(0, n_classes, batch, generator=g)
    ignore = opts.get("ignore_index", -100)
    t = t.masked_fill(torch.rand(batch, generator=g) < 0.25, ignore)
    if opts.get("all_ignored"):
        t.fill_(ignore)
    grad = torch.randn(batch if reduction == "none" else (), generator=g, dtype=FP64)
    return x, t, grad


def _loss_options(opts):
    return {k: v for k, v in opts.items() if k != "all_ignored"}


def _run_case(rank, name, case):
    """This rank's (loss, gradient of its logits shard, its logits after the backward) for one
    case."""
    from torch_flash.ops.cross_entropy import cross_entropy

    batch, dtype, opts, reduction, inplace, how = case
    x, t, grad = _inputs(name, batch, dtype, opts, reduction)
    leaf = x[..., rank * V_LOCAL:(rank + 1) * V_LOCAL].clone().requires_grad_()
    logits = leaf * 1  # an intermediate, as a model's lm-head output (inplace_backward refuses leaves)

    def loss_fn(logits):
        return cross_entropy(logits, t, reduction=reduction, inplace_backward=inplace,
                             process_group=dist.group.WORLD, **_loss_options(opts))

    from torch_flash import use_backend
    with use_backend("triton" if how == "triton" else None):
        fn = torch.compile(loss_fn, backend="aot_eager", fullgraph=True) if how == "compile" else loss_fn
        loss = fn(logits)
        loss.backward(grad.to(loss.dtype))
    return loss.detach(), leaf.grad, logits.detach()


def _error_cases(rank):
    from torch_flash.ops.cross_entropy import cross_entropy

    group = dist.group.WORLD
    t = torch.tensor([0, 3, 15, -100])
    return {
        "target-outside": lambda: cross_entropy(torch.randn(4, V_LOCAL), torch.tensor([0, 16, 3, 1]),
                                                process_group=group),
        "uneven-shards": lambda: cross_entropy(torch.randn(4, V_LOCAL + rank), t, process_group=group),
        "different-targets": lambda: cross_entropy(torch.randn(4, V_LOCAL), t + rank, process_group=group),
        "different-batch": lambda: cross_entropy(torch.randn(4 + rank, V_LOCAL), torch.zeros(4 + rank, dtype=torch.long),
                                                 process_group=group),
        "leaf-inplace": lambda: cross_entropy(torch.randn(4, V_LOCAL, requires_grad=True), t,
                                              inplace_backward=True, process_group=group),
        # Dynamo traces the mode's Python and reads the leaf off its tensors as eager does
        "leaf-inplace-compiled": lambda: torch.compile(
            lambda x: cross_entropy(x, t, inplace_backward=True, process_group=group), backend="aot_eager")(
                torch.randn(4, V_LOCAL, requires_grad=True)),
    }


def _rank_results(rank):
    results = {name: _run_case(rank, name, case) for name, case in _cases().items()}
    results.update({name: error_text(fn) for name, fn in _error_cases(rank).items()})
    # the ranks are still in step after the errors: a last collective completes
    results["after-errors"] = _run_case(rank, "opts0-mean", _cases()["opts0-mean"])
    return results


@pytest.fixture(scope="module")
def results():
    return run_gloo_ranks(_rank_results, WORLD)


def _reference(name, case):
    """(loss, dlogits) of the whole vocabulary in float64: the op's formula written out whole."""
    batch, dtype, opts, reduction, _, _ = case
    x, t, grad = _inputs(name, batch, dtype, opts, reduction)
    x64 = x.double().requires_grad_()
    loss = ce.naive_loss(x64, t, reduction=reduction, **_loss_options(opts))
    loss.backward(grad)
    return loss.detach(), x64.grad


@pytest.mark.parametrize("name", list(_cases()) + ["after-errors"])
def test_matches_unsharded(results, name):
    case_name = "opts0-mean" if name == "after-errors" else name
    case = _cases()[case_name]
    batch, dtype, opts, reduction, inplace, _ = case
    exact_loss, exact_grad = _reference(case_name, case)
    (loss0, grad0, after0), (loss1, grad1, after1) = (r[name] for r in results)
    shards = _inputs(case_name, batch, dtype, opts, reduction)[0].split(V_LOCAL, -1)
    for after, grad, shard in ((after0, grad0, shards[0]), (after1, grad1, shards[1])):
        # inplace_backward leaves the gradient in the logits; else they are untouched
        assert torch.equal(after, grad if inplace else shard)
    torch.testing.assert_close(loss0, loss1, rtol=0, atol=0, equal_nan=True, msg="the ranks' losses differ")
    assert loss0.dtype == (FP64 if dtype == FP64 else FP32)
    grad = torch.cat([grad0, grad1], -1)
    assert grad.dtype == dtype
    if opts.get("all_ignored"):  # mean over no rows: nan, zero gradient (as F.cross_entropy)
        assert loss0.isnan() and not grad.any()
    else:
        assert_rel_close(loss0, exact_loss, TOL[FP64] if dtype == FP64 else TOL[FP32], what="loss")
        assert_rel_close(grad, exact_grad, TOL[dtype], what="dlogits")


@pytest.mark.parametrize("name,match", [
    ("target-outside", "flash.cross_entropy_shard_stats: target contains 16, outside \\[0, 16\\)"),
    ("uneven-shards", "flash.cross_entropy: the ranks of process_group disagree"),
    ("different-targets", "flash.cross_entropy: the ranks of process_group disagree"),
    ("different-batch", "flash.cross_entropy: the ranks of process_group disagree"),
    ("leaf-inplace", "flash.cross_entropy: .*logits is a leaf tensor that requires grad"),
    ("leaf-inplace-compiled", "flash.cross_entropy: .*logits is a leaf tensor that requires grad"),
])
def test_errors_on_every_rank(results, name, match):
    for rank, r in enumerate(results):
        assert r[name] is not None and re.search(match, r[name]), f"rank {rank}: {r[name]!r}"


def test_process_group_type():
    from torch_flash.ops.cross_entropy import cross_entropy
    with pytest.raises(ValueError, match="flash.cross_entropy: process_group must be a torch.distributed ProcessGroup"):
        cross_entropy(torch.randn(4, 8), torch.zeros(4, dtype=torch.long), process_group="world")
