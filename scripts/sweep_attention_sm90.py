"""Sweep kernel configurations of the Hopper attention forward (csrc/attention) on a GPU.

Each configuration (tile, schedule, 88_hopper_fmha options) is compiled, in parallel, into a
small shared library around `sm90::launch` of csrc/attention/attention_fwd_sm90.cuh, the same
template the extension instantiates; then every configuration runs the standard grid
(bf16, 32k tokens, hidden 2048) next to SDPA-cuDNN on the same inputs in this process, checked
against cuDNN's output. The winners go into csrc/attention/attention_fwd_sm90_hdim{D}.cu.

    python scripts/sweep_attention_sm90.py [--out sweep.json] [--only 128] [--jobs 16]
        [--variants d64-full-pp,d128-causal-coop] [--seqlens 1024,4096,16384]

Results: docs/results/sweep_attention_sm90/ (docs/perf.md). At D=128 two consumer warpgroups
of 64 rows with 5 K/V stages lead; at D=64 three warpgroups (192 rows) lead from 4k keys.
Causal masks run best on persistent CTAs that take pairs of query tiles adding up to the same
work (sm90::Paired). The variants that lost (FlashAttention-3's intra-warpgroup overlap, deeper
K/V pipelines, early stage release, exponentials on the FMA pipe, longest-first orders) are in
docs/perf.md, "Tried and not kept". The err column is against cuDNN's bf16 output: 128-key
tiles sum in cuDNN's order and agree to about 5e-5; other tile widths differ by bf16 rounding
(the kernel tests compare with float64).

The "-topleft" variants keep CUTLASS's top-left causal mask, which launch() does not split by
rows (the A/B of the causal row split and middle pairs); persistent configurations without a
mask also run as "<name>-nosplit", without the split tail (attention_fwd_sm90.cuh, TailSplit).

Timing: cuDNN and every configuration of a grid point run back to back in interleaved rounds, and
the ratio is the median of the rounds' ratios (single timings drift by 4-10% between runs).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from torch_flash import _build
from torch_flash.bench._common import env_info, median_ratio, time_rounds

TOKENS, HIDDEN = 32 * 1024, 2048
T = "Shape<_{}, _{}, _{}>"
LOCKED = "Option<Tag::kIsMainloopLocked, true_type>"


def stages(n: int) -> str:
    return f"Option<Tag::kStagesKV, _{n}>"


def warpgroups(n: int) -> str:
    return f"Option<Tag::kNumMmaWarpGroups, _{n}>"


class Variant(NamedTuple):
    name: str
    d: int  # head dim
    causal: bool
    tile: tuple[int, int]  # (query rows, keys) per step
    schedule: str  # sm90 Schedule, or one of SOURCE's
    options: tuple[str, ...] = ()  # 88_hopper_fmha Option<...>
    fusion: str = ""  # the mask; default the extension's (sm90::CausalBottomRight or sm90::Residual)


VARIANTS = [Variant(*v) for v in [
    *[(f"full-{name}", 128, False, tile, sched, opts) for name, tile, sched, opts in (
        ("pp", (128, 128), "Pingpong", ()),
        ("pp-locked", (128, 128), "Pingpong", (LOCKED,)),
        ("pp-s4", (128, 128), "Pingpong", (stages(4),)),
        ("pp-s3", (128, 128), "Pingpong", (stages(3),)),
        ("pp-m192-wg3", (192, 128), "Pingpong", (warpgroups(3),)),
        ("pp-n176-s3", (128, 176), "Pingpong", (stages(3),)),
        ("pp-m256-n64", (256, 64), "Pingpong", ()),
        ("coop", (128, 128), "Cooperative", ()),
        ("pp-n96-s6", (128, 96), "Pingpong", (stages(6),)),
        ("pp-n80-s7", (128, 80), "Pingpong", (stages(7),)),
        ("pp-n64-s8", (128, 64), "Pingpong", (stages(8),)),
    )],
    *[(f"causal-{name}", 128, True, tile, sched, opts) for name, tile, sched, opts in (
        ("coop", (128, 128), "Cooperative", ()),
        ("pair", (128, 128), "Paired", ()),
        ("coop-lf", (128, 128), "CooperativeLongestFirst", ()),
        ("pp", (128, 128), "Pingpong", ()),
        ("pp-lf", (128, 128), "PingpongLongestFirst", ()),
        ("pp-lf-locked", (128, 128), "PingpongLongestFirst", (LOCKED,)),
        ("pp-lf-s4", (128, 128), "PingpongLongestFirst", (stages(4),)),
        ("coop-lf-m192-wg3", (192, 128), "CooperativeLongestFirst", (warpgroups(3),)),
        ("pp-lf-m192-wg3", (192, 128), "PingpongLongestFirst", (warpgroups(3),)),
    )],
    *[(f"full-{name}", 64, False, tile, sched, opts) for name, tile, sched, opts in (
        ("pp", (128, 128), "Pingpong", ()),
        ("pp-locked", (128, 128), "Pingpong", (LOCKED,)),
        ("pp-m192-wg3", (192, 128), "Pingpong", (warpgroups(3),)),
        ("pp-m256", (256, 128), "Pingpong", ()),
        ("pp-n256", (128, 256), "Pingpong", ()),
        ("pp-n192", (128, 192), "Pingpong", ()),
    )],
    *[(f"causal-{name}", 64, True, tile, sched, opts) for name, tile, sched, opts in (
        ("coop", (128, 128), "Cooperative", ()),
        ("coop-lf", (128, 128), "CooperativeLongestFirst", ()),
        ("pp-lf", (128, 128), "PingpongLongestFirst", ()),
        ("pp-lf-locked", (128, 128), "PingpongLongestFirst", (LOCKED,)),
        ("pp-lf-m192-wg3", (192, 128), "PingpongLongestFirst", (warpgroups(3),)),
        ("pp-lf-m256", (256, 128), "PingpongLongestFirst", ()),
        ("coop-lf-m256", (256, 128), "CooperativeLongestFirst", ()),
        ("pair", (128, 128), "Paired", ()),
        ("pair-m192-wg3", (192, 128), "Paired", (warpgroups(3),)),
    )],
    # CUTLASS's top-left causal mask, which launch() does not split by rows (the same mask at Sq == Sk)
    *[(f"causal-{name}-topleft", d, True, tile, "Paired", opts, "cutlass::fmha::collective::CausalFusion")
      for name, d, tile, opts in (("pair", 128, (128, 128), ()), ("pair-m192-wg3", 64, (192, 128), (warpgroups(3),)))],
    *[(f"{mask}-{name}", 256, mask == "causal", tile, sched, ()) for mask, name, tile, sched in (
        ("full", "coop", (128, 64), "Cooperative"),
        ("full", "pp", (128, 64), "Pingpong"),
        ("causal", "coop", (128, 64), "Cooperative"),
        ("causal", "coop-lf", (128, 64), "CooperativeLongestFirst"),
        ("causal", "pp-lf", (128, 64), "PingpongLongestFirst"),
    )],
]]

SOURCE = """#include <string>
#include "attention/attention_fwd_sm90.cuh"
using namespace cute;
using namespace torch_flash::sm90;
using cutlass::fmha::kernel::Option;
using cutlass::fmha::kernel::Tag;

