"""S_dmask of FlashAttention's return_attn_probs=True: the attention probabilities with the dropout
pattern of the call, in the encoding FlashAttention's tests decode (a test-only output: O(S^2)).

FlashAttention returns S_dmask (B, H, Sq_rounded, Sk_rounded) (rounded up to 128) only when
dropout_p > 0: exp(s - m) per key block, negative where the element was dropped. Its tests
(convert_flash_attn_S_to_softmax, normalize_flash_attn_S) take abs() and rescale block by block
with `_get_block_size_n`; here m is the row's maximum over all its keys, which that rescaling
turns into the softmax when the block size covers the row (torch_flash.testing.fa_shim gives it
so). The keep mask is the kernels' own: Philox on (key, query, sequence * H + head) keyed by the
call's seed (torch_flash/reference/attention.py), so S_dmask matches what the call dropped.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..reference import attention as ref

ROUND = 128  # FlashAttention's S_dmask pads both sequence dims to a multiple of this


def _round(n: int) -> int:
    return -(-n // ROUND) * ROUND


def _signed_probs(q: Tensor, k: Tensor, spec: ref.Spec, pos: ref.Positions) -> Tensor:
    """(B, Hq, Sq, Sk) fp32: exp(s - rowmax), negated where dropout dropped it (0 where masked).
    q (B, Hq, Sq, D), k (B, Hkv, Sk, D)."""
    B, Hq, Sq, _ = q.shape
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    k = k.to(cdt).repeat_interleave(Hq // k.shape[1], dim=1)
    s = q.to(cdt) @ k.transpose(-1, -2) * spec.scale
    if spec.softcap > 0:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    if spec.alibi_slopes is not None:
        s = s + ref.alibi_bias(spec.alibi_slopes, pos, 0, Sq, cdt)
    vis = ref.visible(pos, 0, Sq, spec)
    if vis is not None:
        s = s.masked_fill(~vis, -math.inf)
    m = s.amax(-1, keepdim=True)
    a = torch.exp(s - m.masked_fill(m == -math.inf, 0.0))
    keep = ref.dropout_keep(spec, pos, B, Hq, 0, Sq)
    return torch.where(keep, a, -a)


def dense(q: Tensor, k: Tensor, spec: ref.Spec) -> Tensor:
    """S_dmask of a dense call: q (B, Hq, Sq, D), k (B, Hkv, Sk, D) (SDPA layout) ->
    (B, Hq, round(Sq), round(Sk)) in q's dtype."""
    B, Hq, Sq, _ = q.shape
    Sk = k.shape[2]
    p = _signed_probs(q, k, spec, ref.dense_positions(Sq, Sk, q.device))
    out = q.new_zeros(B, Hq, _round(Sq), _round(Sk))
    out[:, :, :Sq, :Sk] = p
    return out


def varlen(q: Tensor, k: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
           max_seqlen_k: int, spec: ref.Spec) -> Tensor:
    """S_dmask of a varlen call: packed q (Tq, Hq, D), k (Tk, Hkv, D) -> (B, Hq, round(max_seqlen_q),
    round(max_seqlen_k)) in q's dtype, sequence b's block at the top left of row b. Reads the
    offsets on the host (a test-only output)."""
    B = cu_seqlens_q.shape[0] - 1
    out = q.new_zeros(B, q.shape[1], _round(max_seqlen_q), _round(max_seqlen_k))
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(B):
        sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        qb = q[cq[b]:cq[b + 1]].transpose(0, 1)[None]
        kb = k[ck[b]:ck[b + 1]].transpose(0, 1)[None]
        dense_pos = ref.dense_positions(sq, sk, q.device)
        # sequence b's own Philox counters and ALiBi row: packed positions with q_seq = k_seq = b
        pos = ref.Positions(dense_pos.q_pos, dense_pos.q_diag, dense_pos.k_pos,
                            torch.full((sq,), b, device=q.device), torch.full((sk,), b, device=q.device))
        out[b, :, :sq, :sk] = _signed_probs(qb, kb, spec, pos)[0]
    return out
