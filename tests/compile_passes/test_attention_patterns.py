"""Attention spellings -> flash.attention, the core forms: scales, layouts (einsum, merged bmm),
GQA / MQA, softcap, and SDPA with its math decompositions; each is rewritten with the arguments
it amounts to and equals eager in float64 by relative error, forward and backward. Near misses
are left alone with a reason a user can act on. Masks built in the graph: test_attention_patterns_masks.py."""
import math

import pytest
import torch
import torch.nn.functional as F

import torch_flash
from _attention_cases import (ADDITIVE, B, D, H, INF, KV, PADDING, S, _args, _check, _compile, _f64, _ones, _scores,
                              _through_flash_backend, _through_flash_backend_cuda_bf16)
from models import repeat_kv


def _attend(s, v):
    # defined here, not imported: explain locates a site at its softmax, which
    # test_near_miss_reason expects in this file
    return torch.softmax(s, dim=-1) @ v


# ------------------------------------------------------------------------- spellings

def mul_scale(q, k, v):
    return _attend(q @ k.transpose(-2, -1) * D ** -0.5, v)


def div_scale(q, k, v):
    return _attend(torch.matmul(q, k.transpose(2, 3)) / math.sqrt(D), v)


def tensor_scale(q, k, v):  # GPT-2's old `/ torch.full([], d ** 0.5)`
    return _attend(q @ k.transpose(-1, -2) / torch.full([], D ** 0.5, dtype=q.dtype, device=q.device), v)


def folded_q(q, k, v):
    return _attend((q * 0.3) @ k.transpose(-2, -1), v)


def folded_qk(q, k, v):
    return _attend((q * D ** -0.25) @ (k * D ** -0.25).transpose(-2, -1), v)


def no_scale(q, k, v):  # T5
    return _attend(q @ k.transpose(-2, -1), v)


def einsum(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * D ** -0.5
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)


def einsum_bshd(q, k, v):  # (B, S, H, D) in and out
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def einsum_ellipsis(q, k, v):
    s = torch.einsum("...qd,...kd->...qk", q, k) / D ** 0.5
    return torch.einsum("...qk,...kd->...qd", s.softmax(-1), v)


def bmm(q, k, v):  # merged (B*H, S, D)
    b, h, s, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
    w = torch.bmm(q3, k3.transpose(1, 2)) * d ** -0.5
    return torch.bmm(w.softmax(-1), v3).view(b, h, s, d)


def baddbmm_reordered(q, k, v):  # GPT-2's reorder_and_upcast_attn, with its causal where
    b, h, s, d = q.shape
    w = torch.empty(b * h, s, s, dtype=torch.float32, device=q.device)
    w = torch.baddbmm(w, q.reshape(-1, s, d).float(), k.transpose(-1, -2).reshape(-1, d, s).float(),
                      beta=0, alpha=d ** -0.5).reshape(b, h, s, s)
    causal = torch.tril(_ones(q, s, s)).view(1, 1, s, s)
    w = torch.where(causal, w, torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device))
    return torch.matmul(w.softmax(-1).type(v.dtype), v)


def inplace(q, k, v):
    s = q @ k.transpose(-1, -2)
    s /= D ** 0.5
    s.masked_fill_(torch.ones(S, S, device=q.device).tril() == 0, INF)
    return _attend(s, v)


def gqa_repeat_kv(q, k, v):
    n = q.shape[1] // k.shape[1]
    return _attend(_scores(q, repeat_kv(k, n)), repeat_kv(v, n))


def gqa_repeat_interleave(q, k, v):
    n = q.shape[1] // k.shape[1]
    return _attend(_scores(q, k.repeat_interleave(n, dim=1)), v.repeat_interleave(n, dim=1))


def mqa_expand(q, k, v):
    k, v = (t.expand(-1, q.shape[1], -1, -1) for t in (k, v))
    return _attend(_scores(q, k), v)


def gqa_bshd(q, k, v):  # repeat over the head dim of (B, S, H, D), then transpose
    n = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), *(t.repeat_interleave(n, dim=2).transpose(1, 2) for t in (k, v))
    return _attend(_scores(q, k), v)


