"""The compiled eager fast path (torch_flash/ops/_fast.py, csrc/fast/): after a signature's first
calls, its calls replay the recorded kernels from C++ and the autograd node is C++. Every
replay must give the Python path's results bit for bit, with fresh inputs each call."""
from __future__ import annotations

import pytest
import torch

import torch_flash
from torch_flash import _extension
from torch_flash.ops import _autograd, _fast

from _utils import TOL, assert_rel_close, to64

_READY = torch.cuda.is_available() and _fast.ensure()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not _READY, reason=f"needs the compiled fast path ({_extension.fast_error() or 'no GPU'})"),
]
DEV = "cuda"


def _stats(op: str) -> tuple[int, int, int]:
    return _extension.load_fast().fast_stats()[op]


def _cases():
    """op -> (public function, make inputs (x first), keyword arguments)."""
    def rows(dtype, n=1024, m=48, transposed=False):
        x = torch.randn(n, m, device=DEV, dtype=dtype).t() if transposed else torch.randn(m, n, device=DEV, dtype=dtype)
        return x

    def heads(h):
        return torch.randn(2, h, 192, 64, device=DEV, dtype=torch.bfloat16)

    def targets(shape, n_classes):
        t = torch.randint(0, n_classes, shape, device=DEV)
        return t.masked_fill_(torch.rand(shape, device=DEV) < 0.1, -100)
    return {
        "rms_norm": (torch_flash.rms_norm, lambda: (rows(torch.bfloat16), torch.randn(1024, device=DEV)), {}),
        "rms_norm_gemma": (torch_flash.rms_norm,
                           lambda: (rows(torch.float16), torch.randn(1024, device=DEV, dtype=torch.float16)),
                           dict(weight_offset=1.0, cast_before_weight=False)),
        "rms_norm_strided": (torch_flash.rms_norm, lambda: (rows(torch.float32, transposed=True)[:, :1000], None), {}),
        "add_rms_norm": (torch_flash.add_rms_norm,
                         lambda: (rows(torch.bfloat16), rows(torch.float32), torch.randn(1024, device=DEV)),
                         dict(residual_in_fp32=True)),
        "layer_norm": (torch_flash.layer_norm,
                       lambda: (rows(torch.bfloat16, 4096), torch.randn(4096, device=DEV),
                                torch.randn(4096, device=DEV)), {}),
        # causal: cuDNN's backward (which use_backend turns off) does not take it at this length
        "attention": (torch_flash.attention, lambda: (heads(4), heads(2), heads(2)), dict(causal=True)),
        # q, k and v share one storage: replays address them through q (the key holds the distances)
        "attention_packed": (torch_flash.attention,
                             lambda: torch.randn(2, 192, 3, 4, 64, device=DEV, dtype=torch.bfloat16)
                             .permute(2, 0, 3, 1, 4).unbind(0),
                             {}),
        "attention_with_lse": (torch_flash.attention_with_lse, lambda: (heads(4), heads(4), heads(4)),
                               dict(causal=True, window=(64, 0))),
        # fp32 sum stream, bf16 normalised output written by the kernel itself
        "add_layer_norm": (torch_flash.add_layer_norm,
                           lambda: (rows(torch.float32, 768), rows(torch.float32, 768),
                                    torch.randn(768, device=DEV), None),
                           dict(out_dtype=torch.bfloat16)),
        "attention_varlen": (torch_flash.attention_varlen,
                             lambda: (*(torch.randn(300, h, 64, device=DEV, dtype=torch.bfloat16) for h in (4, 2, 2)),
                                      *[torch.tensor([0, 100, 117, 300], device=DEV, dtype=torch.int32)] * 2,
                                      183, 183),
                             dict(causal=True)),
        "cross_entropy": (torch_flash.cross_entropy,
                          lambda: (rows(torch.bfloat16, 5000, 64), targets((64,), 5000)),
                          dict(label_smoothing=0.1, z_loss=1e-4)),
        "cross_entropy_none": (torch_flash.cross_entropy,
                               lambda: (rows(torch.float32, 3000, 96).view(4, 24, 3000), targets((4, 24), 3000)),
                               dict(reduction="none", softcap=30.0)),
    }


