"""flash.attention, attention_with_lse, attention_backward and the Hopper kernels' ops: inputs
shared by their opcheck samples and their tests (tests/ops/test_attention.py)."""
import itertools

import torch


def make_qkv(b=2, hq=4, hkv=2, sq=5, sk=7, d=8, dv=None, dtype=torch.float32, rg=False, bshd=False):
    """q, k, v; bshd=True gives (B, S, H, D) buffers viewed as (B, H, S, D)."""
    def make(h, s, dd):
        t = torch.randn(b, s, h, dd, dtype=dtype).transpose(1, 2) if bshd else \
            torch.randn(b, h, s, dd, dtype=dtype)
        return t.requires_grad_(rg)
    return make(hq, sq, d), make(hkv, sk, d), make(hkv, sk, dv or d)


def make_seed(value=1234):
    return torch.tensor(value, dtype=torch.int64)


# (shape kwargs of make_qkv, op kwargs, bias shape or None, bias dtype)
CASES = [
    (dict(), dict(), None, None),
    (dict(sq=6, sk=6, hkv=4), dict(causal=True), None, None),
    (dict(sq=3, sk=9), dict(causal=True), None, None),
    (dict(sq=9, sk=3), dict(causal=True), None, None),
    (dict(sq=1, sk=7, hkv=1), dict(causal=True), None, None),
    (dict(dv=4), dict(window_left=2, window_right=1), None, None),
    (dict(), dict(softcap=3.0, scale=0.5), None, None),
    (dict(), dict(), (5, 7), "float"),
    (dict(), dict(causal=True), (2, 1, 5, 7), "bool"),
    (dict(hkv=1), dict(window_left=3, window_right=-1), (4, 1, 7), "float"),
    (dict(bshd=True, sq=4, sk=4), dict(causal=True, softcap=2.0), (1, 4), "float"),
]


def make_bias(shape, kind, dtype, rg=False):
    if shape is None:
        return None
    if kind == "bool":
        return torch.rand(shape) > 0.2
    return torch.randn(shape, dtype=dtype).requires_grad_(rg)


# (case index in CASES, dtype, requires_grad); together they cover every feature
FWD_SAMPLES = [
    (10, torch.float32, True), (0, torch.float32, True), (1, torch.bfloat16, False),
    (2, torch.float16, True), (4, torch.float32, False), (5, torch.float32, True),
    (6, torch.bfloat16, True), (8, torch.float16, False),
]


# every feature at once: transposed bf16 GQA inputs, D != Dv, bias, window, softcap, dropout, ALiBi,
# sinks
_ALL = dict(b=2, hq=4, hkv=2, sq=5, sk=7, d=8, dv=4, dtype=torch.bfloat16, bshd=True)
_ALL_KW = dict(causal=True, window_left=3, softcap=2.0, dropout_p=0.3)


def make_slopes(*shape):
    return torch.rand(shape)


def _samples_fwd():
    q, k, v = make_qkv(**_ALL, rg=True)
    sinks = torch.randn(4, requires_grad=True)
    yield (q, k, v, make_bias((4, 1, 7), "float", torch.bfloat16, True), make_seed(), make_slopes(2, 4), sinks), _ALL_KW
    for i, dtype, rg in FWD_SAMPLES:
        shape, kw, bshape, bkind = CASES[i]
        q, k, v = make_qkv(**shape, dtype=dtype, rg=rg)
        yield (q, k, v, make_bias(bshape, bkind, dtype, rg)), kw
    q, k, v = make_qkv(sq=9, sk=4, dtype=torch.float32, rg=True)  # ALiBi (Hq,), Sq > Sk
    yield (q, k, v, None, None, make_slopes(4)), dict(causal=True)


def _samples_bwd():
    q, k, v = make_qkv(**_ALL)
    bias, slopes, sinks = make_bias((4, 1, 7), "float", torch.bfloat16), make_slopes(2, 4), torch.randn(4)
    out, lse = torch.ops.flash.attention_with_lse(q, k, v, bias, make_seed(), slopes, sinks, **_ALL_KW)
    yield (torch.randn_like(out), torch.randn_like(lse), q, k, v, bias, out, lse, 8 ** -0.5, True,
           3, -1, 2.0, 0.3, make_seed(), True, slopes, sinks), {}
    for i, dtype, with_grad_lse in ((7, torch.float32, True), (2, torch.bfloat16, False),
                                    (9, torch.float16, True), (10, torch.float32, False)):
        shape, kw, bshape, bkind = CASES[i]
        q, k, v = make_qkv(**shape, dtype=dtype)
        bias = make_bias(bshape, bkind, dtype)
        out, lse = torch.ops.flash.attention_with_lse(q, k, v, bias, **kw)
        scalars = (kw.get("scale", q.shape[-1] ** -0.5), kw.get("causal", False),
                   kw.get("window_left", -1), kw.get("window_right", -1), kw.get("softcap", 0.0))
        grad_lse = torch.randn_like(lse) if with_grad_lse else None
        yield (torch.randn_like(out), grad_lse, q, k, v, bias, out, lse, *scalars, 0.0, None,
               bkind == "float"), {}


def _samples_fwd_sm90():
    """The Hopper kernel's cases (on CPU the op's reference body runs): GQA with sinks,
    transposed layouts, causal, Sk not a multiple of the key tile, ALiBi slopes (Hq,) and
    (B, Hq); CUDA tensors too where there is a GPU."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device, (dtype, hq, hkv, sq, sk, d, causal, bshd) in itertools.product(devices, (
            (torch.bfloat16, 2, 2, 8, 24, 64, False, False),
            (torch.float16, 4, 2, 16, 16, 64, True, True),
            (torch.bfloat16, 4, 2, 8, 40, 64, True, False),
            (torch.bfloat16, 4, 1, 136, 200, 128, False, True))):
        qkv = make_qkv(b=2, hq=hq, hkv=hkv, sq=sq, sk=sk, d=d, dtype=dtype, bshd=bshd)
        q, k, v = (t.to(device) for t in qkv)
        # sinks on the GQA cases (each group member's launch reads its own heads' sinks)
        yield (q, k, v, 0.3, causal), (dict(sinks=torch.randn(hq, device=device) * 3) if hq != hkv else {})
        # ALiBi: (B, Hq) slopes where the heads group, (Hq,) where they do not
        slopes = torch.rand(2, hq, device=device) if hq != hkv else torch.rand(hq, device=device)
        yield (q, k, v, 0.3, causal), dict(alibi_slopes=slopes * 0.5)


def _samples_bwd_sm90():
    """The Hopper backward's cases: its forward's, with the forward's out and lse (ALiBi too)."""
    for (q, k, v, scale, causal), kw in _samples_fwd_sm90():
        slopes = kw.get("alibi_slopes")
        out, lse = torch.ops.flash.attention_fwd_sm90(q, k, v, scale, causal, None, slopes)
        yield (torch.randn_like(out), q, k, v, out, lse, scale, causal), ({} if slopes is None else kw)


OPCHECK_SAMPLES = {
    "attention_fwd_sm90": _samples_fwd_sm90,
    "attention_bwd_sm90": _samples_bwd_sm90,
    "attention": _samples_fwd,
    "attention_with_lse": _samples_fwd,
    "attention_backward": _samples_bwd,
}


FULL_OPCHECKS = 1  # opcheck compiles each sample (aot_dispatch): in full only the first
