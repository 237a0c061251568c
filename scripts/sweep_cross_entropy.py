"""Sweep the cross-entropy kernel's launch on the GPU (torch_flash/kernels/triton/cross_entropy.py,
Knobs): vocabulary block, warps, software-pipeline stages and persistent grids, so that the
defaults can be chosen from measurements. bf16 logits, random targets, mean reduction.

Groups, each timed in interleaved rounds of CUDA-graph replays (median_ms(graph=True)):
- fwd: the op's forward (CeFwd: row losses, then the reduction and target summary);
- bwd: the op's in-place backward (ce_bwd writing the gradient over the logits from the saved lse,
  as inplace_backward=True runs it);
- fused: ce_fwd writing the gradient over the logits in a second sweep of each row (the launch
  whose second read hopes for L2, where persistent grids sized by l2_programs apply);
- op: forward + in-place backward as the op runs them (with the backward's target summary), with
  the default launches and with the fastest fwd and bwd configurations of the shape.
Then, eagerly (do_bench, no graph capture), the op's default against quack.cross_entropy's forward
+ backward where `import quack` works. The kernels take milliseconds, so the host's launch cost
hides behind the GPU's queue there.

Bytes as the bench counts them: the logits read once by a forward, read and written by a
backward, 3 x the logits for forward + backward; TB/s and its fraction of a device copy of the
logits timed in the same process. Every configuration is first checked against the default on
CHECK_ROWS rows (largest relative difference of its outputs: the order of the reductions differs
with block and warps, so a few roundings may).
Writes OUT_DIR/sweep_cross_entropy.json after every shape and prints a table.
Usage: python scripts/sweep_cross_entropy.py OUT_DIR [--rounds N] [--shapes 8192x128256,...]
"""
from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time
from typing import Callable, NamedTuple

import torch
from torch._library.triton import set_wrap_triton_enabled

from torch_flash import _dispatch
from torch_flash.bench._common import copy_bandwidth, time_rounds, write_json
from torch_flash.kernels.triton import cross_entropy as K

# The H200's three points of 2026-11-27 first (quack ahead by 20-35 %), then two more.
SHAPES = [(8192, 128256), (4096, 256000), (32768, 32000), (8192, 32000), (16384, 128256)]
OPTIONS = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0, reduction="mean")
ROUNDS = 2
REP_MS = 10  # median_ms's floor; its 20-call minimum sets the time of these millisecond kernels
DEADLINE_S = 240  # no new shape after this: the run stays near 4 minutes on an H100 / H200
CHECK_ROWS = 1000  # more than a persistent grid's programs: its row loop runs
# bytes moved per logits byte
PASS_BYTES = {"fwd": 1, "bwd": 2, "fused": 3, "op": 3}


class Config(NamedTuple):
    """A launch to time: block None is the launch rule's; per_sm or l2_fraction make the grid
    persistent (per_sm programs a SM, or l2_programs' count), neither one program per row."""
    block: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    per_sm: int | None = None
    l2_fraction: float | None = None

    @property
    def name(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self._asdict().items() if v is not None) or "default"

    def knobs(self, n_rows: int, row_bytes: int, device: torch.device) -> K.Knobs:
        if self.per_sm:
            programs = self.per_sm * _dispatch.sm_count(device)
        elif self.l2_fraction:
            programs = K.l2_programs(n_rows, row_bytes, device, self.l2_fraction)
        else:
            programs = None
        return K.Knobs(self.num_warps, self.num_stages, programs)


def grid() -> dict[str, list[Config]]:
    """group -> its configurations, today's launch first. Streaming kernels: more bytes in flight
    (pipeline stages, more and smaller programs); the fused one also L2-sized persistent grids."""
    streaming = [Config(), Config(num_stages=2), Config(num_stages=3), Config(4096, 8), Config(4096, 8, 3),
                 Config(4096, 4), Config(per_sm=2)]
    return {
        "fwd": streaming + [Config(per_sm=4), Config(8192, 8), Config(16384, 16)],
        "bwd": streaming + [Config(8192, 16), Config(8192, 16, 3)],
        "fused": [Config(), Config(l2_fraction=0.5), Config(l2_fraction=1.0), Config(num_stages=3),
                  Config(num_stages=3, l2_fraction=1.0), Config(8192, 16), Config(8192, 16, 3, l2_fraction=1.0),
                  Config(per_sm=2)],
    }


