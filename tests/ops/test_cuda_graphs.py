"""Every op's forward, and forward + backward through torch.autograd.grad, captured eagerly in
a CUDA graph after one warm-up call (as torch.cuda.graph's documentation does it), then replayed
on new input values: the replay equals an eager call on those values."""
from __future__ import annotations

import pytest
import torch

import torch_flash

pytestmark = pytest.mark.cuda
DEV, BF16 = "cuda", torch.bfloat16


def _cases():
    """name -> (make inputs, function of the inputs returning a tensor or a tuple of them,
    indices of the inputs to differentiate)."""
    cos, sin = torch_flash.rotary_cos_sin(128, 64, device=DEV)
    cache = lambda: torch.randn(2, 4, 256, 64, device=DEV, dtype=BF16)  # noqa: E731
    return {
        "rms_norm": (lambda: (torch.randn(64, 1024, device=DEV, dtype=BF16),
                              torch.randn(1024, device=DEV, dtype=BF16)),
                     lambda x, w: torch_flash.rms_norm(x, w), (0, 1)),
        "add_rms_norm": (lambda: (torch.randn(64, 1024, device=DEV, dtype=BF16),
                                  torch.randn(64, 1024, device=DEV, dtype=BF16),
                                  torch.randn(1024, device=DEV, dtype=BF16)),
                         lambda x, r, w: torch_flash.add_rms_norm(x, r, w), (0, 1, 2)),
        "layer_norm": (lambda: (torch.randn(64, 1024, device=DEV, dtype=BF16),
                                torch.randn(1024, device=DEV, dtype=BF16),
                                torch.randn(1024, device=DEV, dtype=BF16)),
                       lambda x, w, b: torch_flash.layer_norm(x, w, b), (0, 1, 2)),
        "add_layer_norm": (lambda: (torch.randn(64, 1024, device=DEV, dtype=BF16),
                                    torch.randn(64, 1024, device=DEV, dtype=BF16),
                                    torch.randn(1024, device=DEV, dtype=BF16),
                                    torch.randn(1024, device=DEV, dtype=BF16)),
                           lambda x, r, w, b: torch_flash.add_layer_norm(x, r, w, b), (0, 1, 2, 3)),
        "cross_entropy": (lambda: (torch.randn(64, 4096, device=DEV, dtype=BF16),
                                   torch.randint(0, 4096, (64,), device=DEV)),
                          lambda x, t: torch_flash.cross_entropy(x, t), (0,)),
        "linear_cross_entropy": (lambda: (torch.randn(64, 256, device=DEV, dtype=BF16),
                                          torch.randn(2048, 256, device=DEV, dtype=BF16),
                                          torch.randint(0, 2048, (64,), device=DEV)),
                                 lambda h, w, t: torch_flash.linear_cross_entropy(h, w, t), (0, 1)),
        "rotary_qk": (lambda: (torch.randn(2, 8, 128, 64, device=DEV, dtype=BF16),
                               torch.randn(2, 2, 128, 64, device=DEV, dtype=BF16)),
                      lambda q, k: torch_flash.rotary_qk(q, k, cos, sin), (0, 1)),
        "attention": (lambda: tuple(torch.randn(2, h, 128, 64, device=DEV, dtype=BF16) for h in (8, 2, 2)),
                      lambda q, k, v: torch_flash.attention(q, k, v, causal=True), (0, 1, 2)),
        "attention_decode": (lambda: (torch.randn(2, 8, 1, 64, device=DEV, dtype=BF16), cache(), cache(),
                                      torch.randint(1, 256, (2,), device=DEV, dtype=torch.int32)),
                             lambda q, kc, vc, n: torch_flash.attention_decode(q, kc, vc, n), ()),
    }


def _run(fn, inputs, grad_of):
    """fn's outputs, and with grad_of the gradients of their sum of squares into those inputs."""
    if not grad_of:
        with torch.no_grad():
            out = fn(*inputs)
        return out if isinstance(out, tuple) else (out,)
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum(o.float().square().sum() for o in outs)
    return (*outs, *torch.autograd.grad(loss, [inputs[i] for i in grad_of]))


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "cross_entropy",
                                  "linear_cross_entropy", "rotary_qk", "attention", "attention_decode"])
def test_capture_and_replay(name, backward):
    make, fn, grad_of = _cases()[name]
    if backward and not grad_of:
        pytest.skip(f"{name} has no backward")
    grad_of = grad_of if backward else ()
    static = [t.requires_grad_() if i in grad_of else t for i, t in enumerate(make())]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _run(fn, static, grad_of)  # warm-up: compiles, autotunes, allocates
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run(fn, static, grad_of)
    fresh = make()
    with torch.no_grad():
        for s, f in zip(static, fresh):
            s.copy_(f)
    graph.replay()
    eager = _run(fn, [t.clone().requires_grad_() if i in grad_of else t.clone()
                      for i, t in enumerate(fresh)], grad_of)
    torch.cuda.synchronize()
    assert len(captured) == len(eager)
    for i, (c, e) in enumerate(zip(captured, eager)):
        assert torch.equal(c, e), f"{name}: output {i} of the replay differs from an eager call"
