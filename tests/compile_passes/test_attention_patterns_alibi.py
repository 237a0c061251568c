"""ALiBi biases proven and run as flash.attention's alibi_slopes, with no attn_bias: hand-written
modules (causal, non-causal, GQA, Sq != Sk, slopes computed in the graph or held as a buffer),
HF Bloom and MPT. Output and every parameter gradient equal the unrewritten model's (fp32). Biases
that only look like ALiBi stay attn_bias, with explain's reason."""
import math

import pytest
import torch
import torch.nn as nn

import torch_flash
from _attention_cases import B, D, H, KV, S, _attend, _calls, _compile, _f64, _ij, _qkv, _scores
from _utils import assert_rel_close


def _slopes(h: int) -> torch.Tensor:
    """ALiBi's geometric slopes, 2^(-8/h), 2^(-16/h), ..."""
    return torch.pow(2.0, -8.0 * torch.arange(1, h + 1) / h)


class AlibiAttention(nn.Module):
    """Multi-head attention with an ALiBi bias, spelled as `bias`: "causal" slope * (j - i) under a
    causal mask, "keys" slope * j (Bloom's, per key only) under a causal mask, "distance"
    -slope * |i - j| with no mask, "distance_causal" the same under a causal mask. slopes
    "graph" computes them in forward, "buffer" holds them, "tensor" makes them in forward from
    a list (a constant of the traced graph). kv_heads < heads: GQA (repeat_kv)."""

    def __init__(self, bias="causal", slopes="graph", heads=H, kv_heads=H, d=D, learned=False):
        super().__init__()
        self.bias, self.heads, self.kv_heads, self.d = bias, heads, kv_heads, d
        self.q = nn.Linear(32, heads * d)
        self.kv = nn.Linear(32, 2 * kv_heads * d)
        self.o = nn.Linear(heads * d, 32)
        self.from_graph, self.from_list = slopes == "graph", slopes == "tensor"
        if learned:
            self.slopes = nn.Parameter(_slopes(heads))
        elif not self.from_graph:
            self.register_buffer("slopes", _slopes(heads))

    def forward(self, x, memory=None):
        b, sq, _ = x.shape
        mem = x if memory is None else memory
        sk = mem.shape[1]
        q = self.q(x).view(b, sq, self.heads, self.d).transpose(1, 2)
        k, v = self.kv(mem).view(b, sk, 2, self.kv_heads, self.d).permute(2, 0, 3, 1, 4)
        n = self.heads // self.kv_heads
        if n > 1:  # repeat_kv
            k, v = (t[:, :, None].expand(b, self.kv_heads, n, sk, self.d).reshape(b, self.heads, sk, self.d)
                    for t in (k, v))
        if self.from_list:
            slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / self.heads) for h in range(self.heads)], device=x.device)
        else:
            slopes = _slopes(self.heads).to(x.device) if self.from_graph else self.slopes
        i = torch.arange(sq, device=x.device)[:, None] + (sk - sq)  # queries at the end of the keys
        j = torch.arange(sk, device=x.device)[None, :]
        s = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        if self.bias == "causal":
            s = s + slopes[:, None, None] * (j - i)
        elif self.bias == "keys":
            s = s + slopes.view(1, -1, 1, 1) * torch.arange(sk, device=x.device)
        elif self.bias == "linear_no_mask":
            s = s + slopes[:, None, None] * (j - i)
        else:
            s = s - slopes[:, None, None] * (i - j).abs()
        if self.bias in ("causal", "keys", "distance_causal"):
            s = s.masked_fill(j > i, float("-inf"))
        out = torch.softmax(s, -1) @ v
        return self.o(out.transpose(1, 2).reshape(b, sq, -1))


def _flash_calls(graphs):
    return [n for g in graphs for n in g.graph.find_nodes(op="call_function", target=torch.ops.flash.attention.default)]


