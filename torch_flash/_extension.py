"""The optional compiled extension `torch_flash._C`: imported once, and why not, remembered.

Importing it registers its CUDA kernels (`TORCH_LIBRARY_IMPL(flash, CUDA, m)`) for ops whose
schemas torch_flash.ops defines, so torch_flash/__init__.py calls `load()` after those imports.
Not built is the normal pure-Python install and stays silent; a library that is there but does
not load (built against another torch: undefined symbol) warns once and is reported by
`python -m torch_flash info`. Neither stops the package from working on the Triton and
reference paths. A kernel whose C++ signature does not match its op's schema aborts the
process inside the import (uncatchable); `TORCH_FLASH_EXTENSION=0` skips loading, e.g. to
rebuild: `TORCH_FLASH_EXTENSION=0 python -m torch_flash build`.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys
import time
import warnings
from types import ModuleType

_module: ModuleType | None = None
_error: str | None = None
_tried = False


def load() -> ModuleType | None:
    """Import torch_flash._C once; never raises. Returns the module, or None."""
    global _module, _error, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("TORCH_FLASH_EXTENSION") == "0":
        return None
    try:
        _module = importlib.import_module("torch_flash._C")
    except ModuleNotFoundError as e:
        if e.name != "torch_flash._C":
            _error = f"{type(e).__name__}: {e}"
    except Exception as e:  # ImportError (undefined symbol), or a kernel registration that failed
        _error = f"{type(e).__name__}: {e}"
    if _error:
        warnings.warn(f"torch_flash._C did not load ({_error}); the Triton and reference paths serve "
                      "every op. Rebuild it for this torch: python -m torch_flash build",
                      RuntimeWarning, stacklevel=2)
    return _module


def loaded() -> bool:
    return _module is not None


def error() -> str | None:
    """Why a present extension failed to load (None when it loaded or is not built)."""
    return _error


def path() -> str | None:
    return _module.__file__ if _module is not None else None


@functools.cache
def build_info() -> dict | None:
    """What the loaded extension was built for: {"archs": ["sm_90a"], "hdims": [...],
    "cuda_version": str, "cutlass_version": str, "ops": ["flash::...", ...]}; None if not loaded."""
    return dict(_module.build_info()) if _module is not None else None


_fast: ModuleType | None = None
_fast_error: str | None = None
_fast_tried = False


def load_fast() -> ModuleType | None:
    """The eager fast path's compiled module (csrc/fast, torch_flash/ops/_fast.py): compiled on
    first use where torch has CUDA and the CUDA headers are installed, once per torch, CUDA and
    Python version (a line says so, and how long it took), then loaded from the cache. None where
    it cannot be, after one line saying why (silent on machines without CUDA), or with
    TORCH_FLASH_FAST=0; the Python path then serves every call. Never raises."""
    global _fast, _fast_error, _fast_tried
    if _fast_tried:
        return _fast
    _fast_tried = True
    if os.environ.get("TORCH_FLASH_FAST") == "0":
        _fast_error = "disabled (TORCH_FLASH_FAST=0)"
        return None
    from . import _build
    try:
        _fast_error = _build.fast_why_not()
        if _fast_error is not None:
            import torch
            if torch.version.cuda:
                print(f"torch_flash: eager fast path unavailable ({_fast_error}); "
                      "eager calls take the Python path", file=sys.stderr)
            return None
        building = not _build.fast_built()
        if building:
            print(f"torch_flash: compiling the eager fast path into {_build.fast_build_dir()} "
                  "(once per torch/CUDA version, about a minute)...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        _fast = _build.build_fast()
        if building:
            print(f"torch_flash: eager fast path compiled in {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
    except Exception as e:  # a compiler error, or a library built for another torch
        _fast_error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        print(f"torch_flash: eager fast path unavailable ({_fast_error}); eager calls take the Python "
              "path", file=sys.stderr)
    return _fast


def fast_error() -> str | None:
    """Why the fast path is not loaded (None when it is, or was not tried yet)."""
    return _fast_error
