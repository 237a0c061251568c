"""Run FlashAttention's own test files against torch_flash.compat, and count the results per test
function.

The test files come from a FlashAttention checkout the developer fetched (never committed here):

    git clone --depth 1 https://github.com/Dao-AILab/flash-attention /tmp/fa
    TORCH_FLASH_AUTOTUNE=0 python scripts/fa_suite.py /tmp/fa/tests/test_flash_attn.py \\
        /tmp/fa/tests/test_rotary.py /tmp/fa/tests/ops/triton/test_layer_norm.py \\
        /tmp/fa/tests/losses/test_cross_entropy.py --values 2 --sample 500 --summary fa_suite.md -- -x

TORCH_FLASH_AUTOTUNE=0 keeps the Triton attention kernels from autotuning afresh for the shapes
of nearly every test.

`import flash_attn` in them resolves to torch_flash.testing.fa_shim (torch_flash.compat under
FlashAttention's module names); the real flash_attn must not be importable first. --values N
keeps N values of every parametrize (test_flash_attn.py alone takes minutes to collect in full),
--sample N then runs a random sample of N collected tests (--seed fixes both); arguments after
`--` go to pytest. The summary (stdout, and --summary FILE as Markdown, rewritten after every
test) lists passed / failed / skipped per test function, with the skip reasons and each
failure's first error line. Without a GPU the files are collected and imported, and every test
is skipped. `-- -n 8` spreads the tests over pytest-xdist workers: one process ran about one
test in 7 s on the H200 machine, most of it compiling Triton kernels for the test's variant.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import sys

import pytest


# how main() tells every process's Selection what to keep: "sample,seed,values"
SELECT_ENV = "FA_SUITE_SELECT"


class Selection:
    """pytest plugin: --values, then --sample. Every process that collects needs it (the
    workers of pytest-xdist collect for themselves): main() hands it over in FA_SUITE_SELECT,
    which pytest_configure below reads where `-p fa_suite` loads this module."""

    def __init__(self, sample: int | None, seed: int, values: int | None = None):
        self.sample, self.seed, self.values = sample, seed, values
        self.rng = random.Random(seed)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_generate_tests(self, metafunc):
        """With --values N: each parametrize keeps N of its values, drawn by the seed. FlashAttention's
        test_flash_attn.py multiplies out to so many cases that collecting them all takes minutes."""
        if self.values:
            parametrize = metafunc.parametrize

            def sampled(argnames, argvalues, *args, ids=None, **kwargs):
                argvalues = list(argvalues)
                if len(argvalues) > self.values:
                    keep = sorted(self.rng.sample(range(len(argvalues)), self.values))
                    argvalues = [argvalues[i] for i in keep]
                    ids = [ids[i] for i in keep] if isinstance(ids, (list, tuple)) else ids
                return parametrize(argnames, argvalues, *args, ids=ids, **kwargs)
            metafunc.parametrize = sampled
        yield

    def pytest_collection_modifyitems(self, config, items):
        if self.sample is not None and self.sample < len(items):
            keep = set(random.Random(self.seed).sample(range(len(items)), self.sample))
            config.hook.pytest_deselected(items=[t for i, t in enumerate(items) if i not in keep])
            items[:] = [t for i, t in enumerate(items) if i in keep]


def pytest_configure(config):
    select = os.environ.get(SELECT_ENV)
    if select:
        sample, seed, values = (int(x) if x else None for x in select.split(","))
        config.pluginmanager.register(Selection(sample, seed, values), "fa_suite_selection")


class Summary:
    """pytest plugin: outcomes per test function (written to `path` after every test, so a run
    cut off by a time limit still leaves its counts); in the process that reports (under
    pytest-xdist the controller)."""

    def __init__(self, path: str | None = None):
        self.path = path
        self.counts = collections.defaultdict(collections.Counter)  # function -> outcome -> n
        self.reasons = collections.defaultdict(collections.Counter)  # function -> skip reason / error -> n

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and not (report.failed or report.skipped):
            return
        function = report.nodeid.split("[")[0]
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.counts[function]["skipped"] += 1
            self.reasons[function][reason.removeprefix("Skipped: ")] += 1
        elif report.failed:
            self.counts[function]["failed"] += 1
            self.reasons[function][_first_error(report)] += 1
        else:
            self.counts[function]["passed"] += 1
        if self.path:
            with open(self.path, "w") as f:
                f.write(self.markdown())

    def markdown(self) -> str:
        total = collections.Counter()
        lines = ["| test function | passed | failed | skipped |", "|---|---:|---:|---:|"]
        for function in sorted(self.counts):
            c = self.counts[function]
            total.update(c)
            lines.append(f"| {function} | {c['passed']} | {c['failed']} | {c['skipped']} |")
        lines.append(f"| **total** | {total['passed']} | {total['failed']} | {total['skipped']} |")
        for function in sorted(self.reasons):
            for reason, n in self.reasons[function].most_common():
                lines.append(f"- {function} ({n}x): {reason}")
        return "\n".join(lines) + "\n"


def _first_error(report) -> str:
    """The first `E ` line of a failure, or its last line."""
    text = str(report.longrepr)
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    return (errors[0] if errors else text.strip().splitlines()[-1])[:200]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="FlashAttention test files or directories")
    parser.add_argument("--sample", type=int, help="run a random sample of this many tests")
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample")
    parser.add_argument("--values", type=int,
                        help="keep this many values of each parametrize (drawn by --seed), before --sample")
    parser.add_argument("--summary", help="also write the per-function summary to this Markdown file")
    args = parser.parse_args(argv)
    for path in args.paths:
        if not os.path.exists(path):
            parser.error(f"no such file or directory: {path}")
    summary = Summary(args.summary)
    os.environ[SELECT_ENV] = ",".join("" if x is None else str(x) for x in (args.sample, args.seed, args.values))
    # `-p fa_suite` (this file, on this process's path as the script's folder) in the workers too
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))
    # -c os.devnull: FlashAttention's own pytest configuration and conftests of this repository
    # stay out; -p loads the shim before the test modules import flash_attn
    rc = pytest.main(["-c", os.devnull, "--rootdir", os.path.dirname(os.path.abspath(args.paths[0])),
                      "-p", "torch_flash.testing.fa_shim", "-p", "fa_suite", "-q", *extra, *args.paths],
                     plugins=[summary])
    text = summary.markdown()
    print(text)
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
