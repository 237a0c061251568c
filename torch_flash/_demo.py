"""`python -m torch_flash demo`: an unmodified LLaMA-style model, compiled with the flash backend.

The model (torch_flash.testing.llama) is written the way model code spells it by hand
(RMSNorm with an fp32 upcast, rotary embeddings via rotate_half, GQA via repeat_kv, causal
attention as matmul + masked_fill + softmax, SwiGLU MLP, lm head + F.cross_entropy);
nothing in it names a flash op. The demo

1. prints `torch_flash.explain`: every site the compile pass found, rewritten or why not;
2. checks the loss and every parameter's gradient of `torch.compile(model, backend="flash")`
   against eager in a wider dtype (float64 on CPU, float32 on CUDA) by relative error, next
   to the same errors of eager and plain torch.compile in the model's dtype, and fails
   beyond tolerance;
3. times a training step (forward + backward; the optimizer step is the same for both and
   left out) of the flash backend against plain `torch.compile` (Inductor): median of
   several steps after warm-up, and on CUDA the peak memory of each.

Sizes by device (flags override them): CPU a tiny fp32 model on the ops' CPU path, about a
minute on 2 cores, most of it Inductor compiling the two models on a cold cache; CUDA a
d=1024, 8-layer, bf16 model (155M parameters) on 8 x 2048 tokens. `--ops` first checks
every public op on its own against a float64 reference. `--json PATH` writes the numbers.
"""
from __future__ import annotations

import copy
import datetime
import json
import platform
import statistics
import time
import warnings
from dataclasses import asdict, replace
from typing import Callable

import torch
import torch.nn as nn

import torch_flash
from torch_flash import _dispatch
from torch_flash._registry import OPS
from torch_flash.testing.llama import Config, LlamaLM

# ------------------------------------------------------------------------------ sizes

SIZES = {
    # one layer: a second adds no rewrite kind (the first norm reads the embedding, the others a
    # residual sum either way) and 10 of the 41 C++ kernels Inductor builds cold for the two compiles
    "cpu": Config(vocab=512, dim=64, layers=1, heads=4, kv_heads=2, ffn=160, batch=2, seq=64,
                  dtype=torch.float32),
    "cuda": Config(vocab=32000, dim=1024, layers=8, heads=8, kv_heads=2, ffn=2816, batch=8, seq=2048,
                   dtype=torch.bfloat16),
}


