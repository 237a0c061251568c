"""Hugging Face transformers models through torch.export and torch_flash.rewrite, as a user
deploying one would: every attention, norm, loss and rotary site of the exported program is
rewritten (the sites counted from each config, as in test_hf_models; the loss without the LM
head, whose logits the program returns too), explain() of the program says so, and the rewritten program gives the model's own loss and logits (fp32, eval, a
right-padded batch: padding as data in the mask). Export spells some things as the compiled
path does not: a tensor the model makes while traced (a mask's `torch.tensor(0.0)` fill) is a
lifted input, and a `no_grad` region (rotary tables) one node running a subgraph."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch_flash  # noqa: E402

from _utils import assert_rel_close  # noqa: E402
from test_hf_models import MODELS, assert_sites, batch_of, expected_sites  # noqa: E402

# one of each kind of model: rotary decoders (sequential, parallel, sliding and full layers), an
# encoder, ALiBi through baddbmm (eager only), and encoder-decoders with relative bias or none
NAMES = ["llama", "gpt_neox", "gemma3", "bert", "bloom", "t5", "bart"]
CASES = [pytest.param(name, impl, id=f"{name}-{impl}") for name in NAMES for impl in ("eager", "sdpa")]


@pytest.mark.parametrize("name, impl", CASES)
def test_rewrite_exported_model(name, impl):
    spec = MODELS[name]
    cls = getattr(transformers, spec.model)
    if impl == "sdpa" and not cls._supports_sdpa:
        pytest.skip(f"{spec.model} in transformers {transformers.__version__} does not support sdpa")
    torch.manual_seed(0)
    model = cls(getattr(transformers, spec.config)(**spec.options, attn_implementation=impl)).eval()
    model.loss_type = model.loss_type or "ForCausalLM"  # as test_hf_models: GPT-2-like names give none
    batch = batch_of(spec.task, "right")
    ep = torch.export.export(model, (), batch)
    expected, left = expected_sites(name, model.config)
    # the program returns the logits too, so the LM head stays a matmul of its own
    if "linear_cross_entropy" in expected:
        expected["cross_entropy"] = expected.pop("linear_cross_entropy")
    assert_sites(torch_flash.explain(ep), expected, left)
    rewritten = torch_flash.rewrite(ep)
    with torch.no_grad():
        got, ref = rewritten.module()(**batch), model(**batch)
    assert_rel_close(got.loss, ref.loss, what="loss")
    assert_rel_close(got.logits, ref.logits, what="logits")


@pytest.mark.parametrize("name, impl", [c for c in CASES if MODELS[c.values[0]].task == "causal"
                                        and c.values[0] != "bloom"])  # (ALiBi is a bias)
def test_causal_mask_without_bias(name, impl):
    """Without an attention_mask a decoder's mask is causal (and a sliding window) alone, built in
    the graph: each attention becomes causal=True with no attn_bias (a bias of zeros would keep
    the GPU off its bias-free kernels), in eager mode as in SDPA mode."""
    spec = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, spec.model)(
        getattr(transformers, spec.config)(**spec.options, attn_implementation=impl)).eval()
    ids = batch_of(spec.task)["input_ids"]
    ep = torch_flash.rewrite(torch.export.export(model, (), {"input_ids": ids}))
    calls = list(ep.graph.find_nodes(op="call_function", target=torch.ops.flash.attention.default))
    assert len(calls) == spec.ops(model.config)["attention"]
    assert all(c.args[3] is None and c.kwargs["causal"] for c in calls), [c.format_node() for c in calls]
    with torch.no_grad():
        assert_rel_close(ep.module()(input_ids=ids).logits, model(input_ids=ids).logits, what="logits")
