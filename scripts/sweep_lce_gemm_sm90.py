"""Sweep tile configurations of linear cross-entropy's Hopper GEMMs (csrc/linear_cross_entropy)
on a GPU, next to cuBLAS on the same inputs.

Each configuration is compiled, in parallel, into a small shared library around
`lce_sm90::run` of csrc/linear_cross_entropy/lce_gemm_sm90.cuh (the template the extension
instantiates), for each of the three GEMMs of a token chunk; then every library runs each tile
order (raster, swizzle) at the chunk shapes of an lm-head, in interleaved rounds with
`torch.mm` / `addmm_` under cuBLAS and cuBLASLt, checked against cuBLAS's output. The winners go
into csrc/linear_cross_entropy/lce_gemm_sm90_{logits,grad_hidden,grad_weight}.cu. The same
GEMMs unchunked (what torch.compile of linear + cross_entropy runs) are timed for reference.

    python scripts/sweep_lce_gemm_sm90.py [--out F.json] [--jobs 16] [--chunks 512,1024]
        [--tokens 8192 --hidden 4096 --vocab 128256] [--variants coop-128x256-c1x2,...]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
from typing import NamedTuple

import torch

from torch_flash.bench._common import median_ratio, time_rounds, write_json

from _sweep_build import Scratch, compile_libraries

KINDS = ("Logits", "GradHidden", "GradWeight")
RASTERS = {1: "M", 2: "N"}  # 3, CUTLASS's heuristic, picks one of these
SWIZZLES = (1, 8)


class Variant(NamedTuple):
    name: str
    tile: tuple[int, int, int]
    cluster: tuple[int, int]
    schedule: str  # lce_sm90::Cooperative or Pingpong
    scheduler: str = "cutlass::gemm::PersistentScheduler"


VARIANTS = [Variant(*v) for v in [
    ("coop-128x256-c1x2", (128, 256, 64), (1, 2), "Cooperative"),
    ("coop-128x256-c2x1", (128, 256, 64), (2, 1), "Cooperative"),
    ("coop-256x128-c1x2", (256, 128, 64), (1, 2), "Cooperative"),
    ("coop-256x128-c2x1", (256, 128, 64), (2, 1), "Cooperative"),
    ("coop-128x128-c1x2", (128, 128, 64), (1, 2), "Cooperative"),
    ("pp-128x128-c1x2", (128, 128, 64), (1, 2), "Pingpong"),
    ("pp-128x128-c2x1", (128, 128, 64), (2, 1), "Pingpong"),
    ("pp-64x256-c1x2", (64, 256, 64), (1, 2), "Pingpong"),
    ("coop-128x256-c1x2-streamk", (128, 256, 64), (1, 2), "Cooperative", "cutlass::gemm::StreamKScheduler"),
    ("coop-128x128-c1x2-streamk", (128, 128, 64), (1, 2), "Cooperative", "cutlass::gemm::StreamKScheduler"),
]]

SOURCE = """#include <string>
#include "linear_cross_entropy/lce_gemm_sm90.cuh"
using namespace cute;
using namespace torch_flash::lce_sm90;

