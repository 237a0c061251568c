"""The benchmarks' timing protocol (torch_flash/bench/_common.py): interleaved rounds with a
rotating start, failures dropped for good, ratios as medians of the rounds' ratios; and each
suite's smoke run on CPU (python -m torch_flash.bench)."""
from __future__ import annotations

import importlib
import json
import os
import re
import sys

import pytest
import torch

from torch_flash import _dispatch
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
def _quack_stand_in(monkeypatch):
    """A module `quack` with the functions the suites call, in torch, checking the calling
    conventions of quack 0.6.5 (its kernels need a GPU and the CuTe DSL runtime)."""
    import torch.nn.functional as F

    def rmsnorm(x, weight=None, bias=None, residual=None, out_dtype=None, residual_dtype=None, eps=1e-6,
                prenorm=False, weight_offset=0.0):
        h = x if residual is None else x + residual
        y = F.rms_norm(h, h.shape[-1:], weight, eps)
        return (y, h) if prenorm else y

    def layernorm_fwd(x, weight, bias=None, eps=1e-6, return_rstd=False, return_mean=False):
        assert x.dim() == 2 and weight.dtype == torch.float32 and bias.dtype == torch.float32
        h = x.float()
        mean, rstd = h.mean(-1), torch.rsqrt(h.var(-1, unbiased=False) + eps)
        y = ((h - mean[:, None]) * rstd[:, None] * weight + bias).to(x.dtype)
        return (y, rstd, mean)[:1 + return_rstd + return_mean] if return_rstd or return_mean else y

    def layernorm_bwd(x, weight, dout, rstd, mean, has_bias=True):
        xhat = (x.float() - mean[:, None]) * rstd[:, None]
        g = dout.float() * weight
        dx = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
        return dx.to(x.dtype), (dout.float() * xhat).sum(0), dout.float().sum(0)

    def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=None, cu_seqlens=None,
                         max_seqlen=None):
        b, s, h, d = x.shape  # (batch, seqlen, heads, head_dim), tables (seqlen, head_dim / 2)
        assert cos.shape == sin.shape == (s, d // 2)
        x1, x2 = x.float().chunk(2, -1)
        c, n = cos[:, None], sin[:, None]
        return torch.cat((x1 * c - x2 * n, x2 * c + x1 * n), -1).to(x.dtype)

    def cross_entropy(x, target, lse_partial=None, weight=None, ignore_index=-100, reduction="mean",
                      inplace_backward=False):
        return F.cross_entropy(x.float(), target, ignore_index=ignore_index, reduction=reduction)

    def chunked_linear_cross_entropy(x, weight, target, chunk_size=4096, ignore_index=-100, reduction="mean",
                                     tuned=True, use_scaled_exp=None):
        return cross_entropy(F.linear(x, weight), target, ignore_index=ignore_index, reduction=reduction)

    modules = {"quack": dict(rmsnorm=rmsnorm, cross_entropy=cross_entropy),
               "quack.rmsnorm": dict(layernorm_fwd=layernorm_fwd, layernorm_bwd=layernorm_bwd),
               "quack.rotary": dict(apply_rotary_emb=apply_rotary_emb),
               "quack.linear_cross_entropy": dict(chunked_linear_cross_entropy=chunked_linear_cross_entropy)}
    for name, attrs in modules.items():
        module = type(sys)(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)


# the suites with quack columns, and the impls that must be timed in them
QUACK_SUITES = {"norm", "cross_entropy", "linear_cross_entropy", "rotary"}


@pytest.mark.parametrize("suite", ["norm", "cross_entropy", "linear_cross_entropy", "rotary", "decode"])
def test_suite_smoke_run_on_cpu(suite, tmp_path, monkeypatch):
    """`python -m torch_flash.bench SUITE` runs end to end where there is no GPU, on the Triton
    kernels (main() forces that backend there, not the reference path), and writes rows in
    which every variant of ours has a time; quack (a stand-in of its functions) is timed beside
    them wherever the suite has it."""
    if torch.cuda.is_available():
        pytest.skip("with a GPU the suites run their full shapes")
    _quack_stand_in(monkeypatch)
    mod = importlib.import_module(f"torch_flash.bench.{suite}")
    run, forced = mod.run, []
    monkeypatch.setattr(mod, "run", lambda args: forced.append(_dispatch.forced_backend()) or run(args))
    _dispatch.LAST.clear()
    main([suite, "--out", str(tmp_path)])
    assert forced == ["triton"] and _dispatch.forced_backend() is None  # forced while the suite runs
    assert set(_dispatch.LAST.values()) <= {"triton"}  # where a suite times the ops, not only launchers
    rows = json.loads((tmp_path / f"{suite}.json").read_text())["rows"]
    ours = [r for r in rows if r["impl"].startswith("ours")]
    assert ours and all(r["ms"] is not None and r["ms"] > 0 for r in ours), rows
    quack = [r for r in rows if r["impl"] == "quack" and r["ms"] is not None]
    if suite in QUACK_SUITES:  # every op of the suite but add_layer_norm (quack has none), every pass
        expected = {(r["op"], r["pass"]) for r in rows if r["op"] != "add_layer_norm"}
        assert {(r["op"], r["pass"]) for r in quack} == expected, rows
        assert all(r["ms"] > 0 for r in quack), quack


def test_norm_ops_pick(tmp_path, capsys):
    """--configs names the norm suite's ops (a GPU call fits about two); an unknown one, or the
    option on a suite without configurations, is refused with the known names."""
    from torch_flash.bench import norm
    assert [op[0] for op in norm._pick_ops("layer_norm, rms_norm")] == ["rms_norm", "layer_norm"]
    assert norm._pick_ops(None) == norm.OPS
    with pytest.raises(SystemExit, match="known: rms_norm, layer_norm, add_rms_norm, add_layer_norm"):
        norm._pick_ops("rmsnorm")
    with pytest.raises(SystemExit):
        main(["rotary", "--configs", "rms_norm", "--out", str(tmp_path)])
    assert "--configs is for the train, norm and attention suites" in capsys.readouterr().err


def test_attention_max_seconds(monkeypatch, capsys, tmp_path):
    """--max-seconds: the attention suite starts no grid point past the limit and returns the
    points it timed (each check here advances the clock 10 s: the first point, then two more
    before 25 s); --hdims keeps the grid's points of those head dims; the other suites refuse
    --hdims, train --max-seconds."""
    import argparse
    from torch_flash.bench import _common, attention
    timed = []
    monkeypatch.setattr(attention.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attention.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(attention, "_time_point",
                        lambda d, s, b, causal, impls, gqa: timed.append((d, s, causal, gqa)[:3 + (gqa > 1)]) or [{}])
    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr(_common.time, "monotonic", lambda: next(clock))
    rows = attention.run(argparse.Namespace(max_seconds=25, configs=None, quick=False, targets=False))
    assert timed == [(64, 1024, False), (64, 1024, True), (64, 4096, False)] and len(rows) == 3
    assert "--max-seconds 25 reached: 3 of 12 grid points timed" in capsys.readouterr().out
    timed.clear()
    attention.run(argparse.Namespace(max_seconds=None, hdims="128", configs=None, quick=False, targets=False))
    assert timed == [(128, s, causal) for s in attention.SEQLENS for causal in (False, True)]
    timed.clear()  # --gqa: K/V heads shared by that many query heads, a divisor of the grid's heads
    attention.run(argparse.Namespace(max_seconds=None, hdims="128", configs=None, quick=False, targets=False, gqa=4))
    assert timed == [(128, s, causal, 4) for s in attention.SEQLENS for causal in (False, True)]
    with pytest.raises(SystemExit, match="--gqa 3"):
        attention.run(argparse.Namespace(max_seconds=None, hdims="128", configs=None, quick=False, targets=False,
                                         gqa=3))
    with pytest.raises(SystemExit):
        main(["norm", "--hdims", "64", "--out", str(tmp_path)])
    assert "--hdims is for the attention suite" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["norm", "--gqa", "2", "--out", str(tmp_path)])
    assert "--gqa is a positive number of query heads a K/V head, for the attention suite" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--max-seconds", "5", "--out", str(tmp_path)])
    assert "--max-seconds is for the suites other than train" in capsys.readouterr().err


def test_max_seconds_cuts_every_suite_and_keeps_its_rows(monkeypatch, capsys, tmp_path):
    """--max-seconds on a suite other than attention (the norm smoke run on CPU, its clock
    advanced 10 s a check): the grid stops after the first point and the JSON holds its rows."""
    from torch_flash.bench import _common, norm
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr(_common.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(norm, "_pick_ops", lambda spec: norm.OPS[:2])
    main(["norm", "--max-seconds", "5", "--out", str(tmp_path)])
    assert "norm: --max-seconds 5 reached: 1 of 2 grid points timed" in capsys.readouterr().out
    with open(tmp_path / "norm.json") as f:
        rows = json.load(f)["rows"]
    assert rows and {r["op"] for r in rows} == {"rms_norm"}


def test_attention_impls_pick():
    """--configs names the attention suite's implementations (the curated table's five fit a GPU
    call with FlashAttention 4's compilation); an unknown one is refused with the known names."""
    from torch_flash.bench import attention
    from torch_flash.bench._common import pick
    assert set(attention.IMPLS) >= {"fa4", "cuda-sm90", "flash-op", "sdpa-cudnn", "triton-det"}
    assert pick("attention", "fa4, flash-op", attention.IMPLS, "implementation") == ["fa4", "flash-op"]
    with pytest.raises(SystemExit, match="known: triton, triton-det, cuda-sm90"):
        pick("attention", "fa3", attention.IMPLS, "implementation")


def test_suites_refuse_cpu_without_the_interpreter(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit):
        main(["norm", "--out", "unused"])
    assert "no CUDA GPU here" in capsys.readouterr().err


def test_linear_cross_entropy_targets_smoke_run_on_cpu(tmp_path):
    """--targets times the target point (8192 x 4096 x 128256 on a GPU) alone (tiny on CPU) and keeps each round's ratio to
    torch.compile for ours, with the sign test over the rounds."""
    if torch.cuda.is_available():
        pytest.skip("with a GPU the run times the full target shape")
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
    ./bench_results unless --out says otherwise (never over the committed docs/results)."""
    import torch_flash.__main__ as cli
    import torch_flash.bench.__main__ as bench
    seen = []
    monkeypatch.setattr(bench, "main", lambda argv=None: seen.append(argv))
    cli.main(["bench", "norm", "--quick"])
    assert seen == [["norm", "--quick"]]
    assert bench.parser().get_default("out") == "bench_results"


# --------------------------------------------------------------------------------------
# `bench plot` and the committed results (docs/results, described in docs/perf.md)
# --------------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")


def _results() -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), RESULTS)
                  for d, _, files in os.walk(RESULTS) for f in files if f.endswith(".json"))


def test_plot_writes_a_png_beside_the_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    data = {"suite": "rotary", "env": {"device": "cpu", "date": "2026-01-01T00:00:00+00:00"},
            "rows": [{"op": "rotary", "shape": [1, 2, 8, 16], "pass": p, "impl": i, "ms": 1.0, "gbps": 1.0,
                      "frac_of_copy": f} for p in ("forward", "backward") for i, f in (("ours", 0.9), ("copy", 1.0))]}
    path = tmp_path / "rotary.json"
    path.write_text(json.dumps(data))
    main(["plot", str(path)])
    assert (tmp_path / "rotary.png").stat().st_size > 0
    assert "wrote" in capsys.readouterr().out


def test_plot_says_why_not(tmp_path, monkeypatch, capsys):
    """A suite without a plot, no files, or no matplotlib: a message and a non-zero exit."""
    path = tmp_path / "hf.json"
    path.write_text(json.dumps({"suite": "hf_lce", "env": {}, "rows": []}))
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit) as e:
        main(["plot", str(path)])
    assert e.value.code == 1 and "no plot for suite 'hf_lce'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["plot"])
    assert e.value.code == 2 and "name one or more JSON files" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit) as e:
        main(["plot", str(path)])
    assert e.value.code == 2 and "pip install matplotlib" in capsys.readouterr().err


def test_help_names_the_subcommand_and_plot(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "python -m torch_flash bench" in text and "plot" in text and "./bench_results" in text


def test_committed_results_follow_the_schema_and_naming():
    """docs/results/<suite>[_<focus>]/<date>_<device>.json: the bench's schema, the date and
    device of its env, one run per folder and device (a focus: a suite's run on part of its grid,
    as attention_targets and attention_bwd)."""
    files = _results()
    assert files
    seen = set()
    for rel in files:
        folder, name = os.path.split(rel)
        with open(os.path.join(RESULTS, rel)) as f:
            data = json.load(f)
        assert list(data)[:2] == ["suite", "env"] and list(data)[-1] == "rows", rel
        assert isinstance(data["rows"], list) and data["rows"], rel
        env = data["env"]
        assert folder == data["suite"] or folder.startswith(data["suite"] + "_"), rel
        device = env["device"].split()[1].lower()  # "NVIDIA H100 80GB HBM3" -> h100
        assert name == f"{env['date'][:10]}_{device}.json", rel
        if not folder.startswith("sweep_"):  # tuning sweeps keep one run per date
            assert (folder, device) not in seen, f"two runs of {folder} on {device}"
            seen.add((folder, device))


def test_perf_doc_cites_every_result_and_nothing_else():
    with open(os.path.join(ROOT, "docs", "perf.md")) as f:
        doc = f.read()
    cited = set(re.findall(r"\]\(results/([^)]+\.json)\)", doc))
    assert cited == set(_results())
    for png in re.findall(r"\]\(results/([^)]+\.png)\)", doc):
        assert os.path.exists(os.path.join(RESULTS, png)), png


@pytest.mark.cuda
def test_graph_timing_captures_backwards_through_autograd():
    """graph=True times a backward through autograd (recorded once, replayed in a CUDA graph) as
    it times a launcher: the forward is recorded on the capture's stream, where autograd then
    runs the backward's kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from torch_flash.bench.norm import autograd_pair
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    fwd, bwd = autograd_pair(lambda x, r, w, b: torch.nn.functional.rms_norm(x, (1024,), w, 1e-6),
                             [x, None, w, None], g)
    eager_dx = bwd()[0].clone()
    for fn in (fwd, bwd):
        assert _common.median_ms(fn, graph=True) > 0
    assert torch.equal(bwd()[0], eager_dx)  # the eager call still works after the capture


def test_script_out_dir_is_made_before_the_run(tmp_path, monkeypatch):
    """A script's results folder (`python scripts/NAME.py OUT`) exists once its arguments are read,
    not only when its JSON is written after minutes of GPU time."""
    out = tmp_path / "new" / "nested"
    monkeypatch.setattr(sys, "argv", ["sweep.py", str(out)])
    assert _common.out_dir("doc") == str(out) and out.is_dir()
    _common.write_json(str(out / "r.json"), "suite", [{"a": 1}])
    assert json.loads((out / "r.json").read_text())["rows"] == [{"a": 1}]


def test_ncu_source_sums_stall_samples_by_opcode(tmp_path):
    """scripts/ncu_source.py on an Nsight Compute source page (SASS, CSV; gzipped too): each
    opcode's share of the sampling column, predicates dropped, the hottest instructions, and
    executions per 64 MUFU."""
    import gzip
    import subprocess
    page = ('"# Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"\n'
            '"0x10","HGMMA.64x64x16.F32.BF16 R184, gdesc[UR20], RZ, !UPT ;","30","8"\n'
            '"0x20","@!P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR23], R5 ;","50","8"\n'
            '"0x30","SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR20], RZ ;","10","8"\n'
            '"0x40","LDS.64 R6, [R20+0x34000] ;","10","16"\n'
            '"0x50","MUFU.EX2 R7, R7 ;","0","32"\n')
    (tmp_path / "a.csv").write_text("==PROF== a preamble line\n" + page)
    with gzip.open(tmp_path / "b.csv.gz", "wt") as f:
        f.write(page.replace('"50"', '"10"'))
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "ncu_source.py")
    out = subprocess.run([sys.executable, script, str(tmp_path / "a.csv"), str(tmp_path / "b.csv.gz"), "--top", "3"],
                         capture_output=True, text=True, check=True).stdout
    assert re.search(r"SYNCS\s+60\.00 %\s+33\.33 %", out), out
    assert re.search(r"HGMMA\s+30\.00 %\s+50\.00 %", out), out
    assert "50.00 %  @!P0 SYNCS.PHASECHK" in out and out.count("hottest instructions") == 2
    # executions per 64 MUFU: 8 HGMMA, 16 SYNCS, 16 LDS, 32 MUFU -> 16, 32, 32, 64 (144 in all)
    assert re.search(r"all\s+144\.0\s+144\.0", out) and re.search(r"SYNCS\s+32\.0\s+32\.0", out), out


def test_sass_loops_finds_the_mma_loop():
    """scripts/sass_loops.py: a backward branch whose range holds an HGMMA is a loop, listed
    innermost first; predicates and modifiers dropped from the opcodes."""
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "sass_loops.py")
    spec = importlib.util.spec_from_file_location("sass_loops", path)
    sl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sl)
    sass = """
        Function : _Z6kernelv
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0020*/                   MUFU.EX2 R2, R2 ;
        /*0030*/              @!P0 BRA 0x10 ;
        /*0040*/                   STL [R1], R2 ;
        /*0050*/                   BRA 0x0 ;
        /*0060*/                   EXIT ;
    """
    ins = sl.parse(sass)["_Z6kernelv"]
    assert [op for _, op, _ in ins] == ["MOV", "HGMMA", "MUFU", "BRA", "STL", "BRA", "EXIT"]
    loops = sl.mma_loops(ins)
    assert [len(body) for body in loops] == [3, 6]  # 0x10-0x30 inside 0x0-0x50
