"""Plain-PyTorch variable-length attention over packed sequences.

q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv); sequence b holds query tokens
cu_seqlens_q[b]:cu_seqlens_q[b+1] and key tokens cu_seqlens_k[b]:cu_seqlens_k[b+1], and
attends only within itself, by the rules of torch_flash/reference/attention.py per
sequence (causal/window aligned bottom-right within each sequence; ALiBi's distance too,
with (B, Hq) slopes picked by sequence; attention sinks per head). out (Tq, Hq, Dv),
lse (Hq, Tq). Dropout draws the mask of the dense rule with b the sequence and i, j
positions within it.

The CPU path runs the dense chunked path over the packed tokens with that mask, built
from the offsets with tensor ops: no host reads, so torch.compile can trace it (an
op's body is traced there); it costs Tq*Tk score work instead of the sum over sequences.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import attention as dense


def _as_dense(t: Tensor) -> Tensor:
    """(T, H, D) -> (1, H, T, D), a view."""
    return t.transpose(0, 1).unsqueeze(0)


def _from_dense(t: Tensor) -> Tensor:
    """(1, H, T, D) -> contiguous (T, H, D)."""
    return t[0].transpose(0, 1).contiguous()


def positions(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, tq: int, tk: int) -> dense.Positions:
    """Sequence id, index within the sequence and bottom-right diagonal of every packed token."""
    def locate(cu, total):
        cu = cu.long()
        seq = torch.searchsorted(cu, torch.arange(total, device=cu.device), right=True) - 1
        return seq, torch.arange(total, device=cu.device) - cu[seq]

    q_seq, q_pos = locate(cu_seqlens_q, tq)
    k_seq, k_pos = locate(cu_seqlens_k, tk)
    lengths_q, lengths_k = cu_seqlens_q.long().diff(), cu_seqlens_k.long().diff()
    q_diag = q_pos + (lengths_k - lengths_q)[q_seq]
    return dense.Positions(q_pos, q_diag, k_pos, q_seq, k_seq)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None, causal=False,
                     window=(-1, -1), softcap=0.0, dropout_p=0.0, dropout_seed=None, alibi_slopes=None,
                     sinks=None):
    """(out, lse) by the formula: the naive dense attention over the packed tokens, masked
    to each sequence's block, O(Tq*Tk) memory. Differentiable."""
    pos = positions(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    out, lse = dense.attention_with_lse(_as_dense(q), _as_dense(k), _as_dense(v), scale=scale,
                                        causal=causal, window=window, softcap=softcap,
                                        dropout_p=dropout_p, dropout_seed=dropout_seed,
                                        alibi_slopes=alibi_slopes, sinks=sinks, positions=pos)
    return out[0].transpose(0, 1), lse[0]


def forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
            spec: dense.Spec) -> tuple[Tensor, Tensor]:
    """(out (Tq, Hq, Dv) contiguous in q's dtype, lse (Hq, Tq) contiguous)."""
    pos = positions(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    out, lse = dense.forward(_as_dense(q), _as_dense(k), _as_dense(v), None, spec, pos)
    return _from_dense(out), lse[0]


def backward(grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
             cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, out: Tensor, lse: Tensor,
             spec: dense.Spec) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) contiguous in their inputs' dtypes."""
    pos = positions(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    grads = dense.backward(_as_dense(grad_out), None if grad_lse is None else grad_lse[None],
                           _as_dense(q), _as_dense(k), _as_dense(v), None, _as_dense(out),
                           lse[None], spec, False, pos)
    return tuple(_from_dense(g) for g in grads[:3])
