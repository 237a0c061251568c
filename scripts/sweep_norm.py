"""Sweep the norm kernels' launch heuristics on the GPU: rows per program tile (TILE) and, for
the backward, programs per SM, and for rows wider than BWD_MAX_BLOCK the backward's column
block (the whole row in registers, or the column loop's blocks). Prints and writes JSON of
the fraction of a device copy that each setting reaches, with the autotuned num_warps, so the
defaults in torch_flash/kernels/triton/norm.py can be chosen from measurements.
Usage: python scripts/sweep_norm.py OUT.json
"""
import itertools
import json

import torch

from torch._library.triton import set_wrap_triton_enabled

from torch_flash.bench._common import copy_bandwidth, env_info, median_ms, out_dir
from torch_flash.kernels.triton import norm

SHAPES = [(32768, 4096), (65536, 1024), (4096, 8192)]
# rows past BWD_MAX_BLOCK (the weak spot against quack): their backward's column block
WIDE_SHAPES = [(16384, 8192), (4096, 16384), (2048, 65536)]
WIDE_BLOCKS = (1024, 4096, 8192, 16384, 32768, 65536)


def _inputs(m, n, is_rms):
    """x, dy (m, n) bf16, the weight (and LayerNorm's bias), and the launchers' flags."""
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = None if is_rms else torch.randn(n, device="cuda", dtype=torch.bfloat16)
    return x, torch.randn_like(x), w, b, dict(eps=1e-6, is_rms=is_rms, weight_offset=0.0, cast_before_weight=False)


def main(path):
    rows = []
    defaults = norm.TILE, norm._bwd_programs
    for (m, n), is_rms in itertools.product(SHAPES, (True, False)):
        x, g, w, b, kw = _inputs(m, n, is_rms)
        fwd_ceiling = copy_bandwidth(2 * x.numel() * 2)
        bwd_ceiling = copy_bandwidth(3 * x.numel() * 2)
        for tile in (2048, 4096, 8192, 16384):
            norm.TILE = tile
            norm._norm_fwd_kernel.cache.clear()
            ms = median_ms(lambda: norm.norm_fwd(x, w, b, None, residual_in_fp32=False, **kw))
            frac = 2 * x.numel() * 2 / (ms * 1e-3) / fwd_ceiling
            rows.append(dict(op="rms" if is_rms else "ln", shape=[m, n], pass_="fwd", tile=tile,
                             per_sm=None, ms=ms, frac=frac,
                             warps=norm._norm_fwd_kernel.best_config.num_warps))
            print(rows[-1], flush=True)
            for per_sm in (1, 2, 4, 8, 16):
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                norm._bwd_programs = lambda rows, block, device, p=per_sm: min(rows, sms * p)
                norm._norm_bwd_kernel.cache.clear()
                ms = median_ms(lambda: norm.norm_bwd(g, None, x, w, b, out_dtype=x.dtype, **kw))
                frac = 3 * x.numel() * 2 / (ms * 1e-3) / bwd_ceiling
                rows.append(dict(op="rms" if is_rms else "ln", shape=[m, n], pass_="bwd", tile=tile,
                                 per_sm=per_sm, ms=ms, frac=frac,
                                 warps=norm._norm_bwd_kernel.best_config.num_warps))
                print(rows[-1], flush=True)
    norm.TILE, norm._bwd_programs = defaults  # the wide rows' sweep varies the column block alone
    for (m, n), is_rms in itertools.product(WIDE_SHAPES, (True, False)):
        x, g, w, b, kw = _inputs(m, n, is_rms)
        bwd_ceiling = copy_bandwidth(3 * x.numel() * 2)
        for block in (blk for blk in WIDE_BLOCKS if blk <= n):
            norm._norm_bwd_kernel.cache.clear()
            try:
                ms = median_ms(lambda: norm.norm_bwd(g, None, x, w, b, out_dtype=x.dtype, block_n=block, **kw))
            except Exception as e:  # a whole row too wide for the registers
                print(f"{m}x{n} block {block}: {type(e).__name__}", flush=True)
                continue
            rows.append(dict(op="rms" if is_rms else "ln", shape=[m, n], pass_="bwd", block_n=block, ms=ms,
                             frac=3 * x.numel() * 2 / (ms * 1e-3) / bwd_ceiling,
                             warps=norm._norm_bwd_kernel.best_config.num_warps))
            print(rows[-1], flush=True)
    with open(path, "w") as f:
        json.dump({"env": env_info(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    # the launchers are called outside their ops: skip wrap_triton's per-launch tracing hook,
    # which costs more CPU time than these kernels take (see torch_flash/bench/__main__.py)
    with set_wrap_triton_enabled(False):
        main(out_dir(__doc__))
