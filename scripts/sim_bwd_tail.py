"""Greedy simulation of the Hopper backward's grid tail (KeyBlockScheduler, BwdTailSplit in
csrc/attention/attention_bwd_sm90.cuh): CTAs dispatched in grid order to the first free SM, each
lasting its query tiles plus a fixed overhead; prints the makespan over the ideal (total / SMs)
for the 3-D grid's order, the L2-grouped longest-first order and no mask.

    python scripts/sim_bwd_tail.py [--sms 132] [--overhead 1.5]
"""
import argparse
import heapq


def makespan(durations, sms):
    free = [0.0] * sms
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--overhead", type=float, default=1.5, help="a CTA's prologue/epilogue, in tiles")
    ap.add_argument("--l2", type=float, default=50e6, help="L2 bytes (KeyBlockScheduler::group_for_l2)")
    a = ap.parse_args()
    heads, rows, keys = 16, 64, 128  # the bench's grid at D=128: 32k tokens, 16 heads
    for s, batch in ((1024, 32), (4096, 8), (16384, 2)):
        blocks = s // keys
        causal = [(s - keys * kb) // rows + a.overhead for kb in range(blocks)]  # bottom-right
        grid = [causal[kb] for _ in range(batch * heads) for kb in range(blocks)]
        pairs, group = batch * heads, 1
        while 2 * group * s * 128 * (2 * 2 + 4) <= a.l2:  # Q, dO (bf16) and fp32 dQ rows
            group *= 2
        grouped = [causal[kb] for g0 in range(0, pairs, group) for kb in range(blocks)
                   for _ in range(g0, min(g0 + group, pairs))]
        full = [s // rows + a.overhead] * (pairs * blocks)
        ideal = sum(grid) / a.sms
        print(f"S={s:5d} causal tail: grid {makespan(grid, a.sms) / ideal - 1:6.1%}, "
              f"grouped ({group:2d} pairs) {makespan(grouped, a.sms) / ideal - 1:6.1%}; "
              f"no mask {makespan(full, a.sms) / (sum(full) / a.sms) - 1:6.1%}")


if __name__ == "__main__":
    main()
