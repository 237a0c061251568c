"""torch.library.opcheck for every op and backward op of the registry, over each stem's
OPCHECK_SAMPLES (torch_flash.testing.samples; the registry test proves coverage)."""
import pytest
import torch

from torch_flash._registry import OPS, backward_ops
from _utils import samples_of

CHEAP_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")
CASES = [(e.name, e.stem) for e in OPS] + backward_ops()


def _signature(args, kwargs) -> tuple:
    """What AOTAutograd's trace of a call depends on beyond shapes, dtypes and layouts (which
    test_faketensor checks on every sample): which arguments are tensors that require grad,
    the other arguments' values."""
    def kind(a):
        return ("tensor", a.requires_grad) if isinstance(a, torch.Tensor) else repr(a)
    return tuple(map(kind, args)), tuple(sorted((k, kind(v)) for k, v in kwargs.items()))


@pytest.mark.parametrize("op,stem", CASES, ids=[op for op, _ in CASES])
def test_opcheck(op, stem):
    """Every sample gets the cheap checks; the first of each signature also the full ones
    (test_aot_dispatch_dynamic compiles the op, seconds a sample), at most FULL_OPCHECKS
    samples where the stem's tests set it."""
    mod = samples_of(stem)
    full = getattr(mod, "FULL_OPCHECKS", None)
    overload = getattr(torch.ops.flash, op).default
    seen = set()
    for i, (args, kwargs) in enumerate(mod.OPCHECK_SAMPLES[op]()):
        signature = _signature(args, kwargs)
        if signature not in seen and (full is None or i < full):
            seen.add(signature)
            torch.library.opcheck(overload, args, kwargs)
        else:
            torch.library.opcheck(overload, args, kwargs, test_utils=CHEAP_UTILS)
