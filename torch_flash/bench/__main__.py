"""python -m torch_flash.bench SUITE [--out DIR] [--quick] [--targets]   (also: python -m torch_flash bench)
python -m torch_flash.bench plot RESULTS.json [...]   (PNG beside each JSON, e.g. on a CPU machine)
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys

from ._common import write_json

SUITES = ("attention", "norm", "cross_entropy", "linear_cross_entropy", "rotary", "decode", "train")

DESCRIPTION = """\
Time a fused op against the strongest alternatives in the same process on the same inputs
(GPU; on CPU only a smoke run under TRITON_INTERPRET=1). Writes OUT/SUITE.json (device,
versions, date and one row per measurement) and a PNG plot of it where matplotlib is installed.

  python -m torch_flash.bench norm                   # ./bench_results/norm.json and .png
  python -m torch_flash.bench plot results.json ...  # a PNG beside each JSON file
"""

EPILOG = """\
Also reachable as `python -m torch_flash bench ...`. The committed results live in
docs/results/<suite>/<date>_<device>.json and are described in docs/perf.md.
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torch_flash.bench", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=SUITES + ("plot",), help="the op family to time, or 'plot'")
    p.add_argument("files", nargs="*", help="with 'plot': JSON files written by the bench")
    p.add_argument("--out", default="bench_results", help="folder for the JSON and PNG (default: ./bench_results)")
    p.add_argument("--quick", action="store_true", help="a few small shapes (smoke run)")
    p.add_argument("--targets", action="store_true",
                   help="attention: the Hopper forward's target points; linear_cross_entropy: "
                        "8192 x 4096 x 128256; each alone, in more rounds (SUITE_targets.json)")
    p.add_argument("--contexts", help="train: tokens a sequence, comma-separated (default: 4096,16384)")
    p.add_argument("--configs", help="train: configurations (see bench/train.py); norm: ops (rms_norm, "
                                     "layer_norm, add_rms_norm, add_layer_norm); attention: implementations "
                                     "(bench/attention.py IMPLS); comma-separated, default all")
    p.add_argument("--hdims", help="attention: head dims of the grid, comma-separated (default: 64,128)")
    p.add_argument("--gqa", type=int, default=1,
                   help="attention: query heads a K/V head (grouped-query attention; default: 1)")
    p.add_argument("--steps", type=int, help="train: timed steps a configuration (default: 10)")
    p.add_argument("--max-seconds", type=float,
                   help="all but train: start no grid point after this many seconds (the JSON then "
                        "holds the points timed so far)")
    return p


def plot_files(paths: list[str]) -> int:
    """Write PATH.png beside each PATH.json with its suite's plot; 0, or 1 if one could not be
    plotted (each reason printed)."""
    failed = 0
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        suite = data.get("suite")
        if suite not in SUITES:
            print(f"{path}: no plot for suite {suite!r} (plots exist for {', '.join(SUITES)})", file=sys.stderr)
            failed = 1
            continue
        png = os.path.splitext(path)[0] + ".png"
        importlib.import_module(f"torch_flash.bench.{suite}").plot(data, png)
        print(f"wrote {png}")
    return failed


def _needs_matplotlib() -> str | None:
    """None where matplotlib imports, else the message to print."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "plots need matplotlib (pip install matplotlib); the JSON holds every number without it"
    return None


def main(argv=None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.targets and args.suite not in ("attention", "linear_cross_entropy"):
        p.error("--targets is for the attention and linear_cross_entropy suites")
    if args.suite != "train" and (args.contexts or args.steps):
        p.error("--contexts and --steps are for the train suite")
    if args.suite not in ("train", "norm", "attention") and args.configs:
        p.error("--configs is for the train, norm and attention suites")
    if args.suite != "attention" and args.hdims:
        p.error("--hdims is for the attention suite")
    if args.gqa < 1 or (args.gqa > 1 and args.suite != "attention"):
        p.error("--gqa is a positive number of query heads a K/V head, for the attention suite")
    if args.suite == "train" and args.max_seconds is not None:
        p.error("--max-seconds is for the suites other than train (its --steps bounds it)")
    if args.suite == "plot":
        if not args.files:
            p.error("plot: name one or more JSON files written by the bench")
        missing = _needs_matplotlib()
        if missing:
            p.exit(2, f"{p.prog} plot: {missing}\n")
        if plot_files(args.files):
            p.exit(1)
        return
    if args.files:
        p.error(f"unexpected arguments after {args.suite}: {' '.join(args.files)}")
    import torch
    from torch_flash import _dispatch
    backend = contextlib.nullcontext()
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("no CUDA GPU here: the benchmarks time GPU kernels. For a smoke run of the code "
                    "on CPU (tiny shapes, meaningless times), set TRITON_INTERPRET=1")
        if _dispatch.forced_backend() is None:
            # on CPU the ops would take the plain-PyTorch reference path: run the Triton kernels
            backend = _dispatch.use_backend("triton")
    mod = importlib.import_module(f"torch_flash.bench.{args.suite}")
    # Launchers called outside a torch.library.triton_op go through wrap_triton's tracing
    # hook (a Python cost per launch that hid the kernels' own time); the ops themselves
    # already launch directly, so time the launchers the same way.
    from torch._library.triton import set_wrap_triton_enabled
    with set_wrap_triton_enabled(False), backend:
        rows = mod.run(args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.suite}{'_targets' if args.targets else ''}.json")
    write_json(path, args.suite, rows, mod.extra(args) if hasattr(mod, "extra") else None)
    missing = _needs_matplotlib()
    if missing:  # plot later, where matplotlib is installed
        print(f"no plot: {missing}; later: python -m torch_flash.bench plot {path}")
    else:
        plot_files([path])


if __name__ == "__main__":
    main()
