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
