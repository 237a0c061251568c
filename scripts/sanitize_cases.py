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


def _attention_sample(op: str, device: str):
    """The attention ops' opcheck samples have head dim 8, below the Triton kernels' 16 (only
    the reference path serves them): a bf16 call at head dim 32 instead, causal with a window
    (cuDNN takes no window, so the Triton backward runs), GQA, Sq != Sk."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, torch.bfloat16)
    flags = dict(scale=None, causal=True, window_left=24, window_right=-1, softcap=0.0, dropout_p=0.0)
    if op.startswith("attention_varlen"):
        q, k, v = rand(40, 4, 32), rand(56, 2, 32), rand(56, 2, 32)
        cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=device) for c in ([0, 17, 40], [0, 25, 56]))
        if op == "attention_varlen":
            return [q, k, v, cu_q, cu_k, 23, 31], {name: flags[name] for name in ("causal", "window_left")}
        out, lse = torch.ops.flash.attention_varlen(q, k, v, cu_q, cu_k, 23, 31, causal=True, window_left=24)
        return [torch.randn_like(out), None, q, k, v, cu_q, cu_k, 23, 31, out, lse, *flags.values(), None], {}
    q, k, v = rand(2, 4, 40, 32), rand(2, 2, 56, 32), rand(2, 2, 56, 32)
    if op in ("attention", "attention_with_lse"):
        return [q, k, v], {name: flags[name] for name in ("causal", "window_left")}
    out, lse = torch.ops.flash.attention_with_lse(q, k, v, causal=True, window_left=24)
    return [torch.randn_like(out), None, q, k, v, None, out, lse, *flags.values(), None, False], {}


# ops whose opcheck samples no kernel serves: _attention_sample's calls instead
_ATTENTION_OPS = frozenset({"attention", "attention_with_lse", "attention_varlen", "attention_backward",
                            "attention_varlen_backward"})


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
        sample = (_attention_sample(op, args.device) if op in _ATTENTION_OPS
                  else _sample(op, stem, args.device))
        if sample is None:
            print(f"{op:36s} no sample without float64", flush=True)
            failed += 1
            continue
        try:
            with torch.no_grad():
                getattr(torch.ops.flash, op)(*sample[0], **sample[1])
            if args.device == "cuda":
                torch.cuda.synchronize()
            path = _path(op)
            print(f"{op:36s} ran ({path})", flush=True)
            if args.device == "cuda" and path == "reference":  # no kernel ran under the tool
                print(f"{op:36s} FAILED: only the reference path ran", flush=True)
                failed += 1
        except Exception as e:  # reported: the kernel did not run under the sanitizer
            print(f"{op:36s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            failed += 1
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main())
