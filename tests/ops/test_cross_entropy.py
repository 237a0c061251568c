"""flash.cross_entropy: opcheck, gradcheck, numerics vs F.cross_entropy and a float64 formula,
chunking, bad inputs, empty batch, inputs untouched; inplace_backward (results, layouts,
rejections, torch.compile, measured allocations) and the per-shard ops of the vocab-parallel
mode (tests/ops/test_cross_entropy_vocab_parallel.py runs the mode itself over two processes)."""
import collections

import pytest
import torch
import torch.nn.functional as F
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import torch_flash  # noqa: F401  (registers the ops)
from torch_flash.ops import cross_entropy as ops_ce
from torch_flash.ops.cross_entropy import cross_entropy
from torch_flash.reference import cross_entropy as ref
from torch_flash.testing.samples.cross_entropy import (DTYPES, OPTIONS, REDUCTIONS, make_logits, make_target,
                                                      naive_loss)
from _utils import TOL, assert_rel_close, rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels' device (CPU: interpreter)


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
def test_gradcheck(opts):
    x = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    t = make_target((2, 3), 7, opts.get("ignore_index", -100))
    for reduction in REDUCTIONS:
        assert torch.autograd.gradcheck(lambda a: cross_entropy(a, t, reduction=reduction, **opts), (x,))


