"""torch_flash.compat's drop-ins for FlashAttention's everyday imports (layers.rotary,
ops.triton.layer_norm, losses.cross_entropy, bert_padding), against float64 formulas."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from torch_flash.compat import bert_padding
from torch_flash.compat.layers.rotary import (RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_kv_,
                                              apply_rotary_emb_qkv_, apply_rotary_emb_torch)
from torch_flash.compat.losses.cross_entropy import CrossEntropyLoss
from torch_flash.compat.ops.triton.layer_norm import (RMSNorm, layer_norm_fn, layer_norm_linear_fn, layer_norm_ref,
                                                      rms_norm_fn, rms_norm_ref)
from _utils import TOL, assert_rel_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------------------- rotary

def _tables(n, rotary_dim, dtype=torch.float32, device="cpu"):
    angle = torch.rand(n, rotary_dim // 2, device=device) * 6.28
    return angle.cos().to(dtype), angle.sin().to(dtype)


def _at(cos, sin, offsets, seqlen):
    """cos/sin of positions s + offsets: (seqlen, d) for an int, (B, seqlen, d) for a tensor."""
    if isinstance(offsets, int):
        return cos[offsets:offsets + seqlen], sin[offsets:offsets + seqlen]
    idx = offsets.long()[:, None] + torch.arange(seqlen, device=cos.device)
    return cos[idx], sin[idx]


@pytest.mark.parametrize("inplace,interleaved,offsets", itertools.product(
    [False, True], [False, True], [0, 3, "tensor"]))
def test_apply_rotary_emb(inplace, interleaved, offsets):
    """Against FlashAttention's formula in float64, forward and backward; inplace=True on a leaf
    that requires grad writes into it, as FlashAttention's does."""
    x = torch.randn(3, 7, 2, 16, requires_grad=True)
    x_ref = x.detach().double().requires_grad_()
    cos, sin = _tables(16, 12)
    if offsets == "tensor":
        offsets = torch.tensor([0, 2, 5], dtype=torch.int32)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, inplace=inplace, seqlen_offsets=offsets)
    want = apply_rotary_emb_torch(x_ref, *(t.double() for t in _at(cos, sin, offsets, 7)), interleaved)
    assert_rel_close(out, want, TOL[torch.float32])
    if inplace:
        assert out.data_ptr() == x.data_ptr() and torch.equal(x.detach(), out.detach())
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g.double())
    assert_rel_close(x.grad, x_ref.grad, TOL[torch.float32])


def test_apply_rotary_emb_varlen():
    """Packed (total, H, D) with cu_seqlens: each sequence from position 0 (+ its offset)."""
    lens = [3, 5]
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    x = torch.randn(8, 2, 16)
    cos, sin = _tables(12, 16)
    out = apply_rotary_emb(x, cos, sin, cu_seqlens=cu, max_seqlen=5, seqlen_offsets=torch.tensor([1, 4]))
    for (s, e), off, n in zip(((0, 3), (3, 8)), (1, 4), lens):
        want = apply_rotary_emb_torch(x[None, s:e].double(), cos[off:off + n].double(), sin[off:off + n].double())
        assert_rel_close(out[s:e], want[0], TOL[torch.float32])


@pytest.mark.parametrize("gqa", [False, True])
def test_apply_rotary_emb_qkv_and_kv(gqa):
    """q and k rotated in place (v untouched), and the gradient rotated back."""
    cos, sin = _tables(12, 8)
    if gqa:  # (B, S, Hq + 2 * Hk, D)
        qkv = torch.randn(2, 5, 4 + 2 * 2, 16, requires_grad=True)
        parts = lambda t: (t[:, :, :4], t[:, :, 4:6], t[:, :, 6:])  # noqa: E731
        kw = dict(num_heads_q=4)
    else:
        qkv = torch.randn(2, 5, 3, 2, 16, requires_grad=True)
        parts = lambda t: t.unbind(2)  # noqa: E731
        kw = {}
    ref_in = qkv.detach().double().requires_grad_()
    out = apply_rotary_emb_qkv_(qkv, cos, sin, seqlen_offsets=2, **kw)
    q, k, v = parts(ref_in)
    c, s = (t[2:7].double() for t in (cos, sin))
    rot = [apply_rotary_emb_torch(t, c, s) for t in (q, k)]
    want = torch.cat((*rot, v), 2) if gqa else torch.stack((*rot, v), 2)
    assert out.data_ptr() == qkv.data_ptr()
    assert_rel_close(out, want, TOL[torch.float32])
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g.double())
    assert_rel_close(qkv.grad, ref_in.grad, TOL[torch.float32])
    kv = torch.randn(2, 5, 2, 2, 16)
    k_want = apply_rotary_emb_torch(kv[:, :, 0].double(), c, s, True)
    v_before = kv[:, :, 1].clone()
    apply_rotary_emb_kv_(kv, cos, sin, interleaved=True, seqlen_offsets=2)
    assert_rel_close(kv[:, :, 0], k_want, TOL[torch.float32])
    assert torch.equal(kv[:, :, 1], v_before)


