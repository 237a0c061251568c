"""flash_attn.bert_padding: move tokens between padded (batch, seqlen, ...) and packed
(total_tokens, ...) layouts for the varlen functions. Same names, signatures and returns as
FlashAttention's module (differentiable; plain PyTorch indexing, no einops)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def index_first_axis(input: Tensor, indices: Tensor) -> Tensor:
    """input (N, ...) -> input[indices] (len(indices), ...)."""
    return input[indices]


def index_put_first_axis(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    """A zero (first_axis_dim, ...) tensor with values (len(indices), ...) at rows indices."""
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    return out.index_put((indices,), values)


class _IndexFirstAxisResidual(torch.autograd.Function):
    """(input[indices], input detached); the gradient of the second output flows back to input
    too (FlashAttention's fused-MLP residual trick)."""

    @staticmethod
    def forward(ctx, input, indices):
        ctx.save_for_backward(indices)
        return input[indices], input.detach()

    @staticmethod
    def backward(ctx, grad_output, grad_residual):
        (indices,) = ctx.saved_tensors
        return grad_residual.index_add(0, indices, grad_output), None


index_first_axis_residual = _IndexFirstAxisResidual.apply


def _packed(hidden_states: Tensor, keep: Tensor, seqlens: Tensor):
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens, int(seqlens.max())


def unpad_input(hidden_states: Tensor, attention_mask: Tensor, unused_mask: Tensor | None = None):
    """hidden_states (batch, seqlen, ...), attention_mask (batch, seqlen) bool/int (1: a token),
    unused_mask (batch, seqlen) (1: allocated but unused, kept in the packed tensor) ->
    (hidden (total, ...), indices (total,) into the flattened (batch * seqlen), cu_seqlens
    (batch + 1,) int32, max_seqlen_in_batch int, seqused (batch,) int32 tokens per sequence
    selected by attention_mask alone). Reads the mask on the host (max_seqlen)."""
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    packed = _packed(hidden_states, all_masks, all_masks.sum(dim=-1, dtype=torch.int32))
    return (*packed, attention_mask.sum(dim=-1, dtype=torch.int32))


def unpad_input_for_concatenated_sequences(hidden_states: Tensor, attention_mask_in_length: Tensor):
    """Several short samples per row: attention_mask_in_length (batch, seqlen) holds each row's
    sample lengths first, then zeros (e.g. [2, 3, 0, 0, 0, 0]). Returns (hidden (total, ...),
    indices, cu_seqlens (samples + 1,) int32, max_seqlen_in_batch)."""
    length = attention_mask_in_length.sum(dim=-1)
    seqlen = attention_mask_in_length.shape[-1]
    keep = torch.arange(seqlen, device=length.device, dtype=length.dtype) < length[:, None]
    flat = attention_mask_in_length.flatten()
    return _packed(hidden_states, keep, flat[flat != 0])


def pad_input(hidden_states: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """hidden_states (total, ...) at indices of the flattened (batch * seqlen) -> (batch, seqlen, ...),
    zero at the padding."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view(batch, seqlen, *out.shape[1:])
