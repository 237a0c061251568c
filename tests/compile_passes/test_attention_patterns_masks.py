"""Attention spellings -> flash.attention with masks and biases built in the graph: causal
and windows proven from them (aligned as flash aligns them), padding, packed documents,
ALiBi / T5 / chunked biases as attn_bias, and the finite fills (finfo.min) under which a row
that sees no key averages v as the model computes it; outputs and gradients equal eager in
float64 by relative error."""
import pytest
import torch
import torch.nn.functional as F

from _attention_cases import (ADDITIVE, ALIBI, B, BLOOM_ALIBI, D, H, INF, KV, NONE, PADDING, POSITION_BIAS, REL, S,
                              SLOPES, _args, _attend, _calls, _causal_left_padded, _check, _compile, _f64, _ij,
                              _left_padded, _ones, _out_and_grads, _padding_only, _qkv, _scores,
                              _through_flash_backend, _through_flash_backend_cuda_bf16, _window)
from _utils import assert_rel_close
from models import repeat_kv


# ------------------------------------------------------------------------- masks

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


def hf_packed_sliding(q, k, v):  # and a sliding-window piece by the same gathered positions (Gemma 3)
    pos = (torch.arange(q.shape[-2], device=q.device) + 0)[None, :].expand(q.shape[0], -1)
    b_idx = torch.arange(q.shape[0], device=q.device)[:, None, None, None]
    q_idx = torch.arange(q.shape[-2], device=q.device)[None, None, :, None]
    kv_idx = torch.arange(q.shape[-2], device=q.device)[None, None, None, :]
    mask = _packed_mask(q, pos[:1]) & (pos[b_idx, kv_idx] > pos[b_idx, q_idx] - 3)
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


# ------------------------------------------------------------------------- finite fills

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


SPELLINGS = [
    # (fn, inputs, expected flash.attention arguments)
    (triu_masked_fill, _args(), dict(causal=True, bias=False, window=NONE)),
    (nanogpt_in_graph, _args(), dict(causal=True, bias=False)),
    (not_tril, _args(), dict(causal=True, bias=False)),
    (where_arange_finfo, _args(), dict(causal=True, bias=False)),
    (additive_triu, _args(), dict(causal=True, bias=False)),
    (hf_causal, _args(), dict(causal=True, bias=False)),
    (hf_packed_causal, _args(), dict(causal=True, bias=False)),
    (hf_packed_sliding, _args(), dict(causal=True, bias=False, window=(2, -1))),
    (hf_packed_documents, _args(), dict(causal=False, bias=True)),
    (kv_cache, _args(sq=3), dict(causal=True, bias=False)),
    (sliding_window, _args(), dict(causal=True, bias=False, window=(2, -1))),
    (keys_at_or_after, _args(), dict(causal=False, bias=False, window=(0, -1))),
    (padding_input, _args(PADDING), dict(causal=False, bias=True)),
    (causal_and_padding, _args(PADDING), dict(causal=True, bias=True)),
    (hf_causal_padding, _args(PADDING), dict(causal=False, bias=True)),  # finite fill: test_finite_fill_*
    (additive_input, _args(ADDITIVE), dict(causal=False, bias=True)),
    (alibi, _args(SLOPES), dict(causal=True, bias=False, alibi=True)),  # slopes * (j - i) under causal: ALiBi
    (t5, _args(POSITION_BIAS), dict(causal=True, bias=True, scale=1.0)),
    (chunked_causal, _args(), dict(causal=True, bias=True)),
    (top_left_causal, _args(sq=3), dict(causal=False, bias=True, window=NONE)),
    (merged_bmm_4d_mask, _args(ADDITIVE), dict(scale=D ** -0.5, causal=False, bias=True)),
    (bloom, _args(BLOOM_ALIBI), dict(scale=D ** -0.5, causal=True, bias=True)),
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


# spellings whose rewrite inserts views, permutes or casts around the op
INDUCTOR = ["hf_causal_padding", "merged_bmm_4d_mask", "bloom"]


@pytest.mark.filterwarnings("error:torch_flash")
@pytest.mark.parametrize("fn, inputs, expect", [s for s in SPELLINGS if s[0].__name__ in INDUCTOR], ids=INDUCTOR)
def test_spelling_through_inductor(fn, inputs, expect):
    args = inputs()
    _through_flash_backend(fn, args, [_f64(a) for a in args], tol=1e-5)


# the Triton kernels on every mask kind: causal, window, bool and float bias
CUDA = ["hf_causal", "kv_cache", "sliding_window", "keys_at_or_after", "causal_and_padding", "hf_causal_padding",
        "alibi", "t5"]


@pytest.mark.cuda
@pytest.mark.filterwarnings("error:torch_flash")
@pytest.mark.parametrize("fn, inputs, expect", [s for s in SPELLINGS if s[0].__name__ in CUDA], ids=CUDA)
def test_spelling_cuda_bf16(fn, inputs, expect):
    _through_flash_backend_cuda_bf16(fn, inputs())


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


@pytest.mark.parametrize("chunk", [1 << 24, 7])
def test_constant_band_in_row_chunks(monkeypatch, chunk):
    """A mask evaluated at compile time is a band lo <= key - query <= hi exactly when it is
    one, however many rows a chunk of the check holds (7 elements: one row at a time)."""
    from torch_flash.compile_passes.patterns.attention import masks
    monkeypatch.setattr(masks, "BAND_CHUNK_ELEMENTS", chunk)
    i, j = torch.arange(9)[:, None], torch.arange(12)[None, :]
    causal, window = j <= i + 3, (j <= i + 3) & (j >= i)
    assert masks._band(causal.expand(2, 9, 12)) == (-8, 3)
    assert masks._band(window[None]) == (0, 3)
    holes = window.clone()
    holes[4, 5] = False
    assert masks._band(holes[None]) is None
    assert masks._band(torch.stack([causal, window])) is None  # slices must agree
    assert masks._band(torch.zeros(1, 9, 12, dtype=torch.bool)) is None
