"""Side by side: the metrics of one kernel launch from each of several Nsight Compute CSV files
(`ncu --csv ...` over scripts/profile_attention_sm90.py, as its docstring runs it), one column a
launch; --json files them as a curated result, which this script reads back as well.

    python scripts/ncu_compare.py ours.csv fa4.csv [--grep cycles,instructions,throughput]
    python scripts/ncu_compare.py *.csv --json OUT.json --device "NVIDIA H200" --date 2026-11-29T12:39:00+00:00
    python scripts/ncu_compare.py docs/results/profile_attention_sm90/2026-11-29_h200.json --grep cycles

A file with several launches gives its last. Each row of the JSON carries the launch the
profile script describes on its first line (pass, implementation, d, s, b, h, mask).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import re

LAUNCH = re.compile(r"^(?P<impl>\S+) (?P<pass>fwd|bwd) d=(?P<d>\d+) s=(?P<s>\d+) b=(?P<b>\d+) h=(?P<h>\d+) "
                    r"(?P<mask>full|causal)", re.M)


def load(path: str) -> dict:
    """{"launch": the profile script's description, "kernel": name, "metrics": {"section /
    metric": [value, unit]}} of the file's last launch."""
    with open(path) as f:
        text = f.read()
    start = text.find('"ID"')
    if start < 0:
        raise SystemExit(f"{path}: no ncu CSV table (did ncu profile any kernel?)")
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    last = [r for r in rows if r["ID"] == rows[-1]["ID"]]
    launch = LAUNCH.search(text[:start])
    launch = {k: int(v) if v.isdigit() else v for k, v in (launch.groupdict() if launch else {}).items()}
    return {"launch": launch, "kernel": last[0]["Kernel Name"],
            "metrics": {f"{r['Section Name']} / {r['Metric Name']}": [r["Metric Value"], r["Metric Unit"]]
                        for r in last if r["Metric Name"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--grep", help="comma-separated substrings: only metrics naming one of them")
    ap.add_argument("--json", metavar="OUT", help="write the launches as docs/results JSON")
    ap.add_argument("--device", help="with --json: the card's name, as torch reports it")
    ap.add_argument("--date", help="with --json: when the profiles ran (ISO 8601)")
    args = ap.parse_args()
    loaded = []
    for path in args.files:
        if path.endswith(".json"):  # a filed result: one launch a row
            with open(path) as f:
                loaded += [{"launch": {k: v for k, v in r.items() if k not in ("kernel", "metrics")},
                            "kernel": r["kernel"], "metrics": r["metrics"]} for r in json.load(f)["rows"]]
        else:
            loaded.append(load(path))
    if args.json:
        if not (args.device and args.date):
            raise SystemExit("--json needs --device and --date")
        rows = [{**r["launch"], "kernel": r["kernel"], "metrics": r["metrics"]} for r in loaded]
        with open(args.json, "w") as f:
            json.dump({"suite": "profile_attention_sm90", "env": {"date": args.date, "device": args.device},
                       "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
        return
    for i, r in enumerate(loaded):
        print(f"[{i}] {' '.join(map(str, r['launch'].values()))}: {r['kernel'][:80]}")
    keys = list(dict.fromkeys(k for r in loaded for k in r["metrics"]))
    if args.grep:
        words = [w.strip().lower() for w in args.grep.split(",") if w.strip()]
        keys = [k for k in keys if any(w in k.lower() for w in words)]
    width = max(map(len, keys), default=10)
    for k in keys:
        values = [r["metrics"].get(k, ["-", ""])[0] for r in loaded]
        unit = next((r["metrics"][k][1] for r in loaded if k in r["metrics"]), "")
        print(f"{k:{width}}  " + "  ".join(f"{v:>18}" for v in values) + f"  {unit}")


if __name__ == "__main__":
    main()
