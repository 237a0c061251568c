"""KV-cache decoding, bf16: `python -m torch_flash.bench decode`.

One decoding step (Sq = 1) of 32 q heads over 8 kv heads of 128 (LLaMA-3-8B-like), batch x
cache length from batch 32 with 32k-token caches down to batch 1 with 128k. Every cache is
full at the timed step (cache_seqlens = S - 1 plus the appended token), so all S keys count.

Implementations on the same tensors in one process:
- ours: the Triton launcher of torch_flash/kernels/triton/attention_decode.py as the op runs it (append
  of the new k/v, split-KV attention, combine), on a (B, Hkv, S, D) cache; `ours-paged`: the
  same cache as shuffled 256-token blocks of a pool with a block table; `ours-1split`: no
  split-KV (what the splits buy).
- sdpa-flash / sdpa-cudnn: F.scaled_dot_product_attention over the full cache (a contiguous
  (B, Hkv, S, D) tensor, no mask: every slot holds a key), the q heads of a kv head folded
  into the query length (B, Hkv, Hq / Hkv, D) so that GQA needs no repeated k/v. SDPA does
  not append: it does strictly less work than ours.
Every implementation is timed as CUDA-graph replays (serving runs decoding steps that way,
and at batch 1 the Python launch cost of three kernels would otherwise exceed their time).
Effective bandwidth = K and V cache bytes read / time, set against a device copy of the same
byte count timed in the same run. Targets: ours >= 0.95 of copy at B=32/32k, >= 0.8 at B=1/128k.
Rows: {op, shape: [batch, cache length], heads, head_dim, num_splits (the automatic choice),
impl, ms, gbps, frac_of_copy}.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import within_budget
from .norm import plot_bars, time_impls

HQ, HKV, HEAD_DIM, PAGE = 32, 8, 128, 256
POINTS = [(32, 32768), (16, 32768), (8, 32768), (4, 65536), (2, 65536), (1, 131072), (64, 8192)]
QUICK = [(32, 4096), (1, 16384)]
CPU_POINTS = [(2, 64)]  # smoke run under TRITON_INTERPRET=1 (with 4 q and 2 kv heads of 16)


def _sdpa(backend_name: str, q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)
    b, hkv = k.shape[:2]
    qf = q.reshape(b, hkv, -1, q.shape[-1])  # (B, Hkv, group * Sq, D): exact for Sq = 1, no mask

    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qf, k, v)
    return fn


def _paged(k_cache, v_cache, page):
    """(k_pool, v_pool, table): (B, H, S, D) caches scattered over shuffled blocks of `page` slots."""
    b, h, s, _ = k_cache.shape
    nb = s // page
    order = torch.randperm(b * nb, device=k_cache.device)
    pools = []
    for cache in (k_cache, v_cache):
        pool = torch.empty(b * nb, h, page, cache.shape[-1], dtype=cache.dtype, device=cache.device)
        pool[order] = cache.view(b, h, nb, page, -1).transpose(1, 2).reshape(b * nb, h, page, -1)
        pools.append(pool)
    return pools[0], pools[1], order.view(b, nb).int()


def run(args) -> list[dict]:
    from ..kernels.triton.attention_decode import auto_num_splits, decode_fwd

    device = "cuda" if torch.cuda.is_available() else "cpu"
    points = CPU_POINTS if device == "cpu" else (QUICK if args.quick else POINTS)
    hq, hkv, d, page = (4, 2, 16, 16) if device == "cpu" else (HQ, HKV, HEAD_DIM, PAGE)
    dt = torch.bfloat16
    flags = dict(scale=None, causal=True, window_left=-1, window_right=-1, softcap=0.0,
                 rotary_interleaved=False)
    rows: list[dict] = []
    for batch, seqlen in within_budget("decode", args, points):
        def r(*shape):
            return torch.randn(*shape, device=device, dtype=dt)
        q, kn, vn = r(batch, hq, 1, d), r(batch, hkv, 1, d), r(batch, hkv, 1, d)
        kc, vc = r(batch, hkv, seqlen, d), r(batch, hkv, seqlen, d)
        cs = torch.full((batch,), seqlen - 1, dtype=torch.int32, device=device)
        kp, vp, table = _paged(kc, vc, page)
        splits = auto_num_splits(batch * hkv, seqlen, torch.device(device))
        print(f"B={batch} S={seqlen}: num_splits {splits}")

        def ours(k_cache, v_cache, block_table=None, num_splits=0):
            return lambda: decode_fwd(q, k_cache, v_cache, cs, kn, vn, block_table, None, None,
                                      num_splits=num_splits, **flags)
        impls = {
            "ours": ours(kc, vc),
            "ours-paged": ours(kp, vp, table),
            "ours-1split": ours(kc, vc, num_splits=1),
            "sdpa-flash": _sdpa("FLASH_ATTENTION", q, kc, vc),
            "sdpa-cudnn": _sdpa("CUDNN_ATTENTION", q, kc, vc),
        }
        nbytes = 2 * kc.numel() * kc.element_size()  # K and V caches read once
        time_impls(rows, impls, nbytes, device, graph=device == "cuda", op="decode", shape=[batch, seqlen], heads=[hq, hkv],
                   head_dim=d, num_splits=splits)
        del kc, vc, kp, vp
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def plot(data: dict, path: str) -> None:
    plot_bars(data, path, ("op",))
