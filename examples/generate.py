"""Greedy generation with a static KV cache: a LLaMA-style model with random weights.

    python examples/generate.py                        # GPU if there is one, else the tiny CPU run
    python examples/generate.py --device cpu           # tiny model, reference path, well under a minute
    python examples/generate.py --preset 1b --batch 8 --prompt-len 512 --new-tokens 256

The prompt is processed in one pass with flash.attention (causal), which also fills the caches
with its rotated keys and values; then each step feeds one token per sequence and runs
flash.attention_decode, which rotates q and the new k, appends k/v to the caches in place and
attends over them (cache_seqlens stays on the device: no host synchronisation per step). On
CUDA the step is compiled with torch.compile(mode="reduce-overhead"), i.e. replayed as a CUDA
graph; the caches are module buffers, so their addresses stay fixed. Prints prefill time and
decoding tokens per second; --check recomputes all logits in one causal pass and compares.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import torch_flash
from torch_flash.nn import RMSNorm, RotaryEmbedding


@dataclass
class Config:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    hidden: int  # MLP width
    rope_base: float = 500000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


PRESETS = {
    "tiny": Config(vocab=512, dim=128, layers=2, heads=4, kv_heads=2, hidden=256),
    "1b": Config(vocab=32000, dim=2048, layers=16, heads=32, kv_heads=8, hidden=8192),
    "8b": Config(vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8, hidden=14336),
}


class Attention(nn.Module):
    """Grouped-query self-attention with its own static caches (B, Hkv, max_seq, D)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, (cfg.heads + 2 * cfg.kv_heads) * d, bias=False)
        self.wo = nn.Linear(cfg.heads * d, cfg.dim, bias=False)
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def setup_cache(self, batch: int, max_seq: int, device, dtype) -> None:
        shape = (batch, self.cfg.kv_heads, max_seq, self.cfg.head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)

    def forward(self, x, rope: RotaryEmbedding, cache_seqlens, prefill: bool):
        B, S, _ = x.shape
        c, d = self.cfg, self.cfg.head_dim
        # (B, S, H * D) -> (B, H, S, D) views: the flash ops take any strides
        q, k, v = (t.unflatten(-1, (-1, d)).transpose(1, 2)
                   for t in self.wqkv(x).split((c.heads * d, c.kv_heads * d, c.kv_heads * d), -1))
        if prefill:  # the prompt starts every sequence at position 0
            q, k = rope(q, k)
            self.k_cache[:, :, :S].copy_(k)
            self.v_cache[:, :, :S].copy_(v)
            out = torch_flash.attention(q, k, v, causal=True)
        else:
            out, _ = torch_flash.attention_decode(q, self.k_cache, self.v_cache, cache_seqlens, k, v,
                                                  rotary_cos=rope.cos, rotary_sin=rope.sin)
        return self.wo(out.transpose(1, 2).flatten(-2))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.dim, cfg.eps), RMSNorm(cfg.dim, cfg.eps)
        self.attn = Attention(cfg)
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.hidden, bias=False)  # gate and up projections
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x, rope, cache_seqlens, prefill: bool):
        x = x + self.attn(self.attn_norm(x), rope, cache_seqlens, prefill)
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, -1)
        return x + self.w2(F.silu(gate) * up)


