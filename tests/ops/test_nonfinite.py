"""Non-finite inputs: NaN and infinity propagate through every op as through PyTorch's own
(F.rms_norm, F.layer_norm, F.cross_entropy, the rotation by formula), row by row: a NaN logit
gives a NaN loss, not a silent finite number, and what a mask or an ignored target removes does
not leak into the rows that never see it. Two differences: a +inf logit off the target gives
the Triton kernels a +inf loss where PyTorch's log_softmax (and the reference path) gives NaN
(inf - inf), and a NaN key leaves the rows whose causal window excludes it finite where SDPA's
math adds the mask to NaN scores.
On CPU the Triton kernels run under the interpreter; on a GPU the default path and Triton's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_flash

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAN, INF = float("nan"), float("inf")


@pytest.fixture(params=[None, "triton"], ids=["default", "triton"])
def backend(request, force_backend):
    force_backend(request.param)
    return request.param


def assert_same_nonfinite(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """NaN where ref has NaN, the same infinities, finite values close."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.equal(out.isnan(), ref.isnan()), f"{what}: NaN at {out.isnan().nonzero().tolist()}, " \
                                                  f"expected at {ref.isnan().nonzero().tolist()}"
    assert torch.equal(out.isinf() & (out > 0), ref.isinf() & (ref > 0)), f"{what}: +inf differs"
    assert torch.equal(out.isinf() & (out < 0), ref.isinf() & (ref < 0)), f"{what}: -inf differs"
    finite = ref.isfinite()
    assert finite.any(), f"{what}: the case has no finite values to compare"
    err = (out[finite] - ref[finite]).norm() / ref[finite].norm().clamp_min(1e-30)
    assert err < 1e-4, f"{what}: relative error {err:.2e} on the finite values"


def _rows(n=6, m=64):
    x = torch.randn(n, m, dtype=torch.float64)
    x[1, 3] = NAN
    x[2, 5] = INF
    x[3, 7] = -INF
    return x.float().to(DEV)


def test_rms_norm(backend):
    x, w = _rows(), torch.randn(64, device=DEV)
    assert_same_nonfinite(torch_flash.rms_norm(x, w), F.rms_norm(x, (64,), w, eps=1e-6), "rms_norm")


def test_layer_norm(backend):
    x, w, b = _rows(), torch.randn(64, device=DEV), torch.randn(64, device=DEV)
    assert_same_nonfinite(torch_flash.layer_norm(x, w, b), F.layer_norm(x, (64,), w, b, eps=1e-5), "layer_norm")


def _logits():
    """Rows: clean; a NaN; +inf at the target; +inf elsewhere; -inf off the target (a masked
    class: finite loss); -inf at the target; NaN in an ignored row."""
    x = torch.randn(7, 40, dtype=torch.float64)
    t = torch.randint(0, 40, (7,))
    t[2], t[3], t[4], t[5] = 0, 0, 0, 0
    x[1, 9] = NAN
    x[2, 0] = INF
    x[3, 7] = INF
    x[4, 1:8] = -INF
    x[5, 0] = -INF
    t[6] = -100
    x[6, 2] = NAN
    return x.float().to(DEV), t.to(DEV)


def test_cross_entropy(backend):
    x, t = _logits()
    got = torch_flash.cross_entropy(x, t, reduction="none")
    ref = F.cross_entropy(x, t, reduction="none")
    # +inf off the target: NaN by the formula (log_softmax's inf - inf), +inf from the Triton
    # kernels' online log-sum-exp; not finite either way
    assert ref[3].isnan() and (got[3].isnan() or got[3] == INF)
    ref[3] = got[3]
    assert_same_nonfinite(got, ref, "cross_entropy rows")
    assert torch_flash.cross_entropy(x, t).isnan(), "a NaN row must make the mean NaN"
    clean = [0, 4, 6]  # the ignored row's NaN does not reach the mean
    assert_same_nonfinite(torch_flash.cross_entropy(x[clean], t[clean]),
                          F.cross_entropy(x[clean], t[clean]), "cross_entropy mean of clean rows")


def test_linear_cross_entropy(backend):
    h = torch.randn(5, 32, device=DEV)
    w = torch.randn(40, 32, device=DEV)
    t = torch.randint(0, 40, (5,), device=DEV)
    h[1, 4] = NAN
    t[3] = -100
    h[3, 0] = INF  # ignored: its infinity stays out of the loss
    got = torch_flash.linear_cross_entropy(h, w, t, reduction="none")
    assert_same_nonfinite(got, F.cross_entropy(h @ w.T, t, reduction="none"), "linear_cross_entropy rows")


def _attention_inputs():
    q, k, v = (torch.randn(1, 2, 12, 16, device=DEV) for _ in range(3))
    bias = torch.zeros(1, 1, 12, 12, device=DEV)
    bias[..., 3, 1] = -INF  # removes key 1 from row 3
    return q, k, v, bias


def _sdpa_causal(q, k, v, bias):
    mask = torch.ones(12, 12, dtype=torch.bool, device=DEV).tril()
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), bias.double().masked_fill(~mask, -INF))


def test_attention_nan_key(backend):
    """A NaN key (head 0, position 5) makes exactly the rows that see it NaN."""
    q, k, v, bias = _attention_inputs()
    clean = _sdpa_causal(q, k, v, bias)
    k[0, 0, 5, 2] = NAN
    got = torch_flash.attention(q, k, v, bias, causal=True)
    assert got[0, 0, 5:].isnan().all(), "rows that see the NaN key"
    assert_same_nonfinite(got[0, 0, :5], clean[0, 0, :5], "attention rows before the NaN key")
    assert_same_nonfinite(got[0, 1], clean[0, 1], "attention, the other head")


def test_attention_infinite_value(backend):
    """+inf in the value of key 0, which every row sees, makes that dim +inf in every row."""
    q, k, v, bias = _attention_inputs()
    clean = _sdpa_causal(q, k, v, bias)
    v[0, 1, 0, 3] = INF
    got = torch_flash.attention(q, k, v, bias, causal=True)
    assert (got[0, 1, :, 3] == INF).all()
    assert_same_nonfinite(got[0, 1, :, 4:], clean[0, 1, :, 4:], "attention, the value's other dims")
    assert_same_nonfinite(got[0, 0], clean[0, 0], "attention, the other head")


def test_rotary(backend):
    x = torch.randn(1, 2, 6, 16, device=DEV)  # (B, H, S, D)
    x[0, 1, 2, 3] = NAN
    x[0, 0, 4, 12] = INF
    angles = torch.randn(6, 8, device=DEV)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = cos.double(), sin.double()
    ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)  # GPT-NeoX halves
    assert_same_nonfinite(torch_flash.rotary(x, cos, sin), ref, "rotary")
