import os
import zlib

import pytest
import torch

# The ops choose their path per call; tests that pin one set TORCH_FLASH_BACKEND themselves.
os.environ.pop("TORCH_FLASH_BACKEND", None)
# Without a GPU, Triton kernels run under the interpreter (TRITON_INTERPRET is read when a
# kernel is decorated, i.e. at import). CPU calls still take the reference path unless a
# test forces TORCH_FLASH_BACKEND=triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# one autotune config per kernel: tests check results, the benchmarks tune
os.environ.setdefault("TORCH_FLASH_AUTOTUNE", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    # fresh inputs per test, reproducible per test name (crc32: str hash() is salted per process)
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def launches(monkeypatch):
    """Names the Triton rotary kernels launched, one entry a launch (the one-launch tests of
    rotary_qk in tests/ops and tests/kernels)."""
    from torch_flash.kernels.triton import rotary as K
    calls = []
    names = {getattr(K, name): name for name in ("_rotary_kernel", "_rotary_qk_kernel")}

    def launch_as(launcher, kernel, *args):
        if kernel in names:
            calls.append(names[kernel])
        return real(launcher, kernel, *args)
    real = K.launch_as
    monkeypatch.setattr(K, "launch_as", launch_as)
    return calls
