"""`python -m torch_flash demo`: the LLaMA-style model through the flash backend passes its
numerics checks and every candidate site in it is rewritten."""
import json
import os
import subprocess
import sys

import pytest
import torch

from torch_flash._demo import SIZES



def _demo(tmp_path, *args: str, timeout: int) -> dict:
    path = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "torch_flash", "demo", "--json", str(path), *args],
                          capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "demo passed" in proc.stdout
    return json.loads(path.read_text())


def _check(result: dict, layers: int) -> None:
    assert result["ok"] and result["numerics_ok"]
    sites = result["sites"]
    assert sites["rewritten"] == sites["total"] == 5 * layers + 2, sites
    # per layer: attention, rotary of q and of k, two norms; the first norm reads the
    # embedding, every later one (the final norm too) a residual sum; the lm head + loss
    assert sites["ops"] == {"flash.attention": layers, "flash.rotary": 2 * layers, "flash.rms_norm": 1,
                            "flash.add_rms_norm": 2 * layers, "flash.linear_cross_entropy": 1}
    for key in ("device", "versions", "date", "step_ms", "peak_bytes", "speedup"):
        assert key in result
    assert all(ms > 0 for ms in result["step_ms"].values())


def test_demo_cpu(tmp_path):
    result = _demo(tmp_path, "--device", "cpu", "--steps", "1", "--ops", timeout=800)
    assert result["device"] == "cpu"
    assert result["ops"] and all(r["fwd_err"] <= 1e-4 for r in result["ops"].values())
    _check(result, SIZES["cpu"].layers)


@pytest.mark.cuda
def test_demo_cuda_small(tmp_path):
    """The CUDA path (bf16, Triton kernels) at a size that compiles quickly; the full-size
    run is `python -m torch_flash demo`."""
    result = _demo(tmp_path, "--device", "cuda", "--layers", "2", "--seq", "512", "--batch", "2",
                   "--steps", "3", timeout=600)
    assert result["peak_bytes"]["flash"] > 0 and result["memory_ratio"] is not None
    assert result.get("device_name") == torch.cuda.get_device_name()
    _check(result, 2)
