"""Plain-PyTorch KV-cache decoding attention: the semantics the kernels follow, and the CPU path.

q (B, Hq, Sq, D); caches (B, Hkv, S_max, D|Dv), or paged (num_blocks, Hkv, block_size, D|Dv)
with block_table (B, max_blocks) mapping logical block -> physical block. A contiguous cache
is the paged case with one block of S_max slots per sequence, so one code path serves both.
k_new/v_new (B, Hkv, Snew, D|Dv) are written at positions cache_seqlens[b] + s (rotated
first when rotary tables are given; q is rotated at cache_seqlens[b] + i too), then each
sequence attends over its L = cache_seqlens[b] + Snew keys. Query i sits at position
L - Sq + i (causal aligned bottom-right, as FlashAttention). cache_leftpad (B,) starts each
sequence's keys at slot cache_leftpad[b] instead of 0 (FlashAttention 2's left padding: slots
before it are padding; positions, for masks, ALiBi and rotary, stay slot indices). A query with no visible key
gets out = 0 and lse = -inf (it carries no weight when partial attentions are merged).
alibi_slopes (fp32 (Hq,) or (B, Hq)) add -slope * |query position - key position| to the
scaled (and capped) scores, as FlashAttention 2; sinks (Hq,) add a softmax column per head that
takes probability mass and adds no value (lse includes it; such a query's out is 0 without keys).

The masked softmax here is local to decoding (Sq is small, so the (Sq, L) scores are too).
"""
from __future__ import annotations

import math

import torch

from ._common import compute_dtype
from .rotary import rotary


def block_table_of(cache, block_table):
    """The block table, or the one-block-per-sequence table of a contiguous cache."""
    if block_table is not None:
        return block_table.long()
    return torch.arange(cache.shape[0], device=cache.device)[:, None]


def _slots(block_table, pos, block_size):
    """Physical (block, offset) of logical positions pos (B, N)."""
    return block_table.gather(1, pos // block_size), pos % block_size


def append(cache, new, cache_seqlens, block_table) -> None:
    """Write new (B, H, Snew, D) at positions cache_seqlens[b] + s of sequence b, in place."""
    pos = cache_seqlens.long()[:, None] + torch.arange(new.shape[2], device=new.device)
    blk, off = _slots(block_table, pos, cache.shape[2])
    # indices on dims 0 and 2 around a slice: the indexed view is (B, Snew, H, D)
    cache[blk, :, off] = new.transpose(1, 2)


def gather(cache, lengths, block_table):
    """(B, H, capacity, D): each sequence's entries. Slots past a sequence's length read
    physical slot 0 (the caller masks them), so unused table entries are never read. The
    width is the capacity, not max(lengths), so that shapes do not depend on values and the
    op traces (torch.compile runs this function on fake tensors)."""
    pos = torch.arange(block_table.shape[1] * cache.shape[2], device=cache.device)
    valid = pos < lengths[:, None]
    pos = pos.expand_as(valid)
    blk, off = _slots(block_table, pos.where(valid, 0), cache.shape[2])
    return cache[blk.where(valid, 0), :, off].transpose(1, 2)


def attend(q, k, v, lengths, scale, causal=True, window_left=-1, window_right=-1, softcap=0.0,
           alibi_slopes=None, sinks=None, starts=None):
    """Masked attention of q (B, Hq, Sq, D) over k/v (B, Hkv, L, D|Dv) whose keys
    starts[b] .. lengths[b] - 1 exist (starts None: from 0). Returns out (B, Hq, Sq, Dv) in q's
    dtype and lse (B, Hq, Sq) fp32."""
    B, Hq, Sq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    cdt = compute_dtype(q.dtype)
    # GQA without repeating k/v: query heads of one kv head share its scores' batch entry
    qg = q.to(cdt).reshape(B, Hkv, Hq // Hkv * Sq, D)
    s = (qg @ k.to(cdt).transpose(-1, -2) * scale).view(B, Hkv, Hq // Hkv, Sq, L)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    key = torch.arange(L, device=q.device)
    query = lengths[:, None] - Sq + torch.arange(Sq, device=q.device)  # (B, Sq) positions
    rel = key - query[:, :, None]  # (B, Sq, L): key position minus query position
    if alibi_slopes is not None:  # (B or 1, Hkv, group, 1, 1) slopes times (B, 1, 1, Sq, L) distances
        slopes = alibi_slopes.to(cdt).reshape(-1, Hkv, Hq // Hkv, 1, 1)
        s = s - slopes * rel.abs().to(cdt)[:, None, None]
    visible = key < lengths[:, None, None]
    if starts is not None:
        visible = visible & (key >= starts[:, None, None])
    if causal:
        visible = visible & (rel <= 0)
    if window_left >= 0:
        visible = visible & (rel >= -window_left)
    if window_right >= 0:
        visible = visible & (rel <= window_right)
    s = s.masked_fill(~visible[:, None, None], -math.inf)
    lse = torch.logsumexp(s, -1)
    if sinks is not None:  # (B, Hkv, group, Sq): heads grouped as s's
        lse = torch.logaddexp(lse, sinks.to(cdt).view(1, Hkv, -1, 1))
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])  # rows with no key: all 0
    out = (p.view(B, Hkv, -1, L) @ v.to(cdt)).view(B, Hq, Sq, v.shape[-1])
    return out.to(q.dtype), lse.view(B, Hq, Sq).float()


def attention_decode(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, block_table=None,
                     rotary_cos=None, rotary_sin=None, scale=None, causal=True, window_left=-1,
                     window_right=-1, softcap=0.0, rotary_interleaved=False, alibi_slopes=None, sinks=None,
                     cache_leftpad=None):
    """Append k_new/v_new to the caches (in place), then attend; returns (out, lse)."""
    table = block_table_of(k_cache, block_table)
    lengths = cache_seqlens.long()
    if k_new is not None:
        if rotary_cos is not None:
            q, k_new = (rotary(t, rotary_cos, rotary_sin, rotary_interleaved, seqlen_offsets=cache_seqlens)
                        for t in (q, k_new))
        append(k_cache, k_new, lengths, table)
        append(v_cache, v_new, lengths, table)
        lengths = lengths + k_new.shape[2]
    k, v = gather(k_cache, lengths, table), gather(v_cache, lengths, table)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    starts = None if cache_leftpad is None else cache_leftpad.long()
    return attend(q, k, v, lengths, scale, causal, window_left, window_right, softcap, alibi_slopes, sinks, starts)
