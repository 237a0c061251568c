"""torch_flash.nn: state dicts interchangeable with torch.nn, same outputs and gradients."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch_flash import nn as fnn
from _utils import TOL, assert_rel_close


def _randomize(module, scale=1.0):
    """Random parameters, so that a round trip cannot pass on default initialisations."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * scale)
    return module


def _swap_state(ours, theirs, scale=1.0):
    """Loads theirs (randomised) into ours, then ours back into theirs; both strict."""
    ours.load_state_dict(_randomize(theirs, scale).state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    saved = {k: v.clone() for k, v in theirs.state_dict().items()}
    _randomize(theirs, scale)
    theirs.load_state_dict(ours.state_dict())
    for name, t in theirs.state_dict().items():
        assert torch.equal(t, saved[name]), name


def _same_grads(ours, theirs, x_ours, x_theirs, gy):
    for m in (ours, theirs):
        m.zero_grad()
    torch.autograd.backward(x_ours, gy)
    torch.autograd.backward(x_theirs, gy)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert p.grad is not None, f"no gradient for {name}"
        torch.testing.assert_close(p.grad, q.grad, msg=name)


# ---------------------------------------------------------------- norms

NORM_CASES = [
    dict(normalized_shape=32),
    dict(normalized_shape=(4, 8)),
    dict(normalized_shape=32, elementwise_affine=False),
]


@pytest.mark.parametrize("kw", NORM_CASES)
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rms_norm_matches_torch(kw, eps):
    ours, theirs = fnn.RMSNorm(eps=eps, **kw), nn.RMSNorm(eps=eps, **kw)
    _swap_state(ours, theirs)
    shape = (3, 5) + ((kw["normalized_shape"],) if isinstance(kw["normalized_shape"], int)
                      else kw["normalized_shape"])
    x = torch.randn(shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, ref = ours(x), theirs(x2)
    torch.testing.assert_close(y, ref)
    gy = torch.randn_like(y)
    _same_grads(ours, theirs, y, ref, gy)
    torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("kw", NORM_CASES + [dict(normalized_shape=32, bias=False)])
def test_layer_norm_matches_torch(kw):
    ours, theirs = fnn.LayerNorm(**kw), nn.LayerNorm(**kw)
    _swap_state(ours, theirs)
    n = kw["normalized_shape"]
    x = torch.randn((2, 3) + ((n,) if isinstance(n, int) else n), requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, ref = ours(x), theirs(x2)
    torch.testing.assert_close(y, ref)
    _same_grads(ours, theirs, y, ref, torch.randn_like(y))
    torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("cls", [fnn.RMSNorm, fnn.LayerNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_with_residual(cls, dtype):
    norm = _randomize(cls((4, 8), dtype=dtype))
    x, r = torch.randn(3, 4, 8, dtype=dtype), torch.randn(3, 4, 8, dtype=dtype)
    y, s = norm(x, r)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, norm(x + r))
    y32, s32 = norm(x, r, residual_in_fp32=True)
    assert s32.dtype == torch.float32 and y32.dtype == dtype
    torch.testing.assert_close(s32, x.float() + r.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norms_half(dtype):
    for ours, theirs in ((fnn.RMSNorm(64, eps=1e-6), nn.RMSNorm(64, eps=1e-6)),
                         (fnn.LayerNorm(64), nn.LayerNorm(64))):
        ours.load_state_dict(_randomize(theirs).state_dict())
        ours.to(dtype), theirs.to(dtype)
        x = torch.randn(4, 9, 64, dtype=dtype)
        y = ours(x)
        assert y.dtype == dtype
        exact = theirs.double()(x.double())
        assert_rel_close(y, exact, TOL[dtype])


def test_gemma_rms_norm():
    """weight_offset=1 starts as the identity scale and computes x_hat * (1 + w)."""
    norm = fnn.RMSNorm(16, eps=1e-6, weight_offset=1.0, cast_before_weight=False)
    assert torch.equal(norm.weight, torch.zeros(16))
    x = torch.randn(2, 16)
    torch.testing.assert_close(norm(x), nn.RMSNorm(16, eps=1e-6)(x))


@pytest.mark.parametrize("cls", [fnn.RMSNorm, fnn.LayerNorm])
def test_norm_bad_shape(cls):
    with pytest.raises(ValueError, match=f"torch_flash.nn.{cls.__name__}: .*normalized_shape"):
        cls((4, 8), elementwise_affine=False)(torch.randn(2, 8, 4))
    with pytest.raises(ValueError, match="normalized_shape must be non-empty"):
        cls(())


# ---------------------------------------------------------------- losses

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_cross_entropy_loss(reduction, label_smoothing):
    logits = torch.randn(2, 5, 11, requires_grad=True)
    target = torch.randint(0, 11, (2, 5))
    target[0, 1] = -100
    loss = fnn.CrossEntropyLoss(reduction=reduction, label_smoothing=label_smoothing)(logits, target)
    logits2 = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(logits2.flatten(0, 1), target.flatten(), reduction=reduction,
                          label_smoothing=label_smoothing)
    torch.testing.assert_close(loss, ref.view(loss.shape))
    gl = torch.randn_like(loss)
    loss.backward(gl)
    ref.backward(gl.view(ref.shape))
    torch.testing.assert_close(logits.grad, logits2.grad)


def test_cross_entropy_loss_options():
    logits, target = torch.randn(6, 7), torch.randint(0, 7, (6,))
    loss = fnn.CrossEntropyLoss(ignore_index=3, z_loss=1e-2, softcap=5.0)(logits, target)
    capped = 5.0 * torch.tanh(logits / 5.0)
    lse = capped.logsumexp(-1)
    keep = target != 3
    want = (F.cross_entropy(capped, target, reduction="none", ignore_index=3) + 1e-2 * lse**2 * keep)
    torch.testing.assert_close(loss, want.sum() / keep.sum())
    with pytest.raises(ValueError, match="flash.cross_entropy: reduction"):
        fnn.CrossEntropyLoss(reduction="avg")


@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_loss(bias):
    lm_head = _randomize(nn.Linear(16, 37, bias=bias))
    loss_fn = fnn.LinearCrossEntropyLoss(16, 37, bias=bias, label_smoothing=0.05)
    loss_fn.load_state_dict(lm_head.state_dict())
    hidden = torch.randn(2, 3, 16, requires_grad=True)
    target = torch.randint(0, 37, (2, 3))
    loss = loss_fn(hidden, target)
    hidden2 = hidden.detach().clone().requires_grad_()
    ref = F.cross_entropy(lm_head(hidden2).flatten(0, 1), target.flatten(), label_smoothing=0.05)
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(hidden.grad, hidden2.grad)
    for (name, p), q in zip(loss_fn.named_parameters(), lm_head.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert lm_head.load_state_dict(loss_fn.state_dict())  # and back


def test_linear_cross_entropy_init_like_linear():
    torch.manual_seed(0)
    a = fnn.LinearCrossEntropyLoss(8, 12, bias=True)
    torch.manual_seed(0)
    b = nn.Linear(8, 12, bias=True)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


# ---------------------------------------------------------------- rotary

def _rope(x, dim, base, offset, interleaved):
    """Hand-written RoPE in fp64 on the first dim dims of x (B, H, S, D)."""
    s = x.shape[-2]
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = torch.outer(torch.arange(offset, offset + s, dtype=torch.float64), inv)
    cos, sin = ang.cos(), ang.sin()
    xr = x[..., :dim].double()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, -1)
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)
    return torch.cat((out, x[..., dim:].double()), -1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dim", [16, 8])
def test_rotary_embedding(interleaved, dim):
    rope = fnn.RotaryEmbedding(dim, base=500.0, max_seqlen=4, interleaved=interleaved)
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)
    for offset in (0, 3):
        qr, kr = rope(q, k, seqlen_offsets=offset)
        assert rope.cos.shape[0] >= 6 + offset  # grew past max_seqlen=4
        for got, x in ((qr, q), (kr, k)):
            assert got.dtype == x.dtype
            assert_rel_close(got, _rope(x, dim, 500.0, offset, interleaved), TOL[torch.float32])
    assert not rope.state_dict()  # tables are not state


def test_rotary_embedding_tensor_offsets_and_grad():
    rope = fnn.RotaryEmbedding(8, max_seqlen=16)
    q = torch.randn(2, 2, 3, 8, requires_grad=True)
    k = torch.randn(2, 1, 3, 8, requires_grad=True)
    offsets = torch.tensor([0, 5])
    qr, kr = rope(q, k, seqlen_offsets=offsets)
    for b in range(2):
        torch.testing.assert_close(qr[b:b + 1], rope(q[b:b + 1], k[b:b + 1], int(offsets[b]))[0])
    (qr.sum() + kr.square().sum()).backward()
    # the gradients against autograd through the fp64 formula, each batch at its own offset
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    loss = sum(_rope(q64[b:b + 1], 8, 10000.0, int(offsets[b]), False).sum()
               + _rope(k64[b:b + 1], 8, 10000.0, int(offsets[b]), False).square().sum() for b in range(2))
    loss.backward()
    assert_rel_close(q.grad, q64.grad, TOL[torch.float32])
    assert_rel_close(k.grad, k64.grad, TOL[torch.float32])
    with pytest.raises(ValueError, match="flash.rotary(_qk)?: .*positions"):
        rope(q, k, seqlen_offsets=torch.tensor([0, 40]))
    rope(q, k, seqlen_offsets=torch.tensor([0, 40]), max_seqlen=43)


def test_rotary_embedding_keeps_fp32_tables():
    rope = fnn.RotaryEmbedding(8).to(torch.bfloat16)
    q = torch.randn(1, 1, 5, 8, dtype=torch.bfloat16)
    qr, _ = rope(q, q)
    assert rope.cos.dtype == torch.float32
    assert_rel_close(qr, _rope(q, 8, 10000.0, 0, False), TOL[torch.bfloat16])


# ---------------------------------------------------------------- attention

def _mha_pair(e=16, h=4, bias=True):
    ours = fnn.MultiheadAttention(e, h, bias=bias)
    theirs = nn.MultiheadAttention(e, h, bias=bias, batch_first=True)
    _swap_state(ours, theirs, scale=0.3)  # scores of order 1, not saturated softmax
    return ours, theirs


def _check_vs_torch(ours, theirs, x, grads=True, **kw):
    """ours(x, **kw) against theirs(x, x, x, ...) where kw are theirs' keywords, translated."""
    theirs_kw = dict(kw)
    ours_kw = {}
    if "attn_mask" in kw:
        m = kw["attn_mask"]
        ours_kw["attn_mask"] = ~m if m.dtype == torch.bool else m  # theirs: True = masked out
    if "key_padding_mask" in kw:
        ours_kw["key_padding_mask"] = kw["key_padding_mask"]
    x2 = x.detach().clone().requires_grad_()
    y = ours(x, **ours_kw)
    ref, _ = theirs(x2, x2, x2, need_weights=False, **theirs_kw)
    torch.testing.assert_close(y, ref)
    if grads:
        _same_grads(ours, theirs, y, ref, torch.randn_like(y))
        torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("bias", [True, False])
def test_mha_matches_torch(bias):
    ours, theirs = _mha_pair(bias=bias)
    _check_vs_torch(ours, theirs, torch.randn(2, 5, 16, requires_grad=True))


def test_mha_causal_matches_torch():
    ours, theirs = _mha_pair()
    ours.causal = True
    s = 6
    causal = nn.Transformer.generate_square_subsequent_mask(s)
    _check_vs_torch(ours, theirs, torch.randn(2, s, 16, requires_grad=True), attn_mask=causal, is_causal=True)
    with torch.no_grad():  # torch's fast inference path too
        theirs.eval(), ours.eval()
        _check_vs_torch(ours, theirs, torch.randn(2, s, 16), grads=False, attn_mask=causal, is_causal=True)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mha_masks_match_torch(kind):
    ours, theirs = _mha_pair()
    b, s = 3, 5
    pad = torch.zeros(b, s, dtype=torch.bool)
    pad[1, 3:] = True
    pad[2, 4:] = True
    if kind == "bool":
        mask = torch.rand(s, s) < 0.3
        mask.fill_diagonal_(False)  # every query keeps a key
    else:  # additive masks, the padding one included
        mask = torch.randn(s, s)
        pad = torch.zeros(b, s).masked_fill(pad, float("-inf"))
    x = torch.randn(b, s, 16, requires_grad=True)
    _check_vs_torch(ours, theirs, x, attn_mask=mask)
    _check_vs_torch(ours, theirs, x.detach().clone().requires_grad_(), key_padding_mask=pad)
    _check_vs_torch(ours, theirs, x.detach().clone().requires_grad_(), attn_mask=mask, key_padding_mask=pad)


def _manual_attention(mha, x, causal=False):
    """In-projection, rotary, SDPA with k/v heads repeated, out-projection, in fp64."""
    b, s, _ = x.shape
    hq, hkv, d = mha.num_heads, mha.num_kv_heads, mha.head_dim
    w = mha.in_proj_weight.double()
    bias = None if mha.in_proj_bias is None else mha.in_proj_bias.double()
    q, k, v = F.linear(x.double(), w, bias).split((hq * d, hkv * d, hkv * d), -1)
    q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
    if mha.rotary_emb is not None:
        r = mha.rotary_emb
        q, k = (_rope(t, r.dim, r.base, 0, r.interleaved) for t in (q, k))
    k, v = (t.repeat_interleave(hq // hkv, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return F.linear(out.transpose(1, 2).flatten(-2), mha.out_proj.weight.double(),
                    mha.out_proj.bias.double())


@pytest.mark.parametrize("hkv", [1, 2])
@pytest.mark.parametrize("rotary", [False, True, 4])
def test_mha_gqa_rotary(hkv, rotary):
    mha = _randomize(fnn.MultiheadAttention(32, 4, num_kv_heads=hkv, causal=True, rotary=rotary), 0.3)
    assert mha.in_proj_weight.shape == ((4 + 2 * hkv) * 8, 32)
    x = torch.randn(2, 7, 32, requires_grad=True)
    y = mha(x)
    assert y.shape == x.shape
    assert_rel_close(y, _manual_attention(mha, x, causal=True), TOL[torch.float32])
    names, leaves = zip(*mha.named_parameters())
    grads = torch.autograd.grad(y.square().sum(), (x, *leaves))
    # the fp64 reference's graph runs through .double() back to the same leaves
    expected = torch.autograd.grad(_manual_attention(mha, x, causal=True).square().sum(), (x, *leaves))
    for name, g, e in zip(("x", *names), grads, expected):
        assert_rel_close(g, e, TOL[torch.float32], what=name)


def test_mha_shared_rotary_module():
    rope = fnn.RotaryEmbedding(8, interleaved=True)
    mha = fnn.MultiheadAttention(32, 4, rotary=rope)
    assert mha.rotary_emb is rope
    x = torch.randn(1, 4, 32)
    assert_rel_close(mha(x), _manual_attention(mha, x), TOL[torch.float32])


def test_mha_dropout_only_in_training():
    mha = fnn.MultiheadAttention(16, 2, dropout=0.5).eval()
    x = torch.randn(2, 6, 16)
    torch.testing.assert_close(mha(x), mha(x))
    mha.train()
    x.requires_grad_()
    y = mha(x)
    assert not torch.allclose(y, mha.eval()(x))
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(embed_dim=10, num_heads=3), "embed_dim 10 must be divisible by num_heads 3"),
    (dict(embed_dim=16, num_heads=4, num_kv_heads=3), "num_heads 4 must be divisible by num_kv_heads 3"),
    (dict(embed_dim=16, num_heads=4, rotary=8), "rotary dim 8 exceeds the head dim 4"),
    (dict(embed_dim=16, num_heads=4, dropout=1.0), "dropout must be in"),
])
def test_mha_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=f"torch_flash.nn.MultiheadAttention: {match}"):
        fnn.MultiheadAttention(**kwargs)


def test_mha_bad_input():
    with pytest.raises(ValueError, match=r"x must be \(B, S, embed_dim=16\)"):
        fnn.MultiheadAttention(16, 2)(torch.randn(2, 5, 8))


class _Block(nn.Module):
    """A pre-norm block and an lm-head loss built from the modules."""

    def __init__(self, e=32, vocab=50):
        super().__init__()
        self.norm1, self.norm2 = fnn.RMSNorm(e), fnn.LayerNorm(e)
        self.attn = fnn.MultiheadAttention(e, 4, num_kv_heads=2, causal=True, rotary=True)
        self.head = fnn.LinearCrossEntropyLoss(e, vocab)

    def forward(self, x, target):
        h, residual = self.norm1(x, torch.zeros_like(x))
        h, _ = self.norm2(self.attn(h), residual)
        return self.head(h, target)


def test_block_compiles_and_trains():
    """fullgraph torch.compile through every module gives eager's loss, and every parameter's
    gradient is a float64 copy's."""
    block = _Block()
    x, target = torch.randn(2, 6, 32), torch.randint(0, 50, (2, 6))
    exact = copy.deepcopy(block).double()
    exact(x.double(), target).backward()
    eager = block(x, target)
    loss = torch.compile(block, backend="aot_eager", fullgraph=True)(x, target)
    torch.testing.assert_close(loss, eager)
    loss.backward()
    for (name, p), q in zip(block.named_parameters(), exact.parameters()):
        assert_rel_close(p.grad, q.grad, TOL[torch.float32], what=name)
