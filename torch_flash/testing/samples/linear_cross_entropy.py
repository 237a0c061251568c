"""flash.linear_cross_entropy, its _with_grads form and backward ops."""
import torch

from .cross_entropy import DTYPES, OPTIONS, REDUCTIONS


def lce_inputs(batch, hidden_size, n_classes, dtype=torch.float32, bias=True, rg=(False, False, False),
               noncontig=False, ignore_index=-100, target_dtype=torch.int64):
    """(hidden, weight, target, bias); about a quarter of the targets are ignore_index."""
    if noncontig:  # hidden as a strided view over a wider buffer
        h = torch.randn(*batch, hidden_size * 2).to(dtype)[..., ::2]
    else:
        h = torch.randn(*batch, hidden_size).to(dtype)
    w = (torch.randn(n_classes, hidden_size) / hidden_size**0.5 * 3).to(dtype)
    b = torch.randn(n_classes).to(dtype) if bias else None
    t = torch.randint(0, n_classes, batch, dtype=target_dtype)
    ignored = torch.rand(batch) < 0.25
    ignored.view(-1)[:1] = False
    t = t.masked_fill(ignored, ignore_index)
    for tensor, flag in zip((h, w, b), rg):
        if tensor is not None:
            tensor.requires_grad_(flag)
    return h, w, t, b


def _samples_fwd():
    cases = [((6,), 8, 13), ((2, 3), 16, 7), ((2, 2, 3), 4, 33), ((5,), 12, 64)] * 2
    rgs = [(True, True, True), (False, False, False), (True, False, False), (False, True, True)]
    for i, (batch, hidden_size, n_classes) in enumerate(cases):
        opts = OPTIONS[i % len(OPTIONS)]
        h, w, t, b = lce_inputs(batch, hidden_size, n_classes, DTYPES[i % 3], bias=i % 2 == 0, rg=rgs[i % 4],
                                noncontig=i % 3 == 0, ignore_index=opts.get("ignore_index", -100),
                                target_dtype=torch.int32 if i % 5 == 1 else torch.int64)
        yield (h, w, t, b), {**opts, "reduction": REDUCTIONS[i // 3], "chunk_size": (0, 2, 5, 1)[i % 4]}


def _samples_bwd():
    for i, (reduction, dtype, opts) in enumerate(zip(REDUCTIONS * 2, DTYPES * 2, OPTIONS)):
        batch = (2, 3) if i % 2 else (5,)
        h, w, t, b = lce_inputs(batch, 8, 11, dtype, bias=i % 2 == 0, noncontig=i == 1,
                                ignore_index=opts.get("ignore_index", -100))
        grad = torch.randn(batch if reduction == "none" else ())
        flags = dict(zip(("grad_hidden", "grad_weight", "grad_bias"), ((True,) * 3, (True, False, False),
                                                                      (False, True, False))[i % 3]))
        yield (grad, h, w, t, b), {**opts, "reduction": reduction, "chunk_size": i % 3, **flags}


def _samples_with_grads():
    for i, (dtype, opts) in enumerate(zip(DTYPES * 2, OPTIONS)):
        h, w, t, b = lce_inputs((2, 3) if i % 2 else (5,), 8, 11, dtype, bias=i % 2 == 0, noncontig=i == 1,
                                ignore_index=opts.get("ignore_index", -100))
        flags = dict(zip(("grad_hidden", "grad_weight", "grad_bias"), ((True,) * 3, (False, True, True),
                                                                      (True, False, False))[i % 3]))
        yield (h, w, t, b), {**opts, "reduction": REDUCTIONS[i % 2], "chunk_size": i % 3, **flags}


def _samples_scale():
    for dtype, g in zip(DTYPES, (0.37, 1.0, -2.5)):
        yield (torch.randn(3, 5, dtype=dtype), torch.tensor(g)), {}


OPCHECK_SAMPLES = {
    "linear_cross_entropy": _samples_fwd,
    "linear_cross_entropy_backward": _samples_bwd,
    "linear_cross_entropy_with_grads": _samples_with_grads,
    "linear_cross_entropy_scale_": _samples_scale,
}
