"""flash.cross_entropy: opcheck, gradcheck, numerics vs F.cross_entropy and a float64 formula,
chunking, bad inputs, empty batch, inputs untouched."""
import pytest
import torch
import torch.nn.functional as F

import torch_flash  # noqa: F401  (registers the ops)
from torch_flash.ops.cross_entropy import cross_entropy
from torch_flash.reference import cross_entropy as ref
from _utils import TOL, assert_rel_close, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
REDUCTIONS = ["mean", "sum", "none"]
OPTIONS = [{}, {"label_smoothing": 0.1}, {"z_loss": 1e-2}, {"softcap": 3.0},
           {"label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 5.0, "ignore_index": 0}]


def _logits(shape, dtype=torch.float32, rg=False, noncontig=False):
    if noncontig:  # a strided view over a wider buffer
        x = (torch.randn(*shape[:-1], shape[-1] * 2) * 3).to(dtype)[..., ::2]
    else:
        x = (torch.randn(shape) * 3).to(dtype)
    return x.requires_grad_(rg)


def _target(batch_shape, n_classes, ignore_index=-100, dtype=torch.int64):
    """Random classes, about a quarter of them ignore_index (and at least one valid row)."""
    t = torch.randint(0, n_classes, batch_shape, dtype=dtype)
    ignored = torch.rand(batch_shape) < 0.25
    ignored.view(-1)[:1] = False
    return t.masked_fill(ignored, ignore_index)


def _naive(x, t, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0, reduction="mean"):
    """The op's formula, written out whole in float64 (the ground truth)."""
    z = x.double()
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    logp, lse = z.log_softmax(-1), z.logsumexp(-1)
    valid = t != ignore_index
    nll = -logp.gather(-1, torch.where(valid, t, 0).long().unsqueeze(-1)).squeeze(-1)
    loss = (1 - label_smoothing) * nll - label_smoothing * logp.mean(-1) + z_loss * lse**2
    loss = torch.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / valid.sum()


def _samples_fwd():
    cases = [((6,), 11), ((2, 3), 32), ((2, 3, 2), 7), ((5,), 64), ((3, 4), 17)]
    i = 0
    for batch, n_classes in cases:
        for dtype in DTYPES:
            opts = OPTIONS[i % len(OPTIONS)]
            x = _logits((*batch, n_classes), dtype, rg=i % 2 == 0, noncontig=i % 3 == 0)
            t = _target(batch, n_classes, opts.get("ignore_index", -100),
                        torch.int32 if i % 4 == 1 else torch.int64)
            yield (x, t), {**opts, "reduction": REDUCTIONS[i % 3]}
            i += 1


def _samples_bwd():
    for i, (reduction, dtype, opts) in enumerate(zip(REDUCTIONS * 2, DTYPES * 2, OPTIONS)):
        batch = (2, 3) if i % 2 else (5,)
        x = _logits((*batch, 13), dtype, noncontig=i == 1)
        grad = torch.randn(batch if reduction == "none" else ())
        t = _target(batch, 13, opts.get("ignore_index", -100))
        lse = torch.ops.flash.cross_entropy_with_lse(x, t, **opts)[1] if i % 2 else None
        yield (grad, x, t, lse), {**opts, "reduction": reduction}


def _samples_with_lse():
    for (x, t), kw in list(_samples_fwd())[::2]:
        yield (x.detach(), t), kw


OPCHECK_SAMPLES = {
    "cross_entropy": _samples_fwd,
    "cross_entropy_with_lse": _samples_with_lse,
    "cross_entropy_backward": _samples_bwd,
}




@pytest.mark.parametrize("opts", OPTIONS, ids=str)
def test_gradcheck(opts):
    x = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    t = _target((2, 3), 7, opts.get("ignore_index", -100))
    for reduction in REDUCTIONS:
        assert torch.autograd.gradcheck(lambda a: cross_entropy(a, t, reduction=reduction, **opts), (x,))


def test_gradcheck_across_chunks(monkeypatch):
    monkeypatch.setattr(ref, "CHUNK_BYTES", 2 * 9 * 8)  # 2 rows of fp64 per chunk
    x = torch.randn(7, 9, dtype=torch.float64, requires_grad=True)
    t = _target((7,), 9, OPTIONS[-1]["ignore_index"])
    assert torch.autograd.gradcheck(lambda a: cross_entropy(a, t, **OPTIONS[-1]), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
def test_matches_torch(dtype, reduction, label_smoothing):
    x = _logits((4, 5, 33), dtype)
    t = _target((4, 5), 33)
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = cross_entropy(mine, t, label_smoothing=label_smoothing, reduction=reduction)
    expect = F.cross_entropy(theirs.flatten(0, 1), t.flatten(), label_smoothing=label_smoothing,
                             reduction=reduction).reshape(out.shape)
    torch.testing.assert_close(out, expect)
    grad = torch.randn_like(out)
    out.backward(grad)
    expect.backward(grad)
    torch.testing.assert_close(mine.grad, theirs.grad)


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_numerics_vs_float64(opts, dtype):
    x = _logits((3, 6, 50), dtype)
    t = _target((3, 6), 50, opts.get("ignore_index", -100))
    leaf, leaf64 = x.clone().requires_grad_(), x.double().requires_grad_()
    out = cross_entropy(leaf, t, reduction="none", **opts)
    exact = _naive(leaf64, t, reduction="none", **opts)
    assert out.dtype == (torch.float32 if dtype != torch.float64 else dtype)
    assert_rel_close(out, exact, TOL[torch.float32])  # fp32 math whatever the input dtype
    grad = torch.rand_like(out)
    out.backward(grad)
    exact.backward(grad.double())
    assert leaf.grad.dtype == dtype
    assert_rel_close(leaf.grad, leaf64.grad, what="dlogits")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_no_worse_than_torch(dtype):
    x = _logits((64, 1000), dtype)
    t = _target((64,), 1000)
    exact_in = x.double().requires_grad_()
    exact = F.cross_entropy(exact_in, t, reduction="none", label_smoothing=0.1)
    exact.sum().backward()
    errs = {}
    for name, fn in (("flash", cross_entropy), ("torch", F.cross_entropy)):
        leaf = x.clone().requires_grad_()
        out = fn(leaf, t, reduction="none", label_smoothing=0.1)
        out.sum().backward()
        errs[name] = rel_err(out, exact), rel_err(leaf.grad, exact_in.grad)
        assert not torch.isnan(out).any() and not torch.isnan(leaf.grad).any()
    assert errs["flash"][0] <= errs["torch"][0] and errs["flash"][1] <= errs["torch"][1], errs
    assert errs["flash"][1] <= TOL[dtype]


def test_chunked_equals_whole(monkeypatch):
    x = _logits((10, 3, 21), rg=True)
    opts = OPTIONS[-1]
    t = _target((10, 3), 21, opts["ignore_index"])
    whole = cross_entropy(x, t, reduction="none", **opts)
    (dwhole,) = torch.autograd.grad(whole.sum(), x)
    monkeypatch.setattr(ref, "CHUNK_BYTES", 4 * 21 * 4)  # 4 rows of fp32
    seen = []
    for name in ("row_losses", "row_grads"):
        fn = getattr(ref, name)
        monkeypatch.setattr(ref, name, lambda logits, *a, fn=fn: seen.append(logits.shape) or fn(logits, *a))
    chunked = cross_entropy(x, t, reduction="none", **opts)
    (dchunked,) = torch.autograd.grad(chunked.sum(), x)
    assert seen and max(s[0] for s in seen) == 4 and len(seen) == 2 * 8  # 30 rows -> 8 chunks, twice
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(dchunked, dwhole)


def test_chunk_budget_for_huge_vocab():
    for n_classes in (262144, 1 << 20):
        for dtype in DTYPES:
            rows = ref.rows_per_chunk(n_classes, dtype)
            assert rows >= 1 and rows * n_classes * 4 <= ref.CHUNK_BYTES
    assert ref.rows_per_chunk(262144, torch.float32, chunk_size=3) == 3


def test_vocab_256k():
    x = _logits((3, 262147), torch.bfloat16, rg=True)
    t = torch.tensor([5, 262146, -100])
    out = cross_entropy(x, t, reduction="sum", z_loss=1e-4)
    out.backward()
    exact_in = x.detach().double().requires_grad_()
    exact = _naive(exact_in, t, reduction="sum", z_loss=1e-4)
    exact.backward()
    assert_rel_close(out, exact, TOL[torch.float32])
    assert_rel_close(x.grad, exact_in.grad, TOL[torch.bfloat16], what="dlogits")


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_all_ignored_like_torch(label_smoothing):
    """reduction="mean" over no valid rows is nan with zero gradients, as F.cross_entropy."""
    x = _logits((4, 9), rg=True)
    t = torch.full((4,), -100)
    out = cross_entropy(x, t, label_smoothing=label_smoothing)
    assert torch.isnan(out) and torch.isnan(F.cross_entropy(x, t, label_smoothing=label_smoothing))
    out.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert cross_entropy(x, t, reduction="sum") == 0


def _bad_ce(logits=None, target=None, **kw):
    logits = torch.randn(4, 10) if logits is None else logits
    target = torch.randint(0, 10, (4,)) if target is None else target
    return lambda: cross_entropy(logits, target, **kw)


@pytest.mark.parametrize("bad,match", [
    (_bad_ce(target=torch.zeros(5, dtype=torch.long)), "target shape"),
    (_bad_ce(logits=torch.randn(2, 3, 10), target=torch.zeros(3, 2, dtype=torch.long)), "target shape"),
    (_bad_ce(target=torch.zeros(4)), "target has dtype"),
    (_bad_ce(logits=torch.randint(0, 3, (4, 10))), "logits has dtype"),
    (_bad_ce(logits=torch.randn(())), "logits must have at least 1 dimensions"),
    (_bad_ce(logits=torch.randn(4, 0)), "non-empty last"),
    (_bad_ce(target=torch.tensor([0, 1, 10, 2])), "target contains 10, outside \\[0, 10\\)"),
    (_bad_ce(target=torch.tensor([0, -1, 3, 2])), "target contains -1"),
    (_bad_ce(target=torch.tensor([0, -100, 3, 2]), ignore_index=-1), "target contains -100"),
    (_bad_ce(reduction="avg"), "reduction must be one of"),
    (_bad_ce(label_smoothing=1.5), "label_smoothing must be in \\[0, 1\\]"),
    (_bad_ce(z_loss=-1.0), "z_loss must be >= 0"),
    (_bad_ce(softcap=-2.0), "softcap must be >= 0"),
    (lambda: torch.ops.flash.cross_entropy_backward(torch.randn(4), torch.randn(4, 10),
                                                    torch.zeros(4, dtype=torch.long)), "grad_loss has shape"),
])
def test_bad_inputs(bad, match):
    with pytest.raises(ValueError, match=f"flash.cross_entropy(_backward)?: .*{match}"):
        bad()


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_batch(reduction):
    x = torch.randn(0, 3, 16, requires_grad=True)
    t = torch.zeros(0, 3, dtype=torch.long)
    out = cross_entropy(x, t, reduction=reduction)
    expect = F.cross_entropy(x.reshape(0, 16), t.reshape(0), reduction=reduction).reshape(out.shape)
    torch.testing.assert_close(out, expect, equal_nan=True)
    out.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_inputs_untouched(softcap):
    x, t = torch.randn(5, 12, requires_grad=True), _target((5,), 12)
    copies = x.detach().clone(), t.clone()
    cross_entropy(x, t, softcap=softcap, z_loss=1e-2, label_smoothing=0.1).backward()
    assert torch.equal(x.detach(), copies[0]) and torch.equal(t, copies[1])


def test_with_lse_and_saved_lse_backward():
    """cross_entropy_with_lse's lse is each row's logsumexp (0 on ignored rows); the backward
    gives the same gradient from it as when it recomputes it."""
    x, t = _logits((4, 3, 29), torch.float64), _target((4, 3), 29, -100)
    loss, lse = torch.ops.flash.cross_entropy_with_lse(x, t, softcap=4.0, z_loss=1e-2)
    valid = t != -100
    want = (4.0 * torch.tanh(x / 4.0)).logsumexp(-1)
    torch.testing.assert_close(lse, torch.where(valid, want, 0.0))
    torch.testing.assert_close(loss, torch_flash.cross_entropy(x, t, softcap=4.0, z_loss=1e-2))
    g = torch.randn(())
    saved = torch.ops.flash.cross_entropy_backward(g, x, t, lse, softcap=4.0, z_loss=1e-2)
    recomputed = torch.ops.flash.cross_entropy_backward(g, x, t, softcap=4.0, z_loss=1e-2)
    torch.testing.assert_close(saved, recomputed)
