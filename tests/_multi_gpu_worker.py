"""One rank of tests/test_multi_gpu.py, started by torch.distributed.run (one process a GPU,
NCCL; or CPU processes over gloo, tiny shapes, to check this file without GPUs):

    python -m torch.distributed.run --standalone --nproc-per-node N tests/_multi_gpu_worker.py \
        --out DIR [--device cuda --backend nccl | --device cpu --backend gloo] [--sections ...]

Sections, each against float64 on the whole (unsharded) problem, every input the same on every
rank (seeded generators), errors ||out - ref|| / ||ref|| over the whole tensor (the ranks'
squared norms all-reduced):
- attention: torch_flash.context_parallel_attention (ring), forward (out, lse) and dq, dk, dv,
  both layouts, causal and not, GQA / MHA, bf16 and fp32; bf16 also within 2x single-device
  torch_flash.attention's error; on 4+ ranks also rings of 2 over subgroups {0, 2}, {1, 3};
- cross_entropy: flash.cross_entropy(process_group=...) (vocabulary split over the ranks), every
  option, reduction and inplace_backward, fp32 / bf16, one compiled;
- lm_head: the vocab-parallel lm head (a weight and bias shard per rank, F.linear, then the
  vocab-parallel cross_entropy): loss, dhidden (all-reduced), dweight, dbias;
  and the same head fused, flash.linear_cross_entropy(process_group=...);
- linear_cross_entropy: flash.linear_cross_entropy with the whole vocabulary over token shards,
  loss and gradients all-reduced as data parallelism does;
- timing (no check): ring attention forward + backward per step on N devices against one
  device, at the same total sequence (strong scaling) and at the one device's sequence on every
  rank (weak scaling; medians; CUDA events on GPUs).

Writes DIR/rank{r}.json: {"rank", "world", "device", "torch", "checks": [{"name", "what", "err",
"tol", "ok"}], "timing": [...]}; the test asserts every check's ok.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_flash
from torch_flash.bench._common import kernel_times
from torch_flash.context_parallel import context_parallel_attention, shard_sequence, unshard_sequence
from torch_flash.testing.samples import cross_entropy as ce

from _utils import TOL, rel_err

FP64, FP32, BF16 = torch.float64, torch.float32, torch.bfloat16
SECTIONS = ("attention", "cross_entropy", "lm_head", "linear_cross_entropy", "timing")

# shapes per device type: GPUs at sizes where the kernels tile, CPU processes tiny
SIZES = {
    "cuda": dict(batch=2, seq=2048, head_dim=None, ce_rows=(4, 256), v_local=4000, hidden=256,
                 t_seq=32768, t_heads=16, t_dim=128, warmup=3, iters=10),
    "cpu": dict(batch=1, seq=32, head_dim=16, ce_rows=(3, 8), v_local=8, hidden=8,
                t_seq=64, t_heads=2, t_dim=16, warmup=1, iters=3),
}

# name -> (layout, causal, dtype, Hq, Hkv, D (CPU: SIZES' head_dim), return_lse)
ATTENTION_CASES = {
    "zigzag-causal-gqa-bf16": ("zigzag", True, BF16, 8, 2, 128, False),
    "zigzag-gqa-bf16": ("zigzag", False, BF16, 8, 2, 128, False),
    "contiguous-causal-gqa-lse-bf16": ("contiguous", True, BF16, 8, 2, 128, True),
    "contiguous-gqa-bf16": ("contiguous", False, BF16, 8, 2, 128, False),
    "zigzag-causal-mha-d64-bf16": ("zigzag", True, BF16, 8, 8, 64, False),
    "zigzag-causal-mqa-lse-fp32": ("zigzag", True, FP32, 4, 1, 64, True),
}
SUBGROUP_CASE = "zigzag-causal-gqa-bf16"  # also run on rings of 2 over subgroups, 4+ ranks

PLAIN = {}
ALL = {"ignore_index": 0, "label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 5.0}


def _ce_cases():
    """name -> (dtype, options, reduction, inplace_backward, compiled)."""
    cases = {}
    for i, opts in enumerate(ce.OPTIONS):
        for reduction in ce.REDUCTIONS:
            for dtype in (FP32, BF16):
                for inplace in (False, True):
                    tag = f"{'-inplace' if inplace else ''}-{'bf16' if dtype == BF16 else 'fp32'}"
                    cases[f"opts{i}-{reduction}{tag}"] = (dtype, opts, reduction, inplace, False)
    cases["compiled-fp32"] = (FP32, ALL, "mean", False, True)
    cases["all-ignored-fp32"] = (FP32, {"all_ignored": True}, "mean", False, False)
    return cases


def _lce_cases():
    """name -> (dtype, options, reduction, chunk_size): the lm-head and linear_cross_entropy cases."""
    cases = {}
    for i, opts in enumerate(ce.OPTIONS):
        for j, reduction in enumerate(ce.REDUCTIONS):
            for dtype in (FP32, BF16):
                name = f"opts{i}-{reduction}-{'bf16' if dtype == BF16 else 'fp32'}"
                cases[name] = (dtype, opts, reduction, (0, 128)[(i + j) % 2])
    return cases


CE_CASES, LCE_CASES = _ce_cases(), _lce_cases()


class Checks:
    """The records of one rank: relative errors against their tolerance."""

    def __init__(self):
        self.records = []

    def err(self, name: str, what: str, err: float, tol: float) -> None:
        self.records.append({"name": name, "what": what, "err": err, "tol": tol, "ok": bool(err <= tol)})

    def true(self, name: str, what: str, cond: bool) -> None:
        self.err(name, what, 0.0 if cond else 1.0, 0.0)


def whole_err(local, ref_local, group) -> float:
    """||out - ref|| / ||ref|| over the whole tensor whose shards (this rank's: local, ref_local)
    the ranks of group hold: squared norms in float64, summed over the ranks. NaN stays NaN."""
    diff = (local.detach().double() - ref_local.detach().double()).square().sum()
    sums = torch.stack([diff, ref_local.detach().double().square().sum()])
    dist.all_reduce(sums, group=group)
    return math.sqrt(sums[0].item()) / math.sqrt(sums[1].item())


def _gen(device, name: str, salt: int = 0) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(sum(map(ord, name)) * 1000 + salt)


def _randn(g, *shape, dtype=FP64, scale=1.0):
    return (torch.randn(shape, generator=g, device=g.device, dtype=FP64) * scale).to(dtype)


# --------------------------------------------------------------------------------------
# (a) ring attention
# --------------------------------------------------------------------------------------
def attention64(q, k, v, causal: bool, scale: float):
    """(out, lse) of exact attention written out whole (the float64 reference), GQA by repeat."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, s.logsumexp(-1)


def _attention_grads(fn, inputs, grads):
    """(out, lse, dq, dk, dv) of fn(q, k, v) -> (out, lse) for upstream gradients grads
    (g_out, g_lse or None)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out, lse = fn(*leaves)
    outs, ups = (out, lse) if grads[1] is not None else (out,), [g for g in grads if g is not None]
    torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(ups, outs)])
    return (out.detach(), lse.detach(), *(t.grad for t in leaves))


def attention_case(checks: Checks, name: str, case, group, device, sizes, label: str) -> None:
    layout, causal, dtype, hq, hkv, d, return_lse = case
    d = sizes["head_dim"] or d
    b, s = sizes["batch"], sizes["seq"]
    g = _gen(device, name)
    q = _randn(g, b, hq, s, d, dtype=dtype)
    k, v = (_randn(g, b, hkv, s, d, dtype=dtype) for _ in range(2))
    g_out, g_lse = _randn(g, b, hq, s, d, dtype=dtype), _randn(g, b, hq, s) if return_lse else None
    scale = d ** -0.5
    exact = _attention_grads(lambda *t: attention64(*t, causal, scale), [t.double() for t in (q, k, v)],
                             (g_out.double(), None if g_lse is None else g_lse.double()))
    single = _attention_grads(lambda *t: torch_flash.attention_with_lse(*t, scale=scale, causal=causal),
                              (q, k, v), (g_out, g_lse))

    def shard(t):
        return shard_sequence(t, group, layout=layout)

    def ring(q, k, v):
        return context_parallel_attention(q, k, v, group, causal=causal, scale=scale, layout=layout,
                                          return_lse=True)
    mine = _attention_grads(ring, [shard(t) for t in (q, k, v)],
                            (shard(g_out), None if g_lse is None else shard(g_lse)))
    for i, what in enumerate(("out", "lse", "dq", "dk", "dv")):
        tol = {"out": TOL[dtype], "lse": 10 * TOL[FP32]}.get(what, 3 * TOL[dtype])  # as tests/ops/test_attention.py
        checks.true(label, f"{what} dtype", mine[i].dtype == (FP32 if what == "lse" else dtype))
        err = whole_err(mine[i], shard(exact[i]), group)
        checks.err(label, what, err, tol)
        if dtype == BF16 and what != "lse":  # the CPU test's bar: at most 2x the single device's error
            checks.err(label, f"{what} / single-device {what}", err, 2 * rel_err(single[i], exact[i]))
    whole = unshard_sequence(mine[0], group, layout=layout)
    checks.err(label, "unshard_sequence(out)", rel_err(whole, exact[0]), TOL[dtype])


def attention_section(checks: Checks, device, sizes) -> None:
    world = dist.get_world_size()
    for name, case in ATTENTION_CASES.items():
        attention_case(checks, name, case, dist.group.WORLD, device, sizes, f"attention/{name}/w{world}")
    if world >= 4:  # rings of 2 whose group ranks are not their global ranks
        groups = [dist.new_group([r for r in range(world) if r % 2 == p]) for p in (0, 1)]
        mine = groups[dist.get_rank() % 2]
        attention_case(checks, SUBGROUP_CASE, ATTENTION_CASES[SUBGROUP_CASE], mine, device, sizes,
                       f"attention/{SUBGROUP_CASE}/subgroup-w{world // 2}")


# --------------------------------------------------------------------------------------
# (b) vocab-parallel cross-entropy, the lm head, linear_cross_entropy
# --------------------------------------------------------------------------------------
def _targets(g, rows, n_classes, opts):
    """Class ids, about a quarter ignore_index (all of them for "all_ignored"); the first row
    of every quarter of the rows valid (every rank's token shard has one)."""
    ignore = opts.get("ignore_index", -100)
    t = torch.randint(0, n_classes, rows, generator=g, device=g.device)
    t = t.masked_fill(torch.rand(rows, generator=g, device=g.device) < 0.25, ignore)
    flat = t.view(-1)
    if opts.get("all_ignored"):
        return t.fill_(ignore)
    quarter = max(1, flat.numel() // 4)
    flat[::quarter] = torch.where(flat[::quarter] == ignore, (ignore + 1) % n_classes, flat[::quarter])
    return t


def _loss_opts(opts):
    return {k: v for k, v in opts.items() if k != "all_ignored"}


def _loss_tol(dtype, exact_inputs: bool):
    """Loss tolerance: fp32 math on the same (rounded) inputs; bf16 matmul outputs also round."""
    return TOL[FP32] if dtype == FP32 or exact_inputs else TOL[dtype]


def _check_same_loss(checks, label, loss, group):
    """The loss is the same on every rank (bitwise; NaN equal)."""
    x = loss.detach().double().reshape(-1).nan_to_num(nan=1e300)
    both = torch.stack([x, -x])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    checks.true(label, "loss identical on every rank", torch.equal(both[0], -both[1]))


def cross_entropy_section(checks: Checks, device, sizes) -> None:
    from torch_flash.ops.cross_entropy import cross_entropy

    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    rows, v_local = sizes["ce_rows"], sizes["v_local"]
    cols = slice(rank * v_local, (rank + 1) * v_local)
    for name, (dtype, opts, reduction, inplace, compiled) in CE_CASES.items():
        label = f"cross_entropy/{name}/w{world}"
        g = _gen(device, name, world)
        x = _randn(g, *rows, world * v_local, dtype=dtype, scale=3.0)
        t = _targets(g, rows, world * v_local, opts)
        grad = _randn(g, *(rows if reduction == "none" else ()))
        leaf = x[..., cols].clone().requires_grad_()
        logits = leaf * 1  # an intermediate, as an lm head's output (inplace_backward refuses leaves)

        def loss_fn(logits):
            return cross_entropy(logits, t, reduction=reduction, inplace_backward=inplace,
                                 process_group=group, **_loss_opts(opts))
        fn = torch.compile(loss_fn, backend="aot_eager", fullgraph=True) if compiled else loss_fn
        loss = fn(logits)
        loss.backward(grad.to(loss.dtype))
        x64 = x.double().requires_grad_()
        exact = ce.naive_loss(x64, t, reduction=reduction, **_loss_opts(opts))
        exact.backward(grad)
        _check_same_loss(checks, label, loss, group)
        checks.true(label, "loss dtype", loss.dtype == (FP32 if dtype == BF16 else dtype))
        checks.true(label, "grad dtype", leaf.grad.dtype == dtype)
        # inplace_backward leaves the gradient in the logits; else they are untouched
        after = leaf.grad if inplace else x[..., cols]
        checks.true(label, "logits after backward", torch.equal(logits.detach(), after))
        if opts.get("all_ignored"):  # mean over no rows: NaN, zero gradient (as F.cross_entropy)
            checks.true(label, "loss NaN, zero grad", bool(loss.isnan()) and not leaf.grad.any())
            continue
        checks.err(label, "loss", rel_err(loss, exact), _loss_tol(dtype, True))
        checks.err(label, "dlogits", whole_err(leaf.grad, x64.grad[..., cols], group), TOL[dtype])


def lm_head_section(checks: Checks, device, sizes) -> None:
    """Megatron's vocab-parallel lm head: weight / bias rows of this rank's vocabulary shard,
    F.linear to the logits shard, the vocab-parallel flash.cross_entropy (in place every other
    case); dhidden is the sum of the ranks' partial gradients."""
    from torch_flash.ops.cross_entropy import cross_entropy

    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    rows, v_local, hidden = sizes["ce_rows"], sizes["v_local"], sizes["hidden"]
    cls = slice(rank * v_local, (rank + 1) * v_local)
    for i, (name, (dtype, opts, reduction, chunk_size)) in enumerate(LCE_CASES.items()):
        label = f"lm_head/{name}/w{world}"
        g = _gen(device, name, 100 + world)
        h = _randn(g, *rows, hidden, dtype=dtype)
        w = _randn(g, world * v_local, hidden, dtype=dtype, scale=3 / hidden ** 0.5)
        b = _randn(g, world * v_local, dtype=dtype)
        t = _targets(g, rows, world * v_local, opts)
        grad = _randn(g, *(rows if reduction == "none" else ()))
        leaves = [h.clone().requires_grad_(), w[cls].clone().requires_grad_(), b[cls].clone().requires_grad_()]
        loss = cross_entropy(F.linear(*leaves), t, reduction=reduction, inplace_backward=i % 2 == 1,
                             process_group=group, **_loss_opts(opts))
        loss.backward(grad.to(loss.dtype))
        exact_in = [x.double().requires_grad_() for x in (h, w, b)]
        exact = ce.naive_loss(F.linear(*exact_in), t, reduction=reduction, **_loss_opts(opts))
        exact.backward(grad)
        dh = leaves[0].grad.float()
        dist.all_reduce(dh, group=group)
        _check_same_loss(checks, label, loss, group)
        checks.err(label, "loss", rel_err(loss, exact), _loss_tol(dtype, False))
        checks.err(label, "dhidden", rel_err(dh, exact_in[0].grad), TOL[dtype])
        checks.err(label, "dweight", whole_err(leaves[1].grad, exact_in[1].grad[cls], group), TOL[dtype])
        checks.err(label, "dbias", whole_err(leaves[2].grad, exact_in[2].grad[cls], group), TOL[dtype])
        # the same lm head fused: flash.linear_cross_entropy(process_group=...), dhidden summed by the op
        label = f"lm_head/{name}-fused/w{world}"
        fused = [h.clone().requires_grad_(), w[cls].clone().requires_grad_(), b[cls].clone().requires_grad_()]
        loss = torch_flash.linear_cross_entropy(fused[0], fused[1], t, fused[2], reduction=reduction,
                                                chunk_size=chunk_size, process_group=group, **_loss_opts(opts))
        loss.backward(grad.to(loss.dtype))
        _check_same_loss(checks, label, loss, group)
        checks.err(label, "loss", rel_err(loss, exact), _loss_tol(dtype, False))
        checks.err(label, "dhidden", rel_err(fused[0].grad, exact_in[0].grad), TOL[dtype])
        checks.err(label, "dweight", whole_err(fused[1].grad, exact_in[1].grad[cls], group), TOL[dtype])
        checks.err(label, "dbias", whole_err(fused[2].grad, exact_in[2].grad[cls], group), TOL[dtype])


def linear_cross_entropy_section(checks: Checks, device, sizes) -> None:
    """flash.linear_cross_entropy over this rank's tokens, the whole vocabulary: "sum" losses
    add up, "mean" ones weighted by the rank's share of valid tokens, "none" per token;
    dweight and dbias all-reduced (data parallelism), dhidden per token shard."""
    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    rows, hidden = sizes["ce_rows"], sizes["hidden"]
    n_classes = world * sizes["v_local"]
    n = math.prod(rows)
    mine = slice(rank * n // world, (rank + 1) * n // world)
    for name, (dtype, opts, reduction, chunk_size) in LCE_CASES.items():
        label = f"linear_cross_entropy/{name}/w{world}"
        g = _gen(device, name, 200 + world)
        h = _randn(g, n, hidden, dtype=dtype)
        w = _randn(g, n_classes, hidden, dtype=dtype, scale=3 / hidden ** 0.5)
        b = _randn(g, n_classes, dtype=dtype)
        t = _targets(g, (n,), n_classes, opts)
        grad = _randn(g, *((n,) if reduction == "none" else ()))
        leaves = [h[mine].clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
        loss = torch_flash.linear_cross_entropy(leaves[0], leaves[1], t[mine], leaves[2], reduction=reduction,
                                                chunk_size=chunk_size, **_loss_opts(opts))
        valid = t != opts.get("ignore_index", -100)
        share = valid[mine].sum() / valid.sum() if reduction == "mean" else 1.0
        # the gradient of the global loss (sum over the ranks of share * local loss)
        loss.backward((grad[mine] if reduction == "none" else grad * share).to(loss.dtype))
        exact_in = [x.double().requires_grad_() for x in (h, w, b)]
        exact = ce.naive_loss(F.linear(*exact_in), t, reduction=reduction, **_loss_opts(opts))
        exact.backward(grad)
        grads = [leaves[1].grad.float(), leaves[2].grad.float()]
        for x in grads:
            dist.all_reduce(x, group=group)
        if reduction == "none":
            checks.err(label, "loss", whole_err(loss, exact.detach()[mine], group), _loss_tol(dtype, False))
        else:
            total = (loss.detach().double() * share).reshape(1)
            dist.all_reduce(total, group=group)
            checks.err(label, "loss", rel_err(total[0], exact), _loss_tol(dtype, False))
        checks.err(label, "dhidden", whole_err(leaves[0].grad, exact_in[0].grad[mine], group), TOL[dtype])
        checks.err(label, "dweight", rel_err(grads[0], exact_in[1].grad), TOL[dtype])
        checks.err(label, "dbias", rel_err(grads[1], exact_in[2].grad), TOL[dtype])


# --------------------------------------------------------------------------------------
# (c) timing
# --------------------------------------------------------------------------------------
def _median_ms(fn, device, warmup: int, iters: int, sync=None) -> float:
    """Median milliseconds of fn() over `iters` calls after `warmup`: CUDA events on a GPU,
    the host clock on CPU; sync() (a barrier: the ranks start together) before each call."""
    times = []
    for i in range(warmup + iters):
        if sync is not None:
            sync()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def _kernel_ms(step, calls: int = 3) -> tuple[float, float]:
    """Device time a step of this rank's kernels under torch.profiler: (compute, NCCL), ms.
    A ring step's time minus its compute is the communication left exposed."""
    ms = {"compute": 0.0, "nccl": 0.0}
    for name, kernel_ms, _ in kernel_times(step, calls):
        ms["nccl" if "nccl" in name.lower() else "compute"] += kernel_ms
    return ms["compute"], ms["nccl"]


def _fwd_bwd(attn, q, k, v, g):
    def step():
        torch.autograd.grad(attn(q, k, v), (q, k, v), g)
    return step


def timing_section(device, sizes, seq: int) -> list:
    """Ring attention forward + backward (causal, B=1, bf16 on GPUs) per step on all ranks, the
    slowest rank's median, against torch_flash.attention on rank 0's device alone over seq
    tokens; both layouts, at two scalings: strong (the ring over the same seq tokens, speedup =
    one device's time / the ring's) and weak (seq tokens a rank, world * seq in all; efficiency =
    the ring's throughput / world x one device's, issue 38's target)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    heads, d = sizes["t_heads"], sizes["t_dim"]
    dtype = BF16 if device.type == "cuda" else FP32
    g = _gen(device, "timing", rank)

    def flops(s):  # causal forward, backward 2.5x forward
        return 4 * heads * s * s * d / 2 * 3.5

    def make(s):
        return [_randn(g, 1, heads, s, d, dtype=dtype).requires_grad_() for _ in range(4)]
    single_ms = torch.zeros((), dtype=FP64, device=device)
    if rank == 0:
        q, k, v, go = make(seq)
        single_ms.fill_(_median_ms(_fwd_bwd(lambda *t: torch_flash.attention(*t, causal=True), q, k, v, go),
                                   device, sizes["warmup"], sizes["iters"]))
        del q, k, v, go
    dist.all_reduce(single_ms)  # rank 0's to every rank
    one_ms = single_ms.item()
    rows = []
    for scaling, total in (("strong", seq), ("weak", world * seq)):
        for layout in ("zigzag", "contiguous"):
            q, k, v, go = make(total // world)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

            def ring(q, k, v):
                return context_parallel_attention(q, k, v, causal=True, layout=layout)
            step = _fwd_bwd(ring, q, k, v, go)
            mine = _median_ms(step, device, sizes["warmup"], sizes["iters"], sync=dist.barrier)
            compute_ms, nccl_ms = _kernel_ms(step) if device.type == "cuda" else (None, None)
            del q, k, v, go, step
            slowest = torch.tensor([mine, mine - (compute_ms or 0.0)], dtype=FP64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            ring_ms, exposed_ms = slowest.tolist()
            ring_tflops, single_tflops = flops(total) / ring_ms / 1e9, flops(seq) / one_ms / 1e9
            rows.append({
                "what": "ring attention fwd+bwd per step", "scaling": scaling, "layout": layout, "causal": True,
                "world": world, "seq_total": total, "seq_single": seq, "batch": 1, "heads": heads, "head_dim": d,
                "dtype": str(dtype), "ring_ms": ring_ms, "ring_ms_this_rank": mine, "single_device_ms": one_ms,
                # kernel time a step on this rank; exposed: the most any rank's step exceeds its compute
                "compute_ms_this_rank": compute_ms, "nccl_kernel_ms_this_rank": nccl_ms,
                "exposed_comm_ms": exposed_ms if compute_ms is not None else None,
                "ring_tflops": ring_tflops, "single_tflops": single_tflops,
                **({"speedup": one_ms / ring_ms} if scaling == "strong"
                   else {"efficiency": ring_tflops / (world * single_tflops)}),
                "peak_mem_gib_this_rank": (torch.cuda.max_memory_allocated(device) / 2**30
                                           if device.type == "cuda" else None),
            })
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for rank{r}.json")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--backend", help="default: nccl on cuda, gloo on cpu")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--timing-seq", type=int, help="tokens of the one-device timing (default 32768 on cuda)")
    args = parser.parse_args()
    sizes = SIZES[args.device]
    local = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device, extra = torch.device("cuda", local), {"device_id": torch.device("cuda", local)}
    else:
        torch.set_num_threads(1)  # the ranks share the machine's cores
        device, extra = torch.device("cpu"), {}
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300), **extra)
    try:
        checks, timing = Checks(), []
        sections = {"attention": attention_section, "cross_entropy": cross_entropy_section,
                    "lm_head": lm_head_section, "linear_cross_entropy": linear_cross_entropy_section}
        for name in args.sections:
            if name == "timing":
                timing = timing_section(device, sizes, args.timing_seq or sizes["t_seq"])
            else:
                sections[name](checks, device, sizes)
        rank = dist.get_rank()
        result = {"rank": rank, "world": dist.get_world_size(), "backend": backend, "torch": torch.__version__,
                  "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "sections": args.sections, "checks": checks.records, "timing": timing}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
