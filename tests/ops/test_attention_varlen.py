"""flash.attention_varlen / flash.attention_varlen_backward: opcheck, gradcheck, numerics
against the float64 formula and per-sequence flash.attention, dropout, bad inputs."""
import pytest
import torch

import torch_flash  # noqa: F401  (registers the ops)
from torch_flash.ops.attention import attention_with_lse
from torch_flash.ops.attention_varlen import attention_varlen
from torch_flash.reference import attention as dense_ref
from torch_flash.reference import attention_varlen as ref
from torch_flash.testing.samples.attention_varlen import CASES, DTYPES, make_cu, make_packed, make_seed
from _utils import TOL, assert_rel_close


# every query sees a key in these, so lse is finite and differentiable
GRAD_CASES = {
    "plain": ([2, 3], [3, 2], dict(), dict()),
    "causal": ([2, 3], [3, 4], dict(), dict(causal=True)),
    "window": ([3, 2], [3, 2], dict(), dict(window_left=1, window_right=0)),
    "softcap_gqa_dv": ([2, 2], [3, 1], dict(hq=4, hkv=1, dv=3), dict(softcap=1.5)),
    "empty_sequences": ([2, 0, 3], [2, 3, 3], dict(), dict(causal=True)),
    "dropout": ([2, 3], [3, 2], dict(), dict(dropout_p=0.3)),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradcheck(case):
    lq, lk, pk, kw = GRAD_CASES[case]
    q, k, v, cu_q, cu_k, mq, mk = make_packed(lq, lk, **(dict(hq=2, hkv=1, d=4) | pk),
                                          dtype=torch.float64, rg=True)
    seed = make_seed() if kw.get("dropout_p") else None
    assert torch.autograd.gradcheck(
        lambda q, k, v: torch.ops.flash.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, seed, **kw),
        (q, k, v))


def _public_kw(kw):
    kw = dict(kw)
    window = (kw.pop("window_left", -1), kw.pop("window_right", -1))
    return kw | ({"window": window} if window != (-1, -1) else {})


def _check_against_fp64(lq, lk, pk, kw, dtype):
    q, k, v, cu_q, cu_k, mq, mk = make_packed(lq, lk, **pk, dtype=dtype)
    mine = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = attention_varlen(*mine, cu_q, cu_k, mq, mk, return_lse=True, **_public_kw(kw))
    o64, lse64 = ref.attention_varlen(*exact, cu_q, cu_k, **_public_kw(kw))
    assert out.is_contiguous() and out.dtype == dtype and lse.shape == (q.shape[1], q.shape[0])
    assert_rel_close(out, o64, TOL[dtype])
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), finite) and not out.transpose(0, 1)[~finite].any()
    assert_rel_close(lse[finite], lse64[finite], 10 * TOL[torch.float32], what="lse")
    g, gl = torch.randn_like(out), torch.randn_like(lse).masked_fill(~finite, 0)
    torch.autograd.backward((out, lse), (g, gl))
    torch.autograd.backward((o64, lse64), (g.double(), gl.double()))
    for a, b, name in zip(mine, exact, ("dq", "dk", "dv")):
        assert_rel_close(a.grad, b.grad, 3 * TOL[dtype], what=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_numerics_vs_fp64(case, dtype):
    _check_against_fp64(*CASES[case], dtype)


def test_numerics_many_chunks(monkeypatch):
    monkeypatch.setattr(dense_ref, "CHUNK_ELEMENTS", 100)
    _check_against_fp64([5, 9, 4], [7, 3, 6], dict(hkv=1), dict(causal=True, window_left=3),
                        torch.float32)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(2, 1), softcap=4.0)])
def test_equals_per_sequence_attention(kw):
    """Each sequence gives what flash.attention gives on it alone."""
    lq, lk = [3, 6, 2], [5, 6, 4]
    q, k, v, cu_q, cu_k, mq, mk = make_packed(lq, lk)
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, mq, mk, return_lse=True, **kw)
    for b in range(len(lq)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = attention_with_lse(*(t[s].transpose(0, 1)[None] for t, s in ((q, qs), (k, ks), (v, ks))), **kw)
        torch.testing.assert_close(out[qs], o[0].transpose(0, 1))
        torch.testing.assert_close(lse[:, qs], l[0])


def test_dropout():
    packed = make_packed([4, 6], [5, 7], rg=True)
    q, k, v = packed[:3]

    def run():
        out = attention_varlen(*packed, dropout_p=0.3)
        return (out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))

    torch.manual_seed(3)
    first = run()
    torch.manual_seed(3)
    for a, b in zip(first, run()):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], run()[0])
    out = torch.ops.flash.attention_varlen(*packed, make_seed(11), dropout_p=0.3)
    expected = ref.attention_varlen(*(t.detach() for t in packed[:5]), dropout_p=0.3, dropout_seed=11)
    torch.testing.assert_close(out, expected)


