"""Attention spellings -> flash.attention: each spelling real code uses is rewritten with the
arguments it amounts to (causal / window proven from masks built in the graph, attn_bias
for the rest) and equals eager in float64 by relative error, forward and backward; near
misses are left alone with a reason a user can act on."""
import math

import pytest
import torch
import torch.nn.functional as F

import torch_flash
from torch_flash.reference.attention import attention as reference_attention
from _utils import assert_rel_close
from models import LlamaBlock, causal_additive_mask, check_training, repeat_kv

B, H, KV, S, D = 2, 4, 2, 6, 8
INF = float("-inf")


# ------------------------------------------------------------------------- helpers

def _compile(fn, **compile_kwargs):
    """fn compiled with the attention rewrite only; the rewritten graphs run eagerly (no
    Inductor: fast on CPU, and autograd runs the flash op's own backward)."""
    graphs = []

    def inner(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    backend = torch_flash.backend(ops=["attention"], inner=inner)
    return torch.compile(fn, backend=backend, **compile_kwargs), graphs


def _calls(graphs) -> list[dict]:
    """The flash.attention calls of the graphs: their keyword arguments, plus `bias` (whether
    there is an attn_bias), `seed` and `kv_heads`."""
    calls = []
    for g in graphs:
        for n in g.graph.find_nodes(op="call_function", target=torch.ops.flash.attention.default):
            q, k, v, bias, seed = (list(n.args) + [None] * 5)[:5]
            calls.append(dict(n.kwargs, bias=bias is not None, seed=seed is not None,
                              kv_heads=k.meta["val"].shape[1]))
    return calls


def _window(call) -> tuple:
    return call["window_left"], call["window_right"]


def _f64(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().double().requires_grad_(x.requires_grad)
    return x


def _out_and_grads(fn, args, weight=None):
    out = fn(*args)
    out = out[0] if isinstance(out, tuple) else out
    weight = torch.randn(out.shape, dtype=torch.float64, device=out.device) if weight is None else weight
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad((out * weight.to(out.dtype)).sum(), leaves)
    return out, grads, weight


def _check(fn, args, **expect):
    """One flash.attention with the expected arguments; output and input gradients equal to
    eager fn in float64."""
    ref, ref_grads, w = _out_and_grads(fn, [_f64(a) for a in args])
    compiled, graphs = _compile(fn)
    out, grads, _ = _out_and_grads(compiled, args, w)
    calls = _calls(graphs)
    assert len(calls) == 1, calls
    for key, value in expect.items():
        got = _window(calls[0]) if key == "window" else calls[0][key]
        assert got == (pytest.approx(value) if isinstance(value, float) else value), (key, got)
    assert_rel_close(out, ref, tol=1e-5)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_rel_close(g, r, tol=1e-5, what=f"grad {i}")


def _qkv(hkv=H, sq=S, sk=S, layout="bhsd"):
    shape = (lambda h, s: (B, s, h, D)) if layout == "bshd" else (lambda h, s: (B, h, s, D))
    return [torch.randn(shape(h, s), requires_grad=True) for h, s in ((H, sq), (hkv, sk), (hkv, sk))]


def _pad(b=B, s=S):
    """(B, S) keep-mask: the last keys of sequence 0 are padding (every query still sees a key)."""
    pad = torch.ones(b, s, dtype=torch.bool)
    pad[0, -2:] = False
    return pad


def _scores(q, k):
    return q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5


def _attend(s, v):
    return torch.softmax(s, dim=-1) @ v


def _ij(q, sk=None):
    """Query and key indices of q's scores as (Sq, 1) and (1, Sk) columns."""
    sq = q.shape[-2]
    return torch.arange(sq, device=q.device)[:, None], torch.arange(sk or sq, device=q.device)[None, :]


def _ones(q, *size):
    return torch.ones(*size, dtype=torch.bool, device=q.device)


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


def triu_masked_fill(q, k, v):
    n = q.shape[-2]
    hide = torch.triu(_ones(q, n, n), diagonal=1)
    return _attend(_scores(q, k).masked_fill(hide, INF), v)


def nanogpt_in_graph(q, k, v):  # nanoGPT's tril buffer, built in the graph and sliced
    t = q.shape[-2]
    bias = torch.tril(torch.ones(16, 16, device=q.device)).view(1, 1, 16, 16)
    return _attend(_scores(q, k).masked_fill(bias[:, :, :t, :t] == 0, INF), v)


def not_tril(q, k, v):
    n = q.shape[-2]
    return _attend(_scores(q, k).masked_fill(~_ones(q, n, n).tril(), INF), v)


def where_arange_finfo(q, k, v):
    i, j = _ij(q)
    s = _scores(q, k)
    return _attend(torch.where(i >= j, s, torch.finfo(s.dtype).min), v)


def additive_triu(q, k, v):
    n = q.shape[-2]
    return _attend(_scores(q, k) + torch.triu(torch.full((n, n), INF, device=q.device), 1), v)


def hf_causal(q, k, v):  # transformers.masking_utils under Dynamo: le of aranges, where(m, 0, min)
    b, n = q.shape[0], q.shape[-2]
    q_idx = (torch.arange(n, device=q.device) + 0)[None, None, :, None]
    kv_idx = (torch.arange(n, device=q.device) + 0)[None, None, None, :]
    mask = (kv_idx <= q_idx).expand(b, -1, n, n)
    s = _scores(q, k)
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    return _attend(s + torch.where(mask, zero, torch.finfo(s.dtype).min), v)


def kv_cache(q, k, v):  # Sq < Sk, queries at the end: causal aligned bottom-right
    sq, sk = q.shape[-2], k.shape[-2]
    keep = torch.arange(sk, device=q.device)[None, :] <= (torch.arange(sq, device=q.device) + (sk - sq))[:, None]
    return _attend(_scores(q, k).masked_fill(~keep, INF), v)


def sliding_window(q, k, v):  # Mistral: causal and kv > q - 3
    i, j = _ij(q)
    keep = (j > i - 3) & (j <= i)
    return _attend(_scores(q, k).masked_fill(keep.logical_not(), INF), v)


def keys_at_or_after(q, k, v):  # a band on the other side of the diagonal: window (0, -1)
    i, j = _ij(q)
    return _attend(_scores(q, k).masked_fill(j < i, INF), v)


def padding_input(q, k, v, pad):
    return _attend(_scores(q, k).masked_fill(~pad[:, None, None, :], INF), v)


def causal_and_padding(q, k, v, pad):
    i, j = _ij(q)
    keep = (j <= i) & pad[:, None, None, :]
    return _attend(_scores(q, k).masked_fill(~keep, INF), v)


def hf_causal_padding(q, k, v, pad):  # masking_utils with an attention_mask, finfo.min fill
    b, n = q.shape[0], q.shape[-2]
    b_idx = torch.arange(b, device=q.device)[:, None, None, None]
    q_idx = torch.arange(n, device=q.device)[None, None, :, None]
    kv_idx = torch.arange(n, device=q.device)[None, None, None, :]
    mask = (kv_idx <= q_idx) & pad[b_idx, kv_idx]
    s = _scores(q, k)
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    return _attend(s + torch.where(mask.expand(b, -1, n, n), zero, torch.finfo(s.dtype).min), v)


def _packed_mask(q, positions):
    """transformers 5.2x masking_utils under Dynamo: causal by position ids gathered with index,
    and-ed with a same-sequence piece (a new sequence wherever positions do not step by 1)."""
    b, n = q.shape[0], q.shape[-2]
    pos = positions.expand(b, -1)
    steps = torch.cat([pos[:, :1] - 1, pos], -1)
    seq = torch.cumsum((steps[:, 1:] - steps[:, :-1]) != 1, -1)
    b_idx = torch.arange(b, device=q.device)[:, None, None, None]
    q_idx = torch.arange(n, device=q.device)[None, None, :, None]
    kv_idx = torch.arange(n, device=q.device)[None, None, None, :]
    same = seq[b_idx, q_idx] == seq[b_idx, kv_idx]
    return (torch.ones((), dtype=torch.bool, device=q.device) & same & (pos[b_idx, kv_idx] <= pos[b_idx, q_idx]))


def hf_packed_causal(q, k, v):  # one sequence per row: the mask is the causal one, built from constants
    mask = _packed_mask(q, (torch.arange(q.shape[-2], device=q.device) + 0)[None, :])
    return _attend(_scores(q, k).masked_fill(~mask, INF), v)


def hf_packed_documents(q, k, v):  # constant positions restarting every 3 tokens: two documents
    mask = _packed_mask(q, (torch.arange(q.shape[-2], device=q.device) % 3)[None, :])
    return _attend(_scores(q, k).masked_fill(~mask, INF), v)


def additive_input(q, k, v, mask):
    return _attend(_scores(q, k) + mask, v)


def alibi(q, k, v, slopes):  # linear distance bias per head, plus a causal mask
    i, j = _ij(q)
    s = _scores(q, k) + slopes.view(1, -1, 1, 1) * (j - i).to(q.dtype)
    return _attend(s.masked_fill(j > i, INF), v)


def t5(q, k, v, position_bias):  # unscaled scores + a learned bias + HF's causal mask
    n = q.shape[-2]
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    causal = torch.where(_ones(q, n, n).tril(), zero, torch.finfo(q.dtype).min)
    return _attend(q @ k.transpose(2, 3) + position_bias + causal, v)


def chunked_causal(q, k, v):  # chunks of 2 (Llama 4): causal, the chunk condition stays attn_bias
    i, j = _ij(q)
    keep = (torch.div(i, 2, rounding_mode="floor") == torch.div(j, 2, rounding_mode="floor")) & (j <= i)
    return _attend(_scores(q, k).masked_fill(~keep, INF), v)


def top_left_causal(q, k, v):  # Sq < Sk with the diagonal top-left: not flash's causal
    sq, sk = q.shape[-2], k.shape[-2]
    return _attend(_scores(q, k).masked_fill(~_ones(q, sq, sk).tril(), INF), v)


def strictly_lower(q, k, v):  # hides the diagonal too: query 0 sees nothing
    n = q.shape[-2]
    return _attend(_scores(q, k).masked_fill(_ones(q, n, n).triu(), INF), v)


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


def finfo_fill_padding(q, k, v, pad):  # a sequence of padding only: its rows average v, no q, k gradient
    return _attend(_scores(q, k).masked_fill(~pad[:, None, None, :], torch.finfo(q.dtype).min), v)


def finfo_fill_left_padded(q, k, v, keep):  # GPT-2 style: a (B, 1, S, S) causal & left padding keep-mask
    n = q.shape[1] // k.shape[1]
    s = _scores(q, repeat_kv(k, n))
    s = torch.where(keep, s, torch.finfo(s.dtype).min)
    return _attend(s, repeat_kv(v, n))


def mpt(q, k, v, alibi, hide):  # + ALiBi (H, 1, Sk), then finfo.min where causal | padding hides: rows q = 0
    s = (_scores(q, k) + alibi).masked_fill(hide, torch.finfo(q.dtype).min)
    return _attend(s, v)


def finfo_where_then_alibi(q, k, v, keep, alibi):  # the finfo.min fill first, then ALiBi added
    return _attend(torch.where(keep, _scores(q, k), torch.finfo(q.dtype).min) + alibi, v)


def deberta_v2(q, k, v, rel, pad):  # (B*H, S, D) bmm + relative bias, then finfo.min where padding's outer product hides
    b, h, s, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
    scale = torch.sqrt(torch.tensor(d, dtype=torch.float) * 3)  # a one-value tensor, as DeBERTa's
    w = torch.bmm(q3, k3.transpose(-1, -2) / scale.to(dtype=q.dtype)) + rel
    outer = pad[:, None, None, :] * pad[:, None, :, None]
    w = w.view(b, h, s, s).masked_fill(~outer.bool(), torch.finfo(q.dtype).min)
    return torch.bmm(w.softmax(-1).view(b * h, s, s), v3).view(b, h, s, d)


def bmm_finfo_fill(q, k, v, keep):  # merged (B*H, S, D) scores throughout, finfo.min where keep is False
    b, h, s, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
    w = torch.bmm(q3, k3.transpose(1, 2)) * d ** -0.5
    w = w.masked_fill(~keep[:, 0].repeat_interleave(h, 0), torch.finfo(q.dtype).min)
    return torch.bmm(w.softmax(-1), v3).view(b, h, s, d)


def finfo_fill_and_inf(q, k, v, pad):  # a row both hide entirely averages v over the padding keys only
    s = _scores(q, k).masked_fill(_ones(q, S, S).triu(1), INF)
    return _attend(s.masked_fill(~pad[:, None, None, :], torch.finfo(q.dtype).min), v)


def added_inf_then_finfo_fill(q, k, v, pad):  # as finfo_fill_and_inf with the causal -inf added: rows q = 0 still
    s = _scores(q, k) + torch.where(_ones(q, S, S).tril(), 0.0, INF)
    return _attend(s.masked_fill(~pad[:, None, None, :], torch.finfo(q.dtype).min), v)


def merged_bmm_4d_mask(q, k, v, mask):  # MBart/PLBart: (B*H, S, D) bmm, the mask added in a 4-D view
    b, h, s, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
    w = torch.bmm(q3 * d ** -0.5, k3.transpose(1, 2))
    w = (w.view(b, h, s, s) + mask).view(b * h, s, s)
    return torch.bmm(w.softmax(-1), v3).view(b, h, s, d)


def bloom(q, k, v, alibi):  # ALiBi (B*H, 1, S) as baddbmm's input, finfo.min fill, fp32 softmax
    b, h, s, d = q.shape
    q3, v3 = q.reshape(b * h, s, d), v.reshape(b * h, s, d)
    kt = k.reshape(b * h, s, d).transpose(-1, -2)
    w = alibi.baddbmm(batch1=q3, batch2=kt, beta=1.0, alpha=d ** -0.5).view(b, h, s, s)
    w = w.masked_fill(_ones(q, s, s).triu(1), torch.finfo(w.dtype).min)
    p = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(p.view(b * h, s, s), v3).view(b, h, s, d)


def _args(*extra, **qkv_kwargs):
    return lambda: [*_qkv(**qkv_kwargs), *(e() for e in extra)]


PADDING = _pad


def _padding_only():
    """(B, S) keep-mask: sequence 0 is padding on its last 2 keys, sequence 1 everywhere."""
    pad = _pad()
    pad[1] = False
    return pad


def _left_padded():
    """(B, S) keep-mask: keys 0, 1 of sequence 0 are padding."""
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[0, :2] = False
    return pad


def _causal_left_padded():
    """(B, 1, S, S) keep-mask: causal, and keys 0, 1 of sequence 0 padding (its queries 0, 1 see nothing)."""
    keep = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S).clone()
    keep[0, ..., :2] = False
    return keep


ADDITIVE = lambda: causal_additive_mask(B, S)  # noqa: E731
SLOPES = lambda: torch.tensor([2.0 ** -(i + 1) for i in range(H)])  # noqa: E731
# Bloom's: slope per head times key position, (B*H, 1, S)
BLOOM_ALIBI = lambda: (SLOPES()[:, None] * torch.arange(S)).expand(B, H, S).reshape(B * H, 1, S)  # noqa: E731
POSITION_BIAS = lambda: (0.5 * torch.randn(1, H, S, S)).requires_grad_()  # noqa: E731
ALIBI = lambda: SLOPES()[:, None, None] * -torch.arange(S)  # noqa: E731  MPT's: (H, 1, Sk)
REL = lambda: (0.5 * torch.randn(B * H, S, S)).requires_grad_()  # noqa: E731  DeBERTa's learned, (B*H, S, S)
NONE = (-1, -1)

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
    (triu_masked_fill, _args(), dict(causal=True, bias=False, window=NONE)),
    (nanogpt_in_graph, _args(), dict(causal=True, bias=False)),
    (not_tril, _args(), dict(causal=True, bias=False)),
    (where_arange_finfo, _args(), dict(causal=True, bias=False)),
    (additive_triu, _args(), dict(causal=True, bias=False)),
    (hf_causal, _args(), dict(causal=True, bias=False)),
    (hf_packed_causal, _args(), dict(causal=True, bias=False)),
    (hf_packed_documents, _args(), dict(causal=False, bias=True)),
    (kv_cache, _args(sq=3), dict(causal=True, bias=False)),
    (sliding_window, _args(), dict(causal=True, bias=False, window=(2, -1))),
    (keys_at_or_after, _args(), dict(causal=False, bias=False, window=(0, -1))),
    (padding_input, _args(PADDING), dict(causal=False, bias=True)),
    (causal_and_padding, _args(PADDING), dict(causal=True, bias=True)),
    (hf_causal_padding, _args(PADDING), dict(causal=False, bias=True)),  # finite fill: test_finite_fill_*
    (additive_input, _args(ADDITIVE), dict(causal=False, bias=True)),
    (alibi, _args(SLOPES), dict(causal=True, bias=True)),
    (t5, _args(POSITION_BIAS), dict(causal=True, bias=True, scale=1.0)),
    (chunked_causal, _args(), dict(causal=True, bias=True)),
    (top_left_causal, _args(sq=3), dict(causal=False, bias=True, window=NONE)),
    (sdpa_causal, _args(), dict(causal=True, bias=False, scale=None)),
    (sdpa_causal_more_queries, _args(sk=4), dict(causal=False, window=(-1, 2))),
    (sdpa_graph_mask, _args(), dict(causal=True, bias=False)),
    (sdpa_padding, _args(PADDING), dict(causal=False, bias=True)),
    (sdpa_gqa_scale, _args(hkv=KV), dict(scale=0.3, kv_heads=KV)),
    (sdpa_repeat_kv, _args(hkv=KV), dict(kv_heads=KV)),
    (sdpa_reference_mask, _args(), dict(causal=True, bias=False)),
    (sdpa_3d, _args(), dict(kv_heads=B * H)),
    (merged_bmm_4d_mask, _args(ADDITIVE), dict(scale=D ** -0.5, causal=False, bias=True)),
    (bloom, _args(BLOOM_ALIBI), dict(scale=D ** -0.5, causal=True, bias=True)),
    (sdpa_math, _args(), dict(scale=0.3, causal=False, bias=False)),
    (sdpa_math_mask, _args(ADDITIVE), dict(scale=D ** -0.5, causal=False, bias=True)),
    (sdpa_math_bool, _args(PADDING), dict(scale=D ** -0.5, causal=False, bias=True)),
    (sdpa_math_op, _args(), dict(causal=True, bias=False, scale=None)),
    (sdpa_math_op_mask, _args(ADDITIVE, hkv=KV), dict(causal=False, bias=True, scale=0.3, kv_heads=KV)),
    (exp_softmax, _args(), dict(scale=D ** -0.5, causal=False, bias=False)),
    # rows hidden entirely average v beside the op, as the model computes them
    (finfo_fill_padding, _args(_padding_only), dict(causal=False, bias=True)),
    (finfo_fill_left_padded, _args(_causal_left_padded, hkv=KV), dict(causal=False, bias=True, kv_heads=KV)),
    # other terms too: the op reads the model's scores less q @ k^T, with q = 0 on the rows hidden entirely
    (mpt, _args(ALIBI, lambda: ~_causal_left_padded()), dict(causal=False, bias=True)),
    (finfo_where_then_alibi, _args(_causal_left_padded, ALIBI), dict(causal=False, bias=True)),
    (deberta_v2, _args(REL, lambda: _left_padded().long()), dict(causal=False, bias=True, scale=1.0)),
    (bmm_finfo_fill, _args(_causal_left_padded), dict(causal=False, bias=True, kv_heads=B * H)),
    (finfo_fill_and_inf, _args(_left_padded), dict(causal=False, bias=True)),
    (added_inf_then_finfo_fill, _args(_left_padded), dict(causal=False, bias=True)),
]


