"""Rotary embedding of q and k, forward and backward, bf16: `python -m torch_flash.bench rotary`.

LLaMA-7B-like heads (32 q and 32 k heads of 128), q and k as the (B, H, S, D) views of
(B, S, H, D) projections that HF models make. Implementations: ours, the ops as the public
functions call them (so the eager rows carry the host cost users see), once per tensor
("ours": flash.rotary twice, backward flash.rotary_backward) or q and k in one launch
("ours_qk": flash.rotary_qk, flash.rotary_qk_backward), and in place ("_inplace": flash.rotary_
/ flash.rotary_qk_, the backward as their conjugate rotation); eager HF `q * cos +
rotate_half(q) * sin`, torch.compile of it, Liger-Kernel's liger_rotary_pos_emb and quack's
apply_rotary_emb (on the (B, S, H, D) tensors, once each for q and k) where installed. Bytes
moved = q and k read and written once, plus the (S, rd/2) fp32 cos/sin tables. On a GPU each
pass is timed eagerly and as CUDA graph replay (norm.TIMINGS).
"""
from __future__ import annotations

import torch

from ..testing.llama import rotate_half
from ._common import compile_fresh, optional_peer, within_budget
from .norm import TIMINGS, autograd_pair, plot_bars, time_impls

HEADS, HEAD_DIM = 32, 128
SHAPES = [(1, 4096), (4, 4096), (1, 16384)]  # (batch, seqlen)
QUICK = [(1, 1024)]
CPU_SHAPES = [(1, 16)]  # smoke run under TRITON_INTERPRET=1


def _hf_rope(q, k, cos, sin):  # cos/sin (S, D), halves duplicated, in q's dtype
    cos, sin = cos[None, None], sin[None, None]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _liger():
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        return None
    return lambda q, k, cos, sin: liger_rotary_pos_emb(q, k, cos[None], sin[None])


def _quack():
    """quack's rotary as f(q, k, cos, sin) on (B, H, S, D) views of (B, S, H, D) tensors and
    (S, D/2) tables, returning (B, S, H, D) results; None where not importable."""
    rotary = optional_peer("quack.rotary", "apply_rotary_emb")
    if rotary is None:
        return None
    return lambda q, k, cos, sin: (rotary(q.transpose(1, 2), cos, sin), rotary(k.transpose(1, 2), cos, sin))


def run(args) -> list[dict]:
    from ..ops._autograd import call

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = CPU_SHAPES if device == "cpu" else (QUICK if args.quick else SHAPES)
    heads = 2 if device == "cpu" else HEADS
    liger = _liger()
    quack = _quack()
    rows: list[dict] = []
    for batch, seqlen in within_budget("rotary", args, shapes):
        compiled = compile_fresh(_hf_rope)
        q, k, gq, gk = (torch.randn(batch, seqlen, heads, HEAD_DIM, device=device, dtype=torch.bfloat16)
                        .transpose(1, 2) for _ in range(4))
        inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, device=device) / HEAD_DIM)
        angles = torch.arange(seqlen, device=device)[:, None] * inv_freq
        cos, sin = angles.cos(), angles.sin()  # (S, D/2): our tables
        cos_full, sin_full = (torch.cat((t, t), -1).to(q.dtype) for t in (cos, sin))  # HF's

        def ours(a, b, backward=False, in_place=False):
            if in_place:
                call("rotary_", a, cos, sin, conjugate=backward)
                call("rotary_", b, cos, sin, conjugate=backward)
                return a, b
            op = "rotary_backward" if backward else "rotary"
            return call(op, a, cos, sin), call(op, b, cos, sin)

        def ours_qk(a, b, backward=False, in_place=False):
            if in_place:
                call("rotary_qk_", a, b, cos, sin, conjugate=backward)
                return a, b
            return call("rotary_qk_backward" if backward else "rotary_qk", a, b, cos, sin)

        # the tables are constants: no gradient (Liger gives none)
        pairs = {name: None if f is None else autograd_pair(
                     lambda a, b, f=f: f(a, b, cos_full, sin_full), [q, k], (gq, gk))
                 for name, f in (("eager", _hf_rope), ("compile", compiled), ("liger", liger))}
        pairs["quack"] = None if quack is None else autograd_pair(
            lambda a, b: quack(a, b, cos, sin), [q, k], (gq.transpose(1, 2), gk.transpose(1, 2)))
        # in place rotates the same buffers again on every call: fine for timing
        qi, ki, gqi, gki = (t.clone() for t in (q, k, gq, gk))
        impls: dict[str, dict] = {"forward": {}, "backward": {}}
        for name, fn in (("ours", ours), ("ours_qk", ours_qk)):
            impls["forward"].update({name: lambda fn=fn: fn(q, k),
                                     f"{name}_inplace": lambda fn=fn: fn(qi, ki, in_place=True)})
            impls["backward"].update({name: lambda fn=fn: fn(gq, gk, backward=True),
                                      f"{name}_inplace": lambda fn=fn: fn(gqi, gki, backward=True, in_place=True)})
        nbytes = 2 * (q.numel() + k.numel()) * q.element_size() + 2 * cos.numel() * cos.element_size()
        for pass_, i in (("forward", 0), ("backward", 1)):
            timed = {**impls[pass_], **{name: None if p is None else p[i] for name, p in pairs.items()}}
            for timing in TIMINGS[device]:
                time_impls(rows, timed, nbytes, device, graph=timing == "graph", op="rotary",
                           shape=[batch, heads, seqlen, HEAD_DIM], timing=timing, **{"pass": pass_})
    return rows


def plot(data: dict, path: str) -> None:
    plot_bars(data, path, ("op", "pass", "timing"))
