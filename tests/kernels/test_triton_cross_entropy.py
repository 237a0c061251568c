"""Triton cross-entropy launchers (torch_flash/kernels/triton/cross_entropy.py) against the float64
references of torch_flash/reference.

On CPU the kernels run under TRITON_INTERPRET=1 with a small vocabulary block, so every row
loops over several blocks with a partial last one; `cuda` tests take real vocabulary sizes.
The interpreter truncates fp32 -> bf16 where a GPU rounds to nearest: bf16 results are
compared by relative error, never bitwise.
"""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from _utils import TOL, assert_rel_close  # noqa: E402

from torch_flash.kernels.triton import cross_entropy as K  # noqa: E402
from torch_flash.reference import cross_entropy as ce_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
BLOCK = 64  # V = 200 below: three full blocks and a partial one
REDUCTIONS = ["mean", "sum", "none"]
OPTIONS = {
    "plain": ce_ref.LossOptions(),
    "smoothing": ce_ref.LossOptions(label_smoothing=0.1),
    "z_loss": ce_ref.LossOptions(z_loss=1e-2),
    "softcap": ce_ref.LossOptions(softcap=4.0),
    "all": ce_ref.LossOptions(ignore_index=7, label_smoothing=0.2, z_loss=1e-3, softcap=8.0),
}


def _kw(opts, reduction):
    return dict(opts._asdict(), reduction=reduction)


def _target(batch_shape, n_classes, ignore_index, dtype=torch.int64, device=DEV):
    """Random classes, some rows ignore_index (never the first)."""
    t = torch.randint(0, n_classes, batch_shape, dtype=dtype, device=device)
    ignored = torch.rand(batch_shape, device=device) < 0.3
    ignored.view(-1)[0] = False
    return t.masked_fill(ignored, ignore_index)


def _logits(shape, dtype, device=DEV):
    return (torch.randn(shape, device=device) * 3).to(dtype)


def _grad_loss(target, reduction):
    return torch.randn(target.shape if reduction == "none" else (), device=target.device)


def _lse64(x, opts):
    z = x.double()
    if opts.softcap > 0:
        z = opts.softcap * torch.tanh(z / opts.softcap)
    return z.logsumexp(-1)


def _check_ce(x, t, opts, reduction, block=BLOCK):
    """ce_fwd (loss, lse, gradient written into a poisoned buffer) and ce_bwd against the reference.
    Loss and lse are fp32 math on the logits as given: fp32 tolerance whatever their dtype."""
    tol = TOL[x.dtype]
    kw = _kw(opts, reduction)
    x64 = x.double()
    poisoned = torch.full_like(x, float("nan"))
    loss, lse, grad = K.ce_fwd(x, t, grad_logits_out=poisoned, block=block, **kw)
    assert grad is poisoned and loss.dtype == FP32 and lse.dtype == FP32 and lse.shape == t.shape
    ref_loss = ce_ref.cross_entropy(x64, t, opts, reduction)
    assert_rel_close(loss, ref_loss, TOL[FP32], what="loss")
    valid = t != opts.ignore_index
    assert_rel_close(lse[valid], _lse64(x, opts)[valid], TOL[FP32], what="lse")
    ones = torch.ones_like(ref_loss)
    assert_rel_close(grad, ce_ref.cross_entropy_backward(ones, x64, t, opts, reduction), tol, what="fused grad")
    assert (grad[~valid] == 0).all()
    g = _grad_loss(t, reduction)
    dx = K.ce_bwd(g, x, t, lse, block=block, **kw)
    assert dx.dtype == x.dtype and dx.is_contiguous()
    assert_rel_close(dx, ce_ref.cross_entropy_backward(g.double(), x64, t, opts, reduction), tol, what="dlogits")
    # lse recomputed in the kernel: equal in fp32 up to summation order, which can flip the
    # rounding of a few bf16 gradients by one unit (seen on the H100 at V = 256000)
    assert_rel_close(K.ce_bwd(g, x, t, None, block=block, **kw), dx, TOL[FP32] if x.dtype == FP32 else 1e-3,
                     what="dlogits, lse recomputed")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_cross_entropy(dtype, opts, reduction):
    x = _logits((9, 200), dtype)
    _check_ce(x, _target((9,), 200, opts.ignore_index), opts, reduction)