@pytest.mark.parametrize("fn, inputs, expect", SPELLINGS, ids=[s[0].__name__ for s in SPELLINGS])
def test_spelling(fn, inputs, expect):
    _check(fn, inputs(), **expect)


def _through_flash_backend(fn, args, ref_args, tol):
    """fn compiled with backend="flash" (Inductor included): one flash.attention, no fallback
    to the unmodified graph; output and input gradients against eager fn on ref_args."""
    torch_flash.counters.clear()
    ref, ref_grads, w = _out_and_grads(fn, ref_args)
    out, grads, _ = _out_and_grads(torch.compile(fn, backend="flash"), args, w)
    assert torch_flash.counters["flash.attention"] == 1
    assert_rel_close(out, ref, tol=tol)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_rel_close(g, r, tol=tol, what=f"grad {i}")


# spellings whose rewrite inserts views, permutes or casts around the op
INDUCTOR = ["einsum_bshd", "bmm", "baddbmm_reordered", "inplace", "gqa_bshd", "hf_causal_padding", "sdpa_3d",
            "merged_bmm_4d_mask", "bloom"]


@pytest.mark.filterwarnings("error:torch_flash")
@pytest.mark.parametrize("fn, inputs, expect", [s for s in SPELLINGS if s[0].__name__ in INDUCTOR], ids=INDUCTOR)
def test_spelling_through_inductor(fn, inputs, expect):
    args = inputs()
    _through_flash_backend(fn, args, [_f64(a) for a in args], tol=1e-5)