def runner(group: str, cfg, x: torch.Tensor, t: torch.Tensor) -> Callable[[], tuple]:
    """The call group times with cfg (op: a (fwd, bwd) pair of Configs) on logits x (N, V) and
    targets t; it returns its outputs, the logits last where it overwrites them."""
    n, v = x.shape
    row_bytes = v * x.element_size()
    one = torch.ones((), device=x.device)

    def plan(c: Config):
        return K.CeFwd(x, t, **OPTIONS, block=c.block, knobs=c.knobs(n, row_bytes, x.device))

    def backward(c: Config, lse, n_valid):
        return K.ce_bwd(one, x, t, lse, out=x, block=c.block, knobs=c.knobs(n, row_bytes, x.device),
                        n_valid=n_valid, **OPTIONS)

    if group == "fwd":
        fwd = plan(cfg)
        return lambda: fwd(x, t)[:2]
    if group == "bwd":
        _, lse, summary = K.CeFwd(x, t, **OPTIONS)(x, t)
        return lambda: (backward(cfg, lse, summary[0]),)
    if group == "fused":
        n_valid = K.target_summary(t, OPTIONS["ignore_index"])[0]
        knobs = cfg.knobs(n, row_bytes, x.device)
        return lambda: K.ce_fwd(x, t, grad_logits_out=x, block=cfg.block, knobs=knobs, n_valid=n_valid,
                                **OPTIONS)
    if group == "op":
        fwd = plan(cfg[0])

        def run():
            loss, lse, _ = fwd(x, t)
            # the backward's own target check, as the op's (TargetCheck) launches it
            n_valid = K.target_summary(t, OPTIONS["ignore_index"])[0]
            return loss, backward(cfg[1], lse, n_valid)
        return run
    raise ValueError(group)


def _quack(x: torch.Tensor, t: torch.Tensor) -> Callable[[], object] | None:
    """quack.cross_entropy forward + backward (in place where it offers it) on its own copy of x,
    or None where quack does not import."""
    try:
        import quack
        ce = quack.cross_entropy
    except Exception:
        return None
    kw = {"inplace_backward": True} if "inplace_backward" in inspect.signature(ce).parameters else {}
    leaf = x.detach().clone().requires_grad_()

    def run():
        return torch.autograd.grad(ce(leaf, t, **kw), leaf)
    return run


def check(group: str, cfgs: list, x: torch.Tensor, t: torch.Tensor) -> dict[str, float]:
    """name -> the largest difference of a configuration's outputs from the first one's (relative
    to each output's largest magnitude), on fresh copies of x; or why it failed."""
    ref, diffs = None, {}
    for cfg in cfgs:
        try:
            out = [o.float() for o in runner(group, cfg, x.clone(), t)()]
        except Exception as e:  # one that does not compile here: its timing fails and says why
            diffs[name(cfg)] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        ref = ref or out
        diffs[name(cfg)] = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).nan_to_num(float("inf")).item()
                               for a, b in zip(out, ref))
    return diffs


def name(cfg: Config | tuple | str) -> str:
    """A Config's name, "fwd + bwd" for the op's pair of them, or the string itself."""
    if isinstance(cfg, Config):
        return cfg.name
    return cfg if isinstance(cfg, str) else " + ".join(c.name for c in cfg)


def _row(group, cfg, times, n, v, copy_bps, device, diffs, timing="graph") -> dict:
    nbytes = PASS_BYTES[group] * n * v * 2
    ms = statistics.median(times) if times else None
    tbps = None if ms is None else nbytes / (ms * 1e-3) / 1e12
    row = {"shape": [n, v], "group": group, "config": name(cfg), "timing": timing, "ms": ms, "round_ms": times,
           "bytes": nbytes, "tbps": tbps, "frac_copy": None if tbps is None else tbps * 1e12 / copy_bps,
           "max_rel_diff_vs_default": diffs.get(name(cfg))}
    if isinstance(cfg, Config):
        programs = cfg.knobs(n, v * 2, device).programs
        row.update(cfg._asdict(), programs=programs,
                   resident_mb=None if programs is None else min(n, programs) * v * 2 / 2**20)
    return row