@pytest.mark.parametrize("dtype", [FP16, FP32], ids=["fp16", "fp32"])
def test_cross_entropy_batch_dims_int32_target(dtype):
    x = _logits((2, 3, 130), dtype)
    opts = OPTIONS["all"]
    _check_ce(x, _target((2, 3), 130, opts.ignore_index, torch.int32), opts, "none")


def test_default_block_large_vocab():
    """V = 20000 with the launch rule's own block: several 8192-column blocks per row."""
    x = _logits((3, 20000), FP32)
    _check_ce(x, _target((3,), 20000, -100), OPTIONS["softcap"], "mean", block=None)


@pytest.mark.parametrize("block", [BLOCK, None], ids=["looped", "one-block"])
def test_small_vocab(block):
    """V = 3, below one block; V = 1, a loss and a gradient of 0 (up to rounding)."""
    t = torch.zeros(5, dtype=torch.int64, device=DEV)
    _check_ce(_logits((5, 3), FP32), t, OPTIONS["smoothing"], "sum", block=block)
    x = _logits((5, 1), FP32)
    loss, lse, grad = K.ce_fwd(x, t, grad_logits_out=torch.empty_like(x), block=block,
                               **_kw(OPTIONS["smoothing"], "none"))
    assert loss.abs().max() < 1e-6 and grad.abs().max() < 1e-6
    assert_rel_close(lse, x.squeeze(1), TOL[FP32])


def test_in_place():
    """grad_logits_out=logits and ce_bwd(out=logits) overwrite the logits with their gradient."""
    opts = OPTIONS["all"]
    x = _logits((8, 200), BF16)
    t = _target((8,), 200, opts.ignore_index)
    loss, lse, grad = K.ce_fwd(x, t, grad_logits_out=torch.empty_like(x), block=BLOCK, **_kw(opts, "mean"))
    y = x.clone()
    loss2, lse2, grad2 = K.ce_fwd(y, t, grad_logits_out=y, block=BLOCK, **_kw(opts, "mean"))
    assert grad2 is y
    assert torch.equal(loss, loss2) and torch.equal(lse, lse2) and torch.equal(grad, y)
    g = _grad_loss(t, "mean")
    dx = K.ce_bwd(g, x, t, lse, block=BLOCK, **_kw(opts, "mean"))
    z = x.clone()
    assert K.ce_bwd(g, z, t, lse, out=z, block=BLOCK, **_kw(opts, "mean")) is z
    assert torch.equal(dx, z)


@pytest.mark.parametrize("opts", [OPTIONS["plain"], OPTIONS["all"]], ids=["plain", "all"])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_vocab_shards(dtype, opts):
    """Three 150-column shards of a 450-class vocabulary (ignore_index 7 falls in the first):
    ce_stats against the reference's row statistics, and each shard's ce_bwd from the whole row's
    lse (into a new tensor and over the shard itself) against the columns of the whole gradient."""
    x = _logits((2, 5, 450), dtype)
    t = _target((2, 5), 450, opts.ignore_index)
    t.view(-1)[1:4] = torch.tensor([0, 150, 449])  # shard edges
    x64 = x.double()
    lse = _lse64(x, opts).where(t != opts.ignore_index, 0.0)
    g = _grad_loss(t, "none")
    whole = ce_ref.cross_entropy_backward(g.double(), x64, t, opts, "none")
    for r in range(3):
        cols = slice(150 * r, 150 * (r + 1))
        shard = x[..., cols].contiguous()
        got = K.ce_stats(shard, t, ignore_index=opts.ignore_index, softcap=opts.softcap, vocab_start=150 * r,
                         vocab_size=450, block=BLOCK)
        expect = ce_ref.row_stats(x64[..., cols].reshape(-1, 150), t.reshape(-1), opts, vocab_start=150 * r)
        for name, a, b in zip(("lse", "z_target", "z_sum"), got, expect):
            assert a.dtype == FP32 and a.shape == t.shape
            assert_rel_close(a.reshape(-1), b, TOL[FP32], what=name)
        kw = dict(_kw(opts, "none"), vocab_start=150 * r, vocab_size=450, block=BLOCK)
        assert_rel_close(K.ce_bwd(g, shard, t, lse.float(), **kw), whole[..., cols], TOL[dtype], what="dlogits")
        assert K.ce_bwd(g, shard, t, lse.float(), out=shard, **kw) is shard
        assert_rel_close(shard, whole[..., cols], TOL[dtype], what="dlogits in place")


