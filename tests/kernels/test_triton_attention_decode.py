"""Triton KV-cache decoding (torch_flash/kernels/triton/attention_decode.py) against the float64 reference
(torch_flash/reference/attention_decode.py, itself checked against a naive loop in
tests/ops/test_attention_decode.py): append with rotary, paged caches, GQA, split-KV.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (tiny shapes); the
`cuda`-marked tests take realistic sizes, check that a call never synchronises with the host,
and run a decoding step under torch.compile(mode="reduce-overhead") (CUDA graphs):
    python -m pytest -q tests/kernels/test_triton_attention_decode.py -m cuda
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
os.environ.setdefault("TORCH_FLASH_AUTOTUNE", "0")

triton = pytest.importorskip("triton")
import torch_flash  # noqa: E402,F401  (registers the ops)
from torch_flash.kernels.triton import attention_decode as K  # noqa: E402
from torch_flash.ops.attention_decode import attention_decode  # noqa: E402
from torch_flash.ops.rotary import rotary_cos_sin  # noqa: E402
from torch_flash.reference import attention_decode as ref  # noqa: E402
from _utils import TOL, assert_rel_close  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not K._INTERPRET:
    pytest.skip("the Triton kernels were imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

FLAGS = dict(scale=None, causal=True, window_left=-1, window_right=-1, softcap=0.0,
             rotary_interleaved=False)


def make(B, Hq, Hkv, Sq, Snew, D, Dv, S, dtype=torch.float32, page=0, rotary_dim=0, flash_layout=False,
         seqlens=None):
    """Inputs (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, cos, sin).
    S: slots per sequence. page > 0: a paged pool of shuffled blocks with spares (its unused
    table entries hold -1: they must never be read). cache_seqlens: the first sequence empty,
    the last one full after the append, the rest random (or `seqlens`)."""
    def t(*shape):  # (B, H, S, D), or the .transpose(1, 2) view of a (B, S, H, D) buffer
        if flash_layout:
            return torch.randn(shape[0], shape[2], shape[1], shape[3], dtype=dtype,
                               device=DEVICE).transpose(1, 2)
        return torch.randn(shape, dtype=dtype, device=DEVICE)

    q = t(B, Hq, Sq, D)
    kn, vn = (t(B, Hkv, Snew, D), t(B, Hkv, Snew, Dv)) if Snew else (None, None)
    if seqlens is None:
        seqlens = torch.randint(0, S - Snew + 1, (B,))
        seqlens[0], seqlens[-1] = 0, S - Snew
    cache_seqlens = torch.as_tensor(seqlens, dtype=torch.int32, device=DEVICE)
    if page:
        nb = S // page
        pool = B * nb + 3
        kc, vc = t(pool, Hkv, page, D), t(pool, Hkv, page, Dv)
        table = torch.randperm(pool, device=DEVICE)[:B * nb].view(B, nb).int()
        # entries past a sequence's tokens are padding: poison them
        used = torch.arange(nb, device=DEVICE) * page < (cache_seqlens[:, None] + Snew)
        table = table.where(used, -1)
    else:
        kc, vc, table = t(B, Hkv, S, D), t(B, Hkv, S, Dv), None
    cos = sin = None
    if rotary_dim:
        cos, sin = (x.to(DEVICE) for x in rotary_cos_sin(S + Sq, rotary_dim))
    return q, kc, vc, cache_seqlens, kn, vn, table, cos, sin


def reference(inputs, flags):
    """(out, lse, k_cache, v_cache) in float64 after the append."""
    q, kc, vc, cs, kn, vn, table, cos, sin = inputs
    q, kc, vc, kn, vn = (None if x is None else x.double() for x in (q, kc, vc, kn, vn))
    out, lse = ref.attention_decode(q, kc, vc, cs, kn, vn, table, cos, sin, flags["scale"], flags["causal"],
                                    flags["window_left"], flags["window_right"], flags["softcap"],
                                    flags["rotary_interleaved"])
    return out, lse, kc, vc


def clone(inputs):
    return tuple(None if x is None else x.clone() for x in inputs)


def check(inputs, num_splits=0, **kw):
    """The launcher against the reference: out and lse by relative error, -inf exactly where no
    key is visible, caches appended (and nothing else written), other inputs untouched."""
    flags = {**FLAGS, **kw}
    q, kc, vc, cs, kn, vn, table, cos, sin = inputs
    others = [x.clone() for x in (q, cs, kn, vn, table, cos, sin) if x is not None]
    want_out, want_lse, want_k, want_v = reference(clone(inputs), flags)
    out, lse = K.decode_fwd(q, kc, vc, cs, kn, vn, table, cos, sin, num_splits=num_splits, **flags)
    assert out.is_contiguous() and out.dtype == q.dtype and lse.dtype == torch.float32
    assert_rel_close(out, want_out, TOL[q.dtype], what="out")
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), "lse: -inf exactly where no key is visible"
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    # half precision: the kernel rounds rotated q to q's dtype (as the op does), fp64 does not
    assert_rel_close(lse[~empty], want_lse[~empty], TOL[q.dtype], what="lse")
    for got, want in ((kc, want_k), (vc, want_v)):
        if cos is None:
            assert torch.equal(got.double(), want), "cache after the append"
        else:  # the rotation of k_new may round differently in the last bit
            torch.testing.assert_close(got, want.to(got.dtype))
    for before, x in zip(others, [x for x in (q, cs, kn, vn, table, cos, sin) if x is not None]):
        assert torch.equal(before, x), "inputs other than the caches must not change"
    return out, lse


# (B, Hq, Hkv, Sq, Snew, D, Dv, S, make kwargs, num_splits, flags)
CASES = {
    "decode": (3, 4, 2, 1, 1, 32, 32, 48, {}, 1, {}),
    "decode_splits": (3, 8, 2, 1, 1, 32, 32, 64, {}, 3, {}),
    "auto_splits": (2, 2, 1, 1, 1, 16, 16, 40, {}, 0, {}),
    "more_splits_than_blocks": (2, 4, 2, 1, 1, 16, 16, 32, {}, 7, {}),
    "sq3_gqa_rotary": (2, 8, 2, 3, 3, 32, 32, 40, dict(rotary_dim=16), 2, {}),
    "paged_gptj_splits": (3, 4, 1, 2, 2, 32, 32, 48, dict(page=8, rotary_dim=32), 4,
                          dict(rotary_interleaved=True)),
    "paged_page_lt_block": (2, 4, 2, 1, 1, 24, 40, 30, dict(page=5), 2, {}),
    "no_append": (2, 4, 4, 3, 0, 16, 16, 40, {}, 1, dict(causal=False)),
    "window": (2, 4, 2, 2, 2, 16, 16, 64, {}, 3, dict(window_left=9)),
    "window_noncausal": (2, 2, 2, 3, 1, 16, 16, 40, {}, 2, dict(causal=False, window_left=4, window_right=1)),
    "softcap_scale": (2, 4, 2, 1, 1, 32, 32, 40, {}, 2, dict(softcap=5.0, scale=0.3)),
    "row_blocks": (1, 32, 1, 3, 3, 16, 16, 24, {}, 2, {}),
    "flash_layout": (2, 4, 2, 2, 2, 32, 32, 40, dict(flash_layout=True, rotary_dim=8), 2, {}),
    "bf16_paged_rotary": (2, 8, 2, 1, 1, 64, 64, 64, dict(dtype=torch.bfloat16, page=16, rotary_dim=64), 2,
                          {}),
    "fp16_dv": (2, 4, 2, 2, 2, 32, 16, 40, dict(dtype=torch.float16), 2, {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_against_reference(name):
    B, Hq, Hkv, Sq, Snew, D, Dv, S, make_kw, splits, flags = CASES[name]
    check(make(B, Hq, Hkv, Sq, Snew, D, Dv, S, **make_kw), splits, **flags)


def test_splits_agree():
    """Any number of splits gives the same answer (up to rounding) as one."""
    inputs = make(2, 4, 2, 1, 0, 16, 16, 64)
    one = K.decode_fwd(*inputs, num_splits=1, **FLAGS)
    for splits in (2, 5):
        out, lse = K.decode_fwd(*inputs, num_splits=splits, **FLAGS)
        torch.testing.assert_close(out, one[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, one[1], rtol=1e-5, atol=1e-6)


def test_int64_indices_and_queries_before_the_cache():
    """int64 cache_seqlens/block_table; Sq > keys leaves the first queries without a key."""
    q, kc, vc, cs, kn, vn, table, cos, sin = make(3, 2, 1, 4, 1, 16, 16, 16, page=4, seqlens=[0, 2, 9])
    check((q, kc, vc, cs.long(), kn, vn, table.long(), cos, sin), 2)


def test_bad_indices_poison_instead_of_reading_outside():
    """Without host checks (the GPU path), out-of-range cache_seqlens or block_table entries give
    NaN for that sequence only and never write outside the caches."""
    q, kc, vc, cs, kn, vn, table, cos, sin = make(3, 4, 2, 1, 1, 16, 16, 16, page=4, seqlens=[3, 5, 7])
    cs = torch.tensor([3, 16, -1], dtype=torch.int32, device=DEVICE)  # 16 + 1 > capacity, negative
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = K.decode_fwd(q, kc, vc, cs, kn, vn, table, cos, sin, num_splits=2, **FLAGS)
    assert torch.isnan(out[1:]).all() and torch.isnan(lse[1:]).all()
    assert not torch.isnan(out[0]).any()
    changed = (kc != kc0).any(-1).any(1)  # (pool blocks, slots) written
    assert changed.sum() == 1 and changed[table[0, 0], 3]  # only sequence 0's slot 3
    assert torch.equal((vc != vc0).any(-1).any(1), changed)
    table[0, 0] = kc.shape[0]  # a used entry outside the pool
    out, _ = K.decode_fwd(q, kc, vc, torch.tensor([3, 5, 7], dtype=torch.int32, device=DEVICE),
                          None, None, table, None, None, num_splits=2, **FLAGS)
    assert torch.isnan(out[0]).all() and not torch.isnan(out[1:]).any()


def test_positions_past_the_rotary_table_poison():
    """Rotary tables shorter than a sequence's positions (refused by the op's checks of CPU
    tensors): that sequence's rows rotate to NaN, the others are exact, nothing read outside."""
    inputs = make(2, 4, 2, 1, 1, 16, 16, 32, rotary_dim=16, seqlens=[3, 20])
    q, kc, vc, cs, kn, vn, table, cos, sin = inputs
    short = (cos[:8].clone(), sin[:8].clone())  # positions 0-7: sequence 0's new token sits at 3
    want = reference(clone((q[:1], kc[:1], vc[:1], cs[:1], kn[:1], vn[:1], table, *short)), FLAGS)[0]
    out, _ = K.decode_fwd(q, kc, vc, cs, kn, vn, table, *short, num_splits=2, **FLAGS)
    assert torch.isnan(out[1]).all()
    assert_rel_close(out[0], want[0], TOL[q.dtype], what="out")


