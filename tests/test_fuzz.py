"""Seeded random calls of every op family (shapes, strides, dtypes, options), eagerly and under
torch.compile(fullgraph=True, dynamic=True), against float64 spellings written here from the
ops' definitions (not torch_flash.reference); and bad inputs that must fail with the same
message eagerly and when traced (the fakes run the ops' checks). On CPU the ops take their
reference path and the compiler is AOTAutograd over the fakes (backend "aot_eager": Inductor's
C++ compile of every case would take minutes); on a GPU the Triton kernels and Inductor, at
larger sizes."""
from __future__ import annotations

import random
import re

import pytest
import torch
import torch.nn.functional as F

import torch_flash

from _utils import TOL, assert_rel_close

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
BACKEND = "inductor" if GPU else "aot_eager"
CASES = {False: 6, True: 2}  # per family, eager / compiled (each compile of a case takes seconds on CPU)
DTYPES = (torch.float32, torch.bfloat16, torch.float16) if GPU else (torch.float32, torch.float64, torch.bfloat16)
SCALE = 8 if GPU else 1  # size multiplier on the GPU


def _layout(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """t's values in a random layout with a contiguous last dim: as is, inside a wider buffer
    (row stride past the row), with its two leading dims stored transposed, or its first
    entry broadcast along the leading dim (stride 0: every entry then holds the first's values)."""
    kind = rng.choice(("contiguous", "padded", "transposed", "expanded"))
    if kind == "expanded" and t.dim() >= 3:
        return t[:1].expand(t.shape)
    if kind == "padded":
        wide = torch.empty(*t.shape[:-1], t.shape[-1] + rng.choice((1, 8)), dtype=t.dtype, device=t.device)
        wide[..., :t.shape[-1]] = t
        return wide[..., :t.shape[-1]]
    if kind == "transposed" and t.dim() >= 3:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    return t


def _grad_tol(dtype: torch.dtype) -> float:
    return 4 * TOL[dtype] if dtype in (torch.float16, torch.bfloat16) else TOL[dtype]


# ---- the families: make(rng) -> (inputs needing gradients, fn(*inputs) -> tensor, ref64(*inputs))

def _norm_case(rng: random.Random):
    dtype = rng.choice(DTYPES)
    rows, n = rng.randint(1, 9) * SCALE, rng.choice((8, 33, 64, 100)) * SCALE
    lead = (rng.randint(1, 3), rows)
    x = _layout(torch.randn(*lead, n, device=DEV, dtype=dtype), rng)
    r = _layout(torch.randn(*lead, n, device=DEV, dtype=dtype), rng)
    w = torch.randn(n, device=DEV, dtype=dtype) if rng.random() < 0.7 else None
    b = torch.randn(n, device=DEV, dtype=dtype) if rng.random() < 0.5 else None
    eps = rng.choice((1e-6, 1e-5))
    kind = rng.choice(("rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm"))

    def rms64(s, w):
        y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
        return y if w is None else y.to(dtype).double() * w  # cast before the weight (the default)

    def ln64(s, w, b):
        return F.layer_norm(s, (n,), w, b, eps)

    if kind == "rms_norm":
        return [x, w], lambda x, w: torch_flash.rms_norm(x, w, eps), rms64
    if kind == "layer_norm":
        return [x, w, b], lambda x, w, b: torch_flash.layer_norm(x, w, b, eps), ln64
    def joined(y, s):  # both outputs, compared as one
        return torch.cat([y.to(s.dtype), s])
    if kind == "add_rms_norm":
        return ([x, r, w], lambda x, r, w: joined(*torch_flash.add_rms_norm(x, r, w, eps)),
                lambda x, r, w: torch.cat([rms64(x + r, w), x + r]))
    return ([x, r, w, b], lambda x, r, w, b: joined(*torch_flash.add_layer_norm(x, r, w, b, eps)),
            lambda x, r, w, b: torch.cat([ln64(x + r, w, b), x + r]))


def _cross_entropy_case(rng: random.Random):
    dtype = rng.choice(DTYPES)
    rows, v = rng.randint(1, 12) * SCALE, rng.choice((5, 64, 300, 1000)) * SCALE
    logits = _layout(torch.randn(2, rows, v, device=DEV, dtype=dtype) * 3, rng)
    target = torch.randint(0, v, (2, rows), device=DEV)
    target[torch.rand(2, rows, device=DEV) < 0.2] = -100
    target[0, 0] = 0  # at least one row counts
    opts = dict(label_smoothing=rng.choice((0.0, 0.1)), reduction=rng.choice(("mean", "sum", "none")),
                softcap=rng.choice((0.0, 20.0)))

    def ref64(z):
        if opts["softcap"]:
            z = opts["softcap"] * torch.tanh(z / opts["softcap"])
        return F.cross_entropy(z.transpose(1, 2), target, ignore_index=-100,
                               label_smoothing=opts["label_smoothing"], reduction=opts["reduction"])
    return [logits], lambda z: torch_flash.cross_entropy(z, target, **opts), ref64


def _attention_case(rng: random.Random):
    dtype = rng.choice(DTYPES)
    b, hkv = rng.randint(1, 2), rng.choice((1, 2))
    hq, d = hkv * rng.choice((1, 2)), rng.choice((16, 32, 64))
    sq, sk = rng.randint(1, 40) * SCALE, rng.randint(1, 40) * SCALE
    causal = rng.random() < 0.5
    scale = rng.choice((None, 0.3))
    q = _layout(torch.randn(b, hq, sq, d, device=DEV, dtype=dtype), rng)
    k = _layout(torch.randn(b, hkv, sk, d, device=DEV, dtype=dtype), rng)
    v = _layout(torch.randn(b, hkv, sk, d, device=DEV, dtype=dtype), rng)

    def ref64(q, k, v):
        k, v = (t.repeat_interleave(hq // hkv, 1) for t in (k, v))
        s = (q @ k.transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
        if causal:  # bottom-right aligned; a row that sees no key gives 0
            i = torch.arange(sq, device=q.device)[:, None]
            j = torch.arange(sk, device=q.device)[None, :]
            s = s.masked_fill(j > i + sk - sq, float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        return p @ v
    return [q, k, v], lambda q, k, v: torch_flash.attention(q, k, v, scale=scale, causal=causal), ref64


def _rotary_case(rng: random.Random):
    dtype = rng.choice(DTYPES)
    b, h, s, d = rng.randint(1, 2), rng.randint(1, 3), rng.randint(1, 20) * SCALE, rng.choice((8, 16, 64))
    rot = rng.choice((d, d // 2))
    offset = rng.choice((0, 3))
    interleaved = rng.random() < 0.5
    cos, sin = torch_flash.rotary_cos_sin(s + offset, rot, device=DEV)
    x = _layout(torch.randn(b, h, s, d, device=DEV, dtype=dtype), rng)

    def ref64(x):
        c, sn = cos[offset:offset + s].double(), sin[offset:offset + s].double()
        xr, rest = x[..., :rot], x[..., rot:]
        x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else xr.chunk(2, -1)
        o1, o2 = x1 * c - x2 * sn, x1 * sn + x2 * c
        out = torch.stack([o1, o2], -1).flatten(-2) if interleaved else torch.cat([o1, o2], -1)
        return torch.cat([out, rest], -1)
    return [x], lambda x: torch_flash.rotary(x, cos, sin, interleaved=interleaved, seqlen_offsets=offset), ref64


def _linear_cross_entropy_case(rng: random.Random):
    dtype = rng.choice(DTYPES)
    n, h, v = rng.randint(1, 24) * SCALE, rng.choice((8, 32)) * SCALE, rng.choice((7, 100, 513)) * SCALE
    hidden = _layout(torch.randn(2, n, h, device=DEV, dtype=dtype), rng)
    weight = torch.randn(v, h, device=DEV, dtype=dtype) / h ** 0.5
    bias = torch.randn(v, device=DEV, dtype=dtype) if rng.random() < 0.5 else None
    target = torch.randint(0, v, (2, n), device=DEV)
    target[torch.rand(2, n, device=DEV) < 0.2] = -100
    target[0, 0] = 0
    opts = dict(reduction=rng.choice(("mean", "sum")), label_smoothing=rng.choice((0.0, 0.1)),
                chunk_size=rng.choice((None, 3)))

    def ref64(hidden, weight, bias):
        logits = F.linear(hidden, weight, bias)
        return F.cross_entropy(logits.transpose(1, 2), target, label_smoothing=opts["label_smoothing"],
                               reduction=opts["reduction"])
    return ([hidden, weight, bias],
            lambda hidden, weight, bias: torch_flash.linear_cross_entropy(hidden, weight, target, bias, **opts), ref64)


FAMILIES = {"norms": _norm_case, "cross_entropy": _cross_entropy_case, "attention": _attention_case,
            "rotary": _rotary_case, "linear_cross_entropy": _linear_cross_entropy_case}


def _check(inputs, fn, ref64, what: str) -> None:
    leaves = [None if t is None else t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    leaves64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    want = ref64(*leaves64)
    dtype = inputs[0].dtype
    assert_rel_close(out, want, TOL[dtype] * (2 if out.dtype != dtype else 1), what=what)
    g = torch.randn_like(want)
    tensors = [t for t in leaves if t is not None]
    got = torch.autograd.grad(out, tensors, g.to(out.dtype), allow_unused=True)
    ref = torch.autograd.grad(want, [t for t in leaves64 if t is not None], g, allow_unused=True)
    for i, (a, r) in enumerate(zip(got, ref)):
        if r is not None and r.norm() > 0:
            assert_rel_close(a, r, _grad_tol(dtype), what=f"{what}: gradient {i}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_random_calls_match_float64(family, compiled):
    rng = random.Random(f"{family}-{compiled}")
    for i in range(CASES[compiled]):
        torch.manual_seed(rng.randrange(2**31))
        inputs, fn, ref64 = FAMILIES[family](rng)
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(fn, fullgraph=True, dynamic=True, backend=BACKEND)
        _check(inputs, fn, ref64, f"{family} case {i} ({'compiled' if compiled else 'eager'})")


# ---- bad inputs: the same message eagerly and traced

def _bad_calls():
    x = torch.randn(4, 16, device=DEV)
    q = torch.randn(1, 2, 8, 16, device=DEV)
    cos, sin = torch_flash.rotary_cos_sin(8, 16, device=DEV)
    return {
        "rms_norm weight size": (lambda: torch_flash.rms_norm(x, torch.randn(15, device=DEV)), r"rms_norm.*weight"),
        "layer_norm bias size": (lambda: torch_flash.layer_norm(x, None, torch.randn(17, device=DEV)),
                                 r"layer_norm.*bias"),
        "cross_entropy target shape": (lambda: torch_flash.cross_entropy(x, torch.zeros(3, dtype=torch.long, device=DEV)),
                                       r"cross_entropy: target shape"),
        "attention head dim": (lambda: torch_flash.attention(q, torch.randn(1, 2, 8, 8, device=DEV), q),
                               r"attention: k has head dim 8"),
        "rotary table": (lambda: torch_flash.rotary(torch.randn(1, 2, 9, 16, device=DEV), cos, sin), r"rotary"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_fails_alike_eagerly_and_traced(case):
    call, match = _bad_calls()[case]
    with pytest.raises(ValueError, match=match) as eager:
        call()
    torch._dynamo.reset()
    with pytest.raises(Exception) as traced:
        torch.compile(call, fullgraph=True, dynamic=True, backend=BACKEND)()
    # traced with dynamic shapes, a size in the message may be a symbol (s27 for 16)
    pattern = re.sub(r"\d+", r"(\\d+|s\\d+)", re.escape(str(eager.value)))
    assert re.search(pattern, str(traced.value)), f"eager: {eager.value}\ntraced: {traced.value}"
