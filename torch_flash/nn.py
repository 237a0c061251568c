"""torch.nn modules over the flash ops, drop-in where torch.nn has a counterpart.

RMSNorm, LayerNorm, MultiheadAttention and LinearCrossEntropyLoss keep the parameter
names and shapes of torch.nn.RMSNorm, torch.nn.LayerNorm, torch.nn.MultiheadAttention
(batch_first=True) and an lm-head torch.nn.Linear, so their state dicts load both ways.
Differences from torch.nn are noted on each class. ContextParallelAttention (no torch.nn
counterpart) is torch_flash.context_parallel's ring attention over a process group.
"""
from __future__ import annotations

import numbers
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ops.attention import attention
from .ops.cross_entropy import LossOptions, check_options, cross_entropy
from .ops.layer_norm import add_layer_norm, layer_norm
from .ops.linear_cross_entropy import linear_cross_entropy
from .ops.rms_norm import add_rms_norm, rms_norm
from .ops.rotary import rotary, rotary_cos_sin, rotary_qk


def _check(cond: bool, who: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"torch_flash.nn.{who}: {msg}")


class _Norm(nn.Module):
    """Normalisation over the last len(normalized_shape) dims of x, which the flash ops
    see as one hidden dim; parameters are shaped normalized_shape, as in torch.nn."""

    def __init__(self, normalized_shape, elementwise_affine: bool, params: dict[str, bool], device, dtype):
        """params: parameter name -> whether it exists when elementwise_affine."""
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        _check(len(self.normalized_shape) > 0 and min(self.normalized_shape) > 0, type(self).__name__,
               f"normalized_shape must be non-empty and positive, got {self.normalized_shape}")
        self.elementwise_affine = elementwise_affine
        for name, present in params.items():
            param = torch.empty(self.normalized_shape, device=device, dtype=dtype)
            self.register_parameter(name, nn.Parameter(param) if elementwise_affine and present else None)

    def _apply_norm(self, norm_fn, add_norm_fn, x: Tensor, residual: Optional[Tensor],
                    residual_in_fp32: bool, params: tuple[Optional[Tensor], ...], **options):
        k = len(self.normalized_shape)
        _check(tuple(x.shape[-k:]) == self.normalized_shape, type(self).__name__,
               f"x of shape {tuple(x.shape)} does not end in normalized_shape {self.normalized_shape}")
        flat = [None if p is None else p.reshape(-1) for p in params]
        if residual is None:
            return norm_fn(x.flatten(-k), *flat, **options).unflatten(-1, self.normalized_shape)
        y, residual_out = add_norm_fn(x.flatten(-k), residual.flatten(-k), *flat,
                                      residual_in_fp32=residual_in_fp32, **options)
        return y.unflatten(-1, self.normalized_shape), residual_out.unflatten(-1, self.normalized_shape)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class RMSNorm(_Norm):
    """torch.nn.RMSNorm through flash.rms_norm (same `weight`, same eps=None rule: the
    machine epsilon of x's dtype).

    weight_offset=1.0 computes Gemma's x_hat * (1 + w); the weight then starts at zeros
    so that the initial scale is 1, as Gemma's. cast_before_weight: see
    torch_flash.rms_norm. forward(x) -> y; forward(x, residual) -> (y, x + residual)
    through flash.add_rms_norm (residual_out in fp32 with residual_in_fp32=True).
    """

    def __init__(self, normalized_shape, eps: Optional[float] = None, elementwise_affine: bool = True, *,
                 weight_offset: float = 0.0, cast_before_weight: bool = True, device=None, dtype=None):
        super().__init__(normalized_shape, elementwise_affine, {"weight": True}, device, dtype)
        self.eps = eps
        self.weight_offset = weight_offset
        self.cast_before_weight = cast_before_weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.weight_offset)

    def forward(self, x: Tensor, residual: Optional[Tensor] = None, *, residual_in_fp32: bool = False):
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return self._apply_norm(rms_norm, add_rms_norm, x, residual, residual_in_fp32, (self.weight,),
                                eps=eps, weight_offset=self.weight_offset,
                                cast_before_weight=self.cast_before_weight)


