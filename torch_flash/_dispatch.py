"""Per-call choice of implementation (DESIGN.md "Dispatch").

cuda: the compiled extension `torch_flash._C`, where it is built and supports the case;
triton: the Triton kernels (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1);
reference: plain PyTorch (CPU tensors, and anything the kernels do not cover).
`TORCH_FLASH_BACKEND=cuda|triton|reference` forces one; a forced backend that cannot
serve the call is an error, never a silent fallback.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

import torch
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from . import _extension

Backend = Literal["cuda", "triton", "reference"]
BACKENDS = ("cuda", "triton", "reference")


def forced_backend() -> Backend | None:
    value = os.environ.get("TORCH_FLASH_BACKEND", "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise RuntimeError(f"TORCH_FLASH_BACKEND={value!r}: expected one of {', '.join(BACKENDS)}")
    return value  # type: ignore[return-value]


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


def symbolic(t: torch.Tensor) -> bool:
    """Whether this Python runs without real values to read or buffers of its own to reuse:
    traced by torch.compile / aot_autograd / export / make_fx (fake, functional or proxied
    tensors), captured into a CUDA graph (replays never rerun it), or on meta tensors."""
    return (torch.compiler.is_compiling() or get_proxy_mode() is not None or is_fake(t)
            or isinstance(t, FunctionalTensor) or torch._is_functional_tensor(t)
            or t.device.type == "meta" or (t.is_cuda and torch.cuda.is_current_stream_capturing()))


def triton_can_run(device: torch.device) -> bool:
    """Whether Triton kernels can run on tensors of `device` in this process."""
    if not triton_installed():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and triton_interpret()


# The path each op took on its latest call (`python -m torch_flash demo` reports it): a Backend,
# or "cudnn" where flash.attention_backward hands the call to cuDNN (ops/attention.py).
LAST: dict[str, str] = {}


def select(op: str, device: torch.device, *, triton: bool, cuda: bool = False) -> Backend:
    """Pick the backend for one call of `flash.<op>` on tensors of `device`.

    `triton` / `cuda` say whether that kernel exists and supports this particular call
    (shapes, dtypes, features); the op decides, the rules here stay the same for all ops.
    """
    LAST[op] = backend = _select(op, device, triton=triton, cuda=cuda)
    return backend


def _select(op: str, device: torch.device, *, triton: bool, cuda: bool) -> Backend:
    forced = forced_backend()
    if forced == "reference":
        return "reference"
    if forced == "cuda":
        if device.type == "cuda" and cuda and extension_loaded():
            return "cuda"
        raise RuntimeError(f"flash.{op}: TORCH_FLASH_BACKEND=cuda, but the CUDA extension "
                           f"is not built or does not support this call (device {device})")
    if forced == "triton":
        if triton and triton_can_run(device):
            return "triton"
        raise RuntimeError(f"flash.{op}: TORCH_FLASH_BACKEND=triton, but no Triton kernel "
                           f"serves this call on {device} (CPU tensors need TRITON_INTERPRET=1)")
    if device.type == "cuda":
        if cuda and extension_loaded():
            return "cuda"
        if triton and triton_can_run(device):
            return "triton"
    return "reference"
