"""Triton rotary launcher (torch_flash/kernels/triton/rotary.py) against an fp64 formula.

On CPU the kernel runs under TRITON_INTERPRET=1 at tiny shapes; `cuda` tests take real sizes.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from _utils import TOL, assert_rel_close  # noqa: E402

from torch_flash.kernels.triton import rotary as K  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rotate64(x, cos, sin, interleaved, conjugate=False):
    """x (..., D) rotated by angles whose cos/sin (..., rd/2) broadcast against x[..., :rd/2]:
    GPT-NeoX halves or GPT-J pairs; dims past rd unchanged. fp64."""
    x, c, s = x.double(), cos.double(), sin.double()
    if conjugate:
        s = -s
    rd = 2 * cos.shape[-1]
    if interleaved:
        x1, x2 = x[..., 0:rd:2], x[..., 1:rd:2]
        rot = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)
    else:
        x1, x2 = x[..., : rd // 2], x[..., rd // 2: rd]
        rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)
    return torch.cat([rot, x[..., rd:]], -1)


def _tables(n, rd, dtype=torch.float32):
    """cos/sin (n, rd/2) of real rotary angles, as a model builds them."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq
    return angles.cos().to(DEV, dtype), angles.sin().to(DEV, dtype)


def _dense_expected(x, cos, sin, pos, interleaved, conjugate=False):
    """x (B, H, S, D), pos (B, S) positions into the tables."""
    return _rotate64(x, cos[pos][:, None], sin[pos][:, None], interleaved, conjugate)


def _apply(x, cos, sin, interleaved=False, seqlen_offset=0, seqlen_offsets=None, cu_seqlens=None,
           conjugate=False, out=None):
    return K.rotary_apply(x, cos, sin, interleaved=interleaved, seqlen_offset=seqlen_offset,
                          seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens, conjugate=conjugate, out=out)


