"""PyTorch's own attention spellings. Inductor's (`_sfdp_pattern_*` in
torch/_inductor/fx_passes/fuse_attention.py), in fp32 and fp16 and each input layout Inductor
traces them with: every one is rewritten to one flash.attention, exported (torch.export, then
torch_flash.rewrite) with the pattern's own outputs, and through Dynamo with its outputs and
input gradients. Scales arrive as 0-d tensors (`inv_scale`) or Python floats, as Inductor
registers them; dropout is checked at p=0 for numbers, and at Inductor's p for the rewrite.
And F.scaled_dot_product_attention in core ATen (run_decompositions), math SDPA's decomposition."""
import inspect
import re

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.fx_passes import fuse_attention

import torch_flash
from _utils import assert_rel_close

# Dynamo does not trace into torch's own files: the patterns are compiled again from their
# source, as this file's code.
_NS = dict(vars(fuse_attention))
for _name, _fn in vars(fuse_attention).items():
    if _name.startswith("_sfdp_pattern_") and inspect.isfunction(_fn):
        exec(compile(inspect.getsource(_fn), __file__, "exec"), _NS)


def _patterns() -> dict:
    """name -> (pattern, Inductor's example inputs, its scalar arguments), one per dtype and layout."""
    found = {}
    for name, d in fuse_attention._get_sfdp_patterns(torch.device("cpu")):
        key = name.replace("_training", "").replace("_inference", "")
        if key not in found:
            base = re.match(r"_sfdp_pattern_\d+", name).group(0)
            found[key] = (_NS[base], d["example_inputs"], d["scalar_workaround"])
    return found


PATTERNS = _patterns()


def _inputs(example: list, fn) -> list:
    """Fresh values in the example inputs' shapes and strides: masks that keep key 0 of every
    row (bool masks, which hide with finfo.min: but the first row of batch 0), scales away from 1, Inductor's (1024, 128, 128) bmm operands made small."""
    out = []
    for t in example:
        if t.dtype == torch.bool:  # where(mask, scores, finfo.min): a row hidden entirely in batch 0
            x = torch.rand(t.shape) > 0.3
            x[..., 0] = True
            x[0, ..., 0, :] = False
        elif t.dim() == 0:
            x = torch.tensor(1.7, dtype=t.dtype)
        elif t.dim() == 2:  # compared with 0: where it is 0 the key is hidden
            x = (torch.rand(t.shape) > 0.3).to(t.dtype)
            x[..., 0] = 1
        elif t.shape[0] == 1024:
            x = torch.randn(4, 8, 16, dtype=t.dtype)
        else:
            x = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(torch.randn(t.shape))
        out.append(x.requires_grad_(t.requires_grad))
    return out


def _kwargs(fn, example: list, workaround: dict, dropout_p: float) -> dict:
    """The pattern's float arguments: Inductor's, with dropout_p as given; inference patterns
    registered without them get an inverse scale of 0.5 where the signature has one."""
    params = inspect.signature(fn).parameters
    kw = dict(workaround)
    if "dropout_p" in params and len(example) < len(params):
        kw["dropout_p"] = dropout_p
    if "inv_scale" in params and "inv_scale" not in kw and not any(t.dim() == 0 for t in example):
        kw["inv_scale"] = 0.5
    return kw


class Pattern(torch.nn.Module):
    def __init__(self, fn, kwargs):
        super().__init__()
        self.fn, self.kwargs = fn, kwargs

    def forward(self, *args):
        out = self.fn(*args, **self.kwargs)
        return out[0] if isinstance(out, tuple) else out  # some return key and value too


def _tol(args: list, out: torch.Tensor) -> float:
    """fp32 1e-5; the fp16 model's own rounding where it computes in fp16 (patterns 7-10 cast
    the weights to fp16 from fp32 inputs)."""
    return 5e-3 if args[0].dtype == torch.float16 else 2e-3 if out.dtype == torch.float16 else 1e-5


