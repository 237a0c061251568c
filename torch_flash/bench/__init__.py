"""Benchmarks: `python -m torch_flash.bench <suite>` (docs/perf.md has the committed results).

Each suite module defines `run(args) -> list[dict]` timing the fused op against the strongest
alternatives in the same process on the same inputs, and `plot(data, png_path)`; the runner writes
the rows as JSON with the device, versions and date ({"suite", "env", "rows"}: _common.write_json),
and a PNG plot beside it (`python -m torch_flash.bench plot` redraws one from the JSON).
"""
