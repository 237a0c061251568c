"""flash.linear_cross_entropy(..., process_group=pg), the vocab-parallel mode, over two CPU
processes (torch.multiprocessing + gloo): each rank holds half of the lm-head's rows; loss and
the gradients of hidden, of the rank's weight rows and of its bias rows against the unsharded
float64 formula for every option and reduction, in one chunk and in several; and the errors
every rank raises together (ranks that disagree).

The two processes run every case once (one spawn: starting them costs most of the time) and
save what they got; the tests compare it with the reference here.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch_flash.testing.samples import cross_entropy as ce
from _utils import TOL, assert_rel_close, error_text, run_gloo_ranks

pytestmark = pytest.mark.xdist_group("vocab_parallel")

WORLD = 2
V_LOCAL, HIDDEN = 6, 5
FP64, BF16 = torch.float64, torch.bfloat16


def _cases():
    """name -> (batch shape, dtype, loss options, reduction, bias, chunk_size, weight needs grad)."""
    cases = {}
    for i, opts in enumerate(ce.OPTIONS):
        for reduction in ce.REDUCTIONS:
            cases[f"opts{i}-{reduction}"] = ((3, 4), FP64, opts, reduction, i % 2 == 0, (0, 5)[i % 2], True)
    cases.update({
        "bf16": ((7,), BF16, ce.OPTIONS[-1], "mean", True, 3, True),
        "frozen-head": ((4,), FP64, {}, "sum", True, 0, False),
        "empty": ((0,), FP64, {}, "sum", False, 0, True),
    })
    return cases


def _inputs(name, batch, dtype, opts, reduction, bias):
    """The whole (unsharded) hidden, weight, bias, target and upstream gradient of a case, the
    same in every process."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    n_classes = V_LOCAL * WORLD
    h = torch.randn(*batch, HIDDEN, generator=g, dtype=FP64).to(dtype)
    w = torch.randn(n_classes, HIDDEN, generator=g, dtype=FP64).to(dtype)
    b = torch.randn(n_classes, generator=g, dtype=FP64).to(dtype) if bias else None
    t = torch.randint(0, n_classes, batch, generator=g)
    t = t.masked_fill(torch.rand(batch, generator=g) < 0.25, opts.get("ignore_index", -100))
    grad = torch.randn(batch if reduction == "none" else (), generator=g, dtype=FP64)
    return h, w, b, t, grad


def _run_case(rank, name, case):
    """This rank's (loss, dhidden, dweight of its rows, dbias of its rows)."""
    from torch_flash import linear_cross_entropy

    batch, dtype, opts, reduction, bias, chunk_size, weight_grad = case
    h, w, b, t, grad = _inputs(name, batch, dtype, opts, reduction, bias)
    rows = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    h = h.requires_grad_()
    w = w[rows].clone().requires_grad_(weight_grad)
    b = None if b is None else b[rows].clone().requires_grad_()
    loss = linear_cross_entropy(h, w, t, b, reduction=reduction, chunk_size=chunk_size,
                                process_group=dist.group.WORLD, **opts)
    loss.backward(grad.to(loss.dtype))
    return loss.detach(), h.grad, w.grad, None if b is None else b.grad


def _rank_results(rank):
    from torch_flash import linear_cross_entropy

    results = {name: _run_case(rank, name, case) for name, case in _cases().items()}
    group, t = dist.group.WORLD, torch.tensor([0, 3, 11, -100])
    results["uneven-shards"] = error_text(lambda: linear_cross_entropy(
        torch.randn(4, HIDDEN), torch.randn(V_LOCAL + rank, HIDDEN), t, process_group=group))
    results["different-targets"] = error_text(lambda: linear_cross_entropy(
        torch.randn(4, HIDDEN), torch.randn(V_LOCAL, HIDDEN), t + rank, process_group=group))
    results["not-a-group"] = error_text(lambda: linear_cross_entropy(
        torch.randn(4, HIDDEN), torch.randn(V_LOCAL, HIDDEN), t, process_group=rank))
    return results


@pytest.fixture(scope="module")
def results():
    return run_gloo_ranks(_rank_results, WORLD)


def _reference(name, case):
    """(loss, dhidden, dweight, dbias) of the whole vocabulary in float64."""
    batch, dtype, opts, reduction, bias, _, _ = case
    h, w, b, t, grad = (x if x is None or not x.is_floating_point() else x.double().requires_grad_()
                        for x in _inputs(name, batch, dtype, opts, reduction, bias))
    loss = ce.naive_loss(F.linear(h, w, b), t, reduction=reduction, **opts)
    loss.backward(grad.detach())
    return loss.detach(), h.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("name", list(_cases()))
def test_matches_unsharded(results, name):
    case = _cases()[name]
    dtype, weight_grad = case[1], case[6]
    loss, dh, dw, db = _reference(name, case)
    (loss0, dh0, dw0, db0), (loss1, dh1, dw1, db1) = (r[name] for r in results)
    torch.testing.assert_close(loss0, loss1, rtol=0, atol=0, equal_nan=True, msg="the ranks' losses differ")
    assert torch.equal(dh0, dh1), "the ranks' hidden gradients differ (each holds the sum over the group)"
    if loss.numel() == 0 or dh.numel() == 0:
        assert loss0.shape == loss.shape and dh0.shape == dh.shape
        return
    tol = TOL[dtype]
    assert_rel_close(loss0, loss, tol)
    assert_rel_close(dh0, dh, tol)
    if weight_grad:
        assert_rel_close(torch.cat([dw0, dw1]), dw, tol)
    else:
        assert dw0 is None and dw1 is None
    if db is not None:
        assert_rel_close(torch.cat([db0, db1]), db, tol)


@pytest.mark.parametrize("name, match", [
    ("uneven-shards", r"flash.linear_cross_entropy: the ranks of process_group disagree on the weight shards"),
    ("different-targets", r"flash.linear_cross_entropy: the ranks of process_group disagree"),
    ("not-a-group", r"flash.linear_cross_entropy: process_group must be a torch.distributed ProcessGroup"),
])
def test_errors_name_the_op(results, name, match):
    import re
    for r in results:
        assert r[name] is not None and re.search(match, r[name]), r[name]
