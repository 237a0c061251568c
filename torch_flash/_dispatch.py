"""Per-call choice of implementation (docs/design.md, "Dispatch").

cuda: the compiled extension `torch_flash._C`, where it is built and supports the call;
triton: the Triton kernels (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1);
reference: plain PyTorch (CPU tensors, and anything the kernels do not cover).

What can run on a device type is decided once (`available`); an op asks `select` once per
signature of its arguments (ops/_plans.py), saying whether its kernels support the call. A
backend is forced by `use_backend(...)`, else by TORCH_FLASH_BACKEND, read once at import; a
forced backend that cannot serve a call is an error, never a silent fallback.
"""
from __future__ import annotations

import collections.abc
import contextlib
import functools
import importlib.util
import os
from typing import Callable, Iterator, Literal, Optional

import torch
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from . import _extension

Backend = Literal["cuda", "triton", "reference"]
BACKENDS = ("cuda", "triton", "reference")

# use_backend(None): the per-call choice, whatever TORCH_FLASH_BACKEND says
_AUTO = "auto"
# the process's default, read once (use_backend changes it per thread)
_ENV = os.environ.get("TORCH_FLASH_BACKEND", "").strip().lower() or None
# use_backend's choice goes under this key into torch's thread-local state (autograd hands it
# to the device threads that run a backward() called in the block) or, in a compiled function,
# into the annotations of the graph's nodes
BACKEND_TLS_KEY = "torch_flash_backend"
# torch >= 2.13; before, an exit leaves None behind
_tls_remove = getattr(torch._C, "_remove_obj_from_tls", None)


