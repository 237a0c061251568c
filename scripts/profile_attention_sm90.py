"""One attention forward or backward of the standard grid's shape, repeated, for Nsight Compute
to read the hardware counters of one launch (the GPU machine's Firecracker runtime has them):

    ncu --clock-control none --launch-skip 3 --launch-count 1 --kernel-name-base demangled \\
        --kernel-name regex:'FmhaKernelTmaWarpSpecialized|FlashAttention(Forward|Backward)Sm90' \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --csv \\
        python3 scripts/profile_attention_sm90.py bwd --impl cuda-sm90 --d 128 --s 4096 > $OUT/ncu.csv

--impl: cuda-sm90 (torch_flash._C's Hopper kernels, called directly) or fa4 (flash-attn-4, where
importable); bf16, 32k tokens, hidden 2048 (B = 32k / S, H = 2048 / D), q, k, v (B, S, H, D)
buffers seen as (B, H, S, D), as torch_flash.bench.attention times them. Warm-up calls come
first (FA4 compiles its kernels on the first), so skip a few launches. The regex picks the main
kernel by its demangled name (ours are all `device_kernel`): not the row sums before it nor the
dq conversion after. scripts/ncu_compare.py puts such CSVs side by side and files them as
docs/results/profile_attention_sm90/<date>_<device>.json.

--breakdown (no ncu): the device time of every kernel of one call, averaged over --calls calls
under torch.profiler, e.g. how much of a backward the row sums, the dq buffer's zeros and the
dq conversion around the main kernel take, for ours and FA4's alike.
"""
from __future__ import annotations

import argparse

import torch

TOKENS, HIDDEN = 32 * 1024, 2048


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pass_", metavar="pass", choices=("fwd", "bwd"))
    ap.add_argument("--impl", choices=("cuda-sm90", "fa4"), default="cuda-sm90")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--breakdown", action="store_true", help="print each kernel's device time a call")
    args = ap.parse_args()
    d, s, causal = args.d, args.s, args.causal
    b, h = TOKENS // s, HIDDEN // d
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                     for _ in range(4))
    if args.impl == "cuda-sm90":
        import torch_flash  # noqa: F401  (registers torch.ops.flash)
        out, lse = torch.ops.flash.attention_fwd_sm90(q, k, v, d ** -0.5, causal)
        if args.pass_ == "fwd":
            def call():
                torch.ops.flash.attention_fwd_sm90(q, k, v, d ** -0.5, causal)
        else:
            def call():
                torch.ops.flash.attention_bwd_sm90(dout, q, k, v, out, lse, d ** -0.5, causal)
    else:
        from flash_attn.cute import flash_attn_func
        leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
        result = flash_attn_func(*leaves, causal=causal)
        out = result[0] if isinstance(result, tuple) else result
        if args.pass_ == "fwd":
            def call():
                flash_attn_func(*leaves, causal=causal)
        else:
            def call():
                torch.autograd.grad(out, leaves, dout.transpose(1, 2), retain_graph=True)
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    print(f"{args.impl} {args.pass_} d={d} s={s} b={b} h={h} {'causal' if causal else 'full'}: {args.calls} calls")
    if args.breakdown:
        breakdown(call, args.calls)


def breakdown(call, calls: int) -> None:
    """Each kernel's device time a call (mean over `calls` profiled calls), largest first."""
    from torch_flash.bench._common import kernel_times

    rows = [(ms * 1e3, count, name) for name, ms, count in kernel_times(call, calls)]
    total = sum(us for us, _, _ in rows)
    for us, count, name in sorted(rows, reverse=True):
        print(f"{us:10.1f} us {us / total:6.1%} {count:4.1f}x  {name[:110]}")
    print(f"{total:10.1f} us a call in all")


if __name__ == "__main__":
    main()
