import os

import pytest
import torch

# The ops choose their path per call; tests that pin one set TORCH_FLASH_BACKEND themselves.
os.environ.pop("TORCH_FLASH_BACKEND", None)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    # fresh inputs per test, reproducible per test name
    torch.manual_seed(hash(request.node.nodeid) % (2**31))
