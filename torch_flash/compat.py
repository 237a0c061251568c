"""FlashAttention 2's Python API over the flash ops: an existing user changes only the import.

    from torch_flash.compat import flash_attn_func   # was: from flash_attn import ...

Tensors use FlashAttention's (batch, seqlen, heads, headdim) layout; they reach the ops as
`.transpose(1, 2)` views (no copy) and the output comes back contiguous in the same layout.
alibi_slopes (fp32 (H,) or (batch, H)) pass through to the ops, which compute the bias in their
kernels as FlashAttention 2 does (softmax_lse of a causal call differs from FlashAttention's by
a constant per row: its causal kernels drop that constant from the bias, see
torch_flash/reference/attention.py). Not supported (a clear error, not a silent difference): the
attention probabilities of return_attn_probs (softmax_lse is returned; S_dmask is None). `deterministic`
has no per-call effect (a warning says so): torch.use_deterministic_algorithms(True) makes the
backward bitwise reproducible (flash.attention's docstring says where it is not by default).
"""
from __future__ import annotations

import warnings
from typing import Optional, Union

import torch
from torch import Tensor

from .ops.attention import attention_with_lse
from .ops.attention_decode import attention_decode, capacity
from .ops.attention_varlen import attention_varlen
from .ops.rotary import rotary


def _check_deterministic(fn: str, deterministic: bool) -> None:
    if deterministic and not torch.are_deterministic_algorithms_enabled():
        warnings.warn(f"torch_flash.compat.{fn}: deterministic=True has no per-call effect here; the "
                      "backward is bitwise reproducible under torch.use_deterministic_algorithms(True) "
                      "(cuDNN's, which plain Hopper calls take otherwise, is not)", stacklevel=3)


def _result(out: Tensor, lse: Tensor, return_attn_probs: bool):
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes=None, deterministic: bool = False, return_attn_probs: bool = False):
    """q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) -> out (B, Sq, Hq, Dv)
    (and softmax_lse (B, Hq, Sq), None with return_attn_probs)."""
    _check_deterministic("flash_attn_func", deterministic)
    out, lse = attention_with_lse(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  scale=softmax_scale, causal=causal, window=tuple(window_size),
                                  softcap=softcap, dropout_p=dropout_p, alibi_slopes=alibi_slopes)
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
    _check_deterministic("flash_attn_varlen_func", deterministic)
    out, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                scale=softmax_scale, causal=causal, window=tuple(window_size),
                                softcap=softcap, dropout_p=dropout_p, alibi_slopes=alibi_slopes,
                                return_lse=True)
    return _result(out, lse, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes=None, deterministic: bool = False,
                                     return_attn_probs: bool = False):
    """Packed qkv (total, 3, H, D) -> out (total, H, D)."""
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: Optional[float] = None, causal: bool = False,
                                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes=None, deterministic: bool = False,
                                    return_attn_probs: bool = False):
    """Packed q (total_q, Hq, D), kv (total_k, 2, Hkv, D) -> out (total_q, Hq, D)."""
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                            v: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
                            rotary_sin: Optional[Tensor] = None,
                            cache_seqlens: Optional[Union[int, Tensor]] = None,
                            cache_batch_idx: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                            softcap: float = 0.0, rotary_interleaved: bool = True, alibi_slopes=None,
                            num_splits: int = 0, return_softmax_lse: bool = False):
    """KV-cache decoding through flash.attention_decode. q (B, Sq, Hq, D); k_cache/v_cache
    (B_cache, S, Hkv, D|Dv), or paged (num_blocks, block_size, Hkv, D|Dv) with block_table
    (B, max_blocks) int32; k/v (B, Snew, Hkv, D|Dv) are written into the caches in place at
    cache_seqlens (an int or a (B,) int32 tensor; None: the caches are full), rotated by
    rotary_cos/rotary_sin (S_ro, rotary_dim / 2) when given. cache_batch_idx (B,) picks each
    sequence's row of a non-paged cache. Returns out (B, Sq, Hq, Dv) (and softmax_lse
    (B, Hq, Sq) fp32 with return_softmax_lse). cache_leftpad (B,) int32: sequence b's keys are
    cache slots cache_leftpad[b] .. cache_seqlens[b] (+ Snew) - 1, earlier slots are padding;
    rotary positions stay slot indices (as FlashAttention 2)."""
    fn = "flash_attn_with_kvcache"
    q, k_cache, v_cache = (t.transpose(1, 2) for t in (q, k_cache, v_cache))
    k, v = (None if t is None else t.transpose(1, 2) for t in (k, v))
    if cache_batch_idx is not None:
        if block_table is not None:
            raise ValueError(f"torch_flash.compat.{fn}: cache_batch_idx cannot be combined with "
                             "block_table (a paged cache)")
        # cache row cache_batch_idx[b] is sequence b's only block, of S slots
        block_table = cache_batch_idx[:, None]
    if not isinstance(cache_seqlens, Tensor):
        n = capacity(k_cache, block_table) if cache_seqlens is None else cache_seqlens
        cache_seqlens = torch.full((q.shape[0],), n, dtype=torch.int32, device=q.device)
    local = tuple(window_size) != (-1, -1)
    if rotary_cos is not None and k is not None and not (causal or local) and q.shape[2] > 1:
        # FlashAttention puts every query of a non-causal, non-local call at position
        # cache_seqlens; the op would rotate query i at cache_seqlens + i
        pos = cache_seqlens.long()
        per_query = [t[pos][:, None].expand(-1, q.shape[2], -1) for t in (rotary_cos, rotary_sin)]
        q = rotary(q, *per_query, interleaved=rotary_interleaved)
        k = rotary(k, rotary_cos, rotary_sin, interleaved=rotary_interleaved, seqlen_offsets=cache_seqlens)
        rotary_cos = rotary_sin = None
    out, lse = attention_decode(q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale=softmax_scale,
                                causal=causal, window=tuple(window_size), softcap=softcap,
                                rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                rotary_interleaved=rotary_interleaved, num_splits=num_splits,
                                alibi_slopes=alibi_slopes, cache_leftpad=cache_leftpad)
    out = out.transpose(1, 2).contiguous()
    return (out, lse) if return_softmax_lse else out
