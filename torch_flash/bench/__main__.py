"""python -m torch_flash.bench <suite> [--out DIR] [--quick] [--targets]   (also: python -m torch_flash bench)
python -m torch_flash.bench plot <results.json> [...]   (PNG from saved JSON, e.g. on a CPU machine)
"""
from __future__ import annotations

import argparse
import importlib
import json
import os

from ._common import write_json

SUITES = ("attention", "norm", "cross_entropy", "linear_cross_entropy", "rotary", "decode")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torch_flash.bench")
    p.add_argument("suite", choices=SUITES + ("plot",))
    p.add_argument("files", nargs="*", help="JSON files to plot (suite 'plot')")
    p.add_argument("--out", default="bench_results", help="folder for the JSON and PNG (default ./bench_results; "
                   "the committed results in docs/perf are written only when asked for)")
    p.add_argument("--quick", action="store_true", help="a few small shapes (smoke run)")
    p.add_argument("--targets", action="store_true",
                   help="attention: the Hopper forward's target points; linear_cross_entropy: its target "
                        "point (8192 x 4096 x 128256); each alone, in more rounds (SUITE_targets.json)")
    return p


def main(argv=None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.targets and args.suite not in ("attention", "linear_cross_entropy"):
        p.error("--targets is for the attention and linear_cross_entropy suites")
    if args.suite == "plot":
        for path in args.files:
            with open(path) as f:
                data = json.load(f)
            mod = importlib.import_module(f"torch_flash.bench.{data['suite']}")
            mod.plot(data, os.path.splitext(path)[0] + ".png")
        return
    import torch
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("no CUDA GPU here: the benchmarks time GPU kernels. For a smoke run of the code "
                    "on CPU (tiny shapes, meaningless times), set TRITON_INTERPRET=1")
        # on CPU the ops would take the plain-PyTorch reference path: run the Triton kernels
        os.environ.setdefault("TORCH_FLASH_BACKEND", "triton")
    mod = importlib.import_module(f"torch_flash.bench.{args.suite}")
    # Launchers called outside a torch.library.triton_op go through wrap_triton's tracing
    # hook (a Python cost per launch that hid the kernels' own time); the ops themselves
    # already launch directly, so time the launchers the same way.
    from torch._library.triton import set_wrap_triton_enabled
    with set_wrap_triton_enabled(False):
        rows = mod.run(args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.suite}{'_targets' if args.targets else ''}.json")
    write_json(path, args.suite, rows)
    try:
        with open(path) as f:
            mod.plot(json.load(f), os.path.splitext(path)[0] + ".png")
    except ImportError as e:  # no matplotlib on this machine: plot later with `bench plot`
        print(f"no plot ({e}); run `python -m torch_flash.bench plot {path}` where matplotlib is installed")


if __name__ == "__main__":
    main()