# the Triton kernels on every mask kind: causal, window, bool and float bias, GQA, softcap
CUDA = ["mul_scale", "einsum_bshd", "bmm", "gqa_repeat_kv", "softcap", "hf_causal", "kv_cache", "sliding_window",
        "keys_at_or_after", "causal_and_padding", "hf_causal_padding", "alibi", "t5", "sdpa_graph_mask"]


@pytest.mark.cuda
@pytest.mark.filterwarnings("error:torch_flash")
@pytest.mark.parametrize("fn, inputs, expect", [s for s in SPELLINGS if s[0].__name__ in CUDA], ids=CUDA)
def test_spelling_cuda_bf16(fn, inputs, expect):
    def cuda(x, dtype):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().to("cuda", dtype).requires_grad_(x.requires_grad)
        return x.to("cuda") if isinstance(x, torch.Tensor) else x

    args = inputs()
    _through_flash_backend(fn, [cuda(a, torch.bfloat16) for a in args],
                           [cuda(a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point()
                                 else a, torch.float64) for a in args], tol=1e-2)


def test_rows_hidden_entirely():
    """A mask that hides the diagonal is not causal: it stays attn_bias, and query 0, which
    sees no key, gives 0 where eager gives NaN; the other rows agree."""
    q, k, v = _qkv()
    compiled, graphs = _compile(strictly_lower)
    out, ref = compiled(q, k, v), strictly_lower(*(_f64(t) for t in (q, k, v)))
    (call,) = _calls(graphs)
    assert not call["causal"] and call["bias"] and _window(call) == NONE
    assert torch.isnan(ref[..., 0, :]).all() and (out[..., 0, :] == 0).all()
    assert_rel_close(out[..., 1:, :], ref[..., 1:, :], tol=1e-5)


