"""Same-call A/B of two builds from their bench JSONs (`python -m torch_flash.bench <suite>` run
once in each build's tree, one after another on one GPU): one file with BASE's rows renamed
<impl>-before beside NEW's, and each row's time ratio BASE / NEW printed (above 1: NEW faster).
docs/results/attention_bwd*/ hold such files.

    python scripts/bench_ab.py NEW.json BASE.json OUT.json
"""
import json
import sys


def main(new_path, base_path, out_path):
    new, base = (json.load(open(p)) for p in (new_path, base_path))
    before = {(r["d"], r["s"], r["causal"], r["pass"], r["impl"]): r["ms"] for r in base["rows"]}
    for r in new["rows"]:
        key = (r["d"], r["s"], r["causal"], r["pass"], r["impl"])
        if key in before:
            print(f"{r['impl']:14s} d={r['d']:3d} s={r['s']:5d} causal={int(r['causal'])} {r['pass']}: "
                  f"{before[key]:.3f} -> {r['ms']:.3f} ms, x{before[key] / r['ms']:.3f}")
    new["rows"] += [dict(r, impl=r["impl"] + "-before") for r in base["rows"]]
    new["env"]["base_date"] = base["env"]["date"]
    json.dump(new, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
