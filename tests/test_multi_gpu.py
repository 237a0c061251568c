"""Multi-GPU runs: tests/_multi_gpu_worker.py in N processes started by
torch.distributed.run, one GPU each, over NCCL (N = 2, and 4 where 4 GPUs exist): ring attention
(context_parallel_attention), vocab-parallel flash.cross_entropy, the vocab-parallel lm head and
flash.linear_cross_entropy over token shards, every check against float64 on the whole problem;
and timing lines (ring attention forward + backward on N GPUs against one, strong and weak
scaling, printed, not checked):

    pytest tests/test_multi_gpu.py -s -rA              # -k 2gpus / -k 4gpus: one world size

Each world size is one launch (module-scoped fixture) whose per-rank JSON the tests read back.
The worker also runs on CPU processes over gloo at tiny shapes (test_worker_on_cpu_gloo, slow).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from _multi_gpu_worker import ATTENTION_CASES, CE_CASES, LCE_CASES, SECTIONS, SUBGROUP_CASE

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_multi_gpu_worker.py")
N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
# one launch a world size per run: under pytest-xdist (--dist loadgroup) these tests share a worker
pytestmark = pytest.mark.xdist_group("multi_gpu")
needs_2_gpus = pytest.mark.skipif(N_GPUS < 2, reason=f"needs 2 CUDA GPUs, {N_GPUS} here")


def launch(n: int, out_dir, device: str = "cuda", timeout: int = 480) -> list[dict]:
    """The worker's per-rank results of one run of n processes, in rank order. Past `timeout`
    seconds the launcher is stopped (SIGTERM: it stops its workers) and the test fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", WORKER,
           "--out", str(out_dir), "--device", device]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = out_dir / "launch.log"  # a file, not a pipe: no wait on a worker that outlives the launcher
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            proc.wait(timeout=timeout)
            timed_out = ""
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(timeout=60)
            timed_out = f"\n(stopped after {timeout} s)"
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{log.read_text()[-10000:]}{timed_out}"
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(n)]
    assert [(r["rank"], r["world"], r["sections"]) for r in results] == [(r, n, list(SECTIONS)) for r in range(n)]
    return results


def expected(section: str, world: int) -> set:
    """The check names the worker must report for a section at a world size."""
    cases = {"attention": ATTENTION_CASES, "cross_entropy": CE_CASES, "lm_head": LCE_CASES,
             "linear_cross_entropy": LCE_CASES}[section]
    names = {f"{section}/{name}/w{world}" for name in cases}
    if section == "lm_head":  # and the same head fused: flash.linear_cross_entropy(process_group=...)
        names |= {f"{section}/{name}-fused/w{world}" for name in cases}
    if section == "attention" and world >= 4:
        names.add(f"attention/{SUBGROUP_CASE}/subgroup-w{world // 2}")
    return names


def assert_checks(results: list[dict], section: str) -> None:
    """Every rank reported every case of the section, and every check passed."""
    world = len(results)
    failed = []
    for r in results:
        mine = [c for c in r["checks"] if c["name"].startswith(section + "/")]
        missing = expected(section, world) - {c["name"] for c in mine}
        assert not missing, f"rank {r['rank']} did not report {sorted(missing)}"
        failed += [f"rank {r['rank']}: {c['name']} {c['what']}: {c['err']:.3e} > {c['tol']:.3e}"
                   for c in mine if not c["ok"]]
    assert not failed, f"{len(failed)} failed checks:\n" + "\n".join(failed[:60])


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}gpus")
def gpu_results(request, tmp_path_factory):
    n = request.param
    if N_GPUS < n:
        pytest.skip(f"needs {n} CUDA GPUs, {N_GPUS} here")
    return launch(n, tmp_path_factory.mktemp(f"multi_gpu_{n}"))


@pytest.mark.cuda
@needs_2_gpus
@pytest.mark.parametrize("section", ["attention", "cross_entropy", "lm_head", "linear_cross_entropy"])
def test_against_float64(gpu_results, section):
    assert_checks(gpu_results, section)


def timing_lines(results: list[dict]) -> list[str]:
    """One line a timing row: ring attention on N devices against one, and the worker's JSON row."""
    lines = []
    for row in results[0]["timing"]:
        vs = (f"{row['speedup']:.2f}x faster" if row["scaling"] == "strong"
              else f"efficiency {row['efficiency']:.2f} of {row['world']} x one device's TFLOP/s")
        lines.append(f"{results[0]['device']}: ring attention fwd+bwd, causal, {row['scaling']} scaling, "
                     f"{row['seq_total']} tokens on {row['world']} devices ({row['layout']}) "
                     f"{row['ring_ms']:.2f} ms/step against {row['seq_single']} on one "
                     f"{row['single_device_ms']:.2f} ms: {vs}"
                     + (f"; communication exposed {row['exposed_comm_ms']:.2f} ms a step"
                        if row["exposed_comm_ms"] is not None else "") + f"\n  {json.dumps(row)}")
    return lines


TIMING_ROWS = [(scaling, layout) for scaling in ("strong", "weak") for layout in ("zigzag", "contiguous")]


@pytest.mark.cuda
@needs_2_gpus
def test_timing(gpu_results):
    """Printed for the record (run with -s); nothing asserted but that every row was timed."""
    assert [(row["scaling"], row["layout"]) for row in gpu_results[0]["timing"]] == TIMING_ROWS
    print("\n" + "\n".join(timing_lines(gpu_results)))


@pytest.mark.slow
def test_worker_on_cpu_gloo(tmp_path):
    """The worker itself, in 2 CPU processes over gloo at tiny shapes: every section passes."""
    results = launch(2, tmp_path, device="cpu")
    for section in ("attention", "cross_entropy", "lm_head", "linear_cross_entropy"):
        assert_checks(results, section)
    assert [(row["scaling"], row["layout"]) for row in results[0]["timing"]] == TIMING_ROWS
