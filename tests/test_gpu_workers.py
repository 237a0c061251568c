"""tests/_gpu_workers.py: the GPU each pytest-xdist worker takes."""
from _gpu_workers import worker_gpu


def test_worker_gpu_spreads_xdist_workers_over_gpus():
    assert [worker_gpu({"TORCH_FLASH_TEST_GPUS": "4", "PYTEST_XDIST_WORKER": f"gw{k}"}) for k in range(6)] == \
        ["0", "1", "2", "3", "0", "1"]
    # within the GPUs already visible, and never past them
    env = {"TORCH_FLASH_TEST_GPUS": "4", "CUDA_VISIBLE_DEVICES": "5,7", "PYTEST_XDIST_WORKER": "gw3"}
    assert worker_gpu(env) == "7"
    assert worker_gpu({**env, "PYTEST_XDIST_WORKER": "gw2"}) == "5"
    # off: no variable, one GPU, or not an xdist worker
    assert worker_gpu({"PYTEST_XDIST_WORKER": "gw1"}) is None
    assert worker_gpu({"TORCH_FLASH_TEST_GPUS": "1", "PYTEST_XDIST_WORKER": "gw1"}) is None
    assert worker_gpu({"TORCH_FLASH_TEST_GPUS": "4"}) is None
