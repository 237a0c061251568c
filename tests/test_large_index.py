"""64-bit indexing: ops on tensors of more than 2^31 elements match a reference
computed chunk by chunk.

Each case is a function of its sizes and device. The GPU tests (cuda, slow) run it where a
tensor, or an offset the kernels compute, passes 2^31 elements, against a reference computed on
the GPU in slices small enough for 32-bit indexing (float32; float64 where matmuls enter). Every
slice is compared on its own, so the last rows, past 2^31 elements, where an overflow shows, are
held to the same tolerance as the first. The CPU tests run the same functions at tiny sizes, on
the ops' reference path and on the Triton kernels under the interpreter, which checks the
chunking and the references themselves.

    python -m pytest -q -m cuda tests/test_large_index.py
"""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

import torch_flash
from _utils import TOL, assert_rel_close
from torch_flash import _dispatch

BIG = 2**31
GIB = 2**30
BF16 = torch.bfloat16
# The CPU runs: (backend, dtype). None: the ops' own choice, their reference path on CPU tensors;
# "triton": the kernels the GPU cases run, under the interpreter.
SMALL = [pytest.param(None, torch.float32, id="reference-fp32"), pytest.param(None, BF16, id="reference-bf16"),
         pytest.param("triton", torch.float32, id="triton-fp32")]


def large(fn):
    """A GPU case: marked cuda (skipped without a GPU) and slow, in one xdist group: the free
    memory each case checks for (_gpu) holds only while no other case runs beside it."""
    return pytest.mark.xdist_group("large_index")(pytest.mark.cuda(pytest.mark.slow(fn)))


@pytest.fixture(autouse=True)
def _release_memory():
    # the GPU cases take tens of GiB each: nothing of one may stay cached for the next (on CPU
    # the tiny cases leave nothing worth a collection, which costs seconds in a worker's heap)
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def _gpu(gib: float) -> str:
    """The device "cuda", or a skip where the GPU has less than gib GiB free."""
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < gib * GIB:
        pytest.skip(f"needs {gib} GiB of free GPU memory, {free / GIB:.1f} GiB free")
    return "cuda"


def _cpu(backend, force_backend) -> str:
    """The device "cpu", the ops forced onto backend for the rest of the test."""
    if backend == "triton" and not _dispatch.triton_interpret():
        pytest.skip("Triton kernels take CPU tensors only under TRITON_INTERPRET=1")
    force_backend(backend)
    return "cpu"


def _slices(n: int, size: int):
    """slice(i, i + size) over range(n); the last one ends at n."""
    return (slice(i, min(i + size, n)) for i in range(0, n, size))


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Relative error of a slice of an op's output against its reference slice under TOL[dtype]
    (tests/_utils.py's rel_err, computed on the device: the slices are large)."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN"
    ref = ref.double()
    diff, denom = (out.double() - ref).norm().item(), ref.norm().item()
    err = diff / denom if denom > 0 else diff
    assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]:.1e}"


def _where(sl: slice, n: int) -> str:
    return f"[{sl.start}:{sl.stop}] of {n}"


# --------------------------------------------------------------------------------------
# Norms: x (rows, hidden), forward and backward
# --------------------------------------------------------------------------------------
NORMS = ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm")


def _norm_case(kind, rows, hidden, chunk, device, dtype):
    add, rms, eps = kind.startswith("add_"), "rms" in kind, 1e-5
    inputs = [torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
              for _ in range(2 if add else 1)]
    params = [(1 + 0.1 * torch.randn(hidden, device=device)).to(dtype).requires_grad_()]
    if not rms:
        params.append((0.1 * torch.randn(hidden, device=device)).to(dtype).requires_grad_())
    outs = getattr(torch_flash, kind)(*inputs, *params, eps)
    outs = outs if add else (outs,)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    param_grads = [torch.zeros(hidden, dtype=torch.float64, device=device) for _ in params]
    for sl in _slices(rows, chunk):
        xs = [t[sl].detach().float().requires_grad_() for t in inputs]
        ps = [p.detach().float().requires_grad_() for p in params]
        h = sum(xs)
        y = (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * ps[0] if rms
             else F.layer_norm(h, (hidden,), *ps, eps))
        refs = (y, h) if add else (y,)
        where = f"{kind} rows {_where(sl, rows)}"
        for name, out, ref in zip(("y", "residual_out"), outs, refs):
            _close(out[sl], ref, dtype, f"{where}: {name}")
        got = torch.autograd.grad(refs, xs + ps, [g[sl].float() for g in grads])
        for name, t, ref in zip(("dx", "dresidual"), inputs, got):
            _close(t.grad[sl], ref, dtype, f"{where}: {name}")
        for acc, ref in zip(param_grads, got[len(xs):]):
            acc += ref
    for name, p, ref in zip(("dweight", "dbias"), params, param_grads):
        assert_rel_close(p.grad, ref, dtype=dtype, what=f"{kind}: {name}")


