"""The compiled eager fast path: flash ops whose CUDA and AutogradCUDA kernels are C++
(csrc/fast/), so that a plain eager call, and the autograd engine's backward, never enter
Python once a call of the same signature has been seen (docs/design.md, "Dispatch").

Python stays the source of truth. The C++ CUDA kernel runs the op's Python body (`fallback`)
until one call of an argument signature has been recorded: in order, the Triton launches the
body made through kernels/triton/launch.py (compiled function, grid, arguments), the ops it
called that a recipe may call again (_CALLED: csrc/attention's kernels, cuDNN's backward,
copies, the matmuls and reductions of linear cross-entropy), and the loss ops' deferred target
checks (ops/cross_entropy.py, TargetCheck: with this module loaded every CUDA check is queued
in C++, csrc/fast/checks.cpp); besides, the buffers it
allocated and the outputs it returned, each tensor traced to an input, a buffer or an op call's
output. From then on C++ replays that recipe with the new call's tensors. A recording is kept
only where the body did nothing else: every other ATen call it made allocates or views (a
TorchDispatchMode checks), every launch went through a compiled kernel's launcher, no kernel
was compiled during it. The recorded plan must be a function of the signature alone (shapes,
strides, dtypes, alignment, scalar arguments), which ops/_plans.py already requires of every
plan.

Autograd: an op with a Spec (ops/_autograd.py) gets a C++ node that runs the same rule.
TORCH_FLASH_FAST=0 keeps every op on the Python path (to compare the two).
"""
from __future__ import annotations

import struct
import threading
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _dispatch, _extension
from ..kernels.triton import launch as _launch
from . import _autograd

aten = torch.ops.aten

# Ops served here, CUDA and autograd (their plans are pure functions of the signature, their
# autograd rules Specs), their siblings with statistics and their backward ops (rotary's backward
# ops are their own gradient, conjugate flipped).
OPS = ("rms_norm", "rms_norm_backward", "add_rms_norm", "add_rms_norm_backward",
       "layer_norm", "layer_norm_with_stats", "layer_norm_backward",
       "add_layer_norm", "add_layer_norm_with_stats", "add_layer_norm_backward",
       "cross_entropy", "cross_entropy_with_lse", "cross_entropy_backward",
       "attention", "attention_with_lse", "attention_backward", "attention_varlen", "attention_varlen_backward",
       "rotary", "rotary_backward", "rotary_qk", "rotary_qk_backward", "linear_cross_entropy")
# ops whose CUDA kernel alone is served here: their calls without a gradient (autograd: Python;
# decode writes the new keys into the cache, call() moves its version counters; the others are
# linear cross-entropy's forward with gradients, its backward and the in-place scaling the
# C++ node hands its gradients out with)
FORWARD_OPS = ("attention_decode", "linear_cross_entropy_with_grads",
               "linear_cross_entropy_backward", "linear_cross_entropy_scale_")
# ops whose replays stop inside a backward that keeps its graph: their Python body refuses it
PYTHON_WHEN_KEEPING_GRAPH = ("linear_cross_entropy_scale_",)

# ATen calls a recorded body may make: allocations (replayed) and views (their effect is in the
# pointers and strides recorded)
_ALLOCATIONS = frozenset({
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.new_empty.default, aten.new_empty_strided.default,
})
_VIEWS = frozenset({  # reshape and to: where they made no copy (checked)
    aten.view.default, aten._unsafe_view.default, aten._reshape_alias.default, aten.as_strided.default,
    aten.reshape.default, aten.to.dtype_layout, aten.to.device,
    aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default,
    aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.select.int, aten.slice.Tensor, aten.detach.default, aten.alias.default, aten.expand_as.default,
    aten.unbind.int,
})
# ATen calls on dtypes alone, nothing to replay
_DTYPE_QUERIES = frozenset({aten.promote_types.default, aten.result_type.Tensor, aten.result_type.Scalar,
                            aten.result_type.Scalar_Tensor, aten.result_type.Scalar_Scalar})
# ops a recipe calls again through the dispatcher (step "call"): their outputs' shapes follow
# from their inputs' and they read nothing on the host, so a call of the same signature makes
# the same calls. The flash ops (csrc/attention's kernels among them) qualify too. contiguous and
# to.dtype: a copy or the input itself, as the strides (in the key) decide.
_CALLED = frozenset({
    aten.copy_.default, aten.clone.default, aten.contiguous.default, aten.zero_.default, aten.fill_.Scalar,
    aten.zeros.default, aten.new_zeros.default, aten.new_full.default, aten._to_copy.default, aten.to.dtype,
    aten.mm.default, aten.mm.dtype, aten.mm.out, aten.addmm_.default, aten.add_.Tensor, aten.div.Tensor,
    aten.sum.default, aten.sum.dim_IntList,
    aten._scaled_dot_product_cudnn_attention_backward.default,
})
_INPUT, _ALLOC, _VALUE, _PRODUCED, _KEPT = range(5)  # csrc/fast/fast_path.h, Param::Kind

_lock = threading.Lock()  # one recording at a time: launch.py's hook is process-wide


