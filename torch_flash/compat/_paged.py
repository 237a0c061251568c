"""Paged keys/values for FlashAttention's varlen prefill (flash_attn_varlen_func(block_table=...)),
turned into the packed call flash.attention_varlen takes, exactly and without a host sync.

FlashAttention's semantics: k/v are pools (num_blocks, page_block_size, Hkv, D); sequence b's
key s (0 <= s < cu_seqlens_k[b+1] - cu_seqlens_k[b]) is slot s % page of block
block_table[b, s // page]. Here the keys are gathered into a packed (B * max_seqlen_k, Hkv, D)
tensor (a copy, differentiable back into the pools): the real tokens first, in cu_seqlens_k's
order, then the unused rows, which B extra sequences without queries own (each at most
max_seqlen_k keys), so the offsets end at the tensor's length without reading their values.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..ops._checks import INDEX_DTYPES


def _fail(fn: str, msg: str):
    raise ValueError(f"torch_flash.compat.{fn}: {msg}")


def check(fn: str, k: Tensor, v: Tensor, block_table: Tensor, cu_seqlens_k: Tensor, max_seqlen_k: int) -> None:
    """Shapes; on CPU tensors, the values too (elsewhere a bad sequence gets NaN keys)."""
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        _fail(fn, f"with block_table, k and v must be pools (num_blocks, page_block_size, Hkv, D), got "
                  f"{tuple(k.shape)} and {tuple(v.shape)}")
    if block_table.dim() != 2 or block_table.dtype not in INDEX_DTYPES:
        _fail(fn, f"block_table must be a (batch, max_blocks) int32 tensor, got {tuple(block_table.shape)} "
                  f"{block_table.dtype}")
    if block_table.shape[0] != cu_seqlens_k.shape[0] - 1:
        _fail(fn, f"block_table has {block_table.shape[0]} rows, cu_seqlens_k {cu_seqlens_k.shape[0] - 1} sequences")
    if block_table.device.type != "cpu" or cu_seqlens_k.device.type != "cpu":
        return
    lengths = cu_seqlens_k.long().diff()
    cap = min(max_seqlen_k, block_table.shape[1] * k.shape[1])
    if lengths.numel() and int(lengths.max()) > cap:
        _fail(fn, f"cu_seqlens_k holds a sequence of {int(lengths.max())} keys, more than max_seqlen_k "
                  f"({max_seqlen_k}) or the {block_table.shape[1] * k.shape[1]} slots block_table addresses")
    used = torch.arange(block_table.shape[1]) * k.shape[1] < lengths[:, None]
    entries = block_table[used]
    if not bool(((entries >= 0) & (entries < k.shape[0])).all()):
        _fail(fn, f"block_table entries in use must be in [0, {k.shape[0]}) (num_blocks of k)")


def gather(k: Tensor, v: Tensor, block_table: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
           max_seqlen_k: int, alibi_slopes: Tensor | None):
    """(k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes) of the packed call: k/v (B * max_seqlen_k,
    Hkv, D), 2B sequences (the last B without queries), (B, H) slopes extended with zero rows."""
    B, nblk = block_table.shape
    num_blocks, page = k.shape[:2]
    n = B * max_seqlen_k
    cu_k = cu_seqlens_k.long()
    lengths = cu_k.diff()
    t = torch.arange(n, device=k.device)
    seq = (torch.searchsorted(cu_k[1:], t, right=True)).clamp(max=max(B - 1, 0))
    s = t - cu_k[seq]
    real = t < cu_k[-1]
    blk = block_table.long()[seq, (s // page).clamp(0, nblk - 1)]
    # a sequence longer than the bound, or a used entry outside the pool: NaN keys, not a crash
    bad = real & ((blk < 0) | (blk >= num_blocks) | (lengths[seq] > min(max_seqlen_k, nblk * page)))
    take = real & ~bad
    blk, off = blk.where(take, 0), (s % page).where(take, 0)
    k_packed, v_packed = (x[blk, off].masked_fill(bad[:, None, None], math.nan) for x in (k, v))
    # the unused rows: B sequences of at most max_seqlen_k keys each, no queries
    spare = n - cu_k[-1]
    pad = (spare - torch.arange(B, device=k.device) * max_seqlen_k).clamp(0, max_seqlen_k)
    cu_k = torch.cat((cu_k, cu_k[-1] + pad.cumsum(0))).to(cu_seqlens_k.dtype)
    cu_q = torch.cat((cu_seqlens_q, cu_seqlens_q[-1:].expand(B)))
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        alibi_slopes = torch.cat((alibi_slopes, alibi_slopes.new_zeros(alibi_slopes.shape)))
    return k_packed, v_packed, cu_q, cu_k, alibi_slopes
