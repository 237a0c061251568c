"""flash.rotary: rotary position embedding (RoPE), schema, dispatch, autograd, public functions.

x (B, H, S, D) with any strides and a contiguous last dim (FlashAttention's (B, S, H, D) is
its .transpose(1, 2) view), or (total, H, D) packed with cu_seqlens (B + 1,). cos/sin are
(S_ro, rd / 2) tables indexed by position, or (B or 1, S, rd / 2) already gathered per
token; rd = 2 * cos.shape[-1] <= D and dims past rd pass through (partial rotary). See
torch_flash/reference/rotary.py for the formula. The rotation is orthogonal, so the
backward is the same op rotating the other way (flash.rotary_backward = conjugate flipped).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op

from .. import _dispatch
from ..reference import rotary as ref
from ._checks import (INDEX_DTYPES, check, check_last_dim_contiguous, check_positive_float,
                      check_same_device, check_tensor)


def check_table(op: str, cos, sin, head_dim, names=("cos", "sin")) -> None:
    """cos/sin tables of the same shape and dtype whose rotary dim fits in head_dim."""
    for name, t in zip(names, (cos, sin)):
        check_tensor(op, name, t, ndim=(2, 3))
    check(cos.shape == sin.shape, op,
          f"{names[0]} shape {tuple(cos.shape)} differs from {names[1]} shape {tuple(sin.shape)}")
    check(cos.dtype == sin.dtype, op, f"{names[0]} dtype {cos.dtype} differs from {names[1]} dtype {sin.dtype}")
    check(cos.shape[-1] > 0, op, f"{names[0]} must have rotary_dim // 2 > 0 columns, got shape {tuple(cos.shape)}")
    check(2 * cos.shape[-1] <= head_dim, op,
          f"rotary_dim {2 * cos.shape[-1]} (2 * {names[0]}.shape[-1]) exceeds the head dim {head_dim}")


def check_args(op: str, x, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens) -> None:
    """x is the input (named grad in rotary_backward)."""
    x_name = "grad" if op == "rotary_backward" else "x"
    packed = cu_seqlens is not None
    check_tensor(op, x_name, x, ndim=3 if packed else 4)
    check_last_dim_contiguous(op, **{x_name: x})
    check_table(op, cos, sin, x.shape[-1])
    check(seqlen_offset >= 0, op, f"seqlen_offset must be >= 0, got {seqlen_offset}")
    if packed:
        check_tensor(op, "cu_seqlens", cu_seqlens, ndim=1, dtypes=INDEX_DTYPES)
        check(cu_seqlens.shape[0] >= 1, op, "cu_seqlens must have batch + 1 >= 1 entries, got 0")
        batch = cu_seqlens.shape[0] - 1
    else:
        batch = x.shape[0]
    if seqlen_offsets is not None:
        check_tensor(op, "seqlen_offsets", seqlen_offsets, ndim=1, dtypes=INDEX_DTYPES)
        check(seqlen_offsets.shape[0] == batch, op,
              f"seqlen_offsets has {seqlen_offsets.shape[0]} entries, expected batch size {batch}")
    if cos.dim() == 3:
        check(not packed, op, "cos/sin gathered per token (3-D) need x of shape (B, H, S, D), not packed")
        check(seqlen_offset == 0 and seqlen_offsets is None, op,
              "cos/sin gathered per token (3-D) take no seqlen_offset/seqlen_offsets")
        check(cos.shape[0] in (1, batch) and cos.shape[1] == x.shape[2], op,
              f"cos/sin of shape {tuple(cos.shape)} must be (B or 1, S, rotary_dim // 2) "
              f"for x of shape {tuple(x.shape)}")
    elif not packed:
        check(x.shape[2] + seqlen_offset <= cos.shape[0], op,
              f"cos/sin have {cos.shape[0]} positions, fewer than seqlen {x.shape[2]} + "
              f"seqlen_offset {seqlen_offset}")
    check_same_device(op, x=x, cos=cos, sin=sin, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens)


def values_known(t) -> bool:
    """Whether t holds real values: not a fake tensor of a trace (torch.compile runs a
    triton_op's implementation on fake tensors) nor a meta tensor."""
    return not is_fake(t) and t.device.type != "meta"


def check_data(op: str, x, cos, seqlen_offset, seqlen_offsets, cu_seqlens) -> None:
    """The checks that read index values: eager calls on the reference path only (a trace
    has no values, and the kernels trust their callers)."""
    if not values_known(x):
        return
    if cu_seqlens is not None:
        cu = cu_seqlens.long()
        check(cu[0].item() == 0 and bool((cu.diff() >= 0).all()) and cu[-1].item() == x.shape[0], op,
              f"cu_seqlens must start at 0, not decrease and end at total tokens {x.shape[0]}, "
              f"got {cu_seqlens.tolist()}")
    if seqlen_offsets is not None:
        check(bool((seqlen_offsets >= 0).all()), op,
              f"seqlen_offsets must be >= 0, got {seqlen_offsets.tolist()}")
    if cos.dim() == 2 and (seqlen_offsets is not None or cu_seqlens is not None) and x.numel():
        last = ref.positions(x, seqlen_offset, seqlen_offsets, cu_seqlens).max().item()
        check(last < cos.shape[0], op,
              f"cos/sin have {cos.shape[0]} positions, but a token sits at position {last}")


def _rotary_impl(op: str, x, cos, sin, interleaved, seqlen_offset, seqlen_offsets, cu_seqlens,
                 conjugate) -> Tensor:
    check_args(op, x, cos, sin, seqlen_offset, seqlen_offsets, cu_seqlens)
    check_data(op, x, cos, seqlen_offset, seqlen_offsets, cu_seqlens)
    triton = _dispatch.triton_can_run(x.device)
    if triton:
        from ..kernels.triton.rotary import rotary_supports
        triton = rotary_supports(x, cos, sin)
    if _dispatch.select(op, x.device, triton=triton) == "triton":
        from ..kernels.triton.rotary import rotary_apply
        return rotary_apply(x, cos, sin, interleaved=interleaved, seqlen_offset=seqlen_offset,
                            seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens, conjugate=conjugate,
                            out=torch.empty_like(x))
    out = ref.rotary(x, cos, sin, interleaved, seqlen_offset, seqlen_offsets, cu_seqlens, conjugate)
    # x's own layout (a kernel writes into empty_like(x)), so the fake can promise it
    return torch.empty_like(x).copy_(out)


@triton_op("flash::rotary", mutates_args=())
def _rotary(x: Tensor, cos: Tensor, sin: Tensor, seqlen_offsets: Optional[Tensor] = None,
            cu_seqlens: Optional[Tensor] = None, *, interleaved: bool = False, seqlen_offset: int = 0,
            conjugate: bool = False) -> Tensor:
    return _rotary_impl("rotary", x, cos, sin, interleaved, seqlen_offset, seqlen_offsets, cu_seqlens,
                        conjugate)


@triton_op("flash::rotary_backward", mutates_args=())
def _rotary_backward(grad: Tensor, cos: Tensor, sin: Tensor, seqlen_offsets: Optional[Tensor] = None,
                     cu_seqlens: Optional[Tensor] = None, *, interleaved: bool = False,
                     seqlen_offset: int = 0, conjugate: bool = False) -> Tensor:
    """Gradient of flash.rotary with the same flags: the rotation by the opposite angle."""
    return _rotary_impl("rotary_backward", grad, cos, sin, interleaved, seqlen_offset, seqlen_offsets,
                        cu_seqlens, not conjugate)


def _setup(ctx, inputs, keyword_only_inputs, output):
    _, cos, sin, seqlen_offsets, cu_seqlens = inputs
    ctx.save_for_backward(cos, sin, seqlen_offsets, cu_seqlens)
    ctx.flags = dict(keyword_only_inputs)


def _backward_via(op_name: str):
    """rotary and rotary_backward with the same flags are each other's gradient (so the
    backward is differentiable too). cos/sin are tables: no gradient."""
    def backward(ctx, grad):
        cos, sin, seqlen_offsets, cu_seqlens = ctx.saved_tensors
        if grad.stride(-1) != 1:  # e.g. the expanded gradient of a sum()
            grad = grad.clone(memory_format=torch.contiguous_format)
        dx = getattr(torch.ops.flash, op_name)(grad, cos, sin, seqlen_offsets, cu_seqlens, **ctx.flags)
        return dx, None, None, None, None
    return backward


_rotary.register_autograd(_backward_via("rotary_backward"), setup_context=_setup)
_rotary_backward.register_autograd(_backward_via("rotary"), setup_context=_setup)


def rotary(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False,
           seqlen_offsets: Union[int, Tensor] = 0, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """Rotary position embedding of x, returned in x's dtype and layout.

    x: (B, H, S, D) (any strides, contiguous last dim), or (total, H, D) packed with
    cu_seqlens (B + 1,) int32. cos/sin: (S_ro, rotary_dim // 2) tables (see rotary_cos_sin),
    or (B or 1, S, rotary_dim // 2) already gathered per token (no offsets then). Token s
    of sequence b sits at position s + seqlen_offsets (an int, or a (B,) int tensor: one
    offset per sequence, as in KV-cache decoding). interleaved=False rotates the halves
    of the first rotary_dim dims (GPT-NeoX, LLaMA), True the pairs (x[2i], x[2i+1]) (GPT-J);
    dims past rotary_dim pass through. Differentiable in x.
    """
    if isinstance(seqlen_offsets, Tensor):
        return torch.ops.flash.rotary(x, cos, sin, interleaved=interleaved,
                                      seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens)
    return torch.ops.flash.rotary(x, cos, sin, interleaved=interleaved, seqlen_offset=seqlen_offsets,
                                  cu_seqlens=cu_seqlens)


def rotary_cos_sin(seqlen: int, rotary_dim: int, base: float = 10000.0, device=None,
                   dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """(cos, sin) tables of shape (seqlen, rotary_dim // 2) for positions 0..seqlen-1:
    angle pos * base ** (-2i / rotary_dim), computed in fp32 (fp64 for fp64) as HF does."""
    op = "rotary_cos_sin"
    check(rotary_dim > 0 and rotary_dim % 2 == 0, op, f"rotary_dim must be even and > 0, got {rotary_dim}")
    check(seqlen >= 0, op, f"seqlen must be >= 0, got {seqlen}")
    check_positive_float(op, "base", base)
    check(dtype.is_floating_point, op, f"dtype must be floating point, got {dtype}")
    return ref.rotary_cos_sin(seqlen, rotary_dim, base, device, dtype)
