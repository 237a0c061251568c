"""HF LlamaForCausalLM with a Llama-3 vocabulary (128256) on the GPU: a training step (forward +
backward, no optimizer) with transformers' own loss, with
`torch_flash.integrations.transformers.use_linear_cross_entropy`, with Liger-Kernel's fused
linear cross-entropy (`apply_liger_kernel_to_llama(model=...)`, its other kernels off), and, with
--compile, the whole model under torch.compile (Inductor) and the patched model under the flash
backend. Two precisions: bf16 weights, and fp32 weights under bf16 autocast. One model per
implementation, same weights and batch; rounds interleaved. Per implementation: median step
time, peak memory above what is allocated before the step (the parameters), and the relative
error of the loss and of the lm-head and embedding gradients against eager fp32 without autocast.
Needs transformers; Liger-Kernel when installed.
Usage: python scripts/hf_lce.py OUT.json [--layers N] [--rounds R] [--compile]
"""
import argparse
import copy
import importlib.metadata
import json
import statistics
import time

import torch
import transformers

import torch_flash
from torch_flash.integrations.transformers import use_linear_cross_entropy

B, S = 4, 2048
CONFIG = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=8,
              vocab_size=128256, max_position_embeddings=4096, tie_word_embeddings=False, use_cache=False)
CHECKED = ("lm_head.weight", "model.embed_tokens.weight")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def liger(model):
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    apply_liger_kernel_to_llama(rope=False, cross_entropy=False, fused_linear_cross_entropy=True,
                                rms_norm=False, swiglu=False, model=model)
    return model


def implementations(model, compiled: bool) -> dict:
    """name -> callable(ids) -> loss, each on its own copy of the model."""
    def step_fn(m):
        return lambda ids: m(input_ids=ids, labels=ids).loss

    impls = {"transformers": (model, step_fn(model))}
    flash = use_linear_cross_entropy(copy.deepcopy(model))
    impls["flash"] = (flash, step_fn(flash))
    try:
        lg = liger(copy.deepcopy(model))
        impls["liger"] = (lg, step_fn(lg))
    except ImportError as e:
        print("Liger-Kernel not installed:", e, flush=True)
    if compiled:
        impls["torch.compile"] = (model, torch.compile(step_fn(model)))
        impls["flash backend"] = (flash, torch.compile(step_fn(flash), backend="flash"))
    return impls


def run(precision: str, layers: int, rounds: int, compiled: bool, reference) -> dict:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, num_hidden_layers=layers))
    model.load_state_dict(reference["state"])
    model = model.to("cuda", torch.bfloat16 if precision == "bf16" else torch.float32).train()
    ids = reference["ids"]
    impls = implementations(model, compiled)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision != "bf16")

    def step(name):
        m, fn = impls[name]
        m.zero_grad(set_to_none=True)
        with autocast:
            loss = fn(ids)
        loss.backward()
        return loss

    rows = {}
    for name, (m, _) in impls.items():
        t0 = time.perf_counter()
        loss = step(name)  # compiles, first
        torch.cuda.synchronize()
        grads = dict(m.named_parameters())
        rows[name] = dict(first_step_s=time.perf_counter() - t0, loss_err=rel(loss, reference["loss"]),
                          **{f"grad_err {n}": rel(grads[n].grad, reference["grads"][n]) for n in CHECKED})
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(name)
        torch.cuda.synchronize()
        rows[name]["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        print(precision, name, rows[name], flush=True)
    times = {name: [] for name in impls}
    for r in range(rounds):
        for name in impls:
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(name)
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - t0) * 1e3)
        print(f"{precision} round {r + 1}/{rounds}", {n: round(statistics.median(t), 2) for n, t in times.items()},
              flush=True)
    for name in impls:  # x_transformers: speed-up over transformers' own loss
        rows[name]["step_ms"] = statistics.median(times[name])
        rows[name]["x_transformers"] = statistics.median(times["transformers"]) / rows[name]["step_ms"]
    return [dict(impl=name, **row) for name, row in rows.items()]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, num_hidden_layers=args.layers))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model = model.cuda().train()
    ids = torch.randint(0, CONFIG["vocab_size"], (B, S), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    params = dict(model.named_parameters())
    reference = dict(state=state, ids=ids, loss=loss.detach(), grads={n: params[n].grad for n in CHECKED})
    del model, params
    torch.cuda.empty_cache()
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "torch_flash": torch_flash.__version__}
    try:
        versions["liger_kernel"] = importlib.metadata.version("liger_kernel")
    except importlib.metadata.PackageNotFoundError:
        pass
    out = {"env": dict(versions, device=torch.cuda.get_device_name(),
                       date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
           "config": dict(CONFIG, num_hidden_layers=args.layers, batch=B, seq=S, rounds=args.rounds,
                          steps_per_round=5),
           "reference": "eager fp32, transformers' loss, no autocast", "rows": {}}
    for precision in ("bf16", "fp32 weights, bf16 autocast"):
        out["rows"][precision] = run(precision, args.layers, args.rounds, args.compile, reference)
        torch.cuda.empty_cache()  # the models of run() are gone
        with open(args.out, "w") as f:  # after each precision: a run cut short keeps the first
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