@pytest.mark.parametrize("scale_base", [None, 512])
def test_rotary_embedding_module(scale_base):
    """FlashAttention's RotaryEmbedding: qkv in place, or (q, kv); XPos scales q and k apart."""
    rope = RotaryEmbedding(16, interleaved=False, scale_base=scale_base)
    qkv = torch.randn(2, 6, 3, 2, 16)
    q, kv = qkv[:, :, 0].clone(), qkv[:, :, 1:].clone()
    rope(qkv, seqlen_offset=3)
    cos, sin = rope._cos_cached[3:9].double(), rope._sin_cached[3:9].double()
    cos_k, sin_k = (cos, sin) if scale_base is None else (rope._cos_k_cached[3:9].double(),
                                                          rope._sin_k_cached[3:9].double())
    assert_rel_close(qkv[:, :, 0], apply_rotary_emb_torch(q.double(), cos, sin), TOL[torch.float32])
    assert_rel_close(qkv[:, :, 1], apply_rotary_emb_torch(kv[:, :, 0].double(), cos_k, sin_k), TOL[torch.float32])
    q2, kv2 = rope(q.clone(), kv.clone(), seqlen_offset=3)
    torch.testing.assert_close(q2, qkv[:, :, 0])
    torch.testing.assert_close(kv2, qkv[:, :, 1:])


# ---------------------------------------------------------------------------- layer norm

NORM_CASES = list(itertools.product([False, True], [False, True], [False, True], [False, True], [0.0, 0.3],
                                    [False, True]))


@pytest.mark.parametrize("is_rms,prenorm,has_residual,has_x1_w1,dropout_p,rowscale", NORM_CASES)
def test_layer_norm_fn(is_rms, prenorm, has_residual, has_x1_w1, dropout_p, rowscale):
    """Every option against FlashAttention's float64 reference with the returned dropout masks,
    forward and backward."""
    if has_x1_w1 and rowscale:
        pytest.skip("rowscale is not supported with x1 (as FlashAttention)")
    N = 48
    x = torch.randn(3, 5, N, requires_grad=True)
    res = torch.randn(3, 5, N, requires_grad=True) if has_residual else None
    x1 = torch.randn(3, 5, N, requires_grad=True) if has_x1_w1 else None
    w = torch.randn(N, requires_grad=True)
    b = None if is_rms else torch.randn(N, requires_grad=True)
    w1, b1 = (torch.randn(N), torch.randn(N)) if has_x1_w1 else (None, None)
    rs = torch.rand(3, 5) if rowscale else None
    outs = layer_norm_fn(x, w, b, res, x1, w1, b1, eps=1e-5, dropout_p=dropout_p, rowscale=rs, prenorm=prenorm,
                         is_rms_norm=is_rms, return_dropout_mask=True)
    mask, mask1 = outs[-2:]
    assert (mask is None) == (dropout_p == 0)
    d = lambda t: None if t is None else t.detach().double().requires_grad_(t.requires_grad)  # noqa: E731
    leaves = [d(t) for t in (x, w, b, res, x1)]
    want = (rms_norm_ref if is_rms else layer_norm_ref)(
        leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], d(w1), d(b1), eps=1e-5, dropout_p=dropout_p,
        rowscale=d(rs), prenorm=prenorm, dropout_mask=mask, dropout_mask1=mask1)
    want = want if isinstance(want, tuple) else (want,)
    got = outs[:len(want)]
    for g, r in zip(got, want):
        assert_rel_close(g, r, TOL[torch.float32])
    seed = [torch.randn_like(g) for g in got]
    torch.autograd.backward(got, seed)
    torch.autograd.backward(want, [s.double() for s in seed])
    for t, ref in zip((x, w, b, res, x1), leaves):
        if t is not None:
            assert_rel_close(t.grad, ref.grad, TOL[torch.float32])


@pytest.mark.parametrize("x_dtype,residual_dtype,residual_in_fp32", [
    (torch.bfloat16, None, False), (torch.bfloat16, None, True), (torch.float16, torch.float32, False),
    (torch.bfloat16, torch.bfloat16, True)])
