"""Regions of Dynamo's and export's graphs through the pass: a higher-order op running a subgraph.
Layers under torch.utils.checkpoint (activation checkpointing, HF's gradient checkpointing)
become one tag_activation_checkpoint node each: the pass rewrites inside that subgraph, so the
flash ops are recomputed in the backward as the model's own ops were. A branch of torch.cond is
rewritten inside its subgraph too; a torch.compiler.nested_compile_region is inlined. Results
match the model's, forward and backward."""
import functools
import math

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import torch_flash
from torch_flash.compile_passes import Report
from _utils import assert_rel_close
from models import LlamaBlock, causal_additive_mask, check_training

CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


def _save_matmuls(ctx, op, *args, **kwargs):
    """A selective-checkpointing policy: keep matmul outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointedBlocks(nn.Module):
    """Two LLaMA blocks (eager attention, RMSNorm), each under checkpoint; `policy`: selective
    checkpointing's context_fn."""

    def __init__(self, use_reentrant=False, policy=None):
        super().__init__()
        self.blocks = nn.ModuleList([LlamaBlock(), LlamaBlock()])
        self.kwargs = dict(use_reentrant=use_reentrant)
        if policy is not None:
            self.kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)

    def forward(self, x, mask):
        for block in self.blocks:
            x = checkpoint(block, x, mask, **self.kwargs)
        return x


def _inputs():
    # reentrant checkpointing needs an input that requires grad for its region to get one
    return torch.randn(2, 8, 32, requires_grad=True), causal_additive_mask(2, 8)


def _graph_handed_on(model, *args) -> torch.fx.GraphModule:
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=torch_flash.backend(inner=capture))(*args)
    torch._dynamo.reset()
    (gm,) = graphs
    return gm


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "selective"])
def test_checkpointed_layers_train_with_flash_ops_inside_the_regions(how):
    torch.manual_seed(0)
    model = CheckpointedBlocks(use_reentrant=how == "reentrant", policy=_save_matmuls if how == "selective" else None)
    args = _inputs()
    torch_flash.counters.clear()
    check_training(model, *args)
    assert torch_flash.counters["flash.attention"] == 2
    assert torch_flash.counters["flash.rms_norm"] + torch_flash.counters["flash.add_rms_norm"] == 4
    # every flash op sits in a region's subgraph, none in the outer graph: AOTAutograd then
    # recomputes them in the backward, as it does the region's other ops
    gm = _graph_handed_on(model, *args)
    regions = list(gm.graph.find_nodes(op="call_function", target=CHECKPOINT))
    assert len(regions) == 2
    inside = [n for r in regions for n in getattr(gm, r.args[0].target).graph.nodes if str(n.target).startswith("flash.")]
    assert sorted(str(n.target) for n in inside).count("flash.attention.default") == 2
    assert not [n for n in gm.graph.nodes if str(n.target).startswith("flash.")]


def test_explain_names_the_checkpointed_region():
    report = torch_flash.explain(CheckpointedBlocks(), *_inputs())
    attention = [s for s in report.sites if s.family == "attention"]
    assert len(attention) == 2 and all(s.rewritten for s in attention)
    assert all(s.reason.startswith("inside a torch.utils.checkpoint region") for s in report.sites)


def _aot(gm, example_inputs):
    """AOTAutograd with Inductor's partitioner (it honours the regions' recompute tags) and
    no Inductor codegen (minutes on CPU)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import aot_module_simplified

    def run(g, _):
        return make_boxed_func(g.forward)
    return aot_module_simplified(gm, example_inputs, fw_compiler=run, bw_compiler=run,
                                 partition_fn=min_cut_rematerialization_partition)


def test_hf_llama_with_gradient_checkpointing():
    """HF LLaMA with activation (gradient) checkpointing on: every site rewritten (attention, two
    norms and q and k's rotary a layer, the final norm, the loss; rotary's tables come from
    outside the region), loss and every parameter gradient as the model's own."""
    transformers = pytest.importorskip("transformers")
    layers = 2
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    # transformers 5 renamed it (the old name warns)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    ids = torch.randint(0, 128, (2, 16))

    def step(fn):
        model.zero_grad()
        loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    report = Report()
    ref, ref_grads = step(model)
    loss, grads = step(torch.compile(model, backend=torch_flash.backend(inner=_aot, report=report)))
    assert [s for s in report.sites if not s.rewritten] == []
    assert len(report.sites) == 5 * layers + 2
    assert all(s.reason.startswith("inside a torch.utils.checkpoint region") for s in report.sites
               if s.op in ("attention", "rotary"))
    assert_rel_close(loss, ref, tol=1e-5, what="loss")
    for name, g in ref_grads.items():
        assert_rel_close(grads[name], g, tol=1e-4, what=name)


def _attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v


class CondAttention(nn.Module):
    """Attention in torch.cond's true branch (on the data: the sign of a sum), a projection
    before it so that parameters get gradients through the branch."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        q = self.proj(x)
        return torch.cond(q.sum() > 0, lambda t: _attention(t, t, t), lambda t: t.cos(), (q,))


class NestedAttention(nn.Module):
    """One nested_compile_region called twice (a region compiled once for both calls)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        @torch.compiler.nested_compile_region
        def block(t):
            return _attention(t, t, t)
        q = self.proj(x)
        return block(q) + block(q * 2)


@pytest.mark.parametrize("model, sites, reason", [
    (CondAttention, 1, "inside torch.cond's true branch"), (NestedAttention, 2, None)])
def test_cond_and_nested_regions(model, sites, reason):
    torch.manual_seed(0)
    model, x = model(), torch.randn(2, 2, 8, 16)
    if isinstance(model, CondAttention):  # the branch with the attention is the one that runs
        with torch.no_grad():
            model.proj.bias.fill_(1.0)
    report = torch_flash.explain(model, x)
    assert [s.op for s in report.sites] == ["attention"] * sites and all(s.rewritten for s in report.sites)
    if reason:
        assert all(s.reason.startswith(reason) for s in report.sites)
    torch_flash.counters.clear()
    check_training(model, x)
    assert torch_flash.counters["flash.attention"] == sites


def test_exported_cond_rewritten_inside_the_branch():
    """torch.export keeps torch.cond with its branches as subgraphs: rewrite() replaces the
    attention in the branch, with the model's output."""
    torch.manual_seed(0)
    model, x = CondAttention(), torch.randn(2, 2, 8, 16)
    with torch.no_grad():
        model.proj.bias.fill_(1.0)
    ep = torch_flash.rewrite(torch.export.export(model, (x,)))
    nodes = [n for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
             for n in m.graph.find_nodes(op="call_function", target=torch.ops.flash.attention.default)]
    assert len(nodes) == 1 and nodes[0].graph is not ep.graph
    assert_rel_close(ep.module()(x), model(x), tol=1e-5)
