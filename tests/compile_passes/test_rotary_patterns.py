"""Rotary embedding spellings -> flash.rotary through the flash backend, torch.export +
rewrite, and explain()."""
import pytest
import torch

import torch_flash
from models import RotaryQK, check_training, flash_calls, rotate_half

# the backend falls back to the unrewritten graph with a warning: here that is a failure
pytestmark = pytest.mark.filterwarnings("error:torch_flash")


def _inputs(b=2, s=5, dtype=torch.float32):
    return torch.randn(b, s, 32, dtype=dtype), torch.arange(s)[None].expand(b, s)


@pytest.mark.parametrize("style", ["llama", "neox", "gptj", "meta", "torchtune", "gptoss"])
def test_train(style):
    torch.manual_seed(0)
    check_training(RotaryQK(style=style), *_inputs())
    assert torch_flash.counters == {"flash.rotary": 2}  # q and k


class RotaryAttention(torch.nn.Module):
    """HF LLaMA's path from the rotary to SDPA: q and k rotated with tables in x's dtype, then
    attention (GQA through repeat_kv's expand and reshape when kv_heads < heads)."""

    def __init__(self, d=32, heads=4, kv_heads=4, style="llama"):
        super().__init__()
        self.rope, self.n = RotaryQK(d, heads, style), heads // kv_heads
        self.v, self.o = torch.nn.Linear(d, d, bias=False), torch.nn.Linear(d, d, bias=False)

    def forward(self, x, position_ids):
        b, s, d = x.shape
        q, k = self.rope(x, position_ids)
        if self.n > 1:  # every n-th head of k as the kv heads, repeated as transformers' repeat_kv does
            k = k[:, ::self.n]
            k = k[:, :, None].expand(b, k.shape[1], self.n, s, k.shape[-1]).reshape(q.shape)
        v = self.v(x).view(b, s, q.shape[1], -1).transpose(1, 2)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, s, d))


@pytest.mark.parametrize("style, kv_heads, half", [("llama", 4, torch.bfloat16), ("llama", 2, torch.bfloat16),
                                                   ("meta", 2, torch.bfloat16), ("torchtune", 2, torch.bfloat16),
                                                   ("llama", 2, torch.float16)])
def test_train_autocast_into_attention(style, kv_heads, half):
    """bf16 (or fp16) autocast over an fp32 model: q and k come from half linears, the tables
    are fp32 (HF casts them to the fp32 hidden states' dtype), so the model's rotary output is
    fp32, read only by SDPA, which autocast runs in half (Meta's spelling casts it back to q's
    dtype itself). flash.rotary writes it in half directly (q and k in one flash.rotary_qk),
    and SDPA, then reading q, k and v of one dtype, becomes flash.attention."""
    torch.manual_seed(0)
    model, args = RotaryAttention(kv_heads=kv_heads, style=style), _inputs()
    with torch.autocast("cpu", dtype=half):
        check_training(model, *args, atol=2e-2, rtol=2e-2)
        assert torch_flash.counters == {"flash.rotary": 2, "flash.attention": 1}
        calls = flash_calls(model, *args)
    fp32 = torch.float32
    assert [(op, dtypes) for op, _, dtypes in calls] == [  # q and k in one launch
        ("flash.rotary_qk.default", [half, half, fp32, fp32]), ("flash.attention.default", [half, half, half])]


class CastBack(torch.nn.Module):
    """A bf16 model's rotary with fp32 tables, cast back to q's dtype (and read once more
    through a transpose before that cast)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.rand(4))

    def forward(self, q):
        f = torch.outer(torch.arange(q.shape[2], dtype=torch.float32), self.inv_freq)
        emb = torch.cat((f, f), -1)
        out = q * emb.cos() + rotate_half(q) * emb.sin()
        return out.to(q.dtype), out.transpose(1, 2).to(q.dtype)


def test_fp32_tables_cast_back():
    """The fp32 result is only read cast to q's dtype: flash.rotary writes that dtype itself,
    with the same rounding of the fp32 value."""
    torch.manual_seed(0)
    model, q = CastBack(), torch.randn(2, 3, 5, 8, dtype=torch.bfloat16)
    out = torch.compile(model, backend="flash")(q)
    assert torch_flash.counters == {"flash.rotary": 1}
    for o, r in zip(out, model(q)):
        assert o.dtype == torch.bfloat16
        torch.testing.assert_close(o, r, atol=0, rtol=8e-3)


def test_autocast_fp32_output_kept():
    """Under autocast a rotary output the model returns in fp32 stays the model's own: the
    half result would lose precision that the caller sees."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = torch_flash.explain(RotaryQK(), *_inputs())
    assert [s.op for s in report.sites] == [None, None]
    assert all("would give torch.bfloat16" in s.reason for s in report.sites)


@pytest.mark.parametrize("style", ["llama", "meta", "torchtune"])
def test_bf16_inference(style):
    """Meta's and torchtune's spellings upcast x and compute in fp32 before casting back: the op
    computes in fp32 from bf16 x, with the same single rounding. (Their reference is the fp32
    model, as they compute in fp32 whatever x is; Module.to would also drop the complex
    table's imaginary part, so the tables are put back.)"""
    torch.manual_seed(0)
    model = RotaryQK(style=style).to(torch.bfloat16).eval()
    x, pos = _inputs(dtype=torch.bfloat16)
    exact_dtype = torch.float64 if style == "llama" else torch.float32
    with torch.inference_mode():
        tables = RotaryQK(style=style)
        model.freqs_cis, model.rope_cache = tables.freqs_cis, tables.rope_cache
        out = torch.compile(model, backend="flash")(x, pos)
        ref = model(x, pos)
        model.to(exact_dtype).freqs_cis = tables.freqs_cis
        exact = model(x.to(exact_dtype), pos)
    assert torch_flash.counters == {"flash.rotary": 2}
    for o, r, e in zip(out, ref, exact):
        assert o.dtype == torch.bfloat16
        err = lambda y: ((y.double() - e).norm() / e.norm()).item()  # noqa: E731
        assert err(o) <= max(err(r), 1e-2)


