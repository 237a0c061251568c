"""Shared test helpers: relative error against a float64 reference, opcheck samples."""
from __future__ import annotations

import importlib.util
import os
import types
from typing import Callable, Iterable

import torch

# docs/design.md, "Numerics": relative error ||out - ref|| / ||ref|| against a float64 reference.
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}

# op name -> callable returning [(args, kwargs), ...]; each tests/ops/test_<stem>.py
# defines OPCHECK_SAMPLES covering its ops and their backward ops (the registry test checks).
Samples = dict[str, Callable[[], Iterable[tuple[tuple, dict]]]]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
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


def randn_rows(shape, dtype, rg=False, noncontig=False) -> torch.Tensor:
    """Fresh random (..., N) input; noncontig: a strided view over a wider buffer."""
    if noncontig:
        x = torch.randn(*shape[:-1], shape[-1] * 2, dtype=dtype)[..., ::2]
    else:
        x = torch.randn(shape, dtype=dtype)
    return x.requires_grad_(rg)


def to64(*ts):
    return tuple(None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in ts)


OPS_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ops")


def stem_tests(stem: str) -> types.ModuleType:
    """tests/ops/test_<stem>.py as a module: its OPCHECK_SAMPLES and, optionally,
    FULL_OPCHECKS (how many samples per op get every opcheck test; the rest get the cheap
    ones, since each full check compiles the op)."""
    path = os.path.join(OPS_TESTS, f"test_{stem}.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing {path}")
    spec = importlib.util.spec_from_file_location(f"_samples_of_{stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