// Causal query tiles differ in work (tile m reads m + 1 key tiles): handing out the longest
// first keeps the last wave short (measured: no gain, see the module doc).
struct LongestFirstIndividualScheduler : cutlass::fmha::kernel::IndividualTileScheduler {{
  using IndividualTileScheduler::IndividualTileScheduler;
  CUTLASS_DEVICE auto get_block_coord() {{
    return make_coord(gridDim.x - 1 - blockIdx.x, _0{{}}, make_coord(blockIdx.y, blockIdx.z));
  }}
}};

// Persistent order with the query tile slowest, from the last (longest under a causal mask):
// every (batch, head) gets its long tiles before any short one.
struct LongestFirstPersistentScheduler : cutlass::fmha::kernel::PersistentTileScheduler {{
  using PersistentTileScheduler::PersistentTileScheduler;
  CUTLASS_DEVICE auto get_block_coord() {{
    int rest = block_idx, bidb, bidh;
    params.divmod_b(rest, bidb, rest);
    params.divmod_h(rest, bidh, rest);
    return make_coord(params.divmod_m_block.divisor - 1 - rest, _0{{}}, make_coord(bidb, bidh));
  }}
}};

using CooperativeLongestFirst = Schedule<LongestFirstIndividualScheduler, false>;
using PingpongLongestFirst = Schedule<LongestFirstPersistentScheduler, true>;

