import pytest
import torch

import torch_flash


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # each test compiles anew, so counters and graphs belong to that test alone
    torch._dynamo.reset()
    torch_flash.counters.clear()
    yield
    torch._dynamo.reset()
