"""torch.library.opcheck for every op and backward op of the registry, over the samples
that tests/ops/test_<stem>.py defines (OPCHECK_SAMPLES; the registry test proves coverage)."""
import pytest
import torch

from torch_flash._registry import OPS, backward_ops
from _utils import stem_tests

CHEAP_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")
CASES = [(e.name, e.stem) for e in OPS] + backward_ops()


@pytest.mark.parametrize("op,stem", CASES, ids=[op for op, _ in CASES])
def test_opcheck(op, stem):
    tests = stem_tests(stem)
    full = getattr(tests, "FULL_OPCHECKS", None)
    overload = getattr(torch.ops.flash, op).default
    for i, (args, kwargs) in enumerate(tests.OPCHECK_SAMPLES[op]()):
        if full is None or i < full:
            torch.library.opcheck(overload, args, kwargs)
        else:
            torch.library.opcheck(overload, args, kwargs, test_utils=CHEAP_UTILS)
