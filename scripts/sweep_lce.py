"""Where linear cross-entropy's time goes on the GPU, to choose its chunk size from measurements:
fwd+bwd ms and peak memory of lce_fwd per chunk size, next to torch.compile of linear +
cross_entropy and Liger-Kernel's fused kernel (where installed) in the same process, and the
time of each step of one chunk (logits GEMM, loss kernel, dhidden GEMM, dweight GEMM with and
without accumulation into dweight).
Usage: python scripts/sweep_lce.py OUT.json [tokens hidden vocab]
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch._library.triton import set_wrap_triton_enabled

from torch_flash.bench._common import env_info, median_ms, peak_memory
from torch_flash.bench.linear_cross_entropy import _liger
from torch_flash.kernels.triton import cross_entropy as ce

OPTIONS = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0, reduction="mean")


def main(path, n=8192, hid=4096, v=128256):
    h = torch.randn(n, hid, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, hid, device="cuda", dtype=torch.bfloat16) * hid ** -0.5
    t = torch.randint(0, v, (n,), device="cuda")
    rows = []

    def record(**row):
        rows.append(row)
        print(row, flush=True)

    def naive(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t)
    compiled = torch.compile(naive)
    hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()

    def compile_step():
        return torch.autograd.grad(compiled(hg, wg, t), (hg, wg))
    record(impl="compile", ms=median_ms(compile_step), peak_mb=peak_memory(compile_step) / 2**20)
    liger = _liger()
    if liger is not None:
        def liger_step():
            return torch.autograd.grad(liger(hg, wg, t), (hg, wg))
        record(impl="liger", ms=median_ms(liger_step), peak_mb=peak_memory(liger_step) / 2**20)
    for rows_per_chunk in (512, 768, 1024, 1280, 1536, 2048):
        def step(r=rows_per_chunk):
            return ce.lce_fwd(h, w, t, None, chunk_size=r, **OPTIONS)
        record(impl="ours", chunk=rows_per_chunk, ms=median_ms(step), peak_mb=peak_memory(step) / 2**20)

    for r in (768, 1024, 1536):
        logits = torch.empty(r, v, device="cuda", dtype=torch.bfloat16)
        dw = torch.empty_like(w)
        dh = torch.empty(r, hid, device="cuda", dtype=torch.bfloat16)
        losses, lse = (torch.empty(r, device="cuda") for _ in range(2))
        parts = {
            "logits_mm": lambda: torch.mm(h[:r], w.t(), out=logits),
            "loss_kernel": lambda: ce._launch(logits, t[:r], loss=losses, lse=lse, grad_loss=None, out=logits,
                                              n_valid=torch.tensor(n, device="cuda"), block=None, **OPTIONS),
            "dh_mm": lambda: torch.mm(logits, w, out=dh),
            "dw_mm": lambda: torch.mm(logits.t(), h[:r], out=dw),
            "dw_addmm": lambda: dw.addmm_(logits.t(), h[:r]),
        }
        torch.mm(h[:r], w.t(), out=logits)
        for name, fn in parts.items():
            record(impl="part", chunk=r, part=name, ms=median_ms(fn))
    with open(path, "w") as f:
        json.dump({"env": env_info(), "shape": [n, hid, v], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    with set_wrap_triton_enabled(False):
        main(sys.argv[1], *map(int, sys.argv[2:]))
