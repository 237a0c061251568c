"""flash.attention_decode: KV-cache decoding attention (schema, dispatch, public function).

SDPA layout: q (B, Hq, Sq, D) with Sq small; caches (B, Hkv, S_max, D|Dv), or paged
(num_blocks, Hkv, block_size, D|Dv) with block_table (B, max_blocks); any strides with a
contiguous last dim, so FlashAttention's (B, S, H, D) caches pass as .transpose(1, 2)
views. k_new/v_new are appended to the caches in place (the op's declared mutation).
Semantics in torch_flash/reference/attention_decode.py.

Inference only: no autograd rule is registered. A call with inputs that require grad
still runs forward; a backward through it raises "no autograd formula was registered".
The rotary tables, alibi_slopes, sinks and cache_leftpad are positional in the schema because custom ops cannot
take keyword-only tensors; the public function takes them by keyword.

Paths: the Triton kernels (torch_flash/kernels/triton/attention_decode.py) for CUDA tensors, the
reference for CPU tensors. The checks of index values (cache_seqlens, block_table) need the
values on the host, so they run on CPU tensors only: on the GPU they would synchronise every
step and break CUDA-graph capture. There the kernels never read or write outside the caches
and give NaN out/lse for a sequence whose indices are out of range.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _dispatch
from ..reference import attention_decode as ref
from . import rotary as _rotary
from ._autograd import call, triton_op
from ._checks import (INDEX_DTYPES, check, check_last_dim_contiguous, check_same_device,
                      check_same_dtype, check_tensor, fail)
from ._plans import Plans
from .attention import check_alibi, check_sinks

OP = "attention_decode"


def capacity(k_cache, block_table) -> int:
    """Slots per sequence: S_max, or max_blocks * block_size when paged."""
    return k_cache.shape[2] if block_table is None else block_table.shape[1] * k_cache.shape[2]


def check_args(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, rotary_cos, rotary_sin,
               alibi_slopes, sinks, softcap, window_left, window_right, num_splits, cache_leftpad=None) -> None:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(OP, name, t, ndim=4)
    check_same_dtype(OP, q=q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new)
    check_last_dim_contiguous(OP, q=q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new)
    B, Hq, _, D = q.shape
    Hkv, Dv = k_cache.shape[1], v_cache.shape[-1]
    check(v_cache.shape[:3] == k_cache.shape[:3], OP,
          f"v_cache shape {tuple(v_cache.shape)} does not match k_cache shape {tuple(k_cache.shape)} "
          "in all but the last dim")
    check(k_cache.shape[-1] == D, OP, f"k_cache has head dim {k_cache.shape[-1]} but q has {D}")
    check(Hkv > 0 and Hq % Hkv == 0, OP,
          f"q has {Hq} heads, not a multiple of the {Hkv} kv heads of k_cache")
    check_tensor(OP, "cache_seqlens", cache_seqlens, ndim=1, dtypes=INDEX_DTYPES)
    check(cache_seqlens.shape[0] == B, OP,
          f"cache_seqlens has {cache_seqlens.shape[0]} entries, expected batch size {B}")
    if cache_leftpad is not None:
        check_tensor(OP, "cache_leftpad", cache_leftpad, ndim=1, dtypes=INDEX_DTYPES)
        check(cache_leftpad.shape[0] == B, OP,
              f"cache_leftpad has {cache_leftpad.shape[0]} entries, expected batch size {B}")
    if block_table is None:
        check(k_cache.shape[0] == B, OP,
              f"k_cache has batch {k_cache.shape[0]} but q has {B} (pass block_table for a paged cache)")
    else:
        check_tensor(OP, "block_table", block_table, ndim=2, dtypes=INDEX_DTYPES)
        check(block_table.shape[0] == B, OP,
              f"block_table has {block_table.shape[0]} rows, expected batch size {B}")
    check((k_new is None) == (v_new is None), OP, "k_new and v_new must be given together")
    if k_new is not None:
        check_tensor(OP, "k_new", k_new, ndim=4)
        check_tensor(OP, "v_new", v_new, ndim=4)
        snew = k_new.shape[2]
        check(tuple(k_new.shape) == (B, Hkv, snew, D), OP,
              f"k_new has shape {tuple(k_new.shape)}, expected (B, Hkv, Snew, D) = ({B}, {Hkv}, Snew, {D})")
        check(tuple(v_new.shape) == (B, Hkv, snew, Dv), OP,
              f"v_new has shape {tuple(v_new.shape)}, expected (B, Hkv, Snew, Dv) = ({B}, {Hkv}, {snew}, {Dv})")
        check(snew <= capacity(k_cache, block_table), OP,
              f"k_new has {snew} tokens, more than the cache holds ({capacity(k_cache, block_table)})")
    check((rotary_cos is None) == (rotary_sin is None), OP, "rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        check(k_new is not None, OP, "rotary_cos/rotary_sin rotate k_new and q, so they need k_new/v_new")
        check_tensor(OP, "rotary_cos", rotary_cos, ndim=2)
        _rotary.check_table(OP, rotary_cos, rotary_sin, D, names=("rotary_cos", "rotary_sin"))
    check(softcap >= 0.0, OP, f"softcap must be >= 0, got {softcap}")
    check(window_left >= -1 and window_right >= -1, OP,
          f"window_left/window_right must be >= -1 (-1: unbounded), got {window_left}, {window_right}")
    check(num_splits >= 0, OP, f"num_splits must be >= 0 (0: chosen per call), got {num_splits}")
    check_alibi(OP, alibi_slopes, q, B)
    check_sinks(OP, sinks, q)
    check_same_device(OP, q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k_new=k_new,
                      v_new=v_new, block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                      cache_leftpad=cache_leftpad)


def check_data(q, k_cache, cache_seqlens, k_new, block_table, rotary_cos, cache_leftpad=None) -> None:
    """The checks that read cache_seqlens/block_table values: eager calls on CPU tensors only
    (no trace, no device synchronisation; see the module doc)."""
    if (cache_seqlens.numel() == 0 or cache_seqlens.device.type != "cpu"
            or not _rotary.values_known(cache_seqlens)):
        return
    check(bool((cache_seqlens >= 0).all()), OP, f"cache_seqlens must be >= 0, got {cache_seqlens.tolist()}")
    if cache_leftpad is not None:
        check(bool(((cache_leftpad >= 0) & (cache_leftpad <= cache_seqlens)).all()), OP,
              f"cache_leftpad must be in [0, cache_seqlens], got {cache_leftpad.tolist()} "
              f"(cache_seqlens {cache_seqlens.tolist()})")
    snew = 0 if k_new is None else k_new.shape[2]
    lengths = cache_seqlens.long() + snew
    cap = capacity(k_cache, block_table)
    check(int(lengths.max()) <= cap, OP,
          f"cache_seqlens + Snew ({snew}) exceeds the cache capacity {cap} slots: {cache_seqlens.tolist()}")
    if block_table is not None:
        # only the blocks that hold a sequence's tokens must be valid; the rest may be padding
        page = k_cache.shape[2]
        block_start = torch.arange(block_table.shape[1], device=block_table.device) * page
        used = block_start < lengths[:, None]
        if cache_leftpad is not None:  # blocks wholly before a sequence's first key are padding too
            used = used & (block_start + page > cache_leftpad.long()[:, None])
        entries = block_table[used]
        check(bool(((entries >= 0) & (entries < k_cache.shape[0])).all()), OP,
              f"block_table entries in use must be in [0, {k_cache.shape[0]}) (num_blocks of k_cache)")
    if rotary_cos is not None:
        for t in (q, k_new):
            _rotary.check_data(OP, t, rotary_cos, 0, cache_seqlens, None)


# signature -> the Triton kernels' DecodeFwd plan, or None (the reference path)
PLANS = Plans()


def _use_triton(q, k_cache, v_cache, rotary_cos) -> bool:
    def serves():
        from ..kernels.triton.attention_decode import supports
        return supports(q, k_cache, v_cache, rotary_cos)
    return _dispatch.select(OP, q, triton=serves) == "triton"


@triton_op("flash::attention_decode", mutates_args=("k_cache", "v_cache"))
def _attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                      k_new: Optional[Tensor] = None, v_new: Optional[Tensor] = None,
                      block_table: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
                      rotary_sin: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
                      sinks: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None, *,
                      scale: Optional[float] = None,
                      causal: bool = True, window_left: int = -1, window_right: int = -1,
                      softcap: float = 0.0, rotary_interleaved: bool = False,
                      num_splits: int = 0) -> tuple[Tensor, Tensor]:
    tensors = (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, rotary_cos, rotary_sin, alibi_slopes,
               sinks, cache_leftpad)
    flags = dict(scale=scale, causal=causal, window_left=window_left, window_right=window_right, softcap=softcap,
                 rotary_interleaved=rotary_interleaved, num_splits=num_splits)

    def make():
        check_args(*tensors[:-1], softcap, window_left, window_right, num_splits, cache_leftpad)
        if not _use_triton(q, k_cache, v_cache, rotary_cos):
            return None
        from ..kernels.triton.attention_decode import DecodeFwd
        return DecodeFwd(*tensors, **flags)
    plan = PLANS.get(OP, (*tensors, *flags.values()), make)
    check_data(q, k_cache, cache_seqlens, k_new, block_table, rotary_cos, cache_leftpad)
    if plan is not None:
        return plan(*tensors)
    out, lse = ref.attention_decode(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                                    rotary_cos, rotary_sin, scale, causal, window_left, window_right,
                                    softcap, rotary_interleaved, alibi_slopes, sinks, cache_leftpad)
    return out.contiguous(), lse.contiguous()


def attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                     k_new: Optional[Tensor] = None, v_new: Optional[Tensor] = None,
                     block_table: Optional[Tensor] = None, *, scale: Optional[float] = None,
                     causal: bool = True, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     rotary_cos: Optional[Tensor] = None, rotary_sin: Optional[Tensor] = None,
                     rotary_interleaved: bool = False, num_splits: int = 0,
                     alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                     cache_leftpad: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Attention of new queries over a KV cache, appending k_new/v_new to it in place.

    q (B, Hq, Sq, D); k_cache/v_cache (B, Hkv, S_max, D|Dv), or paged (num_blocks, Hkv,
    block_size, D|Dv) with block_table (B, max_blocks) int32 of physical block indices;
    cache_seqlens (B,) int32: tokens already in each sequence's cache. k_new/v_new
    (B, Hkv, Snew, D|Dv) are written at positions cache_seqlens[b] .. + Snew (rotated first
    by the (S_ro, rotary_dim / 2) tables rotary_cos/rotary_sin, with q rotated at positions
    cache_seqlens[b] + i), then every sequence attends over cache_seqlens[b] + Snew keys.
    causal is aligned bottom-right; window = (left, right) bounds the keys a query sees (-1: no
    bound); softcap > 0 caps scores as softcap * tanh(s / softcap); alibi_slopes, fp32 (Hq,) or
    (B, Hq), add -slope * |query position - key position| to them (FlashAttention 2's ALiBi);
    sinks (Hq,): a softmax column per head without value (gpt-oss), included in lse.
    cache_leftpad (B,) int32: sequence b's keys start at slot cache_leftpad[b] <= cache_seqlens[b]
    (FlashAttention 2's left-padded caches: earlier slots are never attended; positions for the
    masks, ALiBi and rotary stay slot indices). Hq % Hkv == 0 (GQA).
    Any strides with a contiguous last dim. num_splits: how many parts of the keys the GPU
    kernel attends in parallel before merging them (0: chosen from the shapes; no effect on
    the result beyond rounding). Returns out (B, Hq, Sq, Dv) in q's dtype and the fp32
    log-sum-exp (B, Hq, Sq); a query with no visible key gets out 0 and lse -inf.
    Inference only (no backward). No host synchronisation on the GPU (CUDA-graph safe); index
    values are validated only for CPU tensors (see the module doc).
    """
    if not (isinstance(window, (tuple, list)) and len(window) == 2):  # formatted only on failure:
        fail(OP, f"window must be a pair (left, right), got {window!r}")  # traced, it holds SymInts
    return call("attention_decode",
                q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, rotary_cos, rotary_sin, alibi_slopes,
                sinks, cache_leftpad, scale=scale, causal=causal, window_left=window[0], window_right=window[1],
                softcap=softcap, rotary_interleaved=rotary_interleaved, num_splits=num_splits)