def test_auto_num_splits():
    """Few programs on a long cache split; many programs or short caches do not."""
    dev = torch.device(DEVICE)
    sms = K._dispatch.sm_count(dev)
    assert K.auto_num_splits(8, 128 * 1024, dev) > 1
    assert K.auto_num_splits(64 * sms, 32 * 1024, dev) == 1
    assert K.auto_num_splits(1, 100, dev) == 1
    assert K.auto_num_splits(1, 1 << 30, dev) <= K.MAX_SPLITS


@pytest.fixture
def triton_backend(force_backend):
    force_backend("triton")


def test_op_runs_the_kernels(triton_backend, force_backend):
    """flash.attention_decode takes the Triton path and matches the reference path."""
    from torch_flash import _dispatch
    inputs = make(2, 4, 2, 2, 2, 16, 16, 32, page=8, rotary_dim=16)
    q, kc, vc, cs, kn, vn, table, cos, sin = inputs
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kw = dict(causal=True, window=(5, -1), softcap=3.0, rotary_cos=cos, rotary_sin=sin)
    out, lse = attention_decode(q, kc, vc, cs, kn, vn, table, num_splits=2, **kw)
    assert _dispatch.LAST["attention_decode"] == "triton"
    force_backend("reference")
    want_out, want_lse = attention_decode(q, kc_ref, vc_ref, cs, kn, vn, table, **kw)
    assert _dispatch.LAST["attention_decode"] == "reference"
    assert_rel_close(out, want_out, TOL[torch.float32])
    torch.testing.assert_close(lse, want_lse)
    torch.testing.assert_close(kc, kc_ref)