def _train(model, args, fn=None):
    """(output, {param: grad}) of one forward/backward of fn (default: the model), with a
    fixed random weighting of the output."""
    fn = model if fn is None else fn
    model.zero_grad()
    out = fn(*args)
    out = out if isinstance(out, torch.Tensor) else out.loss
    torch.manual_seed(7)
    (out * torch.randn_like(out)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_model(model, args, *, causal, alibi=True, bias=None):
    """model compiled with the attention rewrite: one flash.attention, with alibi_slopes and no
    attn_bias (alibi) or with attn_bias and no slopes (bias: whether it has an attn_bias, when
    that differs); output and parameter gradients equal eager's (fp32, relative to their
    norms). Returns the call node."""
    torch.manual_seed(0)
    ref, ref_grads = _train(model, args)
    compiled, graphs = _compile(model)
    out, grads = _train(model, args, compiled)
    (call,) = _flash_calls(graphs)
    slopes = call.args[5] if len(call.args) > 5 else None
    assert (slopes is not None, call.args[3] is not None) == (alibi, not alibi if bias is None else bias), \
        call.format_node()
    assert call.kwargs["causal"] == causal
    assert_rel_close(out, ref, tol=1e-5)
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in ref_grads.items():
        assert_rel_close(grads[name], g, tol=1e-5, what=name)
    return call


@pytest.mark.parametrize("bias, slopes, causal", [
    ("causal", "graph", True), ("causal", "buffer", True), ("keys", "graph", True), ("keys", "buffer", True),
    ("causal", "tensor", True), ("distance", "graph", False), ("distance", "buffer", False),
    ("distance", "tensor", False), ("distance_causal", "buffer", True)])
def test_hand_written(bias, slopes, causal):
    model = AlibiAttention(bias, slopes)
    _check_model(model, [torch.randn(B, S, 32)], causal=causal)


@pytest.mark.parametrize("bias, causal", [("causal", True), ("distance", False), ("distance_causal", True)])
def test_gqa(bias, causal):
    call = _check_model(AlibiAttention(bias, kv_heads=KV), [torch.randn(B, S, 32)], causal=causal)
    assert call.args[1].meta["val"].shape[1] == KV  # k and v unrepeated


@pytest.mark.parametrize("bias, causal", [("causal", True), ("keys", True), ("distance", False)])
def test_fewer_queries_than_keys(bias, causal):
    """Queries at the end of the keys (a KV cache's): the distance to the bottom-right diagonal."""
    _check_model(AlibiAttention(bias, "buffer"), [torch.randn(B, 3, 32), torch.randn(B, S, 32)], causal=causal)


def test_dynamic_shapes():
    model = AlibiAttention("causal")
    torch.manual_seed(0)
    compiled, graphs = _compile(model, dynamic=True)
    for s in (S, S + 3):
        x = torch.randn(B, s, 32)
        assert_rel_close(compiled(x), model(x), tol=1e-5)
    assert all(n.args[3] is None and n.args[5] is not None for n in _flash_calls(graphs))


def test_one_slope_for_all_heads():
    """scores - 0.5 * |i - j|: one slope, which the op takes per head."""
    def fn(q, k, v):
        i, j = _ij(q)
        return _attend(_scores(q, k) - 0.5 * (i - j).abs(), v)

    q, k, v = _qkv()
    compiled, graphs = _compile(fn)
    out = compiled(q, k, v)
    (call,) = _calls(graphs)
    assert not call["bias"] and call["alibi"]
    assert_rel_close(out, fn(*(_f64(t) for t in (q, k, v))), tol=1e-5)


def _reason(model, *args, **kwargs) -> str:
    """explain's note on the one attention site of model(*args, **kwargs), which is rewritten."""
    sites = [s for s in torch_flash.explain(model, *args, **kwargs).sites if s.family == "attention"]
    assert sites and all(s.rewritten for s in sites)
    return sites[0].reason


@pytest.mark.parametrize("model, words", [
    (lambda: AlibiAttention("linear_no_mask"), "ALiBi only under a causal mask"),
    (lambda: AlibiAttention("causal", "buffer", learned=True), "require grad"),
])
def test_left_as_bias_with_a_reason(model, words):
    """ALiBi-like biases that are not ALiBi here: slope * (j - i) with no causal mask, slopes
    that are learned (the op gives alibi_slopes no gradient). They stay attn_bias, the results
    equal the model's, and explain says why."""
    m = model()
    x = torch.randn(B, S, 32)
    _check_model(m, [x], causal=False if "no_mask" in m.bias else True, alibi=False)
    torch._dynamo.reset()
    reason = _reason(m, x)
    assert words in reason and "attn_bias" in reason, reason


def test_shifted_distance_is_not_alibi():
    """-|i - j + 1|: the distance to another diagonal than the op's, with no mask to fix its sign."""
    def fn(q, k, v, slopes):
        i, j = _ij(q)
        return _attend(_scores(q, k) - slopes[:, None, None] * (i - j + 1).abs(), v)

    args = [*_qkv(), _slopes(H)]
    compiled, graphs = _compile(fn)
    assert_rel_close(compiled(*args), fn(*(_f64(a) for a in args)), tol=1e-5)
    (call,) = _calls(graphs)
    assert call["bias"] and not call["alibi"]
    assert "another diagonal" in _reason(fn, *args)


def test_learned_position_bias_stays_bias():
    """A learned (T5-like) bias is not ALiBi-like: attn_bias, and no note."""
    def fn(q, k, v, bias):
        return _attend(_scores(q, k) + bias, v)

    args = [*_qkv(), torch.randn(1, H, S, S, requires_grad=True)]
    compiled, graphs = _compile(fn)
    compiled(*args)
    (call,) = _calls(graphs)
    assert call["bias"] and not call["alibi"]
    assert _reason(fn, *args) == ""


# --- Hugging Face models (tiny configs, random weights)

transformers = pytest.importorskip("transformers")
BLOOM = dict(vocab_size=128, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0,
             use_cache=False, initializer_range=0.2)
MPT = dict(vocab_size=128, d_model=32, n_heads=4, n_layers=2, max_seq_len=64, use_cache=False, initializer_range=0.2)


def _hf(name):
    torch.manual_seed(0)
    if name == "bloom":
        return transformers.BloomForCausalLM(transformers.BloomConfig(**BLOOM, attn_implementation="eager"))
    return transformers.MptForCausalLM(transformers.MptConfig(**MPT, attn_implementation="eager"))


def _batch(padding=None):
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (B, 8))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if padding:
        mask = torch.ones(B, 8, dtype=torch.long)
        pads = slice(0, 3) if padding == "left" else slice(5, 8)
        mask[0, pads] = 0
        batch["labels"][0, pads] = -100
        batch["attention_mask"] = mask
    return batch


