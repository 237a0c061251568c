"""torch_flash/kernels/triton/launch.py: the first eager launch of a key goes through Triton
(autotuner and JITFunction), later ones straight to the compiled kernel (same results); any
change Triton would specialise on makes a new key; traced launches (wrap_triton's hook on)
always take wrap_triton."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch._library.triton import set_wrap_triton_enabled  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

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


@pytest.mark.cuda
def test_triton_once_per_key(monkeypatch):
    monkeypatch.setattr(L, "_LAUNCHERS", {})
    calls = _counting(monkeypatch)
    x = torch.randn(40, device=DEV)
    with set_wrap_triton_enabled(False):  # as inside an op's eager body
        torch.testing.assert_close(_launch(x, 2.0), x * 2)
        assert calls == {"autotuner": 1, "jit": 1}  # the autotuner launches through the JITFunction
        torch.testing.assert_close(_launch(x.clone(), 2.0), x * 2)
        assert calls == {"autotuner": 1, "jit": 1}  # the compiled kernel, straight
        for other in (x.half(), torch.randn(8, device=DEV), x[1:]):  # dtype, n, alignment
            torch.testing.assert_close(_launch(other, 2.0), other * 2)
        assert calls == {"autotuner": 4, "jit": 4}
        torch.testing.assert_close(_launch(x, 3.0), x * 3)  # floats are keyed by value
        assert calls == {"autotuner": 5, "jit": 5}


def _specialising(a, b, n, m, flag, BLOCK: tl.constexpr):
    pass


def test_key_determines_triton_specialisation():
    """Launches with equal keys get one specialisation from Triton's own binder (for an sm_90
    target, computed without a GPU): the key may be finer, never coarser."""
    fn = JITFunction(_specialising)
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    base = torch.empty(64, dtype=torch.float32)
    tensors = [base, base[1:], base[4:], base.half(), base.half()[8:], base.to(torch.bfloat16)]
    ints = [0, 1, 2, 15, 16, 17, 32, 2**31 - 16, 2**31, 2**33 + 1]
    seen: dict[tuple, tuple] = {}
    for a in tensors:
        for b in (None, *tensors[:3]):
            for n in ints:
                for m in (1, 48):
                    for flag in (True, False):
                        args = (a, b, n, m, flag)
                        _, spec, _ = binder(*args, BLOCK=16)
                        key = L._key(fn, 0, args, {"BLOCK": 16})
                        assert seen.setdefault(key, tuple(spec)) == tuple(spec), args


def test_traced_path_keeps_wrap_triton(monkeypatch):
    """With wrap_triton's hook on (torch.compile tracing an op), every launch goes through
    torch.library.wrap_triton, never the cached JITFunction shortcut."""
    monkeypatch.setattr(L, "_LAUNCHERS", {})
    wrapped = []
    real = torch.library.wrap_triton
    monkeypatch.setattr(torch.library, "wrap_triton", lambda k: wrapped.append(k) or real(k))
    x = torch.randn(40, device=DEV)
    with set_wrap_triton_enabled(True):
        for factor in (2.0, 3.0):
            torch.testing.assert_close(_launch(x, factor), x * factor)
    assert wrapped == [_scale_kernel, _scale_kernel]
    assert L._LAUNCHERS == {}


def test_host_arithmetic_matches_triton():
    for n in range(1, 3000):
        assert L.next_power_of_2(n) == triton.next_power_of_2(n)
    for a in range(0, 200):
        for b in range(1, 20):
            assert L.cdiv(a, b) == triton.cdiv(a, b)
