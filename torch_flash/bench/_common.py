"""Timing, environment and output helpers shared by the benchmark suites."""
from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Iterable, Iterator

import torch

# the peer libraries whose versions every result records (None: not installed)
PEERS = ("liger-kernel", "quack-kernels", "flash-attn-4")


def over_retained_graphs(run: Callable) -> Callable:
    """run, a suite that times backward passes repeatedly over one retained graph, with
    compiled baselines that keep their saved buffers: by default they donate them to their
    backward (to reuse their memory in place), which forbids a second backward. The other
    suites run a forward per backward and time torch.compile as users get it."""
    return torch._functorch.config.patch(donated_buffer=False)(run)


def per_stream(make: Callable[[], object]) -> Callable[[], object]:
    """make()'s result, made again whenever the current CUDA stream changes. Autograd keeps the
    stream each node was recorded on and, after a backward, syncs the nodes it returns gradients
    at with the caller's stream: a graph captured on another stream (graph_ms) than the one a
    kept forward was recorded on fails, as it would touch the recording stream."""
    cache: dict = {}

    def get():
        stream = torch.cuda.current_stream() if torch.cuda.is_available() else None
        if "value" not in cache or cache["stream"] != stream:
            cache.clear()  # free the old recording before making the new one
            cache.update(stream=stream, value=make())
        return cache["value"]

    return get


def compile_fresh(fn: Callable) -> Callable:
    """torch.compile of fn after torch._dynamo.reset(): call it once per shape, so that the
    compiled baseline is specialized to its shape, as a model of fixed shapes gets it. Compiled
    again at a second shape, Dynamo recompiles with dynamic sizes (automatic dynamic shapes),
    and variants of one code object pile up toward its recompile limit, past which it runs
    eagerly (the linear cross-entropy bench's third shape: torch.compile 16.9 ms where a fresh
    compile takes 4.6)."""
    torch._dynamo.reset()
    return torch.compile(fn)


def env_info() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
    }
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    for dist in PEERS:  # versions from the installed metadata: no import (quack's loads CuTe DSL)
        try:
            info[dist.replace("-", "_")] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist.replace("-", "_")] = None
    return info


_UNAVAILABLE: set[tuple[str, str]] = set()  # the peers optional_peer has said are missing


def optional_peer(module: str, name: str):
    """module.name of a peer library, or None (said once a process, with why) where it is not
    installed or fails to import here (quack needs its CuTe DSL runtime and a GPU it supports)."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as e:
        if (module, name) not in _UNAVAILABLE:
            _UNAVAILABLE.add((module, name))
            why = str(e).splitlines()[0][:120] if str(e) else ""
            print(f"{module}.{name}: unavailable ({type(e).__name__}: {why})", file=sys.stderr, flush=True)
        return None


MIN_SAMPLES = 20


def median_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100, graph: bool = False) -> float:
    """Median time of fn in milliseconds (triton.testing.do_bench on GPU; on CPU the second call)
    over rep ms of calls, and at least MIN_SAMPLES of them (do_bench fits its call count into
    rep: 100 ms would be 2 calls of a 40 ms loss). graph=True replays fn captured in a CUDA
    graph (graph_ms), as serving runs a decoding step: the kernels' time without the host's
    per-launch cost."""
    if torch.cuda.is_available():
        from triton.testing import do_bench
        fn()  # compile and autotune outside the timing (and the capture)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        rep = max(rep, round(MIN_SAMPLES * start.elapsed_time(end)))
        if graph:
            return graph_ms(fn, rep)
        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    # CPU: a smoke run under the Triton interpreter, not a measurement. Two calls: fn must run
    # again where the first left its buffers (in-place variants), as the GPU's many calls do
    import time
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def graph_ms(fn: Callable[[], object], rep: float, replays: int = 10) -> float:
    """Median ms of fn replayed in a CUDA graph of about rep ms of calls. Warm-up, capture and
    replay run on one side stream: a backward through autograd runs on its forward's stream, so
    autograd_pair records its forward on this stream in the warm-up, where the capture then
    finds the backward's kernels (triton's do_bench_cudagraph captures on another stream than
    its warm-up: the backward's kernels then ran outside the capture, which failed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        fn()
        start.record()
        for _ in range(3):
            fn()
        end.record()
        end.synchronize()
        calls = max(1, min(1000, round(rep / max(start.elapsed_time(end) / 3, 1e-3))))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(calls):
                fn()
        times = []
        for _ in range(replays):
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
    torch.cuda.current_stream().wait_stream(stream)
    return statistics.median(times)


