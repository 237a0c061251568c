"""Attention inside a region of another autocast or grad mode. torch.export keeps such a region
as one higher-order op (wrap_with_autocast / wrap_with_set_grad_enabled) running a subgraph;
the softmax there is rewritten inside that subgraph, under the same mode, and every site there
is reported by explain, naming the wrap. Dynamo's graphs keep the mode switches inline."""
import pytest
import torch
import torch.nn as nn

import torch_flash
from _attention_cases import B, D, H, S
from _utils import assert_rel_close, rel_err
from models import causal_additive_mask, flash_calls, rotate_half

WRAPS = {"autocast": torch.ops.higher_order.wrap_with_autocast,
         "no_grad": torch.ops.higher_order.wrap_with_set_grad_enabled}
FLASH = torch.ops.flash.attention.default


def _region(region):
    return torch.autocast("cpu", dtype=torch.bfloat16) if region == "autocast" else torch.no_grad()


class WrappedAttention(nn.Module):
    """x (B, S, H*D) -> (B, S, H*D): q, k, v projections, then hand-written attention
    (q @ k^T * scale, a mask, softmax, @ v) inside the region, then the output projection.
    mask: None, "causal" (built in the region by tril) or "additive" (a (B, 1, S, S) input)."""

    def __init__(self, region, mask=None):
        super().__init__()
        self.region, self.mask = region, mask
        self.qkv, self.out = nn.Linear(H * D, 3 * H * D), nn.Linear(H * D, H * D)

    def forward(self, x, bias=None):
        q, k, v = self.qkv(x).unflatten(-1, (3, H, D)).permute(2, 0, 3, 1, 4)
        with _region(self.region):
            s = q @ k.transpose(-2, -1) * D ** -0.5
            if self.mask == "causal":
                keep = torch.tril(torch.ones(S, S, dtype=torch.bool, device=x.device))
                s = s.masked_fill(~keep, float("-inf"))
            elif self.mask == "additive":
                s = s + bias
            o = torch.softmax(s, dim=-1) @ v
        return self.out(o.to(x.dtype).transpose(1, 2).flatten(2))


def _inputs(mask, dtype=torch.float32):
    x = torch.randn(B, S, H * D, dtype=dtype)
    return (x, causal_additive_mask(B, S, dtype)) if mask == "additive" else (x,)


def _loss_and_grads(model, args):
    """model(*args) and the gradients of its parameters from a fixed weighted sum of it."""
    model.zero_grad()
    out = model(*args)
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum()
    loss.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _flash_nodes(ep) -> list:
    """The flash.attention nodes of an exported program, in its graph and the wraps' subgraphs."""
    return [n for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.find_nodes(op="call_function", target=FLASH)]


@pytest.mark.parametrize("mask", [None, "causal", "additive"])
@pytest.mark.parametrize("region", ["autocast", "no_grad"])
def test_export_rewrites_inside_wrap(region, mask):
    """One flash.attention inside the wrap's subgraph, no softmax left; output and parameter
    gradients against the model in float64 (autocast leaves float64 alone), by relative error:
    at most twice the model's own (bf16 under autocast, where on CPU flash.attention's matmuls
    run under the ambient autocast too), and 1e-5 at least."""
    torch.manual_seed(0)
    model, args = WrappedAttention(region, mask), _inputs(mask)
    ep = torch.export.export(model, args)
    wraps = [n for n in ep.graph.nodes if n.target is WRAPS[region]]
    assert len(wraps) == 1  # the spelling under test
    ep = torch_flash.rewrite(ep)
    nodes = _flash_nodes(ep)
    assert len(nodes) == 1 and nodes[0].graph is not ep.graph
    # the tril mask built in the region is causal=True; the additive input is attn_bias
    assert nodes[0].kwargs["causal"] == (mask == "causal") and (nodes[0].args[3] is not None) == (mask == "additive")
    assert not any(n.target is torch.ops.aten.softmax.int for m in ep.graph_module.modules()
                   if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)

    out, grads = _loss_and_grads(ep.module(), args)  # its own copy of the parameters
    eager, eager_grads = _loss_and_grads(model, args)
    ref, ref_grads = _loss_and_grads(model.double(), [a.double() for a in args])
    assert grads.keys() == ref_grads.keys() == eager_grads.keys() and grads
    for what, got, own, want in [("output", out, eager, ref)] + [
            (name, grads[name], eager_grads[name], ref_grads[name]) for name in grads]:
        assert_rel_close(got, want.float(), tol=max(2 * rel_err(own, want), 1e-5), what=what)


@pytest.mark.parametrize("region", ["autocast", "no_grad"])
def test_rewritten_program_saves_and_loads(tmp_path, region):
    """The flash op inside the subgraph survives torch.export's serialization."""
    torch.manual_seed(0)
    model, args = WrappedAttention(region, "causal"), _inputs("causal")
    ep = torch_flash.rewrite(torch.export.export(model, args))
    torch.export.save(ep, tmp_path / "wrapped.pt2")
    loaded = torch.export.load(tmp_path / "wrapped.pt2")
    assert len(_flash_nodes(loaded)) == 1
    torch.testing.assert_close(loaded.module()(*args), ep.module()(*args))