class _Recording(TorchDispatchMode):
    """What a body does while recorded: its steps in order (Triton launches through launch.py's
    hook, target checks, op calls), the storages it allocated, and whether it did anything a
    recipe cannot replay."""

    def __init__(self):
        super().__init__()
        self.steps: list[tuple] = []
        self.allocated: set[int] = set()  # storages (_cdata) allocated by the body
        self.replayable = True
        self.thread = threading.get_ident()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.replayable:  # hold nothing: an autotuner's copies would pile up in steps
            return out
        if func in _ALLOCATIONS:
            self.allocated.add(out.untyped_storage()._cdata)
        elif func in _DTYPE_QUERIES:
            pass
        elif func in _CALLED or func.namespace == "flash":
            self.steps.append(("call", func, args, kwargs or {}, out))
        elif func not in _VIEWS or any(o.untyped_storage()._cdata != args[0].untyped_storage()._cdata
                                       for o in (out if isinstance(out, (list, tuple)) else (out,))):
            self.replayable = False
        return out

    def launched(self, launcher, grid: tuple[int, int, int], params: tuple) -> None:
        if threading.get_ident() == self.thread and self.replayable:
            self.steps.append(("launch", launcher, grid, params))

    def checked(self, summary: torch.Tensor, n_classes: int, ignore_index: int, op: str, wait: bool) -> None:
        """A target check (ops/cross_entropy.py, TargetCheck) made at this point of the body."""
        if threading.get_ident() == self.thread and self.replayable:
            self.steps.append(("check", summary, n_classes, ignore_index, op, wait))

    def compiled(self) -> None:
        """A launch that went through Triton (compiling, autotuning): nothing to replay."""
        if threading.get_ident() == self.thread:
            self.replayable = False
            self.steps.clear()


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


class _Unreplayable(Exception):
    """The recorded call holds something a recipe cannot express."""


