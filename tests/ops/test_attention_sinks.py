"""Attention sinks (gpt-oss: a learnable logit per q head, one more softmax column that takes
probability mass and adds no value) in flash.attention, flash.attention_with_lse,
flash.attention_varlen and flash.attention_decode: against a float64 formula that appends the
sink column explicitly, forward and gradients (the sinks' too), on the reference path and on the
Triton kernels (under TRITON_INTERPRET=1 at tiny sizes; larger on a GPU); gradcheck,
torch.compile, bad inputs."""
import math

import pytest
import torch

import torch_flash
from torch_flash.ops import attention as attention_ops
from torch_flash.ops.attention import attention, attention_with_lse
from torch_flash.ops.attention_decode import attention_decode
from torch_flash.ops.attention_varlen import attention_varlen
from torch_flash.reference import attention as ref
from _utils import TOL, assert_rel_close, force_triton_kernels, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def exact(q, k, v, sinks, *, causal=False, window=(-1, -1), softcap=0.0, bias=None):
    """(out, lse) in float64 of softmax over [scores, sink] per row, the sink column's value 0.
    q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D); causal and window aligned bottom-right."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.double()
    sq, sk = s.shape[-2:]
    rel = torch.arange(sk, device=q.device) - (torch.arange(sq, device=q.device)[:, None] + sk - sq)
    right = 0 if causal else window[1]
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        visible &= rel <= right
    if window[0] >= 0:
        visible &= rel >= -window[0]
    s = s.masked_fill(~visible, -math.inf)
    sink = sinks.double().reshape(1, -1, 1, 1).expand(s.shape[0], -1, sq, 1)
    full = torch.cat((s, sink), -1)
    lse = torch.logsumexp(full, -1)
    p = torch.exp(full - lse.masked_fill(lse == -math.inf, 0)[..., None])[..., :-1]
    return p @ v, lse


def _leaves(ts, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in ts]


def _check(out, lse, grads, o64, lse64, grads64, dtype):
    assert_rel_close(out, o64, TOL[dtype], what="out")
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), finite)
    assert_rel_close(lse[finite], lse64[finite], 10 * TOL[torch.float32], what="lse")
    for g, g64, name in zip(grads, grads64, ("dq", "dk", "dv", "dsinks")):
        assert_rel_close(g, g64, 3 * TOL[dtype], what=name)


# (B, Hq, Hkv, Sq, Sk, D), public keyword arguments; sizes cross the interpreter's 16-row tiles
CASES = {
    "gqa_sq<sk": ((2, 4, 2, 5, 21, 16), dict()),
    "causal_sq>sk": ((1, 4, 1, 19, 6, 16), dict(causal=True)),  # rows with no key: all mass on the sink
    "window_softcap": ((2, 2, 2, 18, 18, 16), dict(window=(5, 2), softcap=2.0)),
    "alibi_bias": ((2, 4, 2, 6, 17, 16), dict(causal=True, alibi=True, bias=True)),
    "alibi_long": ((1, 2, 1, 40, 37, 16), dict(alibi=True)),  # the sink logit through every ALiBi fold
}


def check_dense(case, dtype, device="cpu", sinks_dtype=torch.float32, with_attention=True, with_lse=True):
    """attention_with_lse (out, lse and gradients of q, k, v, sinks, with an lse gradient) where
    with_lse, and attention (no lse) where with_attention, against `exact`."""
    (b, hq, hkv, sq, sk, d), kw = CASES[case] if isinstance(case, str) else case
    kw = dict(kw)
    qkv = (torch.randn(b, hq, sq, d, dtype=dtype, device=device),
           *(torch.randn(b, hkv, sk, d, dtype=dtype, device=device) for _ in range(2)))
    sinks = (torch.randn(hq, device=device) * 2).to(sinks_dtype)
    extra, bias = {}, None
    if kw.pop("alibi", False):
        slopes = torch.rand(b, hq, device=device)
        extra["alibi_slopes"] = slopes
        dist = (torch.arange(sq, device=device)[:, None] + sk - sq - torch.arange(sk, device=device)).abs()
        bias = -slopes.double()[:, :, None, None] * dist
    attn_bias = None
    if kw.pop("bias", False):
        attn_bias = torch.randn(b, 1, 1, sk, dtype=dtype, device=device)
        bias = attn_bias.double() if bias is None else bias + attn_bias.double()
    for fn in (attention_with_lse,) * with_lse + (attention,) * with_attention:
        mine = _leaves((*qkv, sinks))
        result = fn(*mine[:3], attn_bias, sinks=mine[3], **kw, **extra)
        ins = _leaves((*qkv, sinks), torch.float64)
        o64, lse64 = exact(*ins, bias=bias, **kw)
        g = torch.randn_like(o64)
        if fn is attention:
            result.backward(g.to(dtype))
            o64.backward(g.to(dtype).double())
            assert_rel_close(result, o64, TOL[dtype])
            # dsinks sums rowsum(dO * O) over all rows from O rounded to dtype, where the rows may
            # cancel: no closer to float64 than twice that sum taken over the rounded O allows
            rounded = ref.sink_grad(ins[3].detach(), result.detach().double(), g.to(dtype).double(),
                                    lse64.detach(), None)
            tols = [3 * TOL[dtype]] * 3 + [max(3 * TOL[dtype], 2 * rel_err(rounded, ins[3].grad))]
            for a, e, name, tol in zip(mine, ins, ("dq", "dk", "dv", "dsinks"), tols):
                assert_rel_close(a.grad, e.grad, tol, what=f"attention {name}")
        else:
            out, lse = result
            gl = torch.randn_like(lse64).masked_fill(~torch.isfinite(lse64), 0)
            torch.autograd.backward((out, lse), (g.to(dtype), gl.float()))
            torch.autograd.backward((o64, lse64), (g.to(dtype).double(), gl.float().double()))
            _check(out, lse, [t.grad for t in mine], o64, lse64, [t.grad for t in ins], dtype)
            assert mine[3].grad.dtype == sinks_dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_path(case, dtype):
    check_dense(case, dtype)


def test_sinks_in_bf16():
    """Sinks kept in the model's dtype (bf16 parameters) work, their gradient in that dtype."""
    check_dense("gqa_sq<sk", torch.bfloat16, sinks_dtype=torch.bfloat16, with_attention=False)


