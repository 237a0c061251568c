"""Plain-PyTorch attention: the math every attention kernel follows, and the CPU path.

Layout (SDPA): q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), Hq % Hkv == 0;
query head h reads key/value head h // (Hq // Hkv).

    s = scale * q k^T                     scale defaults to D ** -0.5
    s = softcap * tanh(s / softcap)       when softcap > 0 (Gemma 2), before bias and mask
    s = s - slope * |i + Sk - Sq - j|     ALiBi, when alibi_slopes (fp32 (Hq,) or (B, Hq)) is given
    s = s + attn_bias                     float bias; a bool bias keeps where True
    key j is visible to query i iff i + Sk - Sq - left <= j <= i + Sk - Sq + right
                                          (window (left, right), -1 = unbounded, causal
                                          means right = 0: aligned bottom-right as FlashAttention)
    lse = logsumexp_j s,  p = exp(s - lse),  out = dropout(p) v
    with sinks (Hq,) (gpt-oss): lse = log(sum_j exp(s_j) + exp(sink_h)), one more softmax
                                          column per row that takes probability mass and adds
                                          no value (d lse / d sink = exp(sink - lse))

ALiBi is FlashAttention 2's: the distance to the bottom-right diagonal, per sequence for
varlen (FlashAttention's causal kernels add slope * (j - Sk + 1) instead, which differs by a
constant per row: the same out, an lse that differs by slope * (Sq - 1 - i)).
A row with no visible key gets out 0 and lse -inf (its sink, with sinks). lse is fp32 (fp64 for
fp64 inputs).
Dropout keeps p[b, h, i, j] iff u >= dropout_p and scales kept entries by 1 / (1 - dropout_p),
where u = tl.uint_to_uniform_float(first word of tl.philox(seed, j, i, b*Hq + h, 0)), i.e.
Philox 4x32-10 keyed by the 64-bit seed on the counter (j, i, b*Hq + h, 0): a pure function
of the position that the Triton kernels draw bit for bit (varlen: b is the sequence, i and
j positions within it).

`attention` / `attention_with_lse` are the naive O(Sq*Sk) formula (tests, compile-pass
patterns). `forward` / `backward` are the CPU path of the ops: PyTorch's own flash CPU
kernel where it covers the call, otherwise an exact path over chunks of query rows whose
memory is O(B*Hq*chunk*Sk), never a full Sq x Sk buffer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._common import compute_dtype

# Score elements (B*Hq*rows*Sk) one chunk of the exact path may hold.
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Spec:
    """The scalar arguments of one attention call, with scale resolved; seed is the
    dropout seed (an int, or an int64 tensor of one element so tracing needs no .item());
    alibi_slopes the fp32 ALiBi slopes, (Hq,) or (B, Hq), or None; sinks the per-head sink
    logits (Hq,), or None."""
    scale: float
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    dropout_p: float = 0.0
    seed: Tensor | int | None = None
    alibi_slopes: Tensor | None = None
    sinks: Tensor | None = None

    @property
    def right(self) -> int:
        return 0 if self.causal else self.window_right


@dataclass(frozen=True)
class Positions:
    """Where each query row and key sits in its sequence: q_pos (Sq,) and k_pos (Sk,) are
    indices within the sequence, q_diag (Sq,) the key index of each query's diagonal
    (q_pos + Sk - Sq of its sequence); q_seq / k_seq the sequence ids of packed varlen
    tokens, or None for one sequence per batch row."""
    q_pos: Tensor
    q_diag: Tensor
    k_pos: Tensor
    q_seq: Tensor | None = None
    k_seq: Tensor | None = None


def dense_positions(sq: int, sk: int, device) -> Positions:
    q_pos = torch.arange(sq, device=device)
    return Positions(q_pos, q_pos + (sk - sq), torch.arange(sk, device=device))


def resolve_scale(scale: float | None, head_dim: int) -> float:
    return head_dim ** -0.5 if scale is None else scale


# ---------------------------------------------------------------------------- masks

def visible(pos: Positions, r0: int, r1: int, spec: Spec) -> Tensor | None:
    """Bool (r1 - r0, Sk): which keys query rows [r0, r1) see; None when all are visible."""
    left, right = spec.window_left, spec.right
    if left < 0 and right < 0 and pos.q_seq is None:
        return None
    diag = pos.q_diag[r0:r1, None]
    if pos.q_seq is None:
        vis = torch.ones(len(diag), len(pos.k_pos), dtype=torch.bool, device=diag.device)
    else:
        vis = pos.q_seq[r0:r1, None] == pos.k_seq
    if right >= 0:
        vis &= pos.k_pos <= diag + right
    if left >= 0:
        vis &= pos.k_pos >= diag - left
    return vis


_M32 = 0xFFFFFFFF
_PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)


def _mul32(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit words of a * b for uint32 values held in int64 (no overflow)."""
    x_hi, x_lo = a * (b >> 16), a * (b & 0xFFFF)
    mid = x_hi + (x_lo >> 16)
    return mid >> 16, ((mid & 0xFFFF) << 16) | (x_lo & 0xFFFF)