def test_finite_fill_hidden_rows_match_the_model():
    """HF eager adds finfo.min where causal & padding hides a key, so a left-padded query row
    that sees no key averages v over all keys. The mask then goes in whole as attn_bias (no
    causal split: under causal=True the row would average over the keys before it only) and
    the op, which weighs keys filled at or below -1e9 alike, gives the model's rows, forward
    and backward. Those rows to 5e-4: the op's fp32 log-sum-exp at its fill score -1e4 rounds
    by up to 4.9e-4; every other row to 1e-5."""
    q, k, v = _qkv()
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[0, :2] = False  # left padding: queries 0 and 1 of sequence 0 see nothing
    ref, ref_grads, w = _out_and_grads(hf_causal_padding, [*(_f64(t) for t in (q, k, v)), pad])
    compiled, graphs = _compile(hf_causal_padding)
    out, grads, _ = _out_and_grads(compiled, [q, k, v, pad], w)
    (call,) = _calls(graphs)
    assert not call["causal"] and call["bias"] and _window(call) == NONE
    assert_rel_close(out[0, :, :2], ref[0, :, :2], tol=5e-4)
    assert_rel_close(out[1], ref[1], tol=1e-5)
    assert_rel_close(out[0, :, 2:], ref[0, :, 2:], tol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert_rel_close(g, r, tol=5e-4, what="grad")


@pytest.mark.parametrize("fn, extra", [(mpt, lambda: [ALIBI(), ~_causal_left_padded()]),
                                       (finfo_where_then_alibi, lambda: [_causal_left_padded(), ALIBI()])])
def test_finite_fill_in_float64(fn, extra):
    """In a float64 model the fill is finfo(float64).min, -inf in fp32: the model's scores less
    q @ k^T are built in float64, so the rows hidden entirely still average v (to 1e-12)."""
    args = [_f64(a) for a in [*_qkv(), *extra()]]
    ref, ref_grads, w = _out_and_grads(fn, args)
    compiled, graphs = _compile(fn)
    out, grads, _ = _out_and_grads(compiled, args, w)
    assert len(_calls(graphs)) == 1
    assert_rel_close(out, ref, tol=1e-12)
    for g, r in zip(grads, ref_grads):
        assert_rel_close(g, r, tol=1e-12, what="grad")


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


# ------------------------------------------------------------------------- dtypes, dropout, shapes

def test_bf16_upcast_and_cast_back():
    """HF's softmax(dtype=float32).to(q.dtype) in bf16: the op computes in fp32 throughout and
    is no worse than eager bf16 against float64."""
    def hf_eager(q, k, v):
        w = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5 + causal_additive_mask(B, S, q.dtype)
        return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)

    q, k, v = (t.detach().bfloat16() for t in _qkv())
    compiled, graphs = _compile(hf_eager)
    out, eager = compiled(q, k, v), hf_eager(q, k, v)
    ref = hf_eager(*(t.double() for t in (q, k, v)))
    assert out.dtype == torch.bfloat16 and len(_calls(graphs)) == 1
    err = assert_rel_close(out, ref, tol=1e-2)
    assert err <= assert_rel_close(eager, ref, tol=1e-2) * 1.5