@pytest.mark.parametrize("region", ["autocast", "no_grad"])
def test_explain_names_the_wrap(region):
    """explain reports the site inside the wrap as rewritten, with the wrap and its mode."""
    ep = torch.export.export(WrappedAttention(region, "causal"), _inputs("causal"))
    report = torch_flash.explain(ep)
    assert [s.op for s in report.sites] == ["attention"]
    name = {"autocast": "wrap_with_autocast(cpu, torch.bfloat16", "no_grad": "wrap_with_set_grad_enabled(False)"}
    assert report.sites[0].reason.startswith(f"inside {name[region]}")


class NearMiss(nn.Module):
    """A softmax over scores inside autocast whose probabilities are returned, not multiplied
    with v: a candidate site that is not attention."""

    def forward(self, q, k):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.softmax(q @ k.transpose(-2, -1), dim=-1)


def test_explain_reason_inside_wrap():
    q, k = torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    report = torch_flash.explain(torch.export.export(NearMiss(), (q, k)))
    (site,) = [s for s in report.sites if s.family == "attention"]
    assert not site.rewritten
    assert site.reason.startswith("inside wrap_with_autocast(cpu, torch.bfloat16, True, False): softmax not rewritten")


class Nested(WrappedAttention):
    """The attention under autocast inside a no_grad region: a wrap inside a wrap's subgraph."""

    def forward(self, x, bias=None):
        with torch.no_grad():
            return super().forward(x, bias)


def test_nested_wraps():
    torch.manual_seed(0)
    model, args = Nested("autocast", "causal"), _inputs("causal")
    ep = torch_flash.rewrite(torch.export.export(model, args))
    assert len(_flash_nodes(ep)) == 1
    report = torch_flash.explain(torch.export.export(model, args))
    assert [s.op for s in report.sites] == ["attention"]
    assert report.sites[0].reason.startswith("inside wrap_with_set_grad_enabled(False): inside wrap_with_autocast(")
    out = ep.module()(*args)
    assert_rel_close(out, model.double()(*[a.double() for a in args]).float(), tol=1e-2)


@pytest.mark.parametrize("region", ["autocast", "no_grad"])
def test_flash_backend_inline_region(region):
    """Dynamo keeps the mode switches as calls in its graph: the attention between them is
    rewritten there."""
    torch.manual_seed(0)
    model, args = WrappedAttention(region, "causal"), _inputs("causal")
    calls = flash_calls(model, *args)
    assert [c[0] for c in calls] == ["flash.attention.default"] and calls[0][1]["causal"]


class Tables(nn.Module):
    """Rotary x (B, H, S, D) * cos + rotate_half(x) * sin under autocast, its (S, D) tables each
    two copies of an (S, D/2) one made outside the region from angles: learned (a parameter)
    or not (a buffer)."""

    def __init__(self, learned):
        super().__init__()
        angles = torch.randn(S, D // 2)
        if learned:
            self.angles = nn.Parameter(angles)
        else:
            self.register_buffer("angles", angles)

    def forward(self, x):
        cos, sin = self.angles.cos(), self.angles.sin()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
            return x * cos + rotate_half(x) * sin


@pytest.mark.parametrize("learned", [False, True])
def test_learned_tables_seen_through_the_wrap(learned):
    """A subgraph's input computed outside shows no requires_grad: the wrap's argument does,
    and learned tables stay with the model (flash.rotary gives them no gradient)."""
    x = torch.randn(B, H, S, D)
    report = torch_flash.explain(torch.export.export(Tables(learned), (x,)))
    (site,) = [s for s in report.sites if s.family == "rotary"]
    assert site.rewritten != learned
    assert site.reason.startswith("inside wrap_with_autocast(")
    assert ("require grad" in site.reason) == learned


def test_shared_subgraph_gets_no_callers_operands():
    """A subgraph two wraps run on different inputs is rewritten once, with no caller's
    operands for its placeholders (a table proven for one caller proves nothing of the other's);
    one wrap's subgraph gets its operands."""
    from compile_passes.graph import regions_of

    def wrapped(callers):
        root = torch.nn.Module()
        root.body = torch.fx.symbolic_trace(lambda t: t.sin())
        graph = torch.fx.Graph()
        inputs = [graph.placeholder(name) for name in "ab"]
        sub = graph.get_attr("body")
        wrap = torch.ops.higher_order.wrap_with_set_grad_enabled
        graph.output(tuple(graph.call_function(wrap, (False, sub, inputs[i])) for i in callers))
        return torch.fx.GraphModule(root, graph), inputs

    gm, _ = wrapped([0, 1])
    assert [(name, outer) for name, _, outer in regions_of(gm)] == [("wrap_with_set_grad_enabled(False)", ())]
    gm, (a, _) = wrapped([0])
    assert [outer for _, _, outer in regions_of(gm)] == [(a,)]