def test_norm_dtypes(x_dtype, residual_dtype, residual_in_fp32):
    """FlashAttention's rules: out in x's dtype (or out_dtype), residual_out in residual's dtype,
    else fp32 with residual_in_fp32, else x's; zero_centered_weight stores w - 1."""
    x = torch.randn(4, 64, dtype=x_dtype)
    res = None if residual_dtype is None else torch.randn(4, 64, dtype=residual_dtype)
    w = torch.rand(64) - 0.5
    out, res_out = rms_norm_fn(x, w, None, res, prenorm=True, residual_in_fp32=residual_in_fp32,
                               zero_centered_weight=True)
    assert out.dtype == x_dtype
    assert res_out.dtype == (residual_dtype or (torch.float32 if residual_in_fp32 else x_dtype))
    want, want_res = rms_norm_ref(x.double(), w.double(), None, None if res is None else res.double(), prenorm=True,
                                  zero_centered_weight=True)
    assert_rel_close(out, want, TOL[x_dtype])
    assert_rel_close(res_out, want_res, TOL[res_out.dtype])
    assert layer_norm_fn(x, w, torch.randn(64), out_dtype=torch.float32).dtype == torch.float32


def test_out_buffers_rmsnorm_module_and_linear():
    x, res = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    w, b = torch.randn(32), torch.randn(32)
    out, res_out = torch.empty(2, 3, 32), torch.empty(2, 3, 32)
    got = layer_norm_fn(x, w, b, res, prenorm=True, out=out, residual_out=res_out)
    want = layer_norm_ref(x.double(), w.double(), b.double(), res.double(), prenorm=True)
    assert_rel_close(out, want[0], TOL[torch.float32])
    assert_rel_close(res_out, want[1], TOL[torch.float32])
    assert got[0].data_ptr() == out.data_ptr() and got[1].data_ptr() == res_out.data_ptr()
    norm = RMSNorm(32, eps=1e-6)
    assert_rel_close(norm(x), rms_norm_ref(x.double(), norm.weight.double(), None, eps=1e-6), TOL[torch.float32])
    lw, lb = torch.randn(16, 32), torch.randn(16)
    out, res_out = layer_norm_linear_fn(x, w, b, lw, lb, residual=res, prenorm=True)
    want = F.linear(layer_norm_ref(x.double(), w.double(), b.double(), res.double()), lw.double(), lb.double())
    assert_rel_close(out, want, TOL[torch.float32])
    assert_rel_close(res_out, x + res, TOL[torch.float32])


def test_norm_bad_inputs():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="compat.layer_norm_fn: residual has shape"):
        layer_norm_fn(x, torch.ones(8), None, residual=torch.randn(2, 4))
    with pytest.raises(ValueError, match="compat.rms_norm_fn: rowscale is not supported with the parallel input x1"):
        rms_norm_fn(x, torch.ones(8), None, x1=x, rowscale=torch.ones(2))


# ---------------------------------------------------------------------------- cross-entropy

@pytest.mark.parametrize("smoothing,logit_scale,lse_square_scale,reduction", itertools.product(
    [0.0, 0.9], [1.0, 0.7], [0.0, 1e-2], ["mean", "sum", "none"]))
def test_cross_entropy_loss(smoothing, logit_scale, lse_square_scale, reduction):
    x = torch.randn(24, 100, requires_grad=True)
    y = torch.randint(0, 100, (24,))
    y[:3] = -100
    model = CrossEntropyLoss(label_smoothing=smoothing, logit_scale=logit_scale, lse_square_scale=lse_square_scale,
                             reduction=reduction, return_z_loss=True)
    loss, z_loss = model(x, y)
    xs = x.detach().double().requires_grad_()
    scaled = xs * logit_scale
    z = (lse_square_scale * torch.logsumexp(scaled, -1).square()).masked_fill(y == -100, 0.0)
    want = F.cross_entropy(scaled, y, label_smoothing=smoothing, reduction="none") + z
    n = (y != -100).sum()
    want, z = {"mean": (want.sum() / n, z.sum() / n), "sum": (want.sum(), z.sum()), "none": (want, z)}[reduction]
    assert loss.dtype == torch.float32 and loss.shape == want.shape
    assert_rel_close(loss, want, TOL[torch.float32])
    if lse_square_scale:
        assert_rel_close(z_loss, z, TOL[torch.float32])
    g = torch.randn_like(loss)
    loss.backward(g)
    want.backward(g.double())
    assert_rel_close(x.grad, xs.grad, TOL[torch.float32])


