"""FlashAttention 2's Python API over the flash ops: an existing user changes only the import.

    from torch_flash.compat import flash_attn_func   # was: from flash_attn import ...

Tensors use FlashAttention's (batch, seqlen, heads, headdim) layout; they reach the ops as
`.transpose(1, 2)` views (no copy) and the output comes back contiguous in the same layout.
Not supported (a clear error, not a silent difference): alibi_slopes and the attention
probabilities of return_attn_probs (softmax_lse is returned; S_dmask is None). The backward
is always deterministic, so `deterministic` is accepted and has no effect.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from .ops.attention import attention_with_lse
from .ops.attention_varlen import attention_varlen


def _check_supported(fn: str, alibi_slopes) -> None:
    if alibi_slopes is not None:
        raise ValueError(f"torch_flash.compat.{fn}: alibi_slopes is not supported; pass the ALiBi "
                         "bias as attn_bias to torch_flash.attention instead")


def _result(out: Tensor, lse: Tensor, return_attn_probs: bool):
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes=None, deterministic: bool = False, return_attn_probs: bool = False):
    """q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) -> out (B, Sq, Hq, Dv)
    (and softmax_lse (B, Hq, Sq), None with return_attn_probs)."""
    _check_supported("flash_attn_func", alibi_slopes)
    out, lse = attention_with_lse(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  scale=softmax_scale, causal=causal, window=tuple(window_size),
                                  softcap=softcap, dropout_p=dropout_p)
    return _result(out.transpose(1, 2).contiguous(), lse, return_attn_probs)


def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                              softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                              return_attn_probs: bool = False):
    """qkv (B, S, 3, H, D) -> out (B, S, H, D)."""
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = 0.0,
                             softmax_scale: Optional[float] = None, causal: bool = False,
                             window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes=None, deterministic: bool = False,
                             return_attn_probs: bool = False):
    """q (B, Sq, Hq, D), kv (B, Sk, 2, Hkv, D) -> out (B, Sq, Hq, D)."""
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes=None, deterministic: bool = False,
                           return_attn_probs: bool = False):
    """Packed q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) with int32
    cu_seqlens (batch + 1,) -> out (total_q, Hq, Dv) (and softmax_lse (Hq, total_q), None)."""
    _check_supported("flash_attn_varlen_func", alibi_slopes)
    out, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                scale=softmax_scale, causal=causal, window=tuple(window_size),
                                softcap=softcap, dropout_p=dropout_p, return_lse=True)
    return _result(out, lse, return_attn_probs)
