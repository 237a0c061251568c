"""Triton flash-attention kernels (torch_flash/kernels/triton/attention.py, attention_backward.py)
against a float64 plain-PyTorch reference written here: forward, backward, every feature, dense
and varlen.

On a machine without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (slow:
tiny shapes); the `cuda`-marked grid at realistic sizes runs where a GPU is present.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
# one config per kernel (compile time); test_gpu_every_config covers the others
os.environ.setdefault("TORCH_FLASH_AUTOTUNE", "0")

pytest.importorskip("triton")
from torch_flash.kernels.triton import attention as A, attention_backward as B  # noqa: E402
from torch_flash.reference.attention import MASK_FILL, MASK_SCORE  # noqa: E402
from _utils import rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not A._INTERPRET:
    pytest.skip("the Triton kernels were imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
NO_FLAGS = dict(scale=None, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                dropout_p=0.0, dropout_seed=None, alibi_slopes=None)


def flags(**kw):
    return {**NO_FLAGS, **kw}


def reference(q, k, v, bias=None, *, scale=None, causal=False, window_left=-1, window_right=-1,
              softcap=0.0, dropout_p=0.0, keep=None, alibi_slopes=None, sinks=None, **_):
    """(out, lse) in float64, differentiable. keep: dropout keep mask (B, Hq, Sq, Sk);
    alibi_slopes (Hq,) or (B, Hq): -slope * |i + Sk - Sq - j| added as a dense bias; sinks (Hq,):
    one more softmax column per head, without value."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        sq, sk = s.shape[-2:]
        dist = (torch.arange(sq, device=q.device)[:, None] + sk - sq - torch.arange(sk, device=q.device)).abs()
        s = s - alibi_slopes.double().reshape(-1, s.shape[1], 1, 1) * dist
    if bias is not None and bias.dtype == torch.bool:
        s = s.masked_fill(~bias, float("-inf"))
    elif bias is not None:  # the op's contract for finite mask fills (reference/attention.py)
        b = bias.double()
        s = torch.where((b <= MASK_FILL) & (b != float("-inf")), MASK_SCORE, s + b)
    sq, sk = s.shape[-2:]
    i = torch.arange(sq, device=q.device)[:, None] + sk - sq  # bottom-right aligned
    j = torch.arange(sk, device=q.device)[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        visible &= j <= i
    if window_left >= 0:
        visible &= j >= i - window_left
    if window_right >= 0:
        visible &= j <= i + window_right
    s = s.masked_fill(~visible, float("-inf"))
    seen = torch.isfinite(s).any(-1, keepdim=True)
    s = torch.where(seen, s, 0.0)  # rows that see no key: out 0, lse -inf
    p = torch.softmax(s, -1) * seen
    lse = torch.where(seen[..., 0], torch.logsumexp(s, -1), float("-inf"))
    if sinks is not None:
        total = torch.logaddexp(lse, sinks.double().view(1, -1, 1))
        p = p * torch.exp(lse - total).nan_to_num(0.0)[..., None]
        lse = total
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    return p @ v, lse


def rand(*shape, dtype=torch.float32, transposed=False):
    """Fresh inputs; transposed=True gives a (B, S, H, D) buffer viewed as (B, H, S, D)."""
    if transposed:
        b, h, s, d = shape
        return torch.randn(b, s, h, d, dtype=dtype, device=DEVICE).transpose(1, 2)
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def check_close(out, ref, tol, what):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN"
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def check_lse(lse, ref):
    empty = torch.isinf(ref)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), "lse: -inf exactly on rows that see no key"
    if (~empty).any():
        check_close(lse[~empty], ref[~empty], 1e-5, "lse")


def run_case(q, k, v, bias=None, *, keep=None, grad_lse=False, deterministic=False, bias_grad=False,
             dout_mask=None, **kw):
    """Forward and backward through the launchers vs the reference; inputs left untouched.
    dout_mask (broadcastable to out) zeroes the upstream gradient of some rows."""
    f = flags(**kw)
    before = [t.clone() for t in (q, k, v)]
    out, lse = A.attention_fwd(q, k, v, bias, **f)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_bias = bias
    if bias_grad:
        ref_bias = bias.detach().double().requires_grad_()
    ref_out, ref_lse = reference(*leaves, ref_bias, keep=keep, **f)
    tol = TOL[q.dtype]
    check_close(out, ref_out, tol, "out")
    check_lse(lse, ref_lse)

    dout = torch.randn_like(out) if dout_mask is None else torch.randn_like(out) * dout_mask
    glse = torch.randn_like(lse) if grad_lse else None
    grads = B.attention_bwd(dout, glse, q, k, v, bias, out, lse, **f, bias_requires_grad=bias_grad,
                            deterministic=deterministic)
    ref_loss = (ref_out * dout.double()).sum()
    if grad_lse:
        ref_loss = ref_loss + (torch.where(torch.isinf(ref_lse), 0.0, ref_lse) * glse.double()).sum()
    inputs = leaves + ([ref_bias] if bias_grad else [])
    ref_grads = torch.autograd.grad(ref_loss, inputs)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        check_close(g, r, tol, name)
    assert (grads[3] is None) == (not bias_grad)
    for t, b in zip((q, k, v), before):
        assert torch.equal(t, b), "inputs must not be modified"
    return out, lse, grads