# 2^19 + 64 rows of 4096: the last 64 rows lie past 2^31 elements (x is 4 GiB in bf16)
NORM_ROWS, NORM_HIDDEN = 2**19 + 64, 4096


@large
@pytest.mark.parametrize("kind", NORMS)
def test_norm_large(kind):
    assert NORM_ROWS * NORM_HIDDEN > BIG
    _norm_case(kind, NORM_ROWS, NORM_HIDDEN, 2**15, _gpu(44), BF16)


@pytest.mark.parametrize("backend,dtype", SMALL)
@pytest.mark.parametrize("kind", NORMS)
def test_norm_small(kind, backend, dtype, force_backend):
    _norm_case(kind, 37, 64, 8, _cpu(backend, force_backend), dtype)


# --------------------------------------------------------------------------------------
# Cross-entropy: logits (rows, vocab), and the lm-head fused with it
# --------------------------------------------------------------------------------------
def _targets(rows, vocab, device):
    """Class indices with every 97th row ignored (the last rows not)."""
    target = torch.randint(vocab, (rows,), device=device)
    target[::97] = -100
    return target


def _ce_grad(z: torch.Tensor, target: torch.Tensor, n_valid: torch.Tensor):
    """(summed loss, gradient) of mean cross-entropy over n_valid rows for the logits z of some
    rows (float32 or float64)."""
    valid = target != -100
    t = target.clamp(min=0)[:, None]
    logp = torch.log_softmax(z, -1)
    loss = -(logp.gather(1, t)[:, 0] * valid).double().sum()
    grad = logp.exp_().scatter_add_(1, t, -torch.ones_like(t, dtype=z.dtype))  # softmax - one-hot
    return loss, grad.mul_((valid / n_valid)[:, None])


def _ce_case(rows, vocab, chunk, device, dtype):
    logits = torch.randn(rows, vocab, device=device, dtype=dtype).mul_(2).requires_grad_()
    target = _targets(rows, vocab, device)
    loss = torch_flash.cross_entropy(logits, target)
    loss.backward()
    n_valid = (target != -100).sum()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for sl in _slices(rows, chunk):
        part, grad = _ce_grad(logits[sl].detach().float(), target[sl], n_valid)
        total += part
        _close(logits.grad[sl], grad, dtype, f"cross_entropy: dlogits rows {_where(sl, rows)}")
    assert_rel_close(loss, total / n_valid, TOL[torch.float32], what="cross_entropy: loss")


# 32768 x 131072 bf16 logits: 8 GiB, 2^32 elements
CE_ROWS, CE_VOCAB = 32768, 131072


@large
def test_cross_entropy_large():
    assert CE_ROWS * CE_VOCAB > BIG
    _ce_case(CE_ROWS, CE_VOCAB, 2048, _gpu(26), BF16)


@pytest.mark.parametrize("backend,dtype", SMALL)
def test_cross_entropy_small(backend, dtype, force_backend):
    _ce_case(37, 100, 8, _cpu(backend, force_backend), dtype)


def _lce_case(rows, vocab, hidden, chunk_size, weight_grad, chunk, device, dtype):
    h = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device) / hidden**0.5).to(dtype).requires_grad_(weight_grad)
    target = _targets(rows, vocab, device)
    loss = torch_flash.linear_cross_entropy(h, w, target, chunk_size=chunk_size)
    loss.backward()
    n_valid = (target != -100).sum()
    w64 = w.detach().double()
    total = torch.zeros((), dtype=torch.float64, device=device)
    dw = torch.zeros(vocab, hidden, dtype=torch.float64, device=device)
    for sl in _slices(rows, chunk):
        h64 = h[sl].detach().double()
        part, grad = _ce_grad(h64 @ w64.T, target[sl], n_valid)
        total += part
        _close(h.grad[sl], grad @ w64, dtype, f"linear_cross_entropy: dhidden rows {_where(sl, rows)}")
        dw += grad.T @ h64
    assert_rel_close(loss, total / n_valid, TOL[dtype], what="linear_cross_entropy: loss")
    if weight_grad:
        assert_rel_close(w.grad, dw, dtype=dtype, what="linear_cross_entropy: dweight")


