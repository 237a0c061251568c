"""torch_flash/kernels/triton/launch.py: an autotuned kernel goes through Triton's autotuner on
the first eager launch of each key and through its bare JITFunction with the chosen config
after that (same results); traced launches (wrap_triton's hook on) always take wrap_triton."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch._library.triton import set_wrap_triton_enabled  # noqa: E402

from torch_flash.kernels.triton import launch as L  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=1)], key=["n"])
@triton.jit
def _scale_kernel(X, Y, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n) * factor, mask=offs < n)


def _counting(monkeypatch):
    """Calls of the autotuner (kernel.run) and of the bare JITFunction (kernel.fn.run)."""
    calls = {"autotuner": 0, "jit": 0}
    for name, obj in (("autotuner", _scale_kernel), ("jit", _scale_kernel.fn)):
        def run(*args, run=obj.run, name=name, **kwargs):
            calls[name] += 1
            return run(*args, **kwargs)
        monkeypatch.setattr(obj, "run", run)
    return calls


def _launch(x, factor):
    y = torch.empty_like(x)
    n = x.numel()
    L.launch(_scale_kernel, lambda meta: (L.cdiv(n, meta["BLOCK"]),), x, y, n, factor)
    return y


def test_autotuner_once_per_key(monkeypatch):
    monkeypatch.setattr(L, "_CHOSEN", {})
    calls = _counting(monkeypatch)
    x = torch.randn(40, device=DEV)
    with set_wrap_triton_enabled(False):  # as inside an op's eager body
        torch.testing.assert_close(_launch(x, 2.0), x * 2)
        assert calls == {"autotuner": 1, "jit": 1}  # the autotuner launches through the JITFunction
        torch.testing.assert_close(_launch(x, 3.0), x * 3)
        assert calls == {"autotuner": 1, "jit": 2}
        x16 = x.half()  # a new key: another tensor dtype
        torch.testing.assert_close(_launch(x16, 2.0), x16 * 2)
        assert calls == {"autotuner": 2, "jit": 3}
        x8 = torch.randn(8, device=DEV)  # a new key: another n
        torch.testing.assert_close(_launch(x8, 2.0), x8 * 2)
        assert calls == {"autotuner": 3, "jit": 4}


def test_traced_path_keeps_wrap_triton(monkeypatch):
    """With wrap_triton's hook on (torch.compile tracing an op), every launch goes through
    torch.library.wrap_triton, never the cached JITFunction shortcut."""
    monkeypatch.setattr(L, "_CHOSEN", {})
    wrapped = []
    real = torch.library.wrap_triton
    monkeypatch.setattr(torch.library, "wrap_triton", lambda k: wrapped.append(k) or real(k))
    x = torch.randn(40, device=DEV)
    with set_wrap_triton_enabled(True):
        for factor in (2.0, 3.0):
            torch.testing.assert_close(_launch(x, factor), x * factor)
    assert wrapped == [_scale_kernel, _scale_kernel]
    assert L._CHOSEN == {}


def test_host_arithmetic_matches_triton():
    for n in range(1, 3000):
        assert L.next_power_of_2(n) == triton.next_power_of_2(n)
    for a in range(0, 200):
        for b in range(1, 20):
            assert L.cdiv(a, b) == triton.cdiv(a, b)