@pytest.mark.parametrize("name", list(PATTERNS))
def test_inductor_pattern(name):
    fn, example, workaround = PATTERNS[name]
    torch.manual_seed(0)
    args = _inputs(example, fn)
    model = Pattern(fn, _kwargs(fn, example, workaround, 0.0))

    # torch.export, then rewrite: the same outputs
    ep = torch.export.export(model, tuple(a.detach() for a in args))
    report = torch_flash.explain(ep)
    assert [s.op for s in report.sites] == ["attention"], str(report)
    out = torch_flash.rewrite(ep).module()(*[a.detach() for a in args])
    ref = model(*[a.detach() for a in args])
    assert_rel_close(out, ref, tol=_tol(args, ref))

    # Dynamo: outputs and input gradients, the rewritten graph run eagerly
    graphs = []

    def inner(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=torch_flash.backend(ops=["attention"], inner=inner))
    leaves = [a for a in args if a.requires_grad]
    weight = torch.randn(ref.shape)
    results = []
    for f in (model, compiled):
        out = f(*args)
        results.append((out, torch.autograd.grad((out.float() * weight).sum(), leaves)))
    (ref, ref_grads), (out, grads) = results
    calls = [n for g in graphs for n in g.graph.find_nodes(op="call_function", target=torch.ops.flash.attention.default)]
    assert len(calls) == 1
    assert_rel_close(out, ref, tol=_tol(args, ref))
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_rel_close(g, r, tol=_tol(args, ref), what=f"grad {i}")


@pytest.mark.parametrize("name", [n for n, (fn, ex, w) in PATTERNS.items() if "dropout_p" in w])
def test_inductor_pattern_dropout(name):
    """With Inductor's own dropout probability the site is rewritten, the probability kept."""
    fn, example, workaround = PATTERNS[name]
    args = _inputs(example, fn)
    model = Pattern(fn, _kwargs(fn, example, workaround, workaround["dropout_p"]))
    ep = torch.export.export(model, tuple(a.detach() for a in args))
    assert [s.op for s in torch_flash.explain(ep).sites] == ["attention"]
    calls = torch_flash.rewrite(ep).graph.find_nodes(op="call_function", target=torch.ops.flash.attention.default)
    assert [n.kwargs["dropout_p"] for n in calls] == [pytest.approx(workaround["dropout_p"])]


class Sdpa(torch.nn.Module):
    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


@pytest.mark.parametrize("mask", [False, True])
def test_core_aten_sdpa(mask):
    """SDPA through run_decompositions() is math SDPA's formula with _safe_softmax decomposed
    into where(every score of the row is -inf, 0, _softmax(scores)): one flash.attention
    (causal, or the mask as attn_bias), outputs and input gradients the model's (float64)."""
    torch.manual_seed(0)
    args = [torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3)] + ([torch.randn(1, 1, 8, 8)] if mask else [])
    ep = torch_flash.rewrite(torch.export.export(Sdpa(), tuple(args)).run_decompositions())
    (call,) = ep.graph.find_nodes(op="call_function", target=torch.ops.flash.attention.default)
    assert call.kwargs["causal"] != mask and (call.args[3] is not None) == mask
    weight = torch.randn(2, 4, 8, 16, dtype=torch.float64)
    results = []
    for f, inputs in ((Sdpa(), [a.detach().double().requires_grad_(a.requires_grad) for a in args]),
                      (ep.module(), args)):
        out = f(*inputs)
        results.append((out, torch.autograd.grad((out * weight.to(out.dtype)).sum(), inputs[:3])))
    (ref, ref_grads), (out, grads) = results
    assert_rel_close(out, ref, tol=1e-5)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert_rel_close(g, r, tol=1e-5, what=f"grad {i}")


class FusedKernel(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[0]


def test_fused_sdpa_kernel_is_a_site():
    """SDPA's fused kernels (graphs traced below SDPA) are sites left alone with a reason, in an
    exported program and through Dynamo, and the graph still computes the kernel's result."""
    args = [torch.randn(2, 4, 8, 16) for _ in range(3)]
    ep = torch.export.export(FusedKernel(), tuple(args))
    for report in (torch_flash.explain(ep), torch_flash.explain(FusedKernel(), *args)):
        (site,) = report.sites
        assert site.anchor == "aten._scaled_dot_product_flash_attention_for_cpu" and not site.rewritten
        assert "a fused SDPA kernel already" in site.reason
    torch.testing.assert_close(torch_flash.rewrite(ep).module()(*args), FusedKernel()(*args))
