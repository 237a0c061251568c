"""flash.attention / flash.attention_with_lse / flash.attention_backward: opcheck, gradcheck,
numerics against float64 and SDPA, dropout, memory of the chunked CPU path, bad inputs."""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import torch_flash  # noqa: F401  (registers the ops)
from torch_flash.ops import attention as attention_ops
from torch_flash.ops.attention import attention, attention_with_lse
from torch_flash.reference import attention as ref
from torch_flash.testing.samples.attention import CASES, make_bias, make_qkv, make_seed
from _utils import TOL, LargestTensor, assert_rel_close, rel_err, to64

DTYPES = [torch.float32, torch.bfloat16, torch.float16]






# ---------------------------------------------------------------------------- gradients

GRAD_CASES = {
    "plain": (dict(), dict(), None),
    "causal_bottom_right": (dict(sq=3, sk=5), dict(causal=True), None),
    "causal_square": (dict(sq=4, sk=4), dict(causal=True), None),
    "window": (dict(sq=5, sk=5), dict(window_left=1, window_right=1), None),
    "softcap": (dict(), dict(softcap=1.5), None),
    "bias_full": (dict(), dict(), (1, 2, 3, 5)),
    "bias_broadcast": (dict(), dict(causal=True), (3, 5)),
    "bias_heads": (dict(), dict(softcap=2.0), (2, 1, 1)),
    "gqa_dv": (dict(hq=4, hkv=1, dv=3), dict(window_left=2, window_right=0), None),
    "dropout": (dict(), dict(dropout_p=0.3), None),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradcheck(case):
    shape, kw, bshape = GRAD_CASES[case]
    dims = dict(b=1, hq=2, hkv=1, sq=3, sk=5, d=4) | shape
    q, k, v = make_qkv(**dims, dtype=torch.float64, rg=True)
    inputs = [q, k, v] + ([torch.randn(bshape, dtype=torch.float64, requires_grad=True)] if bshape else [])
    seed = make_seed() if kw.get("dropout_p") else None

    def fn(q, k, v, bias=None):
        out, lse = torch.ops.flash.attention_with_lse(q, k, v, bias, seed, **kw)
        # every row sees a key in these cases, so lse is finite and differentiable
        return out, lse, torch.ops.flash.attention(q, k, v, bias, seed, **kw)

    assert torch.autograd.gradcheck(fn, inputs)


def test_gradcheck_bool_bias():
    q, k, v = make_qkv(b=1, hq=2, hkv=1, sq=3, sk=5, d=4, dtype=torch.float64, rg=True)
    bias = torch.rand(3, 5) > 0.3
    bias[:, 0] = True
    assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, bias), (q, k, v))


# ---------------------------------------------------------------------------- numerics

def _public_kw(kw):
    """op keyword arguments -> the public function's."""
    kw = dict(kw)
    window = (kw.pop("window_left", -1), kw.pop("window_right", -1))
    return kw | ({"window": window} if window != (-1, -1) else {})


def _leaves(ts, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in ts]


