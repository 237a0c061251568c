"""`python -m torch_flash.bench train` (torch_flash/bench/train.py): the training-step benchmark's
smoke run on CPU (a tiny LlamaForCausalLM, in process), its failure rows, and its FLOP count."""
from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from torch_flash.bench import train  # noqa: E402
from torch_flash.bench.__main__ import main  # noqa: E402

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the suite runs the full model")


@cpu_only
def test_quick_run_on_cpu(tmp_path):
    """Every quick configuration runs, with a finite throughput, the flash backend rewrites the
    model (no fallback to the unmodified graph), and the first step's loss agrees across
    configurations (same weights, same batch)."""
    main(["train", "--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "train.json").read_text())
    assert list(data)[:2] == ["suite", "env"] and list(data)[-1] == "rows"
    assert data["suite"] == "train" and data["model"] == train.CPU_MODEL.as_json()
    assert data["versions"]["transformers"] and data["reference"] == train.REFERENCE
    rows = data["rows"]
    assert [r["config"] for r in rows] == list(train.QUICK_CONFIGS)
    for r in rows:
        assert r["status"] == "ok" and r["error"] is None, r
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0, r
        assert r["step_ms"] > 0 and len(r["step_ms_all"]) == data["steps"]
        assert len(r["warmup_step_s"]) == data["warmup"] and r["warmup_s"] > 0
        assert len(r["losses"]) == data["warmup"] + data["steps"] and all(map(math.isfinite, r["losses"]))
        assert r["tokens"] == r["batch"] * r["seq"] and r["mfu"] is None  # CPU: no peak
        assert r["loss_agrees"] and r["loss_rel_diff"] <= 1e-4, r
        if r["compile"] == "flash":
            assert r["rewrites"].get("flash.attention") == train.CPU_MODEL.layers, r["rewrites"]
            assert not r["warnings"], r["warnings"]
    ref = rows[0]["losses"]
    for r in rows[1:]:  # the same training, step after step
        assert r["losses"] == pytest.approx(ref, rel=1e-4)


@cpu_only
def test_a_failing_configuration_is_recorded_and_the_suite_goes_on(tmp_path, monkeypatch):
    def broken(model):
        raise RuntimeError("CUDA out of memory. Tried to allocate 8.00 GiB\nmore text")

    monkeypatch.setitem(train.PATCHES, "broken", broken)
    monkeypatch.setitem(train.CONFIGS, "broken", train.Config("sdpa", None, "broken"))
    main(["train", "--configs", "broken,sdpa_uncompiled", "--steps", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "train.json").read_text())["rows"]
    failed, ok = rows
    assert failed["status"] == "failed" and failed["oom"] and failed["phase"] == "patch"
    assert failed["error"] == "RuntimeError: CUDA out of memory. Tried to allocate 8.00 GiB"
    assert failed["tokens_per_s"] is None and failed["loss_agrees"] is None
    assert ok["status"] == "ok" and ok["tokens_per_s"] > 0 and len(ok["step_ms_all"]) == 1
    assert ok["loss_rel_diff"] == 0.0  # its own reference


@cpu_only
def test_a_run_of_one_context_keeps_the_other_contexts_rows(tmp_path, monkeypatch):
    """--contexts: the rows of other contexts already in OUT/train.json (same device, model and
    step counts) stay, so the contexts can run as separate commands into one file."""
    monkeypatch.setattr(train, "CPU_CONTEXTS", {32: (2, 32), 64: (2, 64)})
    common = ["--configs", "sdpa_uncompiled", "--steps", "1", "--out", str(tmp_path)]
    main(["train", "--contexts", "64", *common])
    main(["train", "--contexts", "32", *common])
    rows = json.loads((tmp_path / "train.json").read_text())["rows"]
    assert [(r["context"], r["seq"]) for r in rows] == [(32, 32), (64, 64)]
    assert all(r["status"] == "ok" and r["started"] for r in rows)
    main(["train", "--contexts", "32", "--configs", "sdpa_uncompiled", "--steps", "2", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "train.json").read_text())["rows"]
    assert [r["context"] for r in rows] == [32]  # other step counts: not the same run


def test_options_are_checked():
    with pytest.raises(SystemExit, match="unknown configuration nope"):
        main(["train", "--configs", "sdpa_flash,nope", "--out", "unused"])
    with pytest.raises(SystemExit):
        main(["norm", "--configs", "sdpa_flash", "--out", "unused"])


def test_flops_follow_the_model_and_the_attention_bench():
    """6 x the nn.Linear weights x tokens (checked against a built model), plus causal attention
    counted as the attention bench counts its forward and backward."""
    from torch_flash.bench.attention import _tflops

    model = train.build_model(train.CPU_MODEL, "sdpa", 64, "cpu")
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert train.CPU_MODEL.matmul_params() == linear
    full = train.FULL
    assert full.matmul_params() == 8 * (2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 8192) + 2048 * 128256
    for batch, seq in train.CONTEXTS.values():
        attention = sum(_tflops(batch, full.heads, seq, full.head_dim, True, p, 1e3) for p in ("fwd", "bwd")) * 1e12
        expected = 6 * full.matmul_params() * batch * seq + full.layers * attention
        assert full.flops_per_step(batch, seq) == pytest.approx(expected)


def test_peak_tflops():
    assert train.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert train.peak_tflops("NVIDIA H200") == 989.0
    for other in ("NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "cpu"):
        assert train.peak_tflops(other) is None
