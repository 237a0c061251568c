"""A whole training step of HF LlamaForCausalLM (forward, loss, backward, AdamW step), bf16:
`python -m torch_flash.bench train [--contexts 4096,16384] [--configs a,b] [--steps N]`.

Model: transformers' LlamaForCausalLM, 8 layers, hidden 2048, 16 heads / 8 kv heads (D=128),
FFN 8192, vocab 128256 (untied lm-head), bf16 weights, AdamW (fused). Contexts: 2 x 4096 and
1 x 16384 tokens per step. Configurations (CONFIGS), each on a fresh model built from the same
seed (so the same weights) and the same random token batches:

  sdpa_uncompiled  attn_implementation="sdpa", no torch.compile (the reference loss)
  sdpa_flash       "sdpa" under torch.compile(model, backend="flash")
  sdpa_compile     "sdpa" under plain torch.compile(model) (Inductor)
  lce_flash        torch_flash's use_linear_cross_entropy(model) under backend="flash"
  liger_compile    Liger-Kernel's apply_liger_kernel_to_llama (RoPE, RMSNorm, SwiGLU, fused
                   linear cross-entropy) under plain torch.compile, where liger_kernel imports
  eager_flash      attn_implementation="eager" (scores materialised) under backend="flash"
  eager_compile    "eager" under plain torch.compile

Per configuration: WARMUP steps (compiling; their times are warmup_step_s, their sum warmup_s),
then STEPS timed steps, each synchronised: step_ms is their median; tokens_per_s = tokens /
step time; peak_bytes = torch.cuda.max_memory_allocated over the timed steps (weights, gradients,
optimizer state and activations; peak_warmup_bytes: over the warm-up, compiling and autotuning
included; a failed configuration's peak_bytes: since its start or its warm-up); mfu = model
FLOPs per step / step time / the card's dense bf16 peak (PEAK_TFLOPS; null for other devices). Model FLOPs =
6 x matmul parameters (every nn.Linear, the lm-head included, the embedding not) x tokens +
attention 4*B*H*S*S*D per layer, halved for causal, x 3.5 for forward and backward (the
attention bench's convention: backward 2.5x the forward); eager attention counts the same
model FLOPs as SDPA. first_loss (step 1, before any update) is compared with the reference
configuration's (sdpa_uncompiled where it ran): loss_rel_diff, loss_agrees (LOSS_TOL).

A configuration that fails (OOM: 16k tokens with eager attention keeps an S x S score tensor
per layer and head for the backward, 8.6 GB a layer; a compile error, e.g. Liger's RMSNorm under
some torch releases) gets a row with status "failed", its error and the phase it failed in; the
suite goes on. Between configurations everything is freed (models, optimizer, Dynamo's caches).
OUT/train.json is rewritten after every configuration, so a run cut short keeps its rows; a run
given --contexts keeps the rows of the other contexts in an OUT/train.json of the same device,
model and step counts (each row's `started` says when it ran), so the contexts can be run as
separate commands into one file.

On CPU (TRITON_INTERPRET=1, a smoke run): a tiny model (1 layer, hidden 64, vocab 512, 2 x 64
tokens, fp32), 2 + 2 steps, configurations QUICK_CONFIGS, the flash ops on their reference path
(the Triton interpreter cannot run inside an Inductor-compiled graph). --quick on a GPU: 2 layers
of the full width, 2 x 4096 tokens, 2 + 3 steps.
Rows: {context, batch, seq, tokens, config, attention, compile, patch, status, error, oom,
first_loss, loss_rel_diff, loss_agrees, losses, warmup_step_s, warmup_s, step_ms, step_ms_all,
tokens_per_s, flops_per_step, tflops, mfu, peak_bytes, peak_warmup_bytes, rewrites, graph_breaks,
warnings, started, kernel_ms, kernel_top}. On a GPU, one more step after the timed ones runs under
torch.profiler: kernel_ms is its GPU time by kernel kind (KERNEL_KINDS), kernel_top its 12
longest kernels [name, ms, kind].
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import io
import os
import statistics
import sys
import time
import warnings
from typing import Callable, Optional

import torch

from ._common import kernel_times, pick, write_json

SEED = 0


@dataclasses.dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    dtype: torch.dtype

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def matmul_params(self) -> int:
        """Weights of every nn.Linear: q, k, v, o, gate, up, down per layer, and the lm-head."""
        d = self.head_dim
        attn = self.hidden * self.heads * d * 2 + self.hidden * self.kv_heads * d * 2
        mlp = 3 * self.hidden * self.ffn
        return self.layers * (attn + mlp) + self.hidden * self.vocab

    def flops_per_step(self, batch: int, seq: int) -> float:
        """Model FLOPs of a training step: 6 x matmul parameters x tokens, plus causal attention
        (forward 4*B*H*S*S*D halved, backward 2.5x the forward)."""
        attention = 4 * batch * self.heads * seq * seq * self.head_dim * 0.5 * 3.5
        return 6 * self.matmul_params() * batch * seq + self.layers * attention

    def as_json(self) -> dict:
        return {**dataclasses.asdict(self), "dtype": str(self.dtype).removeprefix("torch.")}


FULL = Model(layers=8, hidden=2048, heads=16, kv_heads=8, ffn=8192, vocab=128256, dtype=torch.bfloat16)
GPU_QUICK = dataclasses.replace(FULL, layers=2)
# one layer: a second adds no rewrite kind (the first norm reads the embedding, the others a residual
# sum either way) and a fifth of the cold Inductor build (25 C++ kernels where one layer has 18)
CPU_MODEL = Model(layers=1, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=512, dtype=torch.float32)

# context (tokens a sequence) -> (batch, seq)
CONTEXTS = {4096: (2, 4096), 16384: (1, 16384)}
GPU_QUICK_CONTEXTS = {4096: (2, 4096)}
CPU_CONTEXTS = {64: (2, 64)}

WARMUP, STEPS = 3, 10
QUICK_WARMUP, QUICK_STEPS = 2, 3
CPU_WARMUP, CPU_STEPS = 2, 2

# |first_loss - reference| / |reference| within which configurations agree
LOSS_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}

# dense bf16 tensor-core peak, TFLOP/s, by a device name's marker (no sparsity)
PEAK_TFLOPS = (("H100 80GB HBM3", 989.0), ("H100 SXM", 989.0), ("H200", 989.0))


def peak_tflops(device_name: str) -> Optional[float]:
    """The dense bf16 peak of the card named (H100 SXM, H200), None for any other device."""
    for marker, tflops in PEAK_TFLOPS:
        if marker in device_name:
            return tflops
    return None


@dataclasses.dataclass(frozen=True)
class Config:
    attention: str            # attn_implementation
    compile: Optional[str]    # "flash", "inductor" or None (not compiled)
    patch: Optional[str] = None  # a key of PATCHES, applied to the built model


CONFIGS = {
    "sdpa_uncompiled": Config("sdpa", None),
    "sdpa_flash": Config("sdpa", "flash"),
    "sdpa_compile": Config("sdpa", "inductor"),
    "lce_flash": Config("sdpa", "flash", "lce"),
    "liger_compile": Config("sdpa", "inductor", "liger"),
    "eager_flash": Config("eager", "flash"),
    "eager_compile": Config("eager", "inductor"),
}
QUICK_CONFIGS = ("sdpa_uncompiled", "sdpa_flash")  # eager attention through the pass: tests/compile_passes
REFERENCE = "sdpa_uncompiled"


def _liger(model) -> Callable[[], None]:
    """apply_liger_kernel_to_llama(model=model) with its defaults; returns the undo of what it
    patches module-wide (modeling_llama's RoPE function, RMSNorm and MLP classes), which later
    configurations' models would otherwise pick up."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    saved = dict(vars(modeling_llama))

    def undo():
        for name, value in list(vars(modeling_llama).items()):
            if name not in saved:
                delattr(modeling_llama, name)
            elif saved[name] is not value:
                setattr(modeling_llama, name, saved[name])

    try:
        apply_liger_kernel_to_llama(model=model)
    except BaseException:
        undo()
        raise
    return undo


def _lce(model) -> Callable[[], None]:
    from ..integrations.transformers import use_linear_cross_entropy
    use_linear_cross_entropy(model)
    return lambda: None


# name -> patch(model) -> undo(); a patch that raises fails its configuration
PATCHES: dict[str, Callable] = {"liger": _liger, "lce": _lce}


def _flash_backend():
    """"flash" as users name it (the package's entry point); the function itself when the
    package runs from a checkout that is not installed."""
    if "flash" in torch._dynamo.list_backends():
        return "flash"
    from ..compile_passes.backend import flash
    return flash


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _error(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:400] if lines else ''}"