def _check_against_fp64(shape, kw, bshape, bkind, dtype):
    """out, lse and all gradients of both ops against the fp64 formula."""
    q, k, v = make_qkv(**shape, dtype=dtype)
    bias = make_bias(bshape, bkind, dtype)
    pkw, grad_bias = _public_kw(kw), bkind == "float"
    inputs = (q, k, v, bias) if grad_bias else (q, k, v)
    names = ("dq", "dk", "dv", "dbias")

    def call(fn, ts):
        return fn(*ts[:3], ts[3] if grad_bias else bias, **pkw)

    mine, exact = _leaves(inputs), _leaves(inputs, torch.float64)
    out, lse = call(attention_with_lse, mine)
    o64, lse64 = call(ref.attention_with_lse, exact)
    assert out.dtype == dtype and out.stride() == ref.layout_strides(q, out.shape) and lse.dtype == torch.float32
    assert_rel_close(out, o64, TOL[dtype])
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), finite)
    assert_rel_close(lse[finite], lse64[finite], TOL[torch.float32] * 10, what="lse")
    assert not out[~finite].any(), "rows without a visible key must be 0"
    g, gl = torch.randn_like(out), torch.randn_like(lse).masked_fill(~finite, 0)
    torch.autograd.backward((out, lse), (g, gl))
    torch.autograd.backward((o64, lse64), (g.double(), gl.double()))
    for a, b, name in zip(mine, exact, names):
        assert_rel_close(a.grad, b.grad, 3 * TOL[dtype], what=name)
    # flash.attention: same output, its own autograd path (no grad_lse)
    mine, exact = _leaves(inputs), _leaves(inputs, torch.float64)
    out2 = call(attention, mine)
    assert torch.equal(out2, out)
    out2.backward(g)
    call(ref.attention, exact).backward(g.double())
    for a, b, name in zip(mine, exact, names):
        assert_rel_close(a.grad, b.grad, 3 * TOL[dtype], what=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_numerics_vs_fp64(case, dtype):
    _check_against_fp64(*CASES[case], dtype)


CHUNK_CASES = [
    (dict(sq=11, sk=7), dict(causal=True), (2, 1, 11, 7), "float"),
    (dict(sq=11, sk=7, hkv=1), dict(window_left=2, window_right=1, softcap=2.0), (4, 1, 7), "float"),
    (dict(sq=11, sk=11), dict(), (11, 11), "bool"),
    (dict(sq=13, sk=5, dv=3), dict(causal=True), None, None),
    (dict(sq=11, sk=7), dict(window_left=0, window_right=0), (1, 4, 11, 1), "float"),
]


@pytest.mark.parametrize("case", range(len(CHUNK_CASES)))
def test_numerics_many_chunks(case, monkeypatch):
    """The chunked path in chunks of a few rows: row offsets of masks, bias and dbias."""
    monkeypatch.setattr(ref, "CHUNK_ELEMENTS", 200)
    _check_against_fp64(*CHUNK_CASES[case], torch.float32)


def _sdpa_mask(sq, sk, kw):
    spec = ref.Spec(1.0, kw.get("causal", False), *kw.get("window", (-1, -1)))
    return ref.visible(ref.dense_positions(sq, sk, "cpu"), 0, sq, spec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw,sq,sk", [
    (dict(), 64, 96),
    (dict(causal=True), 80, 80),
    (dict(causal=True), 48, 112),
    (dict(window=(16, 8)), 96, 96),
    (dict(scale=0.3), 33, 65),
])
def test_vs_sdpa(kw, sq, sk, dtype):
    """Same as SDPA (with an explicit bottom-right mask), and in bf16 no further from fp64."""
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=sq, sk=sk, d=32, dtype=dtype, bshd=True)
    mask = _sdpa_mask(sq, sk, kw)
    sdpa_kw = dict(scale=kw.get("scale"), enable_gqa=True)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **sdpa_kw)
    exact = F.scaled_dot_product_attention(*to64(q, k, v), attn_mask=mask, **sdpa_kw)
    ours = attention(q, k, v, **kw)
    if kw.get("causal") and sq != sk:
        from torch.nn.attention.bias import causal_lower_right
        lower_right = F.scaled_dot_product_attention(
            *to64(q, k, v), attn_mask=causal_lower_right(sq, sk), **sdpa_kw)
        torch.testing.assert_close(lower_right, exact)
    err, their_err = rel_err(ours, exact), rel_err(theirs, exact)
    assert err <= TOL[dtype]
    assert err <= 1.1 * their_err + 1e-6, f"ours {err:.3e} vs SDPA {their_err:.3e}"


def test_bias_float_and_bool_vs_sdpa():
    q, k, v = make_qkv(sq=6, sk=9, d=16)
    fbias = torch.randn(2, 1, 6, 9)
    bbias = torch.rand(6, 9) > 0.3
    bbias[:, 0] = True
    for bias in (fbias, bbias):
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
        torch.testing.assert_close(attention(q, k, v, bias), theirs)


