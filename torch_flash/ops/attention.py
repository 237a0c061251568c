"""flash.attention and flash.attention_with_lse: schemas, dispatch, autograd, public functions.

Shapes (SDPA layout): q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), Hq % Hkv == 0,
any strides with a contiguous last dim; alibi_slopes fp32 (Hq,) or (B, Hq); sinks (Hq,); out
(B, Hq, Sq, Dv) contiguous in q's dtype, lse (B, Hq, Sq) fp32 (fp64 for fp64 inputs). Semantics
(causal bottom-right, window, softcap, ALiBi, bias, sinks, dropout mask) are spelled out in
torch_flash/reference/attention.py. Only the Triton kernels and the reference take ALiBi and
sinks. The lse includes the sinks; the backward op also gives their gradient, from out, lse and
the upstream gradients (ref.sink_grad).
Both ops share one backward op, fed the lse that the forward computed: `attention`'s
autograd runs `attention_with_lse` underneath so that it never recomputes it.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
from torch import Tensor

from .. import _dispatch, _extension
from ..reference import attention as ref
from ..reference._common import compute_dtype
from ._autograd import (ARG, GRAD, GRAD_OR_NONE, NONE, REQUIRES_GRAD, SAVED, Spec, Src, call, grad_or_empty,
                        register_autograd_spec, triton_op)
from ._checks import (FLOAT_DTYPES, check, check_last_dim_contiguous, check_like, check_probability,
                      check_same_device, check_same_dtype, check_tensor, fail)
from ._plans import Plans


def check_common(op: str, q, k, v, seq_dim: int, softcap, dropout_p, dropout_seed,
                 window_left, window_right) -> None:
    """Checks shared with flash.attention_varlen ((B, H, S, D) or (T, H, D) tensors, heads
    at dim 1): q/k/v agree on dtype, device, head dims, heads and key length (dim
    `seq_dim`), and the scalar arguments are in range."""
    check_same_dtype(op, q=q, k=k, v=v)
    check_same_device(op, q=q, k=k, v=v)
    check(q.shape[-1] > 0 and v.shape[-1] > 0, op,
          f"head dims must be > 0, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    check(k.shape[-1] == q.shape[-1], op, f"k has head dim {k.shape[-1]} but q has {q.shape[-1]}")
    check(v.shape[seq_dim] == k.shape[seq_dim], op,
          f"v has {v.shape[seq_dim]} keys but k has {k.shape[seq_dim]}")
    hq, hkv = q.shape[1], k.shape[1]  # the head dim is 1 in both layouts
    check(v.shape[1] == hkv, op, f"v has {v.shape[1]} heads but k has {hkv}")
    check(hkv > 0 and hq % hkv == 0, op,
          f"q has {hq} heads, which is not a multiple of the {hkv} heads of k and v")
    check_last_dim_contiguous(op, q=q, k=k, v=v)
    check(softcap >= 0, op, f"softcap must be >= 0, got {softcap}")
    check_probability(op, "dropout_p", dropout_p)
    for name, w in (("window_left", window_left), ("window_right", window_right)):
        check(w >= -1, op, f"{name} must be >= -1 (-1 = unbounded), got {w}")
    if dropout_seed is not None:
        check_tensor(op, "dropout_seed", dropout_seed, dtypes=(torch.int64,))
        check(dropout_seed.numel() == 1, op,
              f"dropout_seed must hold one value, got shape {tuple(dropout_seed.shape)}")
        check(dropout_seed.device.type == "cpu" or dropout_seed.device == q.device, op,
              f"dropout_seed must be on the CPU or on {q.device}, got {dropout_seed.device}")
    check(dropout_p == 0 or dropout_seed is not None, op,
          "dropout_seed is required when dropout_p > 0 (the public function draws one)")


def check_alibi(op: str, alibi_slopes, q, batch: int) -> None:
    """alibi_slopes (or None): fp32 (Hq,) or (batch, Hq) on q's device (heads at q's dim 1)."""
    if alibi_slopes is None:
        return
    check_tensor(op, "alibi_slopes", alibi_slopes, ndim=(1, 2), dtypes=(torch.float32,))
    hq = q.shape[1]
    check(tuple(alibi_slopes.shape) in ((hq,), (batch, hq)), op,
          f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; expected (Hq,) = ({hq},) or "
          f"(B, Hq) = ({batch}, {hq})")
    check_same_device(op, q=q, alibi_slopes=alibi_slopes)


def check_sinks(op: str, sinks, q) -> None:
    """sinks (or None): one float logit per q head (heads at q's dim 1), on q's device."""
    if sinks is None:
        return
    check_tensor(op, "sinks", sinks, ndim=1)
    check(sinks.shape[0] == q.shape[1], op,
          f"sinks has shape {tuple(sinks.shape)}; expected (Hq,) = ({q.shape[1]},)")
    check_same_device(op, q=q, sinks=sinks)


def check_args(op: str, q, k, v, attn_bias, softcap, dropout_p, dropout_seed,
               window_left, window_right, alibi_slopes=None, sinks=None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(op, name, t, ndim=4)
    check_common(op, q, k, v, 2, softcap, dropout_p, dropout_seed, window_left, window_right)
    check(k.shape[0] == q.shape[0] and v.shape[0] == q.shape[0], op,
          f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    check_alibi(op, alibi_slopes, q, q.shape[0])
    check_sinks(op, sinks, q)
    if attn_bias is not None:
        check_tensor(op, "attn_bias", attn_bias, dtypes=FLOAT_DTYPES + (torch.bool,))
        check_same_device(op, q=q, attn_bias=attn_bias)
        target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        shape = tuple(attn_bias.shape)
        check(len(shape) <= 4 and all(s in (1, t) for s, t in zip(shape[::-1], target[::-1])), op,
              f"attn_bias of shape {shape} does not broadcast to (B, Hq, Sq, Sk) = {target}")


def out_shapes(q, v) -> tuple[tuple, tuple, torch.dtype]:
    """(out shape, lse shape, lse dtype)."""
    b, hq, sq, _ = q.shape
    return (b, hq, sq, v.shape[-1]), (b, hq, sq), compute_dtype(q.dtype)


def check_backward_args(op: str, grad_out, grad_lse, q, k, v, attn_bias, out, lse, softcap, dropout_p,
                        dropout_seed, window_left, window_right, alibi_slopes=None, sinks=None) -> None:
    check_args(op, q, k, v, attn_bias, softcap, dropout_p, dropout_seed, window_left, window_right,
               alibi_slopes, sinks)
    check_saved_and_grads(op, q, v, out, lse, grad_out, grad_lse, out_shapes(q, v))


def check_saved_and_grads(op: str, q, v, out, lse, grad_out, grad_lse, shapes) -> None:
    """The backward ops' out and lse, as the forward returned them (shapes: out_shapes), and
    the upstream gradients: grad_out like out and in its dtype (the kernels' matmuls take it
    with v's), grad_lse (or None) like lse. A broadcastable or smaller gradient would give
    wrong gradients silently or make a kernel read out of bounds."""
    out_shape, lse_shape, lse_dtype = shapes
    for name, t, shape, dtype in (("out", out, out_shape, q.dtype), ("lse", lse, lse_shape, lse_dtype)):
        check_tensor(op, name, t)
        check(tuple(t.shape) == tuple(shape) and t.dtype == dtype, op,
              f"{name} has shape {tuple(t.shape)} and dtype {t.dtype}; the forward's is {tuple(shape)} {dtype}")
        check_same_device(op, q=q, **{name: t})
    check_like(op, "grad_out", grad_out, out, "out", same_dtype=True)
    if grad_lse is not None:
        check_like(op, "grad_lse", grad_lse, lse, "lse")


def spec_of(q, scale, causal, window_left, window_right, softcap, dropout_p,
            dropout_seed, alibi_slopes=None, sinks=None) -> ref.Spec:
    return ref.Spec(ref.resolve_scale(scale, q.shape[-1]), causal, window_left, window_right,
                    softcap, dropout_p, dropout_seed if dropout_p > 0 else None, alibi_slopes, sinks)


def use_triton(op: str, q: Tensor, k: Tensor, v: Tensor, attn_bias, dropout_p: float) -> bool:
    """Whether this call runs the Triton kernels (torch_flash/kernels/triton/attention.py):
    select() decides, told whether they support these inputs."""
    return _dispatch.select(op, q, triton=_triton_serves(q, k, v, attn_bias, dropout_p)) == "triton"


def _triton_serves(q: Tensor, k: Tensor, v: Tensor, attn_bias, dropout_p: float) -> Callable[[], bool]:
    """Whether the Triton kernels support these inputs, asked by select() where they can run."""
    def serves():
        from ..kernels.triton.attention import supports
        return supports(q, k, v, attn_bias, dropout_p)
    return serves


def sm90_unsupported(q, k, v, causal: bool) -> str | None:
    """Why flash.attention_fwd_sm90's contract excludes these inputs, or None: fp16/bf16 with
    one head dim, non-empty sequences, Sq a multiple of 8 (the kernel's TMA loads), causal only
    with Sq <= Sk (bottom-right aligned: every query row sees a key). Works on fake tensors."""
    sq, sk = q.shape[2], k.shape[2]
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"q, k, v must be float16 or bfloat16, got {q.dtype}"
    if v.shape[-1] != q.shape[-1]:
        return f"v has head dim {v.shape[-1]} but q has {q.shape[-1]}"
    if sq == 0 or sk == 0:
        return f"empty sequences: Sq {sq}, Sk {sk}"
    if sq % 8:
        return f"seqlen_q must be a multiple of 8, got {sq}"
    if causal and sq > sk:
        return f"causal needs seqlen_q <= seqlen_k, got {sq} and {sk}"
    return None


def check_sm90_args(op: str, q, k, v, causal: bool) -> None:
    check_args(op, q, k, v, None, 0.0, 0.0, None, -1, -1)
    reason = sm90_unsupported(q, k, v, causal)
    check(reason is None, op, reason)


def _sm90_serves(q: Tensor, k: Tensor, v: Tensor, attn_bias, spec: ref.Spec) -> bool:
    """Whether the Hopper kernel of csrc/attention (flash.attention_fwd_sm90) serves this call:
    built for this head dim, an sm_90 GPU, within the op's contract, no bias/window/softcap/
    dropout, and the layout its TMA descriptors need (16-byte aligned, strides within 32 bits).
    It takes sinks (in its epilogue) and ALiBi (in its softmax)."""
    info = _extension.build_info()
    if (info is None or "flash::attention_fwd_sm90" not in info["ops"] or q.device.type != "cuda"
            or torch.cuda.get_device_capability(q.device) != (9, 0)):
        return False
    if (q.shape[-1] not in info["hdims"] or sm90_unsupported(q, k, v, spec.causal) is not None
            or attn_bias is not None
            or spec.dropout_p > 0 or spec.softcap > 0 or spec.window_left >= 0 or spec.window_right >= 0):
        return False
    group = q.shape[1] // k.shape[1]
    # in elements: a multiple of 8 is 16 bytes; tensors come from 512-byte aligned allocations
    for t in (q, k, v):
        strides = (t.storage_offset(), *t.stride()[:3])
        if any(s % 8 for s in strides) or max(t.stride()[:3]) * group >= 2**31:
            return False
    return True


# Head dims whose Hopper backward runs by default where cuDNN's does not serve: against FA4 in one
# run, D=128 0.93x-0.99x, D=64 0.94x-1.01x, the Triton backward 0.56x-0.68x (H200, 2026-11-29:
# docs/results/attention/2026-11-29_h200.json, columns cuda-sm90 and triton).
SM90_BWD_DEFAULT_HDIMS = (64, 128)
# Head dims whose Hopper backward goes before cuDNN's: in that run 1.11x-1.18x SDPA's cuDNN
# backward at D=64 and 1.05x-1.09x at D=128 (either mask); the op through cuDNN's adds layout
# copies to SDPA's (0.96x / 1.00x the kernel at D=128 causal S 4k / 16k in an earlier run, filed
# at a973319).
SM90_BWD_BEFORE_CUDNN_HDIMS = (64, 128)
# Head dims whose Hopper backward runs by default under torch.use_deterministic_algorithms (dq
# added in key-block order): in that run (column cuda-sm90-det) 0.94x-1.01x its default mode at
# D=128 and 0.96x-1.01x at D=64, and 1.33x-1.58x the Triton backward's deterministic mode
# (column triton-det).
SM90_BWD_DETERMINISTIC_HDIMS = (64, 128)


def _sm90_bwd_serves(grad_lse, q: Tensor, k: Tensor, v: Tensor, attn_bias, spec: ref.Spec) -> bool:
    """Whether the Hopper backward of csrc/attention (flash.attention_bwd_sm90) serves this call:
    where the forward's kernel would (_sm90_serves), for a head dim it has (backward_hdims), no
    lse gradient; unforced only for SM90_BWD_DEFAULT_HDIMS (after cuDNN's backward where
    SM90_BWD_BEFORE_CUDNN_HDIMS does not put it first), and under
    torch.use_deterministic_algorithms(True), where the kernel adds dq in key-block order
    (bitwise reproducible), for SM90_BWD_DETERMINISTIC_HDIMS."""
    forced = _dispatch.forced_backend()
    if grad_lse is not None or (forced != "cuda" and (
            forced is not None or q.shape[-1] not in SM90_BWD_DEFAULT_HDIMS
            or (torch.are_deterministic_algorithms_enabled() and q.shape[-1] not in SM90_BWD_DETERMINISTIC_HDIMS))):
        return False
    info = _extension.build_info()
    # its dq accumulator and dk/dv are indexed in 32 bits (csrc/attention/attention.cpp)
    return (info is not None and "flash::attention_bwd_sm90" in info["ops"]
            and q.shape[-1] in info.get("backward_hdims", ()) and max(q.numel(), k.numel()) < 2**31
            and _sm90_serves(q, k, v, attn_bias, spec))


def kernel_flags(spec: ref.Spec) -> dict:
    """The Triton launchers' keyword arguments for one call."""
    return dict(scale=spec.scale, causal=spec.causal, window_left=spec.window_left,
                window_right=spec.window_right, softcap=spec.softcap, dropout_p=spec.dropout_p,
                dropout_seed=spec.seed, alibi_slopes=spec.alibi_slopes)


class _Sm90Plan:
    """flash.attention_fwd_sm90 (csrc/attention) for the calls of one signature."""
    path = "cuda"

    def __init__(self, spec: ref.Spec):
        self.scale, self.causal = spec.scale, spec.causal

    def __call__(self, q, k, v, attn_bias, cu_q, cu_k, dropout_seed, alibi_slopes, sinks):
        return torch.ops.flash.attention_fwd_sm90(q, k, v, self.scale, self.causal, sinks, alibi_slopes)


# signature -> _Sm90Plan, the Triton kernels' AttentionFwd, or None (the reference path)
FORWARD_PLANS = Plans()


def _forward(op: str, q, k, v, attn_bias, alibi_slopes, sinks, scale, causal, window_left, window_right,
             softcap, dropout_p, dropout_seed) -> tuple[Tensor, Tensor]:
    def make():
        check_args(op, q, k, v, attn_bias, softcap, dropout_p, dropout_seed, window_left, window_right,
                   alibi_slopes, sinks)
        spec = spec_of(q, scale, causal, window_left, window_right, softcap, dropout_p, dropout_seed,
                       alibi_slopes, sinks)
        backend = _dispatch.select(op, q, triton=_triton_serves(q, k, v, attn_bias, dropout_p),
                                   cuda=lambda: _sm90_serves(q, k, v, attn_bias, spec))
        if backend == "cuda":
            return _Sm90Plan(spec)
        if backend == "triton":
            from ..kernels.triton.attention import AttentionFwd
            return AttentionFwd(q, k, v, attn_bias, None, None, q.shape[0], q.shape[2], k.shape[2],
                                kernel_flags(spec), sinks)
        return None
    values = (q, k, v, attn_bias, dropout_seed, alibi_slopes, sinks, scale, causal, window_left, window_right,
              softcap, dropout_p)
    plan = FORWARD_PLANS.get(op, values, make)
    if plan is None:
        spec = spec_of(q, scale, causal, window_left, window_right, softcap, dropout_p, dropout_seed,
                       alibi_slopes, sinks)
        return ref.forward(q, k, v, attn_bias, spec)
    return plan(q, k, v, attn_bias, None, None, dropout_seed, alibi_slopes, sinks)


@triton_op("flash::attention", mutates_args=())
def _attention(q: Tensor, k: Tensor, v: Tensor, attn_bias: Optional[Tensor] = None,
               dropout_seed: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
               sinks: Optional[Tensor] = None, *, scale: Optional[float] = None, causal: bool = False,
               window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
               dropout_p: float = 0.0) -> Tensor:
    return _forward("attention", q, k, v, attn_bias, alibi_slopes, sinks, scale, causal, window_left,
                    window_right, softcap, dropout_p, dropout_seed)[0]


@triton_op("flash::attention_with_lse", mutates_args=())
def _attention_with_lse(q: Tensor, k: Tensor, v: Tensor, attn_bias: Optional[Tensor] = None,
                        dropout_seed: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
                        sinks: Optional[Tensor] = None, *, scale: Optional[float] = None, causal: bool = False,
                        window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                        dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    return _forward("attention_with_lse", q, k, v, attn_bias, alibi_slopes, sinks, scale, causal, window_left,
                    window_right, softcap, dropout_p, dropout_seed)


# Causal backwards of 1k tokens ran slower through cuDNN than ours on the H100 (32 x 1024
# tokens, d 64 / 128: 2.01 / 1.72 ms against 1.51 / 1.56), of 2k tokens faster ((4, 16, 2048,
# 128): 0.48 ms against 0.72).
CUDNN_CAUSAL_MIN_SEQLEN = 2048
# TORCH_FLASH_CUDNN_BACKWARD=0 keeps cuDNN's backward off; read once at import, as
# TORCH_FLASH_BACKEND (the eager fast path replays a signature's recorded backward without
# asking again)
CUDNN_BACKWARD = os.environ.get("TORCH_FLASH_CUDNN_BACKWARD", "1").strip() != "0"


def cudnn_backward_serves(grad_lse, q: Tensor, k: Tensor, v: Tensor, attn_bias, spec: ref.Spec) -> bool:
    """Whether flash.attention_backward hands this call to cuDNN's SDPA backward, which reads
    the lse of our forward as its own (equal to 1e-6 on the H100) and was checked there against
    float64 (tests/ops/test_attention.py): 1.1x-1.55x our Triton backward on the H200, 0.82x-0.90x
    FlashAttention 4's (docs/perf.md), but not bitwise reproducible. That is: unless
    TORCH_FLASH_CUDNN_BACKWARD=0 (CUDNN_BACKWARD), not under torch.use_deterministic_algorithms(True), no forced
    backend, cuDNN's SDPA enabled, an sm_90
    GPU, fp16/bf16, one head dim <= 128 (a multiple of 8), Sq == Sk (cuDNN aligns the causal
    diagonal top-left, ours bottom-right), causal only from CUDNN_CAUSAL_MIN_SEQLEN keys, no
    bias, ALiBi, dropout, softcap, window or lse gradient (sinks serve: cuDNN recomputes the
    probabilities from our lse, which has them; their gradient comes from _sinks_grad), and k and
    v laid out as cuDNN reads them (strides and, where real, addresses 16-byte aligned; q is
    copied anyway), and fewer than 2^31
    elements in q's copy and in k: at (4104, 32, 128, 128) bf16 (q past 2^31) the call through it
    failed tests/test_large_index.py with a relative error of 0.25, where the same forward with
    the Triton backward passed (H200, torch 2.11)."""
    d, s = q.shape[-1], q.shape[2]
    return (CUDNN_BACKWARD and q.device.type == "cuda"
            and _dispatch.forced_backend() is None
            and not torch.are_deterministic_algorithms_enabled() and torch.backends.cuda.cudnn_sdp_enabled()
            and torch.cuda.get_device_capability(q.device) == (9, 0)
            and q.dtype in (torch.float16, torch.bfloat16) and v.shape[-1] == d and d <= 128 and d % 8 == 0
            and k.shape[2] == s and q.numel() > 0 and k.numel() > 0 and grad_lse is None
            and (not spec.causal or s >= CUDNN_CAUSAL_MIN_SEQLEN)
            and attn_bias is None and spec.alibi_slopes is None
            and spec.dropout_p == 0 and spec.softcap == 0
            and spec.window_left < 0 and spec.window_right < 0
            and _cudnn_q_copy_numel(q) < 2**31 and k.numel() < 2**31
            and all(_cudnn_aligned(t) for t in (k, v)))


def _cudnn_aligned(t: Tensor) -> bool:
    """Every stride but the last 16 bytes apart and the first element 16-byte aligned (checked
    for real tensors; a traced graph's inputs are aligned by Inductor's SDPA layout rule).
    cuDNN's backward reads k and v otherwise laid out wrongly, without an error (H100, torch
    2.11: relative error 1.1-1.4 for bf16 rows 68 elements apart or starting 8 bytes in)."""
    return all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]) and _starts_aligned(t)


def _starts_aligned(t: Tensor) -> bool:
    """t's first element 16-byte aligned; assumed where there is no address to read (traced)."""
    return _dispatch.symbolic(t) or t.data_ptr() % 16 == 0


def _cudnn_operand(t: Tensor, like: Tensor | None = None) -> Tensor:
    """t laid out like `like` (ref.layout_strides; None: contiguous) and starting 16-byte
    aligned: a copy only where it is not."""
    t = t.contiguous() if like is None else ref.in_layout(t, like)
    return t if _starts_aligned(t) else t.clone()


# Elements added to the outermost stride of the copy of q handed to cuDNN (keeps each of its
# slices 16-byte aligned). Why: aten keeps built cuDNN backward graphs in a per-thread cache,
# shared with F.scaled_dot_product_attention, keyed on q, k and v's shapes and strides only,
# though a graph also bakes in out's, grad_out's and lse's strides: a call whose q, k, v match a
# cached graph's but whose out or grad_out is laid out otherwise runs that graph on misread
# memory. HF LLaMA (8 layers, bf16) had gradients with a relative error of 1.2 after an eager
# SDPA step had cached its graph for our call on the H100 (torch 2.11); our call could as well
# have spoiled SDPA's. No tensor of PyTorch's has this stride, so our graphs are our own; and
# within ours, q's copy fixes the layout (ref.layout_strides) that out and grad_out go in, and
# lse goes in contiguous, so they agree.
CUDNN_Q_BATCH_PAD = 8


def _cudnn_q_strides(q: Tensor) -> tuple[int, ...]:
    """The strides of the copy of q handed to cuDNN: q's layout, its outermost stride padded by
    CUDNN_Q_BATCH_PAD."""
    dense = ref.layout_strides(q, q.shape)
    outer = max(range(3), key=lambda i: dense[i])
    return tuple(st + CUDNN_Q_BATCH_PAD if i == outer else st for i, st in enumerate(dense))


def _cudnn_q_copy_numel(q: Tensor) -> int:
    """Elements the copy of q handed to cuDNN spans."""
    return 1 + sum((n - 1) * st for n, st in zip(q.shape, _cudnn_q_strides(q)))


def _cudnn_backward(grad_out, q, k, v, out, lse, spec: ref.Spec) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), each laid out like its input (ref.layout_strides), from cuDNN (see
    cudnn_backward_serves and CUDNN_Q_BATCH_PAD)."""
    s = q.shape[2]
    q_own = torch.empty_strided(q.shape, _cudnn_q_strides(q), dtype=q.dtype, device=q.device).copy_(q)
    no_dropout = q.new_empty(0, dtype=torch.int64)  # cuDNN's philox seed and offset
    grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _cudnn_operand(grad_out, q), q_own, k, v, _cudnn_operand(out, q), _cudnn_operand(lse).unsqueeze(-1),
        no_dropout, no_dropout, None, None, None, s, s, 0.0, spec.causal, scale=spec.scale)
    return tuple(ref.in_layout(g, t) for g, t in zip(grads[:3], (q, k, v)))


class _Sm90BwdPlan:
    """flash.attention_bwd_sm90 (csrc/attention) for the calls of one signature."""
    path = "cuda"

    def __init__(self, spec: ref.Spec):
        self.scale, self.causal = spec.scale, spec.causal

    def __call__(self, grad_out, grad_lse, q, k, v, attn_bias, out, lse, cu_q, cu_k, dropout_seed, alibi_slopes,
                 sinks):
        grads = torch.ops.flash.attention_bwd_sm90(grad_out, q, k, v, out, lse, self.scale, self.causal,
                                                   alibi_slopes)
        # dq and dk come in q's and k's layout; dv in k's, copied where v's differs; no bias
        return (*(ref.in_layout(g, t) for g, t in zip(grads, (q, k, v))), None, _sinks_grad(grad_out, out, lse, sinks))


def _sinks_grad(grad_out, out, lse, sinks):
    """The sinks' gradient beside a sink-free backward, which gets dq, dk and dv right from the
    sinks' lse (kernels/triton/attention_sinks.py); None without sinks."""
    if sinks is None:
        return None
    from ..kernels.triton.attention_sinks import sink_grad
    return sink_grad(grad_out, out, lse, sinks)


class _Cudnn:
    """The kept choice (ops/_plans.py) of cuDNN's backward, which needs no plan of its own."""
    path = "cudnn"


_CUDNN = _Cudnn()
# signature (and the global state cudnn_backward_serves reads) -> _CUDNN, the Triton kernels'
# AttentionBwd, or None (the reference path)
BACKWARD_PLANS = Plans()


@triton_op("flash::attention_backward", mutates_args=())
def _attention_backward(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor,
                        v: Tensor, attn_bias: Optional[Tensor], out: Tensor, lse: Tensor,
                        scale: Optional[float], causal: bool, window_left: int, window_right: int,
                        softcap: float, dropout_p: float, dropout_seed: Optional[Tensor],
                        bias_requires_grad: bool, alibi_slopes: Optional[Tensor] = None,
                        sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dbias, dsinks); dbias has attn_bias's shape, or is empty unless
    bias_requires_grad; dsinks (Hq,) in sinks' dtype, empty without sinks (ref.sink_grad: lse
    includes them; the Triton backward computes it in its delta pass). The ALiBi slopes get no
    gradient.
    cuDNN's backward where it serves (cudnn_backward_serves), else the Hopper kernel where it
    serves (_sm90_bwd_serves: D 64 / 128 unforced), else the Triton kernels; the Hopper kernel
    goes first for the head dims of SM90_BWD_BEFORE_CUDNN_HDIMS. cuDNN sums dq with atomic
    adds, not bitwise reproducible, so torch.use_deterministic_algorithms(True) turns it off;
    the Hopper kernel then adds dq in a fixed order, and the Triton path computes dq in its own
    pass."""
    def make():
        check_backward_args("attention_backward", grad_out, grad_lse, q, k, v, attn_bias, out, lse, softcap,
                            dropout_p, dropout_seed, window_left, window_right, alibi_slopes, sinks)
        spec = spec_of(q, scale, causal, window_left, window_right, softcap, dropout_p, dropout_seed,
                       alibi_slopes, sinks)
        sm90_first = (q.shape[-1] in SM90_BWD_BEFORE_CUDNN_HDIMS
                      and _sm90_bwd_serves(grad_lse, q, k, v, attn_bias, spec))
        if not sm90_first and cudnn_backward_serves(grad_lse, q, k, v, attn_bias, spec):
            _dispatch.LAST["attention_backward"] = "cudnn"
            return _CUDNN
        backend = _dispatch.select("attention_backward", q,
                                   triton=_triton_serves(q, k, v, attn_bias, dropout_p),
                                   cuda=lambda: _sm90_bwd_serves(grad_lse, q, k, v, attn_bias, spec))
        if backend == "cuda":
            return _Sm90BwdPlan(spec)
        if backend != "triton":
            return None
        from ..kernels.triton.attention_backward import AttentionBwd
        return AttentionBwd(grad_out, grad_lse, q, k, v, attn_bias, out, lse, None, None, q.shape[0], q.shape[2],
                            k.shape[2], kernel_flags(spec), bias_requires_grad, deterministic=True, sinks=sinks)
    # with the global state cudnn_backward_serves reads
    values = (grad_out, grad_lse, q, k, v, attn_bias, out, lse, scale, causal, window_left, window_right, softcap,
              dropout_p, dropout_seed, bias_requires_grad, alibi_slopes, sinks,
              CUDNN_BACKWARD,
              torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.cudnn_sdp_enabled())
    plan = BACKWARD_PLANS.get("attention_backward", values, make)
    if plan is not None and plan is not _CUDNN:
        dq, dk, dv, dbias, dsinks = plan(grad_out, grad_lse, q, k, v, attn_bias, out, lse, None, None,
                                         dropout_seed, alibi_slopes, sinks)
        return dq, dk, dv, grad_or_empty(dbias, q), grad_or_empty(dsinks, q)
    spec = spec_of(q, scale, causal, window_left, window_right, softcap, dropout_p, dropout_seed, alibi_slopes,
                   sinks)
    if plan is _CUDNN:
        return (*_cudnn_backward(grad_out, q, k, v, out, lse, spec), grad_or_empty(None, q),
                grad_or_empty(_sinks_grad(grad_out, out, lse, sinks), q))
    dq, dk, dv, dbias = ref.backward(grad_out, grad_lse, q, k, v, attn_bias, out, lse, spec, bias_requires_grad)
    return dq, dk, dv, grad_or_empty(dbias, q), ref_sinks_grad(sinks, out, grad_out, lse, grad_lse, q)


@torch.library.custom_op("flash::attention_fwd_sm90", mutates_args=())
def _attention_fwd_sm90(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool,
                        sinks: Optional[Tensor] = None,
                        alibi_slopes: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(out, lse) of flash.attention_with_lse for the calls the Hopper kernel serves (see
    check_sm90_args), with attention sinks (Hq,) or none and ALiBi slopes fp32 (Hq,) or (B, Hq)
    or none. torch_flash._C registers that kernel for CUDA tensors (the sinks applied in its
    epilogue, ALiBi in its softmax); this body, the reference, runs elsewhere (CPU tensors, or
    no extension). No autograd of its own: it is the forward inside flash.attention's, whose
    backward reads its lse."""
    check_sm90_args("attention_fwd_sm90", q, k, v, causal)
    check_sinks("attention_fwd_sm90", sinks, q)
    check_alibi("attention_fwd_sm90", alibi_slopes, q, q.shape[0])
    return ref.forward(q, k, v, None, ref.Spec(scale, causal, alibi_slopes=alibi_slopes, sinks=sinks))


