"""examples/generate.py: the tiny CPU run decodes, and its logits match one causal pass."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_generate_tiny_cpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))}
    env.pop("TORCH_FLASH_BACKEND", None)
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "generate.py"), "--device", "cpu",
                          "--check"], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "tokens/s" in run.stdout and "check: relative error" in run.stdout, run.stdout