def softcap(q, k, v):  # Gemma 2
    s = _scores(q, k)
    s = torch.tanh(s / 2.0) * 2.0
    return _attend(s, v)


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_causal_more_queries(q, k, v):  # top-left diagonal, Sq > Sk: window right = Sq - Sk
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_graph_mask(q, k, v):
    n = q.shape[-2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_ones(q, n, n).tril())


def sdpa_padding(q, k, v, pad):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=pad[:, None, None, :])


def sdpa_gqa_scale(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True)


def sdpa_repeat_kv(q, k, v):
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n), repeat_kv(v, n))


def sdpa_reference_mask(q, k, v):  # the float mask of SDPA's documented reference code
    sq, sk = q.shape[-2], k.shape[-2]
    bias = torch.zeros(sq, sk, dtype=q.dtype, device=q.device)
    bias.masked_fill_(_ones(q, sq, sk).tril(diagonal=0).logical_not(), INF)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def sdpa_3d(q, k, v):
    return F.scaled_dot_product_attention(*(t.flatten(0, 1) for t in (q, k, v)))


def sdpa_math(q, k, v):  # SDPA's math decomposition: sqrt(scale) into q and k^T, _safe_softmax
    c = math.sqrt(0.3)
    s = torch.ops.aten.mul.Scalar(q, c) @ torch.ops.aten.mul.Scalar(k.transpose(-2, -1), c)
    return torch.ops.aten._safe_softmax(s, -1) @ v


def sdpa_math_mask(q, k, v, mask):  # with an additive mask, of -inf where a key is hidden
    c = math.sqrt(D ** -0.5)
    s = torch.ops.aten.mul.Scalar(q, c) @ torch.ops.aten.mul.Scalar(k.transpose(-2, -1), c)
    return torch.ops.aten._safe_softmax(s + mask, -1) @ v


def sdpa_math_bool(q, k, v, pad):  # a bool mask as the decomposition turns it into floats
    c = math.sqrt(D ** -0.5)
    s = torch.ops.aten.mul.Scalar(q, c) @ torch.ops.aten.mul.Scalar(k.transpose(-2, -1), c)
    zero, hide = (torch.scalar_tensor(x, dtype=q.dtype, device=q.device) for x in (0.0, INF))
    return torch.ops.aten._safe_softmax(s + torch.where(pad[:, None, None, :], zero, hide), -1) @ v


def sdpa_math_op(q, k, v):  # SDPA's math kernel called as an op: (output, weights)
    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, is_causal=True)[0]


def sdpa_math_op_mask(q, k, v, mask):  # (a float mask: the op adds a bool one as 0 / 1)
    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, scale=0.3, enable_gqa=True)[0]


def exp_softmax(q, k, v):  # softmax as core ATen decomposes it: exp(s - amax) / sum
    s = _scores(q, k)
    e = torch.exp(s - torch.amax(s, -1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ v


def max_shifted(q, k, v):  # the row max subtracted by hand (softmax does not see it)
    s = _scores(q, k)
    return _attend(s - s.max(-1, keepdim=True).values, v)


def sinks_column(q, k, v, sinks):  # gpt-oss: a sink logit per head, one more column sliced off
    s = _scores(q, k)
    col = sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], -1)
    p = torch.softmax(torch.cat([s, col], -1), dim=-1)[..., :-1]
    return p @ v


def sinks_shifted_amax(q, k, v, sinks):  # with the row max subtracted, by amax
    s = torch.cat([_scores(q, k), sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)], dim=-1)
    p = torch.softmax(s - s.amax(-1, keepdim=True), dim=-1)
    return p[..., : k.shape[2]] @ v


SINKS = lambda: torch.randn(H, requires_grad=True)  # noqa: E731

