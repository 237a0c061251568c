"""Sweep the norm kernels' launch heuristics on the GPU, bf16. Parts (TORCH_FLASH_SWEEP=a,b; all
by default, about 10 GPU minutes each but prefetch, about 2):
  tiles   rows of up to 8192 (SHAPES): rows per program tile (TILE) and, for the backward,
          programs per SM;
  narrow  short rows (NARROW_SHAPES): the backward's tile, programs per SM and dW/dB
          accumulation (BWD_ROW_ACC), against quack's backward;
  wide    wider rows (WIDE_SHAPES): the forward's column block (the whole row in registers up
          to FWD_BLOCKS' widest, else its column loop) and the backward's column chunk
          (BWD_CHUNK; a chunk as wide as the row is the one-pass kernel), against quack's;
  prefetch  the backward with and without loading the next row tile ahead (BWD_PREFETCH),
          default tiles, RMSNorm and LayerNorm (from saved statistics, as its op calls it);
          rows wider than BWD_MAX_BLOCK in chunks and as one pass (the whole row a program).
quack is timed where importable. Writes OUT/sweep_norm.json: the fraction of a device copy each
setting reaches, with the autotuned num_warps, so that the defaults in
torch_flash/kernels/triton/norm.py and norm_backward.py are chosen from measurements.
Usage: python scripts/sweep_norm.py OUT
"""
import itertools
import os

import torch

from torch._library.triton import set_wrap_triton_enabled

from torch_flash.bench._common import copy_bandwidth, median_ms, out_dir, pick, write_json
from torch_flash.kernels.triton import norm, norm_backward as nb

SHAPES = [(32768, 4096), (65536, 1024), (4096, 8192)]
NARROW_SHAPES = [(1 << 21, 64), (1 << 19, 256), (65536, 1024)]
WIDE_SHAPES = [(16384, 8192), (4096, 16384), (8192, 32768), (2048, 65536)]
FWD_BLOCKS = (8192, 16384, 32768, 65536)
BWD_BLOCKS = (2048, 4096, 8192, 16384)  # 16384 at 16384 columns: the whole row in registers, one pass
PREFETCH_SHAPES = [(4096, 8192), (16384, 8192), (32768, 4096), (65536, 1024), (4096, 16384)]


def _inputs(m, n, is_rms):
    """x, dy (m, n) bf16, the weight (and LayerNorm's bias), and the launchers' flags."""
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = None if is_rms else torch.randn(n, device="cuda", dtype=torch.bfloat16)
    return x, torch.randn_like(x), w, b, dict(eps=1e-6, is_rms=is_rms, weight_offset=0.0, cast_before_weight=False)


def _bwd_inputs(m, n, is_rms):
    """_inputs plus the backward's byte count, its copy ceiling and the statistics its op passes
    (LayerNorm's saved mean and rstd; RMSNorm recomputes)."""
    x, g, w, b, kw = _inputs(m, n, is_rms)
    nbytes = 3 * x.numel() * 2
    _, _, mean, rstd = norm.norm_fwd(x, w, b, None, residual_in_fp32=False, stats=True, **kw)
    stats = {} if is_rms else dict(mean=mean, rstd=rstd)
    return x, g, w, b, kw, nbytes, copy_bandwidth(nbytes), stats


def _frac(nbytes, ms, ceiling):
    return nbytes / (ms * 1e-3) / ceiling


def _programs_per_sm(per_sm):
    """nb._bwd_programs fixed at per_sm programs per SM (at most one per row)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return lambda rows, block, chunks, device: min(rows, sms * per_sm)


def sweep_tiles(rows):
    """Rows of up to 8192: the row tile and the backward's programs per SM."""
    defaults = norm.TILE, nb._bwd_programs
    for (m, n), is_rms in itertools.product(SHAPES, (True, False)):
        x, g, w, b, kw = _inputs(m, n, is_rms)
        fwd_ceiling = copy_bandwidth(2 * x.numel() * 2)
        bwd_ceiling = copy_bandwidth(3 * x.numel() * 2)
        for tile in (2048, 4096, 8192, 16384):
            norm.TILE = tile
            norm._norm_fwd_kernel.cache.clear()
            ms = median_ms(lambda: norm.norm_fwd(x, w, b, None, residual_in_fp32=False, **kw))
            rows.append(dict(op="rms" if is_rms else "ln", shape=[m, n], pass_="fwd", tile=tile, per_sm=None,
                             ms=ms, frac=_frac(2 * x.numel() * 2, ms, fwd_ceiling),
                             warps=norm._norm_fwd_kernel.best_config.num_warps))
            print(rows[-1], flush=True)
            for per_sm in (1, 2, 4, 8, 16):
                nb._bwd_programs = _programs_per_sm(per_sm)
                nb._norm_bwd_kernel.cache.clear()
                ms = median_ms(lambda: nb.norm_bwd(g, None, x, w, b, out_dtype=x.dtype, **kw))
                rows.append(dict(op="rms" if is_rms else "ln", shape=[m, n], pass_="bwd", tile=tile,
                                 per_sm=per_sm, ms=ms, frac=_frac(3 * x.numel() * 2, ms, bwd_ceiling),
                                 warps=nb._norm_bwd_kernel.best_config.num_warps))
                print(rows[-1], flush=True)
    norm.TILE, nb._bwd_programs = defaults


