"""torch_flash.compat: FlashAttention 2's signatures and (B, S, H, D) layout."""
import warnings

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
    assert out.shape == (2, 7, 4, 16) and out.is_contiguous() and lse.shape == (2, 4, 7) and probs.numel() == 0
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


def test_s_aux_sinks():
    """s_aux (FlashAttention 3's name, by which transformers passes gpt-oss's sinks) is the ops'
    sinks: a softmax column per head of logit s_aux[h] and no value; dense and varlen, with its
    gradient. With return_attn_probs and dropout it is refused (S_dmask cannot show it)."""
    q, k, v = (torch.randn(2, 7, h, 16) for h in (4, 2, 2))
    sinks = torch.tensor([-1.0, 0.5, 2.0, -float("inf")], requires_grad=True)
    out = compat.flash_attn_func(q, k, v, causal=True, s_aux=sinks)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) * 16 ** -0.5
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), -float("inf"))
    s64 = sinks.detach().double().requires_grad_()
    full = torch.cat((scores.double(), s64.reshape(1, 4, 1, 1).expand(2, 4, 7, 1)), -1)
    want = torch.einsum("bhqk,bkhd->bqhd", full.softmax(-1)[..., :-1], v.double().repeat_interleave(2, 2))
    assert_rel_close(out, want, 1e-5)
    g = torch.randn_like(want)
    out.backward(g.float())
    want.backward(g)
    assert_rel_close(sinks.grad, s64.grad, 1e-5)
    cu = torch.tensor([0, 7, 14], dtype=torch.int32)
    packed = compat.flash_attn_varlen_func(*(t.flatten(0, 1) for t in (q, k, v)), cu, cu, 7, 7, causal=True,
                                           s_aux=sinks)
    assert_rel_close(packed, want.flatten(0, 1), 1e-5)
    with pytest.raises(ValueError, match="flash_attn_func: return_attn_probs=True with dropout and s_aux"):
        compat.flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True, s_aux=sinks)


def _alibi_bias(slopes, sq, sk):
    """FlashAttention 2's ALiBi as a dense (B or 1, H, Sq, Sk) bias: -slope * |i + Sk - Sq - j|."""
    dist = (torch.arange(sq)[:, None] + sk - sq - torch.arange(sk)).abs()
    return -slopes.reshape(-1, slopes.shape[-1], 1, 1) * dist


@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi_slopes(per_batch):
    """alibi_slopes (H,) or (B, H) reach the ops: the same as SDPA with the dense bias, for the
    packed variants too."""
    q, k, v = (torch.randn(2, s, 4, 16) for s in (5, 9, 9))
    slopes = torch.rand((2, 4) if per_batch else (4,))
    out = compat.flash_attn_func(q, k, v, alibi_slopes=slopes)
    assert_rel_close(out, _sdpa(q, k, v, attn_mask=_alibi_bias(slopes, 5, 9)), 1e-5)
    qkv = torch.randn(2, 9, 3, 4, 16)
    q, k, v = qkv.unbind(2)
    want = compat.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    torch.testing.assert_close(compat.flash_attn_qkvpacked_func(qkv, causal=True, alibi_slopes=slopes), want)
    torch.testing.assert_close(compat.flash_attn_kvpacked_func(q, torch.stack((k, v), 2), causal=True,
                                                               alibi_slopes=slopes), want)


def test_varlen_alibi_per_sequence():
    """(batch, H) slopes: row b for sequence b, distances within the sequence."""
    cu_q, cu_k = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 4, 11], dtype=torch.int32)
    q, k, v = torch.randn(8, 4, 16), torch.randn(11, 4, 16), torch.randn(11, 4, 16)
    slopes = torch.rand(2, 4)
    out = compat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, alibi_slopes=slopes)
    for b in range(2):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        bias = _alibi_bias(slopes[b], sq.stop - sq.start, sk.stop - sk.start)
        assert_rel_close(out[sq], _sdpa(q[None, sq], k[None, sk], v[None, sk], attn_mask=bias)[0], 1e-5)