extern "C" const char* run(const torch_flash::AttentionFwdSm90Params* p, cudaStream_t stream) {{
  static std::string error;
  try {{
    launch<cutlass::bfloat16_t, {fusion}, Config<{tile}, {schedule}{options}>>(*p, stream);
    return nullptr;
  }} catch (const std::exception& e) {{
    error = e.what();
    return error.c_str();
  }}
}}
"""


class Params(ctypes.Structure):
    """csrc/attention/attention_fwd_sm90.h AttentionFwdSm90Params, field for field."""
    _fields_ = ([(n, ctypes.c_void_p) for n in ("q", "k", "v", "out", "lse")]
                + [(n, ctypes.c_int) for n in (
                    "batch", "heads", "seqlen_q", "seqlen_k", "head_dim",
                    "q_batch_stride", "q_head_stride", "q_row_stride", "k_batch_stride", "k_head_stride",
                    "k_row_stride", "v_batch_stride", "v_head_stride", "v_row_stride", "out_batch_stride",
                    "out_head_stride", "out_row_stride", "lse_batch_stride", "lse_head_stride")]
                + [("sinks", ctypes.c_void_p), ("sinks_head_stride", ctypes.c_int)]
                + [("alibi_slopes", ctypes.c_void_p), ("alibi_batch_stride", ctypes.c_int),
                   ("alibi_head_stride", ctypes.c_int)]
                + [("scale", ctypes.c_float), ("bf16", ctypes.c_bool), ("causal", ctypes.c_bool),
                   ("device", ctypes.c_int), ("sm_count", ctypes.c_int),
                   ("alloc", ctypes.c_void_p), ("alloc_ctx", ctypes.c_void_p)])


class Scratch:
    """Params.alloc for the kernels' split tail: torch buffers, held until the next call (each
    call's work is queued on the same stream, so the caching allocator may then reuse them)."""
    FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)

    def __init__(self):
        self.buffers = []
        self.fn = self.FN(self._alloc)  # referenced here so that ctypes keeps it alive

    def _alloc(self, ctx, nbytes):
        self.buffers.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
        return self.buffers[-1].data_ptr()

    def address(self) -> int:
        return ctypes.cast(self.fn, ctypes.c_void_p).value


def compile_all(variants, workdir: str, jobs: int) -> dict[str, str]:
    """name -> path of the built library; failures are printed and left out."""
    from torch.utils.cpp_extension import CUDA_HOME
    spec = _build.spec(hdims="64,128,256")
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")

    def one(v):
        name, d, (m, n) = v.name, v.d, v.tile
        fusion = v.fusion or ("CausalBottomRight" if v.causal else "Residual")
        src = os.path.join(workdir, f"d{d}-{name}.cu")
        with open(src, "w") as f:
            f.write(SOURCE.format(fusion=fusion, tile=T.format(m, n, d), schedule=v.schedule,
                                  options="".join(", " + o for o in v.options)))
        lib = src[:-3] + ".so"
        argv = [nvcc, "-shared", "-Xcompiler", "-fPIC", src, "-o", lib, *spec.nvcc_flags,
                *(f"-I{i}" for i in spec.include_dirs)]
        t0 = time.time()
        r = subprocess.run(argv, capture_output=True, text=True)
        ok = r.returncode == 0
        print(f"  {'built' if ok else 'FAILED'} d{d}-{name} ({time.time() - t0:.0f} s)", flush=True)
        if not ok:
            print("\n".join(r.stderr.splitlines()[:8]), flush=True)
        return f"d{d}-{name}", lib if ok else None

    print(f"compiling {len(variants)} configurations with {jobs} jobs", flush=True)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        return {k: p for k, p in pool.map(one, variants) if p}


