"""Shared test helpers: relative error against a float64 reference, where opcheck samples are."""
from __future__ import annotations

import datetime
import os
import tempfile
import types
from typing import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_flash.testing import samples

# docs/design.md, "Numerics": relative error ||out - ref|| / ||ref|| against a float64 reference.
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor, size: float | None = None) -> float:
    """|out - ref| / |ref|, or / size where given."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    denom = ref.norm().item() if size is None else size
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float | None = None,
                     dtype: torch.dtype | None = None, what: str = "output", size: float | None = None) -> float:
    """Checks shape, no NaN, and relative error under tol (default: by dtype); size: the norm the
    error is relative to where not ref's."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    tol = TOL[dtype or out.dtype] if tol is None else tol
    err = rel_err(out, ref, size)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"
    return err


def to64(*ts):
    return tuple(None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in ts)



def _gloo_rank(rank: int, work: Callable[[int], object], world: int, out_dir: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'init')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.save(work(rank), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def error_text(fn: Callable[[], object]) -> str | None:
    """The ValueError fn raises, as text (None if it did not raise): what each rank of a
    distributed test reports, for the test to compare."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def run_gloo_ranks(work: Callable[[int], object], world: int) -> list:
    """work(rank) in `world` spawned processes joined in a gloo process group (the default
    group); each rank's result, in rank order. work must be a module-level function."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_gloo_rank, args=(work, world, out_dir), nprocs=world, join=True)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def samples_of(stem: str) -> types.ModuleType:
    """torch_flash.testing.samples.<stem>, the module with stem's OPCHECK_SAMPLES."""
    mod = samples.module(stem)
    if mod is None:
        raise FileNotFoundError(f"no torch_flash/testing/samples/{stem}.py")
    return mod


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op produced inside the block (no S x S tensor
    may appear where the attention ops promise none)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def force_triton_kernels(force_backend) -> None:
    """Forces the Triton attention kernels (on CPU under TRITON_INTERPRET=1, set by conftest
    before triton is imported), or skips."""
    pytest.importorskip("triton")
    from torch_flash.kernels.triton import attention as kernels
    if not torch.cuda.is_available() and not kernels._INTERPRET:
        pytest.skip("the Triton kernels were imported before TRITON_INTERPRET=1 was set")
    force_backend("triton")
