"""Fakes for flash.rotary, flash.rotary_qk, their backward ops and their in-place forms."""
import torch

from torch_flash.ops.rotary import check_args, check_inplace_args, check_qk_args, grad_rows


@torch.library.register_fake("flash::rotary")
def rotary(x, cos, sin, seqlen_offsets=None, cu_seqlens=None, *, interleaved=False, seqlen_offset=0,
           conjugate=False):
    check_args("rotary", x, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens)
    return torch.empty_like(x)


@torch.library.register_fake("flash::rotary_backward")
def rotary_backward(grad, cos, sin, seqlen_offsets=None, cu_seqlens=None, *, interleaved=False,
                    seqlen_offset=0, conjugate=False):
    grad = grad_rows(grad)
    check_args("rotary_backward", grad, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens, "grad")
    return torch.empty_like(grad)


@torch.library.register_fake("flash::rotary_qk")
def rotary_qk(q, k, cos, sin, seqlen_offsets=None, cu_seqlens=None, *, interleaved=False, seqlen_offset=0,
              conjugate=False):
    check_qk_args("rotary_qk", q, k, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens)
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.register_fake("flash::rotary_qk_backward")
def rotary_qk_backward(grad_q, grad_k, cos, sin, seqlen_offsets=None, cu_seqlens=None, *, interleaved=False,
                       seqlen_offset=0, conjugate=False):
    grad_q, grad_k = grad_rows(grad_q), grad_rows(grad_k)
    check_qk_args("rotary_qk_backward", grad_q, grad_k, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens,
                  ("grad_q", "grad_k"))
    return torch.empty_like(grad_q), torch.empty_like(grad_k)


@torch.library.register_fake("flash::rotary_")
def rotary_(x, cos, sin, seqlen_offsets=None, cu_seqlens=None, *, interleaved=False, seqlen_offset=0,
            conjugate=False):
    check_inplace_args("rotary_", {"x": x}, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens)


@torch.library.register_fake("flash::rotary_qk_")
def rotary_qk_(q, k, cos, sin, seqlen_offsets=None, cu_seqlens=None, *, interleaved=False, seqlen_offset=0,
               conjugate=False):
    check_inplace_args("rotary_qk_", {"q": q, "k": k}, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens)
