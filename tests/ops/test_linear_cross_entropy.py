"""flash.linear_cross_entropy: opcheck, gradcheck, equality with cross_entropy(hidden @ W.T + b),
chunking (the full logits never exist), bad inputs, empty batch, inputs untouched."""
import pytest
import torch
import torch.nn.functional as F

import torch_flash
from torch_flash.ops.cross_entropy import cross_entropy
from torch_flash.ops.linear_cross_entropy import linear_cross_entropy
from torch_flash.reference import cross_entropy as ce_ref
from torch_flash.reference import linear_cross_entropy as ref
from torch_flash.testing.samples.linear_cross_entropy import DTYPES, OPTIONS, REDUCTIONS, lce_inputs
from _utils import TOL, assert_rel_close, rel_err


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_with_grads_matches_backward(reduction):
    """The fused forward's gradients are the backward op's for an upstream gradient of 1."""
    h, w, t, b = lce_inputs((3, 4), 8, 19, torch.float64)
    loss, dh, dw, db = torch.ops.flash.linear_cross_entropy_with_grads(h, w, t, b, reduction=reduction,
                                                                        chunk_size=5)
    ref = torch.ops.flash.linear_cross_entropy_backward(torch.ones(()), h, w, t, b, reduction=reduction,
                                                        chunk_size=5)
    torch.testing.assert_close(loss, torch_flash.linear_cross_entropy(h, w, t, b, reduction=reduction))
    for got, want in zip((dh, dw, db), ref):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="flash.linear_cross_entropy_with_grads: reduction='none'"):
        torch.ops.flash.linear_cross_entropy_with_grads(h, w, t, b, reduction="none")


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
def test_gradcheck(opts):
    h, w, t, b = lce_inputs((2, 3), 4, 7, torch.float64, rg=(True, True, True),
                            ignore_index=opts.get("ignore_index", -100))
    for reduction, chunk_size in zip(REDUCTIONS, (0, 2, 4)):
        assert torch.autograd.gradcheck(
            lambda *a: linear_cross_entropy(*a[:2], t, a[2], reduction=reduction, chunk_size=chunk_size,
                                            **opts), (h, w, b))
    assert torch.autograd.gradcheck(lambda *a: linear_cross_entropy(*a, t, **opts), (h, w))


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("opts", OPTIONS, ids=str)
def test_equals_cross_entropy_of_logits(dtype, opts):
    """Same loss and gradients as the unfused flash.cross_entropy(hidden @ W.T + b)."""
    h, w, t, b = lce_inputs((3, 5), 32, 19, dtype, ignore_index=opts.get("ignore_index", -100))
    fused = [x.clone().requires_grad_() for x in (h, w, b)]
    plain = [x.clone().requires_grad_() for x in (h, w, b)]
    out = linear_cross_entropy(fused[0], fused[1], t, fused[2], reduction="none", chunk_size=4, **opts)
    expect = cross_entropy(F.linear(*plain), t, reduction="none", **opts)
    assert out.dtype == expect.dtype
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    grad = torch.rand_like(out)
    out.backward(grad)
    expect.backward(grad)
    for a, e, name in zip(fused, plain, ("dhidden", "dweight", "dbias")):
        assert a.grad.dtype == dtype
        assert_rel_close(a.grad, e.grad, TOL[dtype], what=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_no_worse_than_torch(dtype):
    h, w, t, b = lce_inputs((64,), 64, 500, dtype)
    exact_in = [x.double().requires_grad_() for x in (h, w, b)]
    exact = F.cross_entropy(F.linear(*exact_in), t, reduction="none")
    exact.sum().backward()
    errs = {}
    for name, fn in (("flash", lambda *a: linear_cross_entropy(*a[:2], t, a[2], reduction="none")),
                     ("torch", lambda *a: F.cross_entropy(F.linear(*a), t, reduction="none"))):
        leaves = [x.clone().requires_grad_() for x in (h, w, b)]
        out = fn(*leaves)
        out.sum().backward()
        errs[name] = [rel_err(out, exact)] + [rel_err(x.grad, e.grad) for x, e in zip(leaves, exact_in)]
    assert all(f <= 1.05 * p for f, p in zip(errs["flash"], errs["torch"])), errs
    assert max(errs["flash"]) <= TOL[dtype], errs


def test_full_logits_never_exist(monkeypatch):
    """Full fp32 logits would take 16 MB; with a 1 MB budget every chunk's logits fit in it."""
    n_rows, n_classes = 256, 16384
    budget = 2**20
    monkeypatch.setattr(ce_ref, "CHUNK_BYTES", budget)
    seen = []

    def recording(*args, fn=ref.chunk_logits):
        logits = fn(*args)
        seen.append(tuple(logits.shape))
        return logits

    monkeypatch.setattr(ref, "chunk_logits", recording)
    h, w, t, b = lce_inputs((n_rows,), 8, n_classes, rg=(True, True, True))
    out = linear_cross_entropy(h, w, t, b)
    out.backward()
    rows = budget // (n_classes * 4)
    assert len(seen) == 2 * n_rows // rows  # every chunk once forward, once backward
    assert all(s == (rows, n_classes) for s in seen)
    monkeypatch.undo()
    expect_in = [x.detach().clone().requires_grad_() for x in (h, w, b)]
    expect = cross_entropy(F.linear(*expect_in), t)
    expect.backward()
    torch.testing.assert_close(out, expect)
    for a, e in zip((h, w, b), expect_in):
        assert_rel_close(a.grad, e.grad)


def test_auto_chunk_size():
    """chunk_size=0 keeps a chunk's fp32 logits within the budget, down to one row."""
    for n_classes in (50257, 262144, ce_ref.CHUNK_BYTES // 4 + 1):
        for dtype in DTYPES:
            rows = ce_ref.rows_per_chunk(n_classes, dtype)
            assert rows == max(1, ce_ref.CHUNK_BYTES // (n_classes * 4))
            assert rows == 1 or rows * n_classes * 4 <= ce_ref.CHUNK_BYTES


def _bad(h=None, w=None, t=None, b=None, **kw):
    h = torch.randn(4, 8) if h is None else h
    w = torch.randn(10, 8) if w is None else w
    t = torch.randint(0, 10, (4,)) if t is None else t
    return lambda: linear_cross_entropy(h, w, t, b, **kw)


@pytest.mark.parametrize("bad,match", [
    (_bad(w=torch.randn(10, 7)), "weight has shape \\(10, 7\\)"),
    (_bad(w=torch.randn(10)), "weight must have 2 dimensions"),
    (_bad(b=torch.randn(9)), "bias has 9 elements"),
    (_bad(w=torch.randn(10, 8, dtype=torch.float64)), "dtype mismatch"),
    (_bad(t=torch.zeros(3, dtype=torch.long)), "target shape"),
    (_bad(t=torch.zeros(4)), "target has dtype"),
    (_bad(t=torch.tensor([0, 10, 1, 2])), "target contains 10, outside \\[0, 10\\)"),
    (_bad(t=torch.tensor([0, 1, 3, 2], dtype=torch.int32), ignore_index=-2**31 - 1), "does not fit target's dtype"),
    (_bad(reduction="mean "), "reduction must be one of"),
    (_bad(chunk_size=-1), "chunk_size must be >= 0"),
    (_bad(label_smoothing=-0.1), "label_smoothing must be in"),
])
def test_bad_inputs(bad, match):
    with pytest.raises(ValueError, match=f"flash.linear_cross_entropy: .*{match}"):
        bad()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_bad_target_values_raise_on_every_op(device):
    """Out-of-range targets raise naming the op (on CUDA the check runs behind the kernels,
    which mask such targets, and may raise at the next torch_flash.synchronize())."""
    h, w = torch.randn(4, 8, device=device), torch.randn(10, 8, device=device)
    t = torch.tensor([0, 10, 1, 2], device=device)
    calls = {"linear_cross_entropy": lambda: torch.ops.flash.linear_cross_entropy(h, w, t),
             "linear_cross_entropy_with_grads": lambda: torch.ops.flash.linear_cross_entropy_with_grads(h, w, t),
             "linear_cross_entropy_backward": lambda: torch.ops.flash.linear_cross_entropy_backward(
                 torch.ones((), device=device), h, w, t, None)}
    for op, call in calls.items():
        with pytest.raises(ValueError, match=f"flash.{op}: target contains 10, outside \\[0, 10\\)"):
            call()
            torch_flash.synchronize()


def test_backward_grad_loss_on_another_device():
    """The backward op refuses a grad_loss on another device (it read a meta one as garbage)."""
    h, w, t, b = lce_inputs((4,), 8, 10)
    with pytest.raises(ValueError, match="flash.linear_cross_entropy_backward: .*one device, got .*grad_loss on meta"):
        torch.ops.flash.linear_cross_entropy_backward(torch.ones((), device="meta"), h, w, t, b)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_batch(reduction):
    h, w, t, b = lce_inputs((0, 3), 8, 10, rg=(True, True, True))
    out = linear_cross_entropy(h, w, t, b, reduction=reduction)
    expect = F.cross_entropy(F.linear(h, w, b).reshape(0, 10), t.reshape(0), reduction=reduction)
    torch.testing.assert_close(out, expect.reshape(out.shape), equal_nan=True)
    out.sum().backward()
    assert h.grad.shape == h.shape
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_zero_hidden_size(force_backend, backend):
    """H = 0 (logits = bias, as F.linear gives): it crashed in a reshape of the empty hidden."""
    force_backend(backend)
    dev = DEV if backend == "triton" else "cpu"
    h, w, t, b = (x.detach().to(dev).requires_grad_(x.requires_grad)  # leaves on dev
                  for x in lce_inputs((2, 3), 0, 10, rg=(True, True, True)))
    out = linear_cross_entropy(h, w, t, b)
    b64 = b.detach().cpu().double().requires_grad_()
    expect = F.cross_entropy(b64.expand(6, 10), t.reshape(-1).cpu())
    out.backward()
    expect.backward()
    assert_rel_close(out.cpu(), expect, TOL[torch.float32])
    assert_rel_close(b.grad.cpu(), b64.grad, TOL[torch.float32], what="dbias")
    assert h.grad.shape == h.shape and w.grad.shape == w.shape


def test_inputs_untouched():
    h, w, t, b = lce_inputs((5, 2), 8, 12, rg=(True, True, True))
    copies = [x.detach().clone() for x in (h, w, t, b)]
    linear_cross_entropy(h, w, t, b, softcap=2.0, z_loss=1e-2, label_smoothing=0.1, chunk_size=3).backward()
    assert all(torch.equal(x.detach(), c) for x, c in zip((h, w, t, b), copies))


# --------------------------------------------------------------------------------------
# The fused ("mean"/"sum") backward: the forward's gradients scaled in place, retained
# graphs recomputing, traced graphs keeping a plain multiply
# --------------------------------------------------------------------------------------
GRAD_NAMES = ("dhidden", "dweight", "dbias")
LCE_OPTS = {"label_smoothing": 0.1, "z_loss": 1e-3}
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels' device


def _leaves(backend="reference"):
    """fp32 (hidden, weight, target, bias) requiring grad; on the GPU for the Triton path if
    there is one (CPU tensors run it under the interpreter)."""
    device = DEV if backend == "triton" else "cpu"
    h, w, t, b = (x.to(device) for x in lce_inputs((3, 4), 16, 37))
    return h.requires_grad_(), w.requires_grad_(), t, b.requires_grad_()


def _check_grads(got, h, w, t, b, grad_loss, reduction="mean", **opts):
    """got against the float64 reference backward for the upstream gradient grad_loss."""
    h64, w64, b64 = (x.detach().cpu().double() for x in (h, w, b))
    want = ref.linear_cross_entropy_backward(torch.tensor(float(grad_loss), dtype=torch.float64), h64, w64,
                                             t.cpu(), b64, ref.LossOptions(**opts), reduction)
    for g, e, name in zip(got, want, GRAD_NAMES):
        assert_rel_close(g.cpu(), e, TOL[h.dtype], what=name)


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Names of the ops run, in order (a plain dispatch mode: eager, not tracing), and
    {flash op name: its keyword arguments} of the flash ops among them."""

    def __init__(self):
        super().__init__()
        self.ops = []
        self.flash_kwargs = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        if func.namespace == "flash":
            self.flash_kwargs[func.overloadpacket.__name__] = kwargs or {}
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_backward_scales_by_grad_loss(force_backend, backend, reduction):
    """An upstream gradient other than 1, as (loss * c).backward() gives."""
    force_backend(backend)
    h, w, t, b = _leaves(backend)
    (linear_cross_entropy(h, w, t, b, reduction=reduction, chunk_size=5, **LCE_OPTS) * 0.37).backward()
    _check_grads((h.grad, w.grad, b.grad), h, w, t, b, 0.37, reduction, **LCE_OPTS)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_backward_hands_out_forward_grads_in_place(force_backend, backend, scale):
    """Eager: the backward returns the very tensors the forward computed (no second
    dweight-sized buffer), drops them from the graph, and multiplies in place only when the
    upstream gradient is not 1; loss.backward() leaves them as the leaves' .grad. The Triton
    path decides that on the device (a kernel, no aten multiply and no host read of the
    upstream gradient); the reference path reads it."""
    force_backend(backend)
    h, w, t, b = _leaves(backend)
    loss = linear_cross_entropy(h, w, t, b, chunk_size=5, **LCE_OPTS)
    ptrs = [g.data_ptr() for g in loss.grad_fn.grads]
    with _OpLog() as log:
        got = torch.autograd.grad(loss, (h, w, b), torch.tensor(scale, device=h.device))
    assert loss.grad_fn.grads is None
    assert [g.data_ptr() for g in got] == ptrs
    muls = [op for op in log.ops if op.startswith("mul")]
    if backend == "triton":
        assert muls == [] and "_local_scalar_dense" not in log.ops, log.ops
    else:
        assert muls == ([] if scale == 1 else ["mul_"] * 3), log.ops
    _check_grads(got, h, w, t, b, scale, **LCE_OPTS)

    loss = linear_cross_entropy(h, w, t, b, chunk_size=5, **LCE_OPTS)
    ptrs = [g.data_ptr() for g in loss.grad_fn.grads]
    h.grad = w.grad = b.grad = None
    loss.backward()  # AccumulateGrad takes the tensors without a copy
    assert [x.grad.data_ptr() for x in (h, w, b)] == ptrs


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("first", [1.0, 0.37])
def test_retain_graph_backward_twice(force_backend, backend, first):
    """A second backward through a retained graph recomputes: both results right, and the
    first one's tensors (already the caller's) bitwise unchanged by the later calls."""
    force_backend(backend)
    h, w, t, b = _leaves(backend)
    loss = linear_cross_entropy(h, w, t, b, chunk_size=5, **LCE_OPTS)
    one = torch.autograd.grad(loss, (h, w, b), torch.tensor(first, device=h.device), retain_graph=True)
    kept = [g.clone() for g in one]
    two = torch.autograd.grad(loss, (h, w, b), torch.tensor(-2.5, device=h.device), retain_graph=True)
    three = torch.autograd.grad(loss, (h, w, b), torch.tensor(first, device=h.device))
    assert all(torch.equal(g, k) for g, k in zip(one, kept))
    for got, scale in ((one, first), (two, -2.5), (three, first)):
        _check_grads(got, h, w, t, b, scale, **LCE_OPTS)
    assert not any(a.data_ptr() == c.data_ptr() for a, c in zip(one, three))

    loss = linear_cross_entropy(h, w, t, b, chunk_size=5, **LCE_OPTS)
    h.grad = w.grad = b.grad = None
    loss.backward(retain_graph=True)
    loss.backward()  # accumulates into .grad: twice the gradient
    _check_grads((h.grad, w.grad, b.grad), h, w, t, b, 2.0, **LCE_OPTS)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_create_graph_second_derivative_raises(force_backend, backend, reduction):
    """create_graph=True: the gradients are not differentiable again, so a second derivative
    through them raises naming the backward op (as flash.cross_entropy's), never comes out
    silently without its Hessian term; the first derivative is still right."""
    force_backend(backend)
    h, w, t, b = _leaves(backend)
    loss = linear_cross_entropy(h, w, t, b, reduction=reduction, chunk_size=5, **LCE_OPTS)
    grad_loss = torch.rand_like(loss)
    got = torch.autograd.grad(loss, (h, w, b), grad_loss, create_graph=True)
    want = ref.linear_cross_entropy_backward(grad_loss.cpu().double(), *(x.detach().cpu().double() for x in (h, w)),
                                             t.cpu(), b.detach().cpu().double(), ref.LossOptions(**LCE_OPTS), reduction)
    for g, e, name in zip(got, want, GRAD_NAMES):
        assert_rel_close(g.cpu(), e, TOL[torch.float32], what=name)
    with pytest.raises(RuntimeError, match="flash.linear_cross_entropy_backward"):
        torch.autograd.grad(got[0].square().sum() + h.sum(), h)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("frozen", [("weight", "bias"), ("hidden",), ("bias",)], ids="+".join)
def test_frozen_inputs_get_no_gradient_computed(force_backend, backend, reduction, frozen):
    """A frozen lm-head (LoRA) or frozen hidden states: the gradient ops are asked only for
    the gradients needed (the others, a dweight GEMM and buffer among them, are not computed
    and come back empty); the needed ones are right and the frozen inputs get none."""
    force_backend(backend)
    h, w, t, b = _leaves(backend)
    leaves = {"hidden": h, "weight": w, "bias": b}
    for name, x in leaves.items():
        x.requires_grad_(name not in frozen)
    wanted = {f"grad_{name}": name not in frozen for name in leaves}
    with _OpLog() as log:
        loss = linear_cross_entropy(h, w, t, b, reduction=reduction, chunk_size=5, **LCE_OPTS)
        grad_loss = torch.rand_like(loss)
        loss.backward(grad_loss)
    op = "linear_cross_entropy_backward" if reduction == "none" else "linear_cross_entropy_with_grads"
    # the dispatcher leaves out arguments at their default (True)
    assert {k: log.flash_kwargs[op].get(k, True) for k in wanted} == wanted, log.flash_kwargs
    h64, w64, b64 = (x.detach().cpu().double() for x in (h, w, b))
    expect = ref.linear_cross_entropy_backward(grad_loss.cpu().double(), h64, w64, t.cpu(), b64,
                                               ref.LossOptions(**LCE_OPTS), reduction)
    for (name, x), e in zip(leaves.items(), expect):
        if name in frozen:
            assert x.grad is None
        else:
            assert_rel_close(x.grad.cpu(), e, TOL[x.dtype], what=name)


def test_frozen_weight_traced_graph_carries_the_flags():
    """Traced (make_fx, as torch.compile's AOTAutograd traces), the forward asks for dhidden
    alone when the weight is frozen, and the graph's gradient is right."""
    from torch.fx.experimental.proxy_tensor import make_fx

    h, w, t, _ = lce_inputs((6,), 16, 40)

    def grads(h, w):
        leaf = h.detach().requires_grad_()
        return torch.autograd.grad(linear_cross_entropy(leaf, w, t, chunk_size=4), leaf)

    gm = make_fx(grads)(h, w)
    calls = [n.kwargs for n in gm.graph.nodes if n.target is torch.ops.flash.linear_cross_entropy_with_grads.default]
    assert len(calls) == 1 and calls[0]["grad_weight"] is False and calls[0]["grad_bias"] is False
    h64 = h.double().requires_grad_()
    F.cross_entropy(h64 @ w.double().t(), t).backward()
    assert_rel_close(gm(h, w)[0], h64.grad, TOL[torch.float32])


def test_gradient_flags_return_empty():
    """grad_*=False: that output is an empty tensor, not computed; the others are unchanged."""
    h, w, t, b = lce_inputs((3, 4), 8, 19, torch.float64)
    full = torch.ops.flash.linear_cross_entropy_with_grads(h, w, t, b, chunk_size=5)
    for flags in ((False, True, True), (True, False, False), (False, False, True)):
        kw = dict(zip(("grad_hidden", "grad_weight", "grad_bias"), flags))
        got = torch.ops.flash.linear_cross_entropy_with_grads(h, w, t, b, chunk_size=5, **kw)
        back = torch.ops.flash.linear_cross_entropy_backward(torch.ones(()), h, w, t, b, chunk_size=5, **kw)
        torch.testing.assert_close(got[0], full[0])
        for want, g, bg, f in zip(flags, got[1:], back, full[1:]):
            if want:
                torch.testing.assert_close(g, f)
                torch.testing.assert_close(bg, f)
            else:
                assert g.numel() == 0 and bg.numel() == 0


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_scale_op(force_backend, backend):
    """flash.linear_cross_entropy_scale_ scales in place, leaves the tensor bitwise as it was
    for 1, names itself on bad input, and raises inside a backward that keeps its graph."""
    force_backend(backend)
    device = DEV if backend == "triton" else "cpu"
    grad = torch.randn(4, 7, device=device)
    before = grad.clone()
    torch.ops.flash.linear_cross_entropy_scale_(grad, torch.ones((), device=device))
    assert torch.equal(grad, before)
    torch.ops.flash.linear_cross_entropy_scale_(grad, torch.full((1,), 0.37, device=device))
    torch.testing.assert_close(grad, before * 0.37)
    with pytest.raises(ValueError, match="flash.linear_cross_entropy_scale_: grad_loss must have one element"):
        torch.ops.flash.linear_cross_entropy_scale_(grad, torch.ones(2, device=device))

    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.grad = torch.ones_like(x)
            return x.sum()

        @staticmethod
        def backward(ctx, g):
            torch.ops.flash.linear_cross_entropy_scale_(ctx.grad, g)
            return ctx.grad

    x = torch.randn(3, device=device, requires_grad=True)
    torch.testing.assert_close(torch.autograd.grad(Scaled.apply(x) * 2.0, x)[0], torch.full_like(x, 2.0))
    with pytest.raises(RuntimeError, match="flash.linear_cross_entropy_scale_: cannot run in a backward with "
                                           "retain_graph=True"):
        torch.autograd.grad(Scaled.apply(x) * 2.0, x, retain_graph=True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_backward_scales_in_place(backend):
    """Compiled with donated buffers (torch's default), the backward hands out the forward's
    gradients scaled in place by flash.linear_cross_entropy_scale_ (no multiply in the graph),
    right for 1 and 0.37, and a retained graph is refused rather than computed twice; without
    donation the graph multiplies, and backward twice through a retained graph stays right."""
    h, w, t, b = _leaves("triton" if DEV == "cuda" else "reference")
    seen = []

    def inner(gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def record(g, _):
            seen.append(str(g.code))
            return make_boxed_func(g.forward)
        return aot_module_simplified(gm, example_inputs, fw_compiler=record, bw_compiler=record)

    def model(h, w, b):
        return linear_cross_entropy(h, w, t, b, chunk_size=5, **LCE_OPTS)

    with torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = torch.compile(model, backend=inner if backend == "aot_eager" else backend, fullgraph=True)
        for scale in (1.0, 0.37):
            got = torch.autograd.grad(compiled(h, w, b), (h, w, b), torch.tensor(scale, device=h.device))
            _check_grads(got, h, w, t, b, scale, **LCE_OPTS)
        if seen:
            assert "flash.linear_cross_entropy_scale_" in seen[1] and "aten.mul" not in seen[1]
        with pytest.raises(RuntimeError, match="retain_graph=False"):
            torch.autograd.grad(compiled(h, w, b), (h, w, b), retain_graph=True)
        torch._dynamo.reset()
        with torch._functorch.config.patch(donated_buffer=False):
            compiled = torch.compile(model, backend=backend, fullgraph=True)
            loss = compiled(h, w, b)
            for scale in (1.0, 0.37):
                got = torch.autograd.grad(loss, (h, w, b), torch.tensor(scale, device=h.device), retain_graph=True)
                _check_grads(got, h, w, t, b, scale, **LCE_OPTS)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_backward_compiles(backend):
    """torch.compile traces the backward once (with an upstream gradient of 1 here): the
    graph must keep the multiply for the later call with 0.37, and .backward() accumulates.
    The Triton kernels on a GPU; the CPU path here (the interpreter cannot run on fake tensors)."""
    h, w, t, b = _leaves("triton" if DEV == "cuda" else "reference")

    def model(h, w, b):
        return linear_cross_entropy(h, w, t, b, chunk_size=5, **LCE_OPTS)

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    # trace the backward here, not from an on-disk cache of a run with other code
    with torch._functorch.config.patch(enable_autograd_cache=False):
        for scale in (1.0, 0.37):
            got = torch.autograd.grad(compiled(h, w, b), (h, w, b), torch.tensor(scale, device=h.device))
            _check_grads(got, h, w, t, b, scale, **LCE_OPTS)
        (compiled(h, w, b) * 0.37).backward()
        compiled(h, w, b).backward()
    _check_grads((h.grad, w.grad, b.grad), h, w, t, b, 1.37, **LCE_OPTS)


def test_compiled_graph_skips_the_host_target_check(monkeypatch):
    """Traced by torch.compile, the autograd forward tells the (opaque) gradient op not to run
    TargetCheck, whose verdict the host would wait for in every run of the graph (on the H100
    that idled the GPU for most of a step's backward launches); eager calls still check."""
    from torch_flash.ops import linear_cross_entropy as ops_lce
    seen = []

    class Spy(ops_lce.TargetCheck):
        def __init__(self, op, target, n_classes, ignore_index, enabled=True):
            seen.append((op, enabled))
            super().__init__(op, target, n_classes, ignore_index, enabled)

    monkeypatch.setattr(ops_lce, "TargetCheck", Spy)
    h, w, t, b = _leaves()
    torch._dynamo.reset()
    compiled = torch.compile(lambda h, w, b: linear_cross_entropy(h, w, t, b), backend="aot_eager",
                             fullgraph=True)
    compiled(h, w, b).backward()  # compiles
    seen.clear()
    compiled(h, w, b).backward()
    assert seen == [("linear_cross_entropy_with_grads", False)]
    seen.clear()
    linear_cross_entropy(h, w, t, b).backward()
    assert seen == [("linear_cross_entropy_with_grads", True)]


@pytest.mark.cuda
def test_compiled_forward_memory_as_eager():
    """Under torch.compile the autograd forward (which computes the gradients) peaks where it
    does eagerly: one dweight buffer, not the two that Inductor's traced chunk loop alternated
    between (+ dweight's size)."""
    h = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(32000, 1024, device="cuda") * 1024**-0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 32000, (4096,), device="cuda")

    def loss():  # 1456 resident tokens, then 6 chunks: their dweight accumulation is what Inductor changed
        return linear_cross_entropy(h, w, t, chunk_size=512)

    def forward_peak(fn):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        del out
        return torch.cuda.max_memory_allocated() - before

    eager = forward_peak(loss)
    torch._dynamo.reset()
    compiled = torch.compile(loss)
    forward_peak(compiled)  # compiles
    assert forward_peak(compiled) <= eager + w.numel() * w.element_size() / 8


@pytest.mark.cuda
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_inductor_many_chunks(reduction):
    """Under Inductor, which traces into the launcher, every chunk's losses reach the output
    (the chunks once wrote slices of one buffer, which torch 2.11's Inductor miscompiled into
    an out-of-bounds read: an illegal memory access in HF LLaMA at 8 chunks on the H100)."""
    h, w, t, b = (x.cuda() for x in lce_inputs((4, 40), 64, 1000))
    t[0, :7] = -100

    def model(h, w, b):
        return linear_cross_entropy(h, w, t, b, chunk_size=16, reduction=reduction, **LCE_OPTS)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    h, w, b = (x.requires_grad_() for x in (h, w, b))
    got, eager = compiled(h, w, b), model(h, w, b)
    torch.testing.assert_close(got, eager)
    h64, w64, b64 = (x.detach().cpu().double() for x in (h, w, b))
    exact = ce_ref.cross_entropy(F.linear(h64, w64, b64), t.cpu(), ref.LossOptions(**LCE_OPTS), reduction)
    assert_rel_close(got.detach().cpu().double(), exact, TOL[torch.float32])


@pytest.mark.cuda
def test_inductor_dynamic_vocabulary():
    """The inference op under Inductor with every size dynamic, then a second vocabulary and
    hidden size: the launcher specializes on both (torch 2.11's Inductor raised an
    AssertionError decomposing the traced kernels at 1024 x 768 x 128000, dynamic=True, and
    after 128256 classes then 128000 without it; smaller shapes passed)."""
    torch._dynamo.reset()
    compiled = torch.compile(linear_cross_entropy, dynamic=True)
    for n, hid, v in ((1024, 768, 128000), (1000, 512, 50257)):
        h = torch.randn(n, hid, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(v, hid, device="cuda", dtype=torch.bfloat16) * hid**-0.5
        t = torch.randint(0, v, (n,), device="cuda")
        with torch.no_grad():
            got, eager = compiled(h, w, t), linear_cross_entropy(h, w, t)
        torch.testing.assert_close(got, eager)
        # the logits are rounded to bf16 once, as F.linear's are
        assert_rel_close(got.double(), F.cross_entropy(F.linear(h.double(), w.double()), t), 1e-3)


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic"])
def test_backward_traces_with_make_fx(mode):
    """make_fx traces the backward with proxied tensors (real ones in "real" mode, where
    reading the upstream gradient would fail or bake it in): the graph traced with an upstream
    gradient of 1 must scale by the one it is replayed with."""
    from torch.fx.experimental.proxy_tensor import make_fx

    h, w, t, b = _leaves()

    def grads(h, w, b, t, g):
        leaves = [x.detach().requires_grad_() for x in (h, w, b)]
        return torch.autograd.grad(linear_cross_entropy(*leaves[:2], t, leaves[2], chunk_size=5), leaves, g)

    traced = make_fx(grads, tracing_mode=mode)(h, w, b, t, torch.tensor(1.0))
    _check_grads(traced(h, w, b, t, torch.tensor(0.37)), h, w, t, b, 0.37)


@pytest.mark.cuda
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_cuda_backward_allocates_no_second_dweight(scale):
    """Triton path, 2048 tokens x 1024 hidden x 32000 classes bf16: the backward allocates
    nothing gradient-sized (out of place it took dweight's 65.5 MB and dhidden's again), and
    afterwards the graph no longer holds the gradients."""
    h = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(32000, 1024, device="cuda") * 1024**-0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 32000, (2048,), device="cuda")
    loss = linear_cross_entropy(h, w, t)
    grad_loss = torch.tensor(scale, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    dh, dw = torch.autograd.grad(loss, (h, w), grad_loss)
    torch.cuda.synchronize()
    dw_bytes = dw.numel() * dw.element_size()
    assert torch.cuda.max_memory_allocated() - before < dw_bytes / 16
    assert torch.cuda.memory_allocated() - before < dw_bytes / 16  # held by the caller alone
    del dh, dw
    assert before - torch.cuda.memory_allocated() >= dw_bytes  # and freed with the caller's references


@pytest.mark.cuda
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_cuda_backward_never_waits_for_the_gpu(scale):
    """The eager backward reads the upstream gradient on the device: with CUDA's sync debug
    mode set to error, a host read (.item()) would raise."""
    h, w, t, b = (x.cuda() for x in lce_inputs((64,), 32, 1000))
    h.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    loss = linear_cross_entropy(h, w, t, b, chunk_size=16)
    grad_loss = torch.tensor(scale, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = torch.autograd.grad(loss, (h, w, b), grad_loss)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _check_grads(got, h, w, t, b, scale)
