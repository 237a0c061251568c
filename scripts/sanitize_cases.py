"""One small call of every flash op and backward op on CUDA, for scripts/sanitize.sh: per op the
first opcheck sample (torch_flash.testing.samples) without float64 tensors, which the kernels
serve, moved to the GPU. Prints one line per op; an op whose call raises is reported and counted
(exit status 1), since a sanitizer run that skipped a kernel proves nothing about it.

    python scripts/sanitize_cases.py [--only op,op,...] [--device cpu]   (cpu: a smoke run)
"""
from __future__ import annotations

import argparse
import sys

import torch

from torch_flash._registry import OPS, backward_ops
from torch_flash.testing import samples


def _sample(op: str, stem: str, device: str):
    """The first sample of op whose tensors are not float64 (those take the reference path),
    on device."""
    def to(a):
        return a.detach().to(device).requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
    for args, kwargs in samples.module(stem).OPCHECK_SAMPLES[op]():
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if all(t.dtype != torch.float64 for t in tensors):
            return [to(a) for a in args], {k: to(v) for k, v in kwargs.items()}
    return None


def _path(op: str) -> str:
    """The backend the op's last call took, where the op records one."""
    from torch_flash import _dispatch
    return str(_dispatch.LAST.get(op, "kernel"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated op names (default: every op)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    failed = 0
    for op, stem in [(e.name, e.stem) for e in OPS] + backward_ops():
        if only is not None and op not in only:
            continue
        sample = _sample(op, stem, args.device)
        if sample is None:
            print(f"{op:36s} no sample without float64", flush=True)
            failed += 1
            continue
        try:
            with torch.no_grad():
                getattr(torch.ops.flash, op)(*sample[0], **sample[1])
            if args.device == "cuda":
                torch.cuda.synchronize()
            print(f"{op:36s} ran ({_path(op)})", flush=True)
        except Exception as e:  # reported: the kernel did not run under the sanitizer
            print(f"{op:36s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            failed += 1
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main())
