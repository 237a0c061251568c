"""Linear cross-entropy at the H100's power cap: per implementation and per GEMM, the median
time of a call next to the SM clock, board power and throttle reasons that nvidia-smi samples
(every 20 ms) while it runs, and the energy of a call (mean power x median time).

Everything here runs for 3 s per phase, two interleaved rounds, on the same random bf16 inputs:
linear_cross_entropy fwd+bwd at several chunk sizes, torch.compile of linear + cross_entropy,
and the three GEMMs of 8 chunks of 1024 rows against the same GEMMs unchunked.
Usage: python scripts/power_lce.py OUT_DIR (writes OUT_DIR/lce_power.json)
"""
import json
import os
import statistics as st
import subprocess
import time
from datetime import datetime

import torch
import torch.nn.functional as F

from torch_flash.bench._common import env_info, out_dir
from torch_flash.ops.linear_cross_entropy import linear_cross_entropy

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
PHASE_S, SETTLE_S = 3.0, 0.5


def naive(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def phases(n=8192, hid=4096, v=128256, r=1024):
    h = torch.randn(n, hid, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, hid, device="cuda", dtype=torch.bfloat16) * hid**-0.5).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    compiled = torch.compile(naive)

    def step(fn, **kw):
        return torch.autograd.grad(fn(h, w, t, **kw), (h, w))

    hd, wd = h.detach(), w.detach()
    g = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 1e-3  # stands for the logits' gradient
    dw = torch.randn(v, hid, device="cuda", dtype=torch.bfloat16)
    dh = torch.empty(n, hid, device="cuda", dtype=torch.bfloat16)
    chunks = [slice(s, s + r) for s in range(0, n, r)]
    out = {f"ours_{rows}": (lambda rows=rows: step(linear_cross_entropy, chunk_size=rows)) for rows in (1024, 1280, 2048)}
    out.update({
        "compile": lambda: step(compiled),
        f"logits_gemm_{r}_chunks": lambda: [torch.mm(hd[c], wd.t(), out=g[:r]) for c in chunks],
        "logits_gemm_full": lambda: torch.mm(hd, wd.t(), out=g),
        f"dhidden_gemm_{r}_chunks": lambda: [torch.mm(g[c], wd, out=dh[c]) for c in chunks],
        "dhidden_gemm_full": lambda: torch.mm(g, wd, out=dh),
        f"dweight_gemm_{r}_chunks_accumulating": lambda: [dw.addmm_(g[c].t(), hd[c]) for c in chunks],
        f"dweight_gemm_{r}_chunks_overwriting": lambda: [torch.mm(g[c].t(), hd[c], out=dw) for c in chunks],
        "dweight_gemm_full": lambda: torch.mm(g.t(), hd, out=dw),
    })
    return out


def sample_log(path):
    samples = []
    for line in open(path):
        f = [x.strip() for x in line.split(",")]
        try:
            samples.append((datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp(),
                            float(f[1]), float(f[2]), float(f[3]), int(f[4], 16)))
        except (ValueError, IndexError):
            continue  # a partial last line
    return samples


def main(out_dir, rounds=2):
    fns = phases()
    for name, fn in fns.items():
        print(f"warm-up {name}", flush=True)
        fn(), fn()
    torch.cuda.synchronize()
    log = os.path.join(out_dir, "smi.csv")
    with open(log, "w") as f:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "20"], stdout=f)
    rows = []
    for rnd in range(rounds):
        for name, fn in fns.items():
            time.sleep(SETTLE_S)
            t0, ms = time.time(), []
            while time.time() - t0 < PHASE_S:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(), fn(), b.record()
                b.synchronize()
                ms.append(a.elapsed_time(b))
            rows.append(dict(impl=name, round=rnd, t0=t0, t1=time.time(), ms=st.median(ms), calls=len(ms)))
            print(f"{name:36s} round {rnd}: {rows[-1]['ms']:.3f} ms", flush=True)
    time.sleep(SETTLE_S)
    smi.terminate(), smi.wait()
    samples = sample_log(log)
    for row in rows:
        # the first SETTLE_S of a phase still carries the previous phase's averaged power reading
        s = [x for x in samples if row["t0"] + SETTLE_S <= x[0] <= row["t1"]]
        row.update(samples=len(s), sm_mhz=st.mean(x[1] for x in s), watts=st.mean(x[2] for x in s),
                   max_temp_c=max(x[3] for x in s), reasons=sorted({hex(x[4]) for x in s}))
        row["joules"] = row["watts"] * row["ms"] / 1e3
    limit_w, max_mhz = subprocess.run(["nvidia-smi", "--query-gpu=power.limit,clocks.max.sm", "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True).stdout.split(",")
    with open(os.path.join(out_dir, "lce_power.json"), "w") as f:
        json.dump({"env": env_info(), "power_limit_w": float(limit_w), "max_sm_mhz": float(max_mhz), "rows": rows},
                  f, indent=1)
    print(f"{'impl':36s} {'ms':>8s} {'SM MHz':>7s} {'W':>5s} {'J':>6s}  throttle reasons (0x4: software power cap)")
    for row in rows:
        print(f"{row['impl']:36s} {row['ms']:8.2f} {row['sm_mhz']:7.0f} {row['watts']:5.0f} {row['joules']:6.2f}  {row['reasons']}")


if __name__ == "__main__":
    main(out_dir(__doc__))