class LayerNorm(_Norm):
    """torch.nn.LayerNorm through flash.layer_norm (same `weight` and `bias`).

    forward(x) -> y; forward(x, residual) -> (y, x + residual) through
    flash.add_layer_norm (residual_out in fp32 with residual_in_fp32=True).
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None):
        super().__init__(normalized_shape, elementwise_affine, {"weight": True, "bias": bias}, device, dtype)
        self.eps = eps
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, residual: Optional[Tensor] = None, *, residual_in_fp32: bool = False):
        return self._apply_norm(layer_norm, add_layer_norm, x, residual, residual_in_fp32,
                                (self.weight, self.bias), eps=self.eps)


class _Loss(nn.Module):
    """Loss options shared by the two cross-entropy modules, checked at construction."""

    def __init__(self, op: str, ignore_index: int, reduction: str, label_smoothing: float,
                 z_loss: float, softcap: float):
        super().__init__()
        check_options(op, LossOptions(ignore_index, label_smoothing, z_loss, softcap), reduction)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap

    def loss_options(self) -> dict:
        return dict(ignore_index=self.ignore_index, reduction=self.reduction,
                    label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.loss_options().items())


class CrossEntropyLoss(_Loss):
    """Cross-entropy through flash.cross_entropy: forward(logits (..., V), target (...)).

    Unlike torch.nn.CrossEntropyLoss the class dim is the LAST one (tokens (B, S, V) need
    no transpose), there are no class weights, and z_loss / softcap are added (see
    torch_flash.cross_entropy). The loss is fp32 for fp16/bf16 logits.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0, *,
                 z_loss: float = 0.0, softcap: float = 0.0):
        super().__init__("cross_entropy", ignore_index, reduction, label_smoothing, z_loss, softcap)

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return cross_entropy(logits, target, **self.loss_options())


