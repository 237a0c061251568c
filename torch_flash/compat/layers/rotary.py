"""flash_attn.layers.rotary over flash.rotary: apply_rotary_emb (and its in-place qkv / kv forms)
and RotaryEmbedding, with FlashAttention's signatures and (batch, seqlen, heads, headdim) layout.

As FlashAttention, inplace=True rotates x's storage even where x is a leaf that requires grad
(the rotation runs inside an autograd.Function); the backward rotates the gradient by the
inverse angles (sin negated).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from ...ops.rotary import rotary


def rotate_half(x: Tensor, interleaved: bool = False) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the halves (GPT-NeoX) or the pairs (2i, 2i + 1) (GPT-J)."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_emb_torch(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """The plain-PyTorch formula (FlashAttention's test reference): x (batch, seqlen, heads, headdim),
    cos/sin (seqlen, rotary_dim / 2) or (batch, seqlen, rotary_dim / 2)."""
    ro_dim = cos.shape[-1] * 2
    assert ro_dim <= x.shape[-1]
    cos, sin = (t.repeat_interleave(2, -1) if interleaved else torch.cat((t, t), -1) for t in (cos, sin))
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # over the heads
    x_ro = x[..., :ro_dim]
    return torch.cat((x_ro * cos + rotate_half(x_ro, interleaved) * sin, x[..., ro_dim:]), dim=-1)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, inplace: bool,
            seqlen_offsets: Union[int, Tensor], cu_seqlens: Optional[Tensor]) -> Tensor:
    """flash.rotary on FlashAttention's layout: x (B, S, H, D), or (total, H, D) with cu_seqlens."""
    if cu_seqlens is not None:
        return rotary(x, cos, sin, interleaved=interleaved, seqlen_offsets=seqlen_offsets,
                      cu_seqlens=cu_seqlens, inplace=inplace)
    out = rotary(x.transpose(1, 2), cos, sin, interleaved=interleaved, seqlen_offsets=seqlen_offsets,
                 inplace=inplace)
    return x if inplace else out.transpose(1, 2)


class _ApplyRotaryEmb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens):
        out = _rotate(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens)
        ctx.save_for_backward(cos, sin, cu_seqlens, seqlen_offsets if isinstance(seqlen_offsets, Tensor) else None)
        ctx.offset, ctx.interleaved = seqlen_offsets if not isinstance(seqlen_offsets, Tensor) else None, interleaved
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin, cu_seqlens, offsets = ctx.saved_tensors
        offsets = ctx.offset if offsets is None else offsets
        dx = _rotate(grad, cos, -sin, ctx.interleaved, False, offsets, cu_seqlens)
        return dx, None, None, None, None, None, None


def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, inplace: bool = False,
                     seqlen_offsets: Union[int, Tensor] = 0, cu_seqlens: Optional[Tensor] = None,
                     max_seqlen: Optional[int] = None) -> Tensor:
    """x (batch, seqlen, heads, headdim), or (total, heads, headdim) with cu_seqlens (batch + 1,);
    cos/sin (seqlen_rotary, rotary_dim / 2). Rotates the first rotary_dim dims of each token at
    position s + seqlen_offsets (an int or a (batch,) tensor): pairs (2i, 2i + 1) if interleaved
    (GPT-J), else halves (GPT-NeoX). inplace=True writes into x and returns it. max_seqlen is
    accepted for FlashAttention's signature (the kernels need no bound)."""
    return _ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens)


apply_rotary_emb_func = apply_rotary_emb  # FlashAttention's older name


def _q_k(qkv: Tensor, num_heads_q: Optional[int]) -> tuple[Tensor, Tensor]:
    """Views of q and k in qkv (B, S, 3, H, D), or (B, S, Hq + 2 * Hk, D) with num_heads_q."""
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"torch_flash.compat.apply_rotary_emb_qkv_: qkv must be (B, S, 3, H, D), got "
                             f"{tuple(qkv.shape)}")
        return qkv[:, :, 0], qkv[:, :, 1]
    heads_k = (qkv.shape[2] - (num_heads_q or 0)) // 2
    if qkv.dim() != 4 or num_heads_q is None or qkv.shape[2] != num_heads_q + 2 * heads_k:
        raise ValueError("torch_flash.compat.apply_rotary_emb_qkv_: a 4-D qkv (B, S, Hq + 2 * Hk, D) needs "
                         f"num_heads_q, got qkv {tuple(qkv.shape)} and num_heads_q={num_heads_q}")
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + heads_k]


