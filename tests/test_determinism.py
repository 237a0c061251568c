"""Under torch.use_deterministic_algorithms(True) every backward op gives the same bits run to
run on the GPU, on each stem's opcheck samples (torch_flash.testing.samples) moved to CUDA; an
op that cannot must say so with an error naming it, as PyTorch's own ops do."""
import itertools

import pytest
import torch

from torch_flash._registry import backward_ops
from _utils import samples_of

pytestmark = pytest.mark.cuda

SAMPLES_PER_OP = 4  # the catalogues' first samples: every stem puts its distinct layouts first


def _to_cuda(a):
    return a.detach().to("cuda") if isinstance(a, torch.Tensor) else a


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as integers of its element size (NaNs compare by payload)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()]) if t.is_floating_point() else t


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("op,stem", backward_ops(), ids=[op for op, _ in backward_ops()])
def test_backward_bitwise_reproducible(op, stem, deterministic):
    overload = getattr(torch.ops.flash, op).default
    samples = samples_of(stem).OPCHECK_SAMPLES[op]()
    for i, (args, kwargs) in enumerate(itertools.islice(samples, SAMPLES_PER_OP)):
        args = [_to_cuda(a) for a in args]
        kwargs = {k: _to_cuda(v) for k, v in kwargs.items()}
        try:
            first = overload(*args, **kwargs)
        except RuntimeError as e:
            assert op in str(e) and "determinis" in str(e), f"{op}: unclear error: {e}"
            continue
        second = overload(*args, **kwargs)
        for a, b in zip(*(r if isinstance(r, tuple) else (r,) for r in (first, second))):
            if isinstance(a, torch.Tensor):
                assert torch.equal(_bits(a), _bits(b)), f"{op}, sample {i}: results differ between runs"
