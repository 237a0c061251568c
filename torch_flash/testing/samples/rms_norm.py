"""flash.rms_norm and flash.add_rms_norm, with their backward ops."""
import torch

from . import randn_rows

SHAPES = [(2, 8, 64), (1, 3, 16), (5, 32), (7, 1, 96)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _layout_pairs():
    """(x, grad_y) whose layouts differ: a permuted x with a contiguous grad_y, a contiguous x
    with a last-dim-strided grad_y."""
    yield torch.randn(6, 4, 16).transpose(0, 1), torch.randn(4, 6, 16)
    yield torch.randn(4, 6, 16), torch.randn(4, 16, 6).transpose(1, 2)


def _samples_rms():
    for shape in SHAPES:
        for dtype in DTYPES:
            for rg in (False, True):
                for nc in (False, True):
                    w = torch.randn(shape[-1], dtype=dtype, requires_grad=rg)
                    yield (randn_rows(shape, dtype, rg, nc), w, 1e-5), {"cast_before_weight": nc}
    yield (randn_rows((3, 16), torch.float32, True), None, 1e-6), {}
    yield (randn_rows((3, 16), torch.bfloat16, True), torch.randn(16, requires_grad=True), 1e-6), {"weight_offset": 1.0}
    # autocast's fp32 y written in bf16, and a bf16 y widened
    yield (randn_rows((3, 16), torch.float32, True), torch.randn(16, requires_grad=True), 1e-6), {"out_dtype": torch.bfloat16}
    yield (randn_rows((3, 16), torch.bfloat16, True), None, 1e-6), {"out_dtype": torch.float32}


def _samples_rms_bwd():
    for shape in SHAPES[:2]:
        for dtype in DTYPES:
            x = randn_rows(shape, dtype)
            yield (torch.randn_like(x), x, torch.randn(shape[-1], dtype=dtype), 1e-5, 0.0, True), {}
    x = randn_rows((4, 32), torch.float32)
    yield (torch.randn_like(x), x, None, 1e-5, 0.0, False), {}
    # dx has empty_like(x)'s strides whatever the layouts of x and grad_y (the reference's own
    # result was contiguous for a permuted x, and strided like a last-dim-strided grad_y)
    for x, g in _layout_pairs():
        yield (g, x, torch.randn(x.shape[-1]), 1e-5, 0.0, True), {}


def _samples_add():
    for shape in SHAPES[:3]:
        for dtype in DTYPES:
            for rg in (False, True):
                w = torch.randn(shape[-1], dtype=dtype, requires_grad=rg)
                yield ((randn_rows(shape, dtype, rg), randn_rows(shape, dtype, rg, noncontig=True), w, 1e-5),
                       {"residual_in_fp32": rg})
    yield ((randn_rows((3, 16), torch.float32, True), randn_rows((3, 16), torch.bfloat16, True),
            torch.randn(16, requires_grad=True), 1e-5), {"out_dtype": torch.bfloat16})


def _samples_add_bwd():
    for dtype in DTYPES:
        s = randn_rows((3, 5, 32), torch.float32)
        yield ((torch.randn_like(s, dtype=dtype), torch.randn_like(s), s, torch.randn(32, dtype=dtype),
                1e-5, 0.0, True, dtype), {})
    yield ((torch.randn(4, 16), None, randn_rows((4, 16), torch.float32), None, 1e-5, 1.0, False,
            torch.float32), {})
    for s, g in _layout_pairs():
        yield (g, g, s, torch.randn(16), 1e-5, 0.0, True, torch.float32), {}


OPCHECK_SAMPLES = {
    "rms_norm": _samples_rms,
    "rms_norm_backward": _samples_rms_bwd,
    "add_rms_norm": _samples_add,
    "add_rms_norm_backward": _samples_add_bwd,
}