class _Tensors:
    """Where each tensor the body touched lives, for the recipe: in an input (its argument
    position), a buffer the body allocated, an output of an op call the recipe makes, or a
    tensor from outside the call (a cached stand-in, a table) that the recipe keeps and passes
    again."""

    def __init__(self, args: tuple, rec: _Recording):
        self.args, self.rec = args, rec
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.owners: dict[int, list[int]] = {}  # input storage -> argument positions
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                self.owners.setdefault(a.untyped_storage()._cdata, []).append(i)
        self.buffers: dict[int, tuple[int, int, int]] = {}  # storage -> (index, nbytes, base address)
        self.produced: dict[int, int] = {}  # storage -> index among the op calls' outputs
        self.n_produced = 0
        self.kept: dict[int, tuple[int, torch.Tensor]] = {}  # storage -> (index, a tensor holding it)

    def base(self, t: torch.Tensor) -> tuple[int, int, int]:
        """(kind, index, byte offset of t's data from the base's: the input's data, else the
        storage's start)."""
        s = t.untyped_storage()
        mine = self.owners.get(s._cdata)
        if mine is not None:  # inputs sharing it keep their distances in every call of the key
            return _INPUT, mine[0], t.data_ptr() - self.args[mine[0]].data_ptr()
        if s._cdata in self.produced:
            return _PRODUCED, self.produced[s._cdata], t.data_ptr() - s.data_ptr()
        if s.device != self.device:
            raise _Unreplayable
        if s._cdata not in self.rec.allocated:
            index, _ = self.kept.setdefault(s._cdata, (len(self.kept), t))
            return _KEPT, index, t.data_ptr() - s.data_ptr()
        if s._cdata not in self.buffers:
            self.buffers[s._cdata] = (len(self.buffers), s.nbytes(), s.data_ptr())
        return _ALLOC, self.buffers[s._cdata][0], t.data_ptr() - s.data_ptr()

    def view(self, t: torch.Tensor) -> tuple:
        """(kind, index, byte offset, dtype, sizes, strides): t as a view of its base."""
        kind, index, offset = self.base(t)
        if offset % t.element_size():
            raise _Unreplayable
        return kind, index, offset, t.dtype, tuple(t.shape), t.stride()

    def add_outputs(self, out, n: int) -> None:
        """The n returns of an op call: tensors (fresh ones become bases) or None."""
        for t in (() if n == 0 else (out,) if n == 1 else out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()._cdata
                if s not in self.owners and s not in self.rec.allocated:
                    self.produced.setdefault(s, self.n_produced)
            elif t is not None:
                raise _Unreplayable
            self.n_produced += 1


def _launch_step(tensors: _Tensors, launcher, grid, params) -> tuple:
    abi = launcher.abi
    if abi is None:
        raise _Unreplayable
    kernel_args = []
    for position, ty in abi.params:
        v = params[position]
        if ty.startswith("*"):
            if not isinstance(v, torch.Tensor):
                raise _Unreplayable
            kernel_args.append((*tensors.base(v), 8))
        else:
            bits = _value_bits(ty, v)
            if bits is None:
                raise _Unreplayable
            kernel_args.append((_VALUE, 0, bits, _launch.ARG_BYTES[ty]))
    kernel_args += [(_VALUE, 0, 0, 8)] * abi.scratch  # Triton's scratch pointers, unused here
    return "launch", (abi.function, grid, abi.threads, abi.shared, kernel_args)


def _call_step(tensors: _Tensors, func, args: tuple, kwargs: dict, out) -> tuple:
    """("call", (qualified name, overload, [argument])): each argument ("tensor", view) or
    ("value", the Python value), in schema order."""
    if not all(str(r.type) in ("Tensor", "Tensor?") for r in func._schema.returns):
        raise _Unreplayable
    given = []
    for i, a in enumerate(func._schema.arguments):
        v = args[i] if i < len(args) else kwargs.get(a.name, a.default_value if a.has_default_value() else None)
        if isinstance(v, torch.Tensor):
            given.append(("tensor", tensors.view(v)))
        elif isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            raise _Unreplayable
        else:
            given.append(("value", v))
    tensors.add_outputs(out, len(func._schema.returns))
    return "call", (func._schema.name, func._schema.overload_name, given)


def _recipe(args: tuple, out, rec: _Recording, path: str) -> tuple | None:
    """The recipe C++ replays (csrc/fast/recipes.cpp, parse_recipe), or None where this call
    cannot be replayed."""
    if not rec.replayable or not rec.steps:
        return None
    tensors = _Tensors(args, rec)
    try:
        steps = []
        for kind, *step in rec.steps:
            if kind == "launch":
                steps.append(_launch_step(tensors, *step))
            elif kind == "call":
                steps.append(_call_step(tensors, *step))
            else:
                summary, *rest = step
                steps.append(("check", (tensors.base(summary), *rest)))
        outputs = []
        # None: an in-place op that returns nothing (flash.linear_cross_entropy_scale_)
        for t in out if isinstance(out, tuple) else () if out is None else (out,):
            if not isinstance(t, torch.Tensor) or t.untyped_storage()._cdata in tensors.owners:
                raise _Unreplayable  # an output that aliases an input
            outputs.append(tensors.view(t))
    except _Unreplayable:
        return None
    allocs = [nbytes for _, nbytes, _ in sorted(tensors.buffers.values())]
    kept = [t for _, t in sorted(tensors.kept.values(), key=lambda kept: kept[0])]
    return path, torch.cuda.current_device(), allocs, steps, outputs, kept


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

    def source(s: _autograd.Src, position: int) -> tuple[int, int]:
        # DEFAULT: the position in the called op's schema, whose default C++ reads
        if s.kind == _autograd.DEFAULT:
            return s.kind, position
        return s.kind, names.index(s.ref) if isinstance(s.ref, str) else s.ref or 0

    forward = spec.forward or op
    extra = dict(spec.forward_args)
    own = {n: _autograd.Src(_autograd.ARG, n) for n in names}  # else: the forward's default
    forward_args = [source(extra.get(a.name, own.get(a.name, _autograd.Src(_autograd.DEFAULT))), i)
                    for i, a in enumerate(getattr(torch.ops.flash, forward).default._schema.arguments)]
    saved = [(_autograd.ARG, names.index(s)) if isinstance(s, str) else (_autograd.SAVED, s) for s in spec.save]
    sources = [source(s, i) for i, s in enumerate(spec.backward_args)]
    grads = [(-1, -1)] * len(names)
    for name, ret, cast in spec.grads:
        grads[names.index(name)] = (ret, -1 if cast is None else names.index(cast))
    # arguments that, requiring a gradient, send the call to the Python rule
    python_only = [names.index(name) for name in spec.python_if_grad]
    python_if = [(names.index(name), value) for name, value in _autograd.python_if_pairs(spec)]
    return (f"flash::{spec.forward}" if spec.forward else "", forward_args, list(spec.outputs), saved,
            f"flash::{spec.backward}", sources, grads, python_only, python_if, list(spec.handout),
            f"flash::{spec.scale}" if spec.scale else "")


_ready: bool | None = None
# the fast path's module once ensure() has loaded it
MODULE = None


def ensure() -> bool:
    """Loads (compiling it the first time) the fast path's module and registers OPS' C++
    kernels, once; ops/_autograd.py's call() asks on the first CUDA call. False where it is not
    available (_extension.load_fast says why)."""
    global _ready, MODULE
    if _ready is None:
        module = _extension.load_fast()
        _ready = module is not None and enable(module)
        MODULE = module if _ready else None
    return _ready


def enable(module) -> bool:
    """Registers OPS' C++ kernels from the fast path's module."""
    module.fast_set_backend_key(_dispatch.BACKEND_TLS_KEY)
    for op in OPS:
        module.fast_enable(op, _fallback(op), _autograd.REGISTERED.get(op), _spec_tuple(op), True)
        _autograd.FAST[op] = getattr(torch.ops.flash, op).default
    for op in FORWARD_OPS:
        module.fast_enable(op, _fallback(op), None, None, False, op in PYTHON_WHEN_KEEPING_GRAPH)
        _autograd.FAST_FORWARD[op] = getattr(torch.ops.flash, op).default
    _dispatch.LAST.attach(module.fast_last, module.fast_forget, OPS + FORWARD_OPS)
    return True