def _bad_index_cases():
    q, kc, vc = (torch.randn(2, 4, 1, 16, device=DEVICE), torch.randn(2, 2, 8, 16, device=DEVICE),
                 torch.randn(2, 2, 8, 16, device=DEVICE))
    kn, vn = torch.randn(2, 2, 1, 16, device=DEVICE), torch.randn(2, 2, 1, 16, device=DEVICE)
    pool = torch.randn(5, 2, 4, 16, device=DEVICE)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)

    def cs(*v):
        return torch.tensor(v, dtype=torch.int32, device=DEVICE)
    return [
        # the cache is too short for the appended tokens
        (lambda: attention_decode(q, kc, vc, cs(3, 8), kn, vn), "exceeds the cache capacity 8"),
        (lambda: attention_decode(q, pool, pool, cs(4, 8), kn, vn, table), "exceeds the cache capacity 8"),
        # cache_seqlens beyond the cache, or negative
        (lambda: attention_decode(q, kc, vc, cs(3, 9)), "exceeds the cache capacity 8"),
        (lambda: attention_decode(q, kc, vc, cs(-2, 3)), "cache_seqlens must be >= 0"),
        # block table entries in use outside the pool (unused ones may be anything)
        (lambda: attention_decode(q, pool, pool, cs(2, 5), block_table=table.where(table != 3, 5)),
         "block_table entries in use must be in \\[0, 5\\)"),
        (lambda: attention_decode(q, pool, pool, cs(2, 3), kn, vn, table.where(table != 0, -1)),
         "block_table entries in use"),
    ]