def test_varlen_packed_variants_match():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    qkv = torch.randn(8, 3, 4, 16)
    q, k, v = qkv.unbind(1)
    slopes = torch.rand(4)
    want = compat.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True, alibi_slopes=slopes)
    torch.testing.assert_close(compat.flash_attn_varlen_qkvpacked_func(qkv, cu, 5, causal=True, alibi_slopes=slopes),
                               want)
    torch.testing.assert_close(compat.flash_attn_varlen_kvpacked_func(q, torch.stack((k, v), 1), cu, cu, 5, 5,
                                                                      causal=True, alibi_slopes=slopes), want)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_backward(varlen, deterministic):
    """deterministic=True: the op's backward (where it unpacks its saved tensors) runs under
    torch.use_deterministic_algorithms(True), which is off again afterwards; no warning."""
    q, k, v = (torch.randn(2, 5, 2, 16, requires_grad=True) for _ in range(3))
    modes = []

    def unpack(t):
        modes.append(torch.are_deterministic_algorithms_enabled())
        return t
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack), warnings.catch_warnings():
        warnings.simplefilter("error")
        if varlen:
            cu = torch.tensor([0, 4, 10], dtype=torch.int32)
            out = compat.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 6, 6,
                                                causal=True, deterministic=deterministic)
        else:
            out = compat.flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
    out.sum().backward()
    assert modes and all(m == deterministic for m in modes)
    assert not torch.are_deterministic_algorithms_enabled()
    assert q.grad is not None and k.grad is not None


@pytest.mark.parametrize("window", [(3, 0), [3, 0], (torch.tensor(3), torch.tensor(0)), torch.tensor([3, 0])])
def test_window_size_ints_or_tensors(window):
    """FlashAttention's tests pass torch.randint(0, sk, (2,)): its entries are 0-d tensors."""
    q, k, v = (torch.randn(2, 6, 2, 16) for _ in range(3))
    want = compat.flash_attn_func(q, k, v, window_size=(3, 0))
    torch.testing.assert_close(compat.flash_attn_func(q, k, v, window_size=window), want, rtol=0, atol=0)
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    out = compat.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 6, 6,
                                        window_size=window)
    torch.testing.assert_close(out.view(2, 6, 2, 16), want)


@pytest.mark.parametrize("window,match", [((3,), "window_size must be a pair"), (3, "window_size must be a pair"),
                                          ((1.5, 0), "window_size entries must be ints"),
                                          ((torch.tensor(1.0), 0), "window_size entries must be ints")])
def test_window_size_refused(window, match):
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match=f"compat.flash_attn_func: {match}"):
        compat.flash_attn_func(q, q, q, window_size=window)


# --- flash_attn_with_kvcache -----------------------------------------------------------

def _kvcache_inputs(B=2, Sq=1, Snew=1, Hq=4, Hkv=2, D=16, S=12, rows=None):
    """FlashAttention layout: q (B, Sq, Hq, D), caches (rows, S, Hkv, D), k/v (B, Snew, Hkv, D)."""
    rows = B if rows is None else rows
    q = torch.randn(B, Sq, Hq, D)
    kc, vc = torch.randn(rows, S, Hkv, D), torch.randn(rows, S, Hkv, D)
    k, v = torch.randn(B, Snew, Hkv, D), torch.randn(B, Snew, Hkv, D)
    return q, kc, vc, k, v


def _decode_op(q, kc, vc, cs, k=None, v=None, **kw):
    """flash.attention_decode on the SDPA-layout views of FlashAttention-layout tensors."""
    from torch_flash.ops.attention_decode import attention_decode
    t = [None if x is None else x.transpose(1, 2) for x in (q, kc, vc, k, v)]
    out, lse = attention_decode(t[0], t[1], t[2], cs, t[3], t[4], **kw)
    return out.transpose(1, 2), lse


def test_with_kvcache_matches_the_op():
    q, kc, vc, k, v = _kvcache_inputs(Sq=2, Snew=2)
    cs = torch.tensor([3, 7], dtype=torch.int32)
    kc2, vc2 = kc.clone(), vc.clone()
    out, lse = compat.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=cs, causal=True,
                                              window_size=(4, 0), softcap=3.0, softmax_scale=0.3,
                                              return_softmax_lse=True)
    want, want_lse = _decode_op(q, kc2, vc2, cs, k, v, causal=True, window=(4, 0), softcap=3.0, scale=0.3)
    assert out.shape == (2, 2, 4, 16) and out.is_contiguous() and lse.shape == (2, 4, 2)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # appended in place, (B, S, H, D)
    assert torch.equal(kc[1, 7:9], k[1]) and torch.equal(vc[0, 3:5], v[0])