def test_fp32_scores_of_half_inputs():
    """q.float() @ k.float()^T with half v: the upcasts are dropped, the op runs on the half
    tensors (it accumulates in fp32 anyway)."""
    def upcast(q, k, v):
        s = q.float() @ k.float().transpose(-1, -2) * D ** -0.5
        return torch.softmax(s, -1).to(v.dtype) @ v

    q, k, v = (t.detach().bfloat16() for t in _qkv())
    compiled, graphs = _compile(upcast)
    out = compiled(q, k, v)
    assert out.dtype == torch.bfloat16 and len(_calls(graphs)) == 1
    assert_rel_close(out, upcast(*(t.double() for t in (q, k, v))), tol=1e-2)


def test_dropout_in_training():
    """F.dropout on the probabilities becomes the op's dropout with a seed drawn per call as
    torch_flash.attention draws it: the result is the reference formula's with that seed."""
    p = 0.3

    def train(q, k, v):
        n = q.shape[-2]
        s = _scores(q, k).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), INF)
        return F.dropout(torch.softmax(s, -1), p=p, training=True) @ v

    q, k, v = _qkv()
    compiled, graphs = _compile(train)
    compiled(q, k, v)
    (call,) = _calls(graphs)
    assert call["dropout_p"] == p and call["seed"] and call["causal"]
    torch.manual_seed(1234)
    out, grads, w = _out_and_grads(compiled, [q, k, v])
    torch.manual_seed(1234)
    seed = torch.randint(2**62, (), dtype=torch.int64)

    def expected(q, k, v):
        return reference_attention(q, k, v, causal=True, dropout_p=p, dropout_seed=seed)

    ref, ref_grads, _ = _out_and_grads(expected, [_f64(t) for t in (q, k, v)], w)
    assert_rel_close(out, ref, tol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert_rel_close(g, r, tol=1e-5, what="grad")
    torch.manual_seed(1)
    assert not torch.equal(compiled(q, k, v), out), "each call draws a new dropout mask"


def test_dropout_training_through_inductor():
    torch_flash.counters.clear()
    model = LlamaBlock(p=0.5).train()
    x, mask = torch.randn(2, 8, 32), causal_additive_mask(2, 8)
    out = torch.compile(model, backend="flash")(x, mask)
    out.sum().backward()
    assert torch_flash.counters["flash.attention"] == 1
    assert torch.isfinite(out).all() and model.q.weight.grad.abs().sum() > 0


class InGraphCausal(torch.nn.Module):
    """nanoGPT-style attention whose causal mask is built in forward (no buffer)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.h, self.qkv, self.proj = heads, torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) / (k.size(-1) ** 0.5)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).tril().logical_not(), INF)
        y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def test_training_through_inductor():
    torch_flash.counters.clear()
    check_training(InGraphCausal(), torch.randn(2, 10, 32))
    assert torch_flash.counters["flash.attention"] == 1


def dynamic_head_dim(q, k, v):
    n = q.shape[-2]
    s = q @ k.transpose(-2, -1) / k.size(-1) ** 0.5
    return _attend(s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), INF), v)


@pytest.mark.filterwarnings("error:torch_flash")
@pytest.mark.parametrize("fn", [InGraphCausal().eval(), dynamic_head_dim], ids=["model", "head_dim"])
def test_dynamic_shapes(fn):
    """Under dynamic shapes the mask's sizes are symbolic, and so is a scale 1 / k.size(-1) ** 0.5
    of a dynamic head dim: still causal, and that scale is the op's default."""
    compiled, graphs = _compile(fn, dynamic=True)
    with torch.no_grad():
        for b, t, d in ((2, 8, 8), (3, 5, 4)):
            model = isinstance(fn, torch.nn.Module)
            args = [torch.randn(b, t, 32)] if model else [torch.randn(b, H, t, d) for _ in range(3)]
            torch.testing.assert_close(compiled(*args), fn(*args), atol=1e-5, rtol=1e-5)
    calls = _calls(graphs)
    assert calls and all(c["causal"] and not c["bias"] for c in calls)
    if not isinstance(fn, torch.nn.Module):
        assert all(c["scale"] is None for c in calls)


def test_export_rewrite():
    model = InGraphCausal().eval()
    x = torch.randn(2, 10, 32)
    ep = torch_flash.rewrite(torch.export.export(model, (x,)))
    (call,) = _calls([ep.graph_module])
    assert call["causal"] and not call["bias"]
    torch.testing.assert_close(ep.module()(x), model(x), atol=1e-5, rtol=1e-5)


class CoreAten(torch.nn.Module):
    """LLaMA-style attention (repeat_kv GQA, causal mask built in the graph, fp32 softmax) for
    torch.export's run_decompositions(): matmul becomes bmm of expanded (B*H, S, D) views."""

    def forward(self, q, k, v):
        n = q.shape[1] // k.shape[1]
        s = torch.matmul(q, repeat_kv(k, n).transpose(2, 3)) / math.sqrt(D)
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), INF)
        return torch.matmul(torch.softmax(s.float(), -1).to(q.dtype), repeat_kv(v, n))


