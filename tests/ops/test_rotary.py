"""flash.rotary, flash.rotary_qk and their in-place forms: opcheck, gradcheck, numerics
against the model code, varlen, one kernel launch, in place under autograd and torch.compile,
bad inputs."""

import pytest
import torch

from torch_flash import _dispatch
from torch_flash.ops.rotary import rotary, rotary_cos_sin, rotary_qk
from torch_flash.testing.llama import rotate_half
from torch_flash.testing.samples.rotary import DTYPES, make_packed, make_qk, make_tables, make_x
from _utils import TOL, assert_rel_close, rel_err

def rotate_every_two(x):  # GPT-J's rotate_every_two
    return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)


def rope_model(x, cos, sin, pos, interleaved=False):
    """The model code's RoPE of x (..., S, D) at positions pos (S,) or (B, S), with full-width
    cos/sin as the models build them; dims past 2 * cos.shape[-1] pass through."""
    rd = 2 * cos.shape[-1]
    c, s = cos[pos], sin[pos]
    if interleaved:
        c, s, rot = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1), rotate_every_two
    else:
        c, s, rot = torch.cat((c, c), -1), torch.cat((s, s), -1), rotate_half
    if pos.dim() == 2:  # per-sequence positions: broadcast over heads
        c, s = c.unsqueeze(1), s.unsqueeze(1)
    xr = x[..., :rd]
    return torch.cat((xr * c.to(x.dtype) + rot(xr) * s.to(x.dtype), x[..., rd:]), -1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rd", [8, 4])
def test_gradcheck(interleaved, rd):
    c, s = make_tables(9, rd, torch.float64)
    x = torch.randn(2, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([2, 5])
    for fn in (lambda a: rotary(a, c, s, interleaved=interleaved, seqlen_offsets=1),
               lambda a: rotary(a, c, s, interleaved=interleaved, seqlen_offsets=offsets)):
        assert torch.autograd.gradcheck(fn, (x,))
        assert torch.autograd.gradgradcheck(fn, (x,))
    xp = torch.randn(6, 2, 8, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda a: rotary(a, c, s, interleaved=interleaved, cu_seqlens=cu), (xp,))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rd", [64, 32])
def test_matches_model_code(dtype, interleaved, rd):
    """Against the HF rotate_half (GPT-NeoX/LLaMA, Phi's partial rotary) and GPT-J formulas in
    fp64, and no worse than the same formula run in dtype."""
    B, H, S, D, off = 2, 4, 33, 64, 5
    x = torch.randn(B, H, S, D, dtype=dtype)
    c, s = make_tables(S + off, rd)
    pos = torch.arange(S) + off
    out = rotary(x, c, s, interleaved=interleaved, seqlen_offsets=off)
    exact = rope_model(x.double(), c.double(), s.double(), pos, interleaved)
    err = assert_rel_close(out, exact, TOL[dtype])
    theirs = rope_model(x, c.to(dtype), s.to(dtype), pos, interleaved)
    assert err <= rel_err(theirs, exact) + 1e-6
    assert out.dtype == dtype
    torch.testing.assert_close(out[..., rd:], x[..., rd:], rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_offsets_and_layouts(interleaved):
    """Per-sequence offsets, packed sequences and per-token tables agree with plain calls."""
    c, s = make_tables(20, 8)
    x = make_x((3, 2, 5, 8), flash_layout=True)
    offsets = torch.tensor([0, 4, 15], dtype=torch.int32)
    out = rotary(x, c, s, interleaved=interleaved, seqlen_offsets=offsets)
    assert out.stride() == x.stride()  # the (B, S, H, D) layout is kept
    pos = torch.arange(5) + offsets.long()[:, None]
    torch.testing.assert_close(out, rope_model(x, c, s, pos, interleaved))
    gathered = rotary(x, c[pos], s[pos], interleaved=interleaved)
    torch.testing.assert_close(gathered, out)
    for b in range(3):
        torch.testing.assert_close(out[b:b + 1], rotary(x[b:b + 1], c, s, interleaved=interleaved,
                                                        seqlen_offsets=int(offsets[b])))
    xp, cu = make_packed([5, 0, 3], 2, 12)
    outp = rotary(xp, c, s, interleaved=interleaved, seqlen_offsets=offsets, cu_seqlens=cu)
    for b in range(3):
        lo, hi = cu[b].item(), cu[b + 1].item()
        want = rotary(xp[lo:hi].transpose(0, 1)[None], c, s, interleaved=interleaved,
                      seqlen_offsets=int(offsets[b]))
        torch.testing.assert_close(outp[lo:hi], want[0].transpose(0, 1))


def test_conjugate_inverts_and_backward():
    c, s = make_tables(8, 16)
    x = make_x((2, 2, 8, 16), rg=True)
    y = rotary(x, c, s)
    back = torch.ops.flash.rotary(y, c, s, conjugate=True)
    torch.testing.assert_close(back, x)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad, torch.ops.flash.rotary_backward(g, c, s))
    torch.testing.assert_close(torch.ops.flash.rotary_backward(g, c, s), torch.ops.flash.rotary(g, c, s, conjugate=True))


def test_cos_sin_tables():
    """Same tables as transformers' default rotary embedding."""
    seqlen, dim, base = 50, 32, 500000.0
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.outer(torch.arange(seqlen).float(), inv_freq)
    c, s = rotary_cos_sin(seqlen, dim, base)
    torch.testing.assert_close(c, freqs.cos())
    torch.testing.assert_close(s, freqs.sin())
    cb, _ = rotary_cos_sin(seqlen, dim, base, dtype=torch.bfloat16)
    assert cb.dtype == torch.bfloat16 and cb.shape == (seqlen, dim // 2)


def _bad_cases():
    c, s = make_tables(8, 8)
    x = torch.randn(2, 2, 4, 8)
    xp, cu = make_packed([3, 2], 2, 8)
    return [
        (lambda: rotary(x[..., :6], c, s), "rotary_dim 8 .* exceeds the head dim 6"),
        (lambda: rotary(x, c, s[:, :2]), "cos shape .* differs from sin shape"),
        (lambda: rotary(x, c, s.double()), "cos dtype .* differs from sin dtype"),
        (lambda: rotary(x, c, s, seqlen_offsets=5), "8 positions, fewer than seqlen 4 \\+ seqlen_offset 5"),
        (lambda: rotary(x, c, s, seqlen_offsets=torch.tensor([0, 5])), "8 positions, but a token sits at position 8"),
        (lambda: rotary(x, c, s, seqlen_offsets=torch.tensor([0, -1])), "seqlen_offsets must be >= 0"),
        (lambda: rotary(x, c, s, seqlen_offsets=-1), "seqlen_offset must be >= 0"),
        (lambda: rotary(x, c, s, seqlen_offsets=torch.tensor([0, 1, 2])), "seqlen_offsets has 3 entries"),
        (lambda: rotary(x, c, s, seqlen_offsets=torch.tensor([0.0, 1.0])), "seqlen_offsets has dtype"),
        (lambda: rotary(x.long(), c, s), "x has dtype"),
        (lambda: rotary(x[0], c, s), "x must have 4 dimensions"),
        (lambda: rotary(x, c[None], s[None], seqlen_offsets=1), "take no seqlen_offset"),
        (lambda: rotary(x, c[None, :3], s[None, :3]), "must be \\(B or 1, S, rotary_dim // 2\\)"),
        (lambda: rotary(torch.randn(2, 2, 4, 16)[..., ::2], c, s), "contiguous last dimension"),
        (lambda: rotary(xp, c, s, cu_seqlens=torch.tensor([0, 3, 4], dtype=torch.int32)), "cu_seqlens must start at 0"),
        (lambda: rotary(xp, c, s, cu_seqlens=cu[:, None]), "cu_seqlens must have 1 dimensions"),
        (lambda: rotary(xp, c, s, seqlen_offsets=6, cu_seqlens=cu), "8 positions, but a token sits at position 8"),
        (lambda: rotary(xp, c[None], s[None], cu_seqlens=cu), "need x of shape \\(B, H, S, D\\), not packed"),
        (lambda: rotary(x, c[:, :0], s[:, :0]), "rotary_dim // 2 > 0"),
        # a gradient for the tables would be dropped silently
        (lambda: rotary(x, c.detach().requires_grad_(), s), "cos/sin require grad"),
        (lambda: rotary(x.clone(), c, s.detach().requires_grad_(), inplace=True),
         "^flash.rotary_: cos/sin require grad"),
        (lambda: rotary_cos_sin(8, 7), "rotary_dim must be even"),
        (lambda: rotary_cos_sin(8, 8, base=0.0), "base must be > 0"),
    ]


def _bad_qk_cases():
    c, s = make_tables(8, 8)
    q, k = make_qk(2, 4, 2, 4, 8)
    bshd = make_x((2, 4, 4, 8), flash_layout=True)
    qp, cu = make_packed([3, 2], 2, 8)
    return [
        (lambda: rotary_qk(q, k[:, :, :3], c, s),
         "k shape \\(2, 2, 3, 8\\) must equal q shape \\(2, 4, 4, 8\\) but for the heads"),
        (lambda: rotary_qk(q, torch.randn(2, 2, 4, 12), c, s), "k shape .* must equal q shape .* but for the heads"),
        (lambda: rotary_qk(q, k[:1], c, s), "k shape .* must equal q shape"),
        (lambda: rotary_qk(qp, torch.randn(4, 1, 8), c, s, cu_seqlens=cu),
         "k shape \\(4, 1, 8\\) must equal q shape \\(5, 2, 8\\)"),
        (lambda: rotary_qk(q, k.double(), c, s), "k dtype torch.float64 differs from q dtype torch.float32"),
        (lambda: rotary_qk(q, k[0], c, s), "k must have 4 dimensions"),
        (lambda: rotary_qk(q, torch.randn(2, 2, 4, 16)[..., ::2], c, s), "k must have a contiguous last dimension"),
        (lambda: rotary_qk(q[..., :6], k[..., :6], c, s), "rotary_dim 8 .* exceeds the head dim 6"),
        (lambda: rotary_qk(q, k, c, s, seqlen_offsets=torch.tensor([0, 5])), "a token sits at position 8"),
        (lambda: rotary(torch.randn(2, 1, 4, 8).expand(2, 3, 4, 8), c, s, inplace=True),
         "x has elements that share memory"),
        (lambda: rotary_qk(q, q, c, s, inplace=True), "q and k share memory"),
        # heads 1 and 2 of one (B, S, H, D) buffer would be rotated twice
        (lambda: rotary_qk(bshd[:, :2], bshd[:, 1:3], c, s, inplace=True), "q and k share memory"),
        (lambda: rotary(torch.randn(2, 2, 4, 8, requires_grad=True), c, s, inplace=True),
         "x is a leaf tensor \\(or a view of one\\) that requires grad"),
        (lambda: rotary_qk(q * 1, torch.randn(2, 4, 2, 8, requires_grad=True).transpose(1, 2), c, s,
                           inplace=True), "k is a leaf tensor"),
        (lambda: torch.ops.flash.rotary_qk_backward(q, k.half(), c, s), "grad_k dtype torch.float16 differs"),
        # in place under autograd: refused under the in-place op's name
        (lambda: rotary_qk(q.requires_grad_() * 1, k[:, :, :3], c, s, inplace=True),
         "^flash.rotary_qk_: k shape .* must equal q shape"),
        (lambda: rotary(q.requires_grad_() * 1, c, s, seqlen_offsets=torch.tensor([0, 5]), inplace=True),
         "^flash.rotary_: .*a token sits at position 8"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases()) + len(_bad_qk_cases())))
def test_bad_inputs(case):
    bad, match = (_bad_cases() + _bad_qk_cases())[case]
    with pytest.raises(ValueError, match=match if match[0] == "^" else f"flash.rotary\\w*: .*{match}"):
        bad()


@pytest.mark.parametrize("op", ["rotary", "rotary_backward", "rotary_qk", "rotary_qk_backward"])
def test_tables_that_require_grad(op):
    """Every differentiable op refuses cos/sin that require a gradient while one is recorded
    (their gradient would be dropped), called directly too; without one recording they pass."""
    c, s = make_tables(8, 8)
    xs = [torch.randn(2, h, 4, 8, requires_grad=h == 2) for h in ((2, 1) if "qk" in op else (2,))]
    fn = getattr(torch.ops.flash, op)
    for cos, sin in ((c.detach().requires_grad_(), s), (c, s.detach().requires_grad_())):
        with pytest.raises(ValueError, match=f"^flash.{op}: cos/sin require grad"):
            fn(*xs, cos, sin)
        with pytest.raises(ValueError, match=f"^flash.{op}: cos/sin require grad"):
            fn(*(x.detach() for x in xs), cos=cos, sin=sin)
        with torch.no_grad():
            fn(*xs, cos, sin)


def _unwritable_k(k):
    """k (non-leaf, requires grad) made into tensors that in-place writes refuse: (k, message,
    whether q requires grad): a leaf, views autograd will not write, an inference tensor (with
    and without autograd)."""
    with torch.no_grad():
        no_grad_view = k[:]
    with torch.inference_mode():
        inference = k.detach().clone()
    view = "k is a view autograd cannot write in place"
    return [(k.detach().requires_grad_(), "k is a leaf", False),
            (torch.cat((k, k), -1).chunk(2, -1)[0], view, False),
            (no_grad_view, view, True),
            (inference, "k is an inference tensor", False),
            (inference, "k is an inference tensor", True)]


@pytest.mark.parametrize("case", range(5))
def test_bad_inplace_writes_nothing(case):
    """A refused in-place call leaves both tensors as they were, q too when k is refused."""
    c, s = make_tables(8, 8)
    q, k = make_qk(2, 4, 2, 4, 8, rg=True)
    k, match, q_grad = _unwritable_k(k)[case]
    q = q if q_grad else q.detach()
    q_before = q.detach().clone()
    with pytest.raises(ValueError, match=f"flash.rotary_qk_: {match}"):
        rotary_qk(q, k, c, s, inplace=True)
    assert torch.equal(q, q_before)


def test_empty_batch():
    c, s = make_tables(4, 8)
    x = torch.randn(0, 2, 4, 8, requires_grad=True)
    y = rotary(x, c, s, seqlen_offsets=torch.zeros(0, dtype=torch.int32))
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    q, k = (torch.randn(0, h, 4, 8, requires_grad=True) for h in (2, 1))
    qr, kr = rotary_qk(q, k, c, s)
    assert qr.shape == q.shape and kr.shape == k.shape
    (qr.sum() + kr.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    rotary_qk(q.detach(), k.detach(), c, s, inplace=True)


def test_inputs_untouched():
    c, s = make_tables(10, 8)
    x, offsets = torch.randn(2, 2, 4, 8), torch.tensor([1, 2])
    k = torch.randn(2, 1, 4, 8)
    copies = [t.clone() for t in (x, k, c, s, offsets)]
    rotary(x, c, s, seqlen_offsets=offsets)
    rotary_qk(x, k, c, s, seqlen_offsets=offsets)
    torch.ops.flash.rotary_qk_backward(x, k, c, s, offsets)
    for a, b in zip((x, k, c, s, offsets), copies):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- q and k in one launch, in place

@pytest.fixture(params=["reference", "triton"])
def backend(request, force_backend):
    """Both paths of the ops: the reference, and the Triton kernel (interpreted on CPU, tiny
    shapes); yields the device to put tensors on."""
    force_backend(request.param)
    return "cuda" if request.param == "triton" and torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("interleaved", [False, True])
def test_qk_gradcheck(interleaved):
    c, s = make_tables(9, 4, torch.float64)
    q, k = (torch.randn(2, h, 3, 8, dtype=torch.float64, requires_grad=True) for h in (2, 1))
    offsets = torch.tensor([2, 5])

    def qk(a, b):
        return rotary_qk(a, b, c, s, interleaved=interleaved, seqlen_offsets=offsets)

    def qk_inplace(a, b):  # writes copies; the gradient flows through what was written
        return rotary_qk(a * 1, b * 1, c, s, interleaved=interleaved, seqlen_offsets=1, inplace=True)

    for fn in (qk, qk_inplace):
        assert torch.autograd.gradcheck(fn, (q, k))
        assert torch.autograd.gradgradcheck(fn, (q, k))
    assert torch.autograd.gradcheck(lambda a: rotary(a * 1, c, s, interleaved=interleaved, inplace=True), (q,))
    qp, kp = (torch.randn(6, h, 8, dtype=torch.float64, requires_grad=True) for h in (2, 1))
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda a, b: rotary_qk(a, b, c, s, interleaved=interleaved, cu_seqlens=cu),
                                   (qp, kp))



@pytest.mark.parametrize("qk", [False, True])
def test_gradients_of_any_strides(backend, qk):
    """The backward ops take gradients of any strides, the expanded one of a sum() and a strided
    view: the gradients of their contiguous copies. So does a backward op as its own gradient
    (conjugate flipped: the forward's rotation), in a double backward."""
    c, s = (t.to(backend) for t in make_tables(9, 8))
    xs = [torch.randn(2, h, 5, 12, device=backend, requires_grad=True) for h in ((3, 1) if qk else (3,))]

    def fn(*ts):
        out = rotary_qk(*ts, c, s, seqlen_offsets=2) if qk else rotary(*ts, c, s, seqlen_offsets=2)
        return out if qk else (out,)
    outs = fn(*xs)
    got = torch.autograd.grad(sum(o.sum() for o in outs), xs, retain_graph=True)
    want = torch.autograd.grad(outs, xs, [torch.ones_like(o) for o in outs], retain_graph=True)
    strided = [torch.randn(*o.shape[:-1], 2 * o.shape[-1], device=backend)[..., ::2] for o in outs]
    got += torch.autograd.grad(outs, xs, strided, retain_graph=True)
    want += torch.autograd.grad(outs, xs, [g.contiguous() for g in strided])
    upstream = [torch.randn_like(o, requires_grad=True) for o in outs]
    dxs = torch.autograd.grad(fn(*xs), xs, upstream, create_graph=True)
    got += torch.autograd.grad(sum(d.sum() for d in dxs), upstream)
    want += fn(*(torch.ones_like(x) for x in xs))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_qk_matches_model_code(backend, dtype, interleaved, inplace):
    """GQA q and k in the (B, S, H, D) layout, partial rotary: fp64 model code (and no worse
    than that code in dtype), layouts kept, pass-through dims exact, in place the very
    tensors returned."""
    B, Hq, Hk, S, D, rd, off = 2, 4, 2, 9, 24, 16, 3
    q, k = (t.to(backend) for t in make_qk(B, Hq, Hk, S, D, dtype, flash_layout=True))
    c, s = (t.to(backend) for t in make_tables(S + off, rd))
    qi, ki = (q.clone(), k.clone()) if inplace else (q, k)
    outs = rotary_qk(qi, ki, c, s, interleaved=interleaved, seqlen_offsets=off, inplace=inplace)
    pos = torch.arange(S, device=backend) + off
    for out, x in zip(outs, (q, k)):
        exact = rope_model(x.double(), c.double(), s.double(), pos, interleaved)
        err = assert_rel_close(out, exact, TOL[dtype])
        if not (backend == "cpu" and _dispatch.forced_backend() == "triton"):
            # the Triton interpreter truncates fp32 to bf16 where a GPU rounds to nearest
            assert err <= rel_err(rope_model(x, c.to(dtype), s.to(dtype), pos, interleaved), exact) + 1e-6
        assert out.dtype == dtype and out.stride() == x.stride()
        assert torch.equal(out[..., rd:], x[..., rd:])
    if inplace:
        assert outs[0] is qi and outs[1] is ki
    else:
        assert torch.equal(qi, q) and torch.equal(ki, k)


@pytest.mark.parametrize("interleaved", [False, True])
def test_qk_agrees_with_rotary(backend, interleaved):
    """rotary_qk and rotary_, in every layout rotary takes, give rotary's results exactly."""
    c, s = (t.to(backend) for t in make_tables(20, 8))
    offsets = torch.tensor([0, 4, 11], device=backend)
    q, k = (t.to(backend) for t in make_qk(3, 3, 1, 5, 12, flash_layout=True))
    (qp, cu), (kp, _) = make_packed([5, 0, 3], 2, 8), make_packed([5, 0, 3], 1, 8)
    pos = torch.randint(0, 20, (3, 5), device=backend)
    cases = [((q, k, c, s), {"seqlen_offsets": 2}),
             ((q, k, c, s), {"seqlen_offsets": offsets}),
             ((q, k, c[pos], s[pos]), {}),
             ((qp.to(backend), kp.to(backend), c, s), {"seqlen_offsets": offsets, "cu_seqlens": cu.to(backend)})]
    for (a, b, cos, sin), kw in cases:
        want = [rotary(t, cos, sin, interleaved=interleaved, **kw) for t in (a, b)]
        for got in (rotary_qk(a, b, cos, sin, interleaved=interleaved, **kw),
                    rotary_qk(a.clone(), b.clone(), cos, sin, interleaved=interleaved, inplace=True, **kw),
                    [rotary(t.clone(), cos, sin, interleaved=interleaved, inplace=True, **kw) for t in (a, b)]):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_one_launch(launches, force_backend):
    """rotary_qk: one kernel launch forward and one backward, whatever the head counts; the
    in-place ops one launch too, and one each way under autograd."""
    force_backend("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    qk = "_rotary_qk_kernel"
    c, s = (t.to(dev) for t in make_tables(8, 8))
    q, k = (t.to(dev).requires_grad_() for t in make_qk(2, 4, 1, 5, 12, flash_layout=True))
    qr, kr = rotary_qk(q, k, c, s, seqlen_offsets=1)
    assert launches == [qk]
    gq, gk = torch.randn_like(qr), torch.randn_like(kr)
    torch.autograd.backward((qr, kr), (gq, gk))
    assert launches == [qk, qk]
    want = [torch.ops.flash.rotary_backward(g, c, s, seqlen_offset=1) for g in (gq, gk)]
    torch.testing.assert_close((q.grad, k.grad), tuple(want))
    del launches[:]
    with torch.no_grad():
        rotary_qk(q, k, c, s, inplace=True)
        rotary(q, c, s, inplace=True)
    assert launches == [qk, "_rotary_kernel"]
    q2, k2 = (t.detach().requires_grad_() * 1 for t in (q, k))  # non-leaf: writable under autograd
    rotary_qk(q2, k2, c, s, inplace=True)
    (q2.sum() + k2.sum()).backward()
    assert launches == [qk, "_rotary_kernel", qk, qk]


def test_inplace_rewrites_storage(backend):
    """q and k as views of one fused qkv projection (B, S, (Hq + 2 Hkv) D) are rotated in that
    buffer; v and the pass-through dims keep their values, and autograd sees the write."""
    B, S, Hq, Hk, D, rd = 2, 5, 4, 2, 12, 8
    qkv = torch.randn(B, S, (Hq + 2 * Hk) * D, device=backend)
    before = qkv.clone()

    def views(buf):
        q, k, v = (buf[..., a:b].unflatten(-1, (-1, D)).transpose(1, 2)
                   for a, b in ((0, Hq * D), (Hq * D, (Hq + Hk) * D), ((Hq + Hk) * D, None)))
        return q, k, v

    c, s = (t.to(backend) for t in make_tables(S, rd))
    q, k, v = views(qkv)
    version, ptrs = q._version, (q.data_ptr(), k.data_ptr())
    want = rotary_qk(*views(before)[:2], c, s)
    out = rotary_qk(q, k, c, s, inplace=True)
    assert out[0] is q and out[1] is k and (q.data_ptr(), k.data_ptr()) == ptrs
    assert q._version > version
    for got, w in zip(views(qkv), (*want, views(before)[2])):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
    for got, b in zip(views(qkv)[:2], views(before)[:2]):
        assert torch.equal(got[..., rd:], b[..., rd:])


def _attention_block(w, c, s, inplace):
    """A fused qkv projection rotated in its buffer, or the same written by torch's copy_."""
    qkv = w * 2
    q, k, v = (qkv[..., a:a + 16].unflatten(-1, (-1, 8)).transpose(1, 2) for a in (0, 16, 32))
    if inplace:
        rotary_qk(q, k, c, s, inplace=True)
        rotary(v, c, s, seqlen_offsets=1, inplace=True)
    else:
        for t, r in zip((q, k), rotary_qk(q, k, c, s)):
            t.copy_(r)
        v.copy_(rotary(v, c, s, seqlen_offsets=1))
    return (q * k).sum() + (q * v).sum() + qkv.square().sum()


def test_inplace_autograd(backend):
    """Gradients through in-place rotations of views equal those of the copy_ spelling."""
    c, s = (t.to(backend) for t in make_tables(8, 4))
    w = torch.randn(2, 5, 48, device=backend, requires_grad=True)
    want, = torch.autograd.grad(_attention_block(w, c, s, inplace=False), w)
    got, = torch.autograd.grad(_attention_block(w, c, s, inplace=True), w)
    torch.testing.assert_close(got, want)
    x = torch.randn(1, 2, 5, 8, device=backend, requires_grad=True)
    with torch.no_grad():  # a leaf may be written without autograd, as with any in-place op
        rotary(x, c, s, inplace=True)
    assert x.grad_fn is None


def test_inplace_compiles():
    """Under torch.compile (functionalization, then Inductor) the inputs are written as
    eagerly, and a training graph gives eager's gradients. The reference path: under
    TRITON_INTERPRET=1 compile cannot trace into the Triton kernel."""
    c, s = make_tables(8, 4)

    def infer(q, k, offsets):
        rotary_qk(q, k, c, s, seqlen_offsets=offsets, inplace=True)
        return rotary(q, c, s, inplace=True)

    q, k = make_qk(2, 4, 2, 5, 8, flash_layout=True)
    offsets = torch.tensor([1, 3])
    qe, ke = q.clone(), k.clone()
    infer(qe, ke, offsets)
    out = torch.compile(infer, fullgraph=True)(q, k, offsets)
    torch.testing.assert_close((q, k), (qe, ke), rtol=0, atol=0)
    assert out.data_ptr() == q.data_ptr()
    w = torch.randn(2, 5, 48, requires_grad=True)
    want, = torch.autograd.grad(_attention_block(w, c, s, inplace=False), w)
    compiled = torch.compile(_attention_block, backend="aot_eager", fullgraph=True)
    got, = torch.autograd.grad(compiled(w, c, s, inplace=True), w)
    torch.testing.assert_close(got, want)


@pytest.mark.cuda
def test_cuda_compiled_triton_path():
    """torch.compile traces into the Triton kernel (functionalization copies back each argument
    it writes): eager's results for rotary, rotary_qk and their in-place forms on views of one
    qkv buffer, and eager's gradients."""
    c, s = (t.cuda() for t in make_tables(64, 32))

    def infer(qkv, offsets):
        q, k, v = (qkv[..., a:a + 128].unflatten(-1, (-1, 64)).transpose(1, 2) for a in (0, 128, 256))
        rotary_qk(q, k, c, s, seqlen_offsets=offsets, inplace=True)
        return rotary(v, c, s), rotary_qk(v, k, c, s)

    qkv = torch.randn(2, 16, 384, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor([0, 9], device="cuda")
    eager_qkv = qkv.clone()
    want = infer(eager_qkv, offsets)
    got = torch.compile(infer, fullgraph=True)(qkv, offsets)
    torch.testing.assert_close(qkv, eager_qkv, rtol=0, atol=0)
    torch.testing.assert_close(got, want)
    w = torch.randn(2, 5, 48, device="cuda", requires_grad=True)
    c8, s8 = (t[:, :2] for t in (c, s))
    want, = torch.autograd.grad(_attention_block(w, c8, s8, inplace=False), w)
    got, = torch.autograd.grad(torch.compile(_attention_block, fullgraph=True)(w, c8, s8, inplace=True), w)
    torch.testing.assert_close(got, want)


@pytest.mark.cuda
def test_cuda_index_tensors_no_host_sync():
    """Offsets and cu_seqlens on the GPU are not read on the host (as attention_varlen's): eager
    calls never synchronise, and an offset past the table rotates its tokens to NaN instead of
    raising (the same call on CPU tensors raises)."""
    c, s = (t.cuda() for t in make_tables(16, 32))
    x = torch.randn(2, 4, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    packed = torch.randn(12, 4, 64, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor([0, 12], device="cuda")
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device="cuda")
    for _ in range(2):  # the first call compiles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = rotary(x, c, s, seqlen_offsets=offsets)
            out.backward(torch.ones_like(out))
            rotary(packed, c, s, cu_seqlens=cu)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # rotary dims 32 of 64: positions 16-19 of the second sequence miss the 16-row table
    assert not out[0].isnan().any() and not out[1, :, :4].isnan().any() and out[1, :, 4:, :32].isnan().all()
    assert torch.equal(out[1, :, :, 32:], x[1, :, :, 32:])
    with pytest.raises(ValueError, match="a token sits at position 19"):
        rotary(x.detach().cpu(), c.cpu(), s.cpu(), seqlen_offsets=offsets.cpu())
