"""Two CUDA streams: every op's forward and backward launched on two streams at once, their
calls interleaved, gives bit for bit what the same calls give one after the other on one
stream (allocations, workspaces, cached plans and the fast path's replays are stream-safe).
Deterministic mode, so that the serial results are reproducible bits."""
from __future__ import annotations

import pytest
import torch

from test_fast_path import _cases, _forward_cases

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
CALLS = 4  # per stream, interleaved


def _run(fn, args, kwargs, grad: bool, seed: int) -> list[torch.Tensor]:
    """The outputs, and with grad the gradients of the floating inputs for upstream gradients
    drawn from seed, all on the current stream."""
    leaves = [a.detach().requires_grad_(grad and a.is_floating_point()) if isinstance(a, torch.Tensor) else a
              for a in args]
    out = fn(*leaves, **kwargs)
    outs = list(out) if isinstance(out, tuple) else [out]
    if not grad:
        return outs
    g = torch.Generator(device="cuda").manual_seed(seed)
    ups = [torch.randn(o.shape, generator=g, device="cuda", dtype=o.dtype) for o in outs]
    inputs = [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]
    return outs + list(torch.autograd.grad(outs, inputs, ups))


@pytest.mark.parametrize("case", [*(f"{c}-bwd" for c in _cases()), *(f"{c}-fwd" for c in _forward_cases())])
def test_two_streams_equal_one(case):
    name, kind = case.rsplit("-", 1)
    fn, make, kwargs = (_cases() if kind == "bwd" else _forward_cases())[name]
    grad = kind == "bwd"
    torch.manual_seed(0)
    inputs = [make() for _ in range(2 * CALLS)]
    torch.use_deterministic_algorithms(True)
    try:
        serial = [_run(fn, args, kwargs, grad, i) for i, args in enumerate(inputs)]
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        both = []
        for i, args in enumerate(inputs):
            with torch.cuda.stream(streams[i % 2]):
                both.append(_run(fn, args, kwargs, grad, i))
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
    finally:
        torch.use_deterministic_algorithms(False)
    for i, (want, got) in enumerate(zip(serial, both)):
        assert len(want) == len(got)
        for j, (w, g) in enumerate(zip(want, got)):
            assert torch.equal(w, g), f"{case}: call {i} (stream {i % 2}), result {j} differs from the serial one"
