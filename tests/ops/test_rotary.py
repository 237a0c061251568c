"""flash.rotary: opcheck, gradcheck, numerics against the model code, varlen, bad inputs."""
import pytest
import torch

import torch_flash  # noqa: F401  (registers the ops)
from torch_flash.ops.rotary import rotary, rotary_cos_sin
from _utils import TOL, assert_rel_close, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rotate_half(x):  # transformers' rotate_half
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


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


def _x(shape, dtype=torch.float32, rg=False, flash_layout=False):
    """(B, H, S, D); flash_layout gives the .transpose(1, 2) view of a (B, S, H, D) tensor."""
    if flash_layout:
        B, H, S, D = shape
        x = torch.randn(B, S, H, D, dtype=dtype).transpose(1, 2)
    else:
        x = torch.randn(shape, dtype=dtype)
    return x.requires_grad_(rg)


def _tables(n, rd, dtype=torch.float32):
    return rotary_cos_sin(n, rd, dtype=dtype)


def _packed(lengths, H, D, dtype=torch.float32, rg=False):
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return torch.randn(sum(lengths), H, D, dtype=dtype).requires_grad_(rg), cu


def _samples_rotary():
    for dtype in DTYPES:
        for interleaved in (False, True):
            for rg in (False, True):
                rd = 16 if interleaved == rg else 8  # full and partial rotary
                c, s = _tables(12, rd, dtype if rg else torch.float32)
                yield ((_x((2, 3, 5, 16), dtype, rg, flash_layout=rg), c, s),
                       {"interleaved": interleaved, "seqlen_offset": 3 * rg})
    c, s = _tables(12, 8)
    yield (_x((2, 2, 4, 8), rg=True), c, s, torch.tensor([0, 7])), {}
    x, cu = _packed([3, 0, 5], 2, 8, rg=True)
    yield (x, c, s, torch.tensor([1, 2, 4], dtype=torch.int32), cu), {"interleaved": True}
    yield (x, c, s, None, cu), {"seqlen_offset": 2}
    pos = torch.randint(0, 12, (2, 4))
    yield (_x((2, 3, 4, 8), rg=True), c[pos], s[pos]), {}
    yield (_x((2, 3, 4, 12), torch.bfloat16), c[None, :4].expand(2, 4, 4), s[None, :4].expand(2, 4, 4)), {}


def _samples_rotary_bwd():
    for dtype in DTYPES:
        c, s = _tables(10, 8)
        yield (_x((2, 2, 4, 12), dtype, flash_layout=True), c, s), {"seqlen_offset": 1, "conjugate": True}
    x, cu = _packed([2, 4], 2, 8)
    yield (x, c, s, torch.tensor([3, 0]), cu), {"interleaved": True}
    yield (_x((1, 2, 3, 8), rg=True), c, s), {}


OPCHECK_SAMPLES = {"rotary": _samples_rotary, "rotary_backward": _samples_rotary_bwd}




@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rd", [8, 4])
def test_gradcheck(interleaved, rd):
    c, s = _tables(9, rd, torch.float64)
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
    c, s = _tables(S + off, rd)
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
    c, s = _tables(20, 8)
    x = _x((3, 2, 5, 8), flash_layout=True)
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
    xp, cu = _packed([5, 0, 3], 2, 12)
    outp = rotary(xp, c, s, interleaved=interleaved, seqlen_offsets=offsets, cu_seqlens=cu)
    for b in range(3):
        lo, hi = cu[b].item(), cu[b + 1].item()
        want = rotary(xp[lo:hi].transpose(0, 1)[None], c, s, interleaved=interleaved,
                      seqlen_offsets=int(offsets[b]))
        torch.testing.assert_close(outp[lo:hi], want[0].transpose(0, 1))


def test_conjugate_inverts_and_backward():
    c, s = _tables(8, 16)
    x = _x((2, 2, 8, 16), rg=True)
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
    c, s = _tables(8, 8)
    x = torch.randn(2, 2, 4, 8)
    xp, cu = _packed([3, 2], 2, 8)
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
        (lambda: rotary_cos_sin(8, 7), "rotary_dim must be even"),
        (lambda: rotary_cos_sin(8, 8, base=0.0), "base must be > 0"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs(case):
    bad, match = _bad_cases()[case]
    with pytest.raises(ValueError, match=f"flash.rotary(_cos_sin)?: .*{match}"):
        bad()


def test_empty_batch():
    c, s = _tables(4, 8)
    x = torch.randn(0, 2, 4, 8, requires_grad=True)
    y = rotary(x, c, s, seqlen_offsets=torch.zeros(0, dtype=torch.int32))
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_inputs_untouched():
    c, s = _tables(10, 8)
    x, offsets = torch.randn(2, 2, 4, 8), torch.tensor([1, 2])
    copies = [t.clone() for t in (x, c, s, offsets)]
    rotary(x, c, s, seqlen_offsets=offsets)
    for a, b in zip((x, c, s, offsets), copies):
        assert torch.equal(a, b)