def philox_uniform(seed: Tensor | int, c0: Tensor, c1: Tensor, c2: Tensor) -> Tensor:
    """fp32 uniforms in [0, 1), bit-identical to Triton's
    tl.uint_to_uniform_float(tl.philox(seed, c0, c1, c2, 0)[0]) for uint32 counters held in
    int64 tensors (broadcast together); the key is (lo32(seed), hi32(seed))."""
    c0, c1, c2 = torch.broadcast_tensors(c0, c1, c2)
    c3 = torch.zeros_like(c0)
    if isinstance(seed, Tensor):
        seed = seed.reshape(()).to(c0.device)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        hi_b, lo_b = _mul32(_PHILOX_ROUND[1], c2)
        hi_a, lo_a = _mul32(_PHILOX_ROUND[0], c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY[0]) & _M32, (k1 + _PHILOX_KEY[1]) & _M32
    # read as int32, negatives folded with ~x, then scaled below 1
    folded = torch.where(c0 >= 1 << 31, _M32 - c0, c0)
    return folded.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32)


def dropout_keep(spec: Spec, pos: Positions, b: int, h: int, r0: int, r1: int) -> Tensor:
    """Bool (B, Hq, r1 - r0, Sk) keep-mask of query rows [r0, r1)."""
    heads = torch.arange(h, device=pos.k_pos.device).view(h, 1, 1)
    if pos.q_seq is None:
        bh = torch.arange(b, device=heads.device).view(b, 1, 1, 1) * h + heads
    else:
        bh = (pos.q_seq[r0:r1, None] * h + heads)[None]
    u = philox_uniform(spec.seed, pos.k_pos, pos.q_pos[r0:r1, None], bh)
    return u >= spec.dropout_p


def bias_4d(attn_bias: Tensor) -> Tensor:
    """View a bias broadcastable to (B, Hq, Sq, Sk) with exactly 4 dims."""
    return attn_bias.reshape((1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape))


# A float bias at or below MASK_FILL, but not -inf, is a mask fill (HF builds masks with
# finfo.min): an fp32 softmax rounds score + fill to the fill, so a row masked that way
# averages v. Such a key scores MASK_SCORE instead: nothing next to any visible key, the same
# average over a fully masked row, and small enough in magnitude that lse = max + log(sum)
# keeps its log(sum) in fp32 (at -3e38 it rounds away, and exp(s - lse) in the backward would
# give every key of the row weight 1 instead of 1/Sk).
MASK_FILL = -1e9
MASK_SCORE = -1e4


def alibi_bias(slopes: Tensor, pos: Positions, r0: int, r1: int, dtype: torch.dtype) -> Tensor:
    """(B or 1, Hq, r1 - r0, Sk) ALiBi bias -slope * |diag_i - j| of query rows [r0, r1);
    (B, Hq) slopes of packed sequences are picked per row by its sequence."""
    dist = (pos.q_diag[r0:r1, None] - pos.k_pos).abs().to(dtype)
    slopes = slopes.to(dtype)
    if slopes.dim() == 1:
        per_row = slopes[None, :, None, None]
    elif pos.q_seq is None:
        per_row = slopes[:, :, None, None]
    else:
        per_row = slopes[pos.q_seq[r0:r1]].T[None, :, :, None]
    return -per_row * dist