SPELLINGS = [
    # (fn, inputs, expected flash.attention arguments)
    (mul_scale, _args(), dict(scale=D ** -0.5, causal=False, bias=False)),
    (div_scale, _args(), dict(scale=D ** -0.5)),
    (tensor_scale, _args(), dict(scale=D ** -0.5)),
    (folded_q, _args(), dict(scale=0.3)),
    (folded_qk, _args(), dict(scale=D ** -0.5)),
    (no_scale, _args(), dict(scale=1.0)),
    (einsum, _args(), dict(scale=D ** -0.5)),
    (einsum_bshd, _args(layout="bshd"), dict(scale=D ** -0.5)),
    (einsum_ellipsis, _args(), dict(scale=D ** -0.5)),
    (bmm, _args(), dict(scale=D ** -0.5)),
    (baddbmm_reordered, _args(), dict(scale=D ** -0.5, causal=True, bias=False)),
    (inplace, _args(), dict(causal=True, bias=False)),
    (gqa_repeat_kv, _args(hkv=KV), dict(kv_heads=KV)),
    (gqa_repeat_interleave, _args(hkv=KV), dict(kv_heads=KV)),
    (mqa_expand, _args(hkv=1), dict(kv_heads=1)),
    (gqa_bshd, _args(hkv=KV, layout="bshd"), dict(kv_heads=KV)),
    (softcap, _args(), dict(softcap=2.0, scale=D ** -0.5)),
    (sdpa_causal, _args(), dict(causal=True, bias=False, scale=None)),
    (sdpa_causal_more_queries, _args(sk=4), dict(causal=False, window=(-1, 2))),
    (sdpa_graph_mask, _args(), dict(causal=True, bias=False)),
    (sdpa_padding, _args(PADDING), dict(causal=False, bias=True)),
    (sdpa_gqa_scale, _args(hkv=KV), dict(scale=0.3, kv_heads=KV)),
    (sdpa_repeat_kv, _args(hkv=KV), dict(kv_heads=KV)),
    (sdpa_reference_mask, _args(), dict(causal=True, bias=False)),
    (sdpa_3d, _args(), dict(kv_heads=B * H)),
    (sdpa_math, _args(), dict(scale=0.3, causal=False, bias=False)),
    (sdpa_math_mask, _args(ADDITIVE), dict(scale=D ** -0.5, causal=False, bias=True)),
    (sdpa_math_bool, _args(PADDING), dict(scale=D ** -0.5, causal=False, bias=True)),
    (sdpa_math_op, _args(), dict(causal=True, bias=False, scale=None)),
    (sdpa_math_op_mask, _args(ADDITIVE, hkv=KV), dict(causal=False, bias=True, scale=0.3, kv_heads=KV)),
    (exp_softmax, _args(), dict(scale=D ** -0.5, causal=False, bias=False)),
    (max_shifted, _args(), dict(scale=D ** -0.5, bias=False, sinks=False)),
    (sinks_column, _args(SINKS), dict(scale=D ** -0.5, bias=False, sinks=True)),
    (sinks_shifted_amax, _args(SINKS), dict(sinks=True)),
]


@pytest.mark.parametrize("fn, inputs, expect", SPELLINGS, ids=[s[0].__name__ for s in SPELLINGS])
def test_spelling(fn, inputs, expect):
    _check(fn, inputs(), **expect)


# spellings whose rewrite inserts views, permutes or casts around the op
INDUCTOR = ["einsum_bshd", "bmm", "baddbmm_reordered", "inplace", "gqa_bshd", "sdpa_3d"]


@pytest.mark.filterwarnings("error:torch_flash")
@pytest.mark.parametrize("fn, inputs, expect", [s for s in SPELLINGS if s[0].__name__ in INDUCTOR], ids=INDUCTOR)
def test_spelling_through_inductor(fn, inputs, expect):
    args = inputs()
    _through_flash_backend(fn, args, [_f64(a) for a in args], tol=1e-5)


# the Triton kernels on the core forms: scale, layouts, GQA, softcap, a bool mask
CUDA = ["mul_scale", "einsum_bshd", "bmm", "gqa_repeat_kv", "softcap", "sdpa_graph_mask"]


@pytest.mark.cuda
@pytest.mark.filterwarnings("error:torch_flash")
@pytest.mark.parametrize("fn, inputs, expect", [s for s in SPELLINGS if s[0].__name__ in CUDA], ids=CUDA)
def test_spelling_cuda_bf16(fn, inputs, expect):
    _through_flash_backend_cuda_bf16(fn, inputs())


# ------------------------------------------------------------------------- near misses

def probabilities_returned(q, k, v):
    p = torch.softmax(_scores(q, k), dim=-1)
    return p @ v, p


def softmax_over_queries(q, k, v):
    return torch.softmax(_scores(q, k), dim=-2) @ v


