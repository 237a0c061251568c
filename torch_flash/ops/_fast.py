"""The compiled eager fast path: flash ops whose CUDA and AutogradCUDA kernels are C++
(csrc/fast/), so that a plain eager call, and the autograd engine's backward, never enter
Python once a call of the same signature has been seen (docs/design.md, "Dispatch").

Python stays the source of truth. The C++ CUDA kernel runs the op's Python body (`fallback`)
until one call of an argument signature has been recorded: the Triton launches the body made
through kernels/triton/launch.py (compiled function, grid, arguments), the buffers it
allocated and the outputs it returned, each kernel pointer traced to an input or a buffer. From
then on C++ replays that recipe with the new call's pointers. A recording is kept only where the
body did nothing else: every ATen call it made allocates or views (a TorchDispatchMode checks),
every launch went through a compiled kernel's launcher, no kernel was compiled during it. The
recorded plan must be a function of the signature alone (shapes, strides, dtypes, alignment,
scalar arguments), which ops/_plans.py already requires of every plan; ops with state across
calls (cross-entropy's deferred target check) stay off this path.

Autograd: an op with a Spec (ops/_autograd.py) gets a C++ node that runs the same rule.
TORCH_FLASH_FAST=0 keeps every op on the Python path (to compare the two).
"""
from __future__ import annotations

import struct
import threading
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _dispatch, _extension
from ..kernels.triton import launch as _launch
from . import _autograd

aten = torch.ops.aten

# Ops served here, CUDA and autograd: the norms (their Triton plans are pure functions of the
# signature, their autograd rules Specs), their statistics siblings and their backward ops.
OPS = ("rms_norm", "rms_norm_backward", "add_rms_norm", "add_rms_norm_backward",
       "layer_norm", "layer_norm_with_stats", "layer_norm_backward",
       "add_layer_norm", "add_layer_norm_with_stats", "add_layer_norm_backward")
# Attention, the same, where torch_flash._C is not loaded: its Hopper kernels are an op call,
# which a recipe does not hold, and every call would pay the way through C++ to the Python body.
ATTENTION_OPS = ("attention", "attention_with_lse", "attention_backward")
# ops whose CUDA kernel alone is served here: their calls without a gradient (autograd: Python;
# decode writes the new keys into the cache, call() moves its version counters)
FORWARD_OPS = ("rotary", "rotary_qk", "attention_decode")

# ATen calls a recorded body may make: allocations (replayed) and views (their effect is in the
# pointers and strides recorded)
_ALLOWED = frozenset({
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.new_empty.default, aten.new_empty_strided.default,
    aten.view.default, aten._unsafe_view.default, aten._reshape_alias.default, aten.as_strided.default,
    aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default,
    aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.select.int, aten.slice.Tensor, aten.detach.default, aten.alias.default,
})
_INPUT, _ALLOC, _VALUE = range(3)  # csrc/fast/fast_path.h, Param::Kind

_lock = threading.Lock()  # one recording at a time: launch.py's hook is process-wide


class _Recording(TorchDispatchMode):
    """What a body does while recorded: its launches (through launch.py's hook) and whether it
    did anything a recipe cannot replay."""

    def __init__(self):
        super().__init__()
        self.launches: list[tuple[Any, tuple[int, int, int], tuple]] = []
        self.replayable = True
        self.thread = threading.get_ident()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _ALLOWED:
            self.replayable = False
        return func(*args, **(kwargs or {}))

    def launched(self, launcher, grid: tuple[int, int, int], params: tuple) -> None:
        if threading.get_ident() == self.thread:
            self.launches.append((launcher, grid, params))

    def compiled(self) -> None:
        """A launch that went through Triton (compiling, autotuning): nothing to replay."""
        if threading.get_ident() == self.thread:
            self.replayable = False


def _value_bits(ty: str, v) -> int | None:
    """The argument's bytes as the kernel reads them (little-endian, in an int64), or None."""
    if ty in ("fp32", "f32"):
        return struct.unpack("<i", struct.pack("<f", v))[0]
    if ty == "fp64":
        return struct.unpack("<q", struct.pack("<d", v))[0]
    if ty in _launch.ARG_BYTES and isinstance(v, (int, bool)):
        v = int(v)
        return v - (1 << 64) if v >= 1 << 63 else v
    return None