def _mask_scores(s: Tensor, bias: Tensor | None, vis: Tensor | None, alibi: Tensor | None = None) -> Tensor:
    if alibi is not None:
        s = s + alibi
    if bias is not None and bias.dtype == torch.bool:
        s = s.masked_fill(~bias, -math.inf)
    elif bias is not None:
        bias = bias.to(s.dtype)
        s = torch.where((bias <= MASK_FILL) & (bias != -math.inf), MASK_SCORE, s + bias)
    if vis is not None:
        s = s.masked_fill(~vis, -math.inf)
    return s


def with_sinks(lse: Tensor, sinks: Tensor | None) -> Tensor:
    """lse over the keys -> lse over the keys and the sink column: logaddexp with each row's head's
    sink (heads at dim 1 of lse, which has at least 2 dims)."""
    if sinks is None:
        return lse
    return torch.logaddexp(lse, sinks.to(lse.dtype).reshape(-1, *(1,) * (lse.dim() - 2)))


def sink_grad(sinks: Tensor, out: Tensor, grad_out: Tensor, lse: Tensor, grad_lse: Tensor | None) -> Tensor:
    """d loss / d sinks, (Hq,) in sinks' dtype: the sum over rows of exp(sink - lse) * (grad_lse -
    rowsum(dO * O)), for dense (out (B, Hq, Sq, Dv), lse (B, Hq, Sq)) or varlen (out (T, Hq, Dv),
    lse (Hq, T)) layouts. Every path's backward shares it: dq, dk, dv need only the lse."""
    cdt = lse.dtype
    row = -(grad_out.to(cdt) * out.to(cdt)).sum(-1)
    heads = 0 if lse.dim() == 2 else 1
    if heads == 0:
        row = row.T
    if grad_lse is not None:
        row = row + grad_lse.to(cdt)
    shape = [1] * lse.dim()
    shape[heads] = -1
    p_sink = torch.exp(sinks.to(cdt).reshape(shape) - lse).masked_fill(lse == -math.inf, 0.0)
    return (p_sink * row).sum([d for d in range(lse.dim()) if d != heads]).to(sinks.dtype)


def _probs(s: Tensor, lse: Tensor) -> Tensor:
    """exp(s - lse); rows with lse = -inf (no visible key) give 0, not NaN."""
    return torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0).unsqueeze(-1))


# ---------------------------------------------------------------------------- naive formula

def attention_with_lse(q, k, v, attn_bias=None, *, scale=None, causal=False, window=(-1, -1),
                       softcap=0.0, dropout_p=0.0, dropout_seed=None, alibi_slopes=None, sinks=None,
                       positions=None):
    """(out (B, Hq, Sq, Dv) in q's dtype, lse (B, Hq, Sq)) by the formula, O(Sq*Sk) memory.
    Differentiable; computes in fp32 (fp64 for fp64 inputs). dropout_seed: int or tensor;
    positions: packed sequences (varlen), None for one sequence per batch row."""
    spec = Spec(resolve_scale(scale, q.shape[-1]), causal, window[0], window[1], softcap,
                dropout_p, dropout_seed, alibi_slopes)
    cdt = compute_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    k, v = (t.to(cdt).repeat_interleave(group, dim=1) for t in (k, v))
    s = q.to(cdt) @ k.transpose(-1, -2) * spec.scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = s.shape[-2:]
    bias = None if attn_bias is None else bias_4d(attn_bias)
    pos = positions or dense_positions(sq, sk, q.device)
    alibi = None if alibi_slopes is None else alibi_bias(alibi_slopes, pos, 0, sq, cdt)
    s = _mask_scores(s, bias, visible(pos, 0, sq, spec), alibi)
    lse = with_sinks(torch.logsumexp(s, -1), sinks)
    p = _probs(s, lse)
    if dropout_p > 0:
        p = p * dropout_keep(spec, pos, q.shape[0], q.shape[1], 0, sq) / (1 - dropout_p)
    return (p @ v).to(q.dtype), lse