class Model(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, base=cfg.rope_base)
        self.register_buffer("cache_seqlens", None, persistent=False)

    def setup_cache(self, batch: int, max_seq: int) -> None:
        """Static caches for `batch` sequences of up to max_seq tokens, and the rotary tables."""
        p = self.lm_head.weight
        for layer in self.layers:
            layer.attn.setup_cache(batch, max_seq, p.device, p.dtype)
        self.rope.tables(max_seq, p.device, p.dtype)
        self.cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=p.device)

    def forward(self, tokens, prefill: bool = False):
        """tokens (B, S) -> logits (B, S, vocab). prefill: the prompt (resets the caches), else
        the next token(s) of every sequence, appended at cache_seqlens."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.rope, self.cache_seqlens, prefill)
        if prefill:
            self.cache_seqlens.fill_(tokens.shape[1])
        else:
            self.cache_seqlens.add_(tokens.shape[1])
        return self.lm_head(self.norm(x))


def decode_step(model: Model, token):
    """One greedy step: token (B, 1) -> (next token (B, 1), its logits (B, vocab))."""
    logits = model(token)[:, -1]
    return logits.argmax(-1, keepdim=True), logits


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", choices=PRESETS, default=None, help="model size (default: 1b on CUDA, tiny on CPU)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    p.add_argument("--no-compile", action="store_true", help="run the decoding step eagerly")
    p.add_argument("--check", action="store_true", help="compare with the logits of one causal pass")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    preset = args.preset or ("1b" if cuda else "tiny")
    batch = args.batch or (8 if cuda else 2)
    prompt_len = args.prompt_len or (512 if cuda else 16)
    new_tokens = args.new_tokens or (128 if cuda else 16)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    torch.manual_seed(args.seed)

    cfg = PRESETS[preset]
    model = Model(cfg).to(args.device, dtype).eval()
    model.setup_cache(batch, prompt_len + new_tokens)
    step = decode_step
    if cuda and not args.no_compile:
        step = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
    prompt = torch.randint(cfg.vocab, (batch, prompt_len), device=args.device)
    print(f"{preset}: {sum(t.numel() for t in model.parameters()) / 1e6:.1f}M parameters, {dtype}, "
          f"batch {batch}, prompt {prompt_len}, {new_tokens} new tokens on {args.device}"
          f"{' (compiled, CUDA graphs)' if step is not decode_step else ''}")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    with torch.no_grad():
        t0 = time.perf_counter()
        logits = model(prompt, prefill=True)[:, -1]
        token = logits.argmax(-1, keepdim=True)
        sync()
        prefill_s = time.perf_counter() - t0
        tokens, step_logits = [token], [logits]
        warmup = min(3, new_tokens - 1)  # compilation and CUDA-graph recording happen here
        for i in range(new_tokens - 1):
            if i == warmup:
                sync()
                t0 = time.perf_counter()
            if cuda:
                torch.compiler.cudagraph_mark_step_begin()
            token, logits = step(model, token)
            # a CUDA graph's outputs are overwritten by its next replay
            token, logits = token.clone(), logits.clone() if args.check else None
            tokens.append(token)
            step_logits.append(logits)
        sync()
        timed = new_tokens - 1 - warmup
        decode_s = time.perf_counter() - t0 if timed > 0 else float("nan")
    generated = torch.cat(tokens, 1)
    print(f"prefill: {prefill_s * 1e3:.1f} ms ({batch * prompt_len / prefill_s:.0f} tokens/s)")
    print(f"decode: {batch * timed / decode_s:.1f} tokens/s ({decode_s / max(timed, 1) * 1e3:.2f} ms per step, "
          f"{timed} timed steps after {warmup} warm-up)")
    print("first sequence:", generated[0, :16].tolist())
    if args.check:
        check(model, prompt, generated, torch.stack(step_logits, 1), dtype)


def check(model: Model, prompt, generated, decoded_logits, dtype) -> None:
    """Logits of every generated position from one causal pass over prompt + generated tokens
    against the ones decoding produced; raises if they differ beyond the dtype's tolerance."""
    full = torch.cat((prompt, generated[:, :-1]), 1)
    with torch.no_grad():
        want = model(full, prefill=True)[:, prompt.shape[1] - 1:].float()
    err = ((decoded_logits.float() - want).norm() / want.norm()).item()
    same = (want.argmax(-1) == generated).float().mean().item()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    print(f"check: relative error of the decoded logits {err:.2e} (tolerance {tol:.0e}), "
          f"greedy tokens agree at {same:.1%} of positions")
    if not err <= tol:
        raise SystemExit("check failed: decoding disagrees with the full causal pass")


if __name__ == "__main__":
    main()
