"""Shared test helpers: relative error against a float64 reference, opcheck samples."""
from __future__ import annotations

from typing import Callable, Iterable

import torch

# DESIGN.md "Numerics": relative error ||out - ref|| / ||ref|| against a float64 reference.
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}

# op name -> callable returning [(args, kwargs), ...]; each tests/ops/test_<stem>.py
# defines OPCHECK_SAMPLES covering its ops and their backward ops (the registry test checks).
Samples = dict[str, Callable[[], Iterable[tuple[tuple, dict]]]]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float | None = None,
                     dtype: torch.dtype | None = None, what: str = "output") -> float:
    """Checks shape, no NaN, and relative error under tol (default: by dtype)."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    tol = TOL[dtype or out.dtype] if tol is None else tol
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"
    return err


def to64(*ts):
    return tuple(None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in ts)


def run_opcheck(op, args, kwargs=None) -> None:
    torch.library.opcheck(op, args, kwargs or {})
