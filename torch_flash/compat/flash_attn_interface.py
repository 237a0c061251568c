"""FlashAttention 2's Python API over the flash ops: an existing user changes only the import.

    from torch_flash.compat import flash_attn_func   # was: from flash_attn import ...

Tensors use FlashAttention's (batch, seqlen, heads, headdim) layout; they reach the ops as
`.transpose(1, 2)` views (no copy) and the output comes back contiguous in the same layout.
alibi_slopes (fp32 (H,) or (batch, H)) pass through to the ops, which compute the bias in their
kernels as FlashAttention 2 does (softmax_lse of a causal call differs from FlashAttention's by
a constant per row: its causal kernels drop that constant from the bias, see
torch_flash/reference/attention.py). window_size takes ints or one-element integer tensors
(FlashAttention's tests pass `torch.randint(..., (2,))`). deterministic=True runs the call's
backward under torch.use_deterministic_algorithms(True) (no cuDNN backward, whose dq is summed
with atomics). return_attn_probs=True returns (out, softmax_lse, S_dmask) as FlashAttention:
S_dmask empty without dropout, else the probabilities with the call's dropout pattern
(torch_flash/compat/_attn_probs.py; a test-only output of O(S^2) memory). s_aux (Hq,) (the
name of FlashAttention 3's vLLM build, by which transformers passes gpt-oss's sinks) is the
ops' `sinks`: one softmax column per head that carries no value.
"""
from __future__ import annotations

import operator
import warnings
from typing import Optional, Union

import torch
from torch import Tensor

from ..ops._autograd import call
from ..ops.attention import op_kwargs, spec_of
from ..ops.attention_decode import attention_decode, capacity
from ..ops.rotary import rotary
from . import _attn_probs, _paged


def _fail(fn: str, msg: str):
    raise ValueError(f"torch_flash.compat.{fn}: {msg}")


def _window(fn: str, window_size) -> tuple[int, int]:
    """(left, right) as ints, from ints or one-element integer tensors (a tensor is read on the
    host: a GPU tensor synchronises)."""
    try:
        pair = tuple(window_size)
    except TypeError:
        pair = ()
    if len(pair) != 2:
        _fail(fn, f"window_size must be a pair (left, right), got {window_size!r}")
    out = []
    for w in pair:
        if isinstance(w, Tensor) and w.numel() == 1 and not (w.is_floating_point() or w.is_complex()):
            w = int(w.item())
        try:
            out.append(operator.index(w))
        except TypeError:
            _fail(fn, f"window_size entries must be ints or one-element integer tensors, got {w!r}")
    return out[0], out[1]


def _deterministic(fn: str, deterministic: bool, out: Tensor) -> None:
    """deterministic=True: out's backward node runs under torch.use_deterministic_algorithms(True)
    (restored after it), which keeps the op's backward off cuDNN."""
    if not deterministic or out.grad_fn is None:
        return
    if torch.compiler.is_compiling():  # no autograd hooks in a traced graph
        if not torch.are_deterministic_algorithms_enabled():
            warnings.warn(f"torch_flash.compat.{fn}: deterministic=True has no effect inside torch.compile; "
                          "set torch.use_deterministic_algorithms(True) before compiling", stacklevel=3)
        return
    saved = []

    def before(grad_outputs):
        saved.append((torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled()))
        if not saved[-1][0]:
            torch.use_deterministic_algorithms(True, warn_only=True)

    def after(grad_inputs, grad_outputs):
        mode, warn_only = saved.pop()
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)

    out.grad_fn.register_prehook(before)
    out.grad_fn.register_hook(after)


def _no_probs_with_sinks(fn: str, return_attn_probs: bool, dropout_p: float, s_aux) -> None:
    if return_attn_probs and dropout_p > 0 and s_aux is not None:
        _fail(fn, "return_attn_probs=True with dropout and s_aux (sinks) is not supported: S_dmask "
                  "has no encoding for the sink column")


