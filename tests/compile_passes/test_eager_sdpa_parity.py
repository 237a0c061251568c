"""HF LLaMA with attn_implementation "eager" and "sdpa" through the flash backend:
after the pass both reach Inductor as the same training graphs, op for op (with their constant
arguments: shapes, scale, causal), saving the same tensors for the backward; and each trains
as the model itself does. Graphs are read where Inductor's post-grad passes end (its custom
post pass), forward and backward. The difference there was a copy of attention's output into
the model's contiguous layout, which HF's transpose back then copied again: the pass copies
only for a reader that needs that layout."""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils._pytree import tree_leaves

import torch_flash

transformers = pytest.importorskip("transformers")

from _utils import assert_rel_close  # noqa: E402

# the backend falls back to the unrewritten graph with a warning: here that is a failure; one
# xdist worker runs the module, so that the `runs` fixture (two Inductor compiles) runs once
pytestmark = [pytest.mark.filterwarnings("error:torch_flash"), pytest.mark.xdist_group("eager_sdpa_parity")]

B, S, VOCAB = 2, 16, 128
# two layers: the second reuses the mask the model built once; GQA (4 query heads, 2 kv heads)
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
              tie_word_embeddings=False, initializer_range=0.2)


def _ops(graph: fx.Graph) -> Counter:
    """Each call as (op, its constant arguments): every op counts, views too, since a view
    Inductor cannot make of a buffer's layout is a copy."""
    def constants(n):
        return tuple(repr(a) for a in tree_leaves((n.args, n.kwargs)) if not isinstance(a, fx.Node))

    return Counter((str(n.target), constants(n)) for n in graph.nodes if n.op == "call_function")


class _Capture(CustomGraphPass):
    """Inductor's post-grad custom pass that records each graph it sees, by kind: the backward
    is the one with tangents. Its inputs other than tangents are what the forward saved."""

    def __init__(self):
        self.ops, self.saved = {}, None

    def __call__(self, graph: fx.Graph) -> None:
        inputs = list(graph.find_nodes(op="placeholder"))
        backward = any(str(p.target).startswith("tangents") for p in inputs)
        self.ops["backward" if backward else "forward"] = _ops(graph)
        if backward:
            self.saved = Counter((tuple(v.shape), v.dtype) for p in inputs if not str(p.target).startswith("tangents")
                                 and isinstance(v := p.meta["val"], torch.Tensor))

    def uuid(self):
        return None  # never cached: every compile runs the pass


def _nbytes(saved: Counter) -> int:
    return sum(torch.Size(shape).numel() * dtype.itemsize * k for (shape, dtype), k in saved.items())


