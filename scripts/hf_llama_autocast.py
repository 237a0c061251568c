"""HF LlamaForCausalLM (fp32 weights) under bf16 autocast on the GPU: a training step
(forward + backward) through plain torch.compile (Inductor), the flash backend, and the flash
backend without the rotary family (what the pass did before it retyped autocast's fp32 rotary
output: attention left unfused). Each backend compiles and is timed in turn: median wall time
of 20 steps, GPU kernel time from torch.profiler over 5, peak memory, and the relative error of
the loss and of all parameter gradients (one vector) against eager in fp32 without autocast.
Needs transformers.
Usage: python scripts/hf_llama_autocast.py OUT.json [--hidden H --heads N --kv-heads K]
[--backends NAME ...] (defaults: the run in docs/results/hf_llama_autocast, head dim 64 with GQA; the backend
"flash, no attention family" leaves SDPA to PyTorch; "flash, Triton" runs the flash ops on their
Triton kernels, torch_flash.use_backend("triton"), off the Hopper and cuDNN backwards).
"""
import argparse
import json
import statistics
import time

import torch
import transformers

import torch_flash
from torch_flash.bench._common import kernel_times

B, S = 4, 2048
CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096, use_cache=False,
              attn_implementation="sdpa")
BACKENDS = {"inductor": "inductor", "flash": "flash",
            "flash, Triton": "flash",
            "flash, no rotary family": torch_flash.backend(ops=["attention", "norm", "loss"]),
            "flash, no attention family": torch_flash.backend(ops=["rotary", "norm", "loss"])}
# the backend a configuration's flash ops run on (traced into its graph)
FORCED = {"flash, Triton": "triton"}
# every backend traces afresh: the compile caches do not key on the forced backend, and "flash,
# Triton" would get the graph "flash" traced with the default backends
torch._functorch.config.enable_autograd_cache = False
torch._inductor.config.fx_graph_cache = False
DEFAULT_BACKENDS = ["inductor", "flash", "flash, no rotary family"]


def flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten().double() for p in model.parameters()])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def measure(model, ids, backend, reference) -> dict:
    torch._dynamo.reset()
    torch_flash.counters.clear()
    fn = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss, backend=backend)

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(ids)
        loss.backward()
        return loss

    t0 = time.perf_counter()
    loss = step()
    torch.cuda.synchronize()
    print(f"compiled in {time.perf_counter() - t0:.1f} s; rewrites {dict(torch_flash.counters)}", flush=True)
    errors = dict(loss_err=rel(loss, reference[0]), grad_err=rel(flat_grads(model), reference[1]))
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = []
    for _ in range(20):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
    kernels = kernel_times(step, 5)
    top = sorted(kernels, key=lambda k: -k[1])[:8]
    return dict(rewrites=dict(torch_flash.counters), **errors, step_ms=statistics.median(ms),
                kernel_ms=sum(k_ms for _, k_ms, _ in kernels),
                peak_gib=torch.cuda.max_memory_allocated() / 2**30, loss=loss.item(),
                top=[(name[:70], round(k_ms, 3)) for name, k_ms, _ in top])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--hidden", type=int, default=CONFIG["hidden_size"])
    p.add_argument("--heads", type=int, default=CONFIG["num_attention_heads"])
    p.add_argument("--kv-heads", type=int, default=CONFIG["num_key_value_heads"])
    p.add_argument("--backends", nargs="+", default=DEFAULT_BACKENDS, choices=list(BACKENDS))
    args = p.parse_args()
    config = dict(CONFIG, hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  intermediate_size=CONFIG["intermediate_size"] * args.hidden // CONFIG["hidden_size"])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).cuda()
    ids = torch.randint(0, config["vocab_size"], (B, S), device="cuda")
    out = {"env": {"torch": torch.__version__, "transformers": transformers.__version__,
                   "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
           "config": dict(config, batch=B, seq=S), "rows": []}
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    reference = (loss.detach(), flat_grads(model))
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    out["eager_autocast"] = dict(loss_err=rel(loss, reference[0]), grad_err=rel(flat_grads(model), reference[1]))
    print("eager autocast", out["eager_autocast"], flush=True)
    for name in args.backends:
        print(name, flush=True)
        with torch_flash.use_backend(FORCED.get(name)):
            row = dict(impl=name, **measure(model, ids, BACKENDS[name], reference))
        out["rows"].append(row)
        print(row, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
