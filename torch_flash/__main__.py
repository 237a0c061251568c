"""python -m torch_flash info | demo"""
from __future__ import annotations

import argparse
import os
import platform


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
        ("CUDA extension torch_flash._C", "loaded" if _dispatch.extension_loaded() else
         "not built (pure-Python install: Triton and reference paths)"),
        ("TORCH_FLASH_BACKEND", os.environ.get("TORCH_FLASH_BACKEND") or "unset (per-call choice)"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("\nops (torch.ops.flash.*):")
    for e in OPS:
        back = f"backward {e.backward}" if e.backward else "inference only"
        mut = f", mutates {', '.join(e.mutates)}" if e.mutates else ""
        print(f"  {e.name:<22} {e.family:<9} {back}{mut}")


SIZE_FLAGS = ("batch", "seq", "layers", "dim")  # demo model sizes a user may override


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m torch_flash")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="what is available: extension, Triton, interpreter, versions, ops")
    d = sub.add_parser("demo", help="a LLaMA-style model compiled with the flash backend: explain report, "
                       "numerics against eager, training step time against torch.compile")
    d.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    d.add_argument("--ops", action="store_true", help="first check every public op against float64")
    d.add_argument("--json", metavar="PATH", help="write the numbers (device, versions, date, step ms, "
                   "peak bytes, ratios) to PATH")
    d.add_argument("--steps", type=int, help="timed training steps (default 10 on CUDA, 3 on CPU)")
    for field in SIZE_FLAGS:
        d.add_argument(f"--{field}", type=int, help=f"override the model's {field} (default by device)")
    args = p.parse_args(argv)
    if args.cmd == "info":
        info()
    else:
        from torch_flash._demo import main as demo
        sizes = {f: getattr(args, f) for f in SIZE_FLAGS if getattr(args, f)}
        raise SystemExit(demo(args.device, ops=args.ops, json_path=args.json, steps=args.steps, sizes=sizes))


if __name__ == "__main__":
    main()