@pytest.mark.parametrize("softmax", ["_softmax", "exp"])
def test_core_aten_decomposition(softmax):
    """The core-ATen form of attention (torch.export(...).run_decompositions()): one causal
    GQA flash.attention on the unmerged (B, H, S, D) tensors, with the softmax kept as
    aten._softmax or decomposed further into amax / sub / exp / sum / div; outputs and
    gradients equal the model's in float64."""
    from torch._decomp import decomposition_table

    table = torch.export.default_decompositions()
    if softmax == "exp":
        table[torch.ops.aten._softmax.default] = decomposition_table[torch.ops.aten._softmax.default]
    args = _qkv(hkv=KV)
    ep = torch_flash.rewrite(torch.export.export(CoreAten(), tuple(args)).run_decompositions(table))
    (call,) = _calls([ep.graph_module])
    assert call["causal"] and not call["bias"] and call["kv_heads"] == KV and call["scale"] == pytest.approx(D ** -0.5)
    ref, ref_grads, w = _out_and_grads(CoreAten(), [_f64(a) for a in args])
    out, grads, _ = _out_and_grads(ep.module(), args, w)
    assert_rel_close(out, ref, tol=1e-5)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_rel_close(g, r, tol=1e-5, what=f"grad {i}")


# ------------------------------------------------------------------------- transformers

