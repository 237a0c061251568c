"""ALiBi (alibi_slopes) in flash.attention, flash.attention_with_lse, flash.attention_varlen and
flash.attention_decode: FlashAttention 2's bias -slope * |i + Sk - Sq - j|, checked against float64
attention with that bias written out as a dense tensor, forward and gradients, on the reference
path and on the Triton kernels (under TRITON_INTERPRET=1 at tiny sizes; larger on a GPU); also
gradcheck, torch.compile, bad inputs, memory, and dispatch (the CUDA extension has no ALiBi)."""
import pytest
import torch

import torch_flash
from torch_flash.ops.attention import SM90_BWD_DEFAULT_HDIMS, attention, attention_with_lse
from torch_flash.ops.attention_decode import attention_decode
from torch_flash.ops.attention_varlen import attention_varlen
from torch_flash.reference import attention as ref
from _utils import TOL, LargestTensor, assert_rel_close, force_triton_kernels, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _slopes(b, h, per_batch, device="cpu"):
    """Fresh fp32 slopes, (h,) or (b, h)."""
    return torch.rand((b, h) if per_batch else (h,), device=device) + 0.05


def dense_alibi(slopes, sq, sk):
    """FlashAttention 2's ALiBi written out: (B or 1, H, Sq, Sk) float64 -slope * |i + Sk - Sq - j|."""
    i = torch.arange(sq, device=slopes.device)[:, None] + sk - sq
    j = torch.arange(sk, device=slopes.device)
    return -slopes.double().reshape(-1, slopes.shape[-1], 1, 1) * (i - j).abs()


def _leaves(ts, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in ts]


def _check(out, lse, grads, o64, lse64, grads64, dtype, what=""):
    """out, lse (-inf exactly where the reference has no key) and gradients against float64."""
    assert_rel_close(out, o64, TOL[dtype], what=f"{what} out")
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), finite), f"{what} lse: -inf on other rows"
    if finite.any():
        assert_rel_close(lse[finite], lse64[finite], 10 * TOL[torch.float32], what=f"{what} lse")
    for g, g64, name in zip(grads, grads64, ("dq", "dk", "dv")):
        assert_rel_close(g, g64, 3 * TOL[dtype], what=f"{what} {name}")


def _upstream(out, lse):
    """Fresh upstream gradients; none on the lse of rows that see no key (it is -inf)."""
    return torch.randn_like(out), torch.randn_like(lse).masked_fill(~torch.isfinite(lse), 0)


# ---------------------------------------------------------------------------- dense

# (B, Hq, Hkv, Sq, Sk, D), public keyword arguments, slopes per batch, float bias shape or None.
# Sizes cross the interpreter's 16-row tiles, so the Triton cases visit masked and unmasked blocks.
CASES = {
    "heads_sq<sk_gqa": ((2, 4, 2, 5, 21, 16), dict(), False, None),
    "batch_causal_sq<sk": ((2, 2, 2, 6, 19, 16), dict(causal=True), True, None),
    "causal_sq>sk_mqa": ((1, 4, 1, 19, 6, 16), dict(causal=True), False, None),  # rows without keys
    "batch_sq>sk": ((2, 2, 1, 17, 6, 16), dict(), True, None),
    "window_softcap_scale": ((1, 4, 2, 18, 18, 16), dict(window=(5, 2), softcap=2.0, scale=0.3), True, None),
    "with_bias": ((2, 2, 1, 5, 17, 16), dict(causal=True), False, (2, 1, 1, 17)),
    # tiles wholly left of, right of and across the diagonal, met in every order (_alibi_fold)
    "long_sq>sk": ((1, 2, 1, 40, 37, 16), dict(), True, None),
}


def _dense_inputs(case, dtype, device="cpu"):
    (b, hq, hkv, sq, sk, d), kw, per_batch, bias_shape = CASES[case] if isinstance(case, str) else case
    q = torch.randn(b, hq, sq, d, dtype=dtype, device=device)
    k, v = (torch.randn(b, hkv, sk, d, dtype=dtype, device=device) for _ in range(2))
    bias = None if bias_shape is None else torch.randn(bias_shape, dtype=dtype, device=device)
    return (q, k, v), bias, _slopes(b, hq, per_batch, device), kw


