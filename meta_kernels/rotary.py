"""Fakes for flash.rotary and flash.rotary_backward."""
import torch

from torch_flash.ops.rotary import check_args


def _fake(op, x, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens):
    check_args(op, x, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens)
    return torch.empty_like(x)


@torch.library.register_fake("flash::rotary")
def rotary(x, cos, sin, seqlen_offsets=None, cu_seqlens=None, *, interleaved=False, seqlen_offset=0,
           conjugate=False):
    return _fake("rotary", x, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens)


@torch.library.register_fake("flash::rotary_backward")
def rotary_backward(grad, cos, sin, seqlen_offsets=None, cu_seqlens=None, *, interleaved=False,
                    seqlen_offset=0, conjugate=False):
    return _fake("rotary_backward", grad, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens)
