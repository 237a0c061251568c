"""Small hand-written models in the spellings real code uses (LLaMA-style, Gemma, nanoGPT); the
LLaMA pieces are torch_flash.testing.llama's, the demo's model."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_flash
from torch_flash.testing import llama
from torch_flash.testing.llama import repeat_kv, rotate_half


class LlamaRMSNorm(llama.RMSNorm):  # transformers' LlamaRMSNorm, weights away from 1
    def __init__(self, d, eps=1e-6):
        super().__init__(d, eps)
        with torch.no_grad():
            self.weight.copy_(1 + 0.1 * torch.randn(d))


class GemmaRMSNorm(nn.Module):  # transformers' GemmaRMSNorm: (1 + w), product in fp32
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(0.1 * torch.randn(d)), eps

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class PlainRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.w, self.eps = nn.Parameter(torch.randn(d)), eps

    def forward(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps) * self.w


class LlamaBlock(nn.Module):
    """Pre-norm block with HF-LLaMA eager attention: GQA via repeat_kv, additive mask input,
    fp32 softmax, dropout; the residual add feeding the second norm."""

    def __init__(self, d=32, heads=4, kv_heads=2, norm=LlamaRMSNorm, attn="eager", p=0.0):
        super().__init__()
        self.h, self.kv, self.hd, self.attn, self.p = heads, kv_heads, d // heads, attn, p
        self.n1, self.n2 = norm(d), norm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp = nn.Linear(d, d)

    def forward(self, x, mask):
        b, s, _ = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, s, self.h, self.hd).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv, self.hd).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv, self.hd).transpose(1, 2)
        if self.attn == "sdpa":
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True,
                                               dropout_p=self.p if self.training else 0.0)
        else:
            k, v = repeat_kv(k, self.h // self.kv), repeat_kv(v, self.h // self.kv)
            w = torch.matmul(q, k.transpose(2, 3)) * self.hd ** -0.5
            w = w + mask
            w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            w = F.dropout(w, p=self.p, training=self.training)
            a = torch.matmul(w, v)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.n2(x))


class NanoGPTAttention(nn.Module):
    """nanoGPT's manual attention: masked_fill of a registered causal buffer, divide by sqrt(d)."""

    def __init__(self, d=32, heads=4, block=16):
        super().__init__()
        self.h = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (k.size(-1) ** 0.5)
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


def causal_additive_mask(b, s, dtype=torch.float32):
    return torch.triu(torch.full((s, s), float("-inf"), dtype=dtype), 1)[None, None].expand(b, 1, s, s)


class HandLayerNorm(nn.Module):
    """LayerNorm written out as models do: "var" (x.var(unbiased=False) and / sqrt, as TF
    ports), "mean" (((x - u) ** 2).mean() and rsqrt), "upcast" (fp32 statistics of a half
    x, cast back before the weight, as T5-era code)."""

    def __init__(self, d, eps=1e-5, style="var"):
        super().__init__()
        self.weight, self.bias = nn.Parameter(1 + 0.1 * torch.randn(d)), nn.Parameter(0.1 * torch.randn(d))
        self.eps, self.style = eps, style

    def forward(self, x):
        if self.style == "var":
            u, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
            return (x - u) / torch.sqrt(var + self.eps) * self.weight + self.bias
        if self.style == "mean":
            u = x.mean(-1, keepdim=True)
            s = ((x - u) ** 2).mean(-1, keepdim=True)
            return self.weight * ((x - u) * torch.rsqrt(s + self.eps)) + self.bias
        h = x.float()
        h = (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, keepdim=True, unbiased=False) + self.eps)
        return h.to(x.dtype) * self.weight + self.bias


class PreLNBlock(nn.Module):
    """GPT-2-style pre-norm residual block: the second norm reads the residual sum."""

    def __init__(self, d=32, norm=nn.LayerNorm):
        super().__init__()
        self.ln1, self.ln2 = norm(d), norm(d)
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        x = x + self.fc1(self.ln1(x))
        return x + self.fc2(self.ln2(x))


class TinyCausalLM(nn.Module):
    """Embedding and lm-head with the loss spellings of real code: "hf" (transformers' upcast,
    label shift and view(-1, V)), "nll" (log_softmax + nll_loss), "lse" (logsumexp - gather),
    "transposed" (F.cross_entropy on (B, V, S)). return_logits keeps the logits alive; tied
    reuses the embedding as the lm-head (h @ E.t(), GPT-2)."""

    def __init__(self, vocab=37, d=16, loss="hf", bias=False, return_logits=False, label_smoothing=0.0,
                 tied=False):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab, bias=bias)
        self.loss, self.return_logits, self.smoothing, self.tied = loss, return_logits, label_smoothing, tied

    def forward(self, ids, labels):
        h = torch.tanh(self.emb(ids))
        logits = h @ self.emb.weight.t() if self.tied else self.head(h)
        v = logits.shape[-1]
        if self.loss == "hf":
            lg = logits.float()
            loss = F.cross_entropy(lg[..., :-1, :].contiguous().view(-1, v), labels[..., 1:].contiguous().view(-1),
                                   ignore_index=-100, label_smoothing=self.smoothing)
        elif self.loss == "nll":
            loss = F.nll_loss(F.log_softmax(logits, dim=-1).view(-1, v), labels.view(-1), reduction="sum")
        elif self.loss == "lse":
            picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            loss = (torch.logsumexp(logits, dim=-1) - picked).mean()
        else:
            loss = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        return (loss, logits) if self.return_logits else loss