def _check_hf(model, batch, alibi: bool, grad_tol=1e-5):
    """Loss and every parameter gradient through the attention rewrite equal eager's; every
    flash.attention call takes alibi_slopes and no attn_bias (alibi) or an attn_bias."""
    def step(fn):
        model.zero_grad()
        loss = fn(**batch).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref, ref_grads = step(model)
    compiled, graphs = _compile(lambda **kw: model(**kw))
    loss, grads = step(compiled)
    calls = _flash_calls(graphs)
    assert len(calls) == model.config.num_hidden_layers
    for call in calls:
        slopes = call.args[5] if len(call.args) > 5 else None
        assert (slopes is not None) == alibi, call.format_node()
        if alibi:
            assert tuple(slopes.meta["val"].shape) == (model.config.num_attention_heads,)
    assert_rel_close(loss, ref, tol=1e-5, what="loss")
    scale = max(g.norm() for g in ref_grads.values())
    for name, g in ref_grads.items():
        if g.norm() <= 1e-6 * scale:  # a key bias: softmax is blind to it, both hold noise
            assert grads[name].norm() <= 1e-6 * scale, name
        else:
            assert_rel_close(grads[name], g, tol=grad_tol, what=name)
    return calls


@pytest.mark.parametrize("name", ["bloom", "mpt"])
def test_hf_unpadded(name):
    """No attention_mask: Bloom's alibi is slopes * arange(Sk) repeated over the batch as
    (B*H, 1, Sk) for baddbmm, MPT's slopes * (j - Sk + 1) sliced from a max_seq_len table;
    both under transformers' causal mask: alibi_slopes, causal=True, no attn_bias."""
    for call in _check_hf(_hf(name), _batch(), alibi=True):
        assert call.args[3] is None and call.kwargs["causal"]


@pytest.mark.parametrize("side", ["left", "right"])
def test_mpt_padded(side):
    """MPT's positions do not depend on the mask: still ALiBi, beside the model's bool mask (rows
    that left padding hides entirely average v beside the op, as the model computes them)."""
    _check_hf(_hf("mpt"), _batch(side), alibi=True)


@pytest.mark.parametrize("side", ["left", "right"])
def test_bloom_padded_stays_bias(side):
    """Bloom with an attention_mask: its positions are the mask's cumsum, ALiBi only for left or
    right padding, which the graph does not show: attn_bias, with the reason; the model's results."""
    model, batch = _hf("bloom"), _batch(side)
    _check_hf(model, batch, alibi=False, grad_tol=5e-4 if side == "left" else 1e-5)
    torch._dynamo.reset()
    sites = [s for s in torch_flash.explain(lambda **kw: model(**kw).loss, **batch).sites if s.family == "attention"]
    assert sites and all(s.rewritten and "cumsum of an attention mask" in s.reason for s in sites)


# --- other spellings and entry points

