"""compat's return_attn_probs=True: FlashAttention's (out, softmax_lse, S_dmask), S_dmask decoded
the way FlashAttention's tests decode it (sign = dropout pattern, abs = unnormalised
probabilities) must be the dropout mask and probabilities the call used."""
import math

import pytest
import torch

from torch_flash import compat
from _utils import assert_rel_close


def _decode(S, sq, sk):
    """FlashAttention's test helpers, for a block size covering the row: (keep, exp(s - rowmax))."""
    S = S[:, :, :sq, :sk]
    return S >= 0, S.abs()


def _dense_ref(q, k, v, keep, dropout_p, causal=False, window=(-1, -1), slopes=None):
    """float64 (out, p) of (B, S, H, D) tensors with the given keep mask (B, H, Sq, Sk)."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    sq, sk = s.shape[-2:]
    rel = torch.arange(sk) - (torch.arange(sq)[:, None] + sk - sq)  # key minus diagonal
    if slopes is not None:
        s = s - slopes.double().reshape(-1, slopes.shape[-1], 1, 1) * rel.abs()
    hidden = torch.zeros(sq, sk, dtype=torch.bool)
    right = 0 if causal else window[1]
    if right >= 0:
        hidden |= rel > right
    if window[0] >= 0:
        hidden |= rel < -window[0]
    p = torch.softmax(s.masked_fill(hidden, -math.inf), -1)
    out = (p * keep / (1 - dropout_p)) @ v
    return out.transpose(1, 2), p


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(2, 1)),
                                dict(causal=True, alibi_slopes="per_batch")])
def test_dense_s_dmask_is_the_calls_dropout(kw):
    B, S, H, D, p_drop = 2, 9, 2, 16, 0.3
    q, k, v = (torch.randn(B, S, H, D) for _ in range(3))
    if kw.get("alibi_slopes") == "per_batch":
        kw = dict(kw, alibi_slopes=torch.rand(B, H))
    out, lse, S_dmask = compat.flash_attn_func(q, k, v, p_drop, return_attn_probs=True, **kw)
    assert S_dmask.shape == (B, H, 128, 128) and S_dmask.dtype == q.dtype
    keep, unnorm = _decode(S_dmask, S, S)
    want, p = _dense_ref(q, k, v, keep, p_drop, kw.get("causal", False), kw.get("window_size", (-1, -1)),
                         kw.get("alibi_slopes"))
    seen = p > 0  # masked entries read as kept (-0.0 >= 0), as in FlashAttention's tests
    assert 0.1 < (~keep & seen).sum() / seen.sum() < 0.5  # about p_drop of the visible entries dropped
    assert_rel_close(out, want, 1e-5)
    # normalised as FlashAttention's normalize_flash_attn_S does with one block: exp(rowmax - lse)
    rowmax = unnorm.double().log().amax(-1)  # the row's largest entry is exp(0) = 1
    assert torch.allclose(rowmax, torch.zeros_like(rowmax), atol=1e-6)
    assert_rel_close(unnorm.double() / unnorm.double().sum(-1, keepdim=True), p, 1e-5)
    assert torch.all(S_dmask[:, :, S:] == 0) and torch.all(S_dmask[..., S:] == 0)


def test_varlen_s_dmask_per_sequence():
    H, D, p_drop = 2, 16, 0.25
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    q, k, v = (torch.randn(10, H, D) for _ in range(3))
    out, lse, S_dmask = compat.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, p_drop, causal=True,
                                                      return_attn_probs=True)
    assert S_dmask.shape == (2, H, 128, 128) and lse.shape == (H, 10)
    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        keep, unnorm = _decode(S_dmask[b:b + 1], e - s, e - s)
        want, p = _dense_ref(q[None, s:e], k[None, s:e], v[None, s:e], keep, p_drop, causal=True)
        assert_rel_close(out[s:e], want[0], 1e-5)
        assert_rel_close(unnorm.double() / unnorm.double().sum(-1, keepdim=True), p, 1e-5)


def test_no_dropout_gives_an_empty_s_dmask():
    """As FlashAttention: S_dmask is only filled when dropout_p > 0."""
    q = torch.randn(1, 4, 2, 16)
    out, lse, S_dmask = compat.flash_attn_qkvpacked_func(torch.stack((q, q, q), 2), return_attn_probs=True)
    assert S_dmask.numel() == 0 and lse.shape == (1, 2, 4)


def test_s_dmask_matches_the_triton_kernels_dropout(force_backend):
    """The Triton kernels draw the same Philox mask (CPU under the interpreter)."""
    from _utils import force_triton_kernels
    force_triton_kernels(force_backend)
    q, k, v = (torch.randn(1, 16, 2, 16) for _ in range(3))
    out, _, S_dmask = compat.flash_attn_func(q, k, v, 0.4, causal=True, return_attn_probs=True)
    keep, _ = _decode(S_dmask, 16, 16)
    want, _ = _dense_ref(q, k, v, keep, 0.4, causal=True)
    assert_rel_close(out, want, 1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_s_dmask(dtype):
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=dtype) for _ in range(3))
    out, _, S_dmask = compat.flash_attn_func(q, k, v, 0.17, causal=True, return_attn_probs=True)
    assert S_dmask.shape == (2, 4, 384, 384)
    keep, _ = _decode(S_dmask.float().cpu(), 300, 300)
    want, _ = _dense_ref(q.cpu(), k.cpu(), v.cpu(), keep, 0.17, causal=True)
    assert_rel_close(out.cpu(), want, 1e-2)
