"""The Hopper logits GEMM of csrc/linear_cross_entropy (flash.linear_cross_entropy_logits_sm90,
from torch_flash._C) against cuBLAS and its reference, and linear_cross_entropy's chunks on it
against the loss kernels' own statistics. Needs an sm_90 GPU and the built extension; on other
machines tests/ops/test_linear_cross_entropy.py covers the op's reference body and
tests/kernels/test_triton_cross_entropy.py the launcher's path through it."""
import math

import pytest
import torch

import torch_flash  # noqa: F401  (registers the ops)
from torch_flash import _extension
from torch_flash.kernels.triton import cross_entropy as K
from torch_flash.reference import linear_cross_entropy as ref
from _utils import rel_err

pytestmark = pytest.mark.cuda

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and _extension.loaded()
        and "flash::linear_cross_entropy_logits_sm90" in _extension.build_info()["ops"]):
    pytest.skip("needs an sm_90 GPU and torch_flash._C with the logits kernel (python -m torch_flash build)",
                allow_module_level=True)

OP = torch.ops.flash.linear_cross_entropy_logits_sm90


def _pairs(n_classes, n):
    return torch.empty(-(-n_classes // 128), -(-n // 128) * 128, 2, device="cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_classes, n, hid, wide", [(1000, 300, 64, 320), (128256, 1024, 512, 1024),
                                                      (200, 16, 8, 16), (129, 1030, 4096, 1040)])
def test_logits_sm90(dtype, n_classes, n, hid, wide):
    """Logits as cuBLAS's within rounding (into a column slice of a wider buffer, as a chunk's
    token slice), and per class tile the max and sum of exp2 of those stored logits (so each
    token's lse) as the reference computes them from them; nothing else in the buffer written."""
    w = (torch.randn(n_classes, hid, device="cuda") * hid**-0.5 * 3).to(dtype)
    h = torch.randn(n, hid, device="cuda").to(dtype)
    buf = torch.full((n_classes, wide), 7.0, dtype=dtype, device="cuda")
    pairs = _pairs(n_classes, n)
    OP(w, h, buf[:, :n], pairs)
    logits = buf[:, :n]
    assert rel_err(logits, w @ h.t()) < 2.0**-8
    assert (buf[:, n:] == 7.0).all()
    want = torch.empty_like(pairs)
    ref.linear_cross_entropy_logits_sm90(w, h, logits.clone(), want)  # statistics of our own logits
    m, s = pairs[:, :n].unbind(-1)
    torch.testing.assert_close(m, want[:, :n, 0], rtol=0, atol=0)
    torch.testing.assert_close(s, want[:, :n, 1], rtol=1e-5, atol=0)
    lse = torch.logsumexp((m + torch.log2(s)) * math.log(2), 0)
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), 0), rtol=1e-6, atol=1e-5)


def test_logits_sm90_bad_inputs():
    """The binding's checks (the kernel's TMA needs 16-byte aligned rows), naming the op."""
    w = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    logits = torch.empty(256, 40, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="flash.linear_cross_entropy_logits_sm90: logits row stride 36"):
        OP(w, h, logits.view(-1)[:256 * 36].view(256, 36)[:, :32], _pairs(256, 32))
    with pytest.raises(RuntimeError, match="flash.linear_cross_entropy_logits_sm90: pairs must be"):
        OP(w, h, logits[:, :32], _pairs(256, 32)[:1])
    with pytest.raises(RuntimeError, match="flash.linear_cross_entropy_logits_sm90: hidden must be a CUDA tensor"):
        OP(w, h.cpu(), logits[:, :32], _pairs(256, 32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, hid, n_classes, chunk_size", [(3000, 256, 50257, 0), (2500, 1024, 32000, 512),
                                                            (8192, 4096, 128256, 0)])
def test_lce_fwd_logits_sm90(monkeypatch, dtype, n, hid, n_classes, chunk_size):
    """The launcher with the Hopper GEMM's statistics (it ran: counted) against itself with the
    loss kernels' own: the same loss and gradients but for the statistics' fp32 summation order;
    at LLaMA-3 8B's lm-head too (5120 tokens resident in GEMM slices, three chunks)."""
    calls = []
    stats = K._logits_stats_sm90
    monkeypatch.setattr(K, "_logits_stats_sm90", lambda *args: calls.append(args[1].shape[0]) or stats(*args))
    h = torch.randn(n, hid, device="cuda").to(dtype)
    w = (torch.randn(n_classes, hid, device="cuda") * hid**-0.5).to(dtype)
    t = torch.randint(0, n_classes, (n,), device="cuda")
    t[::7] = -100
    kw = dict(ignore_index=-100, label_smoothing=0.0, z_loss=1e-4, softcap=0.0, reduction="mean",
              chunk_size=chunk_size)
    got = K.lce_fwd(h, w, t, None, **kw)
    assert calls and sum(calls) >= n
    monkeypatch.setattr(K, "use_logits_sm90", False)
    calls.clear()
    own = K.lce_fwd(h, w, t, None, **kw)
    assert not calls
    assert rel_err(got[0], own[0]) < 1e-6
    for g, o in zip(got[1:3], own[1:3]):
        assert rel_err(g, o) < 1e-3
