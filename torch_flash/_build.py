"""Build spec of the optional CUDA extension `torch_flash._C` (docs/design.md, "The CUDA extension").

The one place that knows its sources, flags, macros and include dirs, and whether it can be
built here. Used by setup.py (which loads this file by path: pip's build isolation has no
torch, so torch is only imported inside functions), by `python -m torch_flash build` and
by scripts/check_csrc.sh (`python torch_flash/_build.py --check-commands DIR`).

The kernel sources (one head dim each) include no torch header, so they can be compiled ahead
on a machine without a GPU (`python torch_flash/_build.py --export-objects DIR`) and linked in
by `python -m torch_flash build --objects DIR` where each object's key (its source and the csrc
headers it includes, the flags, CUTLASS's and nvcc's versions) still matches: the GPU machine
then compiles only the torch bindings.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import sys

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
NAME = "torch_flash._C"
ARCHS = ("sm_90a",)
DEFAULT_HDIMS = (64, 128, 256)
SOURCE_SUFFIXES = (".cpp", ".cu")
# relative to the cutlass_library package of the nvidia-cutlass wheel
CUTLASS_INCLUDE_SUBDIRS = ("source/include", "source/tools/util/include")
# The wheel's example whose FMHA collectives csrc/attention instantiates, compiled from a copy
# (patched_examples): its backward assigns float to the element type (dS, and dq's conversion),
# which compiles for cutlass::half_t (assignable from CUDA's half) but not for
# cutlass::bfloat16_t; the copy spells those two assignments as conversions.
EXAMPLE = "88_hopper_fmha"
EXAMPLE_PATCHES = (
    ("collective/fmha_collective_bwd_tma_warpspecialized.hpp",
     "acc_DS(i) = acc_P(i) * params.scale_softmax * (acc_DP(i) - reg_ODO(i));",
     "acc_DS(i) = Element(acc_P(i) * params.scale_softmax * (acc_DP(i) - reg_ODO(i)));"),
    ("kernel/fmha_kernel_bwd_convert.hpp",
     "value_dest[v] = value_src[v];",
     "value_dest[v] = Element(value_src[v]);"),
)

_HDIM = re.compile(r"_hdim(\d+)(?!\d)")
# csrc/fast, the eager fast path (torch_flash/ops/_fast.py): a module of its own, a few C++
# files without CUTLASS, compiled on first use (build_fast) rather than with torch_flash._C
FAST_SUBDIR = "fast"
FAST_NAME = "torch_flash_fast"
FAST_MODULE_SOURCE = ('#include "fast/fast_path.h"\n'
                      "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { torch_flash::fast::bind(m); }\n")

# C++20 for the .cpp files, which include torch's headers: torch's own standard, and
# cpp_extension's default. The .cu files include only CUDA and CUTLASS headers, which compile
# as C++17 without C++20's deprecation warnings.
CXX_FLAGS = ("-O3", "-std=c++20")
NVCC_FLAGS = (
    "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
    "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math", "-DNDEBUG", "-lineinfo",
    "--threads", "2",
    # torch defines these to keep ATen's own half arithmetic unambiguous; CUTLASS needs the operators
    *(f"-U__CUDA_NO_{m}__" for m in (
        "HALF_OPERATORS", "HALF_CONVERSIONS", "HALF2_OPERATORS", "BFLOAT16_OPERATORS",
        "BFLOAT16_CONVERSIONS", "BFLOAT162_OPERATORS", "BFLOAT162_CONVERSIONS")),
)


class BuildError(RuntimeError):
    """The extension cannot be built here; the message says why."""


def find_csrc() -> str | None:
    """csrc/ shipped inside the installed package, else the checkout's top-level csrc/."""
    for path in (os.path.join(PACKAGE_DIR, "csrc"), os.path.join(os.path.dirname(PACKAGE_DIR), "csrc")):
        if _sources_under(path):
            return path
    return None


def _sources_under(csrc: str) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(csrc):
        dirnames.sort()
        found += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(SOURCE_SUFFIXES)]
    return found


def _hdim_of(path: str) -> int | None:
    match = _HDIM.search(os.path.basename(path))
    return int(match.group(1)) if match else None


