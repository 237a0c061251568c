"""Context-parallel (ring) attention: the sequence split over the ranks of a torch.distributed
process group, exact attention over the whole of it.

Each rank holds q (B, Hq, S_local, D), k (B, Hkv, S_local, D), v (B, Hkv, S_local, Dv) of its
tokens. Key/value blocks travel round the ring (rank r sends to r + 1) through
`dist.batch_isend_irecv`, the next block in flight while the current one is attended to; the
partial outputs of flash.attention_with_lse are merged by their log-sum-exp. The backward
runs flash.attention_backward on each block pair with the merged (global) out and lse, and
passes each block's dK / dV accumulator round the ring behind it until it is home.

Layouts (which tokens rank r of W holds; S = W * S_local):
- "contiguous": tokens [r * S_local, (r + 1) * S_local). Causal leaves rank r idle W - 1 - r
  steps of W.
- "zigzag": the sequence cut into 2W chunks of S_local / 2, rank r holding chunks r and
  2W - 1 - r, concatenated. Causal: every step but the first is half a block pair on every
  rank (rank r's queries see all of an earlier rank's first chunk; a later rank's chunks are
  both seen by rank r's second chunk only), so no rank idles.
sequence_positions / shard_sequence / unshard_sequence map a whole sequence to a layout and
back. Without causal the layout changes nothing but which tokens a rank holds.

Communication is torch.distributed only (NCCL on GPUs, gloo on CPU); dK / dV and the running
output travel and accumulate in fp32 (fp64 for fp64 inputs).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

LAYOUTS = ("zigzag", "contiguous")


def _check(cond: bool, who: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"torch_flash.{who}: {msg}")


def _group_of(group, who: str):
    _check(dist.is_available() and dist.is_initialized(), who, "torch.distributed is not initialised")
    group = dist.group.WORLD if group is None else group
    _check(isinstance(group, dist.ProcessGroup), who,
           f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    return group


def sequence_positions(seq_len: int, world_size: int, rank: int, layout: str = "zigzag",
                       device=None) -> Tensor:
    """The global positions (S_local,) int64 of the tokens that `rank` holds, in its order.
    seq_len must split evenly: into world_size parts ("contiguous") or 2 * world_size chunks
    ("zigzag"). Also the rotary positions of those tokens (index the cos / sin tables)."""
    who = "sequence_positions"
    _check(layout in LAYOUTS, who, f"layout must be one of {LAYOUTS}, got {layout!r}")
    _check(0 <= rank < world_size, who, f"rank {rank} outside [0, {world_size})")
    parts = world_size if layout == "contiguous" else 2 * world_size
    _check(seq_len % parts == 0, who, f"seq_len {seq_len} does not split into {parts} equal parts ({layout})")
    n = seq_len // parts
    chunks = (rank,) if layout == "contiguous" else (rank, 2 * world_size - 1 - rank)
    return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in chunks])


def shard_sequence(x: Tensor, group=None, *, layout: str = "zigzag", dim: int = 2) -> Tensor:
    """This rank's tokens of a whole sequence x (its dim `dim`, default SDPA's 2), in `layout`:
    x.index_select(dim, sequence_positions(...)), a copy."""
    group = _group_of(group, "shard_sequence")
    pos = sequence_positions(x.shape[dim], dist.get_world_size(group), dist.get_rank(group), layout, x.device)
    return x.index_select(dim, pos)


def unshard_sequence(x: Tensor, group=None, *, layout: str = "zigzag", dim: int = 2) -> Tensor:
    """The whole sequence from every rank's tokens x (dim `dim`) in `layout`: an all_gather,
    then each token put back at its position. Every rank gets it; not differentiable."""
    group = _group_of(group, "unshard_sequence")
    world = dist.get_world_size(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    s = x.shape[dim] * world
    pos = torch.cat([sequence_positions(s, world, r, layout, x.device) for r in range(world)])
    return torch.cat(parts, dim).index_select(dim, torch.argsort(pos))


class _Ring:
    """One rank's ring: its neighbours' global ranks and the exchange of tensors with them
    (send to the next rank, receive the same shapes from the previous)."""

    def __init__(self, group):
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def start(self, tensors: tuple[Tensor, ...]) -> "_Exchange":
        """Starts sending `tensors` (contiguous, left unchanged until the exchange is waited on)
        to the next rank and receiving their likes from the previous one. A ring of one rank
        passes them to itself."""
        if self.world == 1:
            return _Exchange([], tensors, tensors)
        recv = tuple(torch.empty_like(t) for t in tensors)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recv]
        return _Exchange(dist.batch_isend_irecv(ops), tensors, recv)


class _Exchange:
    """One ring step's sends and receives in flight; holds the sent tensors until they are done."""

    def __init__(self, works: list, sent: tuple[Tensor, ...], recv: tuple[Tensor, ...]):
        self.works, self.sent, self.recv = works, sent, recv

    def wait(self) -> tuple[Tensor, ...]:
        """The received tensors, once every send and receive of the step is complete."""
        for w in self.works:
            w.wait()
        self.works, self.sent = [], None
        return self.recv