def learned_temperature(q, k, v, t):
    return _attend(q @ k.transpose(-2, -1) * t, v)


def fill_zero(q, k, v):
    n = q.shape[-2]
    return _attend(_scores(q, k).masked_fill(_ones(q, n, n).triu(1), 0.0), v)


def tile_repeat(q, k, v):
    n = q.shape[1] // k.shape[1]
    return _attend(_scores(q, k.repeat(1, n, 1, 1)), v.repeat(1, n, 1, 1))


def softcap_after_mask(q, k, v):
    n = q.shape[-2]
    s = _scores(q, k).masked_fill(_ones(q, n, n).triu(1), INF)
    return _attend(torch.tanh(s / 2.0) * 2.0, v)


def relu_scores(q, k, v):
    return _attend(torch.relu(_scores(q, k)), v)


def bias_from_scores(q, k, v):
    s = _scores(q, k)
    return _attend(s + s.detach().amax(-1, keepdim=True), v)


def sdpa_math_op_weights(q, k, v):
    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v)


def sdpa_math_op_bool(q, k, v, pad):
    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, pad[:, None, None, :])[0]


def sdpa_causal_fewer_queries(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def classifier_softmax(q, k, v):
    return torch.softmax(q.flatten(1), dim=-1)


def sinks_kept(q, k, v, sinks):  # the sink column's probability kept (and multiplied by a value)
    s = torch.cat([_scores(q, k), sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)], -1)
    return torch.softmax(s, dim=-1) @ torch.cat([v, v[:, :, :1]], 2)


def sinks_first(q, k, v, sinks):  # the column joined first
    s = torch.cat([sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1), _scores(q, k)], -1)
    return torch.softmax(s, dim=-1)[..., 1:] @ v


def sinks_per_row(q, k, v, sinks):  # a column that is not one value per head
    col = sinks.reshape(1, -1, 1, 1) * torch.arange(q.shape[2], dtype=q.dtype).reshape(1, 1, -1, 1)
    return torch.softmax(torch.cat([_scores(q, k), col.expand(q.shape[0], -1, -1, -1)], -1), dim=-1)[..., :-1] @ v


NEAR_MISSES = [
    (probabilities_returned, _args(), "used more than once (e.g. also returned as attention weights)"),
    (softmax_over_queries, _args(), "softmax is not over the last dimension"),
    (learned_temperature, _args(lambda: torch.rand(1, H, 1, 1)), "multiplied by a tensor that is not one value"),
    (fill_zero, _args(), "masked scores are set to 0.0, not -inf or a large negative value"),
    (tile_repeat, _args(hkv=KV), "repeated in tile order"),
    (softcap_after_mask, _args(), "softcap comes after a mask or bias"),
    (relu_scores, _args(), "pass through relu"),
    (bias_from_scores, _args(), "itself computed from the scores"),
    (sdpa_math_op_weights, _args(), "attention weights of _scaled_dot_product_attention_math are used"),
    (sdpa_math_op_bool, _args(PADDING), "adds it as 0 / 1"),
    (sdpa_causal_fewer_queries, _args(sq=3), "fewer queries than keys"),
    (classifier_softmax, _args(), "scores are 2-D"),
    (sinks_kept, _args(SINKS), "keep the sink column"),
    (sinks_first, _args(SINKS), "is not one column (a sink) last"),
    (sinks_per_row, _args(SINKS), "is not one value per head"),
]


@pytest.mark.parametrize("fn, inputs, reason", NEAR_MISSES, ids=[s[0].__name__ for s in NEAR_MISSES])
def test_near_miss_reason(fn, inputs, reason):
    report = torch_flash.explain(fn, *inputs())
    sites = [s for s in report.sites if s.family == "attention"]
    assert len(sites) == 1 and not sites[0].rewritten
    assert reason in sites[0].reason, sites[0].reason
    assert "test_attention_patterns.py" in sites[0].location
    # and the graph left alone still computes the model's result (through the attention
    # rewrite only: on torch 2.13 Inductor's own SDPA pattern turns softmax(dim=-2) @ v into
    # attention over the keys, with or without this package)
    args = inputs()
    torch.testing.assert_close(_compile(fn)[0](*args), fn(*args))