class _RotaryQK_(torch.autograd.Function):
    """Rotates q and k inside qkv (or k inside kv) in place; the gradient is rotated back. qkv is
    not marked dirty, as in FlashAttention, so a leaf that requires grad may be passed."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q, only_k):
        tables = ((cos_k, sin_k),) if only_k else ((cos, sin), (cos_k, sin_k))
        views = (qkv[:, :, 0],) if only_k else _q_k(qkv, num_heads_q)
        for view, (c, s) in zip(views, tables):
            _rotate(view, c, s, interleaved, True, seqlen_offsets, None)
        ctx.save_for_backward(cos, sin, cos_k, sin_k, seqlen_offsets if isinstance(seqlen_offsets, Tensor) else None)
        ctx.offset = None if isinstance(seqlen_offsets, Tensor) else seqlen_offsets
        ctx.flags = (interleaved, num_heads_q, only_k)
        return qkv

    @staticmethod
    def backward(ctx, grad):
        cos, sin, cos_k, sin_k, offsets = ctx.saved_tensors
        offsets = ctx.offset if offsets is None else offsets
        interleaved, num_heads_q, only_k = ctx.flags
        grad = grad.clone()
        tables = ((cos_k, sin_k),) if only_k else ((cos, sin), (cos_k, sin_k))
        views = (grad[:, :, 0],) if only_k else _q_k(grad, num_heads_q)
        for view, (c, s) in zip(views, tables):
            _rotate(view, c, -s, interleaved, True, offsets, None)
        return grad, None, None, None, None, None, None, None, None


def apply_rotary_emb_qkv_(qkv: Tensor, cos: Tensor, sin: Tensor, cos_k: Optional[Tensor] = None,
                          sin_k: Optional[Tensor] = None, interleaved: bool = False,
                          seqlen_offsets: Union[int, Tensor] = 0, num_heads_q: Optional[int] = None) -> Tensor:
    """Rotates q and k of qkv (B, S, 3, H, D) (or (B, S, Hq + 2 * Hk, D) with num_heads_q) in
    place, k by cos_k/sin_k when given (XPos); returns qkv."""
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    return _RotaryQK_.apply(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q, False)


def apply_rotary_emb_kv_(kv: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False,
                         seqlen_offsets: Union[int, Tensor] = 0) -> Tensor:
    """Rotates k of kv (B, S, 2, H, D) in place; returns kv."""
    return _RotaryQK_.apply(kv, cos, sin, cos, sin, interleaved, seqlen_offsets, None, True)


class RotaryEmbedding(torch.nn.Module):
    """FlashAttention's RotaryEmbedding(dim, base, interleaved, scale_base (XPos), device): caches
    the cos/sin tables (fp32 angles, cast to the input's dtype) and rotates qkv or (q, kv) in
    place. forward(qkv, kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None)."""

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, scale_base=None, device=None):
        super().__init__()
        self.dim, self.base = dim, float(base)
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        self.interleaved, self.scale_base = interleaved, scale_base
        scale = ((torch.arange(0, dim, 2, device=device, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
                 if scale_base is not None else None)
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _compute_inv_freq(self, device=None) -> Tensor:
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim))

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None) -> None:
        cached = self._cos_cached
        if (seqlen <= self._seq_len_cached and cached is not None and cached.device == device
                and cached.dtype == dtype and not (self.training and cached.is_inference())):
            return
        self._seq_len_cached = seqlen
        t = torch.arange(seqlen, device=device, dtype=torch.float32)
        # fp32 angles even when the module was cast to half (large positions lose precision)
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._compute_inv_freq(device)
        freqs = torch.outer(t, inv_freq)
        if self.scale is None:
            self._cos_cached, self._sin_cached = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
            return
        power = (torch.arange(seqlen, dtype=self.scale.dtype, device=self.scale.device) - seqlen // 2) / self.scale_base
        scale = self.scale.to(device=power.device) ** power[:, None]
        self._cos_cached, self._sin_cached = (torch.cos(freqs) * scale).to(dtype), (torch.sin(freqs) * scale).to(dtype)
        self._cos_k_cached = (torch.cos(freqs) / scale).to(dtype)
        self._sin_k_cached = (torch.sin(freqs) / scale).to(dtype)

    def forward(self, qkv: Tensor, kv: Optional[Tensor] = None, seqlen_offset: Union[int, Tensor] = 0,
                max_seqlen: Optional[int] = None, num_heads_q: Optional[int] = None):
        """qkv (B, S, 3, H, D) (or (B, S, Hq + 2 * Hk, D) with num_heads_q), or q (B, S, H, D) with
        kv (B, S, 2, H, D). A (B,) tensor seqlen_offset needs max_seqlen to size the tables."""
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(qkv.shape[1] + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        xpos = self.scale is not None
        cos_k = self._cos_k_cached if xpos else self._cos_cached
        sin_k = self._sin_k_cached if xpos else self._sin_cached
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached, cos_k, sin_k,
                                         interleaved=self.interleaved, seqlen_offsets=seqlen_offset,
                                         num_heads_q=num_heads_q)
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, interleaved=self.interleaved, inplace=True,
                             seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, cos_k, sin_k, interleaved=self.interleaved, seqlen_offsets=seqlen_offset)
        return q, kv
