"""flash.rotary, flash.rotary_qk, their in-place forms and backward ops."""
import torch

from ...ops.rotary import rotary_cos_sin

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_x(shape, dtype=torch.float32, rg=False, flash_layout=False):
    """(B, H, S, D); flash_layout gives the .transpose(1, 2) view of a (B, S, H, D) tensor."""
    if flash_layout:
        B, H, S, D = shape
        x = torch.randn(B, S, H, D, dtype=dtype).transpose(1, 2)
    else:
        x = torch.randn(shape, dtype=dtype)
    return x.requires_grad_(rg)


def make_tables(n, rd, dtype=torch.float32):
    return rotary_cos_sin(n, rd, dtype=dtype)


def make_packed(lengths, H, D, dtype=torch.float32, rg=False):
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return torch.randn(sum(lengths), H, D, dtype=dtype).requires_grad_(rg), cu


def _samples_rotary():
    for dtype in DTYPES:
        for interleaved in (False, True):
            for rg in (False, True):
                rd = 16 if interleaved == rg else 8  # full and partial rotary
                c, s = make_tables(12, rd, dtype if rg else torch.float32)
                yield ((make_x((2, 3, 5, 16), dtype, rg, flash_layout=rg), c, s),
                       {"interleaved": interleaved, "seqlen_offset": 3 * rg})
    c, s = make_tables(12, 8)
    yield (make_x((2, 2, 4, 8), rg=True), c, s, torch.tensor([0, 7])), {}
    x, cu = make_packed([3, 0, 5], 2, 8, rg=True)
    yield (x, c, s, torch.tensor([1, 2, 4], dtype=torch.int32), cu), {"interleaved": True}
    yield (x, c, s, None, cu), {"seqlen_offset": 2}
    pos = torch.randint(0, 12, (2, 4))
    yield (make_x((2, 3, 4, 8), rg=True), c[pos], s[pos]), {}
    yield (make_x((2, 3, 4, 12), torch.bfloat16), c[None, :4].expand(2, 4, 4), s[None, :4].expand(2, 4, 4)), {}


def _samples_rotary_bwd():
    for dtype in DTYPES:
        c, s = make_tables(10, 8)
        yield (make_x((2, 2, 4, 12), dtype, flash_layout=True), c, s), {"seqlen_offset": 1, "conjugate": True}
    x, cu = make_packed([2, 4], 2, 8)
    yield (x, c, s, torch.tensor([3, 0]), cu), {"interleaved": True}
    yield (make_x((1, 2, 3, 8), rg=True), c, s), {}


def make_qk(B, Hq, Hk, S, D, dtype=torch.float32, rg=False, flash_layout=False):
    """q (B, Hq, S, D) and k (B, Hk, S, D); rg makes them non-leaf (in-place ops may write them)."""
    q, k = (make_x((B, h, S, D), dtype, flash_layout=flash_layout) for h in (Hq, Hk))
    if rg:
        q, k = (t.requires_grad_() * 1 for t in (q, k))  # mul keeps the (B, S, H, D) strides
    return q, k


def _samples_qk():
    """Shared by rotary_qk and rotary_qk_ (inputs that require grad are non-leaf, writable)."""
    c, s = make_tables(12, 8)
    for dtype, rg, interleaved in ((torch.float32, True, False), (torch.bfloat16, False, True)):
        yield ((*make_qk(2, 4, 2, 5, 12, dtype, rg, flash_layout=True), c, s),
               {"interleaved": interleaved, "seqlen_offset": 2})
    yield (*make_qk(2, 2, 1, 4, 8, rg=True), c, s, torch.tensor([0, 7])), {}
    (q, cu), (k, _) = make_packed([3, 0, 5], 4, 8), make_packed([3, 0, 5], 1, 8)
    yield (q, k, c, s, torch.tensor([1, 2, 4], dtype=torch.int32), cu), {"interleaved": True}
    pos = torch.randint(0, 12, (2, 4))
    yield (*make_qk(2, 3, 1, 4, 8), c[pos], s[pos]), {"conjugate": True}


def _samples_qk_bwd():
    c, s = make_tables(10, 8)
    yield (*make_qk(2, 4, 2, 4, 12, torch.bfloat16, flash_layout=True), c, s), {"seqlen_offset": 1}
    (q, cu), (k, _) = make_packed([2, 4], 2, 8), make_packed([2, 4], 1, 8)
    yield (q, k, c, s, torch.tensor([3, 0]), cu), {"interleaved": True, "conjugate": True}
    yield (*make_qk(1, 2, 2, 3, 8, rg=True), c, s), {}


def _samples_rotary_inplace():
    c, s = make_tables(12, 8)
    yield (make_x((2, 3, 5, 12), torch.bfloat16, flash_layout=True), c, s), {"interleaved": True, "seqlen_offset": 3}
    yield (make_x((2, 2, 4, 8), rg=True) * 1, c, s, torch.tensor([0, 7])), {"conjugate": True}
    x, cu = make_packed([3, 0, 5], 2, 8)
    yield (x, c, s, None, cu), {"seqlen_offset": 2}


OPCHECK_SAMPLES = {"rotary": _samples_rotary, "rotary_backward": _samples_rotary_bwd,
                   "rotary_qk": _samples_qk, "rotary_qk_backward": _samples_qk_bwd,
                   "rotary_": _samples_rotary_inplace, "rotary_qk_": _samples_qk}