def build_model(model: Model, attention: str, max_seq: int, device: str):
    """LlamaForCausalLM of `model`'s shape from SEED, in train mode, on device."""
    import transformers
    cfg = transformers.LlamaConfig(
        hidden_size=model.hidden, intermediate_size=model.ffn, num_hidden_layers=model.layers,
        num_attention_heads=model.heads, num_key_value_heads=model.kv_heads, vocab_size=model.vocab,
        max_position_embeddings=max_seq, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(SEED)
    with torch.device(device):
        m = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=attention, dtype=model.dtype)
    return m.train()


def _train_step(fn, opt, ids) -> torch.Tensor:
    loss = fn(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


# GPU kernels by what they do, first match of a lower-cased name (attention before matmul: the
# CUTLASS attention kernels carry "cutlass" too)
KERNEL_KINDS = (("attention", ("attn", "fmha", "flash", "attention", "sdpa")),
                ("matmul", ("gemm", "nvjet", "xmma", "cublas", "cutlass", "splitk")),
                ("optimizer", ("adam", "multi_tensor", "foreach")),
                ("loss", ("_ce_", "cross_entropy", "nll", "log_softmax", "target_summary", "_scale_kernel")),
                ("norm", ("norm",)), ("rotary", ("rotary", "rope")),
                ("inductor fused", ("triton_",)), ("copy / fill", ("memcpy", "memset", "copy", "fill")))


def _kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in low for m in marks)), "other")