def pick(suite: str, spec: str | None, known, what: str) -> list:
    """The entries of `known` (dict keys or a sequence; ints parsed as such) that spec names,
    comma-separated, in its order; None: all of them. An unknown or empty list exits naming the
    known ones (a command-line option's value)."""
    if spec is None:
        return list(known)
    picked = [s.strip() for s in spec.split(",") if s.strip()]
    keys = [int(p) if isinstance(next(iter(known)), int) and p.isdigit() else p for p in picked]
    unknown = [str(k) for k in keys if k not in known]
    if unknown or not keys:
        raise SystemExit(f"{suite}: unknown {what} {', '.join(unknown) or '(none given)'}; "
                         f"known: {', '.join(map(str, known))}")
    return keys


def within_budget(suite: str, args, points: Iterable) -> Iterator:
    """The points of a suite's grid, the first always, the next while --max-seconds
    (args.max_seconds; None: no limit) has not passed since the first started: a GPU call's time
    limit then cuts the grid, not the JSON."""
    points = list(points)
    limit, start = getattr(args, "max_seconds", None), time.monotonic()
    for i, point in enumerate(points):
        if i and limit is not None and time.monotonic() - start > limit:
            print(f"{suite}: --max-seconds {limit:g} reached: {i} of {len(points)} grid points timed", flush=True)
            return
        yield point


def report_unavailable(name: str, e: Exception) -> None:
    """Say which baseline could not run on this input and why."""
    print(f"    {name}: not available ({type(e).__name__}: {str(e).splitlines()[0][:120]})", file=sys.stderr)


def try_time(name: str, fn: Callable[[], object], **kw) -> float | None:
    """Time fn; a baseline that fails on this input (unsupported backend, OOM) gives None."""
    try:
        return median_ms(fn, **kw)
    except Exception as e:
        report_unavailable(name, e)
        return None
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


ROUNDS = 3


def time_rounds(fns: dict, rounds: int | None = None, **kw) -> dict:
    """{key: fn} -> {key: [ms per round]} (None: fn failed, try_time says why). Every round
    times all fns back to back: the GPU's speed drifts by several percent over minutes (4-10%
    between runs on the H100), and interleaving puts the same drift under every alternative.
    Each round starts one further down the list, and every other round runs it backwards, so
    a fn does not always start first or follow the same one (a long power-hungry kernel before
    it can lower the clocks it starts at). Callers group alike work (the attention bench times
    forwards and backwards apart)."""
    times: dict = {key: [] for key in fns}
    keys = list(fns)
    if rounds is None:
        rounds = ROUNDS if torch.cuda.is_available() else 1  # CPU: a smoke run (median_ms)
    for r in range(rounds if keys else 0):
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        for key in order[::-1] if r % 2 else order:
            fn = fns[key]
            if times[key] is not None:
                ms = try_time(" ".join(key) if isinstance(key, tuple) else str(key), fn, **kw)
                times[key] = None if ms is None else times[key] + [ms]
    return times


def median_or_none(values: list[float] | None) -> float | None:
    return None if not values else statistics.median(values)


def median_ratio(base: list[float] | None, ours: list[float] | None) -> float | None:
    """Speedup of ours over base: the median over rounds of base ms / ours ms."""
    if not base or not ours:
        return None
    return statistics.median(b / o for b, o in zip(base, ours))


def copy_bandwidth(nbytes: int, device: str = "cuda") -> float:
    """Device-to-device copy in bytes/s, counting bytes read and written (the ceiling)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def peak_memory(fn: Callable[[], object], device: str = "cuda") -> int:
    """Peak bytes allocated by fn beyond what was allocated before it ran."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def kernel_times(fn: Callable[[], object], calls: int = 1) -> list[tuple[str, float, float]]:
    """The CUDA kernels of `calls` calls of fn under torch.profiler: (name, device ms a call,
    launches a call) each, kernels only (host-side ops have no device time of their own)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [(e.key, e.self_device_time_total / 1e3 / calls, e.count / calls) for e in prof.key_averages()
            if e.self_device_time_total > 0]


def write_json(path: str, suite: str, rows: list[dict], extra: dict | None = None) -> None:
    with open(path, "w") as f:
        json.dump({"suite": suite, "env": env_info(), **(extra or {}), "rows": rows}, f, indent=1)
    print(f"wrote {path}")


def out_dir(doc: str | None) -> str:
    """The results folder of a script run as `python scripts/NAME.py OUT` (argparse: an unknown
    option is an error, not a folder name), made before the script's minutes of measuring."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("out", help="folder the JSON results are written to (made if missing)")
    out = parser.parse_args().out
    os.makedirs(out, exist_ok=True)
    return out
