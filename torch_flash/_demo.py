"""`python -m torch_flash demo`: every op on the default device against a float64 reference.

Each op runs on small random inputs (bf16 on a GPU, fp32 on CPU); the same call in float64
on the reference path is the ground truth. The table shows the path each op took, the
relative error of its outputs and input gradients, and its time.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable

import torch

import torch_flash
from torch_flash import _dispatch
from torch_flash._registry import OPS


def _cases(dev: str, dt: torch.dtype) -> dict[str, tuple[Callable, dict]]:
    """op -> (fn(**tensors) -> output(s), tensors); float tensors get gradients where the op has a backward."""
    r = lambda *s: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
    cos, sin = torch_flash.rotary_cos_sin(256, 64, device=dev)
    tgt = torch.randint(0, 8000, (256,), device=dev)
    tgt[::7] = -100
    idx = dict(device=dev, dtype=torch.int32)
    return {
        "attention": (lambda q, k, v: torch_flash.attention(q, k, v, causal=True),
                      dict(q=r(2, 8, 128, 64), k=r(2, 2, 128, 64), v=r(2, 2, 128, 64))),
        "attention_with_lse": (lambda q, k, v: torch_flash.attention_with_lse(q, k, v, window=(32, 0)),
                               dict(q=r(2, 8, 96, 64), k=r(2, 2, 128, 64), v=r(2, 2, 128, 64))),
        "attention_varlen": (lambda q, k, v: torch_flash.attention_varlen(
            q, k, v, torch.tensor([0, 50, 128], **idx), torch.tensor([0, 50, 128], **idx), 78, 78, causal=True),
            dict(q=r(128, 8, 64), k=r(128, 2, 64), v=r(128, 2, 64))),
        "attention_decode": (lambda q, k_cache, v_cache, k_new, v_new: torch_flash.attention_decode(
            q, k_cache.clone(), v_cache.clone(), torch.tensor([100, 200], **idx), k_new, v_new),
            dict(q=r(2, 8, 1, 64), k_cache=r(2, 2, 256, 64), v_cache=r(2, 2, 256, 64),
                 k_new=r(2, 2, 1, 64), v_new=r(2, 2, 1, 64))),
        "rms_norm": (lambda x, w: torch_flash.rms_norm(x, w, 1e-6), dict(x=r(4, 128, 512), w=r(512))),
        "add_rms_norm": (lambda x, res, w: torch_flash.add_rms_norm(x, res, w, 1e-6),
                         dict(x=r(4, 128, 512), res=r(4, 128, 512), w=r(512))),
        "layer_norm": (lambda x, w, b: torch_flash.layer_norm(x, w, b), dict(x=r(4, 128, 512), w=r(512), b=r(512))),
        "add_layer_norm": (lambda x, res, w, b: torch_flash.add_layer_norm(x, res, w, b),
                           dict(x=r(4, 128, 512), res=r(4, 128, 512), w=r(512), b=r(512))),
        "cross_entropy": (lambda logits: torch_flash.cross_entropy(logits, tgt, label_smoothing=0.1),
                          dict(logits=r(256, 8000))),
        "linear_cross_entropy": (lambda h, w: torch_flash.linear_cross_entropy(h, w, tgt, z_loss=1e-4),
                                 dict(h=r(256, 256), w=r(8000, 256) * 0.05)),
        "rotary": (lambda x: torch_flash.rotary(x, cos, sin), dict(x=r(2, 8, 128, 64))),
    }


@contextmanager
def _backend(name: str | None):
    old = os.environ.get("TORCH_FLASH_BACKEND")
    if name is None:
        os.environ.pop("TORCH_FLASH_BACKEND", None)
    else:
        os.environ["TORCH_FLASH_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCH_FLASH_BACKEND", None)
        else:
            os.environ["TORCH_FLASH_BACKEND"] = old


def _run(fn, tensors: dict, grad: bool):
    leaves = {k: v.detach().clone().requires_grad_(grad and v.is_floating_point()) for k, v in tensors.items()}
    out = fn(**leaves)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.is_floating_point()]
    grads = []
    if grad:
        torch.manual_seed(1)
        seeds = [torch.randn_like(o.float()).to(o.dtype) for o in outs]
        torch.autograd.backward([o for o in outs], seeds)
        grads = [v.grad for v in leaves.values() if v.requires_grad]
    return outs, grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    ok = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), ok):
        return float("nan")
    return ((a - b)[ok].norm() / b[ok].norm().clamp_min(1e-300)).item()


def main(device: str | None = None) -> int:
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    tol = 2e-2 if dt == torch.bfloat16 else 1e-4
    torch.manual_seed(0)
    cases = _cases(dev, dt)
    print(f"torch-flash {torch_flash.__version__} demo on {dev} ({dt}); reference: float64 on the reference path")
    print(f"{'op':<22}{'path':<11}{'fwd err':>10}{'grad err':>10}{'ms':>9}  ok")
    failures = 0
    for entry in (e for e in OPS if e.public):  # internal ops run inside their public op
        fn, tensors = cases[entry.name]
        grad = entry.backward is not None
        _dispatch.LAST.clear()
        t0 = time.perf_counter()
        outs, grads = _run(fn, tensors, grad)
        if dev == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        path = "/".join(sorted(set(_dispatch.LAST.values())))  # forward and backward ops
        with _backend("reference"):
            ref_outs, ref_grads = _run(fn, {k: v.double() if v.is_floating_point() else v
                                            for k, v in tensors.items()}, grad)
        fwd = max(_rel(a, b) for a, b in zip(outs, ref_outs))
        bwd = max((_rel(a, b) for a, b in zip(grads, ref_grads)), default=0.0)
        ok = fwd <= tol and bwd <= tol
        failures += not ok
        gtxt = f"{bwd:10.2e}" if grad else f"{'-':>10}"
        print(f"{entry.name:<22}{path:<11}{fwd:10.2e}{gtxt}{ms:9.2f}  {'yes' if ok else 'NO'}")
    print("all ops agree with the reference" if not failures else f"{failures} op(s) out of tolerance")
    return 1 if failures else 0