@pytest.mark.parametrize("opts", [OPTIONS["plain"], OPTIONS["all"]], ids=["plain", "all"])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_masked_classes(dtype, opts):
    """-inf logits (masked classes) filling whole blocks, the first one included: loss, lse and
    gradient as the float64 reference (no NaN from the running max starting at -inf); a shard of
    masked classes alone has lse -inf, which the all-reduce of shard statistics turns into 0."""
    x = _logits((6, 200), dtype)
    x[:, :BLOCK + 5] = float("-inf")
    x[1, 2 * BLOCK:3 * BLOCK] = float("-inf")
    t = _target((6,), 200, opts.ignore_index)
    t = torch.where((t >= 0) & (t < BLOCK + 5), BLOCK + 5, t)
    t[1] = 199
    for reduction in REDUCTIONS:
        _check_ce(x, t, opts, reduction)
    lse, z_t, _ = K.ce_stats(x[:, :BLOCK].contiguous(), t, ignore_index=opts.ignore_index, softcap=0.0,
                             vocab_size=200, block=BLOCK // 2)
    valid = t != opts.ignore_index
    assert (lse[valid] == float("-inf")).all() and (z_t == 0).all()


def test_strided_target_and_lse():
    """A 1-D target or lse with a stride (a reshape keeps it) is read as the values it holds."""
    x = _logits((6, 100), FP32)
    wide_t = _target((12,), 100, -100)
    t = wide_t[::2]
    loss, lse, _ = K.ce_fwd(x, t, block=BLOCK, **_kw(OPTIONS["plain"], "none"))
    assert_rel_close(loss, ce_ref.cross_entropy(x.double(), t.contiguous(), OPTIONS["plain"], "none"), TOL[FP32])
    wide_lse = torch.stack([lse, lse], -1)
    g = _grad_loss(t, "sum")
    dx = K.ce_bwd(g, x, t, wide_lse[:, 0], block=BLOCK, **_kw(OPTIONS["plain"], "sum"))
    assert torch.equal(dx, K.ce_bwd(g, x, t.contiguous(), lse, block=BLOCK, **_kw(OPTIONS["plain"], "sum")))


def _layouts():
    wide = _logits((6, 2 * 150), FP32)
    yield "row-stride", wide[:, 150:], None  # rows 300 apart, read and written in place
    yield "permuted", _logits((5, 3, 150), FP32).transpose(0, 1), None  # no row stride: copied
    yield "column-stride", wide[:, ::2], None
    out = torch.empty(5, 3, 150, device=DEV).transpose(0, 1)
    yield "permuted-out", _logits((3, 5, 150), FP32), out  # written through a buffer


@pytest.mark.parametrize("name,x,out", list(_layouts()), ids=lambda v: v if isinstance(v, str) else "")
def test_layouts_and_inputs_untouched(name, x, out):
    opts = OPTIONS["smoothing"]
    t = _target(x.shape[:-1], x.shape[-1], opts.ignore_index)
    x_before, t_before = x.clone(), t.clone()
    kw = _kw(opts, "none")
    out = torch.full_like(x, float("nan")) if out is None else out.fill_(float("nan"))
    loss, lse, grad = K.ce_fwd(x, t, grad_logits_out=out, block=BLOCK, **kw)
    assert torch.equal(x, x_before) and torch.equal(t, t_before)
    x64 = x.double()
    assert_rel_close(loss, ce_ref.cross_entropy(x64, t, opts, "none"), TOL[FP32], what="loss")
    expect = ce_ref.cross_entropy_backward(torch.ones_like(loss).double(), x64, t, opts, "none")
    assert_rel_close(grad, expect, TOL[FP32], what="fused grad")
    g = torch.randn(t.shape, device=DEV).expand(t.shape)  # any strides
    dx = K.ce_bwd(g, x, t, lse, out=out, block=BLOCK, **kw)
    assert dx is out and torch.equal(x, x_before)
    assert_rel_close(dx, ce_ref.cross_entropy_backward(g.double(), x64, t, opts, "none"), TOL[FP32])


@pytest.mark.filterwarnings("ignore:divide by zero")  # the interpreter's 1 / n_valid, masked after
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_rows_ignored(reduction):
    """mean is 0 / 0 = nan as F.cross_entropy; gradients are exactly 0; nothing else is NaN."""
    x = _logits((4, 100), BF16)
    t = torch.full((4,), -100, device=DEV)
    loss, lse, grad = K.ce_fwd(x, t, grad_logits_out=torch.full_like(x, float("nan")), block=BLOCK,
                               **_kw(OPTIONS["plain"], reduction))
    expect = F.cross_entropy(x.float(), t, reduction=reduction)
    assert torch.equal(loss, expect) if reduction != "mean" else loss.isnan()
    assert (grad == 0).all() and (lse == 0).all()
    dx = K.ce_bwd(_grad_loss(t, reduction), x, t, lse, block=BLOCK, **_kw(OPTIONS["plain"], reduction))
    assert (dx == 0).all()


def test_target_out_of_range_is_nan():
    """A target outside [0, V) that is not ignore_index (too large, negative): NaN lse, loss and
    gradient rows, in one launch and in shard statistics (a compiled call skips the op's host
    check); the other rows stay exact. (Linear cross-entropy: test_triton_linear_cross_entropy.py.)"""
    x, opts = _logits((4, 100), FP32), OPTIONS["smoothing"]
    t = torch.tensor([73, 100, -1, -100], device=DEV)  # in range, too large, negative, ignored
    loss, lse, grad = K.ce_fwd(x, t, grad_logits_out=torch.empty_like(x), block=BLOCK, **_kw(opts, "none"))
    for got in (loss, lse, grad):
        assert got[1:3].isnan().all() and not got[[0, 3]].isnan().any()
    assert_rel_close(loss[0], ce_ref.cross_entropy(x[:1].double(), t[:1], opts, "none")[0], TOL[FP32])
    for start in (0, 50):  # row 0's target in this shard and in the other
        shard_lse, _, _ = K.ce_stats(x[:, start:start + 50], t, ignore_index=-100, softcap=0.0,
                                     vocab_start=start, vocab_size=100, block=BLOCK)
        assert shard_lse[1:3].isnan().all() and not shard_lse[[0, 3]].isnan().any()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_target_summary(dtype):
    """(n_valid, min, max) of the non-ignored targets in one launch: over several of its blocks
    (the last partial), with ignored rows among them, none valid, and int64 extremes."""
    n = 2 * K.SUMMARY_BLOCK + 37
    t = torch.randint(0, 1000, (n,), dtype=dtype, device=DEV)
    t[::3] = -100
    t[5], t[n - 2] = -7, 4321  # the extremes, in the first and the partial last block
    valid = t[t != -100]
    expected = [valid.numel(), valid.min().item(), valid.max().item()]
    assert K.target_summary(t.view(1, n), -100).tolist() == expected  # any shape: flattened
    assert K.target_summary(torch.full((9,), -100, dtype=dtype, device=DEV), -100).tolist() == [0, 0, 0]
    big = torch.tensor([3, -(2**63), 2**63 - 1, 5], device=DEV)
    assert K.target_summary(big, 5).tolist() == [3, -(2**63), 2**63 - 1]


@pytest.mark.filterwarnings("ignore:invalid value")  # the interpreter's mean of no rows: 0 / 0
# the layout reaches only the row-loss launch, the reduction only the summary program: each
# layout once and each reduction once cover what the 3 x 3 product would
@pytest.mark.parametrize("name,reduction", list(zip(["contiguous", "row-stride", "permuted"], REDUCTIONS)))
def test_forward_plan(name, reduction, monkeypatch):
    """CeFwd (the loss op's forward: row losses, then one program that reduces them and sums up the
    targets) against the reference, over two summary blocks (the last partial), with ignored and
    out-of-range targets, for any layout of the logits; an empty batch and one of only ignored rows."""
    monkeypatch.setattr(K, "SUMMARY_BLOCK", 64)
    opts = OPTIONS["all"]
    x = {"contiguous": _logits((80, 40), FP32), "row-stride": _logits((80, 80), FP32)[:, 40:],
         "permuted": _logits((2, 40, 40), FP32).transpose(0, 1)}[name]
    t = _target(x.shape[:-1], 40, opts.ignore_index)
    plan = K.CeFwd(x, t, **_kw(opts, reduction))
    loss, lse, summary = plan(x, t)
    valid = t[t != opts.ignore_index]
    assert summary.tolist() == [valid.numel(), valid.min().item(), valid.max().item()]
    assert_rel_close(loss, ce_ref.cross_entropy(x.double(), t, opts, reduction), TOL[FP32], what="loss")
    assert_rel_close(lse[t != opts.ignore_index], _lse64(x, opts)[t != opts.ignore_index], TOL[FP32], what="lse")
    t_bad = t.clone()
    t_bad.view(-1)[1] = 40
    loss_bad, _, summary = plan(x, t_bad)
    assert summary[2] == 40 and (loss_bad.isnan().any() if reduction != "none" else loss_bad.view(-1)[1].isnan())
    for rows, fill in ((0, 0), (4, opts.ignore_index)):
        xe, te = _logits((rows, 40), FP32), torch.full((rows,), fill, device=DEV)
        loss, lse, summary = K.CeFwd(xe, te, **_kw(opts, reduction))(xe, te)
        expect = F.cross_entropy(xe, te, ignore_index=opts.ignore_index, reduction=reduction)
        assert summary.tolist() == [0, 0, 0] and loss.shape == expect.shape
        assert torch.equal(loss, expect) if reduction != "mean" else loss.isnan()


def test_empty_batch():
    x, t = _logits((0, 50), BF16), torch.zeros(0, dtype=torch.int64, device=DEV)
    for reduction in REDUCTIONS:
        loss, lse, grad = K.ce_fwd(x, t, grad_logits_out=torch.empty_like(x), **_kw(OPTIONS["plain"], reduction))
        assert loss.shape == ((0,) if reduction == "none" else ()) and lse.shape == (0,) and grad.shape == x.shape
        assert K.ce_bwd(_grad_loss(t, reduction), x, t, lse, **_kw(OPTIONS["plain"], reduction)).shape == x.shape


def test_supports():
    x, t = _logits((4, 10), BF16), torch.zeros(4, dtype=torch.int64, device=DEV)
    assert K.ce_supports(x, t) and K.ce_supports(x.float(), t.int())
    assert not K.ce_supports(x.double(), t)
    assert not K.ce_supports(x, t.short())
    assert not K.ce_supports(x, t[:3])
    assert not K.ce_supports(x[:, :0], t)


# --------------------------------------------------------------------------------------
# GPU: real vocabulary sizes
# --------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("n_cols", [128256, 256000])
def test_cuda_large_vocab(n_cols):
    x = _logits((64, n_cols), BF16)
    for opts, reduction in ((OPTIONS["all"], "mean"), (OPTIONS["plain"], "none")):
        _check_ce(x, _target((64,), n_cols, opts.ignore_index), opts, reduction, block=None)


@pytest.mark.cuda
def test_cuda_64bit_offsets():
    """8400 x 256000 bf16 logits (2.15e9 elements > 2^31): the last rows, in place."""
    n, n_cols = 8400, 256000
    x = torch.empty(n, n_cols, device="cuda", dtype=BF16)
    x[:-4].zero_()
    x[-4:] = _logits((4, n_cols), BF16)
    t = torch.randint(0, n_cols, (n,), device="cuda")
    tail = x[-4:].clone()
    opts = OPTIONS["plain"]
    loss, lse, _ = K.ce_fwd(x, t, grad_logits_out=x, **_kw(opts, "none"))
    assert_rel_close(loss[-4:], ce_ref.cross_entropy(tail.double(), t[-4:], opts, "none"), 1e-4)
    expect = ce_ref.cross_entropy_backward(torch.ones(4, device="cuda", dtype=torch.float64), tail.double(),
                                           t[-4:], opts, "none")
    assert_rel_close(x[-4:], expect, TOL[BF16])