def test_with_kvcache_int_and_default_seqlens():
    q, kc, vc, k, v = _kvcache_inputs()
    out = compat.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=5)
    want, _ = _decode_op(q, kc.clone(), vc.clone(), torch.tensor([5, 5], dtype=torch.int32), k, v, causal=False)
    torch.testing.assert_close(out, want)
    full = compat.flash_attn_with_kvcache(q, kc, vc)  # no cache_seqlens: every slot is a key
    ref = _sdpa(q, kc, vc)
    assert_rel_close(full, ref, 1e-5)


def test_with_kvcache_paged():
    q, kc, vc, k, v = _kvcache_inputs(S=12)
    page = 4
    order = torch.randperm(8)[:6]
    kp, vp = torch.randn(8, page, 2, 16), torch.randn(8, page, 2, 16)
    kp[order], vp[order] = kc.reshape(6, page, 2, 16), vc.reshape(6, page, 2, 16)
    table = order.view(2, 3).int()
    cs = torch.tensor([4, 9], dtype=torch.int32)
    out = compat.flash_attn_with_kvcache(q, kp, vp, k, v, cache_seqlens=cs, block_table=table, causal=True)
    want, _ = _decode_op(q, kc, vc, cs, k, v, causal=True)
    torch.testing.assert_close(out, want)
    assert torch.equal(kp[table.long()].reshape(2, 12, 2, 16), kc)


def test_with_kvcache_cache_batch_idx():
    q, kc, vc, k, v = _kvcache_inputs(rows=4)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    cs = torch.tensor([2, 6], dtype=torch.int32)
    sel_k, sel_v = kc[idx.long()].clone(), vc[idx.long()].clone()
    out = compat.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=cs, cache_batch_idx=idx, causal=True)
    want, _ = _decode_op(q, sel_k, sel_v, cs, k, v, causal=True)
    torch.testing.assert_close(out, want)
    assert torch.equal(kc[idx.long()], sel_k) and torch.equal(vc[idx.long()], sel_v)


@pytest.mark.parametrize("causal", [True, False])
def test_with_kvcache_rotary_positions(causal):
    """Causal: query i at cache_seqlens + i; neither causal nor local: every query at
    cache_seqlens (FlashAttention's rule). GPT-J pairs (FlashAttention's default)."""
    from torch_flash.ops.rotary import rotary_cos_sin
    from torch_flash.reference.rotary import rotary
    q, kc, vc, k, v = _kvcache_inputs(Sq=3, Snew=3)
    cos, sin = rotary_cos_sin(16, 8)
    cs = torch.tensor([1, 6], dtype=torch.int32)
    kc2, vc2 = kc.clone(), vc.clone()
    out = compat.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=cs,
                                         causal=causal)
    k_rot = rotary(k.transpose(1, 2), cos, sin, True, seqlen_offsets=cs).transpose(1, 2)
    q_pos = cs.long()[:, None] + (torch.arange(3) if causal else torch.zeros(3, dtype=torch.long))
    q_rot = rotary(q.transpose(1, 2), cos[q_pos], sin[q_pos], True).transpose(1, 2)
    want, _ = _decode_op(q_rot, kc2, vc2, cs, k_rot, v, causal=causal)
    assert_rel_close(out, want, 1e-5)
    torch.testing.assert_close(kc, kc2)


def test_with_kvcache_alibi():
    q, kc, vc, k, v = _kvcache_inputs(Sq=2, Snew=2)
    cs = torch.tensor([3, 7], dtype=torch.int32)
    slopes = torch.rand(2, 4)
    kc2, vc2 = kc.clone(), vc.clone()
    out = compat.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=cs, causal=True, alibi_slopes=slopes)
    want, _ = _decode_op(q, kc2, vc2, cs, k, v, causal=True, alibi_slopes=slopes)
    torch.testing.assert_close(out, want)
    # sequence 1 holds 9 keys; its queries sit at positions 7 and 8
    causal = torch.ones(2, 9, dtype=torch.bool).tril(7)
    bias = _alibi_bias(slopes[1], 2, 9).masked_fill(~causal, float("-inf"))
    assert_rel_close(out[1:], _sdpa(q[1:], kc[1:, :9], vc[1:, :9], attn_mask=bias), 1e-5)


