"""LayerNorm spellings -> flash.layer_norm / flash.add_layer_norm through the flash backend,
torch.export + rewrite, and explain()."""
import pytest
import torch
import torch.nn.functional as F

import torch_flash
from models import HandLayerNorm, LlamaRMSNorm, PreLNBlock, TokenFlatBlock, check_training, flash_calls

# the backend falls back to the unrewritten graph with a warning: here that is a failure
pytestmark = pytest.mark.filterwarnings("error:torch_flash")


def _flash_ops(gm):
    return sorted(str(n.target) for n in gm.graph.nodes if str(n.target).startswith("flash."))


@pytest.mark.parametrize("norm", ["nn.LayerNorm", "var", "mean"])
def test_train_pre_ln_block(norm):
    torch.manual_seed(0)
    make = torch.nn.LayerNorm if norm == "nn.LayerNorm" else (lambda d: HandLayerNorm(d, style=norm))
    check_training(PreLNBlock(norm=make), torch.randn(2, 5, 32))
    # the first norm reads the input, the second the residual sum
    assert torch_flash.counters == {"flash.layer_norm": 1, "flash.add_layer_norm": 1}


def test_train_autocast_residual_stream():
    """bf16 autocast over an fp32 model: the fp32 residual stream plus the bf16 branch sums
    in fp32; the fused op takes the fp32 operand as x, so the sum and the statistics stay
    fp32, and y, read only by linears that autocast runs in bf16, is written in bf16."""
    torch.manual_seed(0)
    model, x = PreLNBlock(), torch.randn(2, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        check_training(model, x)
        assert torch_flash.counters == {"flash.layer_norm": 1, "flash.add_layer_norm": 1}
        calls = flash_calls(model, x)
    assert [(op, kw.get("out_dtype")) for op, kw, _ in calls] == [
        ("flash.layer_norm.default", torch.bfloat16), ("flash.add_layer_norm.default", torch.bfloat16)]


def test_fp32_reader_keeps_fp32():
    """Under autocast a norm whose y is also read by an fp32 op (here the block's output) stays
    fp32: out_dtype is only for a y that every reader casts."""
    torch.manual_seed(0)
    norm, w = torch.nn.LayerNorm(32), torch.randn(8, 32)

    def model(x):
        y = norm(x)
        return y + F.linear(y, w).sum()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        calls = flash_calls(model, torch.randn(2, 32))
    assert [(op, kw) for op, kw, _ in calls] == [("flash.layer_norm.default", {})]


def test_bf16_inference_fp32_statistics():
    """A half model computing the statistics in fp32 (cast back before the weight): the op
    reads the bf16 x itself, and is no further from fp64 than the model."""
    torch.manual_seed(0)
    model = PreLNBlock(norm=lambda d: HandLayerNorm(d, style="upcast")).to(torch.bfloat16).eval()
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = torch.compile(model, backend="flash")(x)
        ref = model(x)
        exact = model.double()(x.double())
    assert torch_flash.counters == {"flash.layer_norm": 1, "flash.add_layer_norm": 1}
    assert out.dtype == torch.bfloat16
    err = lambda y: ((y.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert err(out) <= max(1.5 * err(ref), 1e-2)


def test_dynamic_shapes():
    torch.manual_seed(0)
    model = PreLNBlock().eval()
    compiled = torch.compile(model, backend="flash", dynamic=True)
    # specialize_float: Dynamo would make eps a graph input and restart once the rewrite
    # specialises it; the backend turns that restart into a fallback for now
    with torch.no_grad(), torch._dynamo.config.patch(specialize_float=True):
        for shape in ((2, 5, 32), (3, 7, 32)):
            x = torch.randn(shape)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    assert torch_flash.counters["flash.add_layer_norm"] >= 1


def test_export_rewrite_upcast_aten_layer_norm(tmp_path):
    """F.layer_norm(x.float(), ...).to(x.dtype): the upcast and the cast back go away."""

    class Fp32LayerNorm(torch.nn.LayerNorm):  # open_clip's LayerNormFp32
        def forward(self, x):
            return F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps).to(x.dtype)

    torch.manual_seed(0)
    model = Fp32LayerNorm(16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    ep = torch_flash.rewrite(torch.export.export(model, (x,)))
    assert _flash_ops(ep.graph_module) == ["flash.layer_norm.default"]
    assert not any(n.target == torch.ops.aten.to.dtype for n in ep.graph.nodes)
    torch.export.save(ep, tmp_path / "ln.pt2")
    out = torch.export.load(tmp_path / "ln.pt2").module()(x)
    torch.testing.assert_close(out, model(x), atol=1e-2, rtol=1e-2)


def test_train_residual_through_reshape():
    """OPT's spelling: the sum is flattened to (tokens, d) before the norm, and the branch ends
    in dropout with p=0 in training mode (the identity, removed before matching)."""
    torch.manual_seed(0)
    check_training(TokenFlatBlock().train(), torch.randn(2, 5, 32))
    assert torch_flash.counters == {"flash.layer_norm": 1, "flash.add_layer_norm": 1}


def test_export_residual_read_elsewhere():
    """A sum that is also read directly (not only through the reshape) stays as it is: the
    norm alone is rewritten."""
    torch.manual_seed(0)
    model = TokenFlatBlock(keep_sum=True)
    x = torch.randn(2, 5, 32)
    ep = torch_flash.rewrite(torch.export.export(model, (x,)))
    assert _flash_ops(ep.graph_module) == ["flash.layer_norm.default", "flash.layer_norm.default"]
    for out, ref in zip(ep.module()(x), model(x)):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_explain_reasons():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rms = LlamaRMSNorm(8)

        def forward(self, x):
            u = x.mean(-1, keepdim=True)
            unbiased = (x - u) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5)
            two_dims = F.layer_norm(x, x.shape[-2:])
            m0 = x.mean(0, keepdim=True)
            dim0 = (x - m0) * torch.rsqrt(((x - m0) ** 2).mean(0, keepdim=True) + 1e-5)
            return unbiased, two_dims, dim0, self.rms(x)

    report = torch_flash.explain(Odd(), torch.randn(2, 4, 8))
    norm = [s for s in report.sites if s.family == "norm"]
    text = str(report)
    assert "unbiased=False" in text
    assert "normalized_shape covers more than the last dimension" in text
    # mean over dim 0 is no LayerNorm candidate: only RMSNorm reports that rsqrt
    assert sorted(s.op or s.anchor for s in norm) == ["F.layer_norm", "rms_norm", "rsqrt", "sqrt"]
