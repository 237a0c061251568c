"""The flash backend's post-grad pass (compile_passes/post_grad.py): a compiled backward of
flash.linear_cross_entropy scales the forward's donated gradients in place, with no copy."""
import pytest
import torch
from torch._inductor.utils import run_and_get_code

import torch_flash
from torch_flash.compile_passes.post_grad import FlashPostGradPass
from torch_flash.ops.linear_cross_entropy import linear_cross_entropy

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _grads(fn, h, w, t, b, scale):
    leaves = [x.detach().clone().requires_grad_() for x in (h, w, b)]
    loss = fn(leaves[0], leaves[1], t, leaves[2])
    return torch.autograd.grad(loss, leaves, torch.tensor(scale, device=h.device))


def _backward_code(scale: float, **inductor_config) -> str:
    """The backward code Inductor generates for flash.linear_cross_entropy under the flash
    backend (with inductor_config), after checking its gradients against eager's for an
    upstream gradient of scale."""
    torch.manual_seed(0)
    h, w = torch.randn(40, 16, device=DEV), torch.randn(50, 16, device=DEV)
    b, t = torch.randn(50, device=DEV), torch.randint(0, 50, (40,), device=DEV)
    torch._dynamo.reset()
    compiled = torch.compile(linear_cross_entropy, backend="flash", fullgraph=True)
    with torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch({"fx_graph_cache": False, **inductor_config}):
        got, (_, bw_code) = run_and_get_code(_grads, compiled, h, w, t, b, scale)
    for g, want in zip(got, _grads(linear_cross_entropy, h, w, t, b, scale)):
        torch.testing.assert_close(g, want)
    return bw_code


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_backward_scales_the_donated_gradients_in_place(scale):
    """The backward graph Inductor generates under the flash backend is the scale op on each
    saved gradient and nothing else: plain Inductor clones each into its own buffer first
    (auto_functionalized_v2 of a graph input, torch 2.11-2.13), a pass over dweight. The
    gradients are eager's, for an upstream gradient of 1 and of 0.37."""
    bw_code = _backward_code(scale)
    assert bw_code.count("torch.ops.flash.linear_cross_entropy_scale_.default(") == 3, bw_code
    assert "clone" not in bw_code and "empty_strided" not in bw_code.split("def call")[-1], bw_code


def test_left_alone_under_cuda_graphs():
    """With CUDA graphs (mode="reduce-overhead" sets triton.cudagraphs) the backward keeps
    Inductor's copy: in place, the gradients would live in the forward graph's output memory,
    which its next replay overwrites."""
    assert "clone" in _backward_code(0.37, **{"triton.cudagraphs": True})


def test_a_forward_graph_keeps_its_input_mutation():
    """The pass leaves graphs without upstream gradients alone: the scale op called on a
    compiled function's own input scales the caller's tensor, as eagerly."""
    g = torch.randn(8, 4, device=DEV)
    want = g * 0.5
    torch._dynamo.reset()
    torch.compile(lambda g, s: torch.ops.flash.linear_cross_entropy_scale_(g, s), backend="flash")(
        g, torch.tensor(0.5, device=DEV))
    torch.testing.assert_close(g, want)


def test_enable_chains_and_disable_restores():
    import torch._inductor.config as config

    def theirs(graph):
        pass

    with config.patch(post_grad_custom_post_pass=theirs):
        torch_flash.enable()
        try:
            mine = config.post_grad_custom_post_pass
            assert isinstance(mine, FlashPostGradPass) and mine.previous is theirs
            torch_flash.enable()  # twice: still one
            assert config.post_grad_custom_post_pass is mine
            assert mine.uuid() is None  # theirs has no uuid: Inductor must not cache
        finally:
            torch_flash.disable()
        assert config.post_grad_custom_post_pass is theirs
    assert isinstance(FlashPostGradPass().uuid(), bytes)
