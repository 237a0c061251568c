"""Triton RMSNorm/LayerNorm launchers (torch_flash/kernels/triton/norm.py, norm_backward.py)
against fp64 formulas.

On CPU the kernels run under TRITON_INTERPRET=1 at tiny shapes; `cuda` tests take real sizes.
The interpreter truncates fp32 -> bf16 where a GPU rounds to nearest, so bf16 results are
compared by relative error (within the bf16 tolerance), never bitwise.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from _utils import TOL, assert_rel_close, rel_err  # noqa: E402

import triton  # noqa: E402

from torch_flash.kernels.triton import norm as K  # noqa: E402
from torch_flash.kernels.triton import norm_backward as KB  # noqa: E402
from torch_flash.reference import rms_norm as rms_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _tol(*dtypes):
    return max(TOL[d] for d in dtypes if d is not None)


def _norm64(x, weight, bias, eps, is_rms, weight_offset, cast_before_weight, round_dtype):
    """The forward in fp64 with the launchers' dtype rules; round_dtype None skips the rounding
    of xhat (autograd through the exact formula)."""
    x = x.double()
    xc = x if is_rms else x - x.mean(-1, keepdim=True)
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        if cast_before_weight:
            y = (y if round_dtype is None else y.to(round_dtype).double()) * (weight + weight_offset).double()
        else:
            y = y * (weight.double() + weight_offset)
    if bias is not None:
        y = y + bias.double()
    return y


# (is_rms, residual dtype or None, residual_in_fp32, weight dtype or None, has_bias,
#  cast_before_weight, weight_offset, x dtype): every flag on and off at least once
CASES = [
    (True, None, False, BF16, False, True, 0.0, BF16),  # HF LLaMA
    (True, None, False, FP16, False, False, 1.0, FP16),  # Gemma
    (True, None, False, None, False, True, 0.0, FP32),
    (True, BF16, False, BF16, False, True, 0.0, BF16),
    (True, FP32, True, FP32, False, True, 0.5, BF16),  # mixed dtypes: y in fp32
    (False, None, False, FP32, True, False, 0.0, FP32),
    (False, BF16, True, BF16, True, False, 0.5, BF16),
    (False, FP16, False, None, False, False, 0.0, FP16),
    (False, None, False, None, True, False, 0.0, BF16),
    # under autocast: the fp32 residual stream as x, a bf16 branch as residual
    (True, BF16, False, FP32, False, True, 0.0, FP32),
    (False, BF16, False, FP32, True, False, 0.0, FP32),
]
CASE_IDS = ["llama", "gemma", "rms-noweight", "add-rms", "add-rms-fp32res-mixed", "ln", "add-ln-fp32res",
            "add-ln-noaffine", "ln-biasonly", "add-rms-autocast", "add-ln-autocast"]


def _inputs(case, shape, device=DEV):
    is_rms, rdt, rif32, wdt, has_b, cbw, off, dt = case
    n = shape[-1]
    x = (torch.randn(shape, device=device) * 2 + 0.5).to(dt)
    r = None if rdt is None else torch.randn(shape, device=device, dtype=rdt)
    w = None if wdt is None else torch.randn(n, device=device, dtype=wdt)
    b = torch.randn(n, device=device, dtype=wdt or dt) if has_b else None
    kw = dict(eps=1e-5, is_rms=is_rms, weight_offset=off, cast_before_weight=cbw)
    return x, r, w, b, rif32, kw


def _check_forward(case, x, r, w, b, rif32, kw, block_n=None):
    y, ro = K.norm_fwd(x, w, b, r, residual_in_fp32=rif32, block_n=block_n, **kw)
    y_dtype = torch.promote_types(x.dtype, w.dtype) if w is not None and kw["cast_before_weight"] else x.dtype
    assert y.dtype == y_dtype and y.shape == x.shape and y.stride() == torch.empty_like(x).stride()
    src = x
    if r is not None:
        assert ro.dtype == (FP32 if rif32 else x.dtype) and ro.shape == x.shape
        exact_ro = (x.double() + r.double()).to(ro.dtype)
        assert_rel_close(ro, exact_ro, _tol(ro.dtype), what="residual_out")
        src = exact_ro
    else:
        assert ro is None
    exact = _norm64(src, w, b, round_dtype=x.dtype, **kw)
    assert_rel_close(y, exact, _tol(y.dtype, x.dtype), what="y")
    if kw["is_rms"]:  # and the package's own reference, in the same dtypes
        rk = {k: kw[k] for k in ("eps", "weight_offset", "cast_before_weight")}
        theirs = (rms_ref.rms_norm(x, w, **rk) if r is None
                  else rms_ref.add_rms_norm(x, r, w, residual_in_fp32=rif32, **rk)[0])
        assert theirs.dtype == y.dtype
        assert_rel_close(y, theirs, _tol(y.dtype, x.dtype), what="y vs reference")
    return y, ro


@pytest.mark.parametrize("block_n", [None, 32], ids=["one-block", "column-blocks"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_forward(case, block_n):
    _check_forward(case, *_inputs(case, (3, 5, 100)), block_n=block_n)


def _grads64(gy, gro, src, w, b, kw, round_dtype):
    """(dx, dw, db) in fp64: autograd through the exact formula; dw with cast_before_weight
    uses xhat rounded as the forward used it."""
    x64 = src.double().requires_grad_()
    w64 = None if w is None else w.double().requires_grad_()
    b64 = None if b is None else b.double().requires_grad_()
    y = _norm64(x64, w64, b64, round_dtype=None, **kw)
    y.backward(gy.double())
    dx = x64.grad + (0 if gro is None else gro.double())
    dw = None if w is None else w64.grad
    if w is not None and kw["cast_before_weight"]:
        xhat = _norm64(src, None, None, round_dtype=None, **kw)
        dw = (gy.double() * xhat.to(round_dtype).double()).reshape(-1, src.shape[-1]).sum(0)
    return dx, dw, None if b is None else b64.grad


@pytest.mark.parametrize("block_n", [None, 32], ids=["one-block", "column-blocks"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_backward(case, block_n, monkeypatch):
    _check_backward(case, block_n, monkeypatch)


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 4, 6, 8)], ids=[CASE_IDS[i] for i in (0, 4, 6, 8)])
def test_backward_tile_sums(case, monkeypatch):
    """BWD_ROW_ACC off (scripts/sweep_norm.py times both): dW/dB summed over each tile's rows."""
    monkeypatch.setattr(KB, "BWD_ROW_ACC", False)
    _check_backward(case, None, monkeypatch)