def _bshd(b, h, s, d, dtype):
    """(B, H, S, D) view of a (B, S, H, D) tensor: FlashAttention's layout, no copy."""
    return torch.randn(b, s, h, d, device=DEV).to(dtype).transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rd", [24, 16], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_dense(interleaved, rd, dtype):
    x = _bshd(2, 3, 9, 24, dtype)
    cos, sin = _tables(12, rd)
    before = x.clone()
    out = _apply(x, cos, sin, interleaved)
    assert out.dtype == dtype and out.shape == x.shape
    pos = torch.arange(9, device=DEV).expand(2, 9)
    assert_rel_close(out, _dense_expected(x, cos, sin, pos, interleaved), TOL[dtype])
    assert torch.equal(x, before)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_offsets(interleaved):
    """An int offset, per-batch tensor offsets, and both together (int32 and int64)."""
    x = _bshd(3, 2, 5, 16, torch.float32)
    cos, sin = _tables(20, 12)
    for off, offs in ((4, None), (0, torch.tensor([0, 7, 3], device=DEV, dtype=torch.int32)),
                      (2, torch.tensor([5, 0, 9], device=DEV))):
        out = _apply(x, cos, sin, interleaved, seqlen_offset=off, seqlen_offsets=offs)
        pos = torch.arange(5, device=DEV)[None] + off + (0 if offs is None else offs.long()[:, None])
        assert_rel_close(out, _dense_expected(x, cos, sin, pos.expand(3, 5), interleaved), TOL[torch.float32])


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_per_token_tables(interleaved):
    """cos/sin (B, S, rd/2) or (1, S, rd/2), already gathered per token (bf16 tables)."""
    x = _bshd(2, 3, 6, 16, torch.bfloat16)
    cos, sin = _tables(40, 16, torch.bfloat16)
    idx = torch.randint(0, 40, (2, 6), device=DEV)
    ct, st = cos[idx], sin[idx]
    out = _apply(x, ct, st, interleaved)
    assert_rel_close(out, _rotate64(x, ct[:, None], st[:, None], interleaved), TOL[torch.bfloat16])
    shared = _apply(x, ct[:1], st[:1], interleaved)  # one set for the whole batch, as HF passes it
    assert_rel_close(shared, _rotate64(x, ct[:1, None], st[:1, None], interleaved), TOL[torch.bfloat16])


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_varlen(interleaved):
    """Packed (total, H, D) with an empty sequence, per-sequence offsets, partial rotary,
    conjugate; every token is written (out poisoned first)."""
    cu = torch.tensor([0, 4, 4, 11, 13], device=DEV, dtype=torch.int32)
    x = torch.randn(13, 3, 20, device=DEV, dtype=torch.float16)
    cos, sin = _tables(32, 12)
    offs = torch.tensor([1, 2, 0, 5], device=DEV)
    out = torch.full_like(x, float("nan"))
    _apply(x, cos, sin, interleaved, seqlen_offset=3, seqlen_offsets=offs, cu_seqlens=cu, conjugate=True,
           out=out)
    expected = torch.empty_like(x, dtype=torch.float64)
    for b in range(4):
        lo, hi = int(cu[b]), int(cu[b + 1])
        pos = torch.arange(hi - lo, device=DEV) + 3 + int(offs[b])
        expected[lo:hi] = _rotate64(x[lo:hi], cos[pos][:, None], sin[pos][:, None], interleaved, True)
    assert_rel_close(out, expected, TOL[torch.float16])


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_in_place_and_out(interleaved):
    """out=x rotates in place (pass-through dims untouched); a separate out, poisoned, gets
    the pass-through dims copied."""
    x = _bshd(2, 2, 7, 20, torch.bfloat16)
    cos, sin = _tables(7, 12)
    expected = _dense_expected(x, cos, sin, torch.arange(7, device=DEV).expand(2, 7), interleaved)
    out = torch.full_like(x, float("nan"))
    assert _apply(x, cos, sin, interleaved, out=out) is out
    assert_rel_close(out, expected, TOL[torch.bfloat16])
    y = x.clone()
    assert _apply(y, cos, sin, interleaved, out=y) is y
    assert torch.equal(y, out) and torch.equal(y[..., 12:], x[..., 12:])


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_conjugate_inverts(interleaved):
    x = _bshd(1, 4, 6, 32, torch.float32)
    cos, sin = _tables(6, 32)
    back = _apply(_apply(x, cos, sin, interleaved), cos, sin, interleaved, conjugate=True)
    assert_rel_close(back, x, TOL[torch.float32])


def test_positions_outside_table_are_nan():
    """A tensor offset past the table, or cu_seqlens that do not start at 0 (refused by the op's
    checks of CPU tensors; GPU ones are not read on the host), never read out of bounds nor pass
    silently: those tokens rotate to NaN, the others are right. Tokens past the last sequence are
    copied (padding)."""
    x = _bshd(2, 2, 4, 8, torch.float32)
    cos, sin = _tables(6, 8)
    out = _apply(x, cos, sin, seqlen_offsets=torch.tensor([0, 4], device=DEV))
    pos = torch.arange(4, device=DEV).expand(2, 4)
    assert_rel_close(out[0], _dense_expected(x, cos, sin, pos, False)[0], TOL[torch.float32])
    shifted = _dense_expected(x, cos, sin, (pos + 4).clamp(max=5), False)
    assert_rel_close(out[1, :, :2], shifted[1, :, :2], TOL[torch.float32])
    assert out[1, :, 2:].isnan().all()
    packed = torch.randn(7, 2, 8, device=DEV)
    cu = torch.tensor([1, 4, 6], dtype=torch.int32, device=DEV)  # token 0 before the first sequence
    out = _apply(packed, cos, sin, cu_seqlens=cu)
    assert out[0].isnan().all() and torch.equal(out[6], packed[6])
    want = torch.cat([_rotate64(packed[a:b], cos[:b - a, None], sin[:b - a, None], False) for a, b in ((1, 4), (4, 6))])
    assert_rel_close(out[1:6], want, TOL[torch.float32])