def _kernel_profile(fn, opt, ids) -> dict:
    """GPU time of one more training step by kernel kind (ms; KERNEL_KINDS) and its 12 longest
    kernels, from torch.profiler: where a configuration's step goes."""
    kernels = [(name, ms) for name, ms, _ in kernel_times(lambda: _train_step(fn, opt, ids))]
    by_kind: dict[str, float] = {}
    for name, ms in kernels:
        by_kind[_kernel_kind(name)] = by_kind.get(_kernel_kind(name), 0.0) + ms
    top = sorted(kernels, key=lambda k: -k[1])[:12]
    return {"kernel_ms": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "kernel_top": [[name[:120], round(ms, 3), _kernel_kind(name)] for name, ms in top]}


def run_config(name: str, config: Config, model: Model, batches: torch.Tensor, warmup: int, device: str,
               peak: Optional[float], max_seq: int, context: int) -> dict:
    """One configuration's row (status "ok", or "failed" with the error and its phase)."""
    import torch_flash
    _, batch, seq = batches.shape
    tokens = batch * seq
    flops = model.flops_per_step(batch, seq)
    row = {"context": context, "batch": batch, "seq": seq, "tokens": tokens,
           "config": name, "attention": config.attention, "compile": config.compile, "patch": config.patch,
           "status": "failed", "error": None, "oom": False, "phase": None, "first_loss": None,
           "loss_rel_diff": None, "loss_agrees": None, "losses": [], "warmup_step_s": [], "warmup_s": None,
           "step_ms": None, "step_ms_all": [], "tokens_per_s": None, "flops_per_step": flops, "tflops": None,
           "mfu": None, "peak_bytes": None, "peak_warmup_bytes": None, "rewrites": {}, "graph_breaks": None,
           "warnings": [], "kernel_ms": None, "kernel_top": None}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch_flash.counters.clear()
    torch._dynamo.utils.counters.clear()
    undo = lambda: None  # noqa: E731
    phase = "build"
    try:
        m = build_model(model, config.attention, max_seq, device)
        if config.patch is not None:
            phase = "patch"
            undo = PATCHES[config.patch](m)
        phase = "build"
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=device == "cuda")
        if config.compile == "flash":
            fn = torch.compile(m, backend=_flash_backend())
        elif config.compile == "inductor":
            fn = torch.compile(m)
        else:
            fn = m
        losses = []
        phase = "warm-up"
        print(f"  warm-up ({warmup} steps{', compiling' if config.compile else ''}) ...", flush=True)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for i in range(warmup):
                    t0 = time.perf_counter()
                    losses.append(_train_step(fn, opt, batches[i]))
                    _sync(device)
                    row["warmup_step_s"].append(time.perf_counter() - t0)
        finally:
            for w in caught:  # still shown; the flash backend's fallbacks recorded
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
            row["warnings"] = [str(w.message)[:400] for w in caught if str(w.message).startswith("torch_flash")]
        if device == "cuda":  # compiling and autotuning apart from the training steps' memory
            row["peak_warmup_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        row["warmup_s"] = sum(row["warmup_step_s"])
        row["first_loss"] = losses[0].item()
        print(f"  warm-up {row['warmup_s']:.1f} s (first step {row['warmup_step_s'][0]:.1f} s), "
              f"first loss {row['first_loss']:.5f}", flush=True)
        phase = "timed"
        for i in range(warmup, batches.shape[0]):
            t0 = time.perf_counter()
            losses.append(_train_step(fn, opt, batches[i]))
            _sync(device)
            row["step_ms_all"].append((time.perf_counter() - t0) * 1e3)
        row["losses"] = [loss.item() for loss in losses]
        row["step_ms"] = statistics.median(row["step_ms_all"])
        row["tokens_per_s"] = tokens / (row["step_ms"] * 1e-3)
        row["tflops"] = flops / (row["step_ms"] * 1e-3) / 1e12
        row["mfu"] = None if peak is None else row["tflops"] / peak
        if device == "cuda":
            phase = "profile"
            row.update(_kernel_profile(fn, opt, batches[-1]))
        row["status"], phase = "ok", None
    except Exception as e:  # OOM, a compile error: recorded, the suite goes on
        row["error"] = _error(e)
        row["oom"] = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        print(f"  FAILED in {phase}: {row['error']}", file=sys.stderr, flush=True)
    finally:
        undo()
    row["phase"] = phase
    if device == "cuda":
        row["peak_bytes"] = torch.cuda.max_memory_allocated()
    row["rewrites"] = dict(torch_flash.counters)
    row["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    return row


def _setup(args):
    """(device, model, contexts {context: (batch, seq)}, warmup, steps, configs, max_seq)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        model, contexts, warmup, steps, default = CPU_MODEL, CPU_CONTEXTS, CPU_WARMUP, CPU_STEPS, QUICK_CONFIGS
    elif args.quick:
        model, contexts, warmup, steps, default = GPU_QUICK, GPU_QUICK_CONTEXTS, QUICK_WARMUP, QUICK_STEPS, None
    else:
        model, contexts, warmup, steps, default = FULL, CONTEXTS, WARMUP, STEPS, None
    steps = getattr(args, "steps", None) or steps
    max_seq = max(seq for _, seq in contexts.values())  # the model's, whichever contexts run
    contexts = {c: contexts[c] for c in pick("train", getattr(args, "contexts", None), contexts, "context")}
    spec = getattr(args, "configs", None)
    configs = pick("train", spec, CONFIGS, "configuration") if spec or default is None else list(default)
    return device, model, contexts, warmup, steps, configs, max_seq


def extra(args) -> dict:
    """Run-wide keys of train.json: the model, step counts, peak and versions."""
    device, model, contexts, warmup, steps, configs, max_seq = _setup(args)
    out = {"model": model.as_json(), "matmul_params": model.matmul_params(), "warmup": warmup, "steps": steps,
           "optimizer": "AdamW(lr=1e-4" + (", fused=True)" if device == "cuda" else ")"),
           "peak_tflops": peak_tflops(torch.cuda.get_device_name()) if device == "cuda" else None,
           "reference": REFERENCE}
    try:
        import transformers
        import torch_flash
        out["versions"] = {"transformers": transformers.__version__, "torch_flash": torch_flash.__version__}
    except ImportError:
        pass
    return out


def _compare_losses(rows: list[dict], tol: float) -> None:
    """loss_rel_diff / loss_agrees of one context's rows against the reference configuration's
    first loss (the first row that ran where the reference did not)."""
    ran = [r for r in rows if r["first_loss"] is not None]
    ref = next((r for r in ran if r["config"] == REFERENCE), ran[0] if ran else None)
    for r in ran:
        r["loss_rel_diff"] = abs(r["first_loss"] - ref["first_loss"]) / abs(ref["first_loss"])
        r["loss_agrees"] = r["loss_rel_diff"] <= tol
        if not r["loss_agrees"]:
            print(f"  loss of {r['config']} ({r['first_loss']:.5f}) differs from {ref['config']}'s "
                  f"({ref['first_loss']:.5f}) by {r['loss_rel_diff']:.2e} > {tol:g}", file=sys.stderr)


def _kept_rows(path: str, model: Model, warmup: int, steps: int, contexts: dict) -> list[dict]:
    """The rows of other contexts in an earlier train.json at path, where it comes from this
    device with the same model and step counts: a run of one context (--contexts) adds to a run
    of the other, within a device session's limit on one command."""
    import json

    from ._common import env_info
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return []
    same = (data.get("suite") == "train" and data.get("env", {}).get("device") == env_info()["device"]
            and data.get("model") == model.as_json() and (data.get("warmup"), data.get("steps")) == (warmup, steps))
    kept = [r for r in data.get("rows", []) if r.get("context") not in contexts] if same else []
    if kept:
        print(f"keeping {len(kept)} rows of context {', '.join(sorted({str(r['context']) for r in kept}))} "
              f"from {path} (run {data['env'].get('date')})", flush=True)
    return kept


def run(args) -> list[dict]:
    import transformers  # noqa: F401  (the suite needs it: fail before any work)
    from torch._library.triton import set_wrap_triton_enabled

    from .. import _dispatch

    device, model, contexts, warmup, steps, configs, max_seq = _setup(args)
    peak = peak_tflops(torch.cuda.get_device_name()) if device == "cuda" else None
    out = getattr(args, "out", None)
    # CPU: the flash ops' reference path (main() forces the Triton interpreter, which cannot run
    # inside a graph Inductor compiled); a GPU keeps the per-call choice (or TORCH_FLASH_BACKEND)
    backend = _dispatch.use_backend(None) if device == "cpu" else contextlib.nullcontext()
    print(f"LlamaForCausalLM {model.layers} layers, hidden {model.hidden}, {model.heads}/{model.kv_heads} heads, "
          f"FFN {model.ffn}, vocab {model.vocab}, {model.as_json()['dtype']}; {model.matmul_params() / 1e6:.0f}M "
          f"matmul parameters; {warmup} warm-up + {steps} timed steps; peak "
          f"{'unknown' if peak is None else f'{peak:g} TFLOP/s'}", flush=True)
    path = os.path.join(out, "train.json") if out else None
    kept = _kept_rows(path, model, warmup, steps, contexts) if path and getattr(args, "contexts", None) else []
    rows: list[dict] = []
    t_start = time.perf_counter()
    n, i = len(contexts) * len(configs), 0
    # main() turns wrap_triton's tracing hook off for the launchers the other suites time; a
    # compiler tracing a triton_op into its kernels needs it on (the default a training run has)
    with backend, set_wrap_triton_enabled(True):
        for context, (batch, seq) in contexts.items():
            gen = torch.Generator().manual_seed(SEED)
            batches = torch.randint(0, model.vocab, (warmup + steps, batch, seq), generator=gen).to(device)
            ctx_rows = []
            for name in configs:
                i += 1
                print(f"[{i}/{n}] {batch} x {seq} tokens, {name} ({time.perf_counter() - t_start:.0f} s in)",
                      flush=True)
                _free(device)
                started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
                row = run_config(name, CONFIGS[name], model, batches, warmup, device, peak, max_seq, context)
                row["started"] = started
                _free(device)
                ctx_rows.append(row)
                rows.append(row)
                _compare_losses(ctx_rows, LOSS_TOL.get(model.dtype, 2e-2))
                if row["status"] == "ok":
                    mem = "" if row["peak_bytes"] is None else f", peak {row['peak_bytes'] / 2**30:.1f} GiB"
                    mfu = "" if row["mfu"] is None else f", MFU {row['mfu']:.3f}"
                    print(f"  {row['step_ms']:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s, "
                          f"{row['tflops']:.1f} TFLOP/s{mfu}{mem}; loss diff {row['loss_rel_diff']:.1e}", flush=True)
                if path:  # a run cut short keeps the configurations done
                    os.makedirs(out, exist_ok=True)
                    with contextlib.redirect_stdout(io.StringIO()):
                        write_json(path, "train", _in_order(kept + rows), extra(args))
            del batches
    print(f"train: {len(rows)} rows in {time.perf_counter() - t_start:.0f} s", flush=True)
    return _in_order(kept + rows)


def _in_order(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: r["context"])  # stable: configurations in run order


def plot(data: dict, path: str) -> None:
    """Tokens/s and peak memory per configuration, one column of panels per context; failed
    configurations marked with their reason."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    contexts = list(dict.fromkeys((r["batch"], r["seq"]) for r in rows))
    fig, axes = plt.subplots(2, len(contexts), figsize=(6 * len(contexts), 7), squeeze=False)
    for col, (batch, seq) in enumerate(contexts):
        sub = [r for r in rows if (r["batch"], r["seq"]) == (batch, seq)]
        names = [r["config"] for r in sub]
        for ax, key, scale, label in ((axes[0][col], "tokens_per_s", 1e3, "k tokens/s"),
                                      (axes[1][col], "peak_bytes", 2**30, "peak memory, GiB")):
            vals = [(r[key] or 0.0) / scale if r["status"] == "ok" else 0.0 for r in sub]
            bars = ax.bar(range(len(sub)), vals, color=["C1" if "flash" in n else "C0" for n in names])
            for bar, r, v in zip(bars, sub, vals):
                if r["status"] != "ok":
                    text = "OOM" if r["oom"] else "failed"
                elif r[key] is None:
                    text = "n/a"
                elif key == "tokens_per_s" and r["mfu"] is not None:
                    text = f"MFU {r['mfu']:.2f}"
                else:
                    text = f"{v:.3g}"
                ax.annotate(text, (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
            ax.set_xticks(range(len(sub)), names, fontsize=8, rotation=30, ha="right")
            ax.set_ylabel(label)
            ax.set_title(f"{batch} x {seq} tokens")
    fig.suptitle(f"training step, LlamaForCausalLM, on {data['env']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("run: python -m torch_flash.bench train")