def _check_backward(case, block_n, monkeypatch):
    monkeypatch.setattr(K, "TILE", 2 * (block_n or 128))  # two-row tiles: several per program
    x, r, w, b, rif32, kw = _inputs(case, (3, 5, 100))
    y_dtype = torch.promote_types(x.dtype, w.dtype) if w is not None and kw["cast_before_weight"] else x.dtype
    gy = torch.randn(x.shape, device=DEV, dtype=y_dtype)
    src, gro = x, None
    if r is not None:  # the add variant differentiates residual_out and adds its own gradient
        src = (x.float() + r.float()).to(FP32 if rif32 else x.dtype)
        gro = torch.randn_like(src)
    dx, dw, db = KB.norm_bwd(gy, gro, src, w, b, out_dtype=x.dtype, block_n=block_n, **kw)
    edx, edw, edb = _grads64(gy, gro, src, w, b, kw, x.dtype)
    assert dx.dtype == src.dtype and dx.stride() == torch.empty_like(src).stride()
    assert_rel_close(dx, edx, _tol(dx.dtype), what="dx")
    for got, exp, p, name in ((dw, edw, w, "dweight"), (db, edb, b, "dbias")):
        if p is None:
            assert got is None
        else:
            assert got.dtype == p.dtype
            assert_rel_close(got, exp, _tol(p.dtype, x.dtype), what=name)


@pytest.mark.parametrize("n,block_n", [(1, None), (64, None), (64, 16), (96, 32), (200, 64)])
def test_hidden_sizes(n, block_n, monkeypatch):
    """N = 1, an exact block, and rows of several blocks with a partial last one; tiles of two
    rows, so that each backward program runs several row tiles (a partial one included)."""
    monkeypatch.setattr(K, "TILE", 2 * (block_n or triton.next_power_of_2(n)))
    case = CASES[6]  # add + LayerNorm + weight and bias: every load and store in use
    x, r, w, b, rif32, kw = _inputs(case, (7, n))
    _check_forward(case, x, r, w, b, rif32, kw, block_n)
    gy = torch.randn_like(x)
    dx, dw, db = KB.norm_bwd(gy, None, x, w, b, out_dtype=x.dtype, block_n=block_n, **kw)
    edx, edw, edb = _grads64(gy, None, x, w, b, kw, x.dtype)
    if n > 1:  # a one-element LayerNorm has dx = 0 exactly
        assert_rel_close(dx, edx, _tol(dx.dtype), what="dx")
    assert_rel_close(dw, edw, _tol(BF16), what="dweight")
    assert_rel_close(db, edb, _tol(BF16), what="dbias")