@pytest.mark.skipif(DEVICE != "cpu", reason="index values are validated for CPU tensors only")
@pytest.mark.parametrize("case", range(len(_bad_index_cases())))
def test_bad_indices_raise_on_cpu(triton_backend, case):
    bad, match = _bad_index_cases()[case]
    with pytest.raises(ValueError, match=f"flash.attention_decode: .*{match}"):
        bad()


def test_unused_table_entries_may_be_anything(triton_backend):
    q, kc, vc, cs, kn, vn, table, cos, sin = make(2, 2, 1, 1, 1, 16, 16, 16, page=4, seqlens=[2, 6])
    assert (table == -1).any()
    attention_decode(q, kc, vc, cs, kn, vn, table)


# --------------------------------------------------------------------------------------
# GPU: realistic sizes, every autotune config, no host synchronisation, CUDA graphs
# --------------------------------------------------------------------------------------
GPU_CASES = [
    # (B, Hq, Hkv, Sq, Snew, D, S, dtype, make kwargs, flags)
    (4, 32, 8, 1, 1, 128, 4096, torch.bfloat16, dict(rotary_dim=128), {}),
    (2, 32, 8, 1, 1, 128, 8192, torch.bfloat16, dict(page=256, rotary_dim=64), {}),
    (3, 16, 2, 4, 4, 128, 2048, torch.float16, dict(page=64, flash_layout=True), dict(window_left=300)),
    (1, 8, 8, 1, 1, 64, 16384, torch.bfloat16, {}, dict(softcap=30.0)),
    (2, 16, 1, 2, 0, 256, 3000, torch.bfloat16, dict(page=100), dict(causal=False)),
    (2, 8, 2, 1, 1, 128, 1024, torch.float32, dict(page=16), {}),
]


