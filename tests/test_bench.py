"""The benchmarks' timing protocol (torch_flash/bench/_common.py): interleaved rounds with a
rotating start, failures dropped for good, ratios as medians of the rounds' ratios; and each
suite's smoke run on CPU (python -m torch_flash.bench)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from torch_flash.bench import _common
from torch_flash.bench.__main__ import main


@pytest.fixture
def scripted(monkeypatch):
    """median_ms replaced by a script: {name: [ms per call]} (an Exception entry raises), the
    calls recorded in order."""
    calls: list[str] = []

    def install(script: dict[str, list]):
        def fake_median_ms(fn, **kw):
            name = fn()
            calls.append(name)
            ms = script[name].pop(0)
            if isinstance(ms, Exception):
                raise ms
            return ms
        monkeypatch.setattr(_common, "median_ms", fake_median_ms)
        return {name: (lambda name=name: name) for name in script}

    return install, calls


def test_rounds_interleave_with_a_rotating_start_and_alternating_direction(scripted):
    install, calls = scripted
    fns = install({"a": [1.0, 2.0, 3.0], "b": [4.0, 5.0, 6.0], "c": [7.0, 8.0, 9.0]})
    times = _common.time_rounds(fns, rounds=3)
    assert calls == ["a", "b", "c", "a", "c", "b", "c", "a", "b"]  # b follows a, c, a
    assert times == {"a": [1.0, 2.0, 3.0], "b": [4.0, 5.0, 6.0], "c": [7.0, 8.0, 9.0]}


def test_a_failing_alternative_is_dropped_for_the_remaining_rounds(scripted):
    install, calls = scripted
    fns = install({"ok": [1.0, 1.0, 1.0], "flaky": [2.0, RuntimeError("out of memory")]})
    times = _common.time_rounds(fns, rounds=3)
    assert times == {"ok": [1.0, 1.0, 1.0], "flaky": None}
    assert calls.count("flaky") == 2  # not timed again after it failed
    assert _common.median_or_none(times["flaky"]) is None
    assert _common.median_ratio(times["ok"], times["flaky"]) is None


def test_ratio_is_the_median_of_the_rounds_ratios():
    # each round's ratio pairs times taken back to back; the medians of the times would pair
    # one round's baseline with another round's ours
    base, ours = [10.0, 30.0, 12.0], [10.0, 20.0, 8.0]  # per round: 1.0, 1.5, 1.5
    assert _common.median_ratio(base, ours) == pytest.approx(1.5)
    assert _common.median_or_none(base) / _common.median_or_none(ours) == pytest.approx(1.2)
    assert _common.median_ratio(None, ours) is None and _common.median_ratio([], ours) is None


def test_no_alternatives_no_rounds():
    assert _common.time_rounds({}) == {}


# --------------------------------------------------------------------------------------
# The suites themselves, on their CPU shapes under the Triton interpreter
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("suite", ["norm", "cross_entropy", "linear_cross_entropy", "rotary", "decode"])
def test_suite_smoke_run_on_cpu(suite, tmp_path, monkeypatch):
    """`python -m torch_flash.bench SUITE` runs end to end where there is no GPU, on the Triton
    kernels (main() forces that backend there, not the reference path), and writes rows in
    which every variant of ours has a time."""
    if torch.cuda.is_available():
        pytest.skip("with a GPU the suites run their full shapes (docs/perf)")
    monkeypatch.setenv("TORCH_FLASH_BACKEND", "unset")  # so that teardown removes what main() sets
    monkeypatch.delenv("TORCH_FLASH_BACKEND")
    main([suite, "--out", str(tmp_path)])
    assert os.environ["TORCH_FLASH_BACKEND"] == "triton"
    rows = json.loads((tmp_path / f"{suite}.json").read_text())["rows"]
    ours = [r for r in rows if r["impl"].startswith("ours")]
    assert ours and all(r["ms"] is not None and r["ms"] > 0 for r in ours), rows


def test_suites_refuse_cpu_without_the_interpreter(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit):
        main(["norm", "--out", "unused"])
    assert "no CUDA GPU here" in capsys.readouterr().err


def test_linear_cross_entropy_targets_smoke_run_on_cpu(tmp_path, monkeypatch):
    """--targets times issue 4's point alone (tiny on CPU) and keeps each round's ratio to
    torch.compile for ours, with the sign test over the rounds."""
    if torch.cuda.is_available():
        pytest.skip("with a GPU the run times the full target shape (docs/perf)")
    monkeypatch.setenv("TORCH_FLASH_BACKEND", "unset")
    monkeypatch.delenv("TORCH_FLASH_BACKEND")
    main(["linear_cross_entropy", "--targets", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "linear_cross_entropy_targets.json").read_text())["rows"]
    ours = next(r for r in rows if r["impl"] == "ours")
    compiled = next(r for r in rows if r["impl"] == "compile")
    assert len(ours["round_ratios"]) == 3 and ours["ms"] > 0 and compiled["ms"] > 0
    assert ours["vs_compile"] == pytest.approx(sorted(ours["round_ratios"])[1])
    assert ours["rounds_faster"] == sum(r > 1 for r in ours["round_ratios"])
    assert ours["met_speed"] == (ours["vs_compile"] >= 1.0)
    at_liger = next(r for r in rows if r["impl"] == "ours, Liger's chunk")
    assert len(at_liger["round_ratios"]) == 3 and at_liger["ms"] > 0


def test_liger_chunk():
    """Liger-Kernel's tokens per chunk, as its source computes them (its own example: 16384 x
    4096 x 32000 in chunks of 2048)."""
    from torch_flash.bench.linear_cross_entropy import _liger_chunk
    assert _liger_chunk(16384, 4096, 32000) == 2048
    assert _liger_chunk(8192, 4096, 128256) == 256
    assert _liger_chunk(8192, 768, 50257) == 128  # 8192 / 66 = 124.1, up to a power of 2
    assert _liger_chunk(100, 4096, 1000) == 100  # one chunk of every token


def test_sign_test():
    from torch_flash.bench.linear_cross_entropy import _sign_test
    assert _sign_test(0, 5) == 1.0
    assert _sign_test(5, 5) == pytest.approx(1 / 32)
    assert _sign_test(4, 5) == pytest.approx(6 / 32)  # 4 or 5 of 5


def test_cli_subcommand_and_default_out(monkeypatch):
    """`python -m torch_flash bench ...` is the bench's own command line, and results go to
    ./bench_results unless --out says otherwise (never over the committed docs/perf)."""
    import torch_flash.__main__ as cli
    import torch_flash.bench.__main__ as bench
    seen = []
    monkeypatch.setattr(bench, "main", lambda argv=None: seen.append(argv))
    cli.main(["bench", "norm", "--quick"])
    assert seen == [["norm", "--quick"]]
    assert bench.parser().get_default("out") == "bench_results"
