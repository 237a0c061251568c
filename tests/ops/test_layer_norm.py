"""flash.layer_norm / flash.add_layer_norm (and their _with_stats forms): opcheck, gradcheck,
numerics, the backward from the forward's saved mean/rstd, bad inputs."""
import pytest
import torch
import torch.nn.functional as F

import torch_flash  # noqa: F401  (registers the ops)
from torch_flash.kernels.triton import norm as K
from torch_flash.kernels.triton import norm_backward as KB
from torch_flash.ops.layer_norm import add_layer_norm, layer_norm
from torch_flash.testing.samples.layer_norm import DTYPES, param
from _utils import TOL, assert_rel_close, rel_err, to64

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # tests of the Triton path (CPU: the interpreter)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_gradcheck(offset):
    x, w, b, r = (torch.randn(s, dtype=torch.float64, requires_grad=True)
                  for s in ((2, 3, 8), (8,), (8,), (2, 3, 8)))
    assert torch.autograd.gradcheck(lambda a, c, d: layer_norm(a, c, d, 1e-5, weight_offset=offset),
                                    (x, w, b))
    assert torch.autograd.gradcheck(lambda a: layer_norm(a, None, None, 1e-5), (x,))
    assert torch.autograd.gradcheck(lambda a, c: layer_norm(a, c, None, 1e-5, weight_offset=offset), (x, w))
    assert torch.autograd.gradcheck(lambda a, d: layer_norm(a, None, d, 1e-5), (x, b))
    assert torch.autograd.gradcheck(
        lambda a, c, d, e: add_layer_norm(a, e, c, d, 1e-5, weight_offset=offset), (x, w, b, r))


def _mean_var_ln(x, w, b, eps):
    """LayerNorm spelled out with mean and biased variance."""
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_f_layer_norm(dtype):
    """Same values and dtype as F.layer_norm, within tolerance of a float64 mean/var
    LayerNorm, and no further from it than PyTorch's own path."""
    x = torch.randn(4, 7, 256, dtype=dtype) * 3 + 1
    w, b = param(256, dtype), param(256, dtype)
    out, theirs = layer_norm(x, w, b, 1e-5), F.layer_norm(x, (256,), w, b, 1e-5)
    exact = _mean_var_ln(*to64(x, w, b), 1e-5)
    assert out.dtype == theirs.dtype == dtype
    torch.testing.assert_close(out, theirs)
    err = assert_rel_close(out, exact, TOL[dtype])
    assert err <= 1.01 * rel_err(theirs, exact) + 1e-7


@pytest.mark.parametrize("dtype", DTYPES)
def test_grads_match_f_layer_norm(dtype):
    x, w, b = torch.randn(3, 5, 128, dtype=dtype), param(128, dtype), param(128, dtype)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    leaves64 = [t.double().requires_grad_() for t in (x, w, b)]
    y = layer_norm(*leaves, 1e-5, weight_offset=0.5)
    y64 = _mean_var_ln(leaves64[0], leaves64[1] + 0.5, leaves64[2], 1e-5)
    gy = torch.randn_like(y)
    y.backward(gy)
    y64.backward(gy.double())
    for a, e, name in zip(leaves, leaves64, ("dx", "dweight", "dbias")):
        assert a.grad.dtype == dtype
        assert_rel_close(a.grad, e.grad, 2 * TOL[dtype], what=name)


