"""flash.rms_norm / flash.add_rms_norm: opcheck, gradcheck, numerics, bad inputs."""
import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_flash
from torch_flash.reference import rms_norm as ref
from torch_flash.testing import llama
from torch_flash.testing.samples.rms_norm import DTYPES
from _utils import TOL, assert_rel_close, to64


@pytest.mark.parametrize("offset,cbw", [(0.0, True), (1.0, False), (0.5, True)])
def test_gradcheck(offset, cbw):
    x, w, r = (torch.randn(s, dtype=torch.float64, requires_grad=True) for s in ((2, 3, 8), (8,), (2, 3, 8)))
    assert torch.autograd.gradcheck(
        lambda a, b: torch_flash.rms_norm(a, b, 1e-5, weight_offset=offset, cast_before_weight=cbw), (x, w))
    assert torch.autograd.gradcheck(lambda a: torch_flash.rms_norm(a, None, 1e-5), (x,))
    assert torch.autograd.gradcheck(
        lambda a, b, c: torch_flash.add_rms_norm(a, c, b, 1e-5, weight_offset=offset,
                                                 cast_before_weight=cbw), (x, w, r))


def _gemma(x, w, eps):  # transformers' GemmaRMSNorm.forward
    h = x.float()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + w.float())).type_as(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", ["llama", "gemma"])
def test_matches_model_code(dtype, model):
    """Same values and dtype as the model code it replaces, and within tolerance of fp64."""
    x = torch.randn(4, 7, 256, dtype=dtype) * 3
    w = torch.randn(256, dtype=dtype)
    if model == "llama":
        out, theirs = torch_flash.rms_norm(x, w, 1e-6), llama.rms_norm(x, w, 1e-6)
        exact = ref.rms_norm(*to64(x, w), 1e-6)
    else:
        out = torch_flash.rms_norm(x, w, 1e-6, weight_offset=1.0, cast_before_weight=False)
        theirs, exact = _gemma(x, w, 1e-6), _gemma(*to64(x, w), 1e-6)
    assert out.dtype == theirs.dtype
    torch.testing.assert_close(out, theirs)
    assert_rel_close(out, exact, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_numerics_and_grads(dtype):
    x, r = torch.randn(3, 9, 128, dtype=dtype), torch.randn(3, 9, 128, dtype=dtype)
    w = torch.randn(128, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    y, s = torch_flash.add_rms_norm(leaves[0], leaves[1], leaves[2], 1e-6)
    leaves64 = [t.double().requires_grad_() for t in (x, r, w)]
    s64 = leaves64[0] + leaves64[1]
    y64 = ref.rms_norm(s64, leaves64[2], 1e-6)
    assert_rel_close(s, s64, TOL[dtype])
    assert_rel_close(y, y64, TOL[dtype])
    gy, gs = torch.randn_like(y), torch.randn_like(s)
    torch.autograd.backward((y, s), (gy, gs))
    torch.autograd.backward((y64, s64), (gy.double(), gs.double()))
    for a, b, name in zip(leaves, leaves64, ("dx", "dresidual", "dweight")):
        assert_rel_close(a.grad, b.grad, 2 * TOL[dtype], what=name)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_out_dtype(force_backend, backend):
    """out_dtype gives y as the op's own y cast to it (the Triton path writes it so in one
    rounding: within one bf16 ulp, the interpreter truncating); gradients as the cast's."""
    force_backend(backend)
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # else the interpreter
    x = torch.randn(3, 5, 64, device=dev, requires_grad=True)
    r = torch.randn(3, 5, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, device=dev, requires_grad=True)
    for fn in (lambda **kw: torch_flash.rms_norm(x, w, **kw), lambda **kw: torch_flash.add_rms_norm(x, r, w, **kw)[0]):
        y, cast = fn(out_dtype=torch.bfloat16), fn().to(torch.bfloat16)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, cast, atol=0, rtol=2**-7)
        g = torch.randn_like(y)
        for a, b in zip(torch.autograd.grad(y, (x, w), g), torch.autograd.grad(cast, (x, w), g)):
            torch.testing.assert_close(a, b)


def test_residual_in_fp32():
    x, r = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(2, 64, dtype=torch.float32)
    y, s = torch_flash.add_rms_norm(x, r, None, residual_in_fp32=True)
    assert s.dtype == torch.float32 and y.dtype == torch.bfloat16
    torch.testing.assert_close(s, x.float() + r)


def test_large_hidden():
    x = torch.randn(2, 70000)
    assert_rel_close(torch_flash.rms_norm(x), ref.rms_norm(x.double()), TOL[torch.float32])


@pytest.mark.parametrize("bad,match", [
    (lambda: torch_flash.rms_norm(torch.randn(4, 8), torch.randn(7)), "weight has 7 elements"),
    (lambda: torch_flash.rms_norm(torch.randn(4, 0), None), "non-empty last dimension"),
    (lambda: torch_flash.rms_norm(torch.randint(0, 3, (4, 8)), None), "dtype"),
    (lambda: torch_flash.rms_norm(torch.randn(4, 8), torch.randn(2, 8)), "weight must have 1 dimensions"),
    (lambda: torch_flash.add_rms_norm(torch.randn(4, 8), torch.randn(4, 9)), "residual shape"),
    (lambda: torch_flash.rms_norm(torch.randn(4, 8), None, -1.0), "eps must be >= 0"),
])
def test_bad_inputs(bad, match):
    with pytest.raises(ValueError, match=f"flash.(add_)?rms_norm: .*{match}"):
        bad()


def test_empty_batch():
    x = torch.randn(0, 5, 32, requires_grad=True)
    y = torch_flash.rms_norm(x, torch.ones(32))
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_add_outputs_have_x_layout():
    """y and residual_out have empty_like(x)'s strides, as the fake says (opcheck cannot see this
    case: it clones an expanded x contiguous). The reference path gave them the layout of a
    permuted residual when x was expanded."""
    x, r = torch.randn(16).expand(4, 6, 16), torch.randn(6, 4, 16).transpose(0, 1)
    for out in torch_flash.add_rms_norm(x, r, torch.randn(16)):
        assert out.stride() == torch.empty_like(x).stride()


def test_inputs_untouched():
    x, r, w = torch.randn(3, 32), torch.randn(3, 32), torch.randn(32)
    copies = [t.clone() for t in (x, r, w)]
    torch_flash.add_rms_norm(x, r, w)
    for a, b in zip((x, r, w), copies):
        assert torch.equal(a, b)


@pytest.mark.parametrize("grad,match", [
    (torch.randn(8), r"grad_y has shape \(8,\), expected x's \(4, 8\)"),  # would broadcast
    (torch.randn(4, 8).to("meta"), "all tensors must be on one device"),
    (torch.randint(0, 3, (4, 8)), "grad_y has dtype torch.int64"),
])
def test_backward_checks_the_upstream_gradient(grad, match):
    """The backward ops are public: a mis-shaped gradient raises instead of broadcasting into a
    silently wrong answer (or a kernel reading out of bounds)."""
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(ValueError, match=f"flash.rms_norm_backward: {match}"):
        torch.ops.flash.rms_norm_backward(grad, x, w, 1e-6, 0.0, True)
    add_match = match.replace("x's", "residual_out's")
    with pytest.raises(ValueError, match=f"flash.add_rms_norm_backward: {add_match}"):
        torch.ops.flash.add_rms_norm_backward(grad, None, x, w, 1e-6, 0.0, True, torch.float32)
    with pytest.raises(ValueError, match=r"flash.add_rms_norm_backward: grad_residual_out has shape \(4, 1\)"):
        torch.ops.flash.add_rms_norm_backward(torch.randn(4, 8), torch.randn(4, 1), x, w, 1e-6, 0.0, True,
                                              torch.float32)


def test_backward_checks_x_dtype():
    """add_rms_norm_backward rounds xhat to x_dtype for dweight: an integer dtype raises instead
    of rounding it into a silently wrong dweight."""
    for mode in (contextlib.nullcontext(), FakeTensorMode()):  # the op, then its fake
        with mode:
            s, w = torch.randn(4, 8), torch.randn(8)
            with pytest.raises(ValueError, match="flash.add_rms_norm_backward: x_dtype must be a floating dtype"):
                torch.ops.flash.add_rms_norm_backward(torch.randn(4, 8), None, s, w, 1e-6, 0.0, True, torch.int32)
