"""Seeded random calls of every op family (shapes, strides, dtypes, options), eagerly and under
torch.compile(fullgraph=True, dynamic=True), against float64 spellings written here from the
ops' definitions (not torch_flash.reference); and bad inputs that must fail with the same
message eagerly and when traced (the fakes run the ops' checks). On CPU the ops take their
reference path and the compiler is AOTAutograd over the fakes (backend "aot_eager": Inductor's
C++ compile of every case would take minutes); on a GPU the Triton kernels and Inductor, at
larger sizes.

Eager cases run in chunks (one test each, so pytest-xdist spreads them); compiled cases in
groups that share one compile: a group fixes the structure (dtype, options, layouts), its cases draw
fresh shapes and values, which dynamic shapes must serve without a new graph for
each. TORCH_FLASH_FUZZ_CASES sets the eager cases per family (default 300: 2142 cases
with the compiled ones on CPU; a recorded GPU run uses more)."""
from __future__ import annotations

import os
import random
import re
from typing import Callable, NamedTuple

import pytest
import torch
import torch.nn.functional as F

import torch_flash

from _utils import TOL, assert_rel_close

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
BACKEND = "inductor" if GPU else "aot_eager"
EAGER_CASES = int(os.environ.get("TORCH_FLASH_FUZZ_CASES", 300))  # per family
CHUNK = 50
# compiled, per family; on CPU the reference path traced recompiles per shape, a few seconds a case
GROUPS, PER_GROUP = 2, 5 if GPU else 3
DTYPES = (torch.float32, torch.bfloat16, torch.float16) if GPU else (torch.float32, torch.float64, torch.bfloat16)
SCALE = 8 if GPU else 1  # size multiplier on the GPU


class Case(NamedTuple):
    """inputs: the tensors fn takes (gradients checked for the floating ones where grad);
    fn(*inputs) -> a tensor or a tuple of them; ref64(*float64 inputs) -> the same in float64.
    terms64: ref64 with the terms a gradient is the difference of split off (attention: the
    softmax's normalizer held constant), or None; see _check."""
    inputs: list
    fn: Callable
    ref64: Callable
    grad: bool = True
    terms64: Callable | None = None


def _layout(t: torch.Tensor, rng: random.Random,
            kinds: tuple = ("contiguous", "padded", "transposed", "expanded")) -> torch.Tensor:
    """t's values in a random layout with a contiguous last dim: as is, inside a wider buffer
    (row stride past the row), with its two leading dims stored transposed, or its first
    entry broadcast along the leading dim (stride 0: every entry then holds the first's values)."""
    kind = rng.choice(kinds)
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


# ---- the families: family(rng, srng) -> Case; srng draws the structure (dtype, options, layouts, which
# optional inputs), rng the shapes, layouts and values

def _norm_case(rng: random.Random, srng: random.Random) -> Case:
    dtype = srng.choice(DTYPES)
    kind = srng.choice(("rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm"))
    has_w, has_b, eps = srng.random() < 0.7, srng.random() < 0.5, srng.choice((1e-6, 1e-5))
    rows, n = rng.randint(1, 9) * SCALE, rng.choice((8, 33, 64, 100)) * SCALE
    lead = (rng.randint(1, 3), rows)
    x = _layout(torch.randn(*lead, n, device=DEV, dtype=dtype), srng)
    r = _layout(torch.randn(*lead, n, device=DEV, dtype=dtype), srng)
    w = torch.randn(n, device=DEV, dtype=dtype) if has_w else None
    b = torch.randn(n, device=DEV, dtype=dtype) if has_b else None

    def rms64(s, w):
        y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
        return y if w is None else y.to(dtype).double() * w  # cast before the weight (the default)

    def ln64(s, w, b):
        return F.layer_norm(s, (n,), w, b, eps)

    if kind == "rms_norm":
        return Case([x, w], lambda x, w: torch_flash.rms_norm(x, w, eps), rms64)
    if kind == "layer_norm":
        return Case([x, w, b], lambda x, w, b: torch_flash.layer_norm(x, w, b, eps), ln64)

    def joined(y, s):  # both outputs, compared as one
        return torch.cat([y.to(s.dtype), s])
    if kind == "add_rms_norm":
        return Case([x, r, w], lambda x, r, w: joined(*torch_flash.add_rms_norm(x, r, w, eps)),
                    lambda x, r, w: torch.cat([rms64(x + r, w), x + r]))
    return Case([x, r, w, b], lambda x, r, w, b: joined(*torch_flash.add_layer_norm(x, r, w, b, eps)),
                lambda x, r, w, b: torch.cat([ln64(x + r, w, b), x + r]))