def test_mixed_param_dtype():
    """Half x with fp32 parameters: y stays in x's dtype, as F.layer_norm."""
    x, w, b = torch.randn(4, 64, dtype=torch.bfloat16), param(64, torch.float32), param(64, torch.float32)
    out = layer_norm(x, w, b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.layer_norm(x, (64,), w, b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm_numerics_and_grads(dtype):
    x, r = torch.randn(3, 9, 128, dtype=dtype), torch.randn(3, 9, 128, dtype=dtype)
    w, b = param(128, dtype), param(128, dtype)
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
    y, s = add_layer_norm(leaves[0], leaves[1], leaves[2], leaves[3], 1e-5)
    leaves64 = [t.double().requires_grad_() for t in (x, r, w, b)]
    s64 = leaves64[0] + leaves64[1]
    y64 = _mean_var_ln(s64, leaves64[2], leaves64[3], 1e-5)
    assert y.dtype == s.dtype == dtype
    assert_rel_close(s, s64, TOL[dtype])
    assert_rel_close(y, y64, TOL[dtype])
    gy, gs = torch.randn_like(y), torch.randn_like(s)
    torch.autograd.backward((y, s), (gy, gs))
    torch.autograd.backward((y64, s64), (gy.double(), gs.double()))
    for a, e, name in zip(leaves, leaves64, ("dx", "dresidual", "dweight", "dbias")):
        assert_rel_close(a.grad, e.grad, 2 * TOL[dtype], what=name)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_out_dtype(force_backend, backend):
    """out_dtype gives y as the op's own y cast to it (one rounding on the Triton path: within
    one bf16 ulp, the interpreter truncating); gradients as the cast's."""
    force_backend(backend)
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # else the interpreter
    x = torch.randn(3, 5, 64, device=dev, requires_grad=True)
    r = torch.randn(3, 5, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w, b = (torch.randn(64, device=dev, requires_grad=True) for _ in range(2))
    for fn in (lambda **kw: torch_flash.layer_norm(x, w, b, **kw),
               lambda **kw: torch_flash.add_layer_norm(x, r, w, b, **kw)[0]):
        y, cast = fn(out_dtype=torch.bfloat16), fn().to(torch.bfloat16)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, cast, atol=0, rtol=2**-7)
        g = torch.randn_like(y)
        for a, c in zip(torch.autograd.grad(y, (x, w, b), g), torch.autograd.grad(cast, (x, w, b), g)):
            torch.testing.assert_close(a, c)


def test_residual_in_fp32():
    x, r = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(2, 64, dtype=torch.float32)
    w = param(64, torch.bfloat16)
    y, s = add_layer_norm(x, r, w, None, residual_in_fp32=True)
    assert s.dtype == torch.float32 and y.dtype == torch.bfloat16
    torch.testing.assert_close(s, x.float() + r)
    torch.testing.assert_close(y, F.layer_norm(s, (64,), w.float()).bfloat16())


def test_large_hidden():
    x, w, b = torch.randn(2, 70000) + 5, param(70000, torch.float32), param(70000, torch.float32)
    assert_rel_close(layer_norm(x, w, b), _mean_var_ln(*to64(x, w, b), 1e-5), TOL[torch.float32])


@pytest.mark.parametrize("bad,match", [
    (lambda: layer_norm(torch.randn(4, 8), torch.randn(7)), "weight has 7 elements"),
    (lambda: layer_norm(torch.randn(4, 8), None, torch.randn(9)), "bias has 9 elements"),
    (lambda: layer_norm(torch.randn(4, 8), None, torch.randn(1, 8)), "bias must have 1 dimensions"),
    (lambda: layer_norm(torch.randn(4, 8), None, torch.randint(0, 3, (8,))), "bias has dtype"),
    (lambda: layer_norm(torch.randn(4, 0)), "non-empty last dimension"),
    (lambda: layer_norm(torch.randint(0, 3, (4, 8))), "x has dtype"),
    (lambda: layer_norm(torch.randn(4, 8), torch.randn(2, 8)), "weight must have 1 dimensions"),
    (lambda: add_layer_norm(torch.randn(4, 8), torch.randn(4, 9)), "residual shape"),
    (lambda: layer_norm(torch.randn(4, 8), None, None, -1.0), "eps must be >= 0"),
])
def test_bad_inputs(bad, match):
    with pytest.raises(ValueError, match=f"flash.(add_)?layer_norm: .*{match}"):
        bad()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_batch(force_backend, backend):
    force_backend(backend)
    x = torch.randn(0, 5, 32, device=DEV, requires_grad=True)
    w = torch.ones(32, device=DEV, requires_grad=True)
    b = torch.zeros(32, device=DEV, requires_grad=True)
    y = layer_norm(x, w, b)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape and b.grad.shape == b.shape
    _, mean, rstd = torch.ops.flash.layer_norm_with_stats(x.detach(), w.detach(), b.detach())
    assert mean.shape == rstd.shape == (0, 5) and mean.dtype == rstd.dtype == torch.float32


@pytest.mark.parametrize("stats", [False, True])
def test_add_outputs_have_x_layout(stats):
    """y and residual_out have empty_like(x)'s strides, as the fakes say (opcheck cannot see this
    case: it clones an expanded x contiguous). The reference path gave them the layout of a
    permuted residual when x was expanded."""
    x, r = torch.randn(16).expand(4, 6, 16), torch.randn(6, 4, 16).transpose(0, 1)
    op = torch.ops.flash.add_layer_norm_with_stats if stats else torch.ops.flash.add_layer_norm
    for out in op(x, r, param(16, torch.float32), None)[:2]:
        assert out.stride() == torch.empty_like(x).stride()


def test_inputs_untouched():
    x, r, w, b = torch.randn(3, 32), torch.randn(3, 32), torch.randn(32), torch.randn(32)
    copies = [t.clone() for t in (x, r, w, b)]
    add_layer_norm(x, r, w, b)
    layer_norm(x, w, b)
    for a, e in zip((x, r, w, b), copies):
        assert torch.equal(a, e)


def test_compile_fullgraph():
    """The op traces (fake + autograd) under torch.compile and gives the eager result."""
    x, w, b = torch.randn(4, 32, requires_grad=True), param(32, torch.float32), param(32, torch.float32)
    fn = torch.compile(lambda a: layer_norm(a, w, b).sum(), backend="aot_eager", fullgraph=True)
    fn(x).backward()
    g = x.grad.clone()
    x.grad = None
    layer_norm(x, w, b).sum().backward()
    torch.testing.assert_close(g, x.grad)


# --------------------------------------------------------------------------------------
# The backward from the forward's saved mean and rstd
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("add", [False, True], ids=["ln", "add-ln"])
@pytest.mark.parametrize("block", [None, 16], ids=["one-block", "column-loop"])
def test_saved_stats_triton(monkeypatch, force_backend, block, add, dtype):
    """Triton kernels: the _with_stats ops' mean/rstd are each row's statistics, the ones the
    kernel normalised with; the backward ops from them match float64 and the recomputing
    backward (same fp32 arithmetic). block 16: rows of three column blocks, a partial one."""
    force_backend("triton")
    if block:
        monkeypatch.setattr(K, "FWD_MAX_BLOCK", block)
        monkeypatch.setattr(KB, "BWD_MAX_BLOCK", block)
        monkeypatch.setattr(KB, "BWD_CHUNK", block)
    monkeypatch.setattr(K, "TILE", 2 * (block or 64))  # two-row tiles: several per backward program
    x = (torch.randn(3, 5, 40, device=DEV) * 2 + 0.5).to(dtype)
    w, b = torch.randn(40, device=DEV, dtype=dtype), torch.randn(40, device=DEV, dtype=dtype)
    if add:
        r = torch.randn_like(x)
        y, s, mean, rstd = torch.ops.flash.add_layer_norm_with_stats(x, r, w, b, 1e-5, residual_in_fp32=True)
        assert torch.equal(y, add_layer_norm(x, r, w, b, 1e-5, residual_in_fp32=True)[0])
    else:
        (y, mean, rstd), s = torch.ops.flash.layer_norm_with_stats(x, w, b, 1e-5), x
        assert torch.equal(y, layer_norm(x, w, b, 1e-5))
    assert mean.shape == rstd.shape == x.shape[:-1] and mean.dtype == rstd.dtype == torch.float32
    s64 = s.double()
    assert_rel_close(mean, s64.mean(-1), TOL[torch.float32], what="mean")
    assert_rel_close(rstd, torch.rsqrt(s64.var(-1, unbiased=False) + 1e-5), TOL[torch.float32], what="rstd")
    y_from_stats = ((s.float() - mean[..., None]) * rstd[..., None] * w.float() + b.float()).to(dtype)
    assert rel_err(y, y_from_stats) <= (1e-6 if dtype == torch.float32 else TOL[dtype])

    g = torch.randn_like(y)
    gs = torch.randn_like(s) if add else None
    if add:
        bwd = lambda *stats: torch.ops.flash.add_layer_norm_backward(g, gs, s, w, b, 1e-5, 0.0, *stats)  # noqa: E731
    else:
        bwd = lambda *stats: torch.ops.flash.layer_norm_backward(g, s, w, b, 1e-5, 0.0, *stats)  # noqa: E731
    saved, recomputed = bwd(mean, rstd), bwd()
    leaves64 = [t.double().requires_grad_() for t in (s, w, b)]
    _mean_var_ln(*leaves64, 1e-5).backward(g.double())
    exact = [leaves64[0].grad + (0 if gs is None else gs.double()), leaves64[1].grad, leaves64[2].grad]
    for got, again, e, name in zip(saved, recomputed, exact, ("dx", "dweight", "dbias")):
        assert got.dtype == again.dtype and got.shape == again.shape
        assert rel_err(got, again) <= (1e-6 if dtype == torch.float32 else 0.1 * TOL[dtype]), name
        assert_rel_close(got, e, 2 * TOL[dtype], what=name)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_autograd_saves_stats(monkeypatch, force_backend, backend):
    """With a gradient needed, the forward runs the _with_stats op and the backward op gets its
    mean and rstd (the Triton backward then skips recomputing them); without, neither. The
    gradients of a pre-norm block (add_layer_norm, then layer_norm of the sum) match float64."""
    force_backend(backend)
    calls = []
    for cls, flag in ((K.NormFwd, "STORE_STATS"), (KB.NormBwd, "HAS_STATS")):
        def spy(self, *args, run=cls.__call__, flag=flag):
            calls.append((type(self).__name__, self.consts[flag]))
            return run(self, *args)
        monkeypatch.setattr(cls, "__call__", spy)
    x, r = torch.randn(4, 48, device=DEV), torch.randn(4, 48, device=DEV)
    w, b = torch.randn(48, device=DEV), torch.randn(48, device=DEV)
    torch_flash._dispatch.LAST.clear()
    with torch.no_grad():
        layer_norm(x, w, b)
    assert set(torch_flash._dispatch.LAST) == {"layer_norm"}
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
    y, s = add_layer_norm(*leaves, 1e-5)
    y2 = layer_norm(s, leaves[2], leaves[3], 1e-5)
    seeds = torch.randn_like(y), torch.randn_like(y2)
    torch.autograd.backward((y, y2), seeds)
    assert set(torch_flash._dispatch.LAST) == {"layer_norm", "add_layer_norm_with_stats", "layer_norm_with_stats",
                                               "layer_norm_backward", "add_layer_norm_backward"}
    if backend == "triton":
        assert calls == [("NormFwd", False), ("NormFwd", True), ("NormFwd", True),
                         ("NormBwd", True), ("NormBwd", True)]
    leaves64 = [t.double().requires_grad_() for t in (x, r, w, b)]
    s64 = leaves64[0] + leaves64[1]
    ys64 = [_mean_var_ln(src, leaves64[2], leaves64[3], 1e-5) for src in (s64, s64)]
    torch.autograd.backward(ys64, [t.double() for t in seeds])
    for a, e, name in zip(leaves, leaves64, ("dx", "dresidual", "dweight", "dbias")):
        assert_rel_close(a.grad, e.grad, 2 * TOL[torch.float32], what=name)


STATS_ERRORS = [
    (lambda m, r: (m, None), "mean and rstd must be given together"),
    (lambda m, r: (None, r), "mean and rstd must be given together"),
    (lambda m, r: (m[:3], r), r"mean has shape \(3,\), expected x's shape without the last dim \(4,\)"),
    (lambda m, r: (m, r.reshape(2, 2)), r"rstd has shape \(2, 2\)"),
    (lambda m, r: (m.double(), r), "mean has dtype torch.float64"),
    (lambda m, r: (m, r.bfloat16()), "rstd has dtype torch.bfloat16"),
    (lambda m, r: (m, r.to("meta")), "all tensors must be on one device"),
]


@pytest.mark.parametrize("make,match", STATS_ERRORS)
@pytest.mark.parametrize("add", [False, True], ids=["ln", "add-ln"])
def test_bad_stats(make, match, add):
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    mean, rstd = make(torch.zeros(4), torch.ones(4))
    op = "add_layer_norm_backward" if add else "layer_norm_backward"
    with pytest.raises(ValueError, match=f"flash.{op}: {match}"):
        if add:
            torch.ops.flash.add_layer_norm_backward(g, None, x, None, None, 1e-5, 0.0, mean, rstd)
        else:
            torch.ops.flash.layer_norm_backward(g, x, None, None, 1e-5, 0.0, mean=mean, rstd=rstd)


@pytest.mark.parametrize("add", [False, True], ids=["ln", "add-ln"])
def test_backward_checks_the_upstream_gradient(add):
    """A gradient that would broadcast against x raises, naming the op and the argument."""
    x, w, b = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    if add:
        with pytest.raises(ValueError, match=r"flash.add_layer_norm_backward: grad_y has shape \(1, 8\), "
                                             r"expected residual_out's \(4, 8\)"):
            torch.ops.flash.add_layer_norm_backward(torch.randn(1, 8), None, x, w, b, 1e-5, 0.0)
        with pytest.raises(ValueError, match="flash.add_layer_norm_backward: grad_residual_out has shape"):
            torch.ops.flash.add_layer_norm_backward(torch.randn(4, 8), torch.randn(8), x, w, b, 1e-5, 0.0)
    else:
        with pytest.raises(ValueError, match=r"flash.layer_norm_backward: grad_y has shape \(1, 8\), "
                                             r"expected x's \(4, 8\)"):
            torch.ops.flash.layer_norm_backward(torch.randn(1, 8), x, w, b, 1e-5, 0.0)