def test_gradcheck_across_chunks(monkeypatch):
    monkeypatch.setattr(ref, "CHUNK_BYTES", 2 * 9 * 8)  # 2 rows of fp64 per chunk
    x = torch.randn(7, 9, dtype=torch.float64, requires_grad=True)
    t = make_target((7,), 9, OPTIONS[-1]["ignore_index"])
    assert torch.autograd.gradcheck(lambda a: cross_entropy(a, t, **OPTIONS[-1]), (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
def test_matches_torch(dtype, reduction, label_smoothing):
    x = make_logits((4, 5, 33), dtype)
    t = make_target((4, 5), 33)
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = cross_entropy(mine, t, label_smoothing=label_smoothing, reduction=reduction)
    expect = F.cross_entropy(theirs.flatten(0, 1), t.flatten(), label_smoothing=label_smoothing,
                             reduction=reduction).reshape(out.shape)
    torch.testing.assert_close(out, expect)
    grad = torch.randn_like(out)
    out.backward(grad)
    expect.backward(grad)
    torch.testing.assert_close(mine.grad, theirs.grad)


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_numerics_vs_float64(opts, dtype):
    x = make_logits((3, 6, 50), dtype)
    t = make_target((3, 6), 50, opts.get("ignore_index", -100))
    leaf, leaf64 = x.clone().requires_grad_(), x.double().requires_grad_()
    out = cross_entropy(leaf, t, reduction="none", **opts)
    exact = naive_loss(leaf64, t, reduction="none", **opts)
    assert out.dtype == (torch.float32 if dtype != torch.float64 else dtype)
    assert_rel_close(out, exact, TOL[torch.float32])  # fp32 math whatever the input dtype
    grad = torch.rand_like(out)
    out.backward(grad)
    exact.backward(grad.double())
    assert leaf.grad.dtype == dtype
    assert_rel_close(leaf.grad, leaf64.grad, what="dlogits")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_no_worse_than_torch(dtype):
    x = make_logits((64, 1000), dtype)
    t = make_target((64,), 1000)
    exact_in = x.double().requires_grad_()
    exact = F.cross_entropy(exact_in, t, reduction="none", label_smoothing=0.1)
    exact.sum().backward()
    errs = {}
    for name, fn in (("flash", cross_entropy), ("torch", F.cross_entropy)):
        leaf = x.clone().requires_grad_()
        out = fn(leaf, t, reduction="none", label_smoothing=0.1)
        out.sum().backward()
        errs[name] = rel_err(out, exact), rel_err(leaf.grad, exact_in.grad)
        assert not torch.isnan(out).any() and not torch.isnan(leaf.grad).any()
    assert errs["flash"][0] <= errs["torch"][0] and errs["flash"][1] <= errs["torch"][1], errs
    assert errs["flash"][1] <= TOL[dtype]


def test_chunked_equals_whole(monkeypatch):
    x = make_logits((10, 3, 21), rg=True)
    opts = OPTIONS[-1]
    t = make_target((10, 3), 21, opts["ignore_index"])
    whole = cross_entropy(x, t, reduction="none", **opts)
    (dwhole,) = torch.autograd.grad(whole.sum(), x)
    monkeypatch.setattr(ref, "CHUNK_BYTES", 4 * 21 * 4)  # 4 rows of fp32
    seen = []
    for name in ("row_losses", "row_grads"):
        fn = getattr(ref, name)
        monkeypatch.setattr(ref, name, lambda logits, *a, fn=fn: seen.append(logits.shape) or fn(logits, *a))
    chunked = cross_entropy(x, t, reduction="none", **opts)
    (dchunked,) = torch.autograd.grad(chunked.sum(), x)
    assert seen and max(s[0] for s in seen) == 4 and len(seen) == 2 * 8  # 30 rows -> 8 chunks, twice
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(dchunked, dwhole)


def test_chunk_budget_for_huge_vocab():
    for n_classes in (262144, 1 << 20):
        for dtype in DTYPES:
            rows = ref.rows_per_chunk(n_classes, dtype)
            assert rows >= 1 and rows * n_classes * 4 <= ref.CHUNK_BYTES
    assert ref.rows_per_chunk(262144, torch.float32, chunk_size=3) == 3


def test_vocab_256k():
    x = make_logits((3, 262147), torch.bfloat16, rg=True)
    t = torch.tensor([5, 262146, -100])
    out = cross_entropy(x, t, reduction="sum", z_loss=1e-4)
    out.backward()
    exact_in = x.detach().double().requires_grad_()
    exact = naive_loss(exact_in, t, reduction="sum", z_loss=1e-4)
    exact.backward()
    assert_rel_close(out, exact, TOL[torch.float32])
    assert_rel_close(x.grad, exact_in.grad, TOL[torch.bfloat16], what="dlogits")


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_all_ignored_like_torch(label_smoothing):
    """reduction="mean" over no valid rows is nan with zero gradients, as F.cross_entropy."""
    x = make_logits((4, 9), rg=True)
    t = torch.full((4,), -100)
    out = cross_entropy(x, t, label_smoothing=label_smoothing)
    assert torch.isnan(out) and torch.isnan(F.cross_entropy(x, t, label_smoothing=label_smoothing))
    out.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert cross_entropy(x, t, reduction="sum") == 0


def _bad_ce(logits=None, target=None, **kw):
    logits = torch.randn(4, 10) if logits is None else logits
    target = torch.randint(0, 10, (4,)) if target is None else target
    return lambda: cross_entropy(logits, target, **kw)


@pytest.mark.parametrize("bad,match", [
    (_bad_ce(target=torch.zeros(5, dtype=torch.long)), "target shape"),
    (_bad_ce(logits=torch.randn(2, 3, 10), target=torch.zeros(3, 2, dtype=torch.long)), "target shape"),
    (_bad_ce(target=torch.zeros(4)), "target has dtype"),
    (_bad_ce(logits=torch.randint(0, 3, (4, 10))), "logits has dtype"),
    (_bad_ce(logits=torch.randn(())), "logits must have at least 1 dimensions"),
    (_bad_ce(logits=torch.randn(4, 0)), "non-empty last"),
    (_bad_ce(target=torch.tensor([0, 1, 10, 2])), "target contains 10, outside \\[0, 10\\)"),
    (_bad_ce(target=torch.tensor([0, -1, 3, 2])), "target contains -1"),
    (_bad_ce(target=torch.tensor([0, -100, 3, 2]), ignore_index=-1), "target contains -100"),
    # torch compares an int32 tensor with the scalar wrapped to int32: 2**40 would ignore class 0
    (_bad_ce(target=torch.tensor([0, 1, 3, 2], dtype=torch.int32), ignore_index=2**40),
     "ignore_index=1099511627776 does not fit target's dtype torch.int32"),
    (_bad_ce(reduction="avg"), "reduction must be one of"),
    (_bad_ce(label_smoothing=1.5), "label_smoothing must be in \\[0, 1\\]"),
    (_bad_ce(z_loss=-1.0), "z_loss must be >= 0"),
    (_bad_ce(softcap=-2.0), "softcap must be >= 0"),
    (lambda: torch.ops.flash.cross_entropy_backward(torch.randn(4), torch.randn(4, 10),
                                                    torch.zeros(4, dtype=torch.long)), "grad_loss has shape"),
    # a grad_loss on another device was read as garbage (meta here; a CPU scalar for CUDA logits
    # is a host pointer handed to the kernel)
    (lambda: torch.ops.flash.cross_entropy_backward(torch.ones((), device="meta"), torch.randn(4, 10),
                                                    torch.zeros(4, dtype=torch.long)), "one device, got .*grad_loss on meta"),
    (lambda: torch.ops.flash.cross_entropy_backward(torch.randn(()), torch.randn(4, 10), torch.zeros(4, dtype=torch.long),
                                                    torch.randn(3)), "lse has shape \\(3,\\), expected target's shape \\(4,\\)"),
    (lambda: torch.ops.flash.cross_entropy_backward(torch.randn(()), torch.randn(4, 10), torch.zeros(4, dtype=torch.long),
                                                    vocab_start=10, vocab_size=30), "lse .*is required for a vocabulary shard"),
    (lambda: torch.ops.flash.cross_entropy_shard_stats(torch.randn(4, 10), torch.zeros(4, dtype=torch.long),
                                                       vocab_start=25, vocab_size=30), "classes \\[25, 35\\), beyond vocab_size=30"),
    (lambda: torch.ops.flash.cross_entropy_shard_stats(torch.randn(4, 10), torch.zeros(4, dtype=torch.long),
                                                       vocab_start=10), "vocab_start=10 needs vocab_size"),
    (lambda: torch.ops.flash.cross_entropy_shard_stats(torch.randn(4, 10), torch.zeros(4, dtype=torch.long),
                                                       vocab_start=-1, vocab_size=30), "vocab_start must be >= 0"),
    (lambda: torch.ops.flash.cross_entropy_shard_stats(torch.randn(4, 10), torch.tensor([0, 29, 30, 5]),
                                                       vocab_start=10, vocab_size=30), "target contains 30, outside \\[0, 30\\)"),
    (_bad_ce(logits=torch.randn(4, 20)[:, ::2], inplace_backward=True), "inplace_backward=True writes the gradient over"),
    (lambda: torch.ops.flash.cross_entropy_backward_inplace(torch.randn(()), torch.randn(1, 10).expand(4, 10),
                                                            torch.zeros(4, dtype=torch.long)), "non-overlapping rows"),
])
def test_bad_inputs(bad, match):
    with pytest.raises(ValueError, match=f"flash.cross_entropy(_[a-z_]+)?: .*{match}"):
        bad()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_bad_target_values_raise_on_every_op(device):
    """Out-of-range targets raise naming the op on every op that reads them (on CUDA the check
    runs behind the kernels, which make such rows NaN, and may raise at the next
    torch_flash.synchronize()), and the in-place backward raises before it writes over the
    logits."""
    x = torch.randn(4, 10, device=device)
    t = torch.tensor([0, 3, 10, 1], device=device)
    one = torch.ones((), device=device)
    keep = x.clone()
    calls = {"cross_entropy": lambda: torch.ops.flash.cross_entropy(x, t),
             "cross_entropy_with_lse": lambda: torch.ops.flash.cross_entropy_with_lse(x, t),
             "cross_entropy_backward": lambda: torch.ops.flash.cross_entropy_backward(one, x, t),
             "cross_entropy_backward_inplace": lambda: torch.ops.flash.cross_entropy_backward_inplace(one, x, t),
             "cross_entropy_shard_stats": lambda: torch.ops.flash.cross_entropy_shard_stats(x, t)}
    for op, call in calls.items():
        with pytest.raises(ValueError, match=f"flash.{op}: target contains 10, outside \\[0, 10\\)"):
            call()
            torch_flash.synchronize()
    assert torch.equal(x, keep)


def test_late_target_verdict_raises_at_the_next_call(monkeypatch):
    """A verdict still on its way when the op returns (CUDA) is kept and raised by the next
    loss call once it has arrived, or by torch_flash.synchronize(); good ones are dropped."""
    class Event:  # a CUDA event, told on CPU whether it has completed
        done = False

        def query(self):
            return Event.done

        def synchronize(self):
            Event.done = True

    def check(target):
        c = ops_ce.TargetCheck("cross_entropy", torch.tensor(target), 10, -100)
        c.event = Event()
        c.raise_if_bad(wait=False)
        return c

    monkeypatch.setattr(ops_ce, "_PENDING", collections.deque())
    monkeypatch.setattr(ops_ce, "_FREE_EVENTS", {})
    check([1, 2])
    check([3, 11])  # pending: returns without raising
    assert len(ops_ce._PENDING) == 2
    check([4, 5])  # nothing has arrived yet
    Event.done = True
    with pytest.raises(ValueError, match="flash.cross_entropy: target contains 11, .*after the call returned"):
        cross_entropy(torch.randn(2, 10), torch.tensor([1, 2]))
    assert len(ops_ce._PENDING) == 1  # the good one behind it waits for the next call
    Event.done = False
    check([12, 1])
    with pytest.raises(ValueError, match="target contains 12"):
        torch_flash.synchronize()
    assert not ops_ce._PENDING


@pytest.mark.cuda
def test_cuda_bad_target_compiled_never_silent():
    """Compiled, the host check cannot run where Inductor calls the Triton kernels itself: the
    call raises, or its loss and gradient are NaN (the kernel's signal), never a finite answer."""
    x = torch.randn(4, 10, device="cuda", requires_grad=True)
    t = torch.tensor([0, 3, 10, 1], device="cuda")
    torch._dynamo.reset()
    try:
        loss = torch.compile(lambda x, t: cross_entropy(x * 2, t), fullgraph=True)(x, t)
        loss.backward()
    except ValueError as e:
        assert "target contains 10" in str(e)
    else:
        assert loss.isnan() and x.grad[2].isnan().all()


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_batch(reduction):
    x = torch.randn(0, 3, 16, requires_grad=True)
    t = torch.zeros(0, 3, dtype=torch.long)
    out = cross_entropy(x, t, reduction=reduction)
    expect = F.cross_entropy(x.reshape(0, 16), t.reshape(0), reduction=reduction).reshape(out.shape)
    torch.testing.assert_close(out, expect, equal_nan=True)
    out.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_inputs_untouched(softcap):
    x, t = torch.randn(5, 12, requires_grad=True), make_target((5,), 12)
    copies = x.detach().clone(), t.clone()
    cross_entropy(x, t, softcap=softcap, z_loss=1e-2, label_smoothing=0.1).backward()
    assert torch.equal(x.detach(), copies[0]) and torch.equal(t, copies[1])


def test_with_lse_and_saved_lse_backward():
    """cross_entropy_with_lse's lse is each row's logsumexp (0 on ignored rows); the backward
    gives the same gradient from it as when it recomputes it."""
    x, t = make_logits((4, 3, 29), torch.float64), make_target((4, 3), 29, -100)
    loss, lse = torch.ops.flash.cross_entropy_with_lse(x, t, softcap=4.0, z_loss=1e-2)
    valid = t != -100
    want = (4.0 * torch.tanh(x / 4.0)).logsumexp(-1)
    torch.testing.assert_close(lse, torch.where(valid, want, 0.0))
    torch.testing.assert_close(loss, torch_flash.cross_entropy(x, t, softcap=4.0, z_loss=1e-2))
    g = torch.randn(())
    saved = torch.ops.flash.cross_entropy_backward(g, x, t, lse, softcap=4.0, z_loss=1e-2)
    recomputed = torch.ops.flash.cross_entropy_backward(g, x, t, softcap=4.0, z_loss=1e-2)
    torch.testing.assert_close(saved, recomputed)


# --------------------------------------------------------------------------------------
# inplace_backward
# --------------------------------------------------------------------------------------
def _producer(batch, n_classes, dtype=torch.float32, device="cpu"):
    """A leaf that requires grad and the logits computed from it (an intermediate, as a model's
    lm-head output is; doubling is exact): (leaf, logits)."""
    leaf = make_logits((*batch, n_classes), dtype).to(device).requires_grad_()
    return leaf, leaf * 2


def _grad_like(out):
    return torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(0)).to(out.device)


def _both_ways(logits_fn, t, **kw):
    """(loss, dleaf, dlogits) without and with inplace_backward; each from fresh logits of
    logits_fn() -> (leaf, logits). dlogits is the gradient reaching the logits."""
    results = []
    for inplace in (False, True):
        leaf, logits = logits_fn()
        logits.retain_grad()
        loss = cross_entropy(logits, t, inplace_backward=inplace, **kw)
        loss.backward(_grad_like(loss))
        if inplace:  # the gradient now lives in the logits' memory
            assert torch.equal(logits, logits.grad)
        results.append((loss.detach(), leaf.grad, logits.grad))
    return results


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("opts", [OPTIONS[0], OPTIONS[-1]], ids=["plain", "all"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_inplace_backward_matches(force_backend, backend, opts, reduction):
    """Same loss and gradients as the out-of-place backward, on the CPU path and the Triton
    kernels (under the interpreter here), the gradient written over the logits."""
    force_backend(backend)
    dtype = torch.float32 if backend == "reference" else torch.bfloat16
    device = DEV if backend == "triton" else "cpu"
    t = make_target((3, 4), 70, opts.get("ignore_index", -100))
    seed = torch.seed()

    def make(device=device):
        torch.manual_seed(seed)
        return _producer((3, 4), 70, dtype, device)

    (loss, dleaf, dlogits), (loss_i, dleaf_i, dlogits_i) = _both_ways(make, t.to(device), reduction=reduction, **opts)
    assert torch.equal(loss, loss_i) and torch.equal(dleaf, dleaf_i) and torch.equal(dlogits, dlogits_i)
    leaf64 = make("cpu")[0].detach().double().requires_grad_()
    exact = naive_loss(leaf64 * 2, t, reduction=reduction, **opts)
    exact.backward(_grad_like(exact))
    assert_rel_close(loss_i, exact, TOL[torch.float32])
    assert_rel_close(dleaf_i, leaf64.grad, TOL[dtype], what="dleaf")


def test_inplace_backward_row_strided_view():
    """logits viewed out of a wider intermediate (rows 2V apart, a batch dim): written in place,
    the rest of the buffer untouched."""
    t = make_target((2, 3), 20)
    x = make_logits((2, 3, 40))
    leaves = [x.clone().requires_grad_() for _ in range(2)]
    wide = [leaf * 2 for leaf in leaves]
    made = iter(zip(leaves, (w[..., 10:30] for w in wide)))
    (_, dleaf, dlogits), (_, dleaf_i, dlogits_i) = _both_ways(lambda: next(made), t, label_smoothing=0.1)
    torch.testing.assert_close(dleaf_i, dleaf)
    torch.testing.assert_close(dlogits_i, dlogits)
    assert torch.equal(wide[1][..., 10:30], dlogits)
    for cols in (slice(0, 10), slice(30, 40)):
        assert torch.equal(wide[1][..., cols], wide[0][..., cols])


def test_inplace_backward_rejects_leaves_and_layouts():
    leaf = make_logits((4, 10), rg=True)
    t = make_target((4,), 10)
    with pytest.raises(ValueError, match="flash.cross_entropy: .*logits is a leaf tensor that requires grad"):
        cross_entropy(leaf, t, inplace_backward=True)
    with pytest.raises(ValueError, match="flash.cross_entropy: .*a leaf tensor that requires grad \\(or a view of one\\)"):
        cross_entropy(leaf[1:], t[1:], inplace_backward=True)
    with pytest.raises(ValueError, match="flash.cross_entropy: inplace_backward=True writes the gradient over logits"):
        cross_entropy((leaf * 2).t(), make_target((10,), 4), inplace_backward=True)  # columns 10 apart
    with pytest.raises(ValueError, match="non-overlapping rows"):
        cross_entropy((leaf[:1] * 2).expand(4, 10), t, inplace_backward=True)
    # without a backward, nothing is overwritten: a leaf is fine
    before = leaf.detach().clone()
    with torch.no_grad():
        cross_entropy(leaf, t, inplace_backward=True)
    cross_entropy(leaf.detach(), t, inplace_backward=True)
    assert torch.equal(leaf, before)


@pytest.mark.parametrize("view", [False, True], ids=["leaf", "view-of-leaf"])
def test_inplace_backward_rejects_leaves_under_compile(view):
    """torch.compile refuses a leaf that requires grad (or a view of one) as eager does; it used
    to overwrite the leaf, a parameter say, with its gradient silently."""
    leaf = make_logits((6, 10) if view else (4, 10), rg=True)
    before = leaf.detach().clone()
    t = make_target((4,), 10)
    compiled = torch.compile(lambda x: cross_entropy(x, t, inplace_backward=True), backend="aot_eager",
                             fullgraph=True)
    with pytest.raises(RuntimeError, match="flash.cross_entropy: .*logits is a leaf tensor that requires grad"):
        compiled(leaf[1:5] if view else leaf).backward()
    assert torch.equal(leaf.detach(), before)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("inplace", [False, True])
def test_create_graph_second_derivative_raises(force_backend, backend, inplace):
    """create_graph=True: the gradient is right and not differentiable again, so a second
    derivative raises naming the backward op; with inplace_backward it came out silently wrong
    (autograd took the overwritten logits for the logits, history and all)."""
    force_backend(backend)
    leaf, logits = _producer((4,), 10, device=DEV if backend == "triton" else "cpu")
    t = make_target((4,), 10).to(leaf.device)
    (got,) = torch.autograd.grad(cross_entropy(logits, t, inplace_backward=inplace), leaf, create_graph=True)
    leaf64 = leaf.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(naive_loss(leaf64 * 2, t), leaf64)
    assert_rel_close(got, want, TOL[torch.float32], what="dleaf")
    with pytest.raises(RuntimeError, match="flash.cross_entropy_backward"):
        torch.autograd.grad(got.square().sum() + leaf.sum(), leaf)


def test_inplace_backward_detects_logits_needed_later():
    """An op that saved the logits for its own backward sees them overwritten: PyTorch's
    version-counter error, never a wrong gradient."""
    x = make_logits((4, 10), rg=True)
    logits = x.exp()  # exp saves its output, the logits
    loss = cross_entropy(logits, make_target((4,), 10), inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _peak_allocated(fn) -> int:
    """Peak bytes the CPU allocator handed out while fn ran, beyond what existed before, from
    the profiler's allocation events (CPU PyTorch has no memory_allocated counters)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    current = peak = 0
    for _, size in sorted(sizes):
        current += size
        peak = max(peak, current)
    return peak


@pytest.mark.filterwarnings("ignore:.*allocated before the profiling started")
def test_inplace_backward_allocates_no_logits_sized_buffer(monkeypatch):
    """Measured: the backward's peak allocation is a chunk's temporaries (4 rows here), where the
    out-of-place backward also allocates the logits-sized dlogits."""
    monkeypatch.setattr(ref, "CHUNK_BYTES", 4 * 1000 * 4)
    t = make_target((64,), 1000)
    peaks = {}
    for inplace in (False, True):
        logits = make_logits((64, 1000), rg=True) * 1.0
        loss = cross_entropy(logits, t, z_loss=1e-3, inplace_backward=inplace)
        peaks[inplace] = _peak_allocated(lambda: torch.autograd.grad(loss, logits))
    logits_bytes = 64 * 1000 * 4
    assert peaks[False] >= logits_bytes, peaks
    assert peaks[True] < logits_bytes / 8, peaks


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_inplace_backward_compiles(backend):
    """Under torch.compile: logits made inside the graph and logits as a graph input (the
    mutation then reaches the caller's tensor, as in eager)."""
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(30, 8, requires_grad=True)
    t = make_target((6,), 30)

    def model(h, w, inplace):
        return cross_entropy(h @ w.t(), t, label_smoothing=0.1, inplace_backward=inplace)

    expect = torch.autograd.grad(model(h, w, False), (h, w))
    got = torch.autograd.grad(torch.compile(model, backend=backend, fullgraph=True)(h, w, True), (h, w))
    for g, e in zip(got, expect):
        torch.testing.assert_close(g, e)
    if backend == "aot_eager":
        logits = h @ w.t()
        loss = torch.compile(lambda x: cross_entropy(x, t, inplace_backward=True), backend=backend)(logits)
        (dlogits,) = torch.autograd.grad(loss, logits)
        torch.testing.assert_close(logits, dlogits)


# --------------------------------------------------------------------------------------
# Vocabulary shards (the per-shard ops of the vocab-parallel mode)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("opts", OPTIONS, ids=str)
def test_shards_combine_to_whole(force_backend, backend, opts):
    """Three shards' statistics, combined as the vocab-parallel forward does, give the loss of
    the whole vocabulary; each shard's backward with the whole row's lse gives its columns of
    the whole gradient (in place too)."""
    force_backend(backend)
    dtype = torch.float64 if backend == "reference" else torch.float32
    device = DEV if backend == "triton" else "cpu"
    x = make_logits((3, 5, 3 * 11), dtype).to(device)
    t = make_target((3, 5), 33, opts.get("ignore_index", -100)).to(device)
    lo = ref.LossOptions(**opts)
    shards = x.split(11, -1)
    stats = [torch.ops.flash.cross_entropy_shard_stats(s, t, vocab_start=11 * r, vocab_size=33,
                                                       ignore_index=lo.ignore_index, softcap=lo.softcap)
             for r, s in enumerate(shards)]
    lse_r, z_t, z_sum = (torch.stack(v) for v in zip(*stats))
    lse = torch.where(t != lo.ignore_index, lse_r.logsumexp(0), 0.0)
    whole_loss, whole_lse = torch.ops.flash.cross_entropy_with_lse(x, t, **opts, reduction="none")
    torch.testing.assert_close(lse, whole_lse)
    torch.testing.assert_close(ref.loss_from_stats(lse, z_t.sum(0), z_sum.sum(0), t, lo, 33), whole_loss)
    g = torch.randn(t.shape, dtype=dtype, device=device)
    whole = torch.ops.flash.cross_entropy_backward(g, x, t, **opts, reduction="none")
    for r, s in enumerate(shards):
        kw = dict(**opts, reduction="none", vocab_start=11 * r, vocab_size=33)
        torch.testing.assert_close(torch.ops.flash.cross_entropy_backward(g, s, t, lse, **kw), whole[..., 11 * r:11 * (r + 1)])
        inplace = s.clone()
        torch.ops.flash.cross_entropy_backward_inplace(g, inplace, t, lse, **kw)
        torch.testing.assert_close(inplace, whole[..., 11 * r:11 * (r + 1)])


@pytest.mark.cuda
@pytest.mark.parametrize("inplace", [False, True])
def test_cuda_inplace_backward_memory(inplace):
    """Triton path, 4096 x 32000 bf16: the backward allocates dlogits (262 MB) unless
    inplace_backward, where it allocates no logits-sized buffer."""
    x = torch.randn(4096, 32000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits = x * 2
    t = torch.randint(0, 32000, (4096,), device="cuda")
    loss = cross_entropy(logits, t, label_smoothing=0.1, inplace_backward=inplace)
    exact_in = logits.detach().double().requires_grad_()
    F.cross_entropy(exact_in, t, label_smoothing=0.1).backward()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    (dlogits,) = torch.autograd.grad(loss, logits)
    extra = torch.cuda.max_memory_allocated() - before
    logits_bytes = logits.numel() * logits.element_size()
    assert (extra < logits_bytes / 16) if inplace else (extra >= logits_bytes), extra
    assert (dlogits.data_ptr() == logits.data_ptr()) == inplace
    assert_rel_close(dlogits, exact_in.grad, TOL[torch.bfloat16], what="dlogits")


@pytest.mark.cuda
@pytest.mark.parametrize("inplace", [False, True])
def test_inductor_dynamic_vocabulary(inplace):
    """Under Inductor with every size dynamic, over two vocabularies (one not divisible by 16)
    at large sizes, loss and gradient as eager (flash.linear_cross_entropy's inference op once
    failed to compile this way at 1024 x 128000: tests/ops/test_linear_cross_entropy.py)."""
    torch._dynamo.reset()

    def loss_of(x, t):
        return cross_entropy(x * 2, t, label_smoothing=0.1, inplace_backward=inplace)

    compiled = torch.compile(loss_of, dynamic=True)
    for n, v in ((1024, 128000), (1000, 50257)):
        x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        t = torch.randint(0, v, (n,), device="cuda")
        got, eager = compiled(x, t), loss_of(x, t)
        (g_got,), (g_eager,) = torch.autograd.grad(got, x), torch.autograd.grad(eager, x)
        torch.testing.assert_close(got, eager)
        torch.testing.assert_close(g_got, g_eager)
        exact = x.detach().double().requires_grad_()
        F.cross_entropy(exact * 2, t, label_smoothing=0.1).backward()
        assert_rel_close(g_got, exact.grad, TOL[torch.bfloat16], what="dlogits")