def run_point(libs: dict, variants, d: int, s: int, causal: bool) -> list[dict]:
    h = HIDDEN // d
    b = TOKENS // s
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    scale = d ** -0.5
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    ref = cudnn().transpose(1, 2)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    p = Params(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), b, h, s, s, d,
               q.stride(0), q.stride(2), q.stride(1), k.stride(0), k.stride(2), k.stride(1),
               v.stride(0), v.stride(2), v.stride(1), out.stride(0), out.stride(2), out.stride(1),
               lse.stride(0), lse.stride(1), None, 0, None, 0, 0, scale, True, causal, 0, sm)  # no sinks, ALiBi
    no_split = Params.from_buffer_copy(p)  # alloc null: no split tail
    scratch = Scratch()
    p.alloc = scratch.address()
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    calls, errors = {"sdpa-cudnn": cudnn}, {}
    for v in variants:
        key = f"d{v.d}-{v.name}"
        if v.d != d or v.causal != causal or key not in libs:
            continue
        fn = libs[key].run
        fn.restype = ctypes.c_char_p
        # persistent launches without a mask also run without their split tail, for the A/B
        for k, params in [(key, p)] + ([(key + "-nosplit", no_split)] if v.schedule == "Pingpong" and not causal else []):
            def call(fn=fn, params=params):
                scratch.buffers.clear()
                err = fn(ctypes.byref(params), stream)
                if err:
                    raise RuntimeError(err.decode())

            try:
                out.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
            except RuntimeError as e:
                print(f"    {k}: {e}", flush=True)
                continue
            errors[k] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            calls[k] = call
    times = time_rounds(calls)
    ms_ref = statistics.median(times["sdpa-cudnn"])
    rows = [{"d": d, "s": s, "causal": causal, "impl": "sdpa-cudnn", "ms": ms_ref, "tflops": flops / ms_ref / 1e9}]
    for key, err in errors.items():
        if not times[key]:
            continue
        ms = statistics.median(times[key])
        ratio = median_ratio(times["sdpa-cudnn"], times[key])
        rows.append({"d": d, "s": s, "causal": causal, "impl": key, "ms": ms, "tflops": flops / ms / 1e9,
                     "vs_sdpa-cudnn": ratio, "rel_err_vs_cudnn": err})
        print(f"    {key:28s} {flops / ms / 1e9:6.0f} TFLOP/s  {ratio:5.3f}x cuDNN  err {err:.1e}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="sweep_attention_sm90.json")
    ap.add_argument("--only", type=int, help="one head dim")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--variants", help="comma list of d<D>-<name> to run (default: all)")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    args = ap.parse_args()
    chosen = set(args.variants.split(",")) if args.variants else None
    variants = [v for v in VARIANTS if args.only in (None, v.d) and (chosen is None or f"d{v.d}-{v.name}" in chosen)]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    with tempfile.TemporaryDirectory() as work:
        libs = {k: ctypes.CDLL(p) for k, p in compile_all(variants, work, args.jobs).items()}
        rows = []
        for d in sorted({v.d for v in variants}):
            for s in (seqlens if d != 256 else [4096]):
                for causal in (False, True):
                    print(f"D={d} S={s} {'causal' if causal else 'full'}", flush=True)
                    rows += run_point(libs, variants, d, s, causal)
    with open(args.out, "w") as f:
        json.dump({"suite": "sweep_attention_sm90", "env": env_info(), "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