@pytest.mark.parametrize("block_n", [None, 64], ids=["one-block", "column-blocks"])
def test_cast_before_weight_rounds_xhat(block_n):
    """fp16 x, fp32 weight: y (fp32) and dweight use xhat rounded to fp16 (fp16 rounding is
    exact under the interpreter too, so the rounded formula must fit much better)."""
    x, w = torch.randn(16, 256, device=DEV, dtype=FP16), torch.randn(256, device=DEV)
    kw = dict(eps=1e-5, is_rms=True, weight_offset=0.0, cast_before_weight=True)
    y, _ = K.norm_fwd(x, w, None, None, residual_in_fp32=False, block_n=block_n, **kw)
    gy = torch.randn_like(y)
    _, dw, _ = KB.norm_bwd(gy, None, x, w, None, out_dtype=FP16, block_n=block_n, **kw)
    unrounded = _norm64(x, None, None, round_dtype=None, **kw)
    rounded = unrounded.to(FP16).double()
    assert y.dtype == FP32
    assert rel_err(y, rounded * w.double()) < 0.3 * rel_err(y, unrounded * w.double())
    assert rel_err(dw, (gy * rounded).sum(0)) < 0.3 * rel_err(dw, (gy * unrounded).sum(0))


@pytest.mark.parametrize("n,is_rms,dtype", [(12000, True, FP32), (12000, False, FP32), (12000, True, BF16)],
                         ids=["rms-12000", "ln-12000", "rms-12000-bf16"])
def test_large_hidden(n, is_rms, dtype):
    """Rows wider than the backward's whole-row block, default blocks: its column chunks (six,
    padded to eight row-sum slots), with and without a bias; 16-bit RMSNorm's rows of up to
    BWD_RMS_MAX_BLOCK columns in one pass instead, without prefetch."""
    x, w = torch.randn(2, n, device=DEV, dtype=dtype), torch.randn(n, device=DEV, dtype=dtype)
    b = None if is_rms else torch.randn(n, device=DEV)
    kw = dict(eps=1e-6, is_rms=is_rms, weight_offset=0.0, cast_before_weight=is_rms)
    y, _ = K.norm_fwd(x, w, b, None, residual_in_fp32=False, **kw)
    assert_rel_close(y, _norm64(x, w, b, round_dtype=dtype, **kw), TOL[dtype])
    gy = torch.randn_like(x)
    one_pass = dtype == BF16
    consts = KB.NormBwd(gy, None, x, w, b, out_dtype=dtype, **kw).consts
    assert (consts["BLOCK_N"], consts["PREFETCH"]) == ((16384, False) if one_pass else (KB.BWD_CHUNK, True))
    dx, dw, db = KB.norm_bwd(gy, None, x, w, b, out_dtype=dtype, **kw)
    edx, edw, edb = _grads64(gy, None, x, w, b, kw, dtype)
    assert_rel_close(dx, edx, TOL[dtype], what="dx")
    assert_rel_close(dw, edw, TOL[dtype], what="dweight")
    if b is not None:
        assert_rel_close(db, edb, TOL[FP32], what="dbias")


