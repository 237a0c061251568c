"""Attention sinks around backwards that have none: cuDNN's and the Hopper one (csrc/attention).
A sink is one more softmax column per head, of logit sinks[h], that takes probability and adds
no value, so for each row lse = logaddexp(lse0, sink) and out = out0 * exp(lse0 - lse) from the
sink-free (out0, lse0) (the Hopper forward applies that in its epilogue); a backward that
recomputes the probabilities from the lse it is given gets dq, dk and dv right from the sinks'
lse unchanged. Only the sinks' own gradient needs a pass: the delta kernel's
(attention_backward.py, ref.sink_grad).
"""
from __future__ import annotations

import torch

from .attention import _grid
from .attention_backward import _attn_bwd_delta, _rows, delta_args
from .launch import launch


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
