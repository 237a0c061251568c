"""The Hopper attention forward of csrc/attention (flash.attention_fwd_sm90, from torch_flash._C)
against a float64 reference and SDPA, and its place in flash.attention's dispatch.
Needs an sm_90 GPU and the built extension; on other machines the op's reference body is
covered by the opcheck samples in tests/ops/test_attention.py."""
import pytest
import torch

import torch_flash
from torch_flash import _dispatch, _extension
from torch_flash.reference import attention as ref
from _utils import rel_err

pytestmark = pytest.mark.cuda

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
        and _extension.loaded()):
    pytest.skip("needs an sm_90 GPU and torch_flash._C (python -m torch_flash build)",
                allow_module_level=True)

HDIMS = _extension.build_info()["hdims"]


def rand(b, h, s, d, dtype=torch.bfloat16, transposed=True):
    """Fresh inputs; transposed: a (B, S, H, D) buffer viewed as (B, H, S, D), as models do."""
    if transposed:
        return torch.randn(b, s, h, d, dtype=dtype, device="cuda").transpose(1, 2)
    return torch.randn(b, h, s, d, dtype=dtype, device="cuda")


def reference(q, k, v, scale, causal, sinks=None, alibi=None):
    """(out, lse) in float64 by the project's formula (causal bottom-right: flash.attention's)."""
    return ref.attention_with_lse(q.double(), k.double(), v.double(), scale=scale, causal=causal,
                                  sinks=None if sinks is None else sinks.double(), alibi_slopes=alibi)


def sdpa(q, k, v, scale, causal):
    """SDPA's answer (the baseline error), causal aligned bottom-right as flash.attention's."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    sq, sk = q.shape[2], k.shape[2]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq) if causal else None
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def check_forward(q, k, v, scale, causal, sinks=None, alibi=None):
    """The kernel's (out, lse) against float64, out's error within 1.25x SDPA's (on the problem
    without sinks, which SDPA has not: a sink scales each row's output by a factor <= 1); with
    ALiBi, which SDPA could take only as a bias rounded to q's dtype, within 1.25x the Triton
    kernels'."""
    inputs = [t for t in (q, k, v, sinks, alibi) if t is not None]
    before = [t.clone() for t in inputs]
    out, lse = torch.ops.flash.attention_fwd_sm90(q, k, v, scale, causal, sinks, alibi)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, inputs)), "inputs modified"
    ref_out, ref_lse = reference(q, k, v, scale, causal, sinks, alibi)
    assert out.shape == ref_out.shape and out.dtype == q.dtype and out.stride() == ref.layout_strides(q, out.shape)
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and torch.isfinite(lse).all()
    if alibi is None:
        sink_free = ref_out if sinks is None else reference(q, k, v, scale, causal)[0]
        base, peer = rel_err(sdpa(q, k, v, scale, causal), sink_free), "SDPA"
    else:
        with torch_flash.use_backend("triton"):
            theirs = torch_flash.attention(q, k, v, scale=scale, causal=causal, sinks=sinks, alibi_slopes=alibi)
        base, peer = rel_err(theirs, ref_out), "Triton"
    err = rel_err(out, ref_out)
    assert err <= 1e-2 and err <= 1.25 * base + 1e-4, f"out: {err:.2e} ({peer} {base:.2e})"
    assert rel_err(lse, ref_lse) <= 1e-5, f"lse: {rel_err(lse, ref_lse):.2e}"


@pytest.mark.parametrize("d", HDIMS)
@pytest.mark.parametrize("s", [128, 640, 1000, 2048])  # 1, 5, 8, 16 tiles of 128 rows; 1, 4, 6, 11 of 192
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grid_vs_fp64_and_sdpa(d, s, causal, dtype):
    q, k, v = (rand(2, 4, s, d, dtype) for _ in range(3))
    check_forward(q, k, v, d ** -0.5, causal)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("transposed", [False, True])