def _apply_qk(q, k, cos, sin, interleaved=False, seqlen_offset=0, seqlen_offsets=None, cu_seqlens=None,
              conjugate=False, q_out=None, k_out=None):
    return K.rotary_apply_qk(q, k, cos, sin, interleaved=interleaved, seqlen_offset=seqlen_offset,
                             seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens, conjugate=conjugate,
                             q_out=q_out, k_out=k_out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 1), (2, 3), (3, 3)], ids=["mqa", "k_more", "mha"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_qk_dense(interleaved, heads, dtype, launches):
    """q and k of their own head counts (more k heads than BLOCK_H=2 q heads too), tensor
    offsets, partial rotary: one launch, every element written (outputs poisoned)."""
    hq, hk = heads
    q, k = _bshd(2, hq, 5, 20, dtype), _bshd(2, hk, 5, 20, dtype)
    cos, sin = _tables(16, 12)
    offs = torch.tensor([3, 9], device=DEV)
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    before = q.clone(), k.clone()
    assert _apply_qk(q, k, cos, sin, interleaved, seqlen_offsets=offs, q_out=q_out, k_out=k_out) == (q_out, k_out)
    assert launches == ["_rotary_qk_kernel"]
    pos = torch.arange(5, device=DEV)[None] + offs[:, None]
    for out, x in zip((q_out, k_out), (q, k)):
        assert_rel_close(out, _dense_expected(x, cos, sin, pos, interleaved), TOL[dtype])
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_qk_varlen_per_token_conjugate(interleaved, launches):
    """Packed q/k with an empty sequence; per-token tables (one set for the batch); conjugate."""
    cu = torch.tensor([0, 3, 3, 7], device=DEV, dtype=torch.int32)
    q, k = (torch.randn(7, h, 16, device=DEV, dtype=torch.bfloat16) for h in (4, 1))
    cos, sin = _tables(16, 16)
    offs = torch.tensor([2, 0, 5], device=DEV)
    q_out, k_out = _apply_qk(q, k, cos, sin, interleaved, seqlen_offset=1, seqlen_offsets=offs, cu_seqlens=cu,
                             conjugate=True)
    for out, x in zip((q_out, k_out), (q, k)):
        expected = torch.empty_like(x, dtype=torch.float64)
        for b in range(3):
            lo, hi = int(cu[b]), int(cu[b + 1])
            pos = torch.arange(hi - lo, device=DEV) + 1 + int(offs[b])
            expected[lo:hi] = _rotate64(x[lo:hi], cos[pos][:, None], sin[pos][:, None], interleaved, True)
        assert_rel_close(out, expected, TOL[torch.bfloat16])
    qd, kd = _bshd(2, 2, 6, 16, torch.float16), _bshd(2, 1, 6, 16, torch.float16)
    ct, st = (t[None, 3:9] for t in _tables(16, 16))
    for out, x in zip(_apply_qk(qd, kd, ct, st, interleaved), (qd, kd)):
        assert_rel_close(out, _rotate64(x, ct[:, None], st[:, None], interleaved), TOL[torch.float16])
    assert launches == ["_rotary_qk_kernel"] * 2


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_qk_in_place(interleaved, launches):
    """q and k as views of one fused qkv buffer, rotated in it in one launch: pass-through dims,
    v and the padding between never written."""
    B, S, hq, hk, D, rd = 2, 7, 4, 2, 20, 12
    qkv = torch.randn(B, S, (hq + 2 * hk) * D + 3, device=DEV, dtype=torch.bfloat16)  # + padding
    before = qkv.clone()
    spans = ((0, hq * D), (hq * D, (hq + hk) * D))
    q, k = (qkv[..., a:b].unflatten(-1, (-1, D)).transpose(1, 2) for a, b in spans)
    qb, kb = (before[..., a:b].unflatten(-1, (-1, D)).transpose(1, 2) for a, b in spans)
    cos, sin = _tables(S, rd)
    out = _apply_qk(q, k, cos, sin, interleaved, q_out=q, k_out=k)
    assert out[0] is q and out[1] is k and launches == ["_rotary_qk_kernel"]
    pos = torch.arange(S, device=DEV).expand(B, S)
    for x, xb in ((q, qb), (k, kb)):
        assert_rel_close(x, _dense_expected(xb, cos, sin, pos, interleaved), TOL[torch.bfloat16])
        assert torch.equal(x[..., rd:], xb[..., rd:])
    assert torch.equal(qkv[..., (hq + hk) * D:], before[..., (hq + hk) * D:])
    with pytest.raises(ValueError, match="both in place or both out of place"):
        _apply_qk(q, k, cos, sin, q_out=q)


def test_qk_empty(launches):
    q, k = torch.randn(0, 2, 4, 8, device=DEV), torch.randn(0, 1, 4, 8, device=DEV)
    q_out, k_out = _apply_qk(q, k, *_tables(4, 8))
    assert q_out.shape == q.shape and k_out.shape == k.shape and not launches


def test_supports():
    x = torch.randn(2, 3, 4, 16, device=DEV)
    cos, sin = _tables(4, 16)
    assert K.rotary_supports(x, cos, sin) and K.rotary_supports(x[0], cos, sin)
    assert not K.rotary_supports(x.double(), cos, sin)
    assert not K.rotary_supports(x[..., :8], *_tables(4, 16))  # rotary dim > head dim
    assert not K.rotary_supports(x.transpose(-1, -2), cos, sin)  # last dim not contiguous
    per_token = torch.randn(3, 4, 8, device=DEV)
    assert not K.rotary_supports(x, per_token, per_token)  # 3 sets of tables for a batch of 2


@pytest.mark.cuda
def test_cuda_qk_gqa_shape(launches):
    """LLaMA-3-8B-like q (32 heads) and k (8 heads) of 128, (B, S, H, D) views, one launch each way."""
    q, k = _bshd(2, 32, 4096, 128, torch.bfloat16), _bshd(2, 8, 4096, 128, torch.bfloat16)
    cos, sin = _tables(4096, 128)
    pos = torch.arange(4096, device="cuda").expand(2, 4096)
    q_out, k_out = _apply_qk(q, k, cos, sin)
    for out, x in ((q_out, q), (k_out, k)):
        assert_rel_close(out, _dense_expected(x, cos, sin, pos, False), TOL[torch.bfloat16])
    back = _apply_qk(q_out, k_out, cos, sin, conjugate=True, q_out=q_out, k_out=k_out)
    for out, x in zip(back, (q, k)):
        assert_rel_close(out, x, TOL[torch.bfloat16])
    assert launches == ["_rotary_qk_kernel"] * 2


@pytest.mark.cuda
def test_cuda_batch_past_grid_axis_limit(launches):
    """More sequences than a second CUDA grid axis holds (65535), one token each (decode
    steps of a large batch), q and k in one launch."""
    q, k = _bshd(70000, 2, 1, 16, torch.bfloat16), _bshd(70000, 1, 1, 16, torch.bfloat16)
    cos, sin = _tables(64, 16)
    offs = torch.randint(0, 63, (70000,), device="cuda")
    for out, x in zip(_apply_qk(q, k, cos, sin, seqlen_offsets=offs), (q, k)):
        assert_rel_close(out, _dense_expected(x, cos, sin, offs[:, None], False), TOL[torch.bfloat16])
    assert launches == ["_rotary_qk_kernel"]


@pytest.mark.cuda
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_cuda_llama_shape(interleaved):
    """LLaMA-7B-like q: (B, H, S, D) = (2, 32, 4096, 128) bf16, the (B, S, H, D) view, in place."""
    q = torch.randn(2, 4096, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    cos, sin = _tables(8192, 128)
    offs = torch.tensor([0, 100], device="cuda")
    pos = torch.arange(4096, device="cuda")[None] + offs[:, None]
    expected = _dense_expected(q, cos, sin, pos, interleaved)
    out = _apply(q, cos, sin, interleaved, seqlen_offsets=offs, out=q)
    assert out is q
    assert_rel_close(q, expected, TOL[torch.bfloat16])
