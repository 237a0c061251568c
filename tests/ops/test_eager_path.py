"""torch_flash/ops/_autograd.py's eager path: a plain call runs the op's body (or, recording a
gradient, its autograd rule) without the dispatcher, and every call that is not plain (traced,
under a mode, fake, vmapped) still reaches torch.ops.flash, so that tracers and modes see the op."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import torch_flash
from torch_flash.ops import _autograd


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _inputs():
    return torch.randn(4, 32), torch.randn(32)


def test_plain_call_skips_the_dispatcher(monkeypatch):
    x, w = _inputs()
    monkeypatch.setattr(torch.ops.flash.rms_norm, "default", None)  # reaching it would raise
    torch.testing.assert_close(torch_flash.rms_norm(x, w), _autograd._BODIES["rms_norm"](x, w))


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_gradient_call_skips_the_dispatcher(op, monkeypatch):
    """Recording a gradient, a plain call runs the op's autograd rule directly (_direct_rule):
    the same output, gradients and saved state as through torch.ops.flash, bit for bit."""
    x, w = _inputs()
    fn = getattr(torch_flash, op)

    def run():
        leaves = [t.clone().requires_grad_() for t in (x, w)]
        y = fn(*leaves)
        dy = torch.linspace(-1, 1, y.numel()).view_as(y)
        return y, torch.autograd.grad(y, leaves, dy)
    monkeypatch.setattr(_autograd, "_direct_rule", lambda op: None)  # the dispatcher's way
    expected, expected_grads = run()
    monkeypatch.undo()
    monkeypatch.setattr(getattr(torch.ops.flash, op), "default", None)  # reaching it would raise
    got, grads = run()
    assert torch.equal(got, expected) and all(map(torch.equal, grads, expected_grads))


@pytest.mark.parametrize("how", ["dispatch mode", "make_fx", "make_fx pre_dispatch", "jit trace", "fake",
                                 "gradient under a mode"])
def test_calls_that_are_not_plain_reach_the_op(how):
    x, w = _inputs()
    if how == "dispatch mode":
        with _Recorder() as rec:
            torch_flash.rms_norm(x, w)
        assert "flash.rms_norm.default" in rec.ops
    elif how.startswith("make_fx"):
        gm = make_fx(lambda x, w: torch_flash.rms_norm(x, w), pre_dispatch=how.endswith("pre_dispatch"))(x, w)
        assert any(n.target is torch.ops.flash.rms_norm.default for n in gm.graph.nodes)
    elif how == "jit trace":
        traced = torch.jit.trace(lambda x, w: torch_flash.rms_norm(x, w), (x, w))
        assert "flash::rms_norm" in str(traced.graph)
    elif how == "fake":
        with FakeTensorMode() as mode:
            y = torch_flash.rms_norm(mode.from_tensor(x), mode.from_tensor(w))
        assert isinstance(y, FakeTensor) and y.shape == x.shape
    else:
        x.requires_grad_()
        with _Recorder() as rec:
            y = torch_flash.rms_norm(x, w)
            assert y.grad_fn is not None
            y.sum().backward()
        assert "flash.rms_norm.default" in rec.ops and "flash.rms_norm_backward.default" in rec.ops
        assert x.grad is not None and torch.isfinite(x.grad).all()


def test_vmap_is_not_plain():
    """Under vmap the tensors are batched wrappers of plain type: the transform is what tells."""
    x, w = torch.randn(3, 4, 32), torch.randn(32)
    seen = []

    def one(t):
        seen.append(_autograd._classify((t, w), {}))
        return torch_flash.rms_norm(t, w)
    out = torch.vmap(one)(x)
    assert seen == [_autograd._NOT_PLAIN]
    torch.testing.assert_close(out, torch_flash.rms_norm(x, w))


def test_in_place_call_moves_version_counters():
    """Without the dispatcher, an in-place op's written tensors still count a write (autograd
    relies on it to refuse stale saved tensors)."""
    x = torch.randn(1, 2, 8, 16)
    cos, sin = torch_flash.rotary_cos_sin(8, 16)
    before = x._version
    torch_flash.rotary(x, cos, sin, inplace=True)
    assert x._version > before
    q = torch.randn(1, 2, 1, 16)
    k_cache, v_cache = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    k_new, v_new = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    versions = (k_cache._version, v_cache._version)
    torch_flash.attention_decode(q, k_cache, v_cache, torch.tensor([3], dtype=torch.int32), k_new, v_new)
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    torch.testing.assert_close(k_cache[:, :, 3:4], k_new)


def test_plans_check_once_per_signature(monkeypatch, force_backend):
    """A norm's checks and choice of path run on the first call of a signature; a later call
    with the same signature reuses them (same result), a new shape, dtype, alignment or forced
    backend makes a new plan, and bad input still raises."""
    from torch_flash.ops import _norm
    from torch_flash.ops import rms_norm as R
    monkeypatch.setattr(_norm, "FORWARD_PLANS", type(_norm.FORWARD_PLANS)())
    checks = []
    real = R.check_args
    monkeypatch.setattr(R, "check_args", lambda *a, **k: checks.append(a[1].shape) or real(*a, **k))
    x, w = _inputs()
    first = torch_flash.rms_norm(x, w)
    torch.testing.assert_close(torch_flash.rms_norm(x.clone(), w), first)
    assert len(checks) == 1
    buf = torch.randn(4 * 32 + 1)
    torch_flash.rms_norm(buf[1:].view(4, 32), w)  # 4-byte offset: another alignment
    torch_flash.rms_norm(x.double(), w.double())
    torch_flash.rms_norm(torch.randn(5, 32), w)
    assert len(checks) == 4
    force_backend("reference")
    torch.testing.assert_close(torch_flash.rms_norm(x, w), first)
    assert len(checks) == 5
    with pytest.raises(ValueError, match="flash.rms_norm: weight has 31 elements"):
        torch_flash.rms_norm(x, torch.randn(31))
    kept = dict(_norm.FORWARD_PLANS._plans)
    with FakeTensorMode() as mode:  # traced: checked every time, nothing kept
        torch_flash.rms_norm(mode.from_tensor(x), mode.from_tensor(w))
    assert _norm.FORWARD_PLANS._plans == kept


def test_unhashable_argument_gets_the_op_error():
    """A list where a tensor belongs cannot key a plan: the op's own check names it."""
    x, _ = _inputs()
    with pytest.raises(TypeError, match="flash.rms_norm: weight must be a Tensor, got list"):
        torch_flash.rms_norm(x, [1.0] * 32)