def _hf(name, impl):
    import transformers as T

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4)
    make = {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**common, num_key_value_heads=2)),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**common, num_key_value_heads=2, sliding_window=3)),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**common, num_key_value_heads=2)),
        "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**common, num_key_value_heads=1, head_dim=8)),
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4)),
        "gpt2_reordered": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                                 reorder_and_upcast_attn=True)),
        "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**common)),
        "opt": lambda: T.OPTForCausalLM(T.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                    num_attention_heads=4, word_embed_proj_dim=32)),
        "phi": lambda: T.PhiForCausalLM(T.PhiConfig(**common)),
        "bert": lambda: T.BertModel(T.BertConfig(**common)),
        "roberta": lambda: T.RobertaModel(T.RobertaConfig(**common)),
        "vit": lambda: T.ViTModel(T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                              intermediate_size=64, image_size=16, patch_size=4)),
        "t5": lambda: T.T5Model(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)),
    }
    model = make[name]().eval()
    model.set_attn_implementation(impl)
    return model


# (name, causal self-attention expected, window_left expected)
HF = [("llama", True, -1), ("mistral", True, 2), ("qwen2", True, -1), ("gemma", True, -1), ("gpt2", True, -1),
      ("gpt2_reordered", True, -1), ("gpt_neox", True, -1), ("opt", True, -1), ("phi", True, -1),
      ("bert", False, -1), ("roberta", False, -1), ("vit", False, -1), ("t5", None, -1)]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name, causal, window_left", HF, ids=[h[0] for h in HF])
