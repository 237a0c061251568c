"""flash.layer_norm and flash.add_layer_norm, their _with_stats forms and backward ops."""
import torch

from . import randn_rows

SHAPES = [(2, 8, 64), (1, 3, 16), (5, 32), (7, 1, 96)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def param(n, dtype, rg=False):
    """A fresh weight or bias vector."""
    return torch.randn(n, dtype=dtype, requires_grad=rg)


def _samples_ln():
    for shape in SHAPES:
        for dtype in DTYPES:
            for rg in (False, True):
                for nc in (False, True):
                    n = shape[-1]
                    yield (randn_rows(shape, dtype, rg, nc), param(n, dtype, rg), param(n, dtype, rg), 1e-5), {}
    yield (randn_rows((3, 16), torch.float32, True), None, None, 1e-6), {}
    yield (randn_rows((3, 16), torch.float32, True), param(16, torch.float32, True), None, 1e-6), {"weight_offset": 1.0}
    yield (randn_rows((3, 16), torch.bfloat16, True), None, param(16, torch.float32, True), 1e-6), {}
    yield (randn_rows((3, 16), torch.float32, True), param(16, torch.float32, True), None, 1e-6), {"out_dtype": torch.bfloat16}
    yield (randn_rows((3, 16), torch.float32, True).t(), param(3, torch.float32, True), param(3, torch.float32), 1e-5), {}


def _stats(x, eps=1e-5):
    """The forward's (mean, rstd) of x, as the autograd forward saves them."""
    return torch.ops.flash.layer_norm_with_stats(x.detach(), None, None, eps)[1:]


def _samples_ln_with_stats():
    for i, ((x, w, b, eps), kw) in enumerate(_samples_ln()):
        if i % 3 == 0:
            yield tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in (x, w, b, eps)), kw


def _samples_ln_bwd():
    for shape in SHAPES[:2]:
        for dtype in DTYPES:
            x, n = randn_rows(shape, dtype), shape[-1]
            yield (torch.randn_like(x), x, param(n, dtype), param(n, dtype), 1e-5, 0.0), {}
            yield (torch.randn_like(x), x, param(n, dtype), param(n, dtype), 1e-5, 0.0, *_stats(x)), {}
    x = randn_rows((2, 3, 32), torch.float32, noncontig=True)
    mean, rstd = _stats(x)  # as keywords, rstd column-major
    yield (torch.randn_like(x), x, None, param(32, torch.float32), 1e-5, 0.0), {"mean": mean, "rstd": rstd.t().contiguous().t()}
    x = randn_rows((4, 32), torch.float32)
    yield (torch.randn_like(x), x, None, None, 1e-5, 0.0), {}
    yield (torch.randn_like(x), x, param(32, torch.float32), None, 1e-5, 1.0), {}
    yield (torch.randn_like(x), x, None, param(32, torch.float32), 1e-5, 0.0), {}
    # dx has empty_like(x)'s strides whatever the layouts of x and grad_y (the reference's own
    # result was contiguous for a permuted x, and strided like a last-dim-strided grad_y)
    x = torch.randn(6, 4, 32).transpose(0, 1)
    yield (torch.randn(4, 6, 32), x, param(32, torch.float32), param(32, torch.float32), 1e-5, 0.0), {}
    yield (torch.randn(4, 32, 6).transpose(1, 2), torch.randn(4, 6, 32), None, None, 1e-5, 0.0), {}


def _samples_add():
    for shape in SHAPES[:3]:
        for dtype in DTYPES:
            for rg in (False, True):
                n = shape[-1]
                yield ((randn_rows(shape, dtype, rg), randn_rows(shape, dtype, rg, noncontig=True), param(n, dtype, rg),
                        param(n, dtype, rg), 1e-5), {"residual_in_fp32": rg})
    yield (randn_rows((3, 16), torch.float32, True), randn_rows((3, 16), torch.float32, True), None, None, 1e-5), {}
    yield ((randn_rows((3, 16), torch.float32, True), randn_rows((3, 16), torch.bfloat16, True),
            param(16, torch.float32, True), param(16, torch.float32, True), 1e-5), {"out_dtype": torch.bfloat16})


def _samples_add_with_stats():
    for i, ((x, r, w, b, eps), kw) in enumerate(_samples_add()):
        if i % 3 == 0:
            yield tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in (x, r, w, b, eps)), kw


def _samples_add_bwd():
    for dtype in DTYPES:
        s = randn_rows((3, 5, 32), torch.float32)
        yield ((torch.randn_like(s, dtype=dtype), torch.randn_like(s), s, param(32, dtype), param(32, dtype),
                1e-5, 0.0), {})
        yield ((torch.randn_like(s, dtype=dtype), torch.randn_like(s), s, param(32, dtype), param(32, dtype),
                1e-5, 0.0, *_stats(s)), {})
    yield (torch.randn(4, 16), None, randn_rows((4, 16), torch.float32), None, None, 1e-5, 1.0), {}
    yield (torch.randn(4, 16), None, randn_rows((4, 16), torch.float32), param(16, torch.float32), None, 1e-5, 0.0), {}
    s = randn_rows((4, 16), torch.bfloat16)
    yield (torch.randn_like(s), None, s, None, None, 1e-5, 0.0), dict(zip(("mean", "rstd"), _stats(s)))
    s = torch.randn(6, 4, 16).transpose(0, 1)  # permuted residual_out: d(x + residual) keeps its strides
    yield (torch.randn(4, 6, 16), torch.randn(4, 6, 16), s, param(16, torch.float32), None, 1e-5, 0.0), {}


OPCHECK_SAMPLES = {
    "layer_norm": _samples_ln,
    "layer_norm_with_stats": _samples_ln_with_stats,
    "layer_norm_backward": _samples_ln_bwd,
    "add_layer_norm": _samples_add,
    "add_layer_norm_with_stats": _samples_add_with_stats,
    "add_layer_norm_backward": _samples_add_bwd,
}