def rotate_every_two(x):  # transformers' GPT-J rotate_every_two
    x1, x2 = x[:, :, :, ::2], x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_emb(xq, xk, freqs_cis):  # Meta's LLaMA (also torchtitan): complex pairs
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])  # reshape_for_broadcast
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def apply_rope_pairs(x, rope_cache):  # torchtune's RotaryPositionalEmbeddings (gpt-fast alike)
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out = torch.stack([xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                         xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1]], -1)
    return x_out.flatten(3).type_as(x)


class RotaryQK(nn.Module):
    """q/k projections with RoPE as transformers writes it: "llama" (LlamaRotaryEmbedding
    with cat((freqs, freqs)), rotate_half, tables (B, 1, S, D)), "neox" (partial rotary:
    rotate x[..., :rd], pass the rest; an (S, rd) table), "gptj" (sin/cos table gathered by
    position, repeat_interleave, rotate_every_two on (B, S, H, D)); as Meta's LLaMA does,
    "meta" (a complex freqs_cis buffer, complex products on (B, S, H, D)); and as torchtune
    does, "torchtune" (the same products in real arithmetic, a (S, D/2, 2) cos/sin cache); as
    gpt-oss does, "gptoss" (the halves' products written out, (1, 1, S, D/2) tables).
    Returns q and k as (B, H, S, D)."""

    def __init__(self, d=32, heads=4, style="llama", partial=0.5):
        super().__init__()
        self.h, self.hd, self.style = heads, d // heads, style
        self.rd = self.hd if style in ("llama", "meta", "torchtune", "gptoss") else int(self.hd * partial)
        self.q, self.k = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.rd, 2, dtype=torch.int64).float() / self.rd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        angles = torch.outer(torch.arange(64, dtype=torch.float), inv_freq)
        self.register_buffer("embed_positions", torch.cat((angles.sin(), angles.cos()), 1), persistent=False)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)
        self.register_buffer("rope_cache", torch.stack((angles.cos(), angles.sin()), -1), persistent=False)

    def _cos_sin(self, x, position_ids):
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def forward(self, x, position_ids):
        b, s, _ = x.shape
        q, k = (p(x).view(b, s, self.h, self.hd) for p in (self.q, self.k))
        if self.style == "meta":
            return tuple(t.transpose(1, 2) for t in apply_rotary_emb(q, k, self.freqs_cis[:s]))
        if self.style == "torchtune":
            return tuple(apply_rope_pairs(t, self.rope_cache[:s]).transpose(1, 2) for t in (q, k))
        if self.style == "gptj":
            sin, cos = torch.split(self.embed_positions[position_ids], self.rd // 2, dim=-1)
            sin, cos = (torch.repeat_interleave(t[:, :, None, :], 2, 3).to(x.dtype) for t in (sin, cos))

            def rope(t):
                t_rot, t_pass = t[..., : self.rd], t[..., self.rd:]
                return torch.cat([t_rot * cos + rotate_every_two(t_rot) * sin, t_pass], dim=-1)
            return rope(q).transpose(1, 2), rope(k).transpose(1, 2)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.style == "gptoss":
            freqs = torch.outer(torch.arange(s, dtype=torch.float), self.inv_freq)
            cos, sin = (t[None, None].to(x.dtype) for t in (freqs.cos(), freqs.sin()))

            def halves(t):
                t1, t2 = torch.chunk(t, 2, dim=-1)
                return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1)
            return halves(q), halves(k)
        if self.style == "llama":
            cos, sin = (t.unsqueeze(1) for t in self._cos_sin(x, position_ids))
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        freqs = torch.outer(torch.arange(s, dtype=self.inv_freq.dtype), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)

        def rope(t):
            t_rot, t_pass = t[..., : self.rd], t[..., self.rd:]
            return torch.cat((t_rot * cos + rotate_half(t_rot) * sin, t_pass), dim=-1)
        return rope(q), rope(k)


def flash_calls(model, *args) -> list[tuple[str, dict, list]]:
    """(op, kwargs, dtypes of the tensor arguments) of each flash op in the graph the flash
    backend hands to Inductor."""
    calls = []

    def capture(gm, example_inputs):
        for n in gm.graph.nodes:
            if str(n.target).startswith("flash."):
                dtypes = [a.meta["val"].dtype for a in n.args if isinstance(a, torch.fx.Node)]
                calls.append((str(n.target), dict(n.kwargs), dtypes))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=torch_flash.backend(inner=capture))(*args)
    torch._dynamo.reset()
    return calls


def check_training(model, *args, atol=1e-5, rtol=1e-4, **compile_kwargs):
    """One forward/backward of model eagerly and compiled with the flash backend: the
    outputs and the parameter gradients must agree. Returns the compiled model."""
    compiled = torch.compile(model, backend="flash", **compile_kwargs)

    def step(fn):
        model.zero_grad()
        outs = fn(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        sum(o.float().square().mean() for o in outs).backward()
        return [o.detach() for o in outs], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (ref, ref_grads), (out, grads) = step(model), step(compiled)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=atol, rtol=rtol, msg=name)
    return compiled


class TokenFlatBlock(nn.Module):
    """A pre-norm block that runs its second half on (tokens, d), as OPT does: the residual sum
    reaches the second norm through a reshape. keep_sum also returns the sum itself, so the
    reshape is not its only reader. Branches end in dropout with p=0 (the identity, also in
    training), as HF models configured without dropout."""

    def __init__(self, d=32, norm=nn.LayerNorm, keep_sum=False):
        super().__init__()
        self.n1, self.n2 = norm(d), norm(d)
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)
        self.drop, self.keep_sum = nn.Dropout(0.0), keep_sum

    def forward(self, x):
        s = x + self.drop(self.fc1(self.n1(x)))
        flat = s.view(-1, s.shape[-1])
        out = (flat + self.drop(self.fc2(self.n2(flat)))).view(x.shape)
        return (out, s) if self.keep_sum else out