@contextlib.contextmanager
def use_backend(name: Optional[Backend]) -> Iterator[None]:
    """Run the flash ops called inside the block on backend `name` ("cuda", "triton" or
    "reference"; None: the per-call choice, whatever TORCH_FLASH_BACKEND says).

    Per thread; a backward() called inside the block runs its ops on `name` too. Inside a
    torch.compile'd function the choice is traced into the graph (dynamo cannot trace the
    thread-local state, so it becomes an annotation of the graph's nodes that the ops read
    when traced); a graph compiled inside the block keeps the backend it was traced with."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"use_backend({name!r}): expected one of {', '.join(BACKENDS)}, or None")
    choice = name or _AUTO
    if torch.compiler.is_compiling():
        with fx_traceback.annotate({BACKEND_TLS_KEY: choice}):
            yield
    else:
        prev = _thread_choice()
        torch._C._stash_obj_in_tls(BACKEND_TLS_KEY, choice)
        try:
            yield
        finally:
            if prev is None and _tls_remove is not None:
                _tls_remove(BACKEND_TLS_KEY)  # nothing of ours left for the thread's exit to free
            else:
                torch._C._stash_obj_in_tls(BACKEND_TLS_KEY, prev)


def forced_backend() -> Optional[str]:
    """The backend forced on this call, or None: the innermost use_backend (as traced into a
    graph, else of this thread), else TORCH_FLASH_BACKEND. select() rejects a value that
    names no backend."""
    choice = _traced_choice() or _thread_choice() or _ENV
    return None if choice == _AUTO else choice


def _traced_choice() -> Optional[str]:
    custom = fx_traceback.current_meta.get("custom")
    return custom.get(BACKEND_TLS_KEY) if custom else None


def _thread_choice() -> Optional[str]:
    return torch._C._get_obj_in_tls(BACKEND_TLS_KEY) if torch._C._is_key_in_tls(BACKEND_TLS_KEY) else None


@functools.cache
def triton_interpret() -> bool:
    """Whether Triton interprets its kernels: read once, as Triton itself does when it decorates
    them (at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, for grids sized per SM; 8 elsewhere (the
    Triton interpreter: any small machine)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def extension_loaded() -> bool:
    return _extension.loaded()


@functools.cache
def available(device_type: str) -> frozenset[str]:
    """The backends that can run on tensors of this device type in this process, decided on
    first use (after import, which loads the extension last)."""
    out = {"reference"}
    if device_type == "cuda" and extension_loaded():
        out.add("cuda")
    if triton_installed() and (device_type == "cuda" or (device_type == "cpu" and triton_interpret())):
        out.add("triton")
    return frozenset(out)


def triton_can_run(device: torch.device) -> bool:
    """Whether Triton kernels can run on tensors of `device` in this process."""
    return "triton" in available(device.type)


def symbolic(t: torch.Tensor) -> bool:
    """Whether this Python runs without real values to read or buffers of its own to reuse:
    traced by torch.compile / aot_autograd / export / make_fx (fake, functional or proxied
    tensors), captured into a CUDA graph (replays never rerun it), or on meta tensors."""
    return (torch.compiler.is_compiling() or get_proxy_mode() is not None or is_fake(t)
            or isinstance(t, FunctionalTensor) or torch._is_functional_tensor(t)
            or t.device.type == "meta" or (t.is_cuda and torch.cuda.is_current_stream_capturing()))


class _Last(collections.abc.MutableMapping):
    """op -> the path its latest call took (`python -m torch_flash demo` reports it): a Backend,
    or "cudnn" where flash.attention_backward hands the call to cuDNN (ops/attention.py). The
    Python path writes it; where the compiled fast path (ops/_fast.py) replayed a call since,
    the extension answers."""

    def __init__(self):
        self._paths: dict[str, str] = {}
        self._replayed: Callable[[str], Optional[str]] = lambda op: None
        self._forget: Callable[[str], None] = lambda op: None
        self._fast: frozenset[str] = frozenset()

    def attach(self, replayed: Callable[[str], Optional[str]], forget: Callable[[str], None], ops) -> None:
        self._replayed, self._forget, self._fast = replayed, forget, frozenset(ops)

    def __getitem__(self, op: str) -> str:
        path = self._replayed(op) if op in self._fast else None
        return self._paths[op] if path is None else path

    def __setitem__(self, op: str, path: str) -> None:
        self._paths[op] = path
        if op in self._fast:
            self._forget(op)

    def __delitem__(self, op: str) -> None:
        del self._paths[op]

    def __iter__(self):
        return iter({*self._paths, *(op for op in self._fast if self._replayed(op) is not None)})

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def clear(self) -> None:
        self._paths.clear()
        for op in self._fast:
            self._forget(op)


LAST = _Last()

Serves = Optional[Callable[[], bool]]


def select(op: str, t: torch.Tensor, *, triton: Serves = None, cuda: Serves = None) -> Backend:
    """The backend for one call of `flash.<op>` whose tensors are on t's device.

    `triton` / `cuda`: whether that kernel supports this call (shapes, dtypes, features),
    asked only where it can run, so it may import its kernels; None where the op has none.
    Unforced, a CUDA tensor gets the first of cuda, triton that serves, anything else the
    reference (the Triton interpreter runs on CPU only when forced: it is for tests)."""
    LAST[op] = backend = _select(op, t.device, triton, cuda)
    return backend


def _select(op: str, device: torch.device, triton: Serves, cuda: Serves) -> Backend:
    forced = forced_backend()
    can = available(device.type)
    if forced is None:
        if device.type == "cuda":
            if cuda is not None and "cuda" in can and cuda():
                return "cuda"
            if triton is not None and "triton" in can and triton():
                return "triton"
        return "reference"
    if forced == "reference":
        return "reference"
    if forced not in BACKENDS:
        raise RuntimeError(f"flash.{op}: backend {forced!r} forced (TORCH_FLASH_BACKEND): expected one of "
                           f"{', '.join(BACKENDS)}")
    serves = cuda if forced == "cuda" else triton
    if serves is not None and forced in can and serves():
        return forced  # type: ignore[return-value]
    why = ("the CUDA extension is not built or does not support this call" if forced == "cuda"
           else "no Triton kernel serves this call (CPU tensors need TRITON_INTERPRET=1)")
    raise RuntimeError(f"flash.{op}: backend {forced!r} forced (use_backend or TORCH_FLASH_BACKEND), "
                       f"but {why} (device {device})")
