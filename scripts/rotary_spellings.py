"""A bf16 attention block with Meta's complex rotary (torchtitan, Llama 4) or torchtune's real
pair products, then SDPA, on CUDA: eager, torch.compile (Inductor), the flash backend, and the
flash backend with the rotary family alone. Per variant the largest relative error over the
output and all gradients against the fp32 model in eager, and fwd+bwd ms in interleaved rounds.
The rotary spellings are the compile-pass tests' own (tests/compile_passes/models.py).
Usage: python scripts/rotary_spellings.py OUT.json
"""
import json
import sys

import torch
import torch.nn.functional as F

import torch_flash
from torch_flash.bench._common import median_or_none, median_ratio, time_rounds, out_dir

sys.path.insert(0, "tests/compile_passes")
from models import apply_rope_pairs, apply_rotary_emb  # noqa: E402

B, S, H, D = 4, 2048, 16, 128


class Block(torch.nn.Module):
    def __init__(self, style: str):
        super().__init__()
        self.style = style
        self.qkv = torch.nn.Linear(H * D, 3 * H * D, bias=False)
        self.o = torch.nn.Linear(H * D, H * D, bias=False)
        ang = torch.outer(torch.arange(S).float(), 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(ang), ang), persistent=False)
        self.register_buffer("rope_cache", torch.stack((ang.cos(), ang.sin()), -1), persistent=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, H, D).unbind(2)
        if self.style == "meta":
            q, k = apply_rotary_emb(q, k, self.freqs_cis[:s])
        else:
            q, k = apply_rope_pairs(q, self.rope_cache[:s]), apply_rope_pairs(k, self.rope_cache[:s])
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, s, d))


def outputs_and_grads(fn, model, x) -> list:
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = fn(x)
    y.float().square().mean().backward()
    return [y.detach().float()] + [p.grad.float() for p in model.parameters()] + [x.grad.float()]


def run(style: str) -> dict:
    torch.manual_seed(0)
    exact = Block(style).cuda()
    model = Block(style).cuda().to(torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in exact.state_dict().items()})
    model.freqs_cis, model.rope_cache = exact.freqs_cis, exact.rope_cache  # .to() dropped the imaginary part
    x = torch.randn(B, S, H * D, device="cuda")
    reference = outputs_and_grads(exact, exact, x)
    torch._dynamo.reset()
    fns = {"eager": model, "inductor": torch.compile(model), "flash": torch.compile(model, backend="flash"),
           "flash_rotary_only": torch.compile(model, backend=torch_flash.backend(ops=["rotary"]))}
    row = {"style": style}
    for name, fn in fns.items():
        got = outputs_and_grads(fn, model, x.to(torch.bfloat16))
        row[name + "_err"] = max(((g - r).norm() / r.norm()).item() for g, r in zip(got, reference))
    xb = x.to(torch.bfloat16).requires_grad_()
    times = time_rounds({k: (lambda f=f: f(xb).sum().backward()) for k, f in fns.items()}, rounds=5)
    for name in fns:
        row[name + "_ms"] = median_or_none(times[name])
    row["flash_vs_inductor"] = median_ratio(times["inductor"], times["flash"])
    row["rotary_only_vs_inductor"] = median_ratio(times["inductor"], times["flash_rotary_only"])
    return row


def main(path: str) -> None:
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [B, S, H, D], "rows": []}
    for style in ("meta", "torchtune"):
        out["rows"].append(run(style))
        print(out["rows"][-1], flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(out_dir(__doc__))