# ----------------------------------------------------------------------- shared helpers


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| over the finite entries of b; NaN when a and b disagree on which are finite."""
    a, b = a.double(), b.double()
    ok = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), ok):
        return float("nan")
    return ((a - b)[ok].norm() / b[ok].norm().clamp_min(1e-300)).item()


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _step(model: nn.Module, fn: Callable, ids, targets) -> torch.Tensor:
    """One training step of fn (model or a compiled form of it): fresh gradients, loss.backward()."""
    model.zero_grad(set_to_none=True)
    loss = fn(ids, targets)
    loss.backward()
    return loss.detach()


def _flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.double().flatten() for p in model.parameters()])


# ------------------------------------------------------------------------------ sections


def _section(title: str) -> None:
    print(f"\n== {title}", flush=True)


def check_against_eager(model: nn.Module, variants: dict[str, Callable], ids, targets,
                        ref_dtype: torch.dtype, tol: float) -> tuple[dict, bool]:
    """Loss and gradient errors of each variant against eager in ref_dtype. The flash
    variant passes within tol, or within twice the error of eager in the model's own dtype
    (the bar docs/design.md sets: no worse than PyTorch's own low-precision path)."""
    ref_model = copy.deepcopy(model).to(ref_dtype)
    ref_loss = _step(ref_model, ref_model, ids, targets)
    ref_grads = _flat_grads(ref_model)
    del ref_model
    errors = {}
    print(f"{'':<16}{'loss':>14}{'loss err':>11}{'grad err':>11}   (vs eager in {str(ref_dtype)[6:]})")
    for name, fn in variants.items():
        loss = _step(model, fn, ids, targets)
        errors[name] = {"loss": loss.item(), "loss_err": _rel(loss, ref_loss),
                        "grad_err": _rel(_flat_grads(model), ref_grads)}
        e = errors[name]
        print(f"{name:<16}{e['loss']:14.6f}{e['loss_err']:11.2e}{e['grad_err']:11.2e}", flush=True)
    model.zero_grad(set_to_none=True)
    bar = max(tol, *(2 * errors["eager"][k] for k in ("loss_err", "grad_err")))
    flash = errors["flash"]
    ok = all(flash[k] <= bar for k in ("loss_err", "grad_err"))  # False on NaN too
    print(f"flash backend {'within' if ok else 'OUT OF'} tolerance ({bar:.1e})")
    return errors, ok


def time_steps(model: nn.Module, fn: Callable, ids, targets, dev: str, steps: int,
               warmup: int = 2) -> tuple[float, int | None]:
    """(median step ms, peak bytes allocated during the timed steps, None on CPU)."""
    for _ in range(warmup):
        _step(model, fn, ids, targets)
    _sync(dev)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _step(model, fn, ids, targets)
        _sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    model.zero_grad(set_to_none=True)
    return statistics.median(times), torch.cuda.max_memory_allocated() if dev == "cuda" else None


def _flash_backend():
    """"flash", as users name it (the entry point of an installed package); the same
    function when the package runs from a checkout without an install."""
    from torch_flash.compile_passes.backend import flash

    return "flash" if "flash" in torch._dynamo.list_backends() else flash


def _versions() -> dict:
    out = {"torch_flash": torch_flash.__version__, "torch": torch.__version__,
           "python": platform.python_version(), "cuda": torch.version.cuda}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def explain_sites(model: nn.Module, ids, targets) -> tuple[dict, bool]:
    """Prints torch_flash.explain; ({rewritten, total, ops: {flash.<op>: count}}, all rewritten)."""
    _section("torch_flash.explain(model, ids, targets)")
    t0 = time.perf_counter()
    report = torch_flash.explain(model, ids, targets)
    print(report)
    print(f"({time.perf_counter() - t0:.1f} s)")
    sites = {"rewritten": sum(s.rewritten for s in report.sites), "total": len(report.sites),
             "ops": dict(report.counters())}
    ok = sites["total"] > 0 and sites["rewritten"] == sites["total"]
    if not ok:
        print(f"NOT every site was rewritten: {sites['rewritten']}/{sites['total']}")
    return sites, ok


def compile_both(model: nn.Module, ids, targets, dev: str, explained: dict) -> tuple[Callable, Callable, bool]:
    """(flash-compiled, plain-compiled, whether the flash backend compiled the rewrites that
    explain reported). The backend falls back to the unmodified graph with a warning rather
    than fail a user's compile; here that counts as a failure."""
    _section("compile: torch.compile(model, backend='flash') and plain torch.compile(model)")
    flash, inductor = torch.compile(model, backend=_flash_backend()), torch.compile(model)

    def first_step(name: str, fn: Callable) -> None:
        t0 = time.perf_counter()
        _step(model, fn, ids, targets)
        _sync(dev)
        print(f"{name:<16}compiled and ran one step in {time.perf_counter() - t0:.1f} s", flush=True)

    torch_flash.counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first_step("flash", flash)
    for w in caught:  # still shown
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    first_step("torch.compile", inductor)
    fell_back = [str(w.message) for w in caught if str(w.message).startswith("torch_flash")]
    ok = not fell_back and dict(torch_flash.counters) == explained
    if not ok:
        print(f"the flash backend did NOT compile the rewritten model: rewrites {dict(torch_flash.counters)}"
              + "".join(f"; {m}" for m in fell_back))
    return flash, inductor, ok


def compare_steps(model: nn.Module, variants: dict[str, Callable], ids, targets, dev: str,
                  steps: int) -> dict:
    """Times each variant's training step; {name: {step_ms, peak_bytes}}, ratios printed."""
    _section(f"training step (forward + backward), median of {steps} after warm-up")
    timing = {}
    for name, fn in variants.items():
        ms, peak = time_steps(model, fn, ids, targets, dev, steps)
        timing[name] = {"step_ms": ms, "peak_bytes": peak}
        mem = f"   peak {peak / 2**30:.2f} GiB" if peak is not None else ""
        print(f"{name:<16}{ms:10.2f} ms{mem}", flush=True)
    flash, base = timing["flash"], timing["torch.compile"]
    line = f"flash backend: {base['step_ms'] / flash['step_ms']:.2f}x the speed of torch.compile"
    if dev == "cuda":
        line += f", {flash['peak_bytes'] / base['peak_bytes']:.2f}x its peak memory"
    else:
        line += " (CPU: the ops' reference path, not a performance number)"
    print(line)
    return timing


def run_model(dev: str, cfg: Config, steps: int) -> tuple[dict, bool]:
    """The model demo; (numbers for --json, passed)."""
    torch.manual_seed(0)
    _section(f"model: LLaMA-style, d={cfg.dim}, {cfg.layers} layers, {cfg.heads} heads "
             f"({cfg.kv_heads} kv), ffn {cfg.ffn}, vocab {cfg.vocab}; batch {cfg.batch} x seq "
             f"{cfg.seq}, {str(cfg.dtype)[6:]} on {dev}")
    model = LlamaLM(cfg).to(device=dev, dtype=cfg.dtype)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.1f}M parameters", flush=True)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), device=dev)
    targets = torch.roll(ids, -1, 1)

    sites, all_rewritten = explain_sites(model, ids, targets)
    flash, inductor, sites["compiled_as_explained"] = compile_both(model, ids, targets, dev, sites["ops"])
    _section("numerics: loss and all parameter gradients")
    errors, numerics_ok = check_against_eager(
        model, {"eager": model, "torch.compile": inductor, "flash": flash}, ids, targets,
        ref_dtype=torch.float64 if dev == "cpu" else torch.float32,
        tol=1e-4 if cfg.dtype == torch.float32 else 2e-2)
    timing = compare_steps(model, {"flash": flash, "torch.compile": inductor}, ids, targets, dev, steps)
    step_ms = {k: v["step_ms"] for k, v in timing.items()}
    peak = {k: v["peak_bytes"] for k, v in timing.items()}
    results = {
        "config": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in asdict(cfg).items()},
        "parameters": params, "sites": sites, "errors": errors, "numerics_ok": numerics_ok,
        "step_ms": step_ms, "peak_bytes": peak,
        "speedup": step_ms["torch.compile"] / step_ms["flash"],
        "memory_ratio": peak["flash"] / peak["torch.compile"] if dev == "cuda" else None,
    }
    return results, numerics_ok and all_rewritten and sites["compiled_as_explained"]