def check_sm90_bwd_args(op: str, grad_out, q, k, v, out, lse, causal: bool) -> None:
    check_sm90_args(op, q, k, v, causal)
    check_saved_and_grads(op, q, v, out, lse, grad_out, None, out_shapes(q, v))


@torch.library.custom_op("flash::attention_bwd_sm90", mutates_args=())
def _attention_bwd_sm90(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        scale: float, causal: bool,
                        alibi_slopes: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of flash.attention_backward for the calls the Hopper backward serves (see
    _sm90_bwd_serves), with the forward's ALiBi slopes or none. torch_flash._C registers that
    kernel for CUDA tensors; this body, the reference, runs elsewhere."""
    check_sm90_bwd_args("attention_bwd_sm90", grad_out, q, k, v, out, lse, causal)
    check_alibi("attention_bwd_sm90", alibi_slopes, q, q.shape[0])
    return ref.attention_bwd_sm90(grad_out, q, k, v, out, lse, scale, causal, alibi_slopes)


def ref_sinks_grad(sinks, out, grad_out, lse, grad_lse, like: Tensor) -> Tensor:
    """The backward ops' dsinks output on the reference path: ref.sink_grad, empty without sinks."""
    return grad_or_empty(None if sinks is None else ref.sink_grad(sinks, out, grad_out, lse, grad_lse), like)


def _spec(with_lse: bool) -> Spec:
    """flash.attention's (and flash.attention_with_lse's) autograd rule: the forward keeps its lse
    (attention runs its sibling attention_with_lse), the backward op gives dq, dk, dv and dbias
    (where the bias needs one) and the sinks'."""
    saved = tuple(Src(SAVED, i) for i in range(9))
    return Spec(
        forward=None if with_lse else "attention_with_lse",
        outputs=(0, 1) if with_lse else (0,),
        save=("q", "k", "v", "attn_bias", 0, 1, "dropout_seed", "alibi_slopes", "sinks"),
        backward="attention_backward",
        backward_args=(Src(GRAD, 0), Src(GRAD_OR_NONE, 1) if with_lse else Src(NONE), *saved[:6],
                       *(Src(ARG, n) for n in ("scale", "causal", "window_left", "window_right", "softcap",
                                               "dropout_p")),
                       saved[6], Src(REQUIRES_GRAD, "attn_bias"), saved[7], saved[8]),
        grads=(("q", 0, None), ("k", 1, None), ("v", 2, None), ("attn_bias", 3, None), ("sinks", 4, None)))


register_autograd_spec(_attention_with_lse, _spec(with_lse=True))
register_autograd_spec(_attention, _spec(with_lse=False))


def op_kwargs(op: str, scale, causal, window, softcap, dropout_p) -> dict:
    """Keyword arguments of the ops from the public ones; draws the dropout seed."""
    if not (isinstance(window, (tuple, list)) and len(window) == 2):  # formatted only on failure:
        fail(op, f"window must be a pair (left, right), got {window!r}")  # traced, it holds SymInts
    # torch.manual_seed makes the mask reproducible; backward regenerates it from the seed
    seed = torch.randint(2**62, (), dtype=torch.int64) if dropout_p > 0 else None
    return dict(scale=scale, causal=causal, window_left=window[0], window_right=window[1],
                softcap=softcap, dropout_p=dropout_p, dropout_seed=seed)


def attention(q: Tensor, k: Tensor, v: Tensor, attn_bias: Optional[Tensor] = None, *,
              scale: Optional[float] = None, causal: bool = False, window: tuple[int, int] = (-1, -1),
              softcap: float = 0.0, dropout_p: float = 0.0, alibi_slopes: Optional[Tensor] = None,
              sinks: Optional[Tensor] = None) -> Tensor:
    """Exact softmax attention, FlashAttention-style (no Sq x Sk matrix in memory).

    q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv) with Hq % Hkv == 0 (GQA/MQA);
    any strides with a contiguous last dim, e.g. a (B, S, H, D) tensor `.transpose(1, 2)`.
    Returns out (B, Hq, Sq, Dv) in q's dtype.

    scale defaults to D ** -0.5. attn_bias: float (added to the scores) or bool (True =
    attend), broadcastable to (B, Hq, Sq, Sk); differentiable when float. causal and
    window = (left, right) (-1 = unbounded) align the diagonal bottom-right when Sq != Sk
    (query i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right; causal sets
    right = 0). softcap > 0 applies softcap * tanh(s / softcap) to the scaled scores
    before bias and mask (Gemma 2). alibi_slopes: fp32 (Hq,) or (B, Hq), ALiBi as FlashAttention 2
    adds it, -slope * |i + Sk - Sq - j| on the scaled (capped) scores, computed inside the kernels
    (no gradient for the slopes). sinks (Hq,): a learnable logit per head (gpt-oss), one more
    softmax column that takes probability mass and adds no value; differentiable, included
    in lse. dropout_p drops attention probabilities with a seed drawn from torch's default
    generator. A query that sees no key gets zeros.
    On a Hopper GPU the backward of plain fp16/bf16 self-attention runs the Hopper kernel
    (csrc/attention) at D 64 and 128 where it goes first (ops.attention.SM90_BWD_BEFORE_CUDNN_HDIMS),
    else cuDNN's (cudnn_backward_serves; TORCH_FLASH_CUDNN_BACKWARD=0 at start-up turns it off);
    both add dq atomically, as SDPA's fastest backends do: not bitwise reproducible. Under
    torch.use_deterministic_algorithms(True) the Hopper kernel adds dq in a fixed key-block
    order at D 64 and 128 (SM90_BWD_DETERMINISTIC_HDIMS) and the Triton backward, reproducible as
    it is, serves the rest.
    """
    kw = op_kwargs("attention", scale, causal, window, softcap, dropout_p)
    # positional: the eager fast path records a gradient for positional tensors (sinks)
    return call("attention", q, k, v, attn_bias, kw.pop("dropout_seed"), alibi_slopes, sinks, **kw)


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, attn_bias: Optional[Tensor] = None, *,
                       scale: Optional[float] = None, causal: bool = False,
                       window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                       dropout_p: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                       sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """`attention`, also returning lse (B, Hq, Sq): the log-sum-exp of each query's
    scores over its visible keys (and its head's sink), fp32 (fp64 for fp64 inputs), -inf
    where none is visible. Differentiable in both outputs (merging partial attentions, ring
    attention).
    """
    kw = op_kwargs("attention_with_lse", scale, causal, window, softcap, dropout_p)
    return call("attention_with_lse", q, k, v, attn_bias, kw.pop("dropout_seed"), alibi_slopes, sinks, **kw)