def _exact(qkv, bias, slopes, kw):
    """(out, lse, q/k/v leaves) of float64 attention with the ALiBi bias as a dense tensor."""
    leaves = _leaves(qkv, torch.float64)
    sq, sk = qkv[0].shape[2], qkv[1].shape[2]
    full = dense_alibi(slopes, sq, sk) + (0 if bias is None else bias.double())
    return (*ref.attention_with_lse(*leaves, full, **kw), leaves)


def check_dense(case, dtype, device="cpu", with_attention=True):
    """attention_with_lse (out, lse, gradients with an lse gradient) and, with_attention,
    attention (same out, gradients through its own autograd rule) against _exact."""
    qkv, bias, slopes, kw = _dense_inputs(case, dtype, device)
    mine = _leaves(qkv)
    out, lse = attention_with_lse(*mine, bias, alibi_slopes=slopes, **kw)
    assert out.dtype == dtype and out.stride() == ref.layout_strides(mine[0], out.shape) and lse.dtype == torch.float32
    o64, lse64, exact = _exact(qkv, bias, slopes, kw)
    g, gl = _upstream(o64, lse64)
    torch.autograd.backward((out, lse), (g.to(dtype), gl.float()))
    torch.autograd.backward((o64, lse64), (g.to(dtype).double(), gl.float().double()))
    _check(out, lse, [t.grad for t in mine], o64, lse64, [t.grad for t in exact], dtype, "attention_with_lse")
    if with_attention:
        mine = _leaves(qkv)
        out2 = attention(*mine, bias, alibi_slopes=slopes, **kw)
        assert torch.equal(out2, out)
        out2.backward(g.to(dtype))
        o64, _, exact = _exact(qkv, bias, slopes, kw)
        o64.backward(g.to(dtype).double())
        for a, b, name in zip(mine, exact, ("dq", "dk", "dv")):
            assert_rel_close(a.grad, b.grad, 3 * TOL[dtype], what=f"attention {name}")
    return slopes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_path(case, dtype):
    check_dense(case, dtype)
    assert torch_flash._dispatch.LAST["attention_backward"] == "reference"


def test_flash_attention_causal_form():
    """FlashAttention's causal kernels add slope * (j - Sk + 1) instead: the same out, and an lse
    smaller by slope * (Sq - 1 - i), a constant per row."""
    q, k, v = torch.randn(2, 4, 6, 8, dtype=torch.float64), *torch.randn(2, 2, 2, 9, 8, dtype=torch.float64)
    slopes = _slopes(2, 4, True)
    out, lse = attention_with_lse(q, k, v, alibi_slopes=slopes, causal=True)
    theirs = slopes.double()[:, :, None, None] * (torch.arange(9) - 8)
    o_fa, lse_fa = ref.attention_with_lse(q, k, v, theirs.expand(2, 4, 6, 9), causal=True)
    torch.testing.assert_close(out, o_fa)
    torch.testing.assert_close(lse - lse_fa, slopes.double()[:, :, None] * (5 - torch.arange(6)))


@pytest.mark.parametrize("per_batch,kw", [(False, dict(causal=True)), (True, dict(window=(2, 1), softcap=1.5))])
def test_gradcheck(per_batch, kw):
    q, k, v = (torch.randn(2, h, s, 4, dtype=torch.float64, requires_grad=True) for h, s in ((2, 3), (1, 5), (1, 5)))
    slopes = _slopes(2, 2, per_batch)

    def fn(q, k, v):
        out, lse = torch.ops.flash.attention_with_lse(q, k, v, alibi_slopes=slopes, **_op_kw(kw))
        return out, lse, torch.ops.flash.attention(q, k, v, None, None, slopes, **_op_kw(kw))

    assert torch.autograd.gradcheck(fn, (q, k, v))