# One chunk of 16384 tokens: its logits, (vocab, tokens) column-major in the chunk buffer, pass
# 2^31 elements from class 131072 on (with dweight, all but the ~500 classes that _resident_chunk
# keeps in dweight's memory). A small hidden size keeps the GEMMs cheap.
LCE_ROWS, LCE_VOCAB, LCE_HIDDEN = 16384, 2**17 + 1024, 64


@large
@pytest.mark.parametrize("weight_grad", [True, False], ids=["resident", "chunked"])
def test_linear_cross_entropy_large(weight_grad):
    assert LCE_ROWS * (LCE_VOCAB - 512) > BIG  # elements past 2^31 beyond the ~500 resident classes
    _lce_case(LCE_ROWS, LCE_VOCAB, LCE_HIDDEN, LCE_ROWS, weight_grad, 1024, _gpu(16), BF16)


@pytest.mark.parametrize("backend,dtype", SMALL)
@pytest.mark.parametrize("weight_grad", [True, False], ids=["resident", "chunked"])
def test_linear_cross_entropy_small(weight_grad, backend, dtype, force_backend):
    _lce_case(37, 100, 16, 16, weight_grad, 8, _cpu(backend, force_backend), dtype)


# --------------------------------------------------------------------------------------
# Rotary: x (B, H, S, D), its (B, S, H, D) memory transposed, or packed (B * S, H, D)
# --------------------------------------------------------------------------------------
def _rope(x, cos, sin):
    """x (..., D) in float rotated over its whole head dim in halves (GPT-NeoX); cos and sin
    broadcast to (..., D / 2)."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)


def _rotary_case(layout, batch, heads, seqlen, dim, chunk, device, dtype):
    """heads: (H,) for flash.rotary, (Hq, Hkv) for flash.rotary_qk."""
    cos, sin = torch_flash.rotary_cos_sin(seqlen, dim, device=device)
    packed = layout == "packed"
    shapes = {"bhsd": lambda h: (batch, h, seqlen, dim), "bshd": lambda h: (batch, seqlen, h, dim),
              "packed": lambda h: (batch * seqlen, h, dim)}[layout]
    leaves = [torch.randn(shapes(h), device=device, dtype=dtype, requires_grad=True) for h in heads]
    xs = [t.transpose(1, 2) if layout == "bshd" else t for t in leaves]
    kw = {"cu_seqlens": torch.arange(0, batch * seqlen + 1, seqlen, dtype=torch.int32, device=device)} if packed else {}
    outs = torch_flash.rotary(*xs, cos, sin, **kw) if len(xs) == 1 else torch_flash.rotary_qk(*xs, cos, sin, **kw)
    outs = outs if len(xs) == 2 else (outs,)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    dxs = [t.grad.transpose(1, 2) if layout == "bshd" else t.grad for t in leaves]
    # chunks of tokens: of the sequence dim (dense), or of the packed tokens
    n = batch * seqlen if packed else seqlen
    for sl in _slices(n, chunk):
        if packed:
            pos = torch.arange(sl.start, sl.stop, device=device) % seqlen
            c, s = cos[pos][:, None], sin[pos][:, None]
        else:
            c, s = cos[sl], sin[sl]
        for name, x, out, g, dx in zip(("x",) if len(xs) == 1 else ("q", "k"), xs, outs, grads, dxs):
            part = (lambda t: t[sl]) if packed else (lambda t: t[:, :, sl])
            where = f"rotary ({layout}) {name} tokens {_where(sl, n)}"
            _close(part(out), _rope(part(x).detach().float(), c, s), dtype, f"{where}: out")
            _close(part(dx), _rope(part(g).float(), c, -s), dtype, f"{where}: grad")


# H x S x D = 32 x 524800 x 128 of one sequence: past 2^31 within one batch element
ROTARY_SIZES = dict(batch=1, seqlen=524800, dim=128)
ROTARY_PACKED = dict(batch=1025, seqlen=512, dim=128)  # 1025 sequences of 512 tokens


@large
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "packed"])
def test_rotary_large(layout):
    sizes = ROTARY_PACKED if layout == "packed" else ROTARY_SIZES
    assert sizes["batch"] * 32 * sizes["seqlen"] * sizes["dim"] > BIG
    _rotary_case(layout, heads=(32,), chunk=16384, device=_gpu(22), dtype=BF16, **sizes)


@large
def test_rotary_qk_large():
    _rotary_case("bshd", heads=(32, 8), chunk=16384, device=_gpu(28), dtype=BF16, **ROTARY_SIZES)


@pytest.mark.parametrize("backend,dtype", SMALL)
@pytest.mark.parametrize("heads", [(3,), (4, 2)], ids=["rotary", "rotary_qk"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "packed"])
def test_rotary_small(layout, heads, backend, dtype, force_backend):
    _rotary_case(layout, 2, heads, 20, 16, 6, _cpu(backend, force_backend), dtype)


# --------------------------------------------------------------------------------------
# Attention: many short sequences, forward and backward
# --------------------------------------------------------------------------------------
def _attention_ref(q, k, v, causal):
    """softmax(q k^T / sqrt(D)) v of float64 (B, Hq, S, D) q and (B, Hkv, S, D) k, v."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:  # Sq == Sk: bottom-right and top-left alignment agree
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def _attention_case(batch, heads, kv_heads, seqlen, dim, causal, varlen, chunk, device, dtype):
    # varlen: sequences of equal length, so that the packed (B * S, H, D) tensors are views of
    # dense (B, S, H, D) ones and the dense reference serves both
    def leaf(h):
        shape = (batch * seqlen, h, dim) if varlen else (batch, h, seqlen, dim)
        return torch.randn(shape, device=device, dtype=dtype, requires_grad=True)

    def dense(t):
        return t.view(batch, seqlen, t.shape[1], dim).transpose(1, 2) if varlen else t

    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    _dispatch.LAST.clear()  # the failure messages name the paths this call took
    if varlen:
        cu = torch.arange(0, batch * seqlen + 1, seqlen, dtype=torch.int32, device=device)
        out = torch_flash.attention_varlen(q, k, v, cu, cu, seqlen, seqlen, causal=causal)
    else:
        out = torch_flash.attention(q, k, v, causal=causal)
    grad = torch.randn_like(out)
    out.backward(grad)
    tensors = [dense(t) for t in (out, grad, q.grad, k.grad, v.grad)]
    ran = ", ".join(f"{op} on {path}" for op, path in sorted(_dispatch.LAST.items()))
    for sl in _slices(batch, chunk):
        qs, ks, vs = (dense(t)[sl].detach().double().requires_grad_() for t in (q, k, v))
        ref = _attention_ref(qs, ks, vs, causal)
        refs = (ref, *torch.autograd.grad(ref, (qs, ks, vs), tensors[1][sl].double()))
        where = f"attention (causal={causal}, varlen={varlen}; {ran}) batch {_where(sl, batch)}"
        for name, got, want in zip(("out", "dq", "dk", "dv"), tensors[:1] + tensors[2:], refs):
            _close(got[sl], want, dtype, f"{where}: {name}")


