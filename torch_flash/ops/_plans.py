"""Decided once per signature: an op's argument checks, its choice of path and its kernels'
launch plan, kept per signature of a real call (docs/design.md, "Dispatch").

An eager call re-ran all of that in Python every time, 30-60 us of host time for a norm whose
kernel takes a few (docs/perf, "Host cost of an eager call"). Everything the checks and the
plans read is metadata: per tensor its shape, strides, dtype, device and whether its data is
16-byte aligned (the one thing Triton reads of a pointer), and the scalar arguments. A call
whose signature was seen before passed the same checks and takes the same path with the same
plan; only the tensors are new. Traced calls (fake, functional or proxied tensors) have no
signature and decide every time, as before.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .. import _dispatch
from ._autograd import plain_tensor

# signatures kept per op family before the table starts afresh (shapes can vary without bound)
MAX_PLANS = 4096


def signature(values: tuple) -> tuple | None:
    """What checks and plans read of these arguments, or None where one is not a plain tensor."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            if not plain_tensor(v):
                return None
            out.append((v.shape, v.stride(), v.dtype, v.device, v.data_ptr() & 15))
        else:
            out.append(v)
    return tuple(out)


class Plans:
    """One op family's table: (op, forced backend, signature) -> the plan make() returned."""

    def __init__(self):
        self._plans: dict[tuple, Any] = {}

    def get(self, op: str, values: tuple, make: Callable[[], Any]) -> Any:
        """The plan for these argument values: make() (which runs the checks, and selects the
        path, so _dispatch.LAST records it) on the first call of a signature, the kept plan
        after that (recorded in LAST: None stands for the reference path, other plans name
        theirs in `path`, by default the Triton one)."""
        sig = signature(values)
        if sig is None:
            return make()
        key = (op, _dispatch.forced_backend(), sig)
        try:
            plan = self._plans.get(key, _MISSING)
        except TypeError:  # an unhashable argument (a list for a tensor): make() raises the op's error
            return make()
        if plan is _MISSING:
            plan = make()
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        else:
            _dispatch.LAST[op] = "reference" if plan is None else getattr(plan, "path", "triton")
        return plan


_MISSING = object()
