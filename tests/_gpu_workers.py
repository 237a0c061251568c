"""Which GPU a pytest-xdist worker takes (tests/conftest.py, before CUDA starts): no torch here."""
from __future__ import annotations


def worker_gpu(env) -> str | None:
    """The CUDA_VISIBLE_DEVICES of this pytest-xdist worker where TORCH_FLASH_TEST_GPUS=N (N > 1)
    spreads the workers over N GPUs (worker gwK takes the K % N-th visible one), else None. Tests
    needing several GPUs then skip: run them on their own."""
    n, worker = int(env.get("TORCH_FLASH_TEST_GPUS", "0")), env.get("PYTEST_XDIST_WORKER", "")
    if n < 2 or not worker.startswith("gw"):
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(n)]
    return devices[int(worker[2:]) % min(n, len(devices))]