def test_rows_without_keys_and_infinite_sink():
    """A row that sees no key gives out 0 and lse = its sink; a sink of -inf is no sink at all."""
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8)
    sinks = torch.tensor([0.5, -math.inf])
    out, lse = attention_with_lse(q, k, v, causal=True, sinks=sinks)
    assert not out[:, :, :3].any() and torch.equal(lse[0, 0, :3], torch.full((3,), 0.5))
    assert (lse[0, 1, :3] == -math.inf).all()
    plain, plain_lse = attention_with_lse(q, k, v, causal=True)
    torch.testing.assert_close(out[:, 1], plain[:, 1])
    torch.testing.assert_close(lse[:, 1], plain_lse[:, 1])


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(1, 1), softcap=1.5)])
def test_gradcheck(kw):
    q = torch.randn(2, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 1, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)
    window = kw.get("window", (-1, -1))
    op_kw = dict(causal=kw.get("causal", False), window_left=window[0], window_right=window[1],
                 softcap=kw.get("softcap", 0.0))

    def fn(q, k, v, sinks):
        out, lse = torch.ops.flash.attention_with_lse(q, k, v, None, None, None, sinks, **op_kw)
        return out, lse, torch.ops.flash.attention(q, k, v, None, None, None, sinks, **op_kw)

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_compile_fullgraph(device):
    """torch.compile(fullgraph=True): sinks and their gradient traced through the ops' autograd."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(2, h, 40, 64, dtype=dtype, device=device) for h in (4, 2, 2))
    sinks = torch.randn(4, device=device)

    def step(q, k, v, sinks):
        return attention(q, k, v, causal=True, sinks=sinks).float().square().sum()

    eager = _leaves((q, k, v, sinks))
    step(*eager).backward()
    torch._dynamo.reset()
    compiled = _leaves((q, k, v, sinks))
    torch.compile(step, fullgraph=True)(*compiled).backward()
    for a, b in zip(compiled, eager):
        assert_rel_close(a.grad, b.grad, TOL[dtype])


# ---------------------------------------------------------------------------- varlen

def _cu(lengths, device="cpu"):
    return torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)


def check_varlen(lq, lk, kw, dtype, device="cpu"):
    """attention_varlen (out, lse, gradients of q, k, v, sinks) against `exact` per sequence."""
    hq, hkv, d = 4, 2, 16
    q = torch.randn(sum(lq), hq, d, dtype=dtype, device=device)
    k, v = (torch.randn(sum(lk), hkv, d, dtype=dtype, device=device) for _ in range(2))
    sinks = torch.randn(hq, device=device)
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)
    mine = _leaves((q, k, v, sinks))
    out, lse = attention_varlen(*mine[:3], cu_q, cu_k, max(lq), max(lk), sinks=mine[3], return_lse=True, **kw)
    ins = _leaves((q, k, v, sinks), torch.float64)
    outs, lses = [], []
    for b in range(len(lq)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = exact(*(t[s].transpose(0, 1)[None] for t, s in zip(ins, (rows, keys, keys))), ins[3], **kw)
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    o64, lse64 = torch.cat(outs), torch.cat(lses, 1)
    g, gl = torch.randn_like(o64), torch.randn_like(lse64)
    torch.autograd.backward((out, lse), (g.to(dtype), gl.float()))
    torch.autograd.backward((o64, lse64), (g.to(dtype).double(), gl.float().double()))
    _check(out, lse, [t.grad for t in mine], o64, lse64, [t.grad for t in ins], dtype)


VARLEN_CASES = [([3, 5, 0, 2], [4, 5, 3, 7], dict()), ([2, 6, 1], [5, 4, 0], dict(causal=True))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
def test_varlen_reference_path(case, dtype):
    check_varlen(*VARLEN_CASES[case], dtype)


def test_varlen_gradcheck():
    q = torch.randn(5, 2, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(7, 1, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)
    cu_q, cu_k = _cu([2, 3]), _cu([3, 4])
    assert torch.autograd.gradcheck(
        lambda q, k, v, sinks: torch.ops.flash.attention_varlen(q, k, v, cu_q, cu_k, 3, 4, None, None, sinks,
                                                                causal=True),
        (q, k, v, sinks))


# ---------------------------------------------------------------------------- decode

# (B, Hq, Hkv, Sq, Snew, capacity, public keyword arguments)
DECODE_CASES = {
    "gqa": (3, 4, 2, 1, 1, 24, dict()),
    "sq3_window_splits": (3, 4, 1, 3, 3, 40, dict(window=(6, -1), num_splits=3)),
    "noncausal_splits": (2, 2, 2, 2, 0, 40, dict(causal=False, num_splits=2)),
}


def check_decode(case, dtype, device="cpu"):
    """attention_decode (out, lse) against `exact` over each sequence's cache_seqlens + Snew keys
    (queries bottom-right). Some sequence's queries see no key under the window (all mass on
    the sink) when the window is short."""
    b, hq, hkv, sq, snew, cap, kw = DECODE_CASES[case] if isinstance(case, str) else case
    d = 16
    q = torch.randn(b, hq, sq, d, dtype=dtype, device=device)
    caches = [torch.randn(b, hkv, cap, d, dtype=dtype, device=device) for _ in range(2)]
    new = [torch.randn(b, hkv, snew, d, dtype=dtype, device=device) for _ in range(2)] if snew else [None, None]
    seqlens = torch.randint(max(sq - snew, 0), cap - snew + 1, (b,), dtype=torch.int32, device=device)
    seqlens[0] = max(sq - snew, 0)
    sinks = torch.randn(hq, device=device)
    out, lse = attention_decode(q, *caches, seqlens, *new, sinks=sinks, **kw)
    kw = {n: kw[n] for n in ("causal", "window") if n in kw} | {"causal": kw.get("causal", True)}
    for i in range(b):
        n = int(seqlens[i]) + snew
        o64, lse64 = exact(q[i:i + 1], caches[0][i:i + 1, :, :n], caches[1][i:i + 1, :, :n], sinks, **kw)
        assert_rel_close(out[i:i + 1], o64, TOL[dtype], what=f"sequence {i} out")
        assert_rel_close(lse[i:i + 1], lse64, 10 * TOL[torch.float32], what=f"sequence {i} lse")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_reference_path(case, dtype):
    check_decode(case, dtype)


# ---------------------------------------------------------------------------- Triton kernels

@pytest.mark.parametrize("case", list(CASES))
def test_triton(case, force_backend):
    force_triton_kernels(force_backend)
    check_dense(case, torch.float32, DEVICE, with_attention=False)
    assert torch_flash._dispatch.LAST["attention_with_lse"] == "triton"
    assert torch_flash._dispatch.LAST["attention_backward"] == "triton"


def test_triton_varlen(force_backend):
    force_triton_kernels(force_backend)
    check_varlen([3, 17, 0], [9, 18, 4], dict(causal=True), torch.float32, DEVICE)
    assert torch_flash._dispatch.LAST["attention_varlen"] == "triton"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal_sq>sk"])
def test_triton_expanded_grad(causal, force_backend):
    """The expanded gradient of .sum() through the Triton backward, whose delta pass also gives
    the sinks' gradient (rows without keys too): against float64."""
    force_triton_kernels(force_backend)
    q, k, v = torch.randn(2, 4, 19, 16), torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16)
    sinks = torch.randn(4) * 2
    mine, ins = _leaves((q, k, v, sinks)), _leaves((q, k, v, sinks), torch.float64)
    attention(*mine[:3], sinks=mine[3], causal=causal).sum().backward()
    exact(*ins, causal=causal)[0].sum().backward()
    assert torch_flash._dispatch.LAST["attention_backward"] == "triton"
    for a, e, name in zip(mine, ins, ("dq", "dk", "dv", "dsinks")):
        assert_rel_close(a.grad, e.grad, 3 * TOL[torch.float32], what=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_sinks_around_sink_free_kernels(causal, dtype, force_backend):
    """What the Hopper forward's epilogue and cuDNN's and the Hopper backward rely on: a
    sink-free forward's (out0, lse0) rescaled (lse = logaddexp(lse0, sink), out = out0 *
    exp(lse0 - lse)), and a sink-free backward given that lse plus the delta pass's sink gradient
    (sink_grad), equal attention with sinks. Sinks of -inf (none) and of any size; on the Triton
    kernels (interpreted on CPU)."""
    from torch_flash.kernels.triton.attention_backward import attention_bwd
    from torch_flash.kernels.triton.attention_sinks import sink_grad
    force_triton_kernels(force_backend)
    q, k, v = (torch.randn(2, 4, 24, 16, device=DEVICE).to(dtype) for _ in range(3))
    sinks = torch.tensor([-math.inf, -3.0, 0.5, 4.0], device=DEVICE)
    out0, lse0 = ref.attention_with_lse(q, k, v, causal=causal)
    lse = torch.logaddexp(lse0.float(), sinks[:, None])
    out = (out0.float() * torch.exp(lse0.float() - lse)[..., None]).to(dtype)
    ins = _leaves((q, k, v, sinks), torch.float64)
    o64, lse64 = exact(*ins, causal=causal)
    assert_rel_close(out, o64, TOL[dtype], what="out")
    assert_rel_close(lse, lse64, 10 * TOL[torch.float32], what="lse")
    g = torch.randn_like(o64)
    o64.backward(g)
    grads = (*attention_bwd(g.to(dtype), None, q, k, v, None, out, lse, scale=16 ** -0.5, causal=causal,
                            window_left=-1, window_right=-1, softcap=0.0, dropout_p=0.0, dropout_seed=None,
                            bias_requires_grad=False)[:3],
             sink_grad(g.to(dtype), out, lse, sinks))
    for a, e, name in zip(grads, ins, ("dq", "dk", "dv", "dsinks")):
        assert_rel_close(a, e.grad, 3 * TOL[dtype], what=name)


@pytest.mark.parametrize("path", ["sm90", "cudnn"])
def test_hopper_plans_on_stand_ins(path, force_backend, monkeypatch):
    """flash.attention's Hopper plans with sinks, the CUDA kernels replaced by stand-ins (the
    reference forward with sinks, the sink-free Triton backward) so that the op's own glue runs
    on CPU: the forward gets the sinks, the backward is given their lse and adds dsinks."""
    from torch_flash.kernels.triton.attention_backward import attention_bwd
    from torch_flash.ops import attention as ops
    from torch_flash.reference import attention as ref
    force_triton_kernels(force_backend)  # skips without the interpreter

    def bwd(grad_out, q, k, v, out, lse, scale, causal, alibi=None):
        return attention_bwd(grad_out, None, q, k, v, None, out, lse, scale=scale, causal=causal, window_left=-1,
                             window_right=-1, softcap=0.0, dropout_p=0.0, dropout_seed=None,
                             bias_requires_grad=False, alibi_slopes=alibi)[:3]
    monkeypatch.setattr(torch.ops.flash, "attention_fwd_sm90", lambda q, k, v, scale, causal, sinks, alibi: tuple(
        t.float() if t.dim() == 3 else t
        for t in ref.attention_with_lse(q, k, v, scale=scale, causal=causal, sinks=sinks, alibi_slopes=alibi)))
    monkeypatch.setattr(torch.ops.flash, "attention_bwd_sm90", bwd)
    monkeypatch.setattr(torch_flash._dispatch, "available", lambda device_type: frozenset(
        {"reference", "triton", "cuda"}))
    monkeypatch.setattr(ops, "_sm90_serves", lambda *args: True)
    monkeypatch.setattr(ops, "_sm90_bwd_serves", lambda *args: path == "sm90")
    monkeypatch.setattr(ops, "cudnn_backward_serves", lambda *args: path == "cudnn")
    monkeypatch.setattr(ops, "_cudnn_backward", lambda grad_out, q, k, v, out, lse, spec: bwd(
        grad_out, q, k, v, out, lse, spec.scale, spec.causal))
    q, k, v = (torch.randn(2, 4, 24, 16) for _ in range(3))
    sinks = torch.tensor([-math.inf, -3.0, 0.5, 4.0])
    for causal in (False, True):
        mine, ins = _leaves((q, k, v, sinks)), _leaves((q, k, v, sinks), torch.float64)
        with torch_flash.use_backend("cuda"):  # on CPU tensors: unforced, the reference would run
            out = attention(*mine[:3], sinks=mine[3], causal=causal)
        assert torch_flash._dispatch.LAST["attention_with_lse"] == "cuda"
        o64 = exact(*ins, causal=causal)[0]
        g = torch.randn_like(o64)
        with torch_flash.use_backend("cuda" if path == "sm90" else None):  # cuDNN's is never forced
            out.backward(g.float())
        o64.backward(g)
        assert torch_flash._dispatch.LAST["attention_backward"] == ("cuda" if path == "sm90" else path)
        assert_rel_close(out, o64, TOL[torch.float32], what="out")
        for a, e, name in zip(mine, ins, ("dq", "dk", "dv", "dsinks")):
            assert_rel_close(a.grad, e.grad, 3 * TOL[torch.float32], what=name)


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_triton_decode(case, force_backend):
    force_triton_kernels(force_backend)
    check_decode(case, torch.float32, DEVICE)
    assert torch_flash._dispatch.LAST["attention_decode"] == "triton"


# ---------------------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("sinks,match", [
    (torch.randn(5), r"sinks has shape \(5,\); expected \(Hq,\) = \(4,\)"),
    (torch.randn(1, 4), "sinks must have 1 dimensions"),
    (torch.ones(4, dtype=torch.int32), "sinks has dtype torch.int32"),
    (torch.randn(4, device="meta"), "all tensors must be on one device, got q on cpu, sinks on meta"),
])
def test_bad_sinks(sinks, match):
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8)
    with pytest.raises(ValueError, match=f"flash.attention: {match}"):
        attention(q, k, k, sinks=sinks)
    with pytest.raises(ValueError, match=f"flash.attention_varlen: {match}"):
        attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), k[0].transpose(0, 1), _cu([5]), _cu([7]),
                         sinks=sinks)
    with pytest.raises(ValueError, match=f"flash.attention_decode: {match}"):
        attention_decode(q, k, k, torch.tensor([3, 5], dtype=torch.int32), sinks=sinks)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fq, fk = mode.from_tensor(q), mode.from_tensor(k)
        with pytest.raises(ValueError, match=f"flash.attention_with_lse: {match}"):
            torch.ops.flash.attention_with_lse(fq, fk, fk, None, None, None, mode.from_tensor(sinks))


