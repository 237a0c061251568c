"""Cross-entropy spellings -> flash.cross_entropy / flash.linear_cross_entropy.

Anchors: `aten.cross_entropy_loss` (F.cross_entropy, nn.CrossEntropyLoss), nll_loss of a
log_softmax over the last dim (F.nll_loss(F.log_softmax(x, -1), t)), and `logsumexp(x, -1)
- x.gather(-1, t[..., None])` followed by mean(), sum() or nothing. The class dim must be
the last one; a (B, V, S) input that is `x.transpose(1, 2)` of (B, S, V) logits counts.
From the loss the walk goes up the logits through ops that keep each row of classes whole
(views and reshapes that keep the last dim, slicing leading dims as in HF's label shift,
.contiguous()) and fp32 upcasts of half logits, which the op does itself, so the fp32
logits need not exist. When the logits come from an lm-head `F.linear(h, W)` or
`h @ W.t()` and feed nothing else, the same row ops are replayed on h and the loss becomes
linear_cross_entropy, which never builds the logits. A half loss gets the op's fp32 loss
cast to its dtype. Class weights (weight=) and non-constant options are refused.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..graph import A, cast_dtype, dtype_of, insert_call, is_op, last_dim, location, number, only_user, val
from ..report import Report, Site
from ._shared import (HALF, ROW_RESHAPES, Unmatched, arg, call_checked, conclude, keeps_rows, known_equal, replace,
                      same_value)

FLASH = torch.ops.flash
REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # at::Reduction
NLL = (A.nll_loss_nd.default, A.nll_loss.default, A.nll_loss_forward.default)
LOG_SOFTMAX = (A.log_softmax.int, A._log_softmax.default)


@dataclass
class Loss:
    logits: fx.Node  # the class-last (..., V) logits the loss reads
    target: fx.Node
    out: fx.Node  # the node whose value the fused op replaces
    options: dict = field(default_factory=dict)  # ignore_index, label_smoothing, reduction
    keepdim: bool = False  # "none" loss of logsumexp(keepdim=True): (..., 1)


def _upcast(n: fx.Node) -> bool:
    return cast_dtype(n) == torch.float32 and dtype_of(n.args[0]) in HALF


def _walk_up(logits: fx.Node, want_log_softmax: bool) -> tuple[fx.Node, list[fx.Node], list[fx.Node]] | Unmatched:
    """(source, the row ops passed in source-to-loss order, every node passed) going up the
    logits a loss reads; want_log_softmax: the chain must pass one log_softmax over the
    last dim (the source is then the log_softmax's input)."""
    cur, row_ops, passed, log_softmax = logits, [], [], None
    while True:
        if keeps_rows(cur):
            row_ops.append(cur)
        elif (want_log_softmax and log_softmax is None and is_op(cur, *LOG_SOFTMAX)
              and last_dim(cur.args[1], val(cur).dim())):
            log_softmax = cur
        elif not _upcast(cur):
            break
        passed.append(cur)
        cur = cur.args[0]
    if want_log_softmax and log_softmax is None:
        return Unmatched("the nll_loss input is not log_softmax over the last (class) dimension")
    return cur, row_ops[::-1], passed


def _replay(graph: fx.Graph, before: fx.Node, row_ops: list[fx.Node], base: fx.Node) -> fx.Node:
    """The same row ops applied to base, whose dims are those of their input except
    (possibly) the last."""
    for n in row_ops:
        if is_op(n, A.clone.default, A.contiguous.default):
            continue
        if is_op(n, *ROW_RESHAPES):
            shape = list(n.args[1])
            if n.target != A.expand.default and any(isinstance(s, int) and s == -1 for s in shape[:-1]):
                # a -1 among the leading sizes: the last must be given
                last = val(base).shape[-1]
                if not isinstance(last, int):
                    last = insert_call(graph, before, A.sym_size.int, (base, -1))
                shape[-1] = last
            else:
                shape[-1] = -1
            op = A.expand.default if n.target == A.expand.default else A.reshape.default
            base = insert_call(graph, before, op, (base, shape))
        else:
            base = insert_call(graph, before, n.target, (base, *n.args[1:]), dict(n.kwargs))
    return base


def _transposed(n) -> fx.Node | None:
    """W for W.t(), W.T, W.transpose(0, 1) or W.permute(1, 0) of a 2-D W."""
    if not (isinstance(n, fx.Node) and n.args and val(n.args[0]) is not None and val(n.args[0]).dim() == 2):
        return None
    swap = (is_op(n, A.t.default, A.numpy_T.default)
            or is_op(n, A.transpose.int) and n.args[1] % 2 != n.args[2] % 2
            or is_op(n, A.permute.default) and [d % 2 for d in n.args[1]] == [1, 0])
    return n.args[0] if swap else None


def _lm_head(n: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """(hidden, weight (V, H), bias (V,) or None) for F.linear(h, W, b) or h @ W.t() with
    a plain weight (and bias) of hidden's dtype, or, under autocast (a half result from fp32
    operands), of fp32 and the result's dtype: the caller casts them as autocast does."""
    if is_op(n, A.linear.default):
        h, w, b = n.args[0], n.args[1], arg(n, "bias")
    elif is_op(n, A.matmul.default) and _transposed(n.args[1]) is not None:
        h, w, b = n.args[0], _transposed(n.args[1]), None
    else:
        return None
    plain = val(w).dim() == 2 and (b is None or val(b).dim() == 1)
    dtypes = {dtype_of(t) for t in (h, w, b) if t is not None}
    autocast = dtype_of(n) in HALF and dtypes <= {torch.float32, dtype_of(n)}
    return (h, w, b) if plain and (len(dtypes) == 1 or autocast) else None


def _class_last(x: fx.Node) -> fx.Node | Unmatched:
    """Class-dim-last logits for a loss input whose class dim is 1."""
    v = val(x)
    if v.dim() <= 2:
        return x
    if v.dim() == 3 and (is_op(x, A.transpose.int) and sorted(d % 3 for d in x.args[1:3]) == [1, 2]
                         or is_op(x, A.permute.default) and [d % 3 for d in x.args[1]] == [0, 2, 1]):
        return x.args[0]
    return Unmatched("the class dimension is dim 1 of a (N, C, d1, ...) input, not the last; "
                     "flash.cross_entropy needs (..., C) logits (pass logits.view(-1, C))")


def _options(n: fx.Node, loss: Loss) -> Loss | Unmatched:
    """ignore_index and reduction (plus label_smoothing for cross_entropy_loss) as constants."""
    if arg(n, "weight") is not None:
        return Unmatched("class weights (weight=) are not supported by flash.cross_entropy")
    reduction, ignore_index = arg(n, "reduction", 1), arg(n, "ignore_index", -100)
    smoothing = arg(n, "label_smoothing", 0.0) if n.target == A.cross_entropy_loss.default else 0.0
    if reduction not in REDUCTIONS or type(ignore_index) is not int or number(smoothing) is None:
        return Unmatched("reduction, ignore_index or label_smoothing is not a constant")
    loss.options = {"ignore_index": ignore_index, "label_smoothing": float(smoothing),
                    "reduction": REDUCTIONS[reduction]}
    return loss


def _match_ce(n: fx.Node) -> Loss | Unmatched:
    logits = _class_last(n.args[0])
    if isinstance(logits, Unmatched):
        return logits
    return _options(n, Loss(logits, n.args[1], n))


def _match_nll(n: fx.Node) -> Loss | Unmatched:
    out = n
    if n.target == A.nll_loss_forward.default:  # (loss, total_weight)
        users = list(n.users)
        if len(users) != 1 or not is_op(users[0], operator.getitem) or users[0].args[1] != 0:
            return Unmatched("nll_loss_forward's total_weight is used")
        out = users[0]
    logits = _class_last(n.args[0])
    if isinstance(logits, Unmatched):
        return logits
    return _options(n, Loss(logits, n.args[1], out))


def _match_lse(n: fx.Node) -> Loss | Unmatched | None:
    """logsumexp(x, -1) - x.gather(-1, t.unsqueeze(-1)).squeeze(-1) (both keepdim, or
    neither), then mean(), sum() or nothing; None when the logsumexp is no such loss."""
    x, keepdim = n.args[0], bool(arg(n, "keepdim", False))
    sub = next((u for u in n.users if is_op(u, A.sub.Tensor) and u.args[0] is n), None)
    if sub is None:
        return None
    picked = sub.args[1]
    if not keepdim:
        if not (is_op(picked, A.squeeze.dim) and last_dim(picked.args[1], val(picked.args[0]).dim())):
            return None
        picked = picked.args[0]
    if not is_op(picked, A.gather.default) or not last_dim(picked.args[1], val(x).dim()):
        return None
    index = picked.args[2]
    if not (is_op(index, A.unsqueeze.default) and last_dim(index.args[1], val(index).dim())):
        return None
    if not last_dim(n.args[1], val(x).dim()):
        return Unmatched("logsumexp is not over the last (class) dimension")
    if not same_value(picked.args[0], x):
        return Unmatched("the gathered logits are not the logits of the logsumexp")
    target = index.args[0]
    t_shape, x_shape = val(target).shape, val(x).shape
    if len(t_shape) != len(x_shape) - 1 or not all(map(known_equal, t_shape, x_shape[:-1])):
        return Unmatched("the target does not have the logits' shape without the class dimension")
    reduce = only_user(sub)
    reduction = "mean" if is_op(reduce, A.mean.default) else "sum" if is_op(reduce, A.sum.default) else "none"
    out = sub if reduction == "none" else reduce
    return Loss(x, target, out, {"reduction": reduction}, keepdim=keepdim and reduction == "none")


def _rewrite(gm: fx.GraphModule, loss: Loss, want_log_softmax: bool, site: Site) -> None:
    """Replace loss.out by the flash op, or say on the site why not."""
    graph = gm.graph
    walked = _walk_up(loss.logits, want_log_softmax)
    if isinstance(walked, Unmatched):
        site.reason = walked.reason
        return
    source, row_ops, passed = walked
    head = _lm_head(source)
    if head is not None and all(len(p.users) == 1 for p in (source, *passed)):
        hidden, weight, bias = (t if t is None or dtype_of(t) == dtype_of(source)
                                else insert_call(graph, loss.out, A.to.dtype, (t, dtype_of(source))) for t in head)
        hidden = _replay(graph, loss.out, row_ops, hidden)
        name, args = "linear_cross_entropy", (hidden, weight, loss.target, bias)
    elif len(passed) > len(row_ops):  # a cast or log_softmax to skip: read the source itself
        name, args = "cross_entropy", (_replay(graph, loss.out, row_ops, source), loss.target)
    else:
        name, args = "cross_entropy", (loss.logits, loss.target)
    node = call_checked(graph, loss.out, getattr(FLASH, name).default, args, loss.options)
    if isinstance(node, Unmatched):
        site.reason = node.reason
        return
    model_dtype = dtype_of(loss.out)
    if dtype_of(node) == torch.float32 and model_dtype in HALF:  # the model's half loss of fp32 math
        node = insert_call(graph, loss.out, A.to.dtype, (node, model_dtype))
    if loss.keepdim:
        node = insert_call(graph, loss.out, A.unsqueeze.default, (node, -1))
    conclude(site, replace(graph, loss.out, node, name), name)


def rewrite(gm: fx.GraphModule, report: Report) -> None:
    anchors = [(A.cross_entropy_loss.default, "F.cross_entropy", _match_ce, False)]
    anchors += [(t, "nll_loss", _match_nll, True) for t in NLL]
    anchors += [(A.logsumexp.default, "logsumexp", _match_lse, False)]
    for target, anchor, match, want_log_softmax in anchors:
        for n in list(gm.graph.find_nodes(op="call_function", target=target)):
            loss = match(n)
            if loss is None:
                continue
            site = Site("loss", location(n), anchor)
            report.add(site)
            if isinstance(loss, Unmatched):
                site.reason = loss.reason
            else:
                _rewrite(gm, loss, want_log_softmax, site)
    gm.graph.eliminate_dead_code()
