"""examples/train_gpt.py on CPU: compiled steps through the flash backend, a resume that
continues with exactly the samples that were next, data-parallel runs under torchrun, and
context-parallel runs (--cp) over gloo against single-process training."""
import functools
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
from _utils import run_gloo_ranks

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


def _load_example():
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module
    spec.loader.exec_module(module)
    return module


def _cp_runs(runs: list[list[str]], rank: int) -> list[list[float]]:
    """In a gloo rank (run_gloo_ranks): train_gpt.main(argv) for each argv in turn, in the
    process group that the helper started; the losses of each run."""
    train_gpt = _load_example()
    return [train_gpt.main(argv) for argv in runs]


def _params(ckpt) -> dict:
    return torch.load(ckpt, weights_only=True)["model"]


def _assert_same_training(logs: list[list[dict]], losses: list[list[float]], ckpt, want_log, want_ckpt,
                          rtol: float = 1e-5):
    """Every rank logged the single-process run's samples and (up to float rounding: the ring
    adds up attention in another order) its losses; the final parameters agree likewise."""
    want = read_log(want_log)
    for log, rank_losses in zip(logs, losses):
        assert [r["step"] for r in log] == [r["step"] for r in want]
        assert [r["indices"] for r in log] == [r["indices"] for r in want]
        assert rank_losses == pytest.approx([r["loss"] for r in want], rel=rtol)
    got, ref = _params(ckpt), _params(want_ckpt)
    assert got.keys() == ref.keys()
    for name in ref:
        err = (got[name] - ref[name]).norm() / ref[name].norm()
        assert err < rtol, f"{name}: relative difference {err:.2e} from single-process training"


def test_context_parallel_matches_single_process(train_gpt, one_thread, tmp_path):
    """--cp 2 over 2 gloo ranks: each rank holds half of every sequence (zigzag); the losses and
    the final parameters are single-process training's, and an interrupted run resumes exactly."""
    common = TINY + ["--steps", "4", "--no-compile"]
    full, part = tmp_path / "full", tmp_path / "part"
    cp = common + ["--cp", "2"]
    runs = [cp + ["--log-indices", str(full), "--ckpt", str(full) + ".pt"],
            cp + ["--log-indices", str(part), "--ckpt", str(part) + ".pt", "--interrupt-at", "2"],
            cp + ["--log-indices", str(part), "--ckpt", str(part) + ".pt", "--resume"]]
    results = run_gloo_ranks(functools.partial(_cp_runs, runs), 2)
    single = tmp_path / "single.jsonl"
    train_gpt.main(common + ["--log-indices", str(single), "--ckpt", str(tmp_path / "single.pt")])

    logs = [read_log(f"{full}.rank{r}") for r in range(2)]
    _assert_same_training(logs, [res[0] for res in results], str(full) + ".pt", single, tmp_path / "single.pt")
    for r in range(2):
        assert [len(x) for x in results[r]] == [4, 2, 2]
        # the resumed run: the same samples and bit-identical losses as the uninterrupted one
        assert read_log(f"{part}.rank{r}") == logs[r]
        assert results[r][1] + results[r][2] == results[r][0]
    assert torch.load(str(part) + ".pt", weights_only=True)["step"] == 4
    for name, value in _params(str(part) + ".pt").items():
        assert torch.equal(value, _params(str(full) + ".pt")[name]), name


@pytest.mark.slow
def test_context_and_data_parallel_match_single_process(train_gpt, one_thread, tmp_path):
    """4 gloo ranks, cp 2 x dp 2, batch 4 per rank: the training of one process on batches of
    8 (dp rank d reads samples d, d + 2, ... of them; its loss is over those)."""
    common = TINY + ["--steps", "3", "--no-compile"]
    log, ckpt = tmp_path / "cpdp", str(tmp_path / "cpdp.pt")
    results = run_gloo_ranks(functools.partial(
        _cp_runs, [common + ["--cp", "2", "--log-indices", str(log), "--ckpt", ckpt]]), 4)
    single = tmp_path / "single.jsonl"
    train_gpt.main(common + ["--batch-size", "8", "--log-indices", str(single),
                             "--ckpt", str(tmp_path / "single.pt")])
    want = read_log(single)
    logs = [read_log(f"{log}.rank{r}") for r in range(4)]
    for r in range(4):  # rank = dp_rank * 2 + cp_rank
        dp_rank = r // 2
        assert [x["indices"] for x in logs[r]] == [w["indices"][dp_rank::2] for w in want]
        assert logs[r] == logs[r ^ 1]  # the two ranks of a context-parallel group
    for t, w in enumerate(want):  # the global batch's loss: the mean of the dp ranks'
        assert (logs[0][t]["loss"] + logs[2][t]["loss"]) / 2 == pytest.approx(w["loss"], rel=1e-5)
    got, ref = _params(ckpt), _params(tmp_path / "single.pt")
    for name in ref:
        err = (got[name] - ref[name]).norm() / ref[name].norm()
        assert err < 1e-5, f"{name}: relative difference {err:.2e} from single-process training"
    assert all(len(res[0]) == 3 for res in results)


@pytest.mark.slow
def test_context_parallel_compiled_torchrun(train_gpt, tmp_path):
    """torchrun --cp 2 with torch.compile(backend="flash"): the ring runs eagerly between the
    compiled parts (a graph break); the losses are the compiled single-process run's."""
    log, single = tmp_path / "cp", tmp_path / "single.jsonl"
    args = TINY + ["--steps", "3"]
    torchrun(2, args + ["--cp", "2", "--log-indices", str(log), "--ckpt", str(tmp_path / "cp.pt")])
    train_gpt.main(args + ["--log-indices", str(single), "--ckpt", str(tmp_path / "single.pt")])
    logs = [read_log(f"{log}.rank{r}") for r in range(2)]
    _assert_same_training(logs, [[x["loss"] for x in lg] for lg in logs], str(tmp_path / "cp.pt"), single,
                          tmp_path / "single.pt")


def test_context_parallel_arguments(train_gpt):
    with pytest.raises(SystemExit):
        train_gpt.parse_args(TINY + ["--cp", "3"])  # --block 16 does not split into 6 chunks
    with pytest.raises(SystemExit, match="launch 2"):
        train_gpt.main(TINY + ["--cp", "2", "--steps", "1", "--no-compile"])


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