def run_shape(n: int, v: int, rounds: int, rows: list[dict], device: torch.device) -> None:
    """Times every group at logits (n, v) on device, appending rows and printing them."""
    x = torch.randn(n, v, device=device, dtype=torch.bfloat16) * 4
    t = torch.randint(0, v, (n,), device=device)
    # the backward groups overwrite x with gradients: checks take rows of the logits kept aside
    sample = x[:CHECK_ROWS].clone()
    copy_bps = copy_bandwidth(2 * x.numel() * x.element_size(), device.type)
    rows.append({"shape": [n, v], "group": "copy", "config": "copy", "tbps": copy_bps / 1e12, "frac_copy": 1.0})
    print(f"\n{n} x {v} bf16: copy {copy_bps / 1e12:.2f} TB/s", flush=True)
    groups = grid()
    best = {}
    for group, cfgs in groups.items():
        diffs = check(group, cfgs, sample, t[:CHECK_ROWS])
        times = time_rounds({c.name: runner(group, c, x, t) for c in cfgs}, rounds=rounds, graph=True, rep=REP_MS)
        rows.extend(_row(group, c, times[c.name], n, v, copy_bps, device, diffs) for c in cfgs)
        timed = [c for c in cfgs if times[c.name]]
        best[group] = min(timed, key=lambda c: statistics.median(times[c.name])) if timed else cfgs[0]
        _print(rows, n, v, group)
    pairs = list(dict.fromkeys([(groups["fwd"][0], groups["bwd"][0]), (best["fwd"], best["bwd"])]))
    diffs = check("op", pairs, sample, t[:CHECK_ROWS])
    times = time_rounds({name(p): runner("op", p, x, t) for p in pairs}, rounds=rounds, graph=True, rep=REP_MS)
    rows.extend(_row("op", p, times[name(p)], n, v, copy_bps, device, diffs) for p in pairs)
    eager = {name(pairs[0]): runner("op", pairs[0], x, t), "quack": _quack(x, t)}
    times = time_rounds({k: f for k, f in eager.items() if f is not None}, rounds=rounds, graph=False, rep=REP_MS)
    rows.extend(_row("op", k, times[k], n, v, copy_bps, device, {}, timing="eager") for k in times)
    _print(rows, n, v, "op")


def _print(rows: list[dict], n: int, v: int, group: str) -> None:
    print(f"  {group}:")
    for r in rows:
        if r["shape"] == [n, v] and r["group"] == group:
            diff = r.get("max_rel_diff_vs_default")
            print(f"    {r['config']:<44} {r['timing']:>5} " + (
                f"{r['ms']:8.3f} ms {r['tbps']:5.2f} TB/s {r['frac_copy']:5.3f} of copy" if r["ms"] else "failed")
                + ("" if diff is None else f"  (diff {diff:.1e})" if isinstance(diff, float) else f"  ({diff})"),
                flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--shapes", default=",".join(f"{n}x{v}" for n, v in SHAPES))
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "sweep_cross_entropy.json")
    props = torch.cuda.get_device_properties(0)
    extra = {"sms": props.multi_processor_count, "l2_bytes": props.L2_cache_size, "rounds": args.rounds,
             "options": OPTIONS, "grid": {g: [c.name for c in cs] for g, cs in grid().items()}}
    try:
        from importlib.metadata import version
        extra["quack_kernels"] = version("quack-kernels")
    except Exception:
        extra["quack_kernels"] = None
    rows: list[dict] = []
    start = time.monotonic()
    for n, v in shapes:
        if time.monotonic() - start > DEADLINE_S:
            print(f"skipping {n} x {v}: past {DEADLINE_S} s", flush=True)
            continue
        try:
            run_shape(n, v, args.rounds, rows, torch.device("cuda"))
        finally:  # what was timed survives a peer that breaks the process
            write_json(path, "sweep_cross_entropy", rows, {**extra, "seconds": round(time.monotonic() - start)})
        torch.cuda.empty_cache()
    print(f"\nfastest per group, fraction of copy ({time.monotonic() - start:.0f} s):")
    for n, v in shapes:
        for group in ("fwd", "bwd", "fused", "op"):
            timed = [r for r in rows if r["shape"] == [n, v] and r["group"] == group and r.get("ms")]
            graphed = [r for r in timed if r["timing"] == "graph"]
            if graphed:
                b = min(graphed, key=lambda r: r["ms"])
                print(f"  {n:>6} x {v:<6} {group:>5}: {b['config']:<44} {b['frac_copy']:.3f} "
                      f"(default {graphed[0]['frac_copy']:.3f})")
            eager = ", ".join(f"{r['config']} {r['frac_copy']:.3f}" for r in timed if r["timing"] == "eager")
            if eager:
                print(f"  {'':>15} eager: {eager}")

if __name__ == "__main__":
    # the launchers are called outside their ops: no wrap_triton tracing hook per launch
    with set_wrap_triton_enabled(False):
        main()