# 4104 x 32 heads of 128 x 128: q, out and their gradients pass 2^31 elements (k and v, 8 heads,
# do not), and B * Hq = 131328 (B * Hkv = 32832) programs per row block
ATTENTION_SIZES = dict(batch=4104, heads=32, kv_heads=8, seqlen=128, dim=128)


@large
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", [None, "triton"], ids=["default", "triton"])
def test_attention_large(backend, causal, force_backend):
    s = ATTENTION_SIZES
    assert s["batch"] * s["heads"] * s["seqlen"] * s["dim"] > BIG
    device = _gpu(44)
    force_backend(backend)
    _attention_case(causal=causal, varlen=False, chunk=64, device=device, dtype=BF16, **s)


@large
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_varlen_large(causal):
    _attention_case(causal=causal, varlen=True, chunk=64, device=_gpu(44), dtype=BF16, **ATTENTION_SIZES)


@pytest.mark.parametrize("backend,dtype", SMALL)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_small(causal, varlen, backend, dtype, force_backend):
    _attention_case(5, 4, 2, 16, 16, causal, varlen, 2, _cpu(backend, force_backend), dtype)


# --------------------------------------------------------------------------------------
# Decoding over a KV cache of more than 2^31 elements, contiguous or paged
# --------------------------------------------------------------------------------------
def _cache_rows(cache, block_table, page, sl, j0, j1):
    """Keys j0..j1 of the sequences sl as (Bs, Hkv, j1 - j0, D); j0, j1 multiples of page."""
    if block_table is None:
        return cache[sl, :, j0:j1]
    blocks = cache[block_table[sl, j0 // page:j1 // page].long()]  # (Bs, blocks, Hkv, page, D)
    return blocks.transpose(1, 2).flatten(2, 3)


def _decode_case(paged, batch, heads, kv_heads, capacity, dim, page, chunk, key_chunk, device, dtype):
    if paged:
        shape = (batch * capacity // page, kv_heads, page, dim)
        block_table = torch.randperm(shape[0], device=device).view(batch, -1).int()
    else:
        shape, block_table = (batch, kv_heads, capacity, dim), None
    k_cache, v_cache = (torch.randn(shape, device=device, dtype=dtype) for _ in range(2))
    lens = torch.randint(0, capacity, (batch,), dtype=torch.int32, device=device)
    lens[-1] = capacity - 1  # the new key of the last sequence goes in the cache's last slot
    q = torch.randn(batch, heads, 1, dim, device=device, dtype=dtype)
    k_new, v_new = (torch.randn(batch, kv_heads, 1, dim, device=device, dtype=dtype) for _ in range(2))
    out, lse = torch_flash.attention_decode(q, k_cache, v_cache, lens, k_new, v_new, block_table)
    n = lens.long() + 1  # keys per sequence, the new one included
    group, scale = heads // kv_heads, dim**-0.5
    for sl in _slices(batch, chunk):
        rows = torch.arange(sl.stop - sl.start, device=device)
        where = f"attention_decode (paged={paged}) batch {_where(sl, batch)}"
        for name, cache, new in (("k", k_cache, k_new), ("v", v_cache, v_new)):
            slot = n[sl] - 1
            if paged:
                stored = cache[block_table[sl][rows, slot // page].long(), :, slot % page]
            else:
                stored = cache[sl][rows, :, slot]
            assert torch.equal(stored, new[sl, :, 0]), f"{where}: appended {name} not in its slot"
        qs = q[sl].double().unflatten(1, (kv_heads, group))[:, :, :, 0]  # (Bs, Hkv, group, D)
        spans = list(_slices(capacity, key_chunk))
        s = torch.cat([qs @ _cache_rows(k_cache, block_table, page, sl, j.start, j.stop).double().transpose(-1, -2)
                       for j in spans], -1) * scale
        s = s.masked_fill((torch.arange(capacity, device=device) >= n[sl, None])[:, None, None], float("-inf"))
        lse_ref = torch.logsumexp(s, -1)
        p = torch.exp(s - lse_ref[..., None])
        ref = sum(p[..., j] @ _cache_rows(v_cache, block_table, page, sl, j.start, j.stop).double() for j in spans)
        _close(out[sl], ref.flatten(1, 2)[:, :, None], dtype, f"{where}: out")
        _close(lse[sl], lse_ref.flatten(1, 2)[:, :, None], torch.float32, f"{where}: lse")


# many: 8200 sequences x 8 kv heads x 256 slots (B * Hkv = 65600 programs); long: one sequence
# of 2^21 + 4096 slots; both caches of 8 x 128 x those slots pass 2^31 elements
DECODE_SIZES = {"many": dict(batch=8200, capacity=256, page=16, chunk=512),
                "long": dict(batch=1, capacity=2**21 + 4096, page=256, chunk=1)}


@large
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("size", list(DECODE_SIZES))
def test_attention_decode_large(size, paged):
    sizes = DECODE_SIZES[size]
    assert sizes["batch"] * sizes["capacity"] * 8 * 128 > BIG
    _decode_case(paged, heads=32, kv_heads=8, dim=128, key_chunk=2**16, device=_gpu(16), dtype=BF16, **sizes)


@pytest.mark.parametrize("backend,dtype", SMALL)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_attention_decode_small(paged, backend, dtype, force_backend):
    _decode_case(paged, 5, 4, 2, 32, 16, 8, 2, 8, _cpu(backend, force_backend), dtype)
