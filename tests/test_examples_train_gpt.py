"""examples/train_gpt.py on CPU: compiled steps through the flash backend, a resume that
continues with exactly the samples that were next, and data-parallel runs under torchrun."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_flash

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
TINY = ["--device", "cpu", "--layers", "1", "--d-model", "32", "--heads", "2", "--block", "16",
        "--batch-size", "4", "--corpus-chars", "5000", "--log-every", "1"]


@pytest.fixture(scope="module")
def train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module  # dataclasses (and workers' pickles) look the module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules["train_gpt"]


@pytest.fixture
def one_thread():
    # tiny shapes: a second OpenMP thread only adds synchronisation (measured 10x slower on a busy 2-core machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def read_log(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def torchrun(nproc: int, args: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(EXAMPLE), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_resume_continues_with_the_next_samples(train_gpt, one_thread, tmp_path):
    torch_flash.counters.clear()
    full, part, ckpt = tmp_path / "full.jsonl", tmp_path / "part.jsonl", str(tmp_path / "ckpt.pt")
    losses = train_gpt.main(TINY + ["--steps", "6", "--log-indices", str(full)])
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert torch_flash.counters["flash.attention"] >= 1 and torch_flash.counters["flash.add_layer_norm"] >= 1

    assert len(train_gpt.main(TINY + ["--steps", "6", "--interrupt-at", "3", "--ckpt", ckpt,
                                      "--log-indices", str(part), "--workers", "1"])) == 3
    assert torch.load(ckpt, weights_only=True)["step"] == 3
    resumed = train_gpt.main(TINY + ["--steps", "6", "--resume", "--ckpt", ckpt, "--log-indices", str(part)])
    assert len(resumed) == 3

    want = read_log(full)
    assert [r["step"] for r in want] == list(range(1, 7))
    # one rank reads the resampled sequence in order: global samples 0..23
    assert [i for r in want for i in r["indices"]] == list(range(24))
    # the same samples after the resume, and (same weights, optimizer state, data and
    # learning rate, deterministic CPU kernels) bit-identical losses
    assert read_log(part) == want


def test_data_parallel_gloo(tmp_path):
    log, ckpt = tmp_path / "ddp", str(tmp_path / "ddp.pt")
    torchrun(2, TINY + ["--steps", "3", "--grad-compress", "fp16", "--log-indices", str(log), "--ckpt", ckpt])
    for rank in range(2):
        rows = read_log(f"{log}.rank{rank}")
        assert [r["step"] for r in rows] == [1, 2, 3]
        # rank r reads r, r + 2, r + 4, ...: step t covers global samples [8 (t - 1), 8 t)
        assert [r["indices"] for r in rows] == [[8 * t + 2 * j + rank for j in range(4)] for t in range(3)]
    state = torch.load(ckpt, weights_only=True)
    assert state["step"] == 3 and not any(k.startswith("module.") for k in state["model"])


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_on_one_process(train_gpt, one_thread, tmp_path):
    """FSDP2 writes a full checkpoint; a single process continues from it."""
    ckpt = str(tmp_path / "fsdp.pt")
    torchrun(2, TINY + ["--steps", "4", "--interrupt-at", "2", "--parallel", "fsdp", "--ckpt", ckpt])
    assert torch.load(ckpt, weights_only=True)["step"] == 2
    losses = train_gpt.main(TINY + ["--steps", "4", "--resume", "--ckpt", ckpt, "--no-compile"])
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


@pytest.mark.cuda
def test_gpu_preset_trains(tmp_path):
    """The GPU size, shortened: bf16, compiled, rewritten, and the loss falls."""
    out = subprocess.run([sys.executable, str(EXAMPLE), "--preset", "gpu", "--steps", "60", "--log-every", "20",
                          "--log-indices", str(tmp_path / "gpu.jsonl")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-5000:]
    assert "flash.attention" in out.stdout
    losses = [r["loss"] for r in read_log(tmp_path / "gpu.jsonl")]
    assert len(losses) == 60 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 1.0
