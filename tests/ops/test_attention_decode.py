"""flash.attention_decode: against a naive per-sequence loop, contiguous vs paged caches,
the in-place append, opcheck, bad inputs."""
import math

import pytest
import torch
import torch.nn.functional as F

import torch_flash  # noqa: F401  (registers the ops)
from torch_flash.ops.attention_decode import attention_decode
from torch_flash.ops.rotary import rotary_cos_sin
from torch_flash.testing.samples.attention_decode import CONFIGS, S_MAX, make, to_paged
from _utils import TOL, assert_rel_close, force_triton_kernels, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rope_complex(x, cos, sin, pos, interleaved):
    """RoPE as a complex product (Meta's LLaMA code) in float64, on x (..., S, D) at positions
    pos (S,): pairs (x[2i], x[2i+1]) if interleaved, else (x[i], x[i + rd/2])."""
    rd = 2 * cos.shape[-1]
    xr = x[..., :rd].double()
    pairs = xr.unflatten(-1, (-1, 2)) if interleaved else xr.unflatten(-1, (2, -1)).transpose(-1, -2)
    z = torch.view_as_complex(pairs.contiguous()) * torch.complex(cos[pos].double(), sin[pos].double())
    rotated = torch.view_as_real(z) if interleaved else torch.view_as_real(z).transpose(-1, -2)
    return torch.cat((rotated.flatten(-2).to(x.dtype), x[..., rd:]), -1)