def _targets(rng: random.Random, shape: tuple, classes: int) -> torch.Tensor:
    """Class indices with about a fifth ignored (-100), the first always counted."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    target = torch.randint(0, classes, shape, generator=g)
    target[torch.rand(shape, generator=g) < 0.2] = -100
    target.view(-1)[0] = 0
    return target.to(DEV)


def _reduce64(rows: torch.Tensor, target: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return rows
    total = rows.sum()
    return total / (target != -100).sum() if reduction == "mean" else total


def _cross_entropy_case(rng: random.Random, srng: random.Random) -> Case:
    dtype = srng.choice(DTYPES)
    opts = dict(label_smoothing=srng.choice((0.0, 0.1)), z_loss=srng.choice((0.0, 1e-3)),
                reduction=srng.choice(("mean", "sum", "none")), softcap=srng.choice((0.0, 20.0)),
                inplace_backward=srng.random() < 0.3)
    rows, v = rng.randint(1, 12) * SCALE, rng.choice((5, 64, 300, 1000)) * SCALE
    # a gradient written over the logits needs evenly spaced rows (the op says so otherwise)
    kinds = ("contiguous", "padded") if opts["inplace_backward"] else ("contiguous", "padded", "transposed", "expanded")
    logits = _layout(torch.randn(2, rows, v, device=DEV, dtype=dtype) * 3, srng, kinds)
    target = _targets(rng, (2, rows), v)

    def ref64(z):
        if opts["softcap"]:
            z = opts["softcap"] * torch.tanh(z / opts["softcap"])
        rows = F.cross_entropy(z.transpose(1, 2), target, ignore_index=-100,
                               label_smoothing=opts["label_smoothing"], reduction="none")
        rows = rows + opts["z_loss"] * torch.logsumexp(z, -1).square() * (target != -100)
        return _reduce64(rows, target, opts["reduction"])
    # and must not be a leaf, whose values belong to the caller
    own = (lambda z: z.clone()) if opts["inplace_backward"] else (lambda z: z)
    return Case([logits], lambda z: torch_flash.cross_entropy(own(z), target, **opts), ref64)


def _attention_options(srng: random.Random, dtype: torch.dtype, hq: int, batch: int) -> dict:
    """causal, window, softcap, scale, ALiBi slopes and sinks, each drawn or left out."""
    opts = dict(scale=srng.choice((None, 0.3)), causal=srng.random() < 0.5)
    if srng.random() < 0.3:
        opts["window"] = (srng.choice((-1, 0, 3, 9)), srng.choice((-1, 0, 5)))
    if srng.random() < 0.3:
        opts["softcap"] = srng.choice((5.0, 30.0))
    if srng.random() < 0.3:
        shape = srng.choice(((hq,), (batch, hq)))
        opts["alibi_slopes"] = torch.rand(shape, device=DEV) * 0.5
    if srng.random() < 0.3:
        opts["sinks"] = torch.randn(hq, device=DEV, dtype=dtype)
    return opts


def _attention64(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None,
                 sinks=None, row=None, fixed_norm=False):
    """float64 attention of q (B, Hq, Sq, D) over k, v (B, Hkv, Sk, D): the op's definition with
    bottom-right alignment. row: which row of (batch, Hq) slopes applies (all batches: None).
    fixed_norm: the softmax's log-normalizer detached (the same values; its gradients leave out
    the normalizer's term, P (dP - D) without the D)."""
    hq, sq, sk, d = q.shape[1], q.shape[2], k.shape[2], q.shape[3]
    k, v = (t.repeat_interleave(hq // k.shape[1], 1) for t in (k, v))
    s = (q @ k.transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    diag = torch.arange(sq, device=q.device)[:, None] + sk - sq
    j = torch.arange(sk, device=q.device)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.double()
        slopes = slopes[row:row + 1] if slopes.dim() == 2 and row is not None else slopes
        s = s - slopes.reshape(-1 if slopes.dim() == 2 else 1, hq, 1, 1) * (diag - j).abs()
    left, right = window[0], 0 if causal else window[1]
    hidden = torch.zeros(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        hidden |= j > diag + right
    if left >= 0:
        hidden |= j < diag - left
    s = s.masked_fill(hidden, float("-inf"))
    if sinks is not None:  # one more column per head, no value
        s = torch.cat([s, sinks.double().reshape(1, hq, 1, 1).expand(*s.shape[:3], 1)], -1)
    norm = torch.logsumexp(s, -1, keepdim=True)
    p = torch.exp(s - (norm.detach() if fixed_norm else norm)).nan_to_num(0.0)  # a row without keys: 0
    return (p[..., :-1] if sinks is not None else p) @ v


def _attention_case(rng: random.Random, srng: random.Random) -> Case:
    dtype = srng.choice(DTYPES)
    hkv, group, batch = srng.choice((1, 2)), srng.choice((1, 2)), srng.randint(1, 2)
    hq, d = hkv * group, rng.choice((16, 32, 64))
    opts = _attention_options(srng, dtype, hq, batch)
    sq, sk = rng.randint(1, 40) * SCALE, rng.randint(1, 40) * SCALE
    q = _layout(torch.randn(batch, hq, sq, d, device=DEV, dtype=dtype), srng)
    k = _layout(torch.randn(batch, hkv, sk, d, device=DEV, dtype=dtype), srng)
    v = _layout(torch.randn(batch, hkv, sk, d, device=DEV, dtype=dtype), srng)
    return Case([q, k, v], lambda q, k, v: torch_flash.attention(q, k, v, **opts),
                lambda q, k, v: _attention64(q, k, v, **opts),
                terms64=lambda q, k, v: _attention64(q, k, v, **opts, fixed_norm=True))


def _attention_varlen_case(rng: random.Random, srng: random.Random) -> Case:
    dtype = srng.choice(DTYPES)
    hkv, group, batch = srng.choice((1, 2)), srng.choice((1, 2)), srng.randint(1, 3)
    hq, d = hkv * group, rng.choice((16, 32))
    opts = _attention_options(srng, dtype, hq, batch)
    opts.pop("scale")
    hint = srng.random() < 0.5
    lens_q = [rng.randint(0, 20) * SCALE for _ in range(batch)]
    lens_k = [rng.randint(0, 20) * SCALE for _ in range(batch)]

    def cu(lens):
        return torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    bounds = dict(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k)) if hint else {}
    q = _layout(torch.randn(sum(lens_q), hq, d, device=DEV, dtype=dtype), srng)
    k = _layout(torch.randn(sum(lens_k), hkv, d, device=DEV, dtype=dtype), srng)
    v = _layout(torch.randn(sum(lens_k), hkv, d, device=DEV, dtype=dtype), srng)

    def ref64(q, k, v, fixed_norm=False):
        outs = []
        for b in range(batch):
            qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            seq = [t[s].transpose(0, 1)[None] for t, s in ((q, qs), (k, ks), (v, ks))]
            outs.append(_attention64(*seq, **opts, row=b, fixed_norm=fixed_norm)[0].transpose(0, 1))
        return torch.cat(outs)
    return Case([q, k, v], lambda q, k, v: torch_flash.attention_varlen(q, k, v, cu_q, cu_k, **bounds, **opts),
                ref64, terms64=lambda q, k, v: ref64(q, k, v, fixed_norm=True))


def _attention_decode_case(rng: random.Random, srng: random.Random) -> Case:
    """New queries over a cache (contiguous or paged), appending k_new / v_new in place: the
    output and the whole cache after the call are compared."""
    dtype = srng.choice(DTYPES)
    hkv, group, batch = srng.choice((1, 2)), srng.choice((1, 4)), srng.randint(1, 3)
    hq, d = hkv * group, rng.choice((16, 32))
    opts = _attention_options(srng, dtype, hq, batch)
    opts.setdefault("causal", True)
    paged, new = srng.random() < 0.4, srng.random() < 0.6
    sq = rng.randint(1, 4)
    s_new = sq if new else 0
    block, blocks_per_seq = 8, rng.randint(1, 4)
    s_max = block * blocks_per_seq if paged else rng.randint(s_new + 1, 40)
    lens = torch.tensor([rng.randint(0 if new else 1, s_max - s_new) for _ in range(batch)], dtype=torch.int32)
    q = _layout(torch.randn(batch, hq, sq, d, device=DEV, dtype=dtype), srng)
    k_new = torch.randn(batch, hkv, s_new, d, device=DEV, dtype=dtype) if new else None
    v_new = torch.randn(batch, hkv, s_new, d, device=DEV, dtype=dtype) if new else None
    if paged:  # every sequence's blocks at shuffled physical places, plus one unused block
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        n_blocks = batch * blocks_per_seq + 1
        table = torch.randperm(n_blocks, generator=g)[:batch * blocks_per_seq].view(batch, -1)
        table = table.to(torch.int32).to(DEV)
        k_cache = torch.randn(n_blocks, hkv, block, d, device=DEV, dtype=dtype)
        v_cache = torch.randn(n_blocks, hkv, block, d, device=DEV, dtype=dtype)
    else:
        table = None
        k_cache = torch.randn(batch, hkv, s_max, d, device=DEV, dtype=dtype)
        v_cache = torch.randn(batch, hkv, s_max, d, device=DEV, dtype=dtype)
    lens = lens.to(DEV)
    before = (k_cache.clone(), v_cache.clone())

    def logical(cache, b):  # sequence b's cache (Hkv, S_max, D) in token order
        if table is None:
            return cache[b]
        return cache[table[b].long()].transpose(0, 1).flatten(1, 2)

    def fn(q):
        out, _ = torch_flash.attention_decode(q, k_cache, v_cache, lens, k_new, v_new, table, **opts)
        return out, k_cache, v_cache

    def ref64(q):
        kc, vc = (c.double() for c in before)
        outs = []
        for b in range(batch):
            n = int(lens[b])
            for cache, fresh in ((kc, k_new), (vc, v_new)):
                if fresh is not None:  # write the new tokens where the op writes them
                    seq = logical(cache, b)
                    seq[:, n:n + s_new] = fresh[b].double()
                    if table is None:
                        cache[b] = seq
                    else:
                        cache[table[b].long()] = seq.unflatten(1, (-1, block)).transpose(0, 1)
            keys = n + s_new
            kb, vb = (logical(c, b)[None, :, :keys] for c in (kc, vc))
            outs.append(_attention64(q[b:b + 1], kb, vb, **opts, row=b))
        return torch.cat(outs), kc, vc
    return Case([q], fn, ref64, grad=False)


def _rotary_case(rng: random.Random, srng: random.Random) -> Case:
    dtype = srng.choice(DTYPES)
    interleaved, half, offset = srng.random() < 0.5, srng.random() < 0.5, srng.choice((0, 3))
    b, h, s, d = rng.randint(1, 2), rng.randint(1, 3), rng.randint(1, 20) * SCALE, rng.choice((8, 16, 64))
    rot = d // 2 if half else d
    cos, sin = torch_flash.rotary_cos_sin(s + offset, rot, device=DEV)
    x = _layout(torch.randn(b, h, s, d, device=DEV, dtype=dtype), srng)

    def ref64(x):
        c, sn = cos[offset:offset + s].double(), sin[offset:offset + s].double()
        xr, rest = x[..., :rot], x[..., rot:]
        x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else xr.chunk(2, -1)
        o1, o2 = x1 * c - x2 * sn, x1 * sn + x2 * c
        out = torch.stack([o1, o2], -1).flatten(-2) if interleaved else torch.cat([o1, o2], -1)
        return torch.cat([out, rest], -1)
    return Case([x], lambda x: torch_flash.rotary(x, cos, sin, interleaved=interleaved, seqlen_offsets=offset),
                ref64)


def _linear_cross_entropy_case(rng: random.Random, srng: random.Random) -> Case:
    dtype = srng.choice(DTYPES)
    has_bias = srng.random() < 0.5
    opts = dict(reduction=srng.choice(("mean", "sum")), label_smoothing=srng.choice((0.0, 0.1)),
                chunk_size=srng.choice((None, 3)))
    n, h, v = rng.randint(1, 24) * SCALE, rng.choice((8, 32)) * SCALE, rng.choice((7, 100, 513)) * SCALE
    hidden = _layout(torch.randn(2, n, h, device=DEV, dtype=dtype), srng)
    weight = torch.randn(v, h, device=DEV, dtype=dtype) / h ** 0.5
    bias = torch.randn(v, device=DEV, dtype=dtype) if has_bias else None
    target = _targets(rng, (2, n), v)

    def ref64(hidden, weight, bias):
        logits = F.linear(hidden, weight, bias)
        return F.cross_entropy(logits.transpose(1, 2), target, label_smoothing=opts["label_smoothing"],
                               reduction=opts["reduction"])
    return Case([hidden, weight, bias],
                lambda hidden, weight, bias: torch_flash.linear_cross_entropy(hidden, weight, target, bias, **opts),
                ref64)


FAMILIES = {"norms": _norm_case, "cross_entropy": _cross_entropy_case, "attention": _attention_case,
            "attention_varlen": _attention_varlen_case, "attention_decode": _attention_decode_case,
            "rotary": _rotary_case, "linear_cross_entropy": _linear_cross_entropy_case}


def _check(case: Case, what: str) -> None:
    leaves = [None if t is None else t.detach().requires_grad_(case.grad) for t in case.inputs]
    leaves64 = [None if t is None else t.detach().double().requires_grad_(case.grad) for t in case.inputs]
    want = case.ref64(*leaves64)  # first: the op may write into its inputs (in-place backward, caches)
    out = case.fn(*leaves)
    dtype = case.inputs[0].dtype
    outs, wants = (out, want) if isinstance(out, tuple) else ((out,), (want,))
    for i, (o, w) in enumerate(zip(outs, wants)):
        assert_rel_close(o, w, TOL[dtype] * (2 if o.dtype != dtype else 1), what=f"{what}: output {i}")
    if not case.grad:
        return
    g = torch.randn_like(want)
    tensors = [t for t in leaves if t is not None]
    got = torch.autograd.grad(out, tensors, g.to(out.dtype), allow_unused=True)
    ref = torch.autograd.grad(want, [t for t in leaves64 if t is not None], g, allow_unused=True)
    terms = [None] * len(ref)
    if case.terms64 is not None:
        leaves_t = [t.detach().requires_grad_() for t in leaves64 if t is not None]
        terms = torch.autograd.grad(case.terms64(*leaves_t), leaves_t, g, allow_unused=True)
    # a gradient that is zero in exact arithmetic (dq where each row sees one key) holds only
    # rounding noise, which relative error cannot judge: held to a floor tied to the largest
    scale = max((r.norm() for r in ref if r is not None), default=torch.tensor(0.0))
    for i, (a, r, t) in enumerate(zip(got, ref, terms)):
        if r is None or scale == 0:
            continue
        if r.norm() <= 1e-6 * scale:
            assert a.norm() <= _grad_tol(dtype) * scale, f"{what}: gradient {i} {a.norm():.3e} where 0"
            continue
        # A gradient that is the difference of two terms (attention's dq and dk: dS = P dP - P D,
        # nearly cancelling where all keys or all values are alike) inherits the rounding of the
        # normalizer's term, t - r (D from the dtype's output, as every flash backward takes it):
        # its error is judged against the larger of the two.
        size = None if t is None else max(r.norm(), (t - r).norm()).item()
        assert_rel_close(a, r, _grad_tol(dtype), size=size, what=f"{what}: gradient {i}"
                         + ("" if t is None else f" (to the larger, {size / r.norm():.2g}x the gradient)"))


class _CountingBackend:
    """BACKEND, counting the graphs it compiles."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return torch._dynamo.lookup_backend(BACKEND)(gm, example_inputs)


EAGER_CHUNKS = [(family, start) for family in FAMILIES for start in range(0, EAGER_CASES, CHUNK)]


@pytest.mark.parametrize("family, start", EAGER_CHUNKS, ids=[f"{f}-{s}" for f, s in EAGER_CHUNKS])
def test_random_calls_match_float64(family, start):
    for i in range(start, min(start + CHUNK, EAGER_CASES)):
        rng = random.Random(f"{family}-{i}")
        torch.manual_seed(rng.randrange(2**31))
        _check(FAMILIES[family](rng, rng), f"{family} case {i} (eager)")


COMPILED_GROUPS = [(family, group) for family in FAMILIES for group in range(GROUPS)]


@pytest.mark.parametrize("family, group", COMPILED_GROUPS, ids=[f"{f}-{g}" for f, g in COMPILED_GROUPS])
def test_random_calls_match_float64_compiled(family, group):
    """A group compiles once per structure; its cases must reuse the graph or recompile within
    dynamo's limit (reaching it raises: no case silently runs eagerly). One test a group, so
    that pytest-xdist spreads the slowest."""
    torch._dynamo.reset()
    backend = _CountingBackend()
    for i in range(PER_GROUP):
        rng = random.Random(f"{family}-compiled-{group}-{i}")
        torch.manual_seed(rng.randrange(2**31))
        case = FAMILIES[family](rng, random.Random(f"{family}-compiled-{group}"))
        case = case._replace(fn=torch.compile(case.fn, fullgraph=True, dynamic=True, backend=backend))
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            _check(case, f"{family} group {group} case {i} (compiled, {backend.graphs} graphs so far)")
    assert backend.graphs >= 1

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