def attention(q, k, v, attn_bias=None, **kwargs):
    """out of `attention_with_lse`."""
    return attention_with_lse(q, k, v, attn_bias, **kwargs)[0]


def attention_fwd_sm90(q, k, v, scale, causal, sinks=None, alibi_slopes=None):
    """flash.attention_fwd_sm90 by the formula: (out, lse) of `attention_with_lse` (the op
    takes causal only with Sq <= Sk)."""
    return attention_with_lse(q, k, v, scale=scale, causal=causal, sinks=sinks, alibi_slopes=alibi_slopes)


def attention_bwd_sm90(grad_out, q, k, v, out, lse, scale, causal, alibi_slopes=None):
    """flash.attention_bwd_sm90 by the formula: (dq, dk, dv) of `attention_with_lse`'s backward
    without an lse gradient, laid out as the kernel writes them: dq like q, dk and dv like k."""
    spec = Spec(scale, causal, alibi_slopes=alibi_slopes)
    dq, dk, dv, _ = backward(grad_out, None, q, k, v, None, out, lse, spec, False)
    return in_layout(dq, q), in_layout(dk, k), in_layout(dv, k)


# ---------------------------------------------------------------------------- CPU path

_CPU_FLASH_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _cpu_flash_applies(q: Tensor, k: Tensor, v: Tensor, attn_bias, spec: Spec, positions) -> bool:
    """PyTorch's flash CPU kernel: plain softmax attention, causal only top-left (so Sq == Sk)."""
    sq, sk = q.shape[2], k.shape[2]
    return (q.device.type == "cpu" and q.dtype in _CPU_FLASH_DTYPES and attn_bias is None
            and spec.alibi_slopes is None and spec.sinks is None
            and positions is None and q.numel() > 0 and k.numel() > 0
            and q.shape[-1] == v.shape[-1] and spec.softcap == 0 and spec.dropout_p == 0
            and spec.window_left < 0 and (spec.right < 0 or (spec.right == 0 and sq == sk)))