def test_dropout_mask_is_dense_batch_mask():
    """Sequence b gets the mask of batch row b: equal-length sequences match dense attention."""
    q, k, v, cu_q, cu_k, mq, mk = make_packed([4, 4, 4], [6, 6, 6])
    kw = dict(causal=True, softcap=3.0, dropout_p=0.4)
    out, _ = torch.ops.flash.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, make_seed(8), **kw)
    q4, k4, v4 = (t.unflatten(0, (3, -1)).transpose(1, 2) for t in (q, k, v))
    dense = torch.ops.flash.attention(q4, k4, v4, None, make_seed(8), **kw)
    torch.testing.assert_close(out, dense.transpose(1, 2).flatten(0, 1))


def test_max_seqlen_defaults_and_hint():
    packed = make_packed([3, 7, 2], [4, 4, 9])
    out = attention_varlen(*packed[:5], causal=True)
    torch.testing.assert_close(out, attention_varlen(*packed, causal=True))
    torch.testing.assert_close(out, attention_varlen(*packed[:5], 100, 100, causal=True))


@pytest.mark.parametrize("lq,lk", [([], []), ([0, 0], [0, 0]), ([0, 3], [2, 0]), ([3], [0])])
def test_empty(lq, lk):
    q, k, v, cu_q, cu_k, mq, mk = make_packed(lq, lk, rg=True)
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, mq, mk, return_lse=True, causal=True)
    assert out.shape == (sum(lq), 4, 8) and lse.shape == (4, sum(lq))
    assert not out.any() and (lse == -float("inf")).all()  # no query here sees a key
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and not t.grad.any()


def test_inputs_untouched():
    packed = make_packed([3, 4], [2, 5], strided=True)
    copies = [t.clone() for t in packed[:5]]
    attention_varlen(*packed, dropout_p=0.1, softcap=1.0)
    for a, b in zip(packed, copies):
        assert torch.equal(a, b)


def _bad(**over):
    q, k, v, cu_q, cu_k, mq, mk = make_packed([3, 4], [2, 5])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq,
                max_seqlen_k=mk) | over
    kw = {n: args.pop(n) for n in ("window", "dropout_p", "softcap") if n in args}
    return lambda: attention_varlen(*args.values(), **kw)


@pytest.mark.parametrize("bad,match", [
    (_bad(q=torch.randn(1, 7, 4, 8)), "q must have 3 dimensions"),
    (_bad(k=torch.randn(7, 2, 6)), "k has head dim 6 but q has 8"),
    (_bad(v=torch.randn(6, 2, 8)), "v has 6 keys but k has 7"),
    (_bad(k=torch.randn(7, 3, 8), v=torch.randn(7, 3, 8)), "not a multiple of the 3 heads"),
    (_bad(cu_seqlens_q=torch.tensor([0.0, 3.0, 7.0])), "cu_seqlens_q has dtype torch.float32"),
    (_bad(cu_seqlens_k=torch.tensor([[0, 2, 7]], dtype=torch.int32)), "cu_seqlens_k must have 1 dim"),
    (_bad(cu_seqlens_k=make_cu([2, 2, 3])), "cu_seqlens_q has 3 offsets but cu_seqlens_k has 4"),
    (_bad(cu_seqlens_q=make_cu([3, 3])), "cu_seqlens_q must run from 0 to the 7 tokens, got 0 .. 6"),
    (_bad(cu_seqlens_k=torch.tensor([1, 2, 7], dtype=torch.int32)), "cu_seqlens_k must run from 0"),
    (_bad(cu_seqlens_k=torch.tensor([0, 8, 7], dtype=torch.int32), max_seqlen_k=8), "must be non-decreasing"),
    (_bad(max_seqlen_q=3), "cu_seqlens_q holds a sequence of 4 tokens, more than max_seqlen_q=3"),
    (_bad(max_seqlen_k=-1), "max_seqlen_k must be >= 0"),
    (_bad(dropout_p=1.5), r"dropout_p must be in \[0, 1\)"),
    (_bad(window=(0, -2)), "window_right must be >= -1"),
    (_bad(softcap=-1.0), "softcap must be >= 0"),
])
def test_bad_inputs(bad, match):
    with pytest.raises(ValueError, match=f"flash.attention_varlen: .*{match}"):
        bad()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_compile_fullgraph_no_host_sync(device):
    """cu_seqlens stay on the device: the call compiles into one graph (fullgraph=True) without
    max_seqlen, and forward and backward equal eager."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, cu_q, cu_k, _, _ = (t.to(device) if torch.is_tensor(t) else t
                                 for t in make_packed([37, 5, 64], [37, 70, 1], d=64, dtype=dtype))
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step(q, k, v, cu_q, cu_k):
        return attention_varlen(q, k, v, cu_q, cu_k, causal=True).float().square().sum()

    eager_grads = torch.autograd.grad(step(*leaves, cu_q, cu_k), leaves)
    torch._dynamo.reset()
    grads = torch.autograd.grad(torch.compile(step, fullgraph=True)(*leaves, cu_q, cu_k), leaves)
    for g, e in zip(grads, eager_grads):
        assert_rel_close(g, e, TOL[dtype])