@pytest.mark.parametrize("style", ["neox", "meta", "torchtune"])
def test_dynamic_shapes(style):
    torch.manual_seed(0)
    model = RotaryQK(style=style).eval()
    compiled = torch.compile(model, backend="flash", dynamic=True)
    with torch.no_grad():
        for b, s in ((2, 5), (3, 9)):
            args = _inputs(b, s)
            torch.testing.assert_close(compiled(*args), model(*args), atol=1e-5, rtol=1e-5)
    assert torch_flash.counters["flash.rotary"] >= 2


class TableVariants(torch.nn.Module):
    """RoPE with tables the pattern must not trust: given as inputs (halves unknown),
    halves that differ, and learned frequencies (the op gives tables no gradient)."""

    def __init__(self):
        super().__init__()
        self.freqs = torch.nn.Parameter(torch.randn(5, 4))

    def forward(self, q, cos, sin):
        given = q * cos + rotate_half(q) * sin
        f = torch.outer(torch.arange(5.0), torch.ones(4))
        emb = torch.cat((f, 2 * f), -1)
        different = q * emb.cos() + rotate_half(q) * emb.sin()
        learned = torch.cat((self.freqs, self.freqs), -1)
        return given, different, q * learned.cos() + rotate_half(q) * learned.sin()


def test_explain_reasons():
    args = torch.randn(2, 3, 5, 8), torch.randn(5, 8), torch.randn(5, 8)
    report = torch_flash.explain(TableVariants(), *args)
    assert [s.family for s in report.sites] == ["rotary"] * 3
    proof = [s for s in report.sites if "not proven to repeat its halves" in s.reason]
    assert len(proof) == 2
    # learned tables: visible from the exported program's parameter placeholders
    ep = torch_flash.rewrite(torch.export.export(TableVariants(), args))
    assert not any(str(n.target).startswith("flash.") for n in ep.graph.nodes)


def test_half_products_near_miss():
    """The halves' products with the signs the other way round (a rotation by -angle spelled
    with the wrong pairing) are no rotation of pairs: left, with the reason."""
    def wrong(x, c, s):
        x1, x2 = x.chunk(2, -1)
        return torch.cat((x1 * c + x2 * s, x2 * s - x1 * c), -1)

    def right_but_tables_swapped(x, c, s):
        x1, x2 = x.chunk(2, -1)
        return torch.cat((x1 * c - x2 * s, x2 * s + x1 * c), -1)
    args = torch.randn(2, 3, 5, 8), torch.randn(5, 4), torch.randn(5, 4)
    assert not torch_flash.explain(wrong, *args).sites  # no sub-then-add cat: not a candidate
    (site,) = torch_flash.explain(right_but_tables_swapped, *args).sites
    assert not site.rewritten and "not the rotation (x1 * c - x2 * s, x2 * c + x1 * s)" in site.reason


@pytest.mark.parametrize("style", ["gptj", "meta", "torchtune"])
def test_export_rewrite(tmp_path, style):
    torch.manual_seed(0)
    model = RotaryQK(style=style).eval()
    args = _inputs()
    ep = torch_flash.rewrite(torch.export.export(model, args))
    assert [str(n.target) for n in ep.graph.nodes if str(n.target).startswith("flash.")] == ["flash.rotary_qk.default"]
    torch.export.save(ep, tmp_path / "rope.pt2")
    torch.testing.assert_close(torch.export.load(tmp_path / "rope.pt2").module()(*args), model(*args))


class WrappedTables(RotaryQK):
    """LLaMA's rotary with its tables made in a region of another mode, which export keeps as
    one node running a subgraph: under no_grad (transformers' LlamaRotaryEmbedding.forward up
    to 5.17) or with autocast off (its fp32 tables)."""

    def __init__(self, region):
        super().__init__(style="llama")
        self.region = region

    def _cos_sin(self, x, position_ids):
        with torch.no_grad() if self.region == "no_grad" else torch.autocast("cpu", enabled=False):
            return super()._cos_sin(x, position_ids)


@pytest.mark.parametrize("region", ["no_grad", "autocast_off"])
def test_export_tables_in_wrapped_region(region):
    """The halves are proven inside the region's subgraph: q and k become one flash.rotary_qk."""
    torch.manual_seed(0)
    model, args = WrappedTables(region).eval(), _inputs()
    ep = torch.export.export(model, args)
    wraps = {"no_grad": torch.ops.higher_order.wrap_with_set_grad_enabled,
             "autocast_off": torch.ops.higher_order.wrap_with_autocast}
    assert any(n.target is wraps[region] for n in ep.graph.nodes)  # the spelling under test
    ep = torch_flash.rewrite(ep)
    assert [str(n.target) for n in ep.graph.nodes if str(n.target).startswith("flash.")] == ["flash.rotary_qk.default"]
    torch.testing.assert_close(ep.module()(*args), model(*args))