def naive(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, *, scale=None, causal=True,
          window=(-1, -1), softcap=0.0, rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
          num_splits=0, cache_leftpad=None):
    """One query and one sequence at a time, in float64, on contiguous caches; sequence b's keys
    are slots cache_leftpad[b] .. (FlashAttention 2's left padding; positions stay slots).
    Returns (out, lse, k_cache after the append, v_cache after the append)."""
    window_left, window_right = window
    kc, vc = k_cache.clone(), v_cache.clone()
    B, Hq, Sq, D = q.shape
    group = Hq // kc.shape[1]
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(B, Hq, Sq, vc.shape[-1], dtype=torch.float64)
    lse = torch.full((B, Hq, Sq), -math.inf, dtype=torch.float64)
    for b in range(B):
        n, qb = int(cache_seqlens[b]), q[b]
        if k_new is not None:
            kn, m = k_new[b], k_new.shape[2]
            if rotary_cos is not None:
                qb, kn = (rope_complex(t, rotary_cos, rotary_sin, torch.arange(t.shape[1]) + n,
                                       rotary_interleaved) for t in (qb, kn))
            kc[b, :, n:n + m], vc[b, :, n:n + m] = kn, v_new[b]
            n += m
        for h in range(Hq):
            for i in range(Sq):
                pos = n - Sq + i
                first = 0 if cache_leftpad is None else int(cache_leftpad[b])
                keys = [j for j in range(first, n) if (not causal or j <= pos)
                        and (window_left < 0 or j >= pos - window_left)
                        and (window_right < 0 or j <= pos + window_right)]
                if not keys:
                    continue
                s = kc[b, h // group, keys].double() @ qb[h, i].double() * scale
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                lse[b, h, i] = torch.logsumexp(s, 0)
                out[b, h, i] = torch.softmax(s, 0) @ vc[b, h // group, keys].double()
    return out, lse, kc, vc


def from_paged(pool, block_table):
    B, nb = block_table.shape
    blocks = pool[block_table.long()]  # (B, nb, H, block_size, D)
    return blocks.transpose(1, 2).reshape(B, pool.shape[1], nb * pool.shape[2], pool.shape[3])


def _clone(args):
    return tuple(None if a is None else a.clone() for a in args)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_naive_contiguous_and_paged(name):
    args, kwargs = make(**CONFIGS[name])
    q, kc, vc, cache_seqlens, kn, vn = args
    want_out, want_lse, want_kc, want_vc = naive(*args, **kwargs)
    exact_cache = "rotary_cos" not in kwargs  # rotation rounding may differ by an ulp

    k1, v1 = kc.clone(), vc.clone()
    out, lse = attention_decode(q, k1, v1, cache_seqlens, kn, vn, **kwargs)
    assert out.shape == want_out.shape and out.is_contiguous() and lse.dtype == torch.float32
    assert_rel_close(out, want_out, TOL[torch.float32], what="out")
    assert_rel_close(lse, want_lse, TOL[torch.float32], what="lse")
    for got, want in ((k1, want_kc), (v1, want_vc)):
        if exact_cache:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want)

    kp, vp, table = to_paged(kc, vc)
    spare = torch.ones(kp.shape[0], dtype=torch.bool)
    spare[table.long().flatten()] = False
    kp_spare, vp_spare = kp[spare].clone(), vp[spare].clone()
    out_p, lse_p = attention_decode(q, kp, vp, cache_seqlens, kn, vn, table, **kwargs)
    torch.testing.assert_close(out_p, out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_p, lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(from_paged(kp, table), k1) and torch.equal(from_paged(vp, table), v1)
    assert torch.equal(kp[spare], kp_spare) and torch.equal(vp[spare], vp_spare)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    """Within tolerance of fp64 and no worse than SDPA in the same dtype (over the appended cache)."""
    args, kwargs = make(B=2, Hq=4, Hkv=2, Sq=2, Snew=2, D=32, dtype=dtype)
    q, kc, vc, cache_seqlens, kn, vn = args
    want_out, want_lse, want_kc, want_vc = naive(*args, **kwargs)
    out, lse = attention_decode(*_clone(args), **kwargs)
    err = assert_rel_close(out, want_out, TOL[dtype])
    assert_rel_close(lse, want_lse, TOL[torch.float32])
    lengths = cache_seqlens.long() + 2
    key, query = torch.arange(S_MAX), lengths[:, None] - 2 + torch.arange(2)
    mask = (key < lengths[:, None, None]) & (key <= query[:, :, None])
    theirs = F.scaled_dot_product_attention(q, want_kc.repeat_interleave(2, 1), want_vc.repeat_interleave(2, 1),
                                            attn_mask=mask[:, None])
    assert err <= 1.5 * rel_err(theirs, want_out) + 1e-4


def test_flash_layout_caches():
    """(B, S, H, D) tensors passed as .transpose(1, 2) views: same answer, appended in place."""
    args, kwargs = make(Hq=4, Sq=2, Snew=2, rotary_dim=8, flash_layout=True)
    q, kc, vc, cache_seqlens, kn, vn = args
    contiguous = tuple(a.contiguous() for a in (q, kc, vc)) + (cache_seqlens, kn.contiguous(), vn.contiguous())
    out, lse = attention_decode(*contiguous, **kwargs)
    storage = kc.transpose(1, 2)  # the (B, S, H, D) tensor the user holds
    out_f, lse_f = attention_decode(q, kc, vc, cache_seqlens, kn, vn, **kwargs)
    torch.testing.assert_close(out_f, out)
    torch.testing.assert_close(lse_f, lse)
    torch.testing.assert_close(storage.transpose(1, 2), contiguous[1])


def test_queries_without_keys():
    """Empty cache, and queries before the first key (Sq > L, causal): out 0, lse -inf."""
    q = torch.randn(2, 2, 3, 8)
    kc, vc = torch.randn(2, 2, 8, 8), torch.randn(2, 2, 8, 8)
    cache_seqlens = torch.tensor([0, 2], dtype=torch.int32)
    out, lse = attention_decode(q, kc, vc, cache_seqlens)
    want_out, want_lse, _, _ = naive(q, kc, vc, cache_seqlens)
    assert not out.isnan().any()
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[1, :, 0], torch.zeros_like(out[1, :, 0]))
    assert torch.equal(lse.isinf(), want_lse.isinf()) and (lse[lse.isinf()] < 0).all()
    assert_rel_close(out, want_out, TOL[torch.float32])


def test_compile_appends():
    """A traced call (functionalised, as torch.compile runs it) appends and attends the same."""
    args, kwargs = make(Hq=4, Sq=1, Snew=1, rotary_dim=16)
    eager_args, compiled_args = _clone(args), _clone(args)
    want = attention_decode(*eager_args, **kwargs)
    step = torch.compile(lambda *a: attention_decode(*a, **kwargs), backend="aot_eager", fullgraph=True)
    got = step(*compiled_args)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(compiled_args[1], eager_args[1])
    torch.testing.assert_close(compiled_args[2], eager_args[2])


LEFTPAD = [n for n in CONFIGS if n.startswith("leftpad")]


def _leftpad_on_triton(name, device, B=3, **sizes):
    """The Triton kernels (split and not, contiguous and paged) against the naive loop, with
    cache_leftpad."""
    args, kwargs = make(B=B, **{**CONFIGS[name], **sizes})
    want_out, want_lse, _, _ = naive(*args, **kwargs)
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    args, kwargs = tuple(on(a) for a in args), {k: on(v) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    q, kc, vc, cs, kn, vn = args
    for num_splits in (1, 3):
        out, lse = attention_decode(q, kc.clone(), vc.clone(), cs, kn, vn, num_splits=num_splits, **kwargs)
        assert torch_flash._dispatch.LAST["attention_decode"] == "triton"
        assert_rel_close(out, want_out, TOL[torch.float32], what=f"out, {num_splits} splits")
        assert_rel_close(lse, want_lse, TOL[torch.float32], what=f"lse, {num_splits} splits")
    kp, vp, table = (t.to(device) for t in to_paged(kc.cpu(), vc.cpu()))
    out, lse = attention_decode(q, kp, vp, cs, kn, vn, table, num_splits=2, **kwargs)
    assert_rel_close(out, want_out, TOL[torch.float32], what="out, paged")


@pytest.mark.parametrize("name", LEFTPAD)
def test_leftpad_triton(name, force_backend):
    force_triton_kernels(force_backend)
    _leftpad_on_triton(name, DEVICE, S=40)  # three key blocks of the interpreter's 16


@pytest.mark.cuda
@pytest.mark.parametrize("name", LEFTPAD)
def test_gpu_leftpad_triton(name, force_backend):
    """Realistic head dim and batch, more key blocks than one split holds."""
    force_backend("triton")
    _leftpad_on_triton(name, "cuda", B=8, D=128, S=512)


def _bad_cases():
    q, kc, vc = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    cs, kn, vn = torch.tensor([3, 5], dtype=torch.int32), torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
    cos, sin = rotary_cos_sin(8, 16)
    pool, table = torch.randn(5, 2, 4, 16), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return [
        (lambda: attention_decode(q, kc[..., :8], vc, cs), "k_cache has head dim 8 but q has 16"),
        (lambda: attention_decode(q[:, :3], kc, vc, cs), "q has 3 heads, not a multiple of the 2 kv heads"),
        (lambda: attention_decode(q, kc, vc[:, :, :4], cs), "v_cache shape .* does not match k_cache"),
        (lambda: attention_decode(q, kc, vc, cs[:1]), "cache_seqlens has 1 entries, expected batch size 2"),
        (lambda: attention_decode(q, kc, vc, cs.float()), "cache_seqlens has dtype"),
        (lambda: attention_decode(q, kc[:1], vc[:1], cs), "k_cache has batch 1 but q has 2"),
        (lambda: attention_decode(q, kc, vc, cs, kn), "k_new and v_new must be given together"),
        (lambda: attention_decode(q, kc, vc, cs, kn[:, :, :, :8], vn), "k_new has shape"),
        (lambda: attention_decode(q, kc, vc, cs, kn, vn[:1]), "v_new has shape"),
        (lambda: attention_decode(q, kc, vc, cs, torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)),
         "k_new has 9 tokens, more than the cache holds \\(8\\)"),
        (lambda: attention_decode(q, kc, vc, torch.tensor([3, 8], dtype=torch.int32), kn, vn),
         "exceeds the cache capacity 8"),
        (lambda: attention_decode(q, kc, vc, torch.tensor([3, -1], dtype=torch.int32)), "cache_seqlens must be >= 0"),
        (lambda: attention_decode(q, pool, pool, cs, block_table=table[:, :1]), "exceeds the cache capacity 4"),
        (lambda: attention_decode(q, pool, pool, cs, block_table=table + 2), "block_table entries in use"),
        (lambda: attention_decode(q, pool, pool, cs, block_table=table.float()), "block_table has dtype"),
        (lambda: attention_decode(q, pool, pool, cs, block_table=table[:1]), "block_table has 1 rows"),
        (lambda: attention_decode(q.half(), kc, vc, cs), "dtype mismatch"),
        (lambda: attention_decode(torch.randn(2, 4, 1, 32)[..., ::2], kc, vc, cs),
         "q must have a contiguous last dimension"),
        (lambda: attention_decode(q, kc, vc, cs, window=(-2, 0)), "window_left/window_right must be >= -1"),
        (lambda: attention_decode(q, kc, vc, cs, window=3), "window must be a pair"),
        (lambda: attention_decode(q, kc, vc, cs, num_splits=-1), "num_splits must be >= 0"),
        (lambda: attention_decode(q, kc, vc, cs, softcap=-1.0), "softcap must be >= 0"),
        (lambda: attention_decode(q, kc, vc, cs, rotary_cos=cos, rotary_sin=sin), "need k_new"),
        (lambda: attention_decode(q, kc, vc, cs, kn, vn, rotary_cos=cos), "must be given together"),
        (lambda: attention_decode(q, kc, vc, cs, kn, vn, rotary_cos=cos[:, :8].repeat(1, 2), rotary_sin=sin[:, :8].repeat(1, 2)),
         "rotary_dim 32 .* exceeds the head dim 16"),
        (lambda: attention_decode(q, kc, vc, cs, kn, vn, rotary_cos=cos[:5], rotary_sin=sin[:5]),
         "5 positions, but a token sits at position 5"),
        (lambda: attention_decode(q[0], kc, vc, cs), "q must have 4 dimensions"),
        (lambda: attention_decode(q, kc, vc, cs, cache_leftpad=cs[:1]), "cache_leftpad has 1 entries"),
        (lambda: attention_decode(q, kc, vc, cs, cache_leftpad=cs.float()), "cache_leftpad has dtype"),
        (lambda: attention_decode(q, kc, vc, cs, cache_leftpad=torch.tensor([4, 0], dtype=torch.int32)),
         "cache_leftpad must be in \\[0, cache_seqlens\\]"),
        (lambda: attention_decode(q, kc, vc, cs, cache_leftpad=torch.tensor([0, -1], dtype=torch.int32)),
         "cache_leftpad must be in"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs(case):
    bad, match = _bad_cases()[case]
    with pytest.raises(ValueError, match=f"flash.attention_decode: .*{match}"):
        bad()


def test_inputs_other_than_caches_untouched():
    args, kwargs = make(Hq=4, Sq=2, Snew=2, rotary_dim=8)
    kp, vp, table = to_paged(args[1], args[2])
    q, _, _, cs, kn, vn = args
    others = (q, cs, kn, vn, table, kwargs["rotary_cos"], kwargs["rotary_sin"])
    copies = [t.clone() for t in others]
    attention_decode(q, kp, vp, cs, kn, vn, table, **kwargs)
    for a, b in zip(others, copies):
        assert torch.equal(a, b)


def test_inference_only():
    """Runs forward with inputs that require grad; a backward through it is refused."""
    args, kwargs = make()
    q = args[0].clone().requires_grad_()
    out, _ = attention_decode(q, *args[1:], **kwargs)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()