def test_gqa_layouts_and_scale(hq, hkv, transposed):
    d = HDIMS[0]
    q = rand(2, hq, 264, d, transposed=transposed)
    k, v = (rand(2, hkv, 264, d, transposed=transposed) for _ in range(2))
    check_forward(q, k, v, 0.37, True)


@pytest.mark.parametrize("sq,sk", [(8, 8), (16, 200), (200, 16), (136, 1000)])
def test_ragged_lengths(sq, sk):
    """Sq and Sk that are not multiples of the tiles (non-causal: any Sk, Sq % 8 == 0)."""
    d = HDIMS[-1]
    q, k, v = rand(3, 2, sq, d), rand(3, 2, sk, d), rand(3, 2, sk, d)
    check_forward(q, k, v, d ** -0.5, False)


@pytest.mark.parametrize("sq,sk", [(8, 40), (200, 264), (264, 300), (136, 1000), (1000, 1024)])
def test_causal_bottom_right(sq, sk):
    """Causal with fewer queries than keys: row i sees keys j <= i + Sk - Sq (flash.attention's
    alignment; SDPA's is_causal would align top-left). Three kv heads: with an odd count of
    query tiles (1 and 3 of 128 rows here) one unit of sm90::Paired holds a lone middle tile."""
    for d in HDIMS:
        q, k, v = rand(1, 6, sq, d), rand(1, 3, sk, d), rand(1, 3, sk, d)
        check_forward(q, k, v, d ** -0.5, True)


