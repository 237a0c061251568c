"""flash.cross_entropy, its _with_lse form, backward ops and the vocab-parallel shard op; the
loss options, targets and the float64 formula the tests share."""
import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
REDUCTIONS = ["mean", "sum", "none"]
OPTIONS = [{}, {"label_smoothing": 0.1}, {"z_loss": 1e-2}, {"softcap": 3.0},
           {"label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 5.0, "ignore_index": 0}]


def make_logits(shape, dtype=torch.float32, rg=False, noncontig=False):
    if noncontig:  # a strided view over a wider buffer
        x = (torch.randn(*shape[:-1], shape[-1] * 2) * 3).to(dtype)[..., ::2]
    else:
        x = (torch.randn(shape) * 3).to(dtype)
    return x.requires_grad_(rg)


def make_target(batch_shape, n_classes, ignore_index=-100, dtype=torch.int64):
    """Random classes, about a quarter of them ignore_index (and at least one valid row)."""
    t = torch.randint(0, n_classes, batch_shape, dtype=dtype)
    ignored = torch.rand(batch_shape) < 0.25
    ignored.view(-1)[:1] = False
    return t.masked_fill(ignored, ignore_index)


def naive_loss(x, t, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0, reduction="mean"):
    """The op's formula, written out whole in float64 (the ground truth)."""
    z = x.double()
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    logp, lse = z.log_softmax(-1), z.logsumexp(-1)
    valid = t != ignore_index
    nll = -logp.gather(-1, torch.where(valid, t, 0).long().unsqueeze(-1)).squeeze(-1)
    loss = (1 - label_smoothing) * nll - label_smoothing * logp.mean(-1) + z_loss * lse**2
    loss = torch.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / valid.sum()


def _samples_fwd():
    cases = [((6,), 11), ((2, 3), 32), ((2, 3, 2), 7), ((5,), 64), ((3, 4), 17)]
    i = 0
    for batch, n_classes in cases:
        for dtype in DTYPES:
            opts = OPTIONS[i % len(OPTIONS)]
            # inplace_backward only with inputs that need no grad: opcheck copies inputs into
            # leaves, whose values an in-place backward must not destroy (it refuses them)
            inplace = {"inplace_backward": True} if i % 5 == 3 else {}
            x = make_logits((*batch, n_classes), dtype, rg=i % 2 == 0 and not inplace,
                            noncontig=i % 3 == 0 and not inplace)
            t = make_target(batch, n_classes, opts.get("ignore_index", -100),
                            torch.int32 if i % 4 == 1 else torch.int64)
            yield (x, t), {**opts, "reduction": REDUCTIONS[i % 3], **inplace}
            i += 1


def _shard(n_classes, i):
    """(vocab_start, vocab_size) of a shard of n_classes columns: the whole vocabulary, the
    first, a middle or the last shard."""
    return [(0, None), (0, 3 * n_classes), (n_classes, 3 * n_classes), (2 * n_classes, 3 * n_classes)][i % 4]


def _samples_bwd(inplace=False):
    for i, (reduction, dtype, opts) in enumerate(zip(REDUCTIONS * 2, DTYPES * 2, OPTIONS)):
        batch = (2, 3) if i % 2 else (5,)
        vocab_start, vocab_size = _shard(13, i)
        x = make_logits((*batch, 13), dtype, noncontig=i == 1 and not inplace)
        if inplace and i == 1:  # rows 26 apart: written in place
            x = make_logits((*batch, 26), dtype)[..., 13:]
        grad = torch.randn(batch if reduction == "none" else ())
        t = make_target(batch, vocab_size or 13, opts.get("ignore_index", -100))
        lse = None
        if vocab_size is not None:  # a whole-row log-sum-exp, as the vocab-parallel forward gives
            lse = torch.ops.flash.cross_entropy_with_lse(make_logits((*batch, vocab_size), dtype), t, **opts)[1]
        elif i % 2:
            lse = torch.ops.flash.cross_entropy_with_lse(x, t, **opts)[1]
        shard = {} if vocab_size is None else {"vocab_start": vocab_start, "vocab_size": vocab_size}
        yield (grad, x, t, lse), {**opts, "reduction": reduction, **shard}


def _samples_with_lse():
    for (x, t), kw in list(_samples_fwd())[::2]:
        kw.pop("inplace_backward", None)
        yield (x.detach(), t), kw


def _samples_shard_stats():
    for i, dtype in enumerate(DTYPES * 2):
        opts = OPTIONS[i % len(OPTIONS)]
        vocab_start, vocab_size = _shard(9, i)
        x = make_logits((2, 3, 9) if i % 2 else (5, 9), dtype, noncontig=i % 3 == 2)
        t = make_target(x.shape[:-1], vocab_size or 9, opts.get("ignore_index", -100), torch.int32 if i == 1 else torch.int64)
        kw = {"ignore_index": opts.get("ignore_index", -100), "softcap": opts.get("softcap", 0.0)}
        yield (x, t), {**kw, **({} if vocab_size is None else {"vocab_start": vocab_start, "vocab_size": vocab_size})}


OPCHECK_SAMPLES = {
    "cross_entropy": _samples_fwd,
    "cross_entropy_with_lse": _samples_with_lse,
    "cross_entropy_backward": _samples_bwd,
    "cross_entropy_backward_inplace": lambda: _samples_bwd(inplace=True),
    "cross_entropy_shard_stats": _samples_shard_stats,
}