LAYOUTS = {
    "row-stride": lambda: torch.randn(4, 6, 96, device=DEV)[..., :48],  # rows 96 apart: read in place
    "permuted": lambda: torch.randn(6, 4, 48, device=DEV).transpose(0, 1),  # no single row stride
    "sliced-batch": lambda: torch.randn(4, 6, 96, device=DEV)[::2, 1:, 48:],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_and_inputs_untouched(layout):
    """Strided inputs, outputs with empty_like's strides, an expanded (stride 0) gradient,
    and no input written."""
    x = LAYOUTS[layout]()
    w, b = torch.randn(48, device=DEV), torch.randn(48, device=DEV)
    r = torch.randn(x.shape[::-1], device=DEV).permute(2, 1, 0)  # last dim not contiguous: copied
    kw = dict(eps=1e-5, is_rms=False, weight_offset=0.0, cast_before_weight=False)
    before = [t.clone() for t in (x, r, w, b)]
    y, ro = K.norm_fwd(x, w, b, r, residual_in_fp32=False, **kw)
    assert y.stride() == torch.empty_like(x).stride() and ro.stride() == y.stride()
    assert_rel_close(ro, x + r, TOL[FP32], what="residual_out")
    assert_rel_close(y, _norm64(x + r, w, b, round_dtype=FP32, **kw), TOL[FP32], what="y")
    gy = torch.randn(48, device=DEV).expand(x.shape)
    dx, dw, db = KB.norm_bwd(gy, None, ro, w, b, out_dtype=FP32, **kw)
    edx, edw, edb = _grads64(gy, None, ro, w, b, kw, FP32)
    assert_rel_close(dx, edx, TOL[FP32], what="dx")
    assert_rel_close(dw, edw, TOL[FP32], what="dweight")
    assert_rel_close(db, edb, TOL[FP32], what="dbias")
    for t, c in zip((x, r, w, b), before):
        assert torch.equal(t, c)


@pytest.mark.parametrize("block_n", [None, 16], ids=["one-block", "column-blocks"])
def test_param_grads_deterministic(block_n, monkeypatch):
    monkeypatch.setattr(K, "TILE", block_n or 128)  # one-row tiles: several per program
    x, w, b = torch.randn(13, 80, device=DEV), torch.randn(80, device=DEV), torch.randn(80, device=DEV)
    gy = torch.randn_like(x)
    kw = dict(eps=1e-5, is_rms=False, weight_offset=0.0, cast_before_weight=False, out_dtype=FP32,
              block_n=block_n)
    first = KB.norm_bwd(gy, None, x, w, b, **kw)
    second = KB.norm_bwd(gy, None, x, w, b, **kw)
    for a, c in zip(first, second):
        assert torch.equal(a, c)


def test_empty_batch():
    x, w = torch.randn(0, 5, 32, device=DEV), torch.randn(32, device=DEV)
    kw = dict(eps=1e-5, is_rms=True, weight_offset=0.0, cast_before_weight=True)
    y, ro = K.norm_fwd(x, w, None, torch.randn_like(x), residual_in_fp32=True, **kw)
    assert y.shape == x.shape and ro.shape == x.shape and ro.dtype == FP32
    dx, dw, db = KB.norm_bwd(torch.randn_like(x), None, x, w, None, out_dtype=FP32, **kw)
    assert dx.shape == x.shape and torch.equal(dw, torch.zeros_like(w)) and db is None


def test_supports():
    x = torch.randn(4, 8, device=DEV)
    assert K.norm_supports(x, None) and K.norm_supports(x.bfloat16(), torch.randn(8, device=DEV))
    assert not K.norm_supports(x.double(), None)
    assert not K.norm_supports(x, torch.randn(8, device=DEV, dtype=torch.float64))


def _torch_norm(x, w, b, is_rms, eps):
    if is_rms:
        return torch.nn.functional.rms_norm(x, x.shape[-1:], w, eps)
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, eps)


@pytest.mark.cuda
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("shape", [(4096, 4096), (8192, 1024), (64, 12288), (64, 65536 + 17), (3, 300000)])
def test_cuda_large(shape, is_rms):
    """bf16 at real sizes: within tolerance of fp64 and no worse than PyTorch's own bf16 path
    (PyTorch's rounds xhat * w once; cast_before_weight=False does the same)."""
    x = torch.randn(shape, device="cuda", dtype=BF16)
    w = torch.randn(shape[-1], device="cuda", dtype=BF16)
    b = None if is_rms else torch.randn(shape[-1], device="cuda", dtype=BF16)
    kw = dict(eps=1e-5, is_rms=is_rms, weight_offset=0.0, cast_before_weight=False)
    y, _ = K.norm_fwd(x, w, b, None, residual_in_fp32=False, **kw)
    exact = _norm64(x, w, b, round_dtype=None, **kw)
    err = assert_rel_close(y, exact, TOL[BF16])
    assert err <= 1.05 * assert_rel_close(_torch_norm(x, w, b, is_rms, 1e-5), exact, TOL[BF16])
    gy = torch.randn_like(x)
    dx, dw, db = KB.norm_bwd(gy, None, x, w, b, out_dtype=BF16, **kw)
    edx, edw, edb = _grads64(gy, None, x, w, b, kw, BF16)
    assert_rel_close(dx, edx, TOL[BF16], what="dx")
    assert_rel_close(dw, edw, TOL[BF16], what="dweight")
    if b is not None:
        assert_rel_close(db, edb, TOL[BF16], what="dbias")
    again = KB.norm_bwd(gy, None, x, w, b, out_dtype=BF16, **kw)
    assert torch.equal(again[1], dw)


@pytest.mark.cuda
def test_cuda_add_fp32_residual():
    case = (True, FP32, True, BF16, False, True, 1.0, BF16)
    _check_forward(case, *_inputs(case, (2, 2048, 4096), device="cuda"))


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 6)], ids=[CASE_IDS[i] for i in (0, 6)])
def test_backward_without_prefetch(case, monkeypatch):
    """BWD_PREFETCH off (scripts/sweep_norm.py times both): each row tile loaded when it is
    worked on, whole rows and column chunks."""
    monkeypatch.setattr(KB, "BWD_PREFETCH", False)
    _check_backward(case, None, monkeypatch)
    _check_backward(case, 32, monkeypatch)