@pytest.mark.parametrize("sk,causal", [(2048, False), (1000, False), (2048, True)])
def test_rows_whose_maximum_climbs(sk, causal):
    """Scores that climb along the keys, by steps below and above the softmax's rescaling
    threshold (2^8 in exp2 units: attention_fwd_sm90_softmax.cuh), within and across key tiles,
    in rows that climb at different rates or fall: every row's output and lse still match."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for d in HDIMS:
        u = torch.nn.functional.normalize(torch.randn(d, device="cuda", generator=g), dim=0)
        # key j's score in a row of unit rate: a ramp with jumps of 1 to 40 (log2 units x 0.69)
        steps = torch.rand(sk, device="cuda", generator=g) * 0.02
        steps[torch.randint(0, sk, (12,), device="cuda", generator=g)] = torch.tensor(
            [1., 3., 5., 6., 7., 9., 12., 20., 40., 2., 4., 8.], device="cuda")
        climb = steps.cumsum(0)
        climb = climb - climb.max() + 12  # the highest scores near 12
        rate = torch.rand(2, 4, sk, 1, device="cuda", generator=g) * 1.5 - 0.3  # some rows fall
        noise = lambda *shape: torch.randn(*shape, device="cuda", generator=g) * 0.3
        q = (rate * u * d ** 0.5 + noise(2, 4, sk, d)).bfloat16()
        k = (climb[:, None] * u + noise(2, 4, sk, d)).bfloat16()
        v = torch.randn(2, 4, sk, d, device="cuda", generator=g).bfloat16()
        check_forward(q, k, v, d ** -0.5, causal)


def cutlass_launches(fn) -> int:
    """How many CUTLASS kernels fn launches (torch.profiler's CUDA activity)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "device_kernel" in e.name)


@pytest.mark.parametrize("d,sq,sk", [(64, 2048, 2048), (64, 4096, 4096), (128, 2056, 2056), (64, 2056, 3000),
                                     (256, 2104, 2104), (128, 2048, 2048)])
def test_causal_row_split(d, sq, sk):
    """From 2048 queries a causal problem whose rows end in a partial query tile (192 rows at
    D=64 from 2k keys, else 128) runs those rows first as a launch of their own
    (attention_fwd_sm90.cuh, causal_rows): the same numerics, two launches (one where the
    tiles are whole: D=128, 2048)."""
    if d not in HDIMS:
        pytest.skip(f"head dim {d} not built")
    q, k, v = rand(1, 4, sq, d), rand(1, 2, sk, d), rand(1, 2, sk, d)
    check_forward(q, k, v, d ** -0.5, True)
    whole = sq % (192 if d == 64 else 128) == 0
    per_member = 1 if whole else 2
    assert cutlass_launches(lambda: torch.ops.flash.attention_fwd_sm90(q, k, v, 0.1, True)) == 2 * per_member


def sinks_for(heads: int, dtype=torch.float32):
    """Sink logits (heads,) of every size: none (-inf), small, about a row's lse, dominant."""
    sinks = torch.randn(heads, device="cuda") * 4
    sinks[0] = -float("inf")
    sinks[-1] = 12.0
    return sinks.to(dtype)


@pytest.mark.parametrize("d", HDIMS)
@pytest.mark.parametrize("sq,sk,hq,hkv,causal", [
    (1000, 1000, 4, 4, False), (200, 264, 8, 2, True), (2056, 2056, 4, 2, True), (136, 1000, 6, 3, False)])
def test_sinks_in_the_epilogue(d, sq, sk, hq, hkv, causal):
    """Sinks (Hq,) applied in the epilogue: each GQA group member's launch reads its heads' sinks
    (heads g, g + G, ...), causal with its row split (2056), partial tiles; fp32 and bf16 sinks."""
    q, k, v = rand(2, hq, sq, d), rand(2, hkv, sk, d), rand(2, hkv, sk, d)
    check_forward(q, k, v, d ** -0.5, causal, sinks_for(hq))
    check_forward(q, k, v, d ** -0.5, causal, sinks_for(hq, torch.bfloat16))


def alibi_for(batch: int, heads: int, per_batch: bool) -> torch.Tensor:
    """ALiBi slopes fp32: the geometric ones of the ALiBi paper, 2^(-8 h / H) for h = 1..H, as
    (H,), or (B, H) scaled differently per batch element."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)
    return slopes * torch.rand(batch, 1, device="cuda") * 2 if per_batch else slopes


@pytest.mark.parametrize("d", HDIMS)
@pytest.mark.parametrize("sq,sk,hq,hkv,causal", [
    (1000, 1000, 4, 4, False), (200, 264, 8, 2, True), (2056, 2056, 4, 2, True), (136, 1000, 6, 3, False),
    (1000, 4096, 2, 2, False)])
@pytest.mark.parametrize("per_batch", [False, True], ids=["per-head", "per-batch"])
def test_alibi_in_the_softmax(d, sq, sk, hq, hkv, causal, per_batch):
    """ALiBi slopes (H,) or (B, H), bottom-right distances with Sq != Sk both ways: each GQA group
    member's launch reads its heads' slopes (heads g, g + G, ...), causal with its row split
    (2056) and partial tiles; a long key sequence (4096) that, without ALiBi, would split its
    last round by keys; with sinks too."""
    q, k, v = rand(2, hq, sq, d), rand(2, hkv, sk, d), rand(2, hkv, sk, d)
    slopes = alibi_for(2, hq, per_batch)
    check_forward(q, k, v, d ** -0.5, causal, alibi=slopes)
    check_forward(q, k, v, d ** -0.5, causal, sinks_for(hq), slopes)


def test_alibi_dispatch_and_backward():
    """flash.attention with ALiBi runs this kernel forward; the backward (csrc's where it serves
    the head dim, else Triton's) reads its lse, ALiBi included: gradients against float64."""
    d = HDIMS[0]
    q, k, v = (rand(2, 4, 512, d) for _ in range(3))
    slopes = alibi_for(2, 4, False)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = torch_flash.attention(*leaves, causal=True, alibi_slopes=slopes)
    assert _dispatch.LAST["attention_with_lse"] == "cuda"
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference(*ref_leaves, d ** -0.5, True, alibi=slopes)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    assert rel_err(out, ref_out) <= 1e-2
    for name, g, r in zip("qkv", grads, ref_grads):
        assert rel_err(g, r) <= 1e-2, f"d{name}: {rel_err(g, r):.2e}"


def split_tail_heads(m_blocks: int, key_tiles: int) -> int:
    """A number of (batch x kv head) problems whose persistent launch of m_blocks query tiles
    each ends in a short round that the kernel splits (attention_fwd_sm90.cuh, TailSplit:
    r = tiles % SMs left over, r <= m_blocks, a divisor of the key tiles >= 4 and <= SMs // r)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for heads in range(-(-sms // m_blocks), 4 * sms):
        rest = m_blocks * heads % sms
        if 0 < rest <= m_blocks and any(key_tiles % n == 0 for n in range(4, min(key_tiles, sms // rest) + 1)):
            return heads
    raise AssertionError("no such head count")


def allocations(fn):
    """How many CUDA allocations fn makes (the op's out and lse, and the split tail's scratch)."""
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    fn()
    return torch.cuda.memory_stats()["allocation.all.allocated"] - before


@pytest.mark.skipif(128 not in HDIMS, reason="head dim 128 not built")
@pytest.mark.parametrize("sq,sk,group", [(2048, 2048, 1), (1000, 4096, 1), (2048, 2048, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_tail_vs_fp64_and_sdpa(sq, sk, group, dtype):
    """Shapes whose last round of query tiles runs as key splits merged by a second kernel
    (rows of the last (batch, head), Sq a partial tile or not, GQA launching per group member):
    the same numerics as everywhere, and the split really taken (one scratch allocation per
    launch besides out and lse); causal never splits."""
    heads = split_tail_heads(-(-sq // 128), sk // 128)
    q = rand(1, heads * group, sq, 128, dtype)
    k, v = rand(1, heads, sk, 128, dtype), rand(1, heads, sk, 128, dtype)
    check_forward(q, k, v, 128 ** -0.5, False)
    check_forward(q, k, v, 128 ** -0.5, False, sinks_for(heads * group))  # merge_splits adds the sink
    assert allocations(lambda: torch.ops.flash.attention_fwd_sm90(q, k, v, 0.1, False)) == 2 + group
    if sq == sk:
        assert allocations(lambda: torch.ops.flash.attention_fwd_sm90(q, k, v, 0.1, True)) == 2


def test_flash_attention_dispatch_and_backward():
    """flash.attention runs this kernel where it serves the call (Triton elsewhere) and its
    backward consumes the lse written here."""
    d = HDIMS[0]
    q, k, v = (rand(2, 4, 512, d) for _ in range(3))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = torch_flash.attention(*leaves, causal=True)
    assert _dispatch.LAST["attention_with_lse"] == "cuda"
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference(*ref_leaves, d ** -0.5, True)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    assert rel_err(out, ref_out) <= 1e-2
    for name, g, r in zip("qkv", grads, ref_grads):
        assert rel_err(g, r) <= 1e-2, f"d{name}: {rel_err(g, r):.2e}"


@pytest.mark.parametrize("case", ["bias", "window", "softcap", "causal_sq_gt_sk", "sq_not_8", "fp32", "dv"])
def test_dispatch_falls_back_to_triton(case):
    d = HDIMS[0]
    sq, sk, dtype, dv = 512, 512, torch.bfloat16, d
    kw = {}
    if case == "causal_sq_gt_sk":
        sk, kw = 256, dict(causal=True)
    elif case == "sq_not_8":
        sq = 509
    elif case == "fp32":
        dtype = torch.float32
    elif case == "dv":
        dv = d // 2
    q, k, v = rand(1, 2, sq, d, dtype), rand(1, 2, sk, d, dtype), rand(1, 2, sk, dv, dtype)
    if case == "bias":
        kw = dict(attn_bias=torch.randn(sq, sk, device="cuda", dtype=dtype))
    elif case == "window":
        kw = dict(window=(64, 0))
    elif case == "softcap":
        kw = dict(softcap=20.0)
    torch_flash.attention(q, k, v, **kw)
    assert _dispatch.LAST["attention"] == "triton"


def test_dispatch_picks_the_kernel():
    q, k, v = (rand(1, 2, 512, HDIMS[0]) for _ in range(3))
    torch_flash.attention(q, k, v)
    assert _dispatch.LAST["attention"] == "cuda"
    torch_flash.attention(q[:, :, :256], k, v, causal=True)
    assert _dispatch.LAST["attention"] == "cuda"


def test_compile_fullgraph_uses_the_kernel():
    d = HDIMS[0]
    q, k, v = (rand(2, 4, 256, d) for _ in range(3))
    fn = torch.compile(lambda q, k, v: torch_flash.attention(q, k, v, causal=True), fullgraph=True)
    eager = torch_flash.attention(q, k, v, causal=True)
    assert _dispatch.LAST["attention"] == "cuda"
    torch.testing.assert_close(fn(q, k, v), eager, rtol=0, atol=0)


def test_cuda_graph_capture():
    d = HDIMS[0]
    q, k, v = (rand(2, 4, 256, d) for _ in range(3))
    expected = torch.ops.flash.attention_fwd_sm90(q, k, v, 0.125, False)[0]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.ops.flash.attention_fwd_sm90(q, k, v, 0.125, False)  # warm up off the capture
        with torch.cuda.graph(graph, stream=stream):
            out = torch.ops.flash.attention_fwd_sm90(q, k, v, 0.125, False)[0]
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("bad,match", [
    (lambda q, k, v: (q.float(), k.float(), v.float()), "float16 or bfloat16"),
    (lambda q, k, v: (q[:, :, :-3], k, v), "multiple of 8"),
    (lambda q, k, v: (q, k[:, :, 1:], v), "differ in heads or keys"),
    (lambda q, k, v: (q.cpu(), k, v), "CUDA tensor"),
    (lambda q, k, v: (q, k[..., :32], v), "head dims differ"),
    (lambda q, k, v: (torch.empty(q.numel() + 4, dtype=q.dtype, device="cuda")[4:].view(q.shape), k, v),
     "16-byte aligned"),
])
def test_bad_inputs_raise(bad, match):
    """Called directly, the C++ kernel checks its inputs: an error naming the op, never a crash."""
    q, k, v = (rand(1, 2, 64, HDIMS[0], transposed=False) for _ in range(3))
    with pytest.raises(RuntimeError, match=match):
        torch.ops.flash.attention_fwd_sm90(*bad(q, k, v), 0.125, False)
    torch.cuda.synchronize()  # and the device is still fine


@pytest.mark.parametrize("sinks,match", [
    (lambda: torch.zeros(3, device="cuda"), r"sinks must be \(Hq,\) = \(2,\), got \(3\)"),
    (lambda: torch.zeros(2), "sinks is on cpu"),
    (lambda: torch.zeros(2, dtype=torch.int32, device="cuda"), "sinks must be floating point"),
])
def test_bad_sinks_raise(sinks, match):
    q, k, v = (rand(1, 2, 64, HDIMS[0], transposed=False) for _ in range(3))
    with pytest.raises(RuntimeError, match=match):
        torch.ops.flash.attention_fwd_sm90(q, k, v, 0.125, False, sinks())
    torch.cuda.synchronize()


@pytest.mark.parametrize("slopes,match", [
    (lambda: torch.zeros(3, device="cuda"), r"alibi_slopes must be \(Hq,\) = \(2,\) or \(B, Hq\) = \(1, 2\), got \(3\)"),
    (lambda: torch.zeros(2, 2, device="cuda"), r"alibi_slopes must be \(Hq,\) .* got \(2, 2\)"),
    (lambda: torch.zeros(2), "alibi_slopes is on cpu"),
    (lambda: torch.zeros(2, dtype=torch.float16, device="cuda"), "alibi_slopes must be float32"),
])
def test_bad_alibi_raise(slopes, match):
    q, k, v = (rand(1, 2, 64, HDIMS[0], transposed=False) for _ in range(3))
    with pytest.raises(RuntimeError, match=match):
        torch.ops.flash.attention_fwd_sm90(q, k, v, 0.125, False, None, slopes())
    torch.cuda.synchronize()
