"""Where a kernel's warps stall, instruction by instruction: Nsight Compute's source page (SASS)
of one launch, as CSV, summed by opcode and listed by the hottest instructions, for one or more
launches side by side (ours against FA4's).

    ncu --section SourceCounters --section WarpStateStats -o rep python3 scripts/profile_attention_sm90.py bwd ...
    ncu --import rep.ncu-rep --page source --csv --print-source sass > ours.csv
    python scripts/ncu_source.py ours.csv fa4.csv [--column "Warp Stall Sampling (All Samples)"] [--top 25]

Every numeric column of the page is summed per opcode (predicates and modifiers dropped: HGMMA,
SYNCS, LDS, ...); the column to rank by (--column, default: the first whose name holds
"Sampling") gives each opcode's and each instruction's share. Where the pages count executed
instructions and MUFU runs, each opcode's executions per 64 MUFU follow: one exponential a
score, so kernels of different tile shapes compare per unit of work. Files may be gzipped.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import re
from collections import defaultdict

EXECUTED = "Instructions Executed"
OPCODE = re.compile(r"^\s*(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def read(path: str) -> tuple[list[str], list[dict]]:
    """(numeric column names, rows with "source", "opcode" and those columns as floats)."""
    raw = (gzip.open(path, "rt") if path.endswith(".gz") else open(path)).read()
    lines = raw.splitlines()
    start = next((i for i, line in enumerate(lines) if '"Source"' in line or line.startswith("Source")), None)
    if start is None:
        raise SystemExit(f"{path}: no source table (a column named Source)")
    table = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    numeric = [c for c in table[0] if c not in ("Source", "# Address", "Address") and _number(table[0][c]) is not None]
    rows = []
    for r in table:
        m = OPCODE.match(r.get("Source") or "")
        if m is None:
            continue
        rows.append({"source": r["Source"].strip(), "opcode": m.group(1),
                     **{c: _number(r[c]) or 0.0 for c in numeric}})
    return numeric, rows


def _number(text: str | None) -> float | None:
    try:
        return float((text or "").replace(",", "").rstrip("%"))
    except ValueError:
        return None


def by_opcode(rows: list[dict], column: str) -> dict[str, float]:
    sums: dict[str, float] = defaultdict(float)
    for r in rows:
        sums[r["opcode"]] += r[column]
    return dict(sums)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    ap.add_argument("--column", help="the column to rank by (default: the first with 'Sampling' in its name)")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    loaded = [read(f) for f in args.files]
    column = args.column or next((c for c in loaded[0][0] if "Sampling" in c), loaded[0][0][0])
    totals = []
    for path, (numeric, rows) in zip(args.files, loaded):
        if column not in numeric:
            raise SystemExit(f"{path}: no column {column!r} (has: {', '.join(numeric)})")
        totals.append(sum(r[column] for r in rows) or 1.0)
    opcodes = [by_opcode(rows, column) for _, rows in loaded]
    print(f"{column}, share by opcode: " + " | ".join(args.files))
    ranked = sorted(set().union(*opcodes), key=lambda op: -max(o.get(op, 0) / t for o, t in zip(opcodes, totals)))
    for op in ranked[:args.top]:
        print(f"  {op:12s} " + "  ".join(f"{100 * o.get(op, 0) / t:6.2f} %" for o, t in zip(opcodes, totals)))
    executed = [by_opcode(rows, EXECUTED) if EXECUTED in numeric else {} for numeric, rows in loaded]
    if all(e.get("MUFU") for e in executed):
        print(f"\n{EXECUTED} per 64 MUFU (an exponential a score): " + " | ".join(args.files))
        per = [{op: 64 * n / e["MUFU"] for op, n in e.items()} for e in executed]
        print(f"  {'all':12s} " + "  ".join(f"{sum(p.values()):8.1f}" for p in per))
        for op in sorted(set().union(*per), key=lambda op: -max(p.get(op, 0) for p in per))[:args.top]:
            print(f"  {op:12s} " + "  ".join(f"{p.get(op, 0):8.1f}" for p in per))
    for path, (_, rows), total in zip(args.files, loaded, totals):
        print(f"\n{path}: the {args.top} hottest instructions by {column}")
        for r in sorted(rows, key=lambda r: -r[column])[:args.top]:
            print(f"  {100 * r[column] / total:6.2f} %  {r['source'][:90]}")


if __name__ == "__main__":
    main()