def _expand_heads(t: Tensor, hq: int) -> Tensor:
    """(B, Hkv, S, D) -> (B, Hq, S, D), each kv head repeated for its query group."""
    b, hkv, s, d = t.shape
    return t if hkv == hq else t[:, :, None].expand(b, hkv, hq // hkv, s, d).reshape(b, hq, s, d)


def _sum_heads(t: Tensor, hkv: int) -> Tensor:
    return t if t.shape[1] == hkv else t.unflatten(1, (hkv, -1)).sum(2)


def _grouped(t: Tensor, hkv: int) -> Tensor:
    """(B, H, ...) with H in {1, Hq} -> (B, Hkv or 1, Hq // Hkv or 1, ...), a view."""
    return t.unsqueeze(2) if t.shape[1] == 1 else t.unflatten(1, (hkv, -1))


def _rows(t: Tensor, r0: int, r1: int) -> Tensor:
    """Rows [r0, r1) of a (..., Sq, X) tensor, or the tensor itself when broadcast over rows."""
    return t if t.shape[-2] == 1 else t[..., r0:r1, :]


class _Chunks:
    """The exact path: scores of query rows [r0, r1) for all batches and heads at a time,
    in GQA-grouped layout (B, Hkv, group, rows, Sk) so k and v are never expanded.
    Python control flow depends on shapes only, so torch.compile can trace it."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, attn_bias: Tensor | None, spec: Spec,
                 positions: Positions | None):
        self.spec, self.cdt = spec, compute_dtype(q.dtype)
        self.b, self.hq, self.sq, _ = q.shape
        self.hkv, self.sk = k.shape[1], k.shape[2]
        self.q = _grouped(q, self.hkv)
        self.k, self.v = k.to(self.cdt).unsqueeze(2), v.to(self.cdt).unsqueeze(2)
        self.bias = None if attn_bias is None else _grouped(bias_4d(attn_bias), self.hkv)
        self.pos = positions or dense_positions(self.sq, self.sk, q.device)
        rows = max(1, CHUNK_ELEMENTS // max(1, self.b * self.hq * self.sk))
        self.bounds = [(r, min(r + rows, self.sq)) for r in range(0, self.sq, rows)]

    def scores(self, r0: int, r1: int) -> tuple[Tensor, Tensor | None]:
        """(masked scores, tanh of the softcap or None) of rows [r0, r1)."""
        spec = self.spec
        s = self.q[..., r0:r1, :].to(self.cdt) @ self.k.transpose(-1, -2) * spec.scale
        tanh = None
        if spec.softcap > 0:
            tanh = torch.tanh(s / spec.softcap)
            s = spec.softcap * tanh
        bias = None if self.bias is None else _rows(self.bias, r0, r1)
        alibi = (None if spec.alibi_slopes is None
                 else _grouped(alibi_bias(spec.alibi_slopes, self.pos, r0, r1, self.cdt), self.hkv))
        return _mask_scores(s, bias, visible(self.pos, r0, r1, spec), alibi), tanh

    def dropout(self, r0: int, r1: int) -> Tensor | None:
        """Keep-mask divided by the keep probability, grouped (B, Hkv, g, rows, Sk)."""
        if self.spec.dropout_p == 0:
            return None
        keep = dropout_keep(self.spec, self.pos, self.b, self.hq, r0, r1)
        return _grouped(keep, self.hkv).to(self.cdt) / (1 - self.spec.dropout_p)

    def forward(self) -> tuple[Tensor, Tensor]:
        out = torch.empty(self.b, self.hq, self.sq, self.v.shape[-1], dtype=self.q.dtype,
                          device=self.q.device)
        lse = torch.empty(self.b, self.hq, self.sq, dtype=self.cdt, device=self.q.device)
        out_g, lse_g = _grouped(out, self.hkv), _grouped(lse, self.hkv)
        for r0, r1 in self.bounds:
            s, _ = self.scores(r0, r1)
            lse_c = torch.logsumexp(s, -1)
            if self.spec.sinks is not None:  # grouped (B, Hkv, g, rows): flat heads at dim 1
                lse_c = with_sinks(lse_c.flatten(1, 2), self.spec.sinks).view(lse_c.shape)
            p = _probs(s, lse_c)
            keep = self.dropout(r0, r1)
            out_g[..., r0:r1, :] = (p if keep is None else p * keep) @ self.v
            lse_g[..., r0:r1] = lse_c
        return out, lse

    def backward(self, grad_out: Tensor, grad_lse: Tensor | None, out: Tensor, lse: Tensor,
                 bias_requires_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """dq, dk, dv in the compute dtype, and dbias in the grouped 4-d bias shape."""
        spec, cdt = self.spec, self.cdt
        dq = torch.empty(self.q.shape, dtype=cdt, device=self.q.device)
        dk = torch.zeros(self.k.shape, dtype=cdt, device=self.k.device)
        dv = torch.zeros(self.v.shape, dtype=cdt, device=self.v.device)
        dbias = torch.zeros(self.bias.shape, dtype=cdt, device=self.bias.device) if bias_requires_grad else None
        # dS = P * (dP - rowsum(dO * O)); d lse_i / d s_ij = p_ij adds grad_lse_i * p_ij
        row_term = -(grad_out.to(cdt) * out.to(cdt)).sum(-1)
        if grad_lse is not None:
            row_term = row_term + grad_lse.to(cdt)
        do_g, row_g, lse_g = (_grouped(t, self.hkv) for t in (grad_out, row_term, lse))
        for r0, r1 in self.bounds:
            s, tanh = self.scores(r0, r1)
            p = _probs(s, lse_g[..., r0:r1].to(cdt))
            do = do_g[..., r0:r1, :].to(cdt)
            dp = do @ self.v.transpose(-1, -2)
            keep = self.dropout(r0, r1)
            if keep is not None:
                dp = dp * keep
            dv += ((p if keep is None else p * keep).transpose(-1, -2) @ do).sum(2, keepdim=True)
            ds = p * (dp + row_g[..., r0:r1, None])
            if dbias is not None:
                size = list(dbias.shape)
                size[-2] = min(size[-2], r1 - r0)
                _rows(dbias, r0, r1).add_(ds.sum_to_size(size))
            if tanh is not None:
                ds = ds * (1 - tanh * tanh)
            ds = ds * spec.scale
            dq[..., r0:r1, :] = ds @ self.k
            dk += (ds.transpose(-1, -2) @ self.q[..., r0:r1, :].to(cdt)).sum(2, keepdim=True)
        return dq.flatten(1, 2), dk.squeeze(2), dv.squeeze(2), dbias


def layout_strides(like: Tensor, shape) -> tuple:
    """The strides of the dense (B, H, S, D) `shape` whose dims 0-2 lie in the order of like's
    strides, largest first (ties in dim order), and whose last dim is contiguous: flash.attention's
    out and gradients follow q's, k's and v's layout as SDPA's do, so a (B, S, H, D) buffer seen
    as (B, H, S, D) gets outputs its transpose back reads without a copy. csrc/attention's
    forward allocates alike (empty_like_layout)."""
    order = layout_order(like)
    strides, step = [0, 0, 0, 1], shape[3]
    for i in reversed(order[:3]):
        strides[i] = step
        step = step * shape[i]
    return tuple(strides)


def layout_order(like: Tensor) -> tuple:
    """layout_strides' dims from outermost to innermost (torch.empty_permuted's physical_layout)."""
    return (*sorted(range(3), key=lambda i: -like.stride(i)), 3)


def in_layout(t: Tensor, like: Tensor) -> Tensor:
    """t laid out as layout_strides(like, t.shape): itself where it is, else a copy."""
    strides = layout_strides(like, t.shape)
    if t.stride() == strides:
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def forward(q: Tensor, k: Tensor, v: Tensor, attn_bias: Tensor | None, spec: Spec,
            positions: Positions | None = None) -> tuple[Tensor, Tensor]:
    """(out (B, Hq, Sq, Dv) in q's dtype, lse (B, Hq, Sq) contiguous); out laid out like q
    (layout_strides), contiguous for packed sequences. positions: the mask layout of packed
    sequences (varlen); None for plain attention."""
    if _cpu_flash_applies(q, k, v, attn_bias, spec, positions):
        hq = q.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, _expand_heads(k, hq), _expand_heads(v, hq), 0.0, spec.causal, scale=spec.scale)
    else:
        out, lse = _Chunks(q, k, v, attn_bias, spec, positions).forward()
    return out.contiguous() if positions is not None else in_layout(out, q), lse.contiguous()


def backward(grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
             attn_bias: Tensor | None, out: Tensor, lse: Tensor, spec: Spec,
             bias_requires_grad: bool,
             positions: Positions | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(dq, dk, dv, dbias) in their inputs' dtypes, each laid out like its input (layout_strides;
    contiguous for packed sequences); dbias None unless bias_requires_grad, else summed over
    broadcast dims to attn_bias's shape."""
    hq, hkv = q.shape[1], k.shape[1]
    if grad_lse is None and _cpu_flash_applies(q, k, v, attn_bias, spec, positions):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, _expand_heads(k, hq), _expand_heads(v, hq), out, lse, 0.0, spec.causal,
            scale=spec.scale)
        dk, dv, dbias = _sum_heads(dk, hkv), _sum_heads(dv, hkv), None
    else:
        dq, dk, dv, dbias = _Chunks(q, k, v, attn_bias, spec, positions).backward(
            grad_out, grad_lse, out, lse, bias_requires_grad)
        if dbias is not None:
            dbias = dbias.reshape(attn_bias.shape).to(attn_bias.dtype)
    grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))
    if positions is not None:
        return (*(g.contiguous() for g in grads), dbias)
    return (*(in_layout(g, t) for g, t in zip(grads, (q, k, v))), dbias)