def _python_path(fn, args, kwargs):
    """The same call on the Python path: the op's Python autograd rule, whose forward and
    backward ops then run their Python bodies (TORCH_FLASH_FAST=0 in effect), choosing the
    backends the replays recorded."""
    saved = dict(_autograd.FAST), dict(_autograd.FAST_FORWARD)
    _autograd.FAST.clear()
    _autograd.FAST_FORWARD.clear()
    try:
        return fn(*args, **kwargs)
    finally:
        _autograd.FAST.update(saved[0])
        _autograd.FAST_FORWARD.update(saved[1])


# backward paths whose dq sums in no fixed order (atomics): equal to the Python path's within rounding
_UNORDERED = ("cudnn", "cuda")


@pytest.mark.parametrize("case", list(_cases()))
def test_replay_equals_python_path(case):
    fn, make, kwargs = _cases()[case]
    op = fn.__name__
    def leaves_of(args):
        return [a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in args]
    for call in range(4):  # compile, record, then replays; fresh values every call
        args = make()
        leaves = leaves_of(args)
        out = fn(*leaves, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        grads = [torch.randn_like(o) for o in outs]
        torch.autograd.backward(outs, grads)
        want_leaves = leaves_of(args)
        want = _python_path(fn, want_leaves, kwargs)
        wants = want if isinstance(want, tuple) else (want,)
        torch.autograd.backward(wants, grads)
        for got_t, want_t in zip(outs, wants):
            assert got_t.dtype == want_t.dtype and got_t.stride() == want_t.stride()
            assert torch.equal(got_t, want_t), f"{case}: output of call {call}"
        spec = _autograd.SPECS[op]
        unordered = torch_flash._dispatch.LAST[spec.backward] in _UNORDERED
        for leaf, want_leaf in zip(leaves, want_leaves):
            if not (isinstance(leaf, torch.Tensor) and leaf.requires_grad):
                continue
            if unordered:
                assert_rel_close(leaf.grad, want_leaf.grad.double(), TOL[leaf.dtype])
            else:
                assert torch.equal(leaf.grad, want_leaf.grad), f"{case}: gradient of call {call}"
        assert f"flash::{op} backward" == outs[0].grad_fn.name()
    for ran in (spec.forward or op, spec.backward):  # with a gradient the op runs these two
        replays, _, recipes = _stats(ran)
        assert replays >= 2 and recipes >= 1, f"{ran}: {_stats(ran)}"
        assert torch_flash._dispatch.LAST[ran] in ("triton", "cuda", "cudnn")


def _forward_cases():
    """op -> (public function, make inputs, keyword arguments) of calls without a gradient (the
    only ones the fast path serves for FORWARD_OPS)."""
    qkv = lambda h: torch.randn(2, h, 256, 64, device=DEV, dtype=torch.bfloat16)  # noqa: E731
    tables = lambda: torch_flash.rotary_cos_sin(256, 64, device=DEV)  # noqa: E731
    return {
        "rotary": (torch_flash.rotary, lambda: (qkv(4).transpose(1, 2), *tables()), {}),
        "rotary_qk": (torch_flash.rotary_qk, lambda: (qkv(4), qkv(2), *tables()), {}),
        "attention": (torch_flash.attention, lambda: (qkv(4), qkv(2), qkv(2)), dict(causal=True)),
        "linear_cross_entropy": (torch_flash.linear_cross_entropy, _lce_inputs, dict(label_smoothing=0.1)),
    }


def _lce_inputs(bias=False):
    """(hidden, weight, target[, bias]) of a one-chunk linear cross-entropy, some targets ignored."""
    target = torch.randint(0, 1000, (64,), device=DEV).masked_fill_(torch.rand(64, device=DEV) < 0.1, -100)
    h = torch.randn(64, 256, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(1000, 256, device=DEV, dtype=torch.bfloat16)
    return (h, w, target, torch.randn(1000, device=DEV, dtype=torch.bfloat16)) if bias else (h, w, target)


@pytest.mark.parametrize("upstream", [1.0, 3.0])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_gradients_replay(reduction, upstream):
    """With a gradient, the C++ node runs flash.linear_cross_entropy_with_grads and hands its
    gradients out scaled in place (flash.linear_cross_entropy_scale_), all replays: loss and
    gradients equal the Python path's bit for bit."""
    before = [_stats(op)[0] for op in ("linear_cross_entropy_with_grads", "linear_cross_entropy_scale_")]
    for call in range(4):
        inputs = _lce_inputs(bias=True)
        leaves = [t.requires_grad_() if t.is_floating_point() else t for t in inputs]
        loss = torch_flash.linear_cross_entropy(*leaves, z_loss=1e-4, reduction=reduction)
        assert loss.grad_fn.name() == "flash::linear_cross_entropy backward"
        (loss * upstream).backward()
        want_leaves = [t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs]
        want = _python_path(torch_flash.linear_cross_entropy, want_leaves, dict(z_loss=1e-4, reduction=reduction))
        (want * upstream).backward()
        assert torch.equal(loss, want), f"loss of call {call}"
        for got_t, want_t in zip(leaves, want_leaves):
            if got_t.is_floating_point():
                assert torch.equal(got_t.grad, want_t.grad), f"gradient of call {call}"
    after = [_stats(op)[0] for op in ("linear_cross_entropy_with_grads", "linear_cross_entropy_scale_")]
    assert after[0] >= before[0] + 2 and after[1] >= before[1] + 2


def test_linear_cross_entropy_node_retained_graph():
    """A backward that keeps its graph recomputes (the scaling op refuses such backwards), the
    next one hands the forward's gradients out: both equal the Python path's; a reduction of
    "none" takes the Python rule."""
    inputs = _lce_inputs(bias=False)
    leaves = [t.requires_grad_() if t.is_floating_point() else t for t in inputs]
    want_leaves = [t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs]
    loss = torch_flash.linear_cross_entropy(*leaves)
    want = _python_path(torch_flash.linear_cross_entropy, want_leaves, {})
    for retain in (True, False):
        got = torch.autograd.grad(loss * 2, leaves[:2], retain_graph=retain)
        expected = torch.autograd.grad(want * 2, want_leaves[:2], retain_graph=retain)
        for g, e in zip(got, expected):
            assert_rel_close(g.double(), e.double(), TOL[torch.bfloat16])
    rows = torch_flash.linear_cross_entropy(*leaves, reduction="none")
    assert rows.grad_fn.name() != "flash::linear_cross_entropy backward"


@pytest.mark.parametrize("case", list(_forward_cases()))
def test_forward_replay_equals_python_path(case):
    fn, make, kwargs = _forward_cases()[case]
    for call in range(4):
        args = make()
        got = fn(*args, **kwargs)
        want = _python_path(fn, args, kwargs)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert g.stride() == w.stride() and torch.equal(g, w), f"{case}: call {call}"
    replays, _, recipes = _stats(case)
    assert replays >= 2 and recipes >= 1, f"{case}: {_stats(case)}"


def _rotary_cases():
    """case -> (op, make inputs: (tensors rotated, tables, keyword arguments)), bf16, partial
    rotary; saved offsets or cu_seqlens, or None for them."""
    def tables(n):
        return torch_flash.rotary_cos_sin(n, 32, device=DEV)

    def heads(h):  # the (B, S, H, D) layout
        return torch.randn(2, 256, h, 64, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    return {
        "rotary": ("rotary", lambda: ((heads(4),), tables(264),
                                      dict(seqlen_offsets=torch.tensor([0, 8], device=DEV, dtype=torch.int32)))),
        "rotary_qk": ("rotary_qk", lambda: ((heads(4), heads(2)), tables(260),
                                            dict(interleaved=True, seqlen_offsets=3))),
        "rotary_varlen": ("rotary", lambda: ((torch.randn(300, 4, 64, device=DEV, dtype=torch.bfloat16),), tables(300),
                                             dict(cu_seqlens=torch.tensor([0, 100, 117, 300], device=DEV,
                                                                          dtype=torch.int32)))),
    }


def _upstream(xs, kind: str):
    """Gradients of the outputs rotating xs: random, strided views (the last dim too), or None (a
    sum())."""
    if kind == "sum":
        return None
    if kind == "strided":
        return [torch.randn(*x.shape[:-1], 2 * x.shape[-1], device=DEV, dtype=x.dtype)[..., ::2] for x in xs]
    return [torch.randn_like(x) for x in xs]


@pytest.mark.parametrize("upstream", ["random", "sum", "strided"])
@pytest.mark.parametrize("case", list(_rotary_cases()))
def test_rotary_replay_equals_python_path(case, upstream):
    """rotary's forward and backward through the C++ node and replays equal the Python path's bit
    for bit, for gradients of any strides (the expanded one of a sum(), strided views: the backward
    op copies them)."""
    op, make = _rotary_cases()[case]
    fn = getattr(torch_flash, op)

    def step(xs, tables, kwargs, grads):
        leaves = [x.detach().requires_grad_() for x in xs]
        out = fn(*leaves, *tables, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        if grads is None:
            sum(o.sum() for o in outs).backward()
        else:
            torch.autograd.backward(outs, grads)
        return outs, [x.grad for x in leaves], outs[0].grad_fn.name()
    for call in range(4):  # compile, record, then replays; fresh values every call
        xs, tables, kwargs = make()
        grads = _upstream(xs, upstream)
        got = step(xs, tables, kwargs, grads)
        want = _python_path(step, (xs, tables, kwargs, grads), {})
        assert got[2] == f"flash::{op} backward" and want[2] != got[2]
        for g, w in zip((*got[0], *got[1]), (*want[0], *want[1])):
            assert g.stride() == w.stride() and torch.equal(g, w), f"{case}: call {call}"
    for ran in (op, f"{op}_backward"):
        replays, _, recipes = _stats(ran)
        assert replays >= 2 and recipes >= 1, f"{ran}: {_stats(ran)}"
        assert torch_flash._dispatch.LAST[ran] == "triton"


@pytest.mark.parametrize("case", list(_rotary_cases()))
def test_rotary_double_backward_replays(case):
    """A backward op's C++ node is differentiable: its gradient is the backward op again with
    conjugate flipped back (the forward's rotation of the expanded gradient of a sum()), all
    replays, equal to the Python path's bit for bit."""
    op, make = _rotary_cases()[case]
    fn = getattr(torch_flash, op)

    def step(xs, tables, kwargs, grads):
        leaves = [x.detach().requires_grad_() for x in xs]
        upstream = [g.detach().requires_grad_() for g in grads]
        out = fn(*leaves, *tables, **kwargs)
        dxs = torch.autograd.grad(out, leaves, upstream, create_graph=True)
        again = torch.autograd.grad(sum(d.sum() for d in dxs), upstream)
        return (*dxs, *again), dxs[0].grad_fn.name()
    before = _stats(f"{op}_backward")[0]
    for call in range(4):
        xs, tables, kwargs = make()
        grads = _upstream(xs, "random")
        got, name = step(xs, tables, kwargs, grads)
        want, _ = _python_path(step, (xs, tables, kwargs, grads), {})
        assert name == f"flash::{op}_backward backward"
        # the layout of the backward op's copy of the expanded gradient
        rotated = fn(*(torch.ones(x.shape, device=DEV, dtype=x.dtype) for x in xs), *tables, **kwargs)
        for g, w in zip(got, want):
            assert torch.equal(g, w), f"{case}: call {call}"
        for g, w in zip(got[len(xs):], rotated if isinstance(rotated, tuple) else (rotated,)):
            assert torch.equal(g, w), f"{case}: call {call}"
    assert _stats(f"{op}_backward")[0] >= before + 4  # backward and double backward, replayed


@pytest.mark.parametrize("op", ["rotary", "rotary_backward", "rotary_qk", "rotary_qk_backward"])
def test_rotary_tables_that_require_grad_are_refused(op):
    """The C++ autograd kernel sends calls whose cos/sin require a gradient to the Python rule,
    which refuses them; under no_grad they replay as usual."""
    xs = [torch.randn(2, h, 64, 64, device=DEV, requires_grad=True) for h in ((4, 2) if "qk" in op else (4,))]
    cos, sin = torch_flash.rotary_cos_sin(64, 32, device=DEV)
    fn = getattr(torch.ops.flash, op)
    with pytest.raises(ValueError, match=f"^flash.{op}: cos/sin require grad"):
        fn(*xs, cos, sin.requires_grad_())
    before = _stats(op)[0]
    with torch.no_grad():
        want = _python_path(_autograd.call, (op, *xs, cos, sin), {})
        for _ in range(4):
            got = fn(*xs, cos, sin)
    assert _stats(op)[0] > before
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w)


def test_sinks_gradient_replays():
    """Sinks that need a gradient take the C++ node, their gradient from the backward op's delta
    pass: bit for bit the Python path's, and float64's within bf16 rounding."""
    for call in range(4):
        q, k, v = (torch.randn(1, 4, 128, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        sinks = torch.randn(4, device=DEV, requires_grad=True)
        out = torch_flash.attention(q, k, v, causal=True, sinks=sinks)
        assert out.grad_fn.name() == "flash::attention backward"
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v, sinks), g)
        leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
        want_out = _python_path(lambda *a: torch_flash.attention(*a[:3], causal=True, sinks=a[3]), leaves, {})
        assert torch.equal(out, want_out)
        for got, want in zip(grads, torch.autograd.grad(want_out, leaves, g)):
            assert torch.equal(got, want), f"call {call}"
    replays, _, recipes = _stats("attention_backward")
    assert replays >= 2 and recipes >= 1, _stats("attention_backward")
    ref = torch_flash.reference.attention
    q64, k64, v64 = to64(q, k, v)
    s64 = sinks.detach().double().requires_grad_()
    spec = ref.Spec(64 ** -0.5, True, sinks=s64)
    want = torch.autograd.grad(ref.forward(q64.requires_grad_(), k64.requires_grad_(), v64.requires_grad_(),
                                           None, spec)[0], (q64, k64, v64, s64), g.double())
    for got, w in zip(grads, want):  # bf16 attention: the sinks' gradient carries its rounding
        assert_rel_close(got, w, TOL[torch.bfloat16])


def test_decode_replay_writes_the_cache():
    if "attention_decode" not in _autograd.FAST_FORWARD:
        pytest.skip("flash.attention_decode is not on the fast path here")
    b, hq, hkv, d, cap = 2, 8, 2, 64, 512
    for call in range(4):
        q = torch.randn(b, hq, 1, d, device=DEV, dtype=torch.bfloat16)
        k_cache, v_cache = (torch.randn(b, hkv, cap, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
        k_new, v_new = (torch.randn(b, hkv, 1, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
        lens = torch.tensor([100, 300], device=DEV, dtype=torch.int32)
        caches = (k_cache.clone(), v_cache.clone())
        version = k_cache._version
        out = torch_flash.attention_decode(q, k_cache, v_cache, lens, k_new, v_new)
        assert k_cache._version > version
        want = _python_path(torch_flash.attention_decode, (q, *caches, lens, k_new, v_new), {})
        assert all(torch.equal(g, w) for g, w in zip(out, want))  # (out, lse)
        assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
    replays, _, recipes = _stats("attention_decode")
    assert replays >= 2 and recipes >= 1, _stats("attention_decode")


def test_bad_target_found_by_a_replay_raises_at_the_next_loss_call():
    """The deferred target check is a step of the recipe: a replayed call whose target is out of
    range raises in the call where its verdict is in by then, else at the next loss call (or
    torch_flash.synchronize), once."""
    logits = torch.randn(32, 1000, device=DEV)
    target = torch.randint(0, 1000, (32,), device=DEV)
    for _ in range(3):
        torch_flash.cross_entropy(logits, target)
    assert _stats("cross_entropy")[2] >= 1  # a recipe, which the next calls replay
    bad = target.clone()
    bad[5] = 1000
    with pytest.raises(ValueError, match=r"flash\.cross_entropy: target contains 1000, outside \[0, 1000\)"):
        torch_flash.cross_entropy(logits, bad)
        torch_flash.synchronize()
    torch_flash.synchronize()  # raised once
    bad[5] = -7
    with pytest.raises(ValueError, match="target contains -7"):
        torch_flash.cross_entropy(logits, bad)
        torch.cuda.synchronize()
        torch_flash.cross_entropy(logits, target)
    replays = _stats("cross_entropy")[0]
    torch_flash.cross_entropy(logits, target)
    assert _stats("cross_entropy")[0] == replays + 1


def test_inplace_backward_takes_the_python_rule():
    logits = torch.randn(16, 800, device=DEV, requires_grad=True)
    target = torch.randint(0, 800, (16,), device=DEV)
    h = logits * 1.5
    loss = torch_flash.cross_entropy(h, target, inplace_backward=True)
    assert "flash::" not in loss.grad_fn.name()
    loss.backward()
    want = torch.autograd.grad(torch.nn.functional.cross_entropy(logits.double() * 1.5, target), logits)[0]
    assert_rel_close(logits.grad, want)


def test_a_call_with_more_than_launches_stays_on_the_python_path():
    """Linear cross-entropy in several chunks joins their losses with cat, whose list argument a
    recipe cannot hold: no recipe, and after three recordings its calls stop trying; the results
    are the Python path's."""
    h, w, t = _lce_inputs()
    op, kwargs = "linear_cross_entropy", dict(reduction="none", chunk_size=16)
    before = _stats(op)
    for _ in range(5):
        y = torch_flash.linear_cross_entropy(h, w, t, **kwargs)
    replays, fallbacks, recipes = _stats(op)
    assert (replays, recipes) == before[::2] and fallbacks == before[1] + 5
    assert torch.equal(y, _python_path(torch_flash.linear_cross_entropy, (h, w, t), kwargs))


def test_replay_against_float64():
    x, w = torch.randn(37, 3000, device=DEV, dtype=torch.bfloat16), torch.randn(3000, device=DEV)
    for _ in range(3):
        y = torch_flash.rms_norm(x, w, 1e-5)
    x64, w64 = to64(x, w)
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert_rel_close(y, (ref.to(torch.bfloat16).double() * w64))


def test_backward_op_replays_on_the_engine_thread():
    x = torch.randn(64, 2048, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2048, device=DEV, requires_grad=True)
    g = torch.randn_like(x)
    before = _stats("rms_norm_backward")[0]
    for _ in range(4):
        torch_flash.rms_norm(x, w).backward(g)
    assert _stats("rms_norm_backward")[0] >= before + 2


def test_inplace_change_of_a_saved_input_is_caught():
    x = torch.randn(16, 1024, device=DEV, requires_grad=True)
    w = torch.randn(1024, device=DEV, requires_grad=True)
    h = x * 2
    y = torch_flash.rms_norm(h, w)
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_saved_output_version_is_checked():
    x, r = (torch.randn(16, 1024, device=DEV, requires_grad=True) for _ in range(2))
    w = torch.randn(1024, device=DEV, requires_grad=True)
    y, s = torch_flash.add_layer_norm(x, r, w, None)
    s.mul_(2)  # the backward reads the saved statistics and s's data
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (y.sum() + s.sum()).backward()


def test_forced_backend_takes_the_python_path():
    x, w = torch.randn(8, 1024, device=DEV), torch.randn(1024, device=DEV)
    for _ in range(3):
        torch_flash.rms_norm(x, w)
    with torch_flash.use_backend("reference"):
        y = torch_flash.rms_norm(x, w)
        assert torch_flash._dispatch.LAST["rms_norm"] == "reference"
    assert_rel_close(y, torch_flash.reference.rms_norm.rms_norm(*to64(x, w), 1e-6))
    torch_flash.rms_norm(x, w)
    assert torch_flash._dispatch.LAST["rms_norm"] == "triton"


def test_bad_input_after_replays_names_the_op():
    x, w = torch.randn(8, 1024, device=DEV), torch.randn(1024, device=DEV)
    for _ in range(3):
        torch_flash.rms_norm(x, w)
    with pytest.raises(ValueError, match="rms_norm.*weight"):
        torch_flash.rms_norm(x, torch.randn(1000, device=DEV))


def test_compile_still_sees_the_kernels():
    x = torch.randn(32, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, device=DEV, requires_grad=True)

    def f(x, w):
        return torch_flash.rms_norm(x * 2, w).float().pow(2).sum()
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    gx, gw = torch.autograd.grad(compiled(x, w), (x, w))
    ex, ew = torch.autograd.grad(f(x, w), (x, w))
    assert_rel_close(gx, ex.double(), 2e-2)
    assert_rel_close(gw, ew.double(), 2e-2)


def test_cuda_graph_capture_of_forward_and_backward():
    x = torch.randn(64, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, device=DEV, requires_grad=True)
    step = lambda: torch.autograd.grad(torch_flash.rms_norm(x, w).float().sum(), (x, w))  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gx, gw = step()
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        w.copy_(torch.randn_like(w))
    g.replay()
    ex, ew = step()
    assert torch.equal(gx, ex) and torch.equal(gw, ew)