def test_transformers(name, causal, window_left, impl):
    """Every attention site of a tiny HF model is rewritten; decoders get causal=True (with the
    padding of attention_mask as attn_bias) where the mask hides with False; outputs at
    non-padded positions and parameter gradients match eager."""
    model = _hf(name, impl)
    ids = torch.randint(1, 64, (2, 7))
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    attention_mask[1, -2:] = 0  # right padding: every query sees a key
    if name == "vit":
        inputs = dict(pixel_values=torch.randn(2, 3, 16, 16))
    elif name == "t5":
        inputs = dict(input_ids=ids, attention_mask=attention_mask, decoder_input_ids=ids[:, :5])
    else:
        inputs = dict(input_ids=ids, attention_mask=attention_mask)
    report = torch_flash.explain(model, **inputs)
    sites = [s for s in report.sites if s.family == "attention"]
    assert sites and all(s.rewritten for s in sites), str(report)
    compiled, graphs = _compile(model)
    valid = attention_mask.bool() if "input_ids" in inputs and name != "t5" else ...

    weight = []

    def step(fn):
        model.zero_grad()
        out = fn(**inputs)
        out = (out.logits if hasattr(out, "logits") else out.last_hidden_state)[valid]
        weight.append(weight[0] if weight else torch.randn_like(out))  # (a post-LayerNorm output's
        (out * weight[0]).sum().backward()  # square has no gradient to speak of)
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (ref, ref_grads), (out, grads) = step(model), step(compiled)
    assert_rel_close(out, ref, tol=1e-5)
    assert grads.keys() == ref_grads.keys()
    scale = max(g.norm() for g in ref_grads.values())
    for n, g in ref_grads.items():  # relative to the largest: key biases get none at all
        assert (grads[n] - g).norm() <= 1e-4 * g.norm() + 1e-6 * scale, n
    calls = _calls(graphs)
    assert len(calls) == len(sites)
    if name == "t5":  # encoder self, decoder self (causal), decoder cross, per layer
        assert [c["causal"] for c in calls] == [False, False, True, False, True, False]
    elif impl == "eager" and "input_ids" in inputs:
        # HF hides with finfo.min: a padded query row may see no key, and averages v (left
        # padding), so the mask goes in whole (test_finite_fill_hidden_rows_match_the_model)
        assert all(not c["causal"] and c["window_left"] == -1 and c["bias"] for c in calls), calls
    else:
        assert all(c["causal"] == causal and c["window_left"] == window_left for c in calls), calls


class RuntimeScale(torch.nn.Module):
    """Scores scaled by a one-value tensor the model reads at run time, as PyTorch Inductor's
    _sfdp patterns spell it: divided by an inverse scale or multiplied by a scale factor,
    before an additive mask or without one; the factor a learned parameter (its gradient
    reaches it through q * c) or a buffer."""

    def __init__(self, how: str, mask: bool, learned: bool, d: int = 16):
        super().__init__()
        self.how, self.mask = how, mask
        self.proj = torch.nn.Linear(d, 3 * d)
        c = torch.tensor(d ** 0.5 if how == "div" else d ** -0.5)
        if learned:
            self.c = torch.nn.Parameter(c)
        else:
            self.register_buffer("c", c)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 2, -1).transpose(1, 2) for t in self.proj(x).chunk(3, -1))
        scores = q @ k.transpose(-2, -1)
        scores = scores.div(self.c) if self.how == "div" else scores * self.c
        if self.mask:
            scores = scores + torch.full((s, s), float("-inf")).triu(1)
        return scores.softmax(-1) @ v


@pytest.mark.parametrize("how", ["div", "mul"])
@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("learned", [False, True])
def test_runtime_scale_tensor(how, mask, learned):
    """The scale folds into q (q * c, then scale 1.0): the same outputs and gradients, the
    factor's included, and the site reported rewritten."""
    torch.manual_seed(0)
    model, x = RuntimeScale(how, mask, learned), torch.randn(2, 6, 16)
    report = torch_flash.explain(model, x)
    assert [s.op for s in report.sites] == ["attention"], str(report)
    check_training(model, x)


def test_runtime_scale_after_a_mask_is_left_with_a_reason():
    """A mask added before the runtime scale would be scaled with the scores: left alone, with
    the reason in explain."""
    class ScaledAfterMask(RuntimeScale):
        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (t.view(b, s, 2, -1).transpose(1, 2) for t in self.proj(x).chunk(3, -1))
            scores = (q @ k.transpose(-2, -1) + torch.randn(s, s)) * self.c
            return scores.softmax(-1) @ v

    report = torch_flash.explain(ScaledAfterMask("mul", False, False), torch.randn(2, 6, 16))
    assert [s.op for s in report.sites] == [None]
    assert "a mask or bias is added before a scale read from a tensor" in str(report)


def test_transformers_bloom():
    """HF Bloom (eager only): ALiBi through baddbmm on (B*H, S, D) tensors, the scores viewed
    as (B, H, S, S), finfo.min mask, fp32 softmax. Every site is rewritten with ALiBi in
    attn_bias (the mask whole: it hides with finfo.min) and the outputs equal the model's.
    Forward only here: the loss and every gradient (through Bloom's GeLU, a custom
    autograd.Function) are test_backend.py::test_bloom_gradients' and test_hf_models.py's."""
    import transformers as T

    model = T.BloomForCausalLM(T.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)).eval()
    ids = torch.randint(1, 64, (2, 7))
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    attention_mask[0, :2] = 0  # left padding: rows that see no key
    report = torch_flash.explain(model, input_ids=ids, attention_mask=attention_mask)
    sites = [s for s in report.sites if s.family == "attention"]
    assert len(sites) == 2 and all(s.rewritten for s in sites), str(report)
    compiled, graphs = _compile(model)
    with torch.no_grad():
        out = compiled(input_ids=ids, attention_mask=attention_mask).logits
        ref = model(input_ids=ids, attention_mask=attention_mask).logits
    assert all(not c["causal"] and c["bias"] for c in _calls(graphs))
    assert_rel_close(out, ref, tol=1e-5)
