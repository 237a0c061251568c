"""flash.attention_varlen: attention over packed variable-length sequences.

Shapes: q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), Hq % Hkv == 0; cu_seqlens_q/_k
int32 or int64 (batch + 1,), starting at 0 and ending at Tq / Tk; out (Tq, Hq, Dv)
contiguous in q's dtype, lse (Hq, Tq) fp32 (fp64 for fp64 inputs). max_seqlen_q/_k are
upper bounds on the sequence lengths (kernels size their grids by them; no host sync).
alibi_slopes: fp32 (Hq,) or (batch, Hq), one row per sequence; sinks (Hq,), differentiable (their
gradient from out, lse and the upstream gradients, as flash.attention's).
Per-sequence semantics and the dropout mask: torch_flash/reference/attention_varlen.py.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from ..reference import attention_varlen as ref
from ..reference._common import compute_dtype
from ._autograd import (ARG, GRAD, GRAD_OR_NONE, SAVED, Spec, Src, call, grad_or_empty, register_autograd_spec,
                        triton_op)
from ._checks import INDEX_DTYPES, check, check_same_device, check_tensor
from ._plans import Plans
from .attention import (check_alibi, check_common, check_saved_and_grads, check_sinks, kernel_flags, op_kwargs,
                        ref_sinks_grad, spec_of, use_triton)


def check_cu_seqlens(op: str, name: str, cu_seqlens) -> None:
    check_tensor(op, name, cu_seqlens, ndim=1, dtypes=INDEX_DTYPES)
    check(cu_seqlens.shape[0] >= 1, op, f"{name} must hold batch + 1 >= 1 offsets, got none")


def check_args(op: str, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               softcap, dropout_p, dropout_seed, window_left, window_right, alibi_slopes=None, sinks=None) -> None:
    """Metadata checks (the fake runs them too); the offsets' values: check_offsets."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(op, name, t, ndim=3)
    check_common(op, q, k, v, 0, softcap, dropout_p, dropout_seed, window_left, window_right)
    check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q)
    check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k)
    check_same_device(op, q=q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    check(cu_seqlens_q.shape[0] == cu_seqlens_k.shape[0], op,
          f"cu_seqlens_q has {cu_seqlens_q.shape[0]} offsets but cu_seqlens_k has {cu_seqlens_k.shape[0]}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        check(m >= 0, op, f"{name} must be >= 0, got {m}")
    check_alibi(op, alibi_slopes, q, cu_seqlens_q.shape[0] - 1)
    check_sinks(op, sinks, q)


def check_offsets(op: str, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, total_q: int, total_k: int,
                  max_seqlen_q: int, max_seqlen_k: int) -> None:
    """Checks of the offsets' values (they read the data)."""
    for x, cu, total, longest in (("q", cu_seqlens_q, total_q, max_seqlen_q),
                                  ("k", cu_seqlens_k, total_k, max_seqlen_k)):
        name = f"cu_seqlens_{x}"
        c = cu.tolist()
        lengths = [b - a for a, b in zip(c[:-1], c[1:])]
        check(c[0] == 0 and c[-1] == total, op,
              f"{name} must run from 0 to the {total} tokens, got {c[0]} .. {c[-1]}")
        check(min(lengths, default=0) >= 0, op, f"{name} must be non-decreasing, got {c}")
        most = max(lengths, default=0)
        check(most <= longest, op,
              f"{name} holds a sequence of {most} tokens, more than max_seqlen_{x}={longest}")


def check_backward_args(op: str, grad_out, grad_lse, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, out, lse, softcap, dropout_p, dropout_seed, window_left,
                        window_right, alibi_slopes=None, sinks=None) -> None:
    check_args(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softcap,
               dropout_p, dropout_seed, window_left, window_right, alibi_slopes, sinks)
    check_saved_and_grads(op, q, v, out, lse, grad_out, grad_lse, out_shapes(q, v))


def out_shapes(q, v) -> tuple[tuple, tuple, torch.dtype]:
    """(out shape, lse shape, lse dtype)."""
    return (q.shape[0], q.shape[1], v.shape[-1]), (q.shape[1], q.shape[0]), compute_dtype(q.dtype)


# signature -> the Triton kernels' AttentionFwd / AttentionBwd plan, or None (the reference path)
FORWARD_PLANS, BACKWARD_PLANS = Plans(), Plans()


@triton_op("flash::attention_varlen", mutates_args=())
def _attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                      max_seqlen_q: int, max_seqlen_k: int, dropout_seed: Optional[Tensor] = None,
                      alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None, *,
                      scale: Optional[float] = None, causal: bool = False,
                      window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                      dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    op = "attention_varlen"

    def make():
        check_args(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softcap,
                   dropout_p, dropout_seed, window_left, window_right, alibi_slopes, sinks)
        spec = spec_of(q, scale, causal, window_left, window_right, softcap, dropout_p, dropout_seed, alibi_slopes,
                       sinks)
        if not use_triton(op, q, k, v, None, dropout_p):
            return None
        from ..kernels.triton.attention import AttentionFwd
        return AttentionFwd(q, k, v, None, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q.shape[0] - 1, max_seqlen_q,
                            max_seqlen_k, kernel_flags(spec), sinks)
    values = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_seed, alibi_slopes, sinks,
              scale, causal, window_left, window_right, softcap, dropout_p)
    plan = FORWARD_PLANS.get(op, values, make)
    # the offsets' values only where reading them costs nothing: CPU tensors with data
    # (not on GPU: host sync; not the fake tensors of torch.compile tracing this body)
    if cu_seqlens_q.device.type == "cpu" and not is_fake(cu_seqlens_q):
        check_offsets(op, cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                      max_seqlen_k)
    if plan is not None:
        return plan(q, k, v, None, cu_seqlens_q, cu_seqlens_k, dropout_seed, alibi_slopes, sinks)
    spec = spec_of(q, scale, causal, window_left, window_right, softcap, dropout_p, dropout_seed, alibi_slopes, sinks)
    return ref.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, spec)


