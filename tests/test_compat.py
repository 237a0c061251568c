"""torch_flash.compat: FlashAttention 2's signatures and (B, S, H, D) layout."""
import pytest
import torch
import torch.nn.functional as F

from torch_flash import compat
from _utils import assert_rel_close


def _sdpa(q, k, v, **kw):  # the same attention in SDPA's layout, as reference
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         enable_gqa=True, **kw)
    return out.transpose(1, 2)


def test_flash_attn_func_forward_backward():
    q, k, v = (torch.randn(2, 7, h, 16, requires_grad=True) for h in (4, 2, 2))
    out, lse, probs = compat.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == (2, 7, 4, 16) and out.is_contiguous() and lse.shape == (2, 4, 7) and probs is None
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = _sdpa(*leaves, is_causal=True)
    assert_rel_close(out, ref, 1e-5)
    g = torch.randn_like(out)
    torch.autograd.backward(out, g)
    torch.autograd.backward(ref, g)
    for a, b in zip((q, k, v), leaves):
        assert_rel_close(a.grad, b.grad, 1e-5)


def test_packed_variants_match():
    qkv = torch.randn(2, 9, 3, 4, 16)
    q, k, v = qkv.unbind(2)
    want = compat.flash_attn_func(q, k, v, softmax_scale=0.3, window_size=(3, 1))
    torch.testing.assert_close(compat.flash_attn_qkvpacked_func(qkv, softmax_scale=0.3, window_size=(3, 1)), want)
    kv = torch.stack((k, v), 2)
    torch.testing.assert_close(compat.flash_attn_kvpacked_func(q, kv, softmax_scale=0.3, window_size=(3, 1)), want)


def test_varlen_matches_per_sequence():
    lens = [3, 5]
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = (torch.randn(8, h, 16) for h in (4, 2, 2))
    out = compat.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = _sdpa(q[None, s:e], k[None, s:e], v[None, s:e], is_causal=True)[0]
        assert_rel_close(out[s:e], ref, 1e-5)


def test_alibi_is_refused():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="compat.flash_attn_func: alibi_slopes"):
        compat.flash_attn_func(q, q, q, alibi_slopes=torch.ones(2))