class LinearCrossEntropyLoss(_Loss):
    """An lm-head nn.Linear(in_features, vocab_size) fused with CrossEntropyLoss through
    flash.linear_cross_entropy: forward(hidden (..., H), target (...)) -> loss, never
    materialising the (..., V) logits.

    Owns `weight` (V, H) and `bias` (V,) (bias=True only), named, shaped and initialised
    as nn.Linear's, so an lm_head's state dict loads. chunk_size: tokens per chunk
    (None picks it).
    """

    def __init__(self, in_features: int, vocab_size: int, bias: bool = False, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, *, z_loss: float = 0.0,
                 softcap: float = 0.0, chunk_size: Optional[int] = None, device=None, dtype=None):
        super().__init__("linear_cross_entropy", ignore_index, reduction, label_smoothing, z_loss, softcap)
        self.in_features, self.vocab_size, self.chunk_size = in_features, vocab_size, chunk_size
        self.weight = nn.Parameter(torch.empty(vocab_size, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(vocab_size, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.Linear.reset_parameters(self)  # reads only self.weight and self.bias

    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        return linear_cross_entropy(hidden, self.weight, target, self.bias, chunk_size=self.chunk_size,
                                    **self.loss_options())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, vocab_size={self.vocab_size}, "
                f"bias={self.bias is not None}, {super().extra_repr()}")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding of q and k through flash.rotary_qk (one kernel launch), or
    flash.rotary for each when their shapes differ beyond the head count.

    Rotates the first `dim` dims of each head (partial rotary when dim < head dim) with
    angle pos * base ** (-2i / dim); interleaved=False is GPT-NeoX/LLaMA, True GPT-J.
    The cos/sin tables (S, dim / 2) are cached as non-persistent buffers in fp32 (fp64
    for fp64 inputs) and regrown when a longer sequence comes.
    """

    def __init__(self, dim: int, base: float = 10000.0, max_seqlen: int = 2048, interleaved: bool = False,
                 device=None):
        super().__init__()
        self.dim, self.base, self.interleaved = dim, base, interleaved
        cos, sin = rotary_cos_sin(max_seqlen, dim, base, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, seqlen: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) covering positions [0, seqlen) on device, for inputs of dtype."""
        want = torch.float64 if dtype == torch.float64 else torch.float32
        cached = self.cos.shape[0]
        if seqlen > cached or self.cos.device != device or self.cos.dtype != want:
            # doubling: decoding one token at a time past the cache rebuilds it rarely
            n = cached if seqlen <= cached else max(seqlen, 2 * cached)
            self.cos, self.sin = rotary_cos_sin(n, self.dim, self.base, device, want)
        return self.cos, self.sin

    def forward(self, q: Tensor, k: Tensor, seqlen_offsets: Union[int, Tensor] = 0,
                max_seqlen: Optional[int] = None) -> tuple[Tensor, Tensor]:
        """q (B, Hq, S, D), k (B, Hkv, S, D) -> rotated (q, k); token s sits at position
        s + seqlen_offsets (an int, or a (B,) tensor: one offset per sequence). With
        tensor offsets the tables cover max_seqlen positions (default: the cached ones),
        as reading the offsets' maximum would synchronise with the device."""
        seqlen = max(q.shape[-2], k.shape[-2]) + (0 if isinstance(seqlen_offsets, Tensor) else seqlen_offsets)
        cos, sin = self.tables(max(seqlen, max_seqlen or 0), q.device, q.dtype)
        kw = dict(interleaved=self.interleaved, seqlen_offsets=seqlen_offsets)
        if q.dtype == k.dtype and q.shape[:1] + q.shape[2:] == k.shape[:1] + k.shape[2:]:
            return rotary_qk(q, k, cos, sin, **kw)  # one kernel launch
        return rotary(q, cos, sin, **kw), rotary(k, cos, sin, **kw)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, interleaved={self.interleaved}"


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool keep-mask as an additive 0 / -inf bias; a float mask as it is."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _merge_masks(attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
                 dtype: torch.dtype) -> Optional[Tensor]:
    """One attn_bias for flash.attention: boolean keep-mask when both masks are boolean,
    else additive. key_padding_mask (B, Sk) is True (or -inf) at padded keys."""
    if key_padding_mask is None:
        return attn_mask
    pad = key_padding_mask[:, None, None, :]
    keep = ~pad if pad.dtype == torch.bool else pad  # bool: keep-mask; float: additive already
    if attn_mask is None:
        return keep
    if attn_mask.dtype == keep.dtype == torch.bool:
        return attn_mask & keep
    return _additive(attn_mask, dtype) + _additive(keep, dtype)


class MultiheadAttention(nn.Module):
    """Self-attention over x (B, S, E) through flash.attention, with grouped-query heads
    and optional rotary embeddings.

    Parameters as torch.nn.MultiheadAttention(embed_dim, num_heads, bias=bias,
    batch_first=True): `in_proj_weight` ((Hq + 2 * Hkv) * D, E) stacking the q, k and v
    projections, `in_proj_bias`, and `out_proj` (nn.Linear); with num_kv_heads ==
    num_heads (the default) their state dicts load both ways. rotary: False, True (rotate
    the whole head dim), an int rotary dim, or a RotaryEmbedding.

    forward(x, attn_mask=None, key_padding_mask=None) -> (B, S, E). Differences from
    torch.nn.MultiheadAttention: self-attention only, returns no attention weights, and a
    boolean attn_mask is a KEEP-mask (True = may attend, as in
    F.scaled_dot_product_attention), broadcastable to (B, Hq, S, S); a float attn_mask is
    added to the scores. key_padding_mask (B, S) is True at padded keys, as in torch.nn.
    causal=True masks future positions. Dropout on the attention weights in training only.
    """

    batch_first = True

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: Optional[int] = None, bias: bool = True,
                 dropout: float = 0.0, causal: bool = False,
                 rotary: Union[bool, int, RotaryEmbedding] = False, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        who = "MultiheadAttention"
        _check(num_heads > 0 and embed_dim % num_heads == 0, who,
               f"embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        _check(num_kv_heads > 0 and num_heads % num_kv_heads == 0, who,
               f"num_heads {num_heads} must be divisible by num_kv_heads {num_kv_heads}")
        _check(0.0 <= dropout < 1.0, who, f"dropout must be in [0, 1), got {dropout}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.dropout, self.causal = dropout, causal
        factory = dict(device=device, dtype=dtype)
        qkv_dim = (num_heads + 2 * num_kv_heads) * self.head_dim
        self.in_proj_weight = nn.Parameter(torch.empty(qkv_dim, embed_dim, **factory))
        self.in_proj_bias = nn.Parameter(torch.empty(qkv_dim, **factory)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if isinstance(rotary, RotaryEmbedding) or rotary is None:
            self.rotary_emb = rotary
        else:  # bool or int rotary dim
            dim = self.head_dim if rotary is True else int(rotary)
            self.rotary_emb = RotaryEmbedding(dim, device=device) if dim else None
        if self.rotary_emb is not None:
            _check(self.rotary_emb.dim <= self.head_dim, who,
                   f"rotary dim {self.rotary_emb.dim} exceeds the head dim {self.head_dim}")
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch.nn.MultiheadAttention's initialisation."""
        nn.init.xavier_uniform_(self.in_proj_weight)
        self.out_proj.reset_parameters()
        for b in (self.in_proj_bias, self.out_proj.bias):
            if b is not None:
                nn.init.zeros_(b)

    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None,
                key_padding_mask: Optional[Tensor] = None) -> Tensor:
        _check(x.dim() == 3 and x.shape[-1] == self.embed_dim, "MultiheadAttention",
               f"x must be (B, S, embed_dim={self.embed_dim}), got shape {tuple(x.shape)}")
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        # (B, S, H * D) -> (B, H, S, D) views: the attention op takes any strides
        q, k, v = (t.unflatten(-1, (-1, d)).transpose(1, 2)
                   for t in qkv.split((hq * d, hkv * d, hkv * d), -1))
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(q, k)
        out = attention(q, k, v, _merge_masks(attn_mask, key_padding_mask, q.dtype), causal=self.causal,
                        dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(out.transpose(1, 2).flatten(-2))

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"dropout={self.dropout}, causal={self.causal}")


def __getattr__(name: str):
    # ContextParallelAttention (torch_flash/context_parallel.py): imported on first use, as
    # torch_flash.context_parallel_attention is (its eager-only wrapper imports Dynamo)
    if name == "ContextParallelAttention":
        from .context_parallel import ContextParallelAttention
        return ContextParallelAttention
    raise AttributeError(f"module 'torch_flash.nn' has no attribute {name!r}")