@triton_op("flash::attention_varlen_backward", mutates_args=())
def _attention_varlen_backward(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor,
                               v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                               max_seqlen_q: int, max_seqlen_k: int, out: Tensor, lse: Tensor,
                               scale: Optional[float], causal: bool, window_left: int, window_right: int,
                               softcap: float, dropout_p: float, dropout_seed: Optional[Tensor],
                               alibi_slopes: Optional[Tensor] = None,
                               sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks): dsinks (Hq,) in sinks' dtype, empty without sinks; the ALiBi slopes
    get no gradient."""
    op = "attention_varlen_backward"

    def make():
        check_backward_args(op, grad_out, grad_lse, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, out, lse, softcap, dropout_p, dropout_seed, window_left, window_right,
                            alibi_slopes, sinks)
        spec = spec_of(q, scale, causal, window_left, window_right, softcap, dropout_p, dropout_seed, alibi_slopes,
                       sinks)
        if not use_triton(op, q, k, v, None, dropout_p):
            return None
        from ..kernels.triton.attention_backward import AttentionBwd
        return AttentionBwd(grad_out, grad_lse, q, k, v, None, out, lse, cu_seqlens_q, cu_seqlens_k,
                            cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k, kernel_flags(spec), False,
                            deterministic=True, sinks=sinks)
    values = (grad_out, grad_lse, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse,
              scale, causal, window_left, window_right, softcap, dropout_p, dropout_seed, alibi_slopes, sinks)
    plan = BACKWARD_PLANS.get(op, values, make)
    if plan is not None:
        dq, dk, dv, _, dsinks = plan(grad_out, grad_lse, q, k, v, None, out, lse, cu_seqlens_q, cu_seqlens_k,
                                     dropout_seed, alibi_slopes, sinks)
        return dq, dk, dv, grad_or_empty(dsinks, q)
    spec = spec_of(q, scale, causal, window_left, window_right, softcap, dropout_p, dropout_seed, alibi_slopes,
                   sinks)
    return (*ref.backward(grad_out, grad_lse, q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, spec),
            ref_sinks_grad(sinks, out, grad_out, lse, grad_lse, q))


# The backward op gives dq, dk, dv and dsinks from the saved out and lse.
_SAVED = tuple(Src(SAVED, i) for i in range(10))
register_autograd_spec(_attention_varlen, Spec(
    outputs=(0, 1),
    save=("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", 0, 1, "dropout_seed", "alibi_slopes", "sinks"),
    backward="attention_varlen_backward",
    backward_args=(Src(GRAD, 0), Src(GRAD_OR_NONE, 1), *_SAVED[:5], Src(ARG, "max_seqlen_q"),
                   Src(ARG, "max_seqlen_k"), *_SAVED[5:7],
                   *(Src(ARG, n) for n in ("scale", "causal", "window_left", "window_right", "softcap", "dropout_p")),
                   *_SAVED[7:]),
    grads=(("q", 0, None), ("k", 1, None), ("v", 2, None), ("sinks", 3, None))))


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, *,
                     scale: Optional[float] = None, causal: bool = False,
                     window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     dropout_p: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                     sinks: Optional[Tensor] = None, return_lse: bool = False):
    """Attention within each of the packed sequences (FlashAttention's varlen API).

    q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv): the tokens of all sequences end to end;
    cu_seqlens_q / cu_seqlens_k (batch + 1,) int32: cumulative sequence lengths from 0.
    max_seqlen_q / max_seqlen_k: a hint, an upper bound on the longest sequence that sizes
    the kernels' grids. Omitted, the bound is the total token count Tq / Tk: no host
    synchronisation (the call compiles with fullgraph=True and records in CUDA graphs), at the
    cost of grid programs that exit at once.
    scale, causal, window, softcap, dropout_p, alibi_slopes, sinks as in `torch_flash.attention`, per
    sequence (causal, window and ALiBi's distance aligned bottom-right within each sequence;
    (batch, Hq) slopes give each sequence its own row).
    Returns out (Tq, Hq, Dv), or (out, lse (Hq, Tq) fp32) with return_lse=True.
    """
    kwargs = op_kwargs("attention_varlen", scale, causal, window, softcap, dropout_p)
    seed = kwargs.pop("dropout_seed")
    out, lse = call("attention_varlen",
                    q, k, v, cu_seqlens_q, cu_seqlens_k, q.shape[0] if max_seqlen_q is None else max_seqlen_q,
                    k.shape[0] if max_seqlen_k is None else max_seqlen_k, seed, alibi_slopes, sinks, **kwargs)
    return (out, lse) if return_lse else out
