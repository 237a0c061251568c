"""python -m torch_flash info | build | demo | bench"""
from __future__ import annotations

import argparse
import os
import platform
import sys


def info() -> None:
    import torch

    import torch_flash
    from torch_flash import _dispatch
    from torch_flash._registry import OPS

    cuda = torch.cuda.is_available()
    rows = [
        ("torch-flash", f"{torch_flash.__version__} ({os.path.dirname(torch_flash.__file__)})"),
        ("python", platform.python_version()),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
        ("GPU", torch.cuda.get_device_name() + f" (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
         if cuda else "none"),
    ]
    try:
        import triton
        rows.append(("triton", triton.__version__))
    except ImportError:
        rows.append(("triton", "not installed"))
    rows += [
        ("Triton kernels on GPU", "yes" if cuda and _dispatch.triton_installed() else
         "no (" + ("no CUDA GPU" if not cuda else "triton not installed") + ")"),
        ("Triton interpreter", "on (TRITON_INTERPRET=1: Triton kernels run on CPU tensors)"
         if _dispatch.triton_interpret() else "off (set TRITON_INTERPRET=1 to run Triton kernels on CPU)"),
        *_extension_rows(),
        ("TORCH_FLASH_BACKEND", os.environ.get("TORCH_FLASH_BACKEND") or "unset (per-call choice)"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("\nops (torch.ops.flash.*):")
    name_width = max(len(e.name) for e in OPS)
    for e in OPS:
        back = f"backward {e.backward}" if e.backward else "inference only"
        mut = f", mutates {', '.join(e.mutates)}" if e.mutates else ""
        print(f"  {e.name:<{name_width}} {e.family:<9} {back}{mut}")


def _fast_row() -> tuple[str, str]:
    from torch_flash import _build

    name = "eager fast path (csrc/fast)"
    if os.environ.get("TORCH_FLASH_FAST") == "0":
        return name, "off (TORCH_FLASH_FAST=0)"
    reason = _build.fast_why_not()
    if reason:
        return name, f"unavailable ({reason}): eager calls take the Python path"
    if _build.fast_built():
        return name, f"compiled ({_build.fast_build_dir()})"
    return name, "compiled on the first CUDA call (about a minute, once), or by python -m torch_flash build"


def _extension_rows() -> list[tuple[str, str]]:
    return [*_cuda_extension_rows(), _fast_row()]


def _cuda_extension_rows() -> list[tuple[str, str]]:
    from torch_flash import _build, _extension

    name = "CUDA extension torch_flash._C"
    if _extension.loaded():
        bi = _extension.build_info()
        return [
            (name, f"loaded ({_extension.path()})"),
            ("  archs", ", ".join(bi.get("archs", [])) or "?"),
            ("  head dims", ", ".join(map(str, bi.get("hdims", []))) or "none"),
            ("  CUDA / CUTLASS", f"{bi.get('cuda_version', '?')} / {bi.get('cutlass_version', '?')}"),
            ("  ops with CUDA kernels", ", ".join(bi.get("ops", [])) or "none"),
        ]
    if _extension.error():
        return [(name, f"failed to load: {_extension.error()}"),
                ("", "rebuild it for this torch: python -m torch_flash build")]
    if os.environ.get("TORCH_FLASH_EXTENSION") == "0":
        return [(name, "not loaded (TORCH_FLASH_EXTENSION=0)")]
    reason = _build.why_not()
    return [(name, f"not built ({reason}): Triton and reference paths" if reason else
             "not built: run python -m torch_flash build")]


def build(hdims: str | None, jobs: int | None, objects: str | None = None) -> int:
    """Compile torch_flash._C in place (editable or installed package), linking the kernel objects
    exported to `objects` that still match; 1 when it cannot be built."""
    import subprocess

    from torch_flash import _build

    reason = _build.why_not()
    try:
        if reason:
            raise _build.BuildError(reason)
        spec = _build.spec(hdims, origin="--hdims" if hdims else "FLASH_HDIMS")
    except (_build.BuildError, ValueError) as e:
        print(f"python -m torch_flash build: cannot build the CUDA extension here: {e}", file=sys.stderr)
        return 1
    print(spec.describe())
    print(f"  build dir {_build.build_dir(spec)}" + (f", {jobs} jobs" if jobs else ""), flush=True)
    try:
        target = _build.build(spec, jobs, objects=objects)
    except Exception as e:  # the compiler's own output is above
        print(f"python -m torch_flash build: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    # load it in a fresh process: this one may already hold the previous build
    probe = ("import torch_flash, torch_flash._extension as e; "
             "print(e.build_info() if e.loaded() else 'failed to load: ' + str(e.error()))")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FLASH_EXTENSION"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    ok = out.returncode == 0 and not out.stdout.startswith("failed")
    # a kernel whose signature does not match its op's schema aborts the import: show why
    result = out.stdout.strip() if out.returncode == 0 else "\n".join(out.stderr.splitlines()[:8])
    print(f"built {target}\n{result}")
    from torch_flash import _extension
    fast = _extension.load_fast()  # compiles it where it is not yet
    print("eager fast path: " + ("ready" if fast is not None else f"unavailable ({_extension.fast_error()})"))
    return 0 if ok else 1


SIZE_FLAGS = ("batch", "seq", "layers", "dim")  # demo model sizes a user may override


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m torch_flash")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="what is available: extension, Triton, interpreter, versions, ops")
    b = sub.add_parser("build", help="compile the CUDA extension torch_flash._C in place "
                       "(needs a CUDA build of torch, nvcc and nvidia-cutlass)")
    b.add_argument("--hdims", help="comma list of head dims to build (overrides FLASH_HDIMS; default 64,128,256)")
    b.add_argument("--jobs", type=int, help="parallel compile jobs (MAX_JOBS; default: all cores)")
    b.add_argument("--objects", metavar="DIR", help="link the kernel objects compiled ahead into DIR "
                   "(python torch_flash/_build.py --export-objects DIR) where they still match")
    d = sub.add_parser("demo", help="a LLaMA-style model compiled with the flash backend: explain report, "
                       "numerics against eager, training step time against torch.compile")
    d.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    d.add_argument("--ops", action="store_true", help="first check every public op against float64")
    d.add_argument("--json", metavar="PATH", help="write the numbers (device, versions, date, step ms, "
                   "peak bytes, ratios) to PATH")
    d.add_argument("--steps", type=int, help="timed training steps (default 10 on CUDA, 3 on CPU)")
    for field in SIZE_FLAGS:
        d.add_argument(f"--{field}", type=int, help=f"override the model's {field} (default by device)")
    sub.add_parser("bench", add_help=False, help="the benchmarks: python -m torch_flash bench SUITE ... "
                   "(the same as python -m torch_flash.bench; SUITE --help for more)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # everything after it is the bench's own command line
        from torch_flash.bench.__main__ import main as bench
        bench(argv[1:])
        return
    args = p.parse_args(argv)
    if args.cmd == "info":
        info()
    elif args.cmd == "build":
        raise SystemExit(build(args.hdims, args.jobs, args.objects))
    else:
        from torch_flash._demo import main as demo
        sizes = {f: getattr(args, f) for f in SIZE_FLAGS if getattr(args, f)}
        raise SystemExit(demo(args.device, ops=args.ops, json_path=args.json, steps=args.steps, sizes=sizes))


if __name__ == "__main__":
    main()