def _leftpad_ref(q, kc, vc, lengths, leftpad, causal, window):
    """FlashAttention 2's test reference for cache_leftpad (attention_ref with key_leftpad), in
    float64: slot j of row b is key position j - leftpad[b], of lengths[b] - leftpad[b] keys;
    query i sits at position sk - Sq + i; causal and window relative to those positions."""
    B, Sq = q.shape[:2]
    col = torch.arange(kc.shape[1])[None, None] - leftpad.long()[:, None, None]  # (B, 1, S)
    sk = (lengths - leftpad).long()[:, None, None]
    pos = torch.arange(Sq)[None, :, None] + sk - Sq  # (B, Sq, 1)
    left, right = window[0], 0 if causal else window[1]
    hidden = (col < 0) | (col >= sk)
    if right >= 0:
        hidden = hidden | (col > pos + right)
    if left >= 0:
        hidden = hidden | (col < pos - left)
    return _sdpa(*(t.double() for t in (q, kc, vc)), attn_mask=~hidden[:, None])


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (3, -1)), (False, (2, 1))])
@pytest.mark.parametrize("paged", [False, True])
def test_with_kvcache_leftpad(causal, window, paged):
    """cache_leftpad: sequence b's keys start at slot cache_leftpad[b]; new keys land at
    cache_seqlens[b]; masks as FlashAttention's reference defines them."""
    q, kc, vc, k, v = _kvcache_inputs(B=3, Sq=2, Snew=2, S=12)
    cs = torch.tensor([5, 9, 4], dtype=torch.int32)
    leftpad = torch.tensor([2, 0, 4], dtype=torch.int32)
    kc_after, vc_after = kc.clone(), vc.clone()
    for b, n in enumerate(cs.tolist()):
        kc_after[b, n:n + 2], vc_after[b, n:n + 2] = k[b], v[b]
    want = _leftpad_ref(q, kc_after, vc_after, cs + 2, leftpad, causal, window)
    kw = dict(cache_seqlens=cs, cache_leftpad=leftpad, causal=causal, window_size=window)
    if paged:  # blocks of 4 slots, shuffled in a pool
        order = torch.randperm(11)[:9]
        kp, vp = torch.randn(11, 4, 2, 16), torch.randn(11, 4, 2, 16)
        kp[order], vp[order] = kc.reshape(9, 4, 2, 16), vc.reshape(9, 4, 2, 16)
        out = compat.flash_attn_with_kvcache(q, kp, vp, k, v, block_table=order.view(3, 3).int(), **kw)
    else:
        out = compat.flash_attn_with_kvcache(q, kc, vc, k, v, **kw)
        torch.testing.assert_close(kc, kc_after, rtol=0, atol=0)
    assert_rel_close(out, want, 1e-5)


def test_with_kvcache_leftpad_rotary_alibi():
    """Rotary positions stay slot indices (q at cache_seqlens + i, new keys at cache_seqlens + s);
    ALiBi distances are unchanged by the padding (FlashAttention 2)."""
    from torch_flash.ops.rotary import rotary_cos_sin
    from torch_flash.reference.rotary import rotary
    q, kc, vc, k, v = _kvcache_inputs(Sq=2, Snew=2)
    cos, sin = rotary_cos_sin(16, 8)
    cs, leftpad = torch.tensor([3, 6], dtype=torch.int32), torch.tensor([1, 5], dtype=torch.int32)
    slopes = torch.rand(4)
    kc2, vc2 = kc.clone(), vc.clone()
    out = compat.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=cs,
                                         cache_leftpad=leftpad, causal=True, alibi_slopes=slopes)
    k_rot = rotary(k.transpose(1, 2), cos, sin, True, seqlen_offsets=cs).transpose(1, 2)
    pos = cs.long()[:, None] + torch.arange(2)
    q_rot = rotary(q.transpose(1, 2), cos[pos], sin[pos], True).transpose(1, 2)
    for b, n in enumerate(cs.tolist()):
        kc2[b, n:n + 2], vc2[b, n:n + 2] = k_rot[b], v[b]
        L, first = n + 2, int(leftpad[b])
        bias = _alibi_bias(slopes, 2, L - first).masked_fill(~torch.ones(2, L - first, dtype=torch.bool).tril(L - first - 2),
                                                          float("-inf"))
        want = _sdpa(q_rot[b:b + 1].double(), kc2[b:b + 1, first:L].double(), vc2[b:b + 1, first:L].double(),
                     attn_mask=bias.double())
        assert_rel_close(out[b:b + 1], want, 1e-5)


@pytest.mark.parametrize("kw,match", [
    (dict(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32), block_table=torch.zeros(2, 1, dtype=torch.int32)),
     "cache_batch_idx cannot be combined with block_table"),
])
def test_with_kvcache_refuses(kw, match):
    q, kc, vc, _, _ = _kvcache_inputs()
    with pytest.raises(ValueError, match=f"compat.flash_attn_with_kvcache: {match}"):
        compat.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, **kw)