def select_hdims(value: str | None, available: list[int], origin: str = "FLASH_HDIMS") -> list[int]:
    """Head dims to build: `value` ("64,128") or, when unset, the defaults that have sources."""
    if value is None or not value.strip():
        return [d for d in DEFAULT_HDIMS if d in available]
    try:
        hdims = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        raise ValueError(f"{origin}={value}: expected a comma list of head dims, e.g. 64,128,256") from None
    missing = [d for d in hdims if d not in available]
    if missing:
        valid = ", ".join(map(str, available)) or "none (no *_hdim<D> sources in csrc/)"
        raise ValueError(f"{origin}={value}: no kernel source for head dim "
                         f"{', '.join(map(str, missing))}; valid: {valid}")
    return hdims


def find_cutlass() -> tuple[str, str] | None:
    """(directory of the cutlass_library package, nvidia-cutlass version), located without importing it."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        version = importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return spec.submodule_search_locations[0], version


def _cache_root() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "torch_flash")


def patched_examples(cutlass_dir: str, version: str) -> str:
    """An include dir holding a copy of the wheel's EXAMPLE folder with EXAMPLE_PATCHES applied,
    made once per CUTLASS install."""
    key = json.dumps([cutlass_dir, version, EXAMPLE_PATCHES])
    root = os.path.join(_cache_root(), "cutlass-examples-" + hashlib.sha256(key.encode()).hexdigest()[:16])
    if os.path.isdir(os.path.join(root, EXAMPLE)):
        return root
    tmp = f"{root}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(os.path.join(cutlass_dir, "source", "examples", EXAMPLE), os.path.join(tmp, EXAMPLE))
    for rel, old, new in EXAMPLE_PATCHES:
        path = os.path.join(tmp, EXAMPLE, rel)
        with open(path) as f:
            text = f.read()
        if text.count(old) != 1:
            shutil.rmtree(tmp, ignore_errors=True)
            raise BuildError(f"nvidia-cutlass {version}: {EXAMPLE}/{rel} no longer has the line that "
                             f"torch_flash/_build.py EXAMPLE_PATCHES rewrites: {old}")
        with open(path, "w") as f:
            f.write(text.replace(old, new))
    try:
        os.replace(tmp, root)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return root


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything a compiler needs; flags carry the macros and are argv words (torch's BuildExtension
    quotes them for ninja's shell)."""
    csrc: str
    hdims: tuple[int, ...]
    sources: tuple[str, ...]
    include_dirs: tuple[str, ...]
    cxx_flags: tuple[str, ...]
    nvcc_flags: tuple[str, ...]
    cutlass_version: str | None

    def describe(self) -> str:
        """What gets built, for people: sources, head dims, flags, include dirs."""
        lines = [f"{NAME}: {len(self.sources)} sources from {self.csrc} "
                 f"(head dims {', '.join(map(str, self.hdims)) or 'none'}; {', '.join(ARCHS)}; "
                 f"CUTLASS {self.cutlass_version or 'not installed'})"]
        lines += [f"  {os.path.relpath(s, self.csrc)}" for s in self.sources]
        lines += [f"  nvcc {shlex.join(self.nvcc_flags)}", f"  cxx  {shlex.join(self.cxx_flags)}"]
        lines += [f"  -I {d}" for d in self.include_dirs]
        return "\n".join(lines)


def spec(hdims: str | None = None, csrc: str | None = None, origin: str = "FLASH_HDIMS") -> Spec:
    """The build of `csrc` (default: find_csrc()) for head dims `hdims` (default: $FLASH_HDIMS)."""
    csrc = csrc or find_csrc()
    if csrc is None:
        raise BuildError(_no_sources())
    csrc = os.path.abspath(csrc)
    fast = set(fast_sources(csrc))
    all_sources = [p for p in _sources_under(csrc) if p not in fast]
    available = sorted({d for d in map(_hdim_of, all_sources) if d is not None})
    chosen = select_hdims(os.environ.get("FLASH_HDIMS") if hdims is None else hdims, available, origin)
    sources = [s for s in all_sources if _hdim_of(s) in (None, *chosen)]
    cutlass = find_cutlass()
    include_dirs = [csrc]
    if cutlass:
        include_dirs += [os.path.join(cutlass[0], d) for d in CUTLASS_INCLUDE_SUBDIRS]
        include_dirs.append(patched_examples(*cutlass))
    version = cutlass[1] if cutlass else None
    macros = [f"-DFLASH_HDIM_{d}" for d in chosen] + [f'-DFLASH_CUTLASS_VERSION="{version or "none"}"']
    return Spec(csrc, tuple(chosen), tuple(sources), tuple(include_dirs),
                CXX_FLAGS + tuple(macros), NVCC_FLAGS + tuple(macros), version)


