"""RMSNorm spellings -> flash.rms_norm / flash.add_rms_norm through the flash backend,
torch.export + rewrite, and explain(): nn.RMSNorm (aten.rms_norm) and the hand-written
norms of LLaMA, Gemma and T5 (transformers' own T5LayerNorm: statistics of x.float(), the
half x scaled, the weight's cast first)."""
import pytest
import torch
import torch.nn.functional as F

import torch_flash
from models import GemmaRMSNorm, LlamaRMSNorm, PlainRMSNorm, PreLNBlock, check_training, flash_calls

# the backend falls back to the unrewritten graph with a warning: here that is a failure
pytestmark = pytest.mark.filterwarnings("error:torch_flash")


def _t5(d):
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    norm = t5.T5LayerNorm(d)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)  # not all ones, so a lost weight shows
    return norm


def _nn(d, eps=1e-6):
    norm = torch.nn.RMSNorm(d, eps=eps)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    return norm


NORMS = {
    "nn.RMSNorm": _nn,
    "nn.RMSNorm-eps-None": lambda d: _nn(d, eps=None),  # torch's default: finfo(dtype).eps
    "llama": LlamaRMSNorm,
    "gemma": GemmaRMSNorm,
    "plain": PlainRMSNorm,
    "t5": _t5,
}


@pytest.mark.parametrize("norm", NORMS)
def test_train_pre_norm_block(norm):
    torch.manual_seed(0)
    check_training(PreLNBlock(norm=NORMS[norm]), torch.randn(2, 5, 32))
    # the first norm reads the input, the second the residual sum
    assert torch_flash.counters == {"flash.rms_norm": 1, "flash.add_rms_norm": 1}


@pytest.mark.parametrize("norm", ["nn.RMSNorm", "llama", "gemma"])
def test_train_autocast_residual_stream(norm):
    """bf16 autocast over an fp32 model: the residual stream (fp32) plus a branch's bf16
    output sums in fp32, and the sum still fuses into the norm; y, read only by linears that
    autocast runs in bf16, is written in bf16 by the op (no cast pass)."""
    torch.manual_seed(0)
    model, x = PreLNBlock(norm=NORMS[norm]), torch.randn(2, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        check_training(model, x)
        assert torch_flash.counters == {"flash.rms_norm": 1, "flash.add_rms_norm": 1}
        calls = flash_calls(model, x)
    assert [(op, kw.get("out_dtype")) for op, kw, _ in calls] == [
        ("flash.rms_norm.default", torch.bfloat16), ("flash.add_rms_norm.default", torch.bfloat16)]


def test_train_autocast_y_read_through_views():
    """y reaches its autocast readers through views: a slice into a linear, a reshape into a
    cast (torch_flash.integrations.transformers' lm-head placeholder and fused loss). The
    views are made again on the bf16 y; the old ones went, so the fp32 y could go too."""
    class ViewsReader(torch.nn.Module):
        def __init__(self, d=32):
            super().__init__()
            self.norm, self.head = LlamaRMSNorm(d), torch.nn.Linear(d, 8)

        def forward(self, x):
            y = self.norm(x)
            return self.head(y.narrow(-2, 0, 2)), y.reshape(-1, y.shape[-1]).to(torch.bfloat16) * 2

    torch.manual_seed(0)
    model, x = ViewsReader(), torch.randn(2, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        check_training(model, x, atol=1e-2, rtol=1e-2)  # bf16 sums (head.bias) in another order
        assert torch_flash.counters == {"flash.rms_norm": 1}
        calls = flash_calls(model, x)
    assert [(op, kw.get("out_dtype")) for op, kw, _ in calls] == [("flash.rms_norm.default", torch.bfloat16)]


@pytest.mark.parametrize("norm", ["nn.RMSNorm", "llama", "gemma", "t5"])
def test_bf16_inference(norm):
    """A bf16 model: each spelling's dtype rule is kept, and the result is no further from
    fp64 than the model's own."""
    torch.manual_seed(0)
    model = PreLNBlock(norm=NORMS[norm]).to(torch.bfloat16).eval()
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = torch.compile(model, backend="flash")(x)
        ref = model(x)
        exact = model.double()(x.double())
    assert torch_flash.counters == {"flash.rms_norm": 1, "flash.add_rms_norm": 1}
    assert out.dtype == torch.bfloat16
    err = lambda y: ((y.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert err(out) <= max(1.5 * err(ref), 1e-2)


def test_export_t5_fp32_weight_half_input(tmp_path):
    """T5LayerNorm with an fp32 weight and a bf16 input keeps the fp32 result (no cast back):
    the op normalises the fp32 upcast."""
    torch.manual_seed(0)
    norm = _t5(16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    ep = torch_flash.rewrite(torch.export.export(norm, (x,)))
    assert [str(n.target) for n in ep.graph.nodes if str(n.target).startswith("flash.")] == ["flash.rms_norm.default"]
    torch.export.save(ep, tmp_path / "t5.pt2")
    out = torch.export.load(tmp_path / "t5.pt2").module()(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, norm(x), atol=1e-5, rtol=1e-5)


def test_explain_reasons():
    class Odd(torch.nn.Module):
        def forward(self, x, w64):
            other = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * x.flip(-1)
            mixed = F.rms_norm(x, x.shape[-1:], w64, 1e-6)
            two_dims = F.rms_norm(x, x.shape[-2:])
            return other, mixed, two_dims

    report = torch_flash.explain(Odd(), torch.randn(2, 4, 8), torch.randn(8, dtype=torch.float64))
    assert [s.family for s in report.sites] == ["norm"] * 3 and not any(s.rewritten for s in report.sites)
    text = str(report)
    assert "looks like RMSNorm but rsqrt(...) is not multiplied by the same x" in text
    assert "weight dtype differs from the input's" in text
    assert "normalized_shape covers more than the last dimension" in text
