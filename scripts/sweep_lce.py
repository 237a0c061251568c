"""Linear cross-entropy's time against its memory by chunk_size, to choose a chunk size from
measurements: forward + backward through the op's autograd for each chunk_size (0: the default
plan), next to torch.compile of linear + cross_entropy and Liger-Kernel's fused kernel (where
installed), in interleaved rounds in one process. Writes OUT.json (rows: impl, chunk_size, the
plan (resident tokens, rows per chunk after them), ms, peak_mb) and OUT.png (ms against memory).
Usage: python scripts/sweep_lce.py OUT.json [tokens hidden vocab]
"""
import functools
import json
import statistics
import sys

import torch

from torch_flash.bench._common import compile_fresh, env_info, peak_memory, time_rounds
from torch_flash.bench.cross_entropy import with_grad
from torch_flash.bench.linear_cross_entropy import _eager, _inputs, _liger, plot_time_memory
from torch_flash.kernels.triton.linear_cross_entropy import lce_plan
from torch_flash.ops.linear_cross_entropy import linear_cross_entropy

CHUNK_SIZES = (128, 256, 512, 768, 1024, 1536, 0)
ROUNDS = 5


def main(path, n=8192, hid=4096, v=128256):
    h, w, t = _inputs(n, hid, v, "cuda")
    impls = {f"ours, chunk_size={c}" if c else "ours (default)": functools.partial(linear_cross_entropy, chunk_size=c)
             for c in CHUNK_SIZES}
    impls["compile"] = compile_fresh(_eager)
    impls["liger"] = _liger()
    fns = {k: with_grad(f, h, w, t) for k, f in impls.items() if f is not None}
    print(f"{n} x {hid} x {v} bf16: {len(fns)} implementations, {ROUNDS} interleaved rounds", flush=True)
    times = time_rounds(fns, rounds=ROUNDS)
    rows = []
    for impl, fn in fns.items():
        chunk = impls[impl].keywords["chunk_size"] if impl.startswith("ours") else None
        row = {"impl": impl, "chunk_size": chunk, "ms": statistics.median(times[impl]),
               "peak_mb": peak_memory(fn) / 2**20, "round_ms": times[impl]}
        if chunk is not None:
            row["plan"] = lce_plan(n, v, hid, h.dtype, chunk)
        rows.append(row)
        print(f"  {impl:>22}: {row['ms']:7.2f} ms, peak {row['peak_mb']:6.0f} MiB"
              + (f", plan {row['plan']}" if chunk is not None else ""), flush=True)
    data = {"env": env_info(), "shape": [n, hid, v], "rows": rows}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    plot(data, path.rsplit(".", 1)[0] + ".png")


def plot(data: dict, path: str) -> None:
    """ms against peak memory: ours by chunk_size as one curve (points labelled by chunk size),
    torch.compile and Liger as points."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{**r, "impl": r["impl"] if r["chunk_size"] is None else f"{r['chunk_size'] or 'default'}"}
            for r in data["rows"]]
    ours = sorted((r["peak_mb"] * 2**20 / 1e9, r["ms"]) for r in rows if r["chunk_size"] is not None)
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(*zip(*ours), "-", color="0.75", zorder=0, label="ours by chunk_size")
    plot_time_memory(ax, rows, "compile")
    n, hid, v = data["shape"]
    ax.set_title(f"linear cross-entropy fwd+bwd by chunk_size, {n} x {hid} x {v} bf16\n"
                 f"{data['env']['device']} ({data['env']['date'][:10]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