def _no_sources() -> str:
    return (f"no C++/CUDA sources in {os.path.join(PACKAGE_DIR, 'csrc')} "
            f"or {os.path.join(os.path.dirname(PACKAGE_DIR), 'csrc')}")


def why_not() -> str | None:
    """Why the extension cannot be built here (torch without CUDA, no nvcc, no CUTLASS headers,
    no sources), or None when it can."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        return f"torch is not importable ({e}); pip's build isolation hides it: use --no-build-isolation"
    if not torch.version.cuda:
        return f"torch {torch.__version__} has no CUDA"
    cuda_home = cpp_extension.CUDA_HOME
    if not cuda_home or not os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    if find_cutlass() is None:
        return "the CUTLASS/CuTe headers are missing: pip install nvidia-cutlass"
    if find_csrc() is None:
        return _no_sources()
    return None


def extension(s: Spec, relative_to: str | None = None, prebuilt: dict[str, str] | None = None):
    """The setuptools CUDAExtension of `s` (sources relative to `relative_to`, as setup.py wants),
    linking the objects of `prebuilt` (prebuilt_objects) instead of compiling their sources."""
    from torch.utils.cpp_extension import CUDAExtension

    prebuilt = prebuilt or {}
    sources = [os.path.relpath(p, relative_to) if relative_to else p for p in s.sources if p not in prebuilt]
    return CUDAExtension(name=NAME, sources=sources, include_dirs=list(s.include_dirs),
                         extra_objects=list(prebuilt.values()),
                         extra_compile_args={"cxx": list(s.cxx_flags), "nvcc": list(s.nvcc_flags)})


def build_dir(s: Spec) -> str:
    """A cache directory per (spec, torch, CUDA, Python), so rebuilds are incremental under ninja."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    key = json.dumps([dataclasses.asdict(s), torch.__version__, torch.version.cuda, CUDA_HOME, sys.version])
    return os.path.join(_cache_root(), "build-" + hashlib.sha256(key.encode()).hexdigest()[:16])


