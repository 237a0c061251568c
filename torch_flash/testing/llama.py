"""A LLaMA-style model written the way model code spells it by hand (HF transformers'
LlamaRMSNorm with its fp32 upcast, rotary embeddings via rotate_half, GQA via repeat_kv,
causal attention as matmul + masked_fill + softmax, SwiGLU MLP, lm head + F.cross_entropy);
nothing in it names a flash op. The demo trains it, the compile-pass tests and the benches
use its pieces as the naive code the fused ops replace."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Config:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    batch: int
    seq: int
    dtype: torch.dtype
    eps: float = 1e-6
    rope_theta: float = 10000.0


def rms_norm(x, weight, eps: float):
    """transformers' LlamaRMSNorm.forward: statistics in fp32, cast back before the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rotate_half(x):  # transformers' rotate_half
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def repeat_kv(x, n: int):  # transformers' repeat_kv
    """(B, Hkv, S, D) -> (B, Hkv * n, S, D), each kv head shared by n query heads."""
    b, h, s, d = x.shape
    return x if n == 1 else x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.dim // c.heads
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = (repeat_kv(t, self.heads // self.kv_heads) for t in (k, v))
        scores = torch.matmul(q, k.transpose(2, 3)) * self.head_dim ** -0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.gate = nn.Linear(c.dim, c.ffn, bias=False)
        self.up = nn.Linear(c.dim, c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(c.dim, c.eps), Attention(c)
        self.mlp_norm, self.mlp = RMSNorm(c.dim, c.eps), MLP(c)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class LlamaLM(nn.Module):
    """ids (B, S), targets (B, S) -> mean next-token cross-entropy."""

    def __init__(self, c: Config):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim, c.eps)
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)
        self.head_dim, self.rope_theta = c.dim // c.heads, c.rope_theta

    def forward(self, ids, targets):
        x = self.embed(ids)
        # rotary angles in fp32 whatever the model's dtype (a buffer would follow .to(dtype))
        f32 = dict(device=ids.device, dtype=torch.float32)
        inv_freq = self.rope_theta ** -(torch.arange(0, self.head_dim, 2, **f32) / self.head_dim)
        freqs = torch.outer(torch.arange(ids.shape[1], **f32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
