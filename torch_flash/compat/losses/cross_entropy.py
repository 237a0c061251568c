"""flash_attn.losses.cross_entropy.CrossEntropyLoss over flash.cross_entropy, with FlashAttention's
signature: label_smoothing, logit_scale, lse_square_scale (z-loss), ignore_index,
inplace_backward, process_group (vocab-parallel logits shards) and return_z_loss.

Any device (FlashAttention's needs CUDA). logit_scale != 1 multiplies the logits first, into an
fp32 copy that the fused loss then reads (one extra pass and buffer). return_z_loss computes the z-loss term,
for logging only as in FlashAttention, from each row's log-sum-exp (one more read of the logits,
no gradient). precomputed_lse is accepted and not needed: the loss computes its own.
inplace_backward=True on logits that are a leaf requiring grad (FlashAttention's tests pass one)
overwrites that leaf with its gradient too, as FlashAttention does; flash.cross_entropy itself
refuses leaves, so such calls go through _LeafInplace.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...ops.cross_entropy import cross_entropy


def _leaf_storage(t: Tensor) -> bool:
    """Whether t is a leaf that requires grad, or a view of one."""
    base = t if t._base is None else t._base
    return t.requires_grad and base.is_leaf


class _LeafInplace(torch.autograd.Function):
    """flash.cross_entropy whose backward writes the gradient over the logits, for a leaf."""

    @staticmethod
    def forward(ctx, logits, target, options, reduction):
        loss, lse = torch.ops.flash.cross_entropy_with_lse(logits, target, **options, reduction=reduction)
        ctx.save_for_backward(logits, target, lse)
        ctx.options, ctx.reduction = options, reduction
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse = ctx.saved_tensors
        torch.ops.flash.cross_entropy_backward_inplace(grad_loss.contiguous(), logits, target, lse, **ctx.options,
                                                       reduction=ctx.reduction)
        return logits, None, None, None


class CrossEntropyLoss(nn.Module):
    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 logit_scale: float = 1.0, lse_square_scale: float = 0.0, inplace_backward: bool = False,
                 process_group=None, return_z_loss: bool = False):
        """ignore_index rows get loss 0; lse_square_scale > 0 adds lse_square_scale * lse^2 per row;
        inplace_backward writes the gradient over the logits; process_group: each rank holds a
        shard of the vocabulary (the loss is over the whole vocabulary)."""
        super().__init__()
        if reduction not in ("mean", "none", "sum"):
            raise NotImplementedError("Only support reduction = 'mean' or 'none' or 'sum'")
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.logit_scale = label_smoothing, logit_scale
        self.lse_square_scale, self.inplace_backward = lse_square_scale, inplace_backward
        self.process_group, self.return_z_loss = process_group, return_z_loss

    def forward(self, input: Tensor, target: Tensor, precomputed_lse: Tensor | None = None):
        """input (batch, vocab) (this rank's shard with process_group), target (batch,) ->
        loss: (batch,) with reduction 'none', else a scalar, fp32; (loss, z_loss) with
        return_z_loss."""
        # scaled in fp32, as FlashAttention's kernel does (a half copy would round the scaled logits)
        logits = input.float() * self.logit_scale if self.logit_scale != 1.0 else input
        if (self.inplace_backward and self.process_group is None and torch.is_grad_enabled()
                and _leaf_storage(logits)):
            options = dict(ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
                           z_loss=self.lse_square_scale)
            loss = _LeafInplace.apply(logits, target, options, self.reduction)
        else:
            loss = cross_entropy(logits, target, ignore_index=self.ignore_index,
                                 label_smoothing=self.label_smoothing, z_loss=self.lse_square_scale,
                                 reduction=self.reduction, inplace_backward=self.inplace_backward,
                                 process_group=self.process_group)
        if not self.return_z_loss:
            return loss
        with torch.no_grad():
            lse = self._lse(logits)
            z = (self.lse_square_scale * lse.square()).masked_fill(target == self.ignore_index, 0.0)
            if self.reduction == "mean":
                z = z.sum() / (target != self.ignore_index).sum()
            elif self.reduction == "sum":
                z = z.sum()
        return loss, z

    def _lse(self, logits: Tensor) -> Tensor:
        """Each row's fp32 log-sum-exp over the whole vocabulary (all shards)."""
        lse = torch.logsumexp(logits.float(), dim=-1)
        if self.process_group is None:
            return lse
        top = lse.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.process_group)
        total = torch.exp(lse - top)
        dist.all_reduce(total, group=self.process_group)
        return top + torch.log(total)