def _op_kw(kw):
    """Public keyword arguments -> the ops'."""
    kw = dict(kw)
    window = kw.pop("window", (-1, -1))
    return kw | dict(window_left=window[0], window_right=window[1])





def test_reference_memory_and_chunks(monkeypatch):
    """The reference's bias comes per chunk of query rows (no Sq x Sk tensor), rows offset right."""
    monkeypatch.setattr(ref, "CHUNK_ELEMENTS", 4096)
    s = 384
    q, k, v = (torch.randn(1, 2, s, 16, requires_grad=True) for _ in range(3))
    slopes = _slopes(1, 2, True)
    with LargestTensor() as mode:
        out, lse = attention_with_lse(q, k, v, alibi_slopes=slopes, causal=True)
        out.sum().backward()
    assert mode.numel <= max(4096, q.numel()) < s * s  # chunks of scores, or the inputs' size
    o64, lse64, _ = _exact((q, k, v), None, slopes, dict(causal=True))
    assert_rel_close(out, o64, TOL[torch.float32])
    assert_rel_close(lse, lse64, TOL[torch.float32])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_compile_fullgraph(device):
    """torch.compile(fullgraph=True) traces the slopes through the ops and their backward."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    qkv, _, slopes, _ = _dense_inputs(((2, 4, 2, 40, 40, 64), {}, True, None), dtype, device)

    def step(q, k, v):
        return attention(q, k, v, causal=True, alibi_slopes=slopes).float().square().sum()

    eager = _leaves(qkv)
    loss = step(*eager)
    loss.backward()
    torch._dynamo.reset()
    compiled = _leaves(qkv)
    loss_c = torch.compile(step, fullgraph=True)(*compiled)
    loss_c.backward()
    assert_rel_close(loss_c, loss, TOL[dtype])
    for a, b in zip(compiled, eager):
        assert_rel_close(a.grad, b.grad, TOL[dtype])


# ---------------------------------------------------------------------------- varlen

def _cu(lengths, device="cpu"):
    return torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)


# (lengths of q, lengths of k, public keyword arguments, slopes per sequence)
VARLEN_CASES = {
    "heads": ([3, 5, 0, 2], [4, 5, 3, 7], dict(), False),
    "batch_causal": ([2, 6, 1], [5, 4, 3], dict(causal=True), True),  # Sq > Sk in the second
    "batch_window": ([3, 17, 0], [9, 18, 4], dict(window=(4, 2)), True),
}


def check_varlen(case, dtype, device="cpu"):
    """attention_varlen (out, lse, gradients) against each sequence's float64 dense attention with
    its own dense ALiBi bias (its row of (batch, Hq) slopes). case: a VARLEN_CASES key or value."""
    lq, lk, kw, per_batch = VARLEN_CASES[case] if isinstance(case, str) else case
    hq, hkv, d = 4, 2, 16
    q = torch.randn(sum(lq), hq, d, dtype=dtype, device=device)
    k, v = (torch.randn(sum(lk), hkv, d, dtype=dtype, device=device) for _ in range(2))
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)
    slopes = _slopes(len(lq), hq, per_batch, device)
    mine = _leaves((q, k, v))
    out, lse = attention_varlen(*mine, cu_q, cu_k, max(lq), max(lk), alibi_slopes=slopes, return_lse=True, **kw)
    exact = _leaves((q, k, v), torch.float64)
    outs, lses = [], []
    for b in range(len(lq)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        tq, tk, tv = (t[s].transpose(0, 1)[None] for t, s in zip(exact, (rows, keys, keys)))
        o, l = ref.attention_with_lse(tq, tk, tv, dense_alibi(slopes[b] if per_batch else slopes, lq[b], lk[b]), **kw)
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    o64, lse64 = torch.cat(outs), torch.cat(lses, 1)
    g, gl = _upstream(o64, lse64)
    torch.autograd.backward((out, lse), (g.to(dtype), gl.float()))
    torch.autograd.backward((o64, lse64), (g.to(dtype).double(), gl.float().double()))
    _check(out, lse, [t.grad for t in mine], o64, lse64, [t.grad for t in exact], dtype, "attention_varlen")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen_reference_path(case, dtype):
    check_varlen(case, dtype)


def test_varlen_many_chunks(monkeypatch):
    """Chunks of a few packed rows: each row's slope picked by its own sequence."""
    monkeypatch.setattr(ref, "CHUNK_ELEMENTS", 100)
    check_varlen("batch_causal", torch.float32)