@pytest.mark.cuda
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_gpu_grid(case):
    B, Hq, Hkv, Sq, Snew, D, S, dtype, make_kw, flags = GPU_CASES[case]
    for splits in (0, 1, 5):
        check(make(B, Hq, Hkv, Sq, Snew, D, D, S, dtype, **make_kw), splits, **flags)


@pytest.mark.cuda
@pytest.mark.parametrize("cls", list(K._CONFIGS))
def test_gpu_every_config(cls, monkeypatch):
    """Each autotune config of each tile class on its own (the tests otherwise run the first)."""
    dtype = torch.bfloat16 if cls == "narrow" else torch.float32
    inputs = make(2, 8, 2, 1, 1, 128, 128, 2048, dtype, page=32, rotary_dim=128)
    for config in K._CONFIGS[cls]:
        kernel = triton.autotune(configs=[config], key=K._KEY)(K._decode_kernel)
        monkeypatch.setitem(K._DECODE, cls, kernel)
        check(clone(inputs), 3)


@pytest.mark.cuda
def test_gpu_no_host_sync():
    """An eager call through the op never synchronises (cache_seqlens stays on the device)."""
    q, kc, vc, cs, kn, vn, table, cos, sin = make(2, 8, 2, 1, 1, 64, 64, 512, torch.bfloat16, page=64,
                                                  rotary_dim=64)
    attention_decode(q, kc, vc, cs, kn, vn, table, rotary_cos=cos, rotary_sin=sin)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        attention_decode(q, kc, vc, cs, kn, vn, table, rotary_cos=cos, rotary_sin=sin)
    finally:
        torch.cuda.set_sync_debug_mode("default")


class _Step(torch.nn.Module):
    """A decoding step over static caches held as buffers (as a model's KV cache)."""

    def __init__(self, kc, vc, cs, cos, sin):
        super().__init__()
        for name, t in dict(kc=kc, vc=vc, cs=cs, cos=cos, sin=sin).items():
            self.register_buffer(name, t)

    def forward(self, q, kn, vn):
        out, lse = attention_decode(q, self.kc, self.vc, self.cs, kn, vn, rotary_cos=self.cos,
                                    rotary_sin=self.sin)
        self.cs.add_(kn.shape[2])
        return out * 2, lse


@pytest.mark.cuda
def test_gpu_compile_reduce_overhead():
    """torch.compile(mode="reduce-overhead") captures the step in a CUDA graph (no skip: no host
    sync, mutated buffers only) and decodes the same tokens as eager calls."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    B, Hq, Hkv, D, S, steps = 2, 8, 2, 64, 256, 5
    _, kc, vc, cs, _, _, _, cos, sin = make(B, Hq, Hkv, 1, 1, D, D, S, torch.bfloat16, rotary_dim=D,
                                            seqlens=[5, 40])
    eager = _Step(kc.clone(), vc.clone(), cs.clone(), cos, sin)
    graphed = _Step(kc, vc, cs, cos, sin)
    step = torch.compile(graphed, mode="reduce-overhead", fullgraph=True)
    for _ in range(steps):
        q, kn, vn = (torch.randn(B, h, 1, D, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
        want = eager(q, kn, vn)
        torch.compiler.cudagraph_mark_step_begin()
        got = step(q, kn, vn)
        torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(graphed.kc, eager.kc)
    assert torch.equal(graphed.cs, eager.cs)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
