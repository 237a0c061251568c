"""Attention sinks around kernels that have none: the Hopper forward (csrc/attention), cuDNN's
and the Hopper backward. A sink is one more softmax column per head, of logit sinks[h], that
takes probability and adds no value, so for each row

    lse = logaddexp(lse0, sink),  out = out0 * exp(lse0 - lse)

from the sink-free forward's (out0, lse0); and a backward that recomputes the probabilities
from the lse it is given gets dq, dk and dv right from the sink's lse unchanged. Only the
sinks' own gradient needs a pass: the delta kernel's (attention_backward.py, ref.sink_grad).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import _INTERPRET, _bhm, _grid, _load_tile, _lse_strides, _pow2, _store_tile
from .attention_backward import _attn_bwd_delta, _rows, delta_args
from .launch import launch

_TILE = 256 if _INTERPRET else 8192  # rows x padded D of one rescale program


@triton.jit
def _sink_rescale(Out, Lse, Sinks, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, SEQ,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """In place, BLOCK_M rows of one (batch, head): lse = logaddexp(lse, sink), out scaled by
    exp(old lse - new lse). A sink of -inf leaves both alone; lse is finite on every row."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    lse_ptrs = Lse + b64 * stride_lb + h64 * stride_lh + offs_m
    lse0 = tl.load(lse_ptrs, mask=offs_m < SEQ, other=0.0)
    sink = tl.load(Sinks + h).to(tl.float32)
    top = tl.maximum(lse0, sink)
    lse = top + tl.log(tl.exp(lse0 - top) + tl.exp(sink - top))
    tl.store(lse_ptrs, lse, mask=offs_m < SEQ)
    o_base = Out + b64 * stride_ob + h64 * stride_oh
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_tile(o_base, offs_m, stride_om, SEQ, offs_d, HEAD_DIM, BLOCK_D, True).to(tl.float32)
    _store_tile(o_base, offs_m, stride_om, SEQ, offs_d, HEAD_DIM,
                (o * tl.exp(lse0 - lse)[:, None]).to(Out.dtype.element_ty))


def add_sinks_(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Turns a sink-free forward's out (B, Hq, Sq, Dv), last dim contiguous, and lse (B, Hq,
    Sq) fp32 into those of attention with sinks (Hq,), in place."""
    b, h, s, d = out.shape
    if out.numel() == 0:
        return
    block_d = _pow2(d)
    launch(_sink_rescale, _grid(s, h, b), Out=out, Lse=lse, Sinks=sinks, **_bhm(out, "o", "m"),
           **_lse_strides(lse), SEQ=s, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=max(16, _TILE // block_d))


def sink_grad(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks (Hq,) in sinks' dtype of dense attention with sinks (no lse gradient):
    the sum over rows of -exp(sink - lse) * rowsum(dO * O), one pass of the delta kernel."""
    b, h, s, _ = out.shape
    if out.numel() == 0:
        return torch.zeros_like(sinks)
    grad_out, out = _rows(grad_out), _rows(out)
    scalars, parts_shape = delta_args(out, grad_out, lse, False, b, s, True)
    parts = torch.empty(parts_shape, dtype=torch.float32, device=out.device)
    delta = torch.empty_like(lse)
    launch(_attn_bwd_delta, _grid(s, h, b), Out=out, DO=grad_out, GradLse=lse, Delta=delta,
           CuQ=out.new_empty(0, dtype=torch.int32), Lse=lse, Sinks=sinks, SinkPart=parts, **scalars)
    return parts.sum((0, 2)).to(sinks.dtype)