# (B, Hq, Hkv, Sq, Sk, D, Dv, dtype, flags)
CASES = {
    "plain": (2, 2, 2, 17, 17, 32, 32, torch.float32, {}),
    # Sk - Sq = 14: the diagonal ends one short of a 16-block edge (off-by-one in the ranges)
    "causal_sq<sk_gqa": (1, 4, 2, 9, 23, 16, 16, torch.float32, dict(causal=True)),
    "causal_sq>sk": (1, 2, 1, 33, 20, 32, 32, torch.float32, dict(causal=True)),
    "window": (1, 2, 2, 33, 33, 16, 16, torch.float32, dict(window_left=5, window_right=2)),
    "window_causal": (1, 2, 2, 20, 31, 16, 16, torch.float32, dict(causal=True, window_left=7)),
    "softcap_scale": (1, 2, 2, 17, 23, 32, 32, torch.float32, dict(softcap=2.0, scale=0.7)),
    "dv_ne_d": (1, 2, 1, 17, 19, 48, 24, torch.float32, dict(causal=True)),
    "sq1": (2, 2, 2, 1, 33, 32, 32, torch.float32, dict(causal=True)),
    "bf16": (1, 2, 2, 33, 33, 64, 64, torch.bfloat16, dict(causal=True)),
    "fp16_mqa": (1, 4, 1, 17, 33, 32, 32, torch.float16, {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_backward(name):
    b, hq, hkv, sq, sk, d, dv, dtype, kw = CASES[name]
    run_case(rand(b, hq, sq, d, dtype=dtype), rand(b, hkv, sk, d, dtype=dtype),
             rand(b, hkv, sk, dv, dtype=dtype), **kw)


def test_transposed_and_strided_inputs():
    """(B, S, H, D) buffers viewed as (B, H, S, D), and v a slice of a wider buffer."""
    q = rand(2, 2, 17, 32, transposed=True)
    k = rand(2, 2, 21, 32, transposed=True)
    v = rand(2, 2, 21, 64)[..., 16:48]
    assert not q.is_contiguous() and v.stride(2) == 64
    run_case(q, k, v, causal=True)


def test_grad_lse():
    run_case(rand(1, 2, 17, 32), rand(1, 2, 24, 32), rand(1, 2, 24, 32), grad_lse=True, causal=True)


@pytest.mark.parametrize("shape", [(2, 1, 1, 24), (2, 2, 17, 24), (17, 24)])
def test_float_bias_and_grad(shape):
    """Padding-mask layout (B, 1, 1, Sk) with -inf entries, a full per-head bias, and a 2-D
    bias, under GQA; dbias is summed over the broadcast dims."""
    bias = rand(*shape)
    if len(shape) == 4 and shape[2] == 1:
        bias[1, ..., -3:] = float("-inf")  # padded keys of the second sequence
    run_case(rand(2, 2, 17, 32), rand(2, 1, 24, 32), rand(2, 1, 24, 32), bias, bias_grad=True)  # GQA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finfo_min_mask(dtype):
    """HF builds masks with finfo.min: a fully masked row then averages v (as an fp32 softmax
    does) instead of becoming empty, and nothing overflows into NaN (pad key columns too).
    Such keys score MASK_SCORE (reference/attention.py), so the row's lse is -1e4 + log(Sk):
    in fp32 its log(Sk) is exact to 5e-4, which puts the row's own backward within 0.05%
    (the fp32 tolerance here is 1e-5, so its upstream gradient is zeroed, as padding is)."""
    bias = torch.zeros(2, 1, 17, 21, dtype=dtype, device=DEVICE)
    bias[0, 0, :, 15:] = torch.finfo(dtype).min
    bias[1, 0, 4] = torch.finfo(dtype).min
    v = rand(2, 2, 21, 32, dtype=dtype)
    live = torch.ones(2, 1, 17, 1, device=DEVICE, dtype=dtype)  # grad_out in out's dtype
    live[1, 0, 4] = 0
    out, _, _ = run_case(rand(2, 2, 17, 32, dtype=dtype), rand(2, 2, 21, 32, dtype=dtype), v, bias,
                         bias_grad=True, dout_mask=live)
    check_close(out[1, :, 4], v[1].double().mean(1), TOL[dtype], "fully masked row")


def test_bool_bias_with_empty_rows():
    bias = torch.rand(2, 1, 17, 24, device=DEVICE) > 0.3
    bias[0, 0, 3] = False  # a row that sees no key: out 0, lse -inf, zero gradients
    out, lse, (dq, _, _, _) = run_case(rand(2, 2, 17, 32), rand(2, 2, 24, 32), rand(2, 2, 24, 32), bias)
    assert torch.all(out[0, :, 3] == 0) and torch.all(lse[0, :, 3] == float("-inf"))
    assert torch.all(dq[0, :, 3] == 0)


@pytest.mark.parametrize("per_batch,deterministic,kw,sq,sk", [
    (False, False, dict(), 9, 23),
    (True, False, dict(causal=True), 33, 20),
    (True, True, dict(causal=True, window_left=5, softcap=2.0), 17, 30),
])
def test_alibi(per_batch, deterministic, kw, sq, sk):
    """ALiBi slopes (Hq,) or (B, Hq) under GQA, with a float bias too: dQ by atomics and by its
    own pass."""
    slopes = torch.rand((2, 4) if per_batch else (4,), device=DEVICE)
    run_case(rand(2, 4, sq, 16), rand(2, 2, sk, 16), rand(2, 2, sk, 16), rand(2, 1, 1, sk), alibi_slopes=slopes,
             deterministic=deterministic, **kw)


def test_sinks():
    """Sinks start the forward's online softmax (rows without keys put all mass on them); the
    backward kernels, with atomic dQ here, need only the lse."""
    sinks = torch.randn(4, device=DEVICE)
    q, k, v = rand(2, 4, 19, 16), rand(2, 2, 6, 16), rand(2, 2, 6, 16)
    f = flags(causal=True)
    out, lse = A.attention_fwd(q, k, v, None, **f, sinks=sinks)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, **f, sinks=sinks)
    check_close(out, ref_out, TOL[torch.float32], "out")
    check_close(lse, ref_lse, 1e-5, "lse")
    dout = torch.randn_like(out)
    grads = B.attention_bwd(dout, None, q, k, v, None, out, lse, **f, bias_requires_grad=False)
    ref_grads = torch.autograd.grad((ref_out * dout.double()).sum(), leaves)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        check_close(g, r, TOL[torch.float32], name)


def test_empty_rows_grad_lse_no_nan():
    """causal with Sq > Sk leaves the first rows without keys; grad_lse there must not NaN."""
    run_case(rand(1, 2, 20, 16), rand(1, 2, 7, 16), rand(1, 2, 7, 16), causal=True, grad_lse=True)


def test_deterministic_bitwise():
    q, k, v = rand(1, 4, 33, 32, dtype=torch.bfloat16), rand(1, 2, 33, 32, dtype=torch.bfloat16), \
        rand(1, 2, 33, 32, dtype=torch.bfloat16)
    _, _, first = run_case(q, k, v, causal=True, deterministic=True)
    f = flags(causal=True)
    out, lse = A.attention_fwd(q, k, v, None, **f)
    dout = torch.randn_like(out)
    runs = [B.attention_bwd(dout, None, q, k, v, None, out, lse, **f, bias_requires_grad=False,
                            deterministic=True) for _ in range(2)]
    for a, b in zip(runs[0][:3], runs[1][:3]):
        assert torch.equal(a, b)


def _dropout_keep_mask(q, k, dv, **kw):
    """Recovers the kernel's keep mask: with v rows one-hot (v[j] = e_j) out[i, j] = P_ij*keep/(1-p)."""
    sk = k.shape[2]
    assert dv >= sk
    eye = torch.eye(sk, dv, dtype=q.dtype, device=q.device).expand(k.shape[0], k.shape[1], sk, dv)
    out, _ = A.attention_fwd(q, k, eye, None, **flags(**kw))
    return out[..., :sk] != 0


def test_dropout():
    p, seed = 0.3, torch.tensor(1234)
    q, k, v = rand(2, 2, 24, 16), rand(2, 1, 24, 16), rand(2, 1, 24, 32)
    kw = dict(dropout_p=p, dropout_seed=seed, causal=True)
    keep = _dropout_keep_mask(q, k, 32, **kw)
    visible = torch.ones(24, 24, dtype=torch.bool, device=DEVICE).tril()
    frac = keep[..., visible].float().mean().item()
    assert abs(frac - (1 - p)) < 0.05, f"kept fraction {frac:.3f}, expected {1 - p}"
    # same seed: same mask and bitwise the same output; the backward replays that mask
    out1, _, _ = run_case(q, k, v, keep=keep, **kw)
    out2, _ = A.attention_fwd(q, k, v, None, **flags(**kw))
    assert torch.equal(out1, out2)
    other = _dropout_keep_mask(q, k, 32, **{**kw, "dropout_seed": torch.tensor(99)})
    assert not torch.equal(keep, other)


def _pack(lengths, h, d, dtype):
    total = sum(lengths)
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)
    return torch.randn(total, h, d, dtype=dtype, device=DEVICE), cu


@pytest.mark.parametrize("dtype,kw", [(torch.float32, dict(causal=True)),
                                      (torch.bfloat16, dict(window_left=4, softcap=3.0)),
                                      (torch.float32, dict(alibi=True))])
def test_varlen(dtype, kw):
    """Packed sequences (one empty), GQA, max_seqlen hints above the true maxima; each sequence
    must match the dense reference on its own slice (ALiBi: slopes (batch, Hq), a row each)."""
    lq, lk = [5, 17, 0, 1], [9, 17, 3, 20]
    q, cu_q = _pack(lq, 4, 32, dtype)
    k, cu_k = _pack(lk, 2, 32, dtype)
    v, _ = _pack(lk, 2, 16, dtype)
    kw = dict(kw)
    slopes = torch.rand(len(lq), 4, device=DEVICE) if kw.pop("alibi", False) else None
    f = flags(**kw, alibi_slopes=slopes)
    out, lse = A.attention_varlen_fwd(q, k, v, cu_q, cu_k, max(lq) + 7, max(lk) + 3, **f)
    assert out.shape == (sum(lq), 4, 16) and lse.shape == (4, sum(lq))
    dout = torch.randn_like(out)
    dq, dk, dv = B.attention_varlen_bwd(dout, None, q, k, v, cu_q, cu_k, max(lq) + 7, max(lk) + 3,
                                        out, lse, **f)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    outs, lses = [], []
    for b in range(len(lq)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = reference(*(t[s].transpose(0, 1)[None] for t, s in zip(leaves, (sq, sk, sk))),
                         **{**f, "alibi_slopes": None if slopes is None else slopes[b]})
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    ref_out, ref_lse = torch.cat(outs), torch.cat(lses, 1)
    check_close(out, ref_out, TOL[dtype], "out")
    check_lse(lse, ref_lse)
    ref_grads = torch.autograd.grad((ref_out * dout.double()).sum(), leaves)
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        check_close(g, r, TOL[dtype], name)


def test_varlen_deterministic_matches_atomic():
    q, cu = _pack([7, 12], 2, 16, torch.float32)
    k, v = torch.randn_like(q), torch.randn_like(q)
    f = flags(causal=True)
    out, lse = A.attention_varlen_fwd(q, k, v, cu, cu, 12, 12, **f)
    dout = torch.randn_like(out)
    det = B.attention_varlen_bwd(dout, None, q, k, v, cu, cu, 12, 12, out, lse, **f, deterministic=True)
    atomic = B.attention_varlen_bwd(dout, None, q, k, v, cu, cu, 12, 12, out, lse, **f)
    for a, b in zip(det, atomic):
        check_close(a, b, 1e-5, "deterministic vs atomic")


def test_empty_batch():
    q, k, v = rand(0, 2, 5, 32), rand(0, 2, 5, 32), rand(0, 2, 5, 32)
    out, lse = A.attention_fwd(q, k, v, None, **NO_FLAGS)
    assert out.shape == (0, 2, 5, 32) and lse.shape == (0, 2, 5)
    dq, dk, dv, db = B.attention_bwd(out, None, q, k, v, None, out, lse, **NO_FLAGS,
                                     bias_requires_grad=False)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and db is None


def test_supports():
    q, k, v = rand(1, 4, 8, 64), rand(1, 2, 8, 64), rand(1, 2, 8, 32)
    assert A.supports(q, k, v, None, 0.0)
    assert A.supports(q, k, v, torch.zeros(1, 1, 1, 8, device=DEVICE), 0.1)
    assert A.supports(q, k, v, torch.ones(8, 8, dtype=torch.bool, device=DEVICE), 0.0)
    assert A.supports(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), None, 0.0)  # varlen
    assert not A.supports(q.double(), k.double(), v.double(), None, 0.0)
    assert not A.supports(q, k, v.half(), None, 0.0)
    assert not A.supports(rand(1, 4, 8, 8), rand(1, 2, 8, 8), v, None, 0.0)  # head dim < 16
    assert not A.supports(rand(1, 4, 8, 512), rand(1, 2, 8, 512), v, None, 0.0)
    assert not A.supports(rand(1, 3, 8, 64), k, v, None, 0.0)  # 3 heads over 2 kv heads
    assert not A.supports(rand(1, 4, 64, 8).transpose(-1, -2), k, v, None, 0.0)  # strided last dim
    assert not A.supports(q, k, v, torch.zeros(2, 1, 1, 8, device=DEVICE), 0.0)  # bias batch 2
    assert not A.supports(q, k, v, torch.zeros(1, 1, 1, 8, dtype=torch.int32, device=DEVICE), 0.0)


# ------------------------------------------------------------------------------------------
# GPU: realistic sizes, bf16 error no worse than SDPA's own against the same fp64 reference
# ------------------------------------------------------------------------------------------
def _sdpa(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    # SDPA's causal mask is top-left aligned; the grid below uses Sq == Sk where both agree
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("s", [128, 1000, 2048])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_grid_vs_sdpa(d, s, causal):
    b, h = 2, 4
    q, k, v = (rand(b, h, s, d, dtype=torch.bfloat16, transposed=True) for _ in range(3))
    f = flags(causal=causal)
    out, lse = A.attention_fwd(q, k, v, None, **f)
    dout = torch.randn_like(out)
    dq, dk, dv, _ = B.attention_bwd(dout, None, q, k, v, None, out, lse, **f, bias_requires_grad=False)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, **f)
    ref_grads = torch.autograd.grad((ref_out * dout.double()).sum(), leaves)
    sq, sk, sv = (t.detach().requires_grad_() for t in (q, k, v))
    sdpa_out = _sdpa(sq, sk, sv, causal)
    sdpa_grads = torch.autograd.grad(sdpa_out, (sq, sk, sv), dout)

    check_lse(lse, ref_lse)
    for name, ours, theirs, ref in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv),
                                       (sdpa_out,) + sdpa_grads, (ref_out,) + ref_grads):
        err, base = rel_err(ours, ref), rel_err(theirs, ref)
        assert not torch.isnan(ours).any(), f"{name}: NaN"
        assert err <= 1e-2, f"{name}: relative error {err:.2e}"
        assert err <= 1.25 * base + 1e-4, f"{name}: {err:.2e} vs SDPA's {base:.2e}"


