"""Benchmarks: `python -m torch_flash.bench <suite>` (DESIGN.md "Benchmarks").

Each suite module defines `run(args) -> list[dict]` timing the fused op against the strongest
alternatives in the same process on the same inputs, and `plot(rows, path)`; the runner writes
the rows as JSON with the device, versions and date, and a PNG plot beside it.
"""
