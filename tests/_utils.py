"""Shared test helpers: relative error against a float64 reference, where opcheck samples are."""
from __future__ import annotations

import importlib.util
import os
import types

import torch

from torch_flash.testing import samples

# docs/design.md, "Numerics": relative error ||out - ref|| / ||ref|| against a float64 reference.
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


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


def to64(*ts):
    return tuple(None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in ts)


OPS_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ops")


def samples_of(stem: str) -> types.ModuleType:
    """The module with stem's OPCHECK_SAMPLES (torch_flash.testing.samples' docstring):
    torch_flash.testing.samples.<stem>, else tests/ops/test_<stem>.py loaded by path, where the
    attention stems' samples still are."""
    mod = samples.module(stem)
    if mod is not None:
        return mod
    path = os.path.join(OPS_TESTS, f"test_{stem}.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing {path}")
    spec = importlib.util.spec_from_file_location(f"_samples_of_{stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