# ---------------------------------------------------------------------------- GPU

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,kw", [
    ((2, 8, 2, 1024, 1024, 64), dict(causal=True)),  # gpt-oss: GQA, causal, sinks
    ((2, 8, 8, 512, 1536, 128), dict(window=(128, 0))),
    ((1, 8, 2, 1536, 512, 64), dict(causal=True, alibi=True)),
])
def test_gpu_dense(shape, kw, dtype):
    """Realistic sizes on the default dispatch (the first case's forward is the Hopper kernel's
    where it is built, with the sinks added to its results)."""
    check_dense((shape, kw), dtype, "cuda", with_attention=False)


@pytest.mark.cuda
@pytest.mark.parametrize("forced,backward", [(None, ("cuda", "cudnn")), ("cuda", ("cuda", "cuda"))])
def test_gpu_hopper_paths(forced, backward, force_backend, monkeypatch):
    """Sinks on the Hopper forward (in its epilogue) and on cuDNN's or the Hopper backward
    (given the sinks' lse; the sinks' gradient from the delta pass)."""
    info = torch_flash._extension.build_info()
    if torch.cuda.get_device_capability() != (9, 0) or not info or 128 not in info.get("backward_hdims", ()):
        pytest.skip("needs the Hopper kernels of torch_flash._C at head dim 128 on an sm_90 GPU")
    monkeypatch.setattr(attention_ops, "CUDNN_BACKWARD", True)
    if forced:
        force_backend(forced)
    # cuDNN's backward serves causal from 2048; at D=128 without a mask the Hopper one goes first
    for (causal, sq), path in zip(((False, 1024), (True, 2048)), backward):
        check_dense(((2, 4, 2, sq, sq, 128), dict(causal=causal)), torch.bfloat16, "cuda", with_lse=False)
        assert torch_flash._dispatch.LAST["attention_with_lse"] == "cuda"
        assert torch_flash._dispatch.LAST["attention_backward"] == path


@pytest.mark.cuda
def test_gpu_varlen():
    check_varlen([300, 1, 0, 777, 64], [500, 200, 9, 777, 1], dict(causal=True), torch.bfloat16, "cuda")
    assert torch_flash._dispatch.LAST["attention_varlen_backward"] == "triton"


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(DECODE_CASES.values()) + [
    (4, 64, 8, 1, 1, 8192, dict()),  # gpt-oss-like decoding: long cache, splits chosen per call
    (8, 16, 16, 4, 4, 2048, dict(window=(128, -1)))])
def test_gpu_decode(case):
    check_decode(case, torch.bfloat16, "cuda")
    assert torch_flash._dispatch.LAST["attention_decode"] == "triton"