@pytest.mark.cuda
def test_gpu_features_bf16():
    """Every feature at once at a realistic size: GQA, window, softcap, padding bias, grad_lse,
    deterministic; fp32 as well."""
    for dtype in (torch.bfloat16, torch.float32):
        bias = torch.zeros(2, 1, 1, 777, device=DEVICE)
        bias[1, ..., 700:] = float("-inf")
        run_case(rand(2, 8, 513, 128, dtype=dtype, transposed=True),
                 rand(2, 2, 777, 128, dtype=dtype, transposed=True),
                 rand(2, 2, 777, 128, dtype=dtype, transposed=True), bias, causal=True,
                 window_left=300, softcap=30.0, grad_lse=True, deterministic=True)


@pytest.mark.cuda
def test_gpu_every_config():
    """Each autotune config of the d128 class (the main H100 target), run alone, against the
    reference: autotuning may pick any of them."""
    kernels = (A._KERNELS["d128"], *B._KERNELS["d128"])  # forward, dK/dV, dQ
    configs = (A._CONFIGS["d128"], *B._CONFIGS["d128"])
    saved = [k.configs for k in kernels]
    try:
        for which, kernel in enumerate(kernels):
            for config in configs[which]:
                kernel.configs = [config]
                run_case(rand(2, 4, 300, 128, dtype=torch.bfloat16, transposed=True),
                         rand(2, 2, 333, 128, dtype=torch.bfloat16, transposed=True),
                         rand(2, 2, 333, 128, dtype=torch.bfloat16, transposed=True),
                         causal=True, deterministic=which == 2)
            kernel.configs = saved[which]
    finally:
        for k, configs in zip(kernels, saved):
            k.configs = configs
