"""opcheck argument sets, one module per op stem: torch_flash.testing.samples.<stem> defines
OPCHECK_SAMPLES, {op or backward op: () -> iterable of (args, kwargs)} with fresh tensors per
call, and may set FULL_OPCHECKS (how many samples get the full opcheck; the first of each call
signature does otherwise). tests/ops/test_opcheck.py runs them, tests/test_registry.py checks
that every op has some, and the op's own tests share the helpers."""
from __future__ import annotations

import importlib
import types

import torch


def module(stem: str) -> types.ModuleType | None:
    """The samples module of stem, or None where it has none."""
    try:
        return importlib.import_module(f"{__name__}.{stem}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{stem}":
            raise
        return None


def randn_rows(shape, dtype, rg=False, noncontig=False) -> torch.Tensor:
    """Fresh random (..., N) input; noncontig: a strided view over a wider buffer."""
    if noncontig:
        x = torch.randn(*shape[:-1], shape[-1] * 2, dtype=dtype)[..., ::2]
    else:
        x = torch.randn(shape, dtype=dtype)
    return x.requires_grad_(rg)