def _train(model, ids, fn=None) -> tuple[torch.Tensor, dict]:
    """One forward and backward of model (through fn, its compiled form, if given)."""
    loss = (model if fn is None else fn)(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def runs():
    """impl -> (capture, compiled loss and gradients, the model's own)."""
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
    out = {}
    for impl in ("sdpa", "eager"):
        torch.manual_seed(0)  # the same weights in both modes
        cfg = transformers.LlamaConfig(**CONFIG)
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=impl).train()
        ref = _train(copy.deepcopy(model), ids)
        capture = _Capture()
        torch._dynamo.reset()
        with torch._inductor.config.patch(post_grad_custom_post_pass=capture, fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            got = _train(model, ids, torch.compile(model, backend="flash"))
        out[impl] = capture, got, ref
    torch._dynamo.reset()
    return out


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_same_ops(runs, kind):
    sdpa, eager = runs["sdpa"][0].ops[kind], runs["eager"][0].ops[kind]
    assert eager == sdpa, f"eager-only: {eager - sdpa}; sdpa-only: {sdpa - eager}"


def test_same_saved_tensors(runs):
    sdpa, eager = runs["sdpa"][0].saved, runs["eager"][0].saved
    assert sdpa, "no backward graph captured"
    assert eager == sdpa, (f"saved {_nbytes(eager)} bytes against {_nbytes(sdpa)}; eager-only: {eager - sdpa}; "
                           f"sdpa-only: {sdpa - eager}")


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_training_matches_model(runs, impl):
    _, (loss, grads), (ref_loss, ref_grads) = runs[impl]
    assert_rel_close(loss, ref_loss, what="loss")
    for name, ref in ref_grads.items():
        assert_rel_close(grads[name], ref, what=name)


class _ViewsOutput(torch.nn.Module):
    """Attention whose output is viewed as the model's contiguous (B, H, S, D) tensor: a
    reader that needs that layout."""

    def forward(self, q, k, v):
        w = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
        return (w @ v).view(q.shape[0], -1, q.shape[-1]) * 2


class _TransposesOutput(torch.nn.Module):
    """HF eager's layout back: transpose(1, 2).contiguous(), then a view."""

    def forward(self, q, k, v):
        w = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
        return (w @ v).transpose(1, 2).contiguous().view(q.shape[0], q.shape[2], -1) * 2


@pytest.mark.parametrize("model, copies", [(_ViewsOutput, 1), (_TransposesOutput, 0)])
def test_output_copied_only_where_read_as_contiguous(model, copies):
    """flash.attention's out is laid out like q ((B, S, H, D) memory here): copied into the
    model's contiguous layout only for a reader that needs it. After the model's transpose
    back, its own .contiguous() finds the value contiguous already (the graph's meta says so)."""
    x = tuple(torch.randn(2, 8, 4, 16).transpose(1, 2) for _ in range(3))
    m = model()
    ep = torch_flash.rewrite(torch.export.export(m, x))
    calls = [n for n in ep.graph.nodes if n.op == "call_function"]
    assert sum(n.target is torch.ops.flash.attention.default for n in calls) == 1
    copying = [n for n in calls if n.target is torch.ops.aten.contiguous.default
               and not n.args[0].meta["val"].is_contiguous()]
    assert len(copying) == copies
    assert_rel_close(ep.module()(*x), m(*x))


class _ConstantZeroMask(torch.nn.Module):
    """transformers' eager mask up to 5.17: where(causal, torch.tensor(0.0), finfo.min), its 0
    a tensor constant that the traced graph holds rather than computes."""

    def forward(self, q, k, v):
        i = torch.arange(q.shape[2])
        keep = (i[None, :] <= i[:, None])[None, None]
        mask = torch.where(keep, torch.tensor(0.0, dtype=q.dtype), torch.finfo(q.dtype).min)
        w = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask, dim=-1)
        return w @ v


def _compiled_graph(m, x) -> tuple[fx.GraphModule, torch.Tensor]:
    """The graph the flash backend hands on, and its output."""
    graphs = []

    def inner(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(m, backend=torch_flash.backend(inner=inner))(*x)
    return graphs[0], out


def _exported_graph(m, x) -> tuple[fx.GraphModule, torch.Tensor]:
    """The rewritten ExportedProgram's graph (export lifts the held 0 to an input), its output."""
    ep = torch_flash.rewrite(torch.export.export(m, x))
    return ep.graph_module, ep.module()(*x)


@pytest.mark.parametrize("trace", [_compiled_graph, _exported_graph], ids=["compile", "export"])
def test_constant_zero_mask_is_causal_without_bias(trace):
    """The held 0 reads as the number: causal=True and no attn_bias (a 0-d bias of zeros kept
    the GPU off its bias-free kernels: the Hopper forward of csrc/attention, cuDNN's backward)."""
    x = tuple(torch.randn(2, 4, 8, 16) for _ in range(3))
    m = _ConstantZeroMask()
    gm, out = trace(m, x)
    (call,) = gm.graph.find_nodes(op="call_function", target=torch.ops.flash.attention.default)
    assert call.args[3] is None and call.kwargs["causal"] is True
    assert_rel_close(out, m(*x))