def test_varlen_gradcheck():
    lq, lk = [2, 3], [3, 4]
    q = torch.randn(5, 2, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(7, 1, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cu_q, cu_k, slopes = _cu(lq), _cu(lk), _slopes(2, 2, True)
    assert torch.autograd.gradcheck(
        lambda q, k, v: torch.ops.flash.attention_varlen(q, k, v, cu_q, cu_k, 3, 4, None, slopes, causal=True),
        (q, k, v))


# ---------------------------------------------------------------------------- decode

def _paged(caches, block_size=4, spare=2):
    """(k_pool, v_pool, block_table): (B, H, S, D) caches scattered over the same shuffled blocks."""
    b, h, s, _ = caches[0].shape
    n = s // block_size
    phys = torch.randperm(b * n + spare, device=caches[0].device)[:b * n]
    pools = []
    for cache in caches:
        pool = torch.randn(b * n + spare, h, block_size, cache.shape[-1], dtype=cache.dtype, device=cache.device)
        pool[phys] = cache.reshape(b, h, n, block_size, -1).transpose(1, 2).reshape(b * n, h, block_size, -1)
        pools.append(pool)
    return (*pools, phys.view(b, n).int())


# (B, Hq, Hkv, Sq, Snew, capacity, public keyword arguments, slopes per batch, paged)
DECODE_CASES = {
    "heads": (3, 4, 2, 1, 1, 24, dict(), False, False),
    "batch_causal_paged": (3, 4, 1, 3, 3, 24, dict(causal=True), True, True),
    "batch_window_splits": (2, 2, 2, 2, 0, 40, dict(causal=True, window=(9, -1), num_splits=3), True, False),
    "noncausal_paged_splits": (2, 4, 2, 2, 2, 40, dict(causal=False, num_splits=2), False, True),
}


def check_decode(case, dtype, device="cpu"):
    """attention_decode (out, lse) against each sequence's float64 dense attention over its
    cache_seqlens + Snew keys (queries bottom-right), with its dense ALiBi bias. case: a
    DECODE_CASES key or value."""
    b, hq, hkv, sq, snew, cap, kw, per_batch, paged = DECODE_CASES[case] if isinstance(case, str) else case
    d = 16
    q = torch.randn(b, hq, sq, d, dtype=dtype, device=device)
    caches = [torch.randn(b, hkv, cap, d, dtype=dtype, device=device) for _ in range(2)]
    new = [torch.randn(b, hkv, snew, d, dtype=dtype, device=device) for _ in range(2)] if snew else [None, None]
    seqlens = torch.randint(max(sq - snew, 1), cap - snew + 1, (b,), dtype=torch.int32, device=device)
    slopes = _slopes(b, hq, per_batch, device)
    if paged:
        kp, vp, table = _paged(caches)
        out, lse = attention_decode(q, kp, vp, seqlens, *new, table, alibi_slopes=slopes, **kw)
        caches = [p[table.long()].transpose(1, 2).reshape(b, hkv, cap, d) for p in (kp, vp)]
    else:
        out, lse = attention_decode(q, *caches, seqlens, *new, alibi_slopes=slopes, **kw)
    kw = {n: kw[n] for n in ("causal", "window") if n in kw}
    for i in range(b):
        n = int(seqlens[i]) + snew
        o64, lse64 = ref.attention_with_lse(
            q[i:i + 1].double(), caches[0][i:i + 1, :, :n].double(), caches[1][i:i + 1, :, :n].double(),
            dense_alibi(slopes[i] if per_batch else slopes, sq, n), **kw)
        assert_rel_close(out[i:i + 1], o64, TOL[dtype], what=f"sequence {i} out")
        assert_rel_close(lse[i:i + 1], lse64, 10 * TOL[torch.float32], what=f"sequence {i} lse")
    if snew:  # the new keys went in at cache_seqlens
        assert torch.equal(caches[0][0, :, seqlens[0]:seqlens[0] + snew], new[0][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_reference_path(case, dtype):
    check_decode(case, dtype)


# ---------------------------------------------------------------------------- Triton kernels
# Under TRITON_INTERPRET=1 (set by conftest before triton is imported) on CPU tensors: tiny sizes.

@pytest.mark.parametrize("case,dtype", [(c, torch.float32) for c in CASES] + [("batch_causal_sq<sk", torch.bfloat16)])
def test_triton(case, dtype, force_backend):
    force_triton_kernels(force_backend)
    check_dense(case, dtype, DEVICE, with_attention=False)
    assert torch_flash._dispatch.LAST["attention_with_lse"] == "triton"
    assert torch_flash._dispatch.LAST["attention_backward"] == "triton"


@pytest.mark.parametrize("case", ["heads", "batch_window"])
def test_triton_varlen(case, force_backend):
    force_triton_kernels(force_backend)
    check_varlen(case, torch.float32, DEVICE)
    assert torch_flash._dispatch.LAST["attention_varlen_backward"] == "triton"


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_triton_decode(case, force_backend):
    force_triton_kernels(force_backend)
    check_decode(case, torch.float32, DEVICE)
    assert torch_flash._dispatch.LAST["attention_decode"] == "triton"


# ---------------------------------------------------------------------------- bad inputs

def _dense_call(slopes):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    return lambda: attention(q, k, v, alibi_slopes=slopes)


def _dense_grad_call(slopes):
    q, k, v = torch.randn(2, 4, 5, 8, requires_grad=True), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    return lambda: attention(q, k, v, alibi_slopes=slopes)


def _backward_call(slopes):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    out, lse = attention_with_lse(q, k, v)
    return lambda: torch.ops.flash.attention_backward(torch.randn_like(out), None, q, k, v, None, out, lse, 0.3,
                                                      False, -1, -1, 0.0, 0.0, None, False, slopes)


def _varlen_call(slopes):
    q, k = torch.randn(6, 4, 8), torch.randn(9, 2, 8)
    return lambda: attention_varlen(q, k, k, _cu([2, 4]), _cu([4, 5]), alibi_slopes=slopes)


def _decode_call(slopes):
    q, cache = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 6, 8)
    return lambda: attention_decode(q, cache, cache, torch.tensor([3, 5], dtype=torch.int32), alibi_slopes=slopes)


@pytest.mark.parametrize("make,op", [(_dense_call, "attention"), (_dense_grad_call, "attention_with_lse"),
                                     (_backward_call, "attention_backward"),
                                     (_varlen_call, "attention_varlen"), (_decode_call, "attention_decode")])
@pytest.mark.parametrize("slopes,match", [
    (torch.rand(4, dtype=torch.float64), "alibi_slopes has dtype torch.float64; expected one of torch.float32"),
    (torch.rand(4, dtype=torch.bfloat16), "alibi_slopes has dtype torch.bfloat16"),
    (torch.rand(5), r"alibi_slopes has shape \(5,\); expected \(Hq,\) = \(4,\) or \(B, Hq\) = \(2, 4\)"),
    (torch.rand(3, 4), r"alibi_slopes has shape \(3, 4\); expected"),
    (torch.rand(2, 4, 1), "alibi_slopes must have 1 or 2 dimensions"),
    (torch.rand(4, device="meta"), "all tensors must be on one device, got q on cpu, alibi_slopes on meta"),
])
def test_bad_slopes(make, op, slopes, match):
    with pytest.raises(ValueError, match=f"flash.{op}: {match}"):
        make(slopes)()


def test_bad_slopes_fail_at_trace_time():
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fq, fk, fs = mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(torch.rand(3))
        with pytest.raises(ValueError, match=r"flash.attention: alibi_slopes has shape \(3,\)"):
            torch.ops.flash.attention(fq, fk, fk, None, None, fs)


def test_no_gradient_for_slopes():
    """The slopes are a constant of the bias: attention runs, the slopes get no gradient."""
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    slopes = torch.rand(2, requires_grad=True)
    attention(q, k, v, alibi_slopes=slopes).sum().backward()
    assert slopes.grad is None and q.grad is not None


# ---------------------------------------------------------------------------- GPU

GPU_CASES = [  # (B, Hq, Hkv, Sq, Sk, D), causal, per_batch
    ((2, 8, 2, 1024, 1024, 128), True, False),
    ((2, 8, 8, 512, 1536, 64), True, True),
    ((1, 8, 2, 1536, 512, 128), False, True),
    ((2, 4, 1, 1000, 1000, 64), False, False),
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_dense(case, dtype):
    """Realistic sizes on the default dispatch (the Hopper kernels where built, forward for their
    head dims and backward for SM90_BWD_DEFAULT_HDIMS; never cuDNN, which has no ALiBi; else
    the Triton kernels), and no further from float64 than SDPA with the dense bias."""
    shape, causal, per_batch = case
    check_dense((shape, dict(causal=causal), per_batch, None), dtype, "cuda")
    d = shape[-1]
    info = torch_flash._extension.build_info() if torch.cuda.get_device_capability() == (9, 0) else None
    fwd = "cuda" if info and "flash::attention_fwd_sm90" in info["ops"] and d in info["hdims"] else "triton"
    bwd = ("cuda" if fwd == "cuda" and d in SM90_BWD_DEFAULT_HDIMS and d in info.get("backward_hdims", ())
           else "triton")
    assert torch_flash._dispatch.LAST["attention_with_lse"] == fwd
    assert torch_flash._dispatch.LAST["attention_backward"] == bwd
    qkv, _, slopes, _ = _dense_inputs((shape, {}, per_batch, None), dtype, "cuda")
    exact, _, _ = _exact(qkv, None, slopes, dict(causal=causal))
    b, hq, hkv, sq, sk, _ = shape
    mask = dense_alibi(slopes, sq, sk)
    if causal:
        mask = mask.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril(sk - sq), float("-inf"))
    sdpa = torch.nn.functional.scaled_dot_product_attention(*qkv, attn_mask=mask.to(dtype), enable_gqa=True)
    ours = attention(*qkv, causal=causal, alibi_slopes=slopes)
    assert rel_err(ours, exact) <= 1.1 * rel_err(sdpa, exact) + 1e-6


@pytest.mark.cuda
def test_gpu_memory_no_square_bias():
    """Sq = Sk = 16k, 16 heads: a dense fp32 bias would take 16 GiB; the forward and backward
    together need little more than their inputs, outputs and gradients."""
    q, k, v = (torch.randn(1, 16, 16384, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    slopes = _slopes(1, 16, False, "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    attention(q, k, v, causal=True, alibi_slopes=slopes).sum().backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 2 ** 28  # 256 MiB; inputs are 96 MiB


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_batch", [False, True])
def test_gpu_varlen(dtype, per_batch):
    check_varlen(([300, 1, 0, 777, 64], [500, 200, 9, 777, 1], dict(causal=True), per_batch), dtype, "cuda")
    assert torch_flash._dispatch.LAST["attention_varlen_backward"] == "triton"


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(DECODE_CASES.values()) + [
    (4, 32, 8, 1, 1, 4096, dict(causal=True), True, True),  # long paged caches, splits chosen per call
    (8, 16, 16, 4, 4, 2048, dict(causal=True, window=(256, -1)), False, False)])
def test_gpu_decode(case):
    check_decode(case, torch.bfloat16, "cuda")
    assert torch_flash._dispatch.LAST["attention_decode"] == "triton"