def bloom_mask_of_ones(q, k, v):
    """Bloom's build_alibi_tensor on a mask of ones made in the graph: positions cumsum(mask) - 1,
    (B*H, 1, S) as baddbmm's input, the (B*H) scores viewed as (B, H) for the causal mask."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    b, h, s, d = q.shape
    alibi = build_alibi_tensor(torch.ones(b, s, dtype=torch.long, device=q.device), h, q.dtype)
    w = alibi.baddbmm(q.reshape(b * h, s, d), k.reshape(b * h, s, d).transpose(1, 2), beta=1.0, alpha=d ** -0.5)
    w = w.view(b, h, s, s).masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (torch.softmax(w, -1).view(b * h, s, s) @ v.reshape(b * h, s, d)).view(b, h, s, d)


def sdpa_alibi_mask(q, k, v):
    """F.scaled_dot_product_attention with ALiBi summed into an additive causal mask."""
    i, j = _ij(q)
    causal = torch.zeros(q.shape[-2], q.shape[-2], device=q.device).masked_fill(j > i, float("-inf"))
    mask = _slopes(q.shape[1]).to(q.device).view(1, -1, 1, 1) * (j - i) + causal
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("fn", [bloom_mask_of_ones, sdpa_alibi_mask])
def test_spelling(fn):
    if fn is bloom_mask_of_ones:
        pytest.importorskip("transformers")
    q, k, v = _qkv()
    compiled, graphs = _compile(fn)
    out, ref = compiled(q, k, v), fn(*(_f64(t) for t in (q, k, v)))
    (call,) = _calls(graphs)
    assert call["causal"] and call["alibi"] and not call["bias"]
    assert_rel_close(out, ref, tol=1e-5)
    (g,) = torch.autograd.grad((out * torch.randn_like(out)).sum(), q)
    assert not torch.isnan(g).any()


class PaddedAlibi(AlibiAttention):
    """AlibiAttention("causal") with an additive (B, 1, 1, S) padding mask of finfo.min, as HF adds."""

    def forward(self, x, pad):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.heads, self.d).permute(2, 0, 3, 1, 4)
        slopes = _slopes(self.heads) if self.from_graph else self.slopes
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        w = q @ k.transpose(-1, -2) / math.sqrt(self.d) + slopes[:, None, None] * (j - i) + pad
        w = w.masked_fill(j > i, float("-inf"))
        return self.o((torch.softmax(w, -1) @ v).transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("slopes", ["graph", "buffer"])
def test_beside_a_finite_padding_mask(slopes):
    """A float padding mask of finfo.min, which the op reads as the score -1e4: ALiBi's penalty
    must stay well above it. Slopes computed from constants and static sizes bound it (ALiBi,
    the mask as attn_bias); a buffer's slopes may change: the bias stays whole, with the reason."""
    model = PaddedAlibi("causal", slopes)
    pad = torch.zeros(B, 1, 1, S)
    pad[0, ..., -2:] = torch.finfo(torch.float32).min
    x = torch.randn(B, S, 32)
    if slopes == "graph":
        _check_model(model, [x, pad], causal=True, alibi=True, bias=True)
        return
    _check_model(model, [x, pad], causal=True, alibi=False)
    torch._dynamo.reset()
    assert "not bounded" in _reason(model, x, pad)


@pytest.mark.parametrize("slopes", ["buffer", "tensor"])
def test_export_and_rewrite(slopes):
    """torch.export then torch_flash.rewrite: the program runs flash.attention with alibi_slopes
    (a buffer, or a constant that export lifts to an input)."""
    model = AlibiAttention("causal", slopes).eval()
    x = torch.randn(B, S, 32)
    ep = torch_flash.rewrite(torch.export.export(model, (x,)))
    (call,) = ep.graph.find_nodes(op="call_function", target=torch.ops.flash.attention.default)
    assert call.args[3] is None and call.args[5] is not None
    with torch.no_grad():
        assert_rel_close(ep.module()(x), model(x), tol=1e-5)


def test_through_inductor():
    """backend="flash" (Inductor included): the slopes reach the op, the results the model's."""
    from models import check_training

    torch_flash.counters.clear()
    check_training(AlibiAttention("causal"), torch.randn(B, S, 32))
    assert torch_flash.counters["flash.attention"] == 1


def test_half_precision_bias_stays_bias():
    """Bloom in bf16 rounds its ALiBi to bf16 (slope * 7 to 8 bits), where the op's is fp32: not
    the model's bias, so it stays attn_bias, with the reason."""
    model = _hf("bloom").to(torch.bfloat16)
    reason = _reason(lambda **kw: model(**kw).loss, **_batch())
    assert "half precision" in reason, reason