def _recipe(args: tuple, out, rec: _Recording, path: str) -> tuple | None:
    """The recipe C++ replays (csrc/fast/recipes.cpp, parse_recipe), or None where this call
    cannot be replayed."""
    if not rec.replayable or not rec.launches:
        return None
    device = torch.cuda.current_device()
    owners: dict[int, list[int]] = {}  # input storage -> argument positions
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            owners.setdefault(a.untyped_storage()._cdata, []).append(i)
    buffers: dict[int, tuple[int, int, int]] = {}  # storage -> (index, nbytes, base address)

    def buffer(t: torch.Tensor) -> tuple[int, int, int] | None:
        s = t.untyped_storage()
        if s._cdata in owners or s.device != torch.device("cuda", device):
            return None
        if s._cdata not in buffers:
            buffers[s._cdata] = (len(buffers), s.nbytes(), s.data_ptr())
        return buffers[s._cdata]

    outputs = []
    for t in out if isinstance(out, tuple) else (out,):
        b = buffer(t) if isinstance(t, torch.Tensor) else None
        if b is None:
            return None
        outputs.append((b[0], t.dtype, tuple(t.shape), t.stride(), t.storage_offset()))
    launches = []
    for launcher, grid, params in rec.launches:
        abi = launcher.abi
        if abi is None:
            return None
        kernel_args = []
        for position, ty in abi.params:
            v = params[position]
            if ty.startswith("*"):
                if not isinstance(v, torch.Tensor):
                    return None
                mine = owners.get(v.untyped_storage()._cdata)
                if mine is not None:
                    if len(mine) != 1:  # two inputs share it: which one moves with a new call is unknown
                        return None
                    kernel_args.append((_INPUT, mine[0], v.data_ptr() - args[mine[0]].data_ptr(), 8))
                else:
                    b = buffer(v)
                    if b is None:
                        return None
                    kernel_args.append((_ALLOC, b[0], v.data_ptr() - b[2], 8))
            else:
                bits = _value_bits(ty, v)
                if bits is None:
                    return None
                kernel_args.append((_VALUE, 0, bits, _launch.ARG_BYTES[ty]))
        kernel_args += [(_VALUE, 0, 0, 8)] * abi.scratch  # Triton's scratch pointers, unused here
        launches.append((abi.function, grid, abi.threads, abi.shared, kernel_args))
    allocs = [nbytes for _, nbytes, _ in sorted(buffers.values())]
    return path, device, allocs, launches, outputs


def _fallback(op: str) -> Callable[[tuple, bool], tuple]:
    """fallback(args, record) for C++: op's Python body on the arguments in schema order, and
    the recipe of the call where record is set and one can be made."""
    body = _autograd._BODIES[op]
    schema = getattr(torch.ops.flash, op).default._schema
    keyword = [(i, a.name) for i, a in enumerate(schema.arguments) if a.kwarg_only]
    n_positional = len(schema.arguments) - len(keyword)

    def fallback(args: tuple, record: bool) -> tuple:
        kwargs = {name: args[i] for i, name in keyword}
        if not record:
            return body(*args[:n_positional], **kwargs), None
        with _lock:
            rec = _Recording()
            _launch.RECORDING = rec
            try:
                with rec:
                    out = body(*args[:n_positional], **kwargs)
            finally:
                _launch.RECORDING = None
        return out, _recipe(args, out, rec, _dispatch.LAST.get(op, "triton"))
    return fallback


def _spec_tuple(op: str) -> tuple | None:
    """op's Spec as csrc/fast/autograd.cpp (parse_spec) takes it: names become positions."""
    spec = _autograd.SPECS.get(op)
    if spec is None:
        return None
    names = [a.name for a in getattr(torch.ops.flash, op).default._schema.arguments]
    forward = spec.forward or op
    forward_args = [names.index(a.name) for a in getattr(torch.ops.flash, forward).default._schema.arguments]
    saved = [(_autograd.ARG, names.index(s)) if isinstance(s, str) else (_autograd.SAVED, s) for s in spec.save]
    sources = [(s.kind, names.index(s.ref) if isinstance(s.ref, str) else s.ref or 0) for s in spec.backward_args]
    grads = [(-1, -1)] * len(names)
    for name, ret, cast in spec.grads:
        grads[names.index(name)] = (ret, -1 if cast is None else names.index(cast))
    python_only = [names.index(name) for name, _ in spec.python_grads]
    return (f"flash::{spec.forward}" if spec.forward else "", forward_args, list(spec.outputs), saved,
            f"flash::{spec.backward}", sources, grads, python_only)


_ready: bool | None = None


def ensure() -> bool:
    """Loads (compiling it the first time) the fast path's module and registers OPS' C++
    kernels, once; ops/_autograd.py's call() asks on the first CUDA call. False where it is not
    available (_extension.load_fast says why)."""
    global _ready
    if _ready is None:
        module = _extension.load_fast()
        _ready = module is not None and enable(module)
    return _ready


def enable(module) -> bool:
    """Registers OPS' C++ kernels from the fast path's module."""
    module.fast_set_backend_key(_dispatch.BACKEND_TLS_KEY)
    ops = OPS + (() if _extension.loaded() else ATTENTION_OPS)
    for op in ops:
        module.fast_enable(op, _fallback(op), _autograd.REGISTERED.get(op), _spec_tuple(op), True)
        _autograd.FAST[op] = getattr(torch.ops.flash, op).default
    for op in FORWARD_OPS:
        module.fast_enable(op, _fallback(op), None, None, False)
        _autograd.FAST_FORWARD[op] = getattr(torch.ops.flash, op).default
    _dispatch.LAST.attach(module.fast_last, module.fast_forget, ops + FORWARD_OPS)
    return True