def sweep_narrow(rows):
    """Short rows' backward: row tile x programs per SM x dW/dB per tile row (BWD_ROW_ACC)."""
    from torch_flash.bench.norm import _quack
    defaults = norm.TILE, nb._bwd_programs, nb.BWD_ROW_ACC
    for (m, n), is_rms in itertools.product(NARROW_SHAPES, (True, False)):
        x, g, w, b, kw, nbytes, ceiling, stats = _bwd_inputs(m, n, is_rms)
        for tile, per_sm, row_acc in itertools.product((2048, 4096, 8192), (2, 4, 8), (False, True)):
            norm.TILE, nb.BWD_ROW_ACC = tile, row_acc
            nb._bwd_programs = _programs_per_sm(per_sm)
            nb._norm_bwd_kernel.cache.clear()
            ms = median_ms(lambda: nb.norm_bwd(g, None, x, w, b, out_dtype=x.dtype, **stats, **kw))
            rows.append(dict(op="rms" if is_rms else "ln", shape=[m, n], pass_="bwd", tile=tile, per_sm=per_sm,
                             row_acc=row_acc, ms=ms, frac=_frac(nbytes, ms, ceiling),
                             warps=nb._norm_bwd_kernel.best_config.num_warps))
            print(rows[-1], flush=True)
        quack = _quack(is_rms, False, [x, None, w, b], g)
        if quack is not None:
            ms = median_ms(quack[1])
            rows.append(dict(op="rms" if is_rms else "ln", shape=[m, n], pass_="bwd", tile="quack", ms=ms,
                             frac=_frac(nbytes, ms, ceiling)))
            print(rows[-1], flush=True)
    norm.TILE, nb._bwd_programs, nb.BWD_ROW_ACC = defaults


def sweep_wide(rows):
    """Rows wider than 8192: the forward's column block, the backward's column chunk, quack's."""
    from torch_flash.bench.norm import _quack
    for (m, n), is_rms in itertools.product(WIDE_SHAPES, (True, False)):
        x, g, w, b, kw = _inputs(m, n, is_rms)
        nbytes = {"fwd": 2 * x.numel() * 2, "bwd": 3 * x.numel() * 2}
        ceiling = {p: copy_bandwidth(v) for p, v in nbytes.items()}
        _, _, mean, rstd = norm.norm_fwd(x, w, b, None, residual_in_fp32=False, stats=True, **kw)
        stats = {} if is_rms else dict(mean=mean, rstd=rstd)  # as the ops' backwards get them
        runs = [("fwd", blk, lambda blk=blk: norm.norm_fwd(x, w, b, None, residual_in_fp32=False, block_n=blk, **kw))
                for blk in FWD_BLOCKS if blk <= n]
        runs += [("bwd", blk, lambda blk=blk: nb.norm_bwd(g, None, x, w, b, out_dtype=x.dtype, block_n=blk,
                                                               **stats, **kw))
                 for blk in BWD_BLOCKS if blk <= n]
        quack = _quack(is_rms, False, [x, None, w, b], g)
        if quack is not None:
            runs += [("fwd", "quack", quack[0]), ("bwd", "quack", quack[1])]
        for pass_, blk, fn in runs:
            try:
                ms = median_ms(fn)
            except Exception as e:  # a whole row too wide for the registers
                print(f"{m}x{n} {pass_} {blk}: {type(e).__name__}", flush=True)
                continue
            kernel = norm._norm_fwd_kernel if pass_ == "fwd" else nb._norm_bwd_kernel
            rows.append(dict(op="rms" if is_rms else "ln", shape=[m, n], pass_=pass_, block_n=blk, ms=ms,
                             frac=_frac(nbytes[pass_], ms, ceiling[pass_]),
                             warps=None if blk == "quack" else kernel.best_config.num_warps))
            print(rows[-1], flush=True)


def sweep_prefetch(rows):
    """The backward with and without the next row tile loaded ahead (BWD_PREFETCH); rows wider
    than BWD_MAX_BLOCK in BWD_CHUNK chunks and as one pass (block_n = the row, which the kernel
    runs without prefetch: its one CTA an SM, BWD_RMS_MAX_BLOCK)."""
    default = nb.BWD_PREFETCH
    for (m, n), is_rms in itertools.product(PREFETCH_SHAPES, (True, False)):
        x, g, w, b, kw, nbytes, ceiling, stats = _bwd_inputs(m, n, is_rms)
        blocks = [None] if n <= nb.BWD_MAX_BLOCK else [nb.BWD_CHUNK, n]
        for block_n, prefetch in itertools.product(blocks, (True, False)):
            if block_n == n and prefetch:
                continue
            nb.BWD_PREFETCH = prefetch
            nb._norm_bwd_kernel.cache.clear()
            ms = median_ms(lambda: nb.norm_bwd(g, None, x, w, b, out_dtype=x.dtype, block_n=block_n, **stats, **kw))
            rows.append(dict(op="rms" if is_rms else "ln", shape=[m, n], pass_="bwd", block_n=block_n,
                             prefetch=prefetch, ms=ms, frac=_frac(nbytes, ms, ceiling),
                             warps=nb._norm_bwd_kernel.best_config.num_warps))
            print(rows[-1], flush=True)
    nb.BWD_PREFETCH = default


def main(out):
    parts = {"tiles": sweep_tiles, "narrow": sweep_narrow, "wide": sweep_wide, "prefetch": sweep_prefetch}
    rows = []
    for part in pick("TORCH_FLASH_SWEEP", os.environ.get("TORCH_FLASH_SWEEP"), parts, "part"):
        parts[part](rows)
    write_json(os.path.join(out, "sweep_norm.json"), "sweep_norm", rows)


if __name__ == "__main__":
    # the launchers are called outside their ops: skip wrap_triton's per-launch tracing hook,
    # which costs more CPU time than these kernels take (see torch_flash/bench/__main__.py)
    with set_wrap_triton_enabled(False):
        main(out_dir(__doc__))
