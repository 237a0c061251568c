"""Attention rewrites in other dtypes and modes: bf16 / half inputs, dropout in training, whole
models through Inductor, dynamic shapes, torch.export and its core-ATen decompositions."""
import math

import pytest
import torch
import torch.nn.functional as F

import torch_flash
from torch_flash.reference.attention import attention as reference_attention
from _attention_cases import B, D, H, INF, KV, S, _attend, _calls, _compile, _f64, _out_and_grads, _qkv, _scores
from _utils import assert_rel_close
from models import LlamaBlock, causal_additive_mask, check_training, repeat_kv


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