def test_softcap_formula():
    q, k, v = make_qkv(dtype=torch.float64)
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.4
    s = 5.0 * torch.tanh(s / 5.0)
    expected = torch.softmax(s, -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(attention(q, k, v, scale=0.4, softcap=5.0), expected)


def test_rows_without_keys():
    """causal with Sq > Sk: the first Sq - Sk queries see nothing -> out 0, lse -inf, no NaN."""
    q, k, v = make_qkv(sq=6, sk=2, rg=True)
    out, lse = attention_with_lse(q, k, v, causal=True)
    assert torch.isinf(lse[:, :, :4]).all() and (lse[:, :, :4] < 0).all()
    assert not out[:, :, :4].any() and torch.isfinite(lse[:, :, 4:]).all()
    (out.sum() + lse[:, :, 4:].sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# ---------------------------------------------------------------------------- dropout

def test_dropout_reproducible():
    q, k, v = make_qkv(sq=16, sk=16, rg=True)

    def run():
        out = attention(q, k, v, dropout_p=0.4)
        return (out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))

    torch.manual_seed(7)
    first = run()
    torch.manual_seed(7)
    second = run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    third = run()
    assert not torch.equal(first[0], third[0])
    assert not torch.equal(first[0], attention(q, k, v))


@pytest.mark.parametrize("chunk", [ref.CHUNK_ELEMENTS, 100])
def test_dropout_matches_reference_and_keep_fraction(chunk, monkeypatch):
    monkeypatch.setattr(ref, "CHUNK_ELEMENTS", chunk)
    q, k, v = make_qkv(sq=9, dtype=torch.float64)
    out = torch.ops.flash.attention(q, k, v, None, make_seed(99), dropout_p=0.3, causal=True)
    expected = ref.attention(q, k, v, causal=True, dropout_p=0.3, dropout_seed=99)
    torch.testing.assert_close(out, expected)
    for p in (0.1, 0.5):
        keep = ref.dropout_keep(ref.Spec(1.0, dropout_p=p, seed=5), ref.dense_positions(64, 256, "cpu"),
                                2, 4, 0, 64)
        assert abs(keep.float().mean().item() - (1 - p)) < 0.01


_TRITON_PHILOX_CHECK = """
import torch, triton, triton.language as tl
from torch_flash.reference.attention import philox_uniform

@triton.jit
def kernel(seed_ptr, c0_ptr, c1_ptr, c2_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c0 = tl.load(c0_ptr + i, mask=i < n).to(tl.uint32)
    c1 = tl.load(c1_ptr + i, mask=i < n).to(tl.uint32)
    c2 = tl.load(c2_ptr + i, mask=i < n).to(tl.uint32)
    r, _, _, _ = tl.philox(tl.load(seed_ptr), c0, c1, c2, c0 * 0)
    tl.store(out_ptr + i, tl.uint_to_uniform_float(r), mask=i < n)

n = 600
c = [torch.cat([torch.arange(100), torch.randint(0, 2**31, (n - 100,))]).int() for _ in range(3)]
for seed in (0, -3, 2**62 + 11):
    out = torch.empty(n)
    seed_t = torch.tensor([seed], dtype=torch.int64)
    kernel[(triton.cdiv(n, 128),)](seed_t, *c, out, n, BLOCK=128)
    assert torch.equal(out, philox_uniform(seed_t, *(t.long() for t in c))), seed
"""


def test_dropout_mask_is_triton_philox():
    """The mask's uniforms are Triton's philox, so a Triton kernel reproduces it bit for bit
    (in a subprocess: the interpreter must be on before triton is imported)."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    subprocess.run([sys.executable, "-c", _TRITON_PHILOX_CHECK], env=env, check=True, timeout=300)


# ---------------------------------------------------------------------------- memory




def test_long_sequence_no_square_buffer():
    """Sq = Sk = 4096 through the chunked path (window and softcap): no tensor of the
    reference's forward or backward comes near Sq * Sk elements."""
    s = 4096
    q, k, v = make_qkv(b=1, hq=1, hkv=1, sq=s, sk=s, d=16)
    spec = ref.Spec(0.25, causal=True, window_left=512, softcap=10.0)
    with LargestTensor() as mode:
        out, lse = ref.forward(q, k, v, None, spec)
        ref.backward(torch.randn_like(out), None, q, k, v, None, out, lse, spec, False)
    assert mode.numel <= ref.CHUNK_ELEMENTS and mode.numel < s * s // 2
    # spot check the last rows against the formula on the keys they can see
    tail = slice(s - 8, s)
    expected = ref.attention(q[:, :, tail], k[:, :, -600:], v[:, :, -600:], scale=0.25, causal=True,
                             window=(512, -1), softcap=10.0)
    torch.testing.assert_close(out[:, :, tail], expected)


# ---------------------------------------------------------------------------- edge cases

@pytest.mark.parametrize("b,sq,sk", [(0, 5, 7), (2, 0, 7), (2, 5, 0), (2, 0, 0)])
def test_empty(b, sq, sk):
    q, k, v = make_qkv(b=b, sq=sq, sk=sk, rg=True)
    bias = torch.randn(5 if sq else 0, 7 if sk else 0).requires_grad_() if sq and sk else None
    out, lse = attention_with_lse(q, k, v, bias, causal=True)
    assert out.shape == (b, 4, sq, 8) and lse.shape == (b, 4, sq)
    assert not out.any() if sk == 0 else True
    if sk == 0 and b * sq:
        assert (lse == -math.inf).all()
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and not t.grad.any()


def test_inputs_untouched_and_out_laid_out_like_q():
    """out follows q's layout as SDPA's does: (B, S, H, D) buffers seen as (B, H, S, D) give an
    out whose transpose back is contiguous; the gradients follow q, k and v likewise."""
    q, k, v = make_qkv(bshd=True, dv=4)
    bias = torch.randn(5, 7)
    copies = [t.clone() for t in (q, k, v, bias)]
    out, lse = attention_with_lse(q, k, v, bias, softcap=1.0)
    attention(q, k, v, dropout_p=0.2)
    assert out.transpose(1, 2).is_contiguous() and lse.is_contiguous()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(attention(*leaves), leaves, torch.randn_like(out))
    assert all(g.stride() == t.stride() for g, t in zip(grads, (q, k, v)))
    for a, b in zip((q, k, v, bias), copies):
        assert torch.equal(a, b)


def test_forced_backend(force_backend):
    q, k, v = make_qkv()
    force_backend("reference")
    attention(q, k, v)
    force_backend("triton")
    with pytest.raises(RuntimeError, match="flash.attention: backend .triton. forced"):
        attention(q, k, v)


def _bad(**over):
    q, k, v = make_qkv()
    args = dict(q=q, k=k, v=v, attn_bias=None) | over
    kw = {n: args.pop(n) for n in list(args) if n not in ("q", "k", "v", "attn_bias")}
    return lambda: attention(args["q"], args["k"], args["v"], args["attn_bias"], **kw)


@pytest.mark.parametrize("bad,match", [
    (_bad(q=torch.randn(4, 5, 8)), "q must have 4 dimensions"),
    (_bad(k=torch.randn(2, 2, 7, 6)), "k has head dim 6 but q has 8"),
    (_bad(v=torch.randn(2, 2, 6, 8)), "v has 6 keys but k has 7"),
    (_bad(v=torch.randn(2, 1, 7, 8)), "v has 1 heads but k has 2"),
    (_bad(k=torch.randn(2, 3, 7, 8), v=torch.randn(2, 3, 7, 8)), "not a multiple of the 3 heads"),
    (_bad(k=torch.randn(3, 2, 7, 8), v=torch.randn(3, 2, 7, 8)), "batch sizes differ"),
    (_bad(v=torch.randn(2, 2, 7, 8, dtype=torch.float64)), "dtype mismatch"),
    (_bad(q=torch.randint(0, 3, (2, 4, 5, 8))), "q has dtype torch.int64"),
    (_bad(q=torch.randn(2, 4, 8, 5).transpose(-1, -2)), "q must have a contiguous last dimension"),
    (_bad(attn_bias=torch.randn(3, 7)), r"attn_bias of shape \(3, 7\) does not broadcast"),
    (_bad(attn_bias=torch.randn(1, 2, 4, 5, 7)), "does not broadcast"),
    (_bad(attn_bias=torch.ones(5, 7, dtype=torch.int32)), "attn_bias has dtype torch.int32"),
    (_bad(dropout_p=1.0), r"dropout_p must be in \[0, 1\)"),
    (_bad(dropout_p=-0.1), "dropout_p must be in"),
    (_bad(softcap=-1.0), "softcap must be >= 0"),
    (_bad(window=(-2, 0)), "window_left must be >= -1"),
    (_bad(window=(0, -5)), "window_right must be >= -1"),
    (_bad(window=3), "window must be a pair"),
    (_bad(q=torch.randn(2, 4, 5, 0), k=torch.randn(2, 2, 7, 0)), "head dims must be > 0"),
    (lambda: torch.ops.flash.attention(*make_qkv(), dropout_p=0.5), "dropout_seed is required"),
    (lambda: torch.ops.flash.attention(*make_qkv(), None, torch.tensor([1.0])), "dropout_seed has dtype"),
    (lambda: torch.ops.flash.attention(*make_qkv(), None, torch.tensor([1, 2])), "dropout_seed must hold one"),
])
def test_bad_inputs(bad, match):
    with pytest.raises(ValueError, match=f"flash.attention: .*{match}"):
        bad()


@pytest.mark.parametrize("change,match", [
    (dict(grad_out=lambda g: g[..., :1]), r"grad_out has shape \(2, 4, 5, 1\), expected out's \(2, 4, 5, 8\)"),
    (dict(grad_out=lambda g: g.double()), "grad_out has dtype torch.float64, expected out's torch.float32"),
    (dict(grad_lse=lambda g: g[:, :1]), r"grad_lse has shape \(2, 1, 5\), expected lse's \(2, 4, 5\)"),
    (dict(out=lambda o: o[:1]), r"out has shape \(1, 4, 5, 8\) and dtype torch.float32; the forward's"),
    (dict(lse=lambda l: l.double()), "lse has shape .* and dtype torch.float64; the forward's"),
])
def test_backward_checks_saved_tensors_and_gradients(change, match):
    """The backward op is public: mis-shaped or mistyped out, lse or upstream gradients raise
    (a smaller one would broadcast into a silently wrong answer, or make a kernel read out of
    bounds; a float32 grad_out with bf16 q broke the Triton kernel's compilation)."""
    q, k, v = make_qkv()
    out, lse = torch.ops.flash.attention_with_lse(q, k, v)
    args = dict(grad_out=torch.randn_like(out), grad_lse=torch.randn_like(lse), out=out, lse=lse)
    (name, f), = change.items()
    args[name] = f(args[name])
    with pytest.raises(ValueError, match=f"flash.attention_backward: {match}"):
        torch.ops.flash.attention_backward(args["grad_out"], args["grad_lse"], q, k, v, None, args["out"],
                                           args["lse"], 0.35, False, -1, -1, 0.0, 0.0, None, False)


def test_bad_inputs_fail_at_trace_time():
    q, k, v = make_qkv()
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fq, fk = mode.from_tensor(q), mode.from_tensor(torch.randn(2, 2, 7, 6))
        with pytest.raises(ValueError, match="flash.attention_with_lse: k has head dim 6"):
            torch.ops.flash.attention_with_lse(fq, fk, mode.from_tensor(v))


# ------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True), CUDA graphs and torch.export; on CUDA the Triton kernels run
# inside the compiled graph, on CPU the reference path does
# ------------------------------------------------------------------------------------------
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _features_step(q, k, v, bias):
    """One training-style call with GQA, causal, softcap and a padding bias; loss and grads."""
    out = attention(q, k, v, attn_bias=bias, causal=True, softcap=20.0)
    return out.float().square().sum()


def _compile_inputs(device, dtype):
    q, k, v = (t.to(device) for t in make_qkv(b=2, hq=4, hkv=2, sq=40, sk=40, d=64, dtype=dtype))
    bias = torch.zeros(2, 1, 1, 40, device=device)
    bias[1, ..., 33:] = float("-inf")
    return [t.requires_grad_() for t in (q, k, v)], bias


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_forward_backward(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    leaves, bias = _compile_inputs(device, dtype)
    eager_loss = _features_step(*leaves, bias)
    eager_grads = torch.autograd.grad(eager_loss, leaves)
    torch._dynamo.reset()
    step = torch.compile(_features_step, fullgraph=True)
    loss = step(*leaves, bias)
    grads = torch.autograd.grad(loss, leaves)
    tol = TOL[dtype]
    assert_rel_close(loss, eager_loss, tol)
    for g, e in zip(grads, eager_grads):
        assert_rel_close(g, e, tol)


_EAGER_THEN_COMPILE = """
import torch, torch_flash
q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
step = lambda q, k, v: torch_flash.attention(q, k, v, causal=True).float().square().sum()
step(q, k, v).backward()  # the first launch imports the kernels inside the op's eager body
eager = [t.grad.clone() for t in (q, k, v)]
for t in (q, k, v):
    t.grad = None
torch.compile(step, fullgraph=True)(q, k, v).backward()
for t, e in zip((q, k, v), eager):
    torch.testing.assert_close(t.grad, e, atol=2e-2, rtol=2e-2)
cache = torch.randn(2, 2, 512, 64, device="cuda", dtype=torch.bfloat16)
lens = torch.full((2,), 300, dtype=torch.int32, device="cuda")
decode = lambda q: torch_flash.attention_decode(q, cache, cache, lens)[0]
q1 = torch.randn(2, 4, 1, 64, device="cuda", dtype=torch.bfloat16)
torch.testing.assert_close(torch.compile(decode, fullgraph=True)(q1), decode(q1))
print("ok")
"""


@pytest.mark.cuda
def test_compile_after_first_eager_call():
    """A fresh process whose first attention call is eager, then compiled (fullgraph, forward and
    backward, and decoding): the compiled graph must trace the kernels, not launch them on fake
    tensors (a wrapper made while the kernels were first imported inside an op stayed bare)."""
    run = subprocess.run([sys.executable, "-c", _EAGER_THEN_COMPILE], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


@pytest.mark.cuda
def test_cuda_graphs_reduce_overhead():
    """mode="reduce-overhead" replays a CUDA graph: no host sync inside the op, and replays
    with new input values give the new results."""
    torch._dynamo.reset()
    step = torch.compile(lambda q, k, v: attention(q, k, v, causal=True), mode="reduce-overhead",
                         fullgraph=True)
    for _ in range(4):  # warm-up, record, replays
        q, k, v = (t.cuda() for t in make_qkv(b=2, hq=8, hkv=2, sq=256, sk=256, d=128, dtype=torch.bfloat16))
        out = step(q, k, v).clone()
        assert_rel_close(out, attention(q, k, v, causal=True), TOL[torch.bfloat16])


class _Attn(torch.nn.Module):
    def forward(self, q, k, v, bias):
        return attention(q, k, v, attn_bias=bias, causal=True, softcap=20.0)


@pytest.mark.parametrize("device", DEVICES)
def test_export_save_load(device, tmp_path):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    (q, k, v), bias = _compile_inputs(device, dtype)
    q, k, v = (t.detach() for t in (q, k, v))
    ep = torch.export.export(_Attn(), (q, k, v, bias))
    assert any(n.target is torch.ops.flash.attention.default for n in ep.graph.nodes)
    torch.export.save(ep, tmp_path / "attn.pt2")
    loaded = torch.export.load(tmp_path / "attn.pt2")
    expected = _Attn()(q, k, v, bias)
    assert torch.equal(loaded.module()(q, k, v, bias), expected)


# (b, hq, hkv, s, d, causal, bshd): plain calls of the kind models make, which cuDNN serves
CUDNN_CASES = [(1, 4, 4, 2048, 128, True, False), (2, 8, 2, 200, 64, False, True),
               (1, 4, 4, 1000, 96, False, True), (1, 4, 2, 2056, 64, True, True)]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _count_cudnn(monkeypatch) -> list:
    """Calls of cuDNN's backward, with CUDNN_BACKWARD on (as by default) and cuDNN's
    backward ahead of the Hopper kernel at every head dim (by default the Hopper kernel goes
    first at SM90_BWD_BEFORE_CUDNN_HDIMS; test_cuda_attention_bwd.py checks that order), with a
    table of plans of its own."""
    monkeypatch.setattr(attention_ops, "CUDNN_BACKWARD", True)
    monkeypatch.setattr(attention_ops, "SM90_BWD_BEFORE_CUDNN_HDIMS", ())
    monkeypatch.setattr(attention_ops.BACKWARD_PLANS, "_plans", {})
    calls, real = [], attention_ops._cudnn_backward
    monkeypatch.setattr(attention_ops, "_cudnn_backward", lambda *args: calls.append(1) or real(*args))
    return calls


@pytest.mark.cuda
@pytest.mark.parametrize("case", CUDNN_CASES)
def test_cudnn_backward(case, monkeypatch):
    """On an H100 or H200 the eager backward of a plain bf16 call is cuDNN's where it goes
    first (_count_cudnn): the op's gradients contiguous (as its fake promises) and within 2x of the
    deterministic Triton backward's error against float64, for an upstream gradient in HF's
    transposed layout too, eager and compiled (traced, the call is counted once); with
    torch.use_deterministic_algorithms cuDNN's does not run and the one that does (the Hopper
    kernel's at D 64 / 128, else Triton's) is bitwise reproducible."""
    if not _hopper():
        pytest.skip("cuDNN's backward is taken on sm_90 only")
    b, hq, hkv, s, d, causal, bshd = case
    q, k, v = (t.cuda() for t in make_qkv(b, hq, hkv, s, s, d, dtype=torch.bfloat16, bshd=bshd))
    g = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    exact = _leaves((q, k, v), torch.float64)
    ref.attention(*exact, causal=causal).backward(g.double())
    calls = _count_cudnn(monkeypatch)

    def grads(fn=attention):
        leaves = _leaves((q, k, v))
        fn(*leaves, causal=causal).backward(g)
        return [t.grad for t in leaves]

    got = grads()
    assert calls == [1]
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        det, det2 = grads(), grads()
    finally:
        torch.use_deterministic_algorithms(False)
    assert calls == [1]
    # traced afresh (a cached graph would skip the trace this counts)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = grads(torch.compile(attention, fullgraph=True))
    assert calls == [1, 1]
    out, lse = attention_with_lse(q, k, v, causal=causal)
    op_grads = torch.ops.flash.attention_backward(g, None, q, k, v, None, out, lse, d ** -0.5, causal,
                                                  -1, -1, 0.0, 0.0, None, False)
    assert all(g.stride() == ref.layout_strides(t, t.shape) for g, t in zip(op_grads[:3], (q, k, v)))
    for mine, comp, ours, ours2, e, name in zip(got, compiled, det, det2, exact, ("dq", "dk", "dv")):
        assert torch.equal(ours, ours2), name
        assert_rel_close(mine, e.grad, max(2 * rel_err(ours, e.grad), TOL[torch.bfloat16] / 4), what=name)
        assert_rel_close(comp, e.grad, max(2 * rel_err(ours, e.grad), TOL[torch.bfloat16] / 4), what=name)


@pytest.mark.cuda
@pytest.mark.parametrize("sdpa_first", [True, False])
def test_cudnn_backward_shares_no_graph_with_sdpa(sdpa_first, monkeypatch):
    """aten caches cuDNN's backward graphs per thread by q, k and v's layout only, though a graph
    bakes in out's and grad_out's too. SDPA's own cuDNN backward (out in q's (B, S, H, D) order)
    and ours (out contiguous) on the same q, k, v, one after the other in either order: both
    as close to float64 as the Triton backward. With q handed over as it came (before
    CUDNN_Q_BATCH_PAD) the second was wrong (H100: dq relative error 0.55 / 0.54). Each order
    has a length of its own, so no earlier graph is cached."""
    if not _hopper():
        pytest.skip("cuDNN's backward is taken on sm_90 only")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    s = 2048 + 64 * (1 + sdpa_first)
    q, k, v = (t.cuda() for t in make_qkv(2, 4, 4, s, s, 64, dtype=torch.bfloat16, bshd=True))
    g = torch.randn(2, 4, s, 64, device="cuda", dtype=torch.bfloat16)
    exact = _leaves((q, k, v), torch.float64)
    ref.attention(*exact, causal=True).backward(g.double())
    calls = _count_cudnn(monkeypatch)

    def grads(fn):
        leaves = _leaves((q, k, v))
        fn(*leaves).backward(g)
        return [t.grad for t in leaves]

    def sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with torch_flash.use_backend("triton"):
        triton = grads(lambda q, k, v: attention(q, k, v, causal=True))
    order = [("sdpa", sdpa), ("flash", lambda q, k, v: attention(q, k, v, causal=True))]
    for name, fn in order if sdpa_first else order[::-1]:
        for got, ours, e, what in zip(grads(fn), triton, exact, ("dq", "dk", "dv")):
            assert_rel_close(got, e.grad, max(2 * rel_err(ours, e.grad), TOL[torch.bfloat16] / 4),
                             what=f"{name} {what}")
    assert calls == [1]


@pytest.mark.cuda
def test_cudnn_backward_only_where_it_agrees(monkeypatch, force_backend):
    """Calls whose semantics cuDNN's backward does not share, or that ask for ours, keep the
    Triton backward: causal with Sq != Sk (cuDNN's diagonal is top-left), softcap, a window,
    a bias, an lse gradient, fp32, k and v whose strides or addresses are not 16-byte aligned,
    use_backend("triton"); short causal calls, which ours runs faster on the H100; and
    every call with TORCH_FLASH_CUDNN_BACKWARD=0 (CUDNN_BACKWARD off)."""
    if not _hopper():
        pytest.skip("cuDNN's backward is taken on sm_90 only")
    calls = _count_cudnn(monkeypatch)

    def run(sq=64, sk=64, dtype=torch.bfloat16, bias=False, with_lse=False, kv_pad=0, kv_offset=0, **kw):
        q, k, v = (t.cuda() for t in make_qkv(1, 4, 4, sq, sk, 64, dtype=dtype))
        # k and v as views of wider rows (kv_pad), or starting kv_offset elements in
        k, v = (torch.zeros(1, 4, sk, 64 + kv_pad + kv_offset, device="cuda", dtype=dtype)
                [..., kv_offset:kv_offset + 64].copy_(t) for t in (k, v))
        q, k, v = _leaves((q, k, v))
        attn_bias = torch.randn(sq, sk, device="cuda", dtype=dtype) if bias else None
        if with_lse:
            out, lse = attention_with_lse(q, k, v, attn_bias, **kw)
            (out.sum() + lse.sum()).backward()
        else:
            attention(q, k, v, attn_bias, **kw).sum().backward()

    run(sq=48, causal=True)
    run(causal=True)
    run(softcap=5.0)
    run(window=(8, 0))
    run(bias=True)
    run(with_lse=True)
    run(dtype=torch.float32)
    run(kv_pad=4)
    run(kv_offset=4)
    force_backend("triton")
    run()
    assert calls == []
    force_backend(None)
    run()
    assert calls == [1]
    monkeypatch.setattr(attention_ops, "CUDNN_BACKWARD", False)
    run()
    assert calls == [1]
    monkeypatch.setattr(attention_ops, "CUDNN_BACKWARD", True)  # the default
    run()
    assert calls == [1, 1]