def _attn_probs_result(out, lse, return_attn_probs, dropout_p, probs):
    """out, or FlashAttention's (out, softmax_lse, S_dmask): S_dmask empty without dropout."""
    if not return_attn_probs:
        return out
    return out, lse, probs() if dropout_p > 0 else out.new_empty(0)


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes=None, deterministic: bool = False, return_attn_probs: bool = False,
                    s_aux: Optional[Tensor] = None):
    """q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) -> out (B, Sq, Hq, Dv); with
    return_attn_probs, (out, softmax_lse (B, Hq, Sq), S_dmask (B, Hq, Sq_128, Sk_128), empty
    without dropout). s_aux: sinks (Hq,)."""
    fn = "flash_attn_func"
    window = _window(fn, window_size)
    _no_probs_with_sinks(fn, return_attn_probs, dropout_p, s_aux)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    kw = op_kwargs(fn, softmax_scale, causal, window, softcap, dropout_p)
    seed = kw.pop("dropout_seed")
    out, lse = call("attention_with_lse", q, k, v, None, seed, alibi_slopes, s_aux, **kw)
    _deterministic(fn, deterministic, out)

    def probs():
        spec = spec_of(q, softmax_scale, causal, *window, softcap, dropout_p, seed, alibi_slopes)
        return _attn_probs.dense(q.detach(), k.detach(), spec)
    return _attn_probs_result(out.transpose(1, 2).contiguous(), lse, return_attn_probs, dropout_p, probs)


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
                           return_attn_probs: bool = False, block_table: Optional[Tensor] = None,
                           s_aux: Optional[Tensor] = None):
    """Packed q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) with int32
    cu_seqlens (batch + 1,) -> out (total_q, Hq, Dv); with return_attn_probs, (out, softmax_lse
    (Hq, total_q), S_dmask (batch, Hq, max_seqlen_q_128, max_seqlen_k_128), empty without dropout).
    block_table (batch, max_blocks) int32: k/v are paged pools (num_blocks, page_block_size, Hkv,
    D|Dv) and sequence b's key s is in block block_table[b, s // page_block_size] (paged prefill;
    the keys are gathered into a packed copy, see torch_flash/compat/_paged.py). s_aux: sinks
    (Hq,)."""
    fn = "flash_attn_varlen_func"
    window = _window(fn, window_size)
    _no_probs_with_sinks(fn, return_attn_probs, dropout_p, s_aux)
    batch_cu_q, batch_cu_k, slopes = cu_seqlens_q, cu_seqlens_k, alibi_slopes
    if block_table is not None:
        _paged.check(fn, k, v, block_table, cu_seqlens_k, max_seqlen_k)
        k, v, cu_seqlens_q, cu_seqlens_k, slopes = _paged.gather(k, v, block_table, cu_seqlens_q, cu_seqlens_k,
                                                                 max_seqlen_k, alibi_slopes)
    kw = op_kwargs(fn, softmax_scale, causal, window, softcap, dropout_p)
    seed = kw.pop("dropout_seed")
    out, lse = call("attention_varlen", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed,
                    slopes, s_aux, **kw)
    _deterministic(fn, deterministic, out)

    def probs():
        spec = spec_of(q, softmax_scale, causal, *window, softcap, dropout_p, seed, alibi_slopes)
        return _attn_probs.varlen(q.detach(), k.detach(), batch_cu_q, batch_cu_k, max_seqlen_q, max_seqlen_k, spec)
    return _attn_probs_result(out, lse, return_attn_probs, dropout_p, probs)


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
    window = _window(fn, window_size)
    q, k_cache, v_cache = (t.transpose(1, 2) for t in (q, k_cache, v_cache))
    k, v = (None if t is None else t.transpose(1, 2) for t in (k, v))
    if cache_batch_idx is not None:
        if block_table is not None:
            _fail(fn, "cache_batch_idx cannot be combined with block_table (a paged cache)")
        # cache row cache_batch_idx[b] is sequence b's only block, of S slots
        block_table = cache_batch_idx[:, None]
    if not isinstance(cache_seqlens, Tensor):
        n = capacity(k_cache, block_table) if cache_seqlens is None else cache_seqlens
        cache_seqlens = torch.full((q.shape[0],), n, dtype=torch.int32, device=q.device)
    local = window != (-1, -1)
    if rotary_cos is not None and k is not None and not (causal or local) and q.shape[2] > 1:
        # FlashAttention puts every query of a non-causal, non-local call at position
        # cache_seqlens; the op would rotate query i at cache_seqlens + i
        pos = cache_seqlens.long()
        per_query = [t[pos][:, None].expand(-1, q.shape[2], -1) for t in (rotary_cos, rotary_sin)]
        q = rotary(q, *per_query, interleaved=rotary_interleaved)
        k = rotary(k, rotary_cos, rotary_sin, interleaved=rotary_interleaved, seqlen_offsets=cache_seqlens)
        rotary_cos = rotary_sin = None
    out, lse = attention_decode(q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale=softmax_scale,
                                causal=causal, window=window, softcap=softcap,
                                rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                rotary_interleaved=rotary_interleaved, num_splits=num_splits,
                                alibi_slopes=alibi_slopes, cache_leftpad=cache_leftpad)
    out = out.transpose(1, 2).contiguous()
    return (out, lse) if return_softmax_lse else out