# --------------------------------------------------------- --ops: each op against float64


def _op_cases(dev: str, dt: torch.dtype) -> dict[str, tuple[Callable, dict]]:
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
        "rotary_qk": (lambda q, k: torch_flash.ops.rotary.rotary_qk(q, k, cos, sin),
                      dict(q=r(2, 8, 128, 64), k=r(2, 2, 128, 64))),
    }


def _run_op(fn, tensors: dict, grad: bool):
    leaves = {k: v.detach().clone().requires_grad_(grad and v.is_floating_point()) for k, v in tensors.items()}
    out = fn(**leaves)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.is_floating_point()]
    grads = []
    if grad:
        torch.manual_seed(1)
        seeds = [torch.randn_like(o.float()).to(o.dtype) for o in outs]
        torch.autograd.backward(outs, seeds)
        grads = [v.grad for v in leaves.values() if v.requires_grad]
    return outs, grads


def check_ops(dev: str) -> tuple[dict, bool]:
    """Every public op on small random inputs (bf16 on a GPU, fp32 on CPU) against the same
    call in float64 on the reference path: path taken, output and gradient errors, time."""
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    tol = 2e-2 if dt == torch.bfloat16 else 1e-4
    torch.manual_seed(0)
    cases = _op_cases(dev, dt)
    _section(f"ops on {dev} ({str(dt)[6:]}) against float64 on the reference path")
    print(f"{'op':<22}{'path':<11}{'fwd err':>10}{'grad err':>10}{'ms':>9}  ok")
    results, all_ok = {}, True
    for entry in (e for e in OPS if e.public):  # internal ops run inside their public op
        if entry.name not in cases:
            print(f"{entry.name:<22}(no case in the demo yet)")
            continue
        fn, tensors = cases[entry.name]
        grad = entry.backward is not None
        _dispatch.LAST.clear()
        t0 = time.perf_counter()
        outs, grads = _run_op(fn, tensors, grad)
        _sync(dev)
        ms = (time.perf_counter() - t0) * 1e3
        path = "/".join(sorted(set(_dispatch.LAST.values())))  # forward and backward ops
        with torch_flash.use_backend("reference"):
            ref_outs, ref_grads = _run_op(fn, {k: v.double() if v.is_floating_point() else v
                                               for k, v in tensors.items()}, grad)
        fwd = max(_rel(a, b) for a, b in zip(outs, ref_outs))
        bwd = max((_rel(a, b) for a, b in zip(grads, ref_grads)), default=0.0)
        ok = fwd <= tol and bwd <= tol
        all_ok &= ok
        results[entry.name] = {"path": path, "fwd_err": fwd, "grad_err": bwd if grad else None, "ms": ms}
        gtxt = f"{bwd:10.2e}" if grad else f"{'-':>10}"
        print(f"{entry.name:<22}{path:<11}{fwd:10.2e}{gtxt}{ms:9.2f}  {'yes' if ok else 'NO'}")
    print("all ops agree with the reference" if all_ok else "some ops are out of tolerance")
    return results, all_ok


# --------------------------------------------------------------------------------- main


def main(device: str | None = None, ops: bool = False, json_path: str | None = None,
         steps: int | None = None, sizes: dict | None = None) -> int:
    """The demo; returns the exit status (0 when every check passed). sizes overrides
    fields of the device's Config (batch, seq, layers, dim, ...)."""
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = replace(SIZES["cuda" if dev == "cuda" else "cpu"], **(sizes or {}))
    steps = steps or (10 if dev == "cuda" else 3)
    name = torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or platform.machine()
    print(f"torch-flash {torch_flash.__version__} demo on {dev} ({name}), torch {torch.__version__}")
    out = {"device": dev, "device_name": name, "versions": _versions(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    ok = True
    if ops:
        out["ops"], ops_ok = check_ops(dev)
        ok &= ops_ok
    model_results, model_ok = run_model(dev, cfg, steps)
    out.update(model_results)
    ok &= model_ok
    out["ok"] = ok
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"\nwrote {json_path}")
    print("\ndemo passed" if ok else "\ndemo FAILED (see above)")
    return 0 if ok else 1
