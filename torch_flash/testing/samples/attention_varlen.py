"""flash.attention_varlen and its backward op: inputs shared by their opcheck samples and their
tests (tests/ops/test_attention_varlen.py)."""
import itertools

import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_cu(lengths, dtype=torch.int32):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=dtype)


def make_packed(lens_q, lens_k, hq=4, hkv=2, d=8, dv=None, dtype=torch.float32, rg=False,
                cu_dtype=torch.int32, strided=False):
    """(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k); strided=True
    gives tensors whose heads are every other head of a wider buffer."""
    def make(t, h, dd):
        x = torch.randn(t, 2 * h, dd, dtype=dtype)[:, ::2] if strided else torch.randn(t, h, dd, dtype=dtype)
        return x.requires_grad_(rg)
    return (make(sum(lens_q), hq, d), make(sum(lens_k), hkv, d), make(sum(lens_k), hkv, dv or d),
            make_cu(lens_q, cu_dtype), make_cu(lens_k, cu_dtype), max(lens_q, default=0), max(lens_k, default=0))


def make_seed(value=4321):
    return torch.tensor(value, dtype=torch.int64)


# (lengths of q, lengths of k, make_packed kwargs, op kwargs)
CASES = [
    ([3, 5, 2], [3, 5, 2], dict(), dict()),
    ([2, 4, 1], [5, 4, 3], dict(hkv=4), dict(causal=True)),
    ([4, 0, 3], [2, 3, 6], dict(hkv=1, dv=4), dict(window_left=1, window_right=2)),
    ([3, 3], [4, 0], dict(strided=True), dict(softcap=2.0, scale=0.4)),
    ([1, 1, 1, 1], [6, 1, 2, 3], dict(cu_dtype=torch.int64), dict(causal=True, window_left=2)),
]

# every feature at once: bf16 strided GQA inputs, D != Dv, empty sequences, causal, window,
# softcap, dropout, ALiBi slopes per sequence, sinks
_ALL = (([3, 0, 4, 2], [5, 2, 0, 3]), dict(hq=4, hkv=2, dv=4, dtype=torch.bfloat16, strided=True))
_ALL_KW = dict(causal=True, window_left=2, softcap=3.0, dropout_p=0.2)


def make_slopes():
    return torch.rand(len(_ALL[0][0]), 4)


def _samples_fwd():
    yield (*make_packed(*_ALL[0], **_ALL[1], rg=True), make_seed(), make_slopes(), torch.randn(4, requires_grad=True)), _ALL_KW
    for i, (lq, lk, pk, kw) in enumerate(CASES):
        dtype = DTYPES[i % 3]
        yield make_packed(lq, lk, **pk, dtype=dtype, rg=i % 2 == 0), kw


def backward_args(packed, kw, seed=None, with_grad_lse=True, slopes=None, sinks=None):
    q, k, v, cu_q, cu_k, mq, mk = packed
    out, lse = torch.ops.flash.attention_varlen(*packed, seed, slopes, sinks, **kw)
    scalars = (kw.get("scale", q.shape[-1] ** -0.5), kw.get("causal", False), kw.get("window_left", -1),
               kw.get("window_right", -1), kw.get("softcap", 0.0), kw.get("dropout_p", 0.0))
    grad_lse = torch.randn_like(lse) if with_grad_lse else None
    return (torch.randn_like(out), grad_lse, q, k, v, cu_q, cu_k, mq, mk, out, lse, *scalars, seed, slopes, sinks)


def _samples_bwd():
    yield backward_args(make_packed(*_ALL[0], **_ALL[1]), _ALL_KW, make_seed(), slopes=make_slopes(),
                        sinks=torch.randn(4)), {}
    for i, (lq, lk, pk, kw) in enumerate(CASES):
        yield backward_args(make_packed(lq, lk, **pk, dtype=DTYPES[i % 3]), kw, None, i % 2 == 1), {}


OPCHECK_SAMPLES = {
    "attention_varlen": _samples_fwd,
    "attention_varlen_backward": _samples_bwd,
}

FULL_OPCHECKS = 1  # opcheck compiles each sample (aot_dispatch): in full only the first