extern "C" const char* run(const torch_flash::LceGemmSm90Params* p, cudaStream_t stream) {{
  static std::string error;
  try {{
    torch_flash::lce_sm90::run<Kind::{kind}, Config<Shape<_{m}, _{n}, _{k}>, Shape<_{cm}, _{cn}, _1>, {schedule},
                                                    {scheduler}>>(*p, stream);
  }} catch (const std::exception& e) {{
    error = e.what();
    return error.c_str();
  }}
  return nullptr;
}}
"""


class Params(ctypes.Structure):
    """csrc/linear_cross_entropy/lce_gemm_sm90.h LceGemmSm90Params, field for field."""
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("d", ctypes.c_void_p),
                ("m", ctypes.c_int), ("n", ctypes.c_int), ("k", ctypes.c_int),
                ("bf16", ctypes.c_bool), ("accumulate", ctypes.c_bool),
                ("raster", ctypes.c_int), ("swizzle", ctypes.c_int),
                ("device", ctypes.c_int), ("sm_count", ctypes.c_int),
                ("alloc", ctypes.c_void_p), ("alloc_ctx", ctypes.c_void_p)]


def compile_all(variants, workdir: str, jobs: int) -> dict[str, str]:
    """<Kind>-<name> -> path of the built library."""
    sources = {f"{kind}-{v.name}": SOURCE.format(kind=kind, m=v.tile[0], n=v.tile[1], k=v.tile[2], cm=v.cluster[0],
                                                 cn=v.cluster[1], schedule=v.schedule, scheduler=v.scheduler)
               for kind in KINDS for v in variants}
    return compile_libraries(sources, workdir, jobs)


def problem(kind: str, rows: int, h: torch.Tensor, w: torch.Tensor, logits: torch.Tensor, out: dict):
    """(a, b, d, m, n, k, accumulate, the torch.mm call) of one GEMM of a `rows`-token chunk."""
    hc, lg = h[:rows], logits[:rows]
    if kind == "Logits":
        return hc, w, lg, rows, w.shape[0], w.shape[1], False, lambda: torch.mm(hc, w.t(), out=lg)
    if kind == "GradHidden":
        d = out["dh"][:rows]
        return lg, w, d, rows, w.shape[1], w.shape[0], False, lambda: torch.mm(lg, w, out=d)
    d = out["dw"]
    return lg, hc, d, w.shape[0], w.shape[1], rows, True, lambda: d.addmm_(lg.t(), hc)


def with_blas(library: str, fn):
    def call():
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(library)
        try:
            return fn()
        finally:
            torch.backends.cuda.preferred_blas_library(previous)
    return call


def run_point(libs, variants, kind: str, rows: int, h, w, logits, out) -> list[dict]:
    a, b, d, m, n, k, accumulate, mm = problem(kind, rows, h, w, logits, out)
    flops = 2 * m * n * k
    if accumulate:
        d.normal_(0, 1e-2)  # earlier timings have been adding into it
    start = d.clone()
    mm()
    ref = d.float().clone()
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    scratch = Scratch()
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    calls, errors = {"cublas": mm, "cublaslt": with_blas("cublaslt", mm)}, {}
    for v in variants:
        fn = libs.get(f"{kind}-{v.name}")
        if fn is None:
            continue
        for raster in RASTERS:
            for swizzle in SWIZZLES:
                key = f"{v.name}-r{RASTERS[raster]}-s{swizzle}"
                p = Params(a.data_ptr(), b.data_ptr(), d.data_ptr(), m, n, k, True, accumulate, raster, swizzle,
                           torch.cuda.current_device(), sm, scratch.address(), None)

                def call(fn=fn, p=p):
                    scratch.buffers.clear()
                    err = fn(ctypes.byref(p), stream)
                    if err:
                        raise RuntimeError(err.decode())

                try:
                    d.copy_(start)
                    call()
                    torch.cuda.synchronize()
                except RuntimeError as e:
                    print(f"    {key}: {e}", flush=True)
                    continue
                errors[key] = ((d.float() - ref).norm() / ref.norm()).item()
                calls[key] = call
    times = time_rounds(calls)
    rows_out = []
    for key, values in times.items():
        if not values:
            continue
        ms = statistics.median(values)
        row = {"gemm": kind, "rows": rows, "m": m, "n": n, "k": k, "impl": key, "ms": ms,
               "tflops": flops / ms / 1e9, "vs_cublas": median_ratio(times["cublas"], values),
               "rel_err_vs_cublas": errors.get(key, 0.0)}
        rows_out.append(row)
    rows_out.sort(key=lambda r: r["ms"])
    for r in rows_out[:6] + [r for r in rows_out[6:] if r["impl"].startswith("cublas")]:
        print(f"    {r['impl']:36s} {r['tflops']:6.0f} TFLOP/s  {r['vs_cublas']:5.3f}x cuBLAS  "
              f"err {r['rel_err_vs_cublas']:.1e}", flush=True)
    return rows_out


def run_pairs(libs, pairs: list[tuple[str, str]], rows: int, h, w, logits, out) -> list[dict]:
    """dhidden and dweight of one chunk at once, on two streams, each GEMM on its own share of
    the SMs (its persistent grid), so that dweight's read-modify-write of the whole weight
    gradient runs under dhidden's arithmetic; against the two back to back."""
    a_x, b_x, d_x, m_x, n_x, k_x, _, mm_x = problem("GradHidden", rows, h, w, logits, out)
    a_w, b_w, d_w, m_w, n_w, k_w, _, mm_w = problem("GradWeight", rows, h, w, logits, out)
    flops = 2 * (m_x * n_x * k_x + m_w * n_w * k_w)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    scratch, side = Scratch(), torch.cuda.Stream()
    main_stream = torch.cuda.current_stream()
    streams = [ctypes.c_void_p(s.cuda_stream) for s in (main_stream, side)]
    dev = torch.cuda.current_device()

    def cublas():
        mm_x()
        mm_w()

    calls = {"cublas-sequential": cublas}
    for name_x, name_w in pairs:
        fx, fw = libs.get(f"GradHidden-{name_x}"), libs.get(f"GradWeight-{name_w}")
        if fx is None or fw is None:
            continue
        for sm_x in (0, sm // 2 - 6, sm // 2, sm // 2 + 6, sm // 2 + 12, sm // 2 + 18):
            px = Params(a_x.data_ptr(), b_x.data_ptr(), d_x.data_ptr(), m_x, n_x, k_x, True, False, 0, 0, dev,
                        sm_x or sm, scratch.address(), None)
            pw = Params(a_w.data_ptr(), b_w.data_ptr(), d_w.data_ptr(), m_w, n_w, k_w, True, True, 2, 1, dev,
                        sm - sm_x if sm_x else sm, scratch.address(), None)

            def call(fx=fx, fw=fw, px=px, pw=pw, concurrent=bool(sm_x)):
                scratch.buffers.clear()
                if concurrent:
                    side.wait_stream(main_stream)
                for f, p, stream in ((fw, pw, streams[concurrent]), (fx, px, streams[0])):
                    err = f(ctypes.byref(p), stream)
                    if err:
                        raise RuntimeError(err.decode())
                if concurrent:
                    main_stream.wait_stream(side)

            key = f"{name_x}+{name_w}-" + (f"x{sm_x}" if sm_x else "sequential")
            try:
                call()
                torch.cuda.synchronize()
            except RuntimeError as e:
                print(f"    {key}: {e}", flush=True)
                continue
            calls[key] = call
    times = time_rounds(calls)
    rows_out = []
    for key, values in times.items():
        if values:
            ms = statistics.median(values)
            rows_out.append({"gemm": "GradHidden+GradWeight", "rows": rows, "impl": key, "ms": ms,
                             "tflops": flops / ms / 1e9,
                             "vs_cublas": median_ratio(times["cublas-sequential"], values)})
    rows_out.sort(key=lambda r: r["ms"])
    for r in rows_out[:8] + [r for r in rows_out[8:] if r["impl"].startswith("cublas")]:
        print(f"    {r['impl']:56s} {r['ms']:6.3f} ms {r['tflops']:6.0f} TFLOP/s  {r['vs_cublas']:5.3f}x cuBLAS",
              flush=True)
    return rows_out


def unchunked(tokens: int, h, w) -> list[dict]:
    """The same three GEMMs over all tokens, through cuBLAS: what torch.compile runs."""
    v, hid = w.shape
    lg = torch.empty(tokens, v, device="cuda", dtype=h.dtype)
    dh, dw = torch.empty_like(h), torch.empty_like(w)
    calls = {"Logits": lambda: torch.mm(h, w.t(), out=lg), "GradHidden": lambda: torch.mm(lg, w, out=dh),
             "GradWeight": lambda: torch.mm(lg.t(), h, out=dw)}
    torch.mm(h, w.t(), out=lg)
    times = time_rounds(calls)
    flops = 2 * tokens * v * hid
    rows = []
    for kind, values in times.items():
        ms = statistics.median(values)
        rows.append({"gemm": kind, "rows": tokens, "impl": "cublas-unchunked", "ms": ms, "tflops": flops / ms / 1e9})
        print(f"  unchunked {kind:10s} {ms:7.2f} ms {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="sweep_lce_gemm_sm90.json")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--chunks", default="512,1024")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--variants", help="comma list of names (default: all)")
    ap.add_argument("--pairs", default="", help="comma list of <dhidden variant>+<dweight variant> to run "
                    "concurrently on split SMs")
    ap.add_argument("--no-single", action="store_true", help="only the pairs and the unchunked GEMMs")
    args = ap.parse_args()
    chosen = set(args.variants.split(",")) if args.variants else None
    pairs = [tuple(p.split("+")) for p in args.pairs.split(",") if p]
    chosen = chosen if chosen is not None or not pairs else {n for p in pairs for n in p}
    variants = [v for v in VARIANTS if chosen is None or v.name in chosen]
    torch.manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.vocab, args.hidden, device="cuda", dtype=torch.bfloat16) * args.hidden ** -0.5
    chunks = [int(c) for c in args.chunks.split(",")]
    with tempfile.TemporaryDirectory() as work:
        libs = {}
        for key, path in compile_all(variants, work, args.jobs).items():
            libs[key] = ctypes.CDLL(path).run
            libs[key].restype = ctypes.c_char_p
        logits = torch.randn(max(chunks), args.vocab, device="cuda", dtype=torch.bfloat16) * 1e-3
        out = {"dh": torch.empty(max(chunks), args.hidden, device="cuda", dtype=torch.bfloat16),
               "dw": torch.randn_like(w) * 1e-2}
        rows = []
        for rows_per_chunk in chunks:
            for kind in KINDS if not args.no_single else ():
                print(f"{kind} at {rows_per_chunk} rows", flush=True)
                rows += run_point(libs, variants, kind, rows_per_chunk, h, w, logits, out)
            if pairs:
                print(f"dhidden + dweight at {rows_per_chunk} rows", flush=True)
                rows += run_pairs(libs, pairs, rows_per_chunk, h, w, logits, out)
        del logits, out
        rows += unchunked(args.tokens, h, w)
    write_json(args.out, "sweep_lce_gemm_sm90", rows, {"shape": [args.tokens, args.hidden, args.vocab]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