def _block(ring: _Ring, step: int, causal: bool, layout: str, s_local: int):
    """What rank `ring.rank` computes at `step`, against the key/value block of rank
    (rank - step) mod W: (query rows, key rows, causal) as slices of the local and the
    visiting block, or None to skip. Equal-length diagonal blocks only are causal, where
    flash.attention's bottom-right alignment is plain causal."""
    full = slice(0, s_local)
    if not causal:
        return full, full, False
    if step == 0:  # the rank's own block: causal (zigzag: its chunks are in increasing order)
        return full, full, True
    src = (ring.rank - step) % ring.world
    if layout == "contiguous":
        return (full, full, False) if src < ring.rank else None
    half = s_local // 2
    if src < ring.rank:  # both local chunks come after src's first chunk and before its second
        return full, slice(0, half), False
    return slice(half, s_local), full, False  # only the local second chunk comes after both


def _merge(acc: Optional[tuple[Tensor, Tensor]], out: Tensor, lse: Tensor, rows: slice):
    """acc (out in the lse dtype, lse) with a partial (out, lse) of the query rows `rows`,
    merged by log-sum-exp, in place."""
    if acc is None:
        return out.to(lse.dtype), lse.clone()
    acc_out, acc_lse = acc[0][:, :, rows], acc[1][:, :, rows]
    new = torch.logaddexp(acc_lse, lse)
    # rows that see no key yet keep lse -inf: weigh against 0 instead of -inf (no nan)
    ref = new.masked_fill(new == float("-inf"), 0)
    acc_out.mul_(torch.exp(acc_lse - ref).unsqueeze(-1)).add_(out * torch.exp(lse - ref).unsqueeze(-1))
    acc_lse.copy_(new)
    return acc


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, layout):
        ring = _Ring(group)
        s_local = q.shape[2]
        kv = (k.contiguous(), v.contiguous())
        acc = None
        for step in range(ring.world):
            nxt = ring.start(kv) if step + 1 < ring.world else None
            blk = _block(ring, step, causal, layout, s_local)
            if blk is not None:
                rows, keys, blk_causal = blk
                out, lse = torch.ops.flash.attention_with_lse(
                    q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], scale=scale, causal=blk_causal)
                acc = _merge(acc, out, lse, rows)
            if nxt is not None:
                kv = nxt.wait()
        out, lse = acc[0].to(q.dtype), acc[1]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.scale, ctx.layout = ring, causal, scale, layout
        # an unused output's gradient stays None: a zero grad_lse would cost every block's
        # backward the paths that take none (PyTorch's CPU kernel, cuDNN)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        ring, s_local = ctx.ring, q.shape[2]
        cdt = lse.dtype
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        kv = (k.contiguous(), v.contiguous())
        dkv = None  # the exchange that brings this step's block its dK / dV accumulator
        for step in range(ring.world):
            nxt = ring.start(kv) if step + 1 < ring.world else None
            blk = _block(ring, step, ctx.causal, ctx.layout, s_local)
            dk = torch.zeros(kv[0].shape, dtype=cdt, device=q.device)
            dv = torch.zeros(kv[1].shape, dtype=cdt, device=q.device)
            if blk is not None:
                rows, keys, blk_causal = blk
                # the global out and lse: each block's probabilities are exp(s - lse_global)
                g_lse = None if grad_lse is None else grad_lse[:, :, rows].contiguous()
                bq, bk, bv, _, _ = torch.ops.flash.attention_backward(
                    grad_out[:, :, rows].contiguous(), g_lse, q[:, :, rows], kv[0][:, :, keys],
                    kv[1][:, :, keys], None, out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(),
                    ctx.scale, blk_causal, -1, -1, 0.0, 0.0, None, False)
                dq[:, :, rows] += bq
                dk[:, :, keys] += bk
                dv[:, :, keys] += bv
            if dkv is not None:  # sent by the previous rank behind the block, while we computed
                dk_in, dv_in = dkv.wait()
                dk += dk_in
                dv += dv_in
            # on to the next rank; after the last step that is the block's home (and this
            # rank's own accumulator arrives from the previous rank)
            dkv = ring.start((dk, dv))
            if nxt is not None:
                kv = nxt.wait()
        dk, dv = dkv.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