def build(s: Spec, jobs: int | None = None, dest: str = PACKAGE_DIR, objects: str | None = None) -> str:
    """Compile `s` in build_dir(s), linking the matching kernel objects exported to `objects`,
    and install the library into `dest` atomically (a running process may have the old one
    mapped); returns its path."""
    from setuptools import Distribution
    from torch.utils.cpp_extension import BuildExtension

    ext = extension(s, prebuilt=prebuilt_objects(s, objects) if objects else None)
    dist = Distribution({"name": "torch-flash", "ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}})
    cmd = dist.get_command_obj("build_ext")
    root = build_dir(s)
    cmd.build_temp, cmd.build_lib = os.path.join(root, "temp"), os.path.join(root, "lib")
    # distutils skips the extension when no source is newer than the library, blind to the
    # headers and to prebuilt objects; ninja still recompiles only what changed
    cmd.force = True
    if jobs:
        os.environ["MAX_JOBS"] = str(jobs)  # read by torch's ninja backend
    dist.run_command("build_ext")
    built = cmd.get_ext_fullpath(ext.name)
    target = os.path.join(dest, os.path.basename(built))
    shutil.copyfile(built, target + ".tmp")
    os.replace(target + ".tmp", target)
    return target


def fast_sources(csrc: str) -> list[str]:
    return _sources_under(os.path.join(csrc, FAST_SUBDIR))


def fast_why_not() -> str | None:
    """Why the fast path's module cannot be compiled here, or None."""
    import torch
    from torch.utils import cpp_extension

    if not torch.version.cuda:
        return f"torch {torch.__version__} has no CUDA"
    home = cpp_extension.CUDA_HOME
    if not home or not os.path.exists(os.path.join(home, "include", "cuda.h")):
        return "the CUDA toolkit's headers were not found (set CUDA_HOME)"
    csrc = find_csrc()
    if csrc is None or not fast_sources(csrc):
        return _no_sources()
    return None


@functools.cache
def fast_build_dir() -> str:
    """Where the fast path's module is built and kept: one directory per torch, CUDA, Python and
    content of its sources (read once per process)."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    digest = hashlib.sha256(json.dumps([torch.__version__, torch.version.cuda, CUDA_HOME, sys.version,
                                        FAST_MODULE_SOURCE, CXX_FLAGS]).encode())
    csrc = find_csrc()
    for path in fast_sources(csrc) + [os.path.join(csrc, FAST_SUBDIR, "fast_path.h")]:
        with open(path, "rb") as f:
            digest.update(f.read())
    return os.path.join(_cache_root(), "fast-" + digest.hexdigest()[:16])


def fast_built() -> bool:
    directory = fast_build_dir()
    return os.path.isdir(directory) and any(f.startswith(FAST_NAME) and f.endswith(".so") for f in os.listdir(directory))


def build_fast(verbose: bool = False):
    """Compile (or, when fast_built(), just load) the fast path's module; returns it."""
    from torch.utils.cpp_extension import load

    csrc, directory = find_csrc(), fast_build_dir()
    os.makedirs(directory, exist_ok=True)
    module_source = os.path.join(directory, "module.cpp")
    if not os.path.exists(module_source):
        with open(module_source, "w") as f:
            f.write(FAST_MODULE_SOURCE)
    return load(name=FAST_NAME, sources=[*fast_sources(csrc), module_source], extra_cflags=list(CXX_FLAGS),
                extra_include_paths=[csrc], build_directory=directory, with_cuda=True, verbose=verbose)


def _cuda_home() -> str | None:
    """The CUDA toolkit for compile checks; a CPU build of torch does not look for one."""
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = shutil.which("nvcc")
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), CUDA_HOME, "/usr/local/cuda",
                 nvcc and os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return home
    return None


def check_commands(s: Spec, out_dir: str, files: list[str] | None = None) -> list[tuple[str, list[str]]]:
    """(source, argv) pairs that compile each `.cu` with nvcc and syntax-check each `.cpp` with
    the host compiler, with the flags of the real build, on a machine without a GPU."""
    import sysconfig

    import torch
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

    cuda = _cuda_home()
    if cuda is None:
        raise BuildError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    system = [*include_paths(), sysconfig.get_path("include"), os.path.join(cuda, "include")]
    # generated only in CUDA builds of torch; c10/cuda headers need it to parse
    if not any(os.path.exists(os.path.join(d, "c10/cuda/impl/cuda_cmake_macros.h")) for d in system):
        stub = os.path.join(out_dir, "stub")
        os.makedirs(os.path.join(stub, "c10/cuda/impl"), exist_ok=True)
        with open(os.path.join(stub, "c10/cuda/impl/cuda_cmake_macros.h"), "w") as f:
            f.write("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        system.append(stub)
    common = ["-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H",
              f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
              *(f"-I{d}" for d in s.include_dirs)]
    for d in system:
        common += ["-isystem", d]
    chosen = [os.path.abspath(f) for f in files] if files else [*s.sources, *fast_sources(s.csrc)]
    commands = []
    for i, src in enumerate(chosen):
        if src.endswith(".cu"):
            obj = os.path.join(out_dir, f"{i}_{os.path.basename(src)}.o")
            argv = [os.path.join(cuda, "bin", "nvcc"), "-c", src, "-o", obj, *common, *COMMON_NVCC_FLAGS,
                    "-Xcompiler", "-fPIC", *s.nvcc_flags]
        else:
            argv = [os.environ.get("CXX", "c++"), "-fsyntax-only", src, *common, "-fPIC", *s.cxx_flags]
        commands.append((src, argv))
    return commands


OBJECTS_MANIFEST = "manifest.json"  # {object file name: {"source": path under csrc, "key": kernel_key}}


def kernel_sources(s: Spec) -> list[str]:
    """The sources of one head dim each: CUDA kernels without torch headers."""
    return [p for p in s.sources if p.endswith(".cu") and _hdim_of(p) is not None]


def _object_name(src: str) -> str:
    return os.path.basename(src) + ".o"


def _why_stale(manifest: dict, directory: str, src: str, key: str) -> str | None:
    """Why directory's object of src, as its manifest lists it, cannot stand for a compile of src
    whose kernel_key is `key`; None when it can."""
    entry = manifest.get(_object_name(src))
    if entry is None or not os.path.exists(os.path.join(directory, _object_name(src))):
        return "not exported"
    if entry.get("key") != key:
        return "stale: the source, a header it includes, a flag or a compiler differs"
    return None


@functools.cache
def _nvcc_version() -> str:
    import subprocess

    cuda = _cuda_home()
    if cuda is None:
        raise BuildError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    out = subprocess.run([os.path.join(cuda, "bin", "nvcc"), "--version"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def _csrc_includes(csrc: str, src: str) -> list[str]:
    """src and the files under csrc it includes with quotes, transitively (CUTLASS's headers lie
    outside csrc: its version stands for them)."""
    seen, todo = set(), [os.path.abspath(src)]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        with open(path) as f:
            for name in _QUOTED_INCLUDE.findall(f.read()):
                for base in (os.path.dirname(path), csrc):
                    candidate = os.path.abspath(os.path.join(base, name))
                    if candidate.startswith(csrc + os.sep) and os.path.isfile(candidate):
                        todo.append(candidate)
                        break
    return sorted(seen)


def kernel_key(s: Spec, src: str) -> str:
    """What a kernel object depends on: its source and the csrc headers it includes, the nvcc
    flags and the versions of CUTLASS (with EXAMPLE_PATCHES) and nvcc."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    h = hashlib.sha256(json.dumps([s.nvcc_flags, COMMON_NVCC_FLAGS, s.cutlass_version, EXAMPLE_PATCHES,
                                   _nvcc_version()]).encode())
    for path in _csrc_includes(s.csrc, src):
        h.update(os.path.relpath(path, s.csrc).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def export_objects(s: Spec, out_dir: str, jobs: int = 2) -> None:
    """Compile kernel_sources(s) into out_dir, `jobs` at a time, with OBJECTS_MANIFEST; objects
    already there under the same key are kept."""
    import subprocess
    import time

    os.makedirs(out_dir, exist_ok=True)
    manifest_path = os.path.join(out_dir, OBJECTS_MANIFEST)
    try:
        with open(manifest_path) as f:
            previous = json.load(f)
        os.remove(manifest_path)  # until every object below is whole again
    except (OSError, ValueError):
        previous = {}
    sources = kernel_sources(s)
    manifest, running = {}, []
    for i, (src, argv) in enumerate(check_commands(s, out_dir, sources)):
        obj = _object_name(src)
        argv[argv.index("-o") + 1] = os.path.join(out_dir, obj)
        manifest[obj] = {"source": os.path.relpath(src, s.csrc), "key": kernel_key(s, src)}
        if _why_stale(previous, out_dir, src, manifest[obj]["key"]) is None:
            print(f"{manifest[obj]['source']}: up to date", flush=True)
            continue
        while len(running) >= jobs:
            _finish(running.pop(0))
        print(f"compiling {manifest[obj]['source']} ({i + 1}/{len(sources)})", flush=True)
        running.append((src, subprocess.Popen(argv), time.monotonic()))
    for job in running:
        _finish(job)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)


def _finish(job) -> None:
    import time

    src, proc, start = job
    if proc.wait() != 0:
        raise BuildError(f"nvcc failed on {src} (exit {proc.returncode})")
    print(f"  {os.path.basename(src)}: {time.monotonic() - start:.0f} s", flush=True)


def prebuilt_objects(s: Spec, directory: str) -> dict[str, str]:
    """{kernel source: object in directory} for the sources whose exported object's key matches;
    the others (printed, with why) are compiled as usual."""
    try:
        with open(os.path.join(directory, OBJECTS_MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        print(f"prebuilt objects: none usable in {directory} ({e})", flush=True)
        return {}
    found = {}
    for src in kernel_sources(s):
        why = _why_stale(manifest, directory, src, kernel_key(s, src))
        if why is None:
            found[src] = os.path.join(directory, _object_name(src))
        else:
            print(f"prebuilt objects: compiling {os.path.relpath(src, s.csrc)} ({why})", flush=True)
    return found


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python torch_flash/_build.py",
                                description="print the build spec, or the compile-check commands")
    p.add_argument("--check-commands", metavar="DIR", help="print 'source<TAB>command' lines that "
                   "compile-check the sources, objects and helper headers going to DIR")
    p.add_argument("--export-objects", metavar="DIR", help="compile the kernel sources into DIR for "
                   "`python -m torch_flash build --objects DIR` on another machine (no GPU needed)")
    p.add_argument("--csrc", help="sources root (default: the package's or the checkout's csrc/)")
    p.add_argument("--hdims", help="comma list of head dims (default: $FLASH_HDIMS, else 64,128,256)")
    p.add_argument("files", nargs="*", help="check only these sources")
    args = p.parse_args(argv)
    try:
        s = spec(args.hdims, args.csrc, origin="--hdims" if args.hdims else "FLASH_HDIMS")
        if args.export_objects:
            export_objects(s, args.export_objects)
            return 0
        if not args.check_commands:
            print(s.describe())
            return 0
        print(s.describe(), file=sys.stderr)
        for src, cmd in check_commands(s, args.check_commands, args.files):
            print(f"{src}\t{shlex.join(cmd)}")
    except (BuildError, ValueError) as e:
        print(f"torch_flash._build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