def test_cross_entropy_inplace_backward_half():
    """inplace_backward overwrites the (intermediate) logits with their gradient."""
    h = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    logits = h * 2
    y = torch.randint(0, 64, (16,))
    loss = CrossEntropyLoss(inplace_backward=True)(logits, y)
    ref_h = h.detach().double().requires_grad_()
    want = F.cross_entropy(ref_h * 2, y)
    assert_rel_close(loss, want, TOL[torch.float32])
    loss.backward()
    want.backward()
    assert_rel_close(h.grad, ref_h.grad, TOL[torch.bfloat16])


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_inplace_backward_leaf(reduction):
    """As FlashAttention's: a leaf's own memory is overwritten with its gradient."""
    x = torch.randn(16, 64, requires_grad=True)
    ref_x = x.detach().double().requires_grad_()
    y = torch.randint(0, 64, (16,))
    y[:2] = -100
    loss = CrossEntropyLoss(inplace_backward=True, label_smoothing=0.1, lse_square_scale=1e-3,
                            reduction=reduction)(x, y)
    want = F.cross_entropy(ref_x, y, label_smoothing=0.1, reduction="none") + 1e-3 * torch.logsumexp(
        ref_x, -1).square().masked_fill(y == -100, 0.0)
    want = want.sum() / 14 if reduction == "mean" else want
    assert_rel_close(loss, want, TOL[torch.float32])
    g = torch.randn_like(loss)
    loss.backward(g)
    want.backward(g.double())
    assert_rel_close(x.grad, ref_x.grad, TOL[torch.float32])
    assert torch.equal(x.detach(), x.grad)


def test_cross_entropy_refuses_reduction():
    with pytest.raises(NotImplementedError, match="reduction"):
        CrossEntropyLoss(reduction="batchmean")


# ---------------------------------------------------------------------------- bert_padding

def test_unpad_pad_roundtrip_and_gradients():
    x = torch.randn(3, 5, 2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    h, indices, cu, max_len, used = bert_padding.unpad_input(x, mask)
    assert h.shape == (8, 2, 4) and cu.tolist() == [0, 2, 7, 8] and max_len == 5 and used.tolist() == [2, 5, 1]
    assert cu.dtype == torch.int32 and torch.equal(h, x[mask])
    padded = bert_padding.pad_input(h, indices, 3, 5)
    assert torch.equal(padded[mask], x[mask]) and torch.all(padded[~mask] == 0)
    padded.sum().backward()
    assert torch.equal(x.grad[..., 0, 0], mask.float())
    unused = torch.zeros_like(mask)
    unused[0, 2] = True
    h2, _, cu2, _, used2 = bert_padding.unpad_input(x, mask, unused)
    assert h2.shape[0] == 9 and cu2.tolist() == [0, 3, 8, 9] and used2.tolist() == [2, 5, 1]


def test_concatenated_sequences_and_residual_index():
    x = torch.randn(2, 6, 3)
    in_length = torch.tensor([[2, 3, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    h, indices, cu, max_len = bert_padding.unpad_input_for_concatenated_sequences(x, in_length)
    assert cu.tolist() == [0, 2, 5, 11] and max_len == 6 and indices.tolist() == [0, 1, 2, 3, 4, *range(6, 12)]
    flat = torch.randn(6, 3, requires_grad=True)
    idx = torch.tensor([4, 1])
    out, residual = bert_padding.index_first_axis_residual(flat, idx)
    (out.sum() * 2 + residual.sum()).backward()
    want = torch.ones(6, 3)
    want[idx] += 2
    assert torch.equal(flat.grad, want)


# ---------------------------------------------------------------------------- GPU sizes

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_dropins(dtype):
    """FlashAttention's test sizes: rotary (B 32, S 217, D 128), norms (N 3000), a 128k vocab."""
    x = torch.randn(32, 217, 4, 128, device="cuda", dtype=dtype)
    cos, sin = _tables(434, 64, dtype, "cuda")
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=7, interleaved=True)
    want = apply_rotary_emb_torch(x.double(), cos[7:224].double(), sin[7:224].double(), True)
    assert_rel_close(out, want, TOL[dtype])
    h, res = torch.randn(64, 3000, device="cuda", dtype=dtype), torch.randn(64, 3000, device="cuda")
    w, b = torch.randn(3000, device="cuda"), torch.randn(3000, device="cuda")
    y, r = layer_norm_fn(h, w, b, res, prenorm=True, dropout_p=0.0)
    want = layer_norm_ref(h.double(), w.double(), b.double(), res.double(), prenorm=True)
    assert_rel_close(y, want[0], TOL[dtype])
    assert r.dtype == torch.float32
    logits = torch.randn(256, 128256, device="cuda", dtype=dtype)
    y = torch.randint(0, 128256, (256,), device="cuda")
    loss = CrossEntropyLoss(label_smoothing=0.1, lse_square_scale=1e-4)(logits, y)
    want = F.cross_entropy(logits.double(), y, label_smoothing=0.1) + 1e-4 * torch.logsumexp(
        logits.double(), -1).square().mean()
    assert_rel_close(loss, want, 1e-5)
