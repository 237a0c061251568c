"""Cross-entropy spellings -> flash.cross_entropy / flash.linear_cross_entropy through the
flash backend, torch.export + rewrite, and explain()."""
import pytest
import torch
import torch.nn.functional as F

import torch_flash
from models import TinyCausalLM, check_training, flash_calls

# the backend falls back to the unrewritten graph with a warning: here that is a failure
pytestmark = pytest.mark.filterwarnings("error:torch_flash")

VOCAB = 37


def _batch(b=2, s=6, ignore=True):
    ids, labels = torch.randint(0, VOCAB, (b, s)), torch.randint(0, VOCAB, (b, s))
    if ignore:
        labels[0, -2] = -100  # padding, as HF marks it
    return ids, labels


@pytest.mark.parametrize("loss, options, op", [
    ("hf", {}, "linear_cross_entropy"),
    ("hf", {"bias": True, "label_smoothing": 0.1}, "linear_cross_entropy"),
    ("hf", {"return_logits": True}, "cross_entropy"),  # the logits live on: no lm-head fusion
    ("nll", {"tied": True}, "linear_cross_entropy"),
    ("lse", {}, "cross_entropy"),
    ("transposed", {}, "linear_cross_entropy"),
])
def test_train(loss, options, op):
    torch.manual_seed(0)
    model = TinyCausalLM(loss=loss, **options)
    check_training(model, *_batch(ignore=loss != "lse"))  # gather takes no -100
    assert torch_flash.counters == {f"flash.{op}": 1}


@pytest.mark.parametrize("bias", [False, True])
def test_train_autocast(bias):
    """bf16 autocast over an fp32 model: the lm-head runs in bf16 from fp32 hidden states and
    weight, so linear_cross_entropy gets them cast to bf16 as autocast would (not fp32 GEMMs)."""
    torch.manual_seed(0)
    model, batch = TinyCausalLM(bias=bias), _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        check_training(model, *batch, atol=1e-2, rtol=1e-2)  # bf16 logits rounded in other orders
        assert torch_flash.counters == {"flash.linear_cross_entropy": 1}
        (op, _, dtypes), = flash_calls(model, *batch)
    assert op == "flash.linear_cross_entropy.default"
    assert dtypes == [torch.bfloat16, torch.bfloat16, torch.int64] + [torch.bfloat16] * bias


def test_bf16():
    """A bf16 model: HF's upcast loss fuses with the lm-head and stays fp32; a loss computed
    in bf16 stays bf16 (the op's fp32 loss is cast) and is closer to fp64 than the model's."""
    torch.manual_seed(0)
    ids, labels = _batch()
    for loss, dtype in (("hf", torch.float32), ("nll", torch.bfloat16)):
        model = TinyCausalLM(loss=loss).to(torch.bfloat16)
        torch._dynamo.reset()
        torch_flash.counters.clear()
        with torch.inference_mode():
            out = torch.compile(model, backend="flash")(ids, labels)
            ref = model(ids, labels)
            exact = model.double()(ids, labels)
        assert torch_flash.counters == {"flash.linear_cross_entropy": 1}
        assert out.dtype == ref.dtype == dtype
        assert abs(out.double() - exact) <= max(abs(ref.double() - exact), 1e-2 * exact)


def test_dynamic_shapes():
    torch.manual_seed(0)
    model = TinyCausalLM(label_smoothing=0.1)
    compiled = torch.compile(model, backend="flash", dynamic=True)
    # specialize_float: see test_layer_norm_patterns.test_dynamic_shapes
    with torch.no_grad(), torch._dynamo.config.patch(specialize_float=True):
        for b, s in ((2, 6), (3, 9)):
            batch = _batch(b, s)
            torch.testing.assert_close(compiled(*batch), model(*batch), atol=1e-5, rtol=1e-5)
    assert torch_flash.counters["flash.linear_cross_entropy"] >= 1


def test_export_rewrite(tmp_path):
    torch.manual_seed(0)
    model = TinyCausalLM()
    batch = _batch()
    ep = torch_flash.rewrite(torch.export.export(model, batch))
    ops = [str(n.target) for n in ep.graph.nodes if str(n.target).startswith("flash.")]
    assert ops == ["flash.linear_cross_entropy.default"]
    assert not any(n.target == torch.ops.aten.linear.default for n in ep.graph.nodes)  # no logits
    torch.export.save(ep, tmp_path / "lm.pt2")
    torch.testing.assert_close(torch.export.load(tmp_path / "lm.pt2").module()(*batch), model(*batch))


def test_explain_reasons():
    class Odd(torch.nn.Module):
        def forward(self, logits, labels, pixels, pixel_labels):
            weighted = F.cross_entropy(logits, labels, weight=torch.linspace(0.5, 1.5, VOCAB))
            spatial = F.cross_entropy(pixels, pixel_labels)  # (N, C, H, W): classes in dim 1
            no_log_softmax = F.nll_loss(logits, labels)
            return weighted, spatial, no_log_softmax

    report = torch_flash.explain(Odd(), torch.randn(4, VOCAB), torch.randint(0, VOCAB, (4,)),
                                 torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2, 4, 4)))
    assert [s.family for s in report.sites] == ["loss"] * 3 and not any(s.rewritten for s in report.sites)
    text = str(report)
    assert "class weights (weight=) are not supported" in text
    assert "the class dimension is dim 1" in text
    assert "not log_softmax over the last (class) dimension" in text
