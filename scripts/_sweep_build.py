"""What the CUDA sweeps (scripts/sweep_*_sm90.py) share: kernel variants compiled in parallel
into small shared libraries with the extension's own flags (torch_flash/_build.py), and torch
memory for the kernels' alloc callbacks. The scripts import it as a sibling module."""
from __future__ import annotations

import concurrent.futures
import ctypes
import os
import subprocess
import time

import torch

from torch_flash import _build


class Scratch:
    """An alloc(ctx, bytes) callback handing out torch buffers, held until the next call (each
    call's work is queued on the same stream, so the caching allocator may then reuse them)."""
    FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)

    def __init__(self):
        self.buffers = []
        self.fn = self.FN(self._alloc)  # referenced here so that ctypes keeps it alive

    def _alloc(self, ctx, nbytes):
        self.buffers.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
        return self.buffers[-1].data_ptr()

    def address(self) -> int:
        return ctypes.cast(self.fn, ctypes.c_void_p).value


def compile_libraries(sources: dict[str, str], workdir: str, jobs: int) -> dict[str, str]:
    """{name: CUDA source} -> {name: path of the built library}; failures are printed and left out."""
    from torch.utils.cpp_extension import CUDA_HOME
    spec = _build.spec(hdims="64,128,256")
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")

    def one(item):
        name, text = item
        src = os.path.join(workdir, f"{name}.cu")
        with open(src, "w") as f:
            f.write(text)
        lib = src[:-3] + ".so"
        argv = [nvcc, "-shared", "-Xcompiler", "-fPIC", src, "-o", lib, *spec.nvcc_flags,
                *(f"-I{i}" for i in spec.include_dirs)]
        t0 = time.time()
        r = subprocess.run(argv, capture_output=True, text=True)
        ok = r.returncode == 0
        print(f"  {'built' if ok else 'FAILED'} {name} ({time.time() - t0:.0f} s)", flush=True)
        if not ok:
            print("\n".join(r.stderr.splitlines()[:8]), flush=True)
        return name, lib if ok else None

    print(f"compiling {len(sources)} configurations with {jobs} jobs", flush=True)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        return {k: p for k, p in pool.map(one, sources.items()) if p}
