"""The fast path's recording (torch_flash/ops/_fast.py, _Recording) on CPU tensors: what it
holds while an op's body runs. The replays themselves are GPU tests (test_fast_path.py)."""
from __future__ import annotations

import weakref

import torch

from torch_flash.ops import _fast


def _autotune_like(x: torch.Tensor) -> weakref.ref:
    """What Triton's autotuner does per timed run with restore_value: clone, run, copy back."""
    copy = None
    for _ in range(3):
        copy = x.clone()
        x.copy_(copy)
    return weakref.ref(copy)


def test_recording_holds_the_calls_it_may_replay():
    rec, x = _fast._Recording(), torch.randn(64)
    with rec:
        copy = _autotune_like(x)
    assert rec.replayable and len(rec.steps) == 6 and copy() is not None


def test_unreplayable_recording_holds_nothing():
    """Once a launch compiles (autotuning: the autotuner clones its outputs for every timed run)
    nothing is replayed, so nothing is kept: on 2026-11-28 the kept clones of a 4 GiB rotary
    output filled an H200's memory."""
    rec, x = _fast._Recording(), torch.randn(64)
    with rec:
        rec.steps.append(("launch", None, (1, 1, 1), (x,)))
        rec.compiled()
        copy = _autotune_like(x)
    assert not rec.replayable and rec.steps == [] and copy() is None
