"""The Hopper chunk-logits GEMM of csrc/linear_cross_entropy (flash.linear_cross_entropy_logits_sm90,
from torch_flash._C) against float64 and cuBLAS, and its place in flash.linear_cross_entropy.
Needs an sm_90 GPU and the built extension; elsewhere the op's reference body is covered by
the opcheck samples in tests/ops/test_linear_cross_entropy.py."""
import pytest
import torch
import torch.nn.functional as F

import torch_flash
from torch_flash import _extension
from torch_flash.ops import linear_cross_entropy as lce_op
from torch_flash.reference import cross_entropy as ce_ref
from torch_flash.reference import linear_cross_entropy as lce_ref
from _utils import TOL, assert_rel_close, rel_err

pytestmark = pytest.mark.cuda

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
        and _extension.loaded()):
    pytest.skip("needs an sm_90 GPU and torch_flash._C (python -m torch_flash build)",
                allow_module_level=True)

logits_sm90 = torch.ops.flash.linear_cross_entropy_logits_sm90


def _operands(c, h, v, dtype):
    hidden = torch.randn(c, h, device="cuda", dtype=dtype)
    weight = torch.randn(v, h, device="cuda", dtype=dtype) * h**-0.5
    return hidden, weight


# chunk rows off the 256-row tile, K off the 64-element step; the lm-head chunk itself
@pytest.mark.parametrize("c,h,v", [(1, 64, 8), (200, 136, 520), (1000, 1024, 32000), (1024, 4096, 128256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logits_gemm(c, h, v, dtype):
    hidden, weight = _operands(c, h, v, dtype)
    before = (hidden.clone(), weight.clone())
    out = torch.full((c, v), float("nan"), device="cuda", dtype=dtype)
    logits_sm90(hidden, weight, out)
    assert torch.equal(before[0], hidden) and torch.equal(before[1], weight), "inputs modified"
    expect = hidden.double() @ weight.double().t()
    err, base = rel_err(out, expect), rel_err(hidden @ weight.t(), expect)
    assert not out.isnan().any()
    assert err <= TOL[dtype] and err <= 1.25 * base + 1e-6, f"{err:.2e} (cuBLAS {base:.2e})"


def test_logits_gemm_bad_inputs():
    hidden, weight = _operands(16, 64, 40, torch.bfloat16)
    out = torch.empty(16, 40, device="cuda", dtype=torch.bfloat16)
    cases = [
        ((hidden.float(), weight, out), "dtype"),
        ((hidden[:, :60], weight[:, :60], out), "contiguous"),
        ((hidden.view(-1)[4:4 + 15 * 64].view(15, 64), weight, out[:15]), "aligned"),
        ((hidden, weight, out[:8]), "out must be"),
        ((hidden, weight[:, :32].contiguous(), out), "columns"),
        ((hidden, weight[:36], torch.empty(16, 36, device="cuda", dtype=torch.bfloat16)), "16 bytes"),
    ]
    for args, match in cases:
        with pytest.raises(RuntimeError, match=match) as info:
            logits_sm90(*args)
        assert "linear_cross_entropy_logits_sm90" in str(info.value)


def _cutlass_kernels(fn) -> int:
    """How many CUTLASS kernels fn launched (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal" in e.key)


@pytest.mark.parametrize("has_bias", [False, True])
def test_linear_cross_entropy_on_sm90(has_bias):
    """flash.linear_cross_entropy's forward and backward at 2048 tokens, H 1024, V 32000 in
    512-row chunks: the CUTLASS GEMM makes each chunk's logits (a bias stays with cuBLAS's addmm),
    and loss and gradients match float64 no worse than PyTorch's own bf16 path."""
    opts = ce_ref.LossOptions(label_smoothing=0.1)
    n, hid, v = 2048, 1024, 32000
    h, w = (t.requires_grad_() for t in _operands(n, hid, v, torch.bfloat16))
    b = torch.randn(v, device="cuda", dtype=torch.bfloat16, requires_grad=True) if has_bias else None
    t = torch.randint(0, v, (n,), device="cuda")
    assert lce_op._logits_sm90_serves(h, w, b) == (not has_bias)

    def step():
        loss = torch_flash.linear_cross_entropy(h, w, t, b, label_smoothing=0.1, chunk_size=512)
        return loss, torch.autograd.grad(loss, [p for p in (h, w, b) if p is not None])

    assert _cutlass_kernels(step) == (0 if has_bias else n // 512)
    loss, grads = step()
    leaves64 = [p.detach().double().requires_grad_() for p in (h, w, b) if p is not None]
    loss64 = lce_ref.linear_cross_entropy(leaves64[0], leaves64[1], t, leaves64[2] if has_bias else None, opts)
    expect = torch.autograd.grad(loss64, leaves64)
    leaves = [p.detach().clone().requires_grad_() for p in (h, w, b) if p is not None]
    theirs_loss = F.cross_entropy(F.linear(*leaves).float(), t, label_smoothing=0.1)
    theirs = torch.autograd.grad(theirs_loss, leaves)
    assert_rel_close(loss, loss64, 1e-3, what="loss")
    for name, g, e, own in zip(("dhidden", "dweight", "dbias"), grads, expect, theirs):
        err = assert_rel_close(g, e, TOL[torch.bfloat16], what=name)
        assert err <= 1.5 * rel_err(own, e) + 1e-6, f"{name}: {err:.2e} vs PyTorch's {rel_err(own, e):.2e}"


def test_linear_cross_entropy_compiled():
    """torch.compile traces flash.linear_cross_entropy's Triton body, the GEMM op (which writes
    into the chunk buffer) included: same loss and gradients as eager."""
    n, hid, v = 1024, 512, 8192
    h, w = (t.requires_grad_() for t in _operands(n, hid, v, torch.bfloat16))
    t = torch.randint(0, v, (n,), device="cuda")

    def loss_fn(h, w, t):
        return torch_flash.linear_cross_entropy(h, w, t, chunk_size=256)

    def step(fn):
        loss = fn(h, w, t)
        return loss, *torch.autograd.grad(loss, (h, w))

    eager = step(loss_fn)
    compiled = step(torch.compile(loss_fn, fullgraph=True))
    for name, a, b in zip(("loss", "dhidden", "dweight"), compiled, eager):
        assert rel_err(a, b) <= 1e-3, f"{name}: {rel_err(a, b):.2e}"