@torch.compiler.disable  # Python-driven communication: runs eagerly inside compiled code
def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, group=None, *, causal: bool = False,
                               scale: Optional[float] = None, layout: str = "zigzag",
                               return_lse: bool = False):
    """Exact self-attention over a sequence split across the ranks of `group` (default: the
    world), as torch_flash.attention over the whole sequence would compute it.

    q (B, Hq, S_local, D), k (B, Hkv, S_local, D), v (B, Hkv, S_local, Dv), Hq % Hkv == 0: this
    rank's tokens in `layout` ("zigzag" or "contiguous", see the module docstring and
    shard_sequence), S_local equal on every rank (even for causal zigzag). Returns out
    (B, Hq, S_local, Dv) in q's dtype for the same tokens, and with return_lse also lse
    (B, Hq, S_local) fp32 (fp64 for fp64 inputs), both differentiable. scale defaults to
    D ** -0.5; causal masks by global position. Every rank of the group must call it with the
    same shapes (not checked: a mismatch hangs or fails in the transport). No bias, window,
    softcap, ALiBi, sinks, dropout or varlen.
    """
    who = "context_parallel_attention"
    group = _group_of(group, who)
    _check(layout in LAYOUTS, who, f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(isinstance(t, Tensor) and t.dim() == 4, who, f"{name} must be a 4-d tensor (B, H, S_local, D)")
    _check(k.shape[2] == q.shape[2], who,
           f"self-attention: k has {k.shape[2]} tokens but q has {q.shape[2]} (a rank holds the same tokens of both)")
    _check(not (causal and layout == "zigzag" and q.shape[2] % 2), who,
           f"causal zigzag needs an even S_local (two chunks), got {q.shape[2]}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, lse = _RingAttention.apply(q, k, v, group, bool(causal), scale, layout)
    return (out, lse) if return_lse else out


class ContextParallelAttention(nn.Module):
    """context_parallel_attention as a module: forward(q, k, v) -> out, with the group,
    causal, scale and layout fixed at construction. Holds no parameters."""

    def __init__(self, group=None, causal: bool = False, scale: Optional[float] = None,
                 layout: str = "zigzag"):
        super().__init__()
        _check(layout in LAYOUTS, "ContextParallelAttention", f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.group, self.causal, self.scale, self.layout = group, causal, scale, layout

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return context_parallel_attention(q, k, v, self.group, causal=self.causal, scale=self.scale,
                                          layout=self.layout)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, scale={self.scale}, layout={self.layout!r}"
