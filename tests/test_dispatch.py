"""torch_flash._dispatch: the rules of select(), use_backend (per thread, through backward, in
compiled graphs), TORCH_FLASH_BACKEND read once at import, and an import without side effects."""
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

import torch_flash
from torch_flash import _dispatch, use_backend

CPU_TRITON = _dispatch.triton_can_run(torch.device("cpu"))
needs_interpreter = pytest.mark.skipif(not CPU_TRITON, reason="needs TRITON_INTERPRET=1 (tests/conftest.py)")


def _on(device: str):
    """What select() reads of a tensor: its device (a CUDA one is named, not allocated)."""
    return SimpleNamespace(device=torch.device(device))


def _never():
    raise AssertionError("a kernel's support asked where it cannot run or is not needed")


def test_select_rules():
    if not _dispatch.triton_installed() or _dispatch.extension_loaded():
        pytest.skip("the CUDA rows assume Triton installed and no extension")
    assert _dispatch.select("op", _on("cuda"), triton=lambda: True, cuda=_never) == "triton"
    assert _dispatch.select("op", _on("cuda"), triton=lambda: False) == "reference"
    assert _dispatch.select("op", _on("cpu"), triton=_never) == "reference"  # the interpreter only when forced
    assert _dispatch.LAST["op"] == "reference"
    with use_backend("reference"):
        assert _dispatch.select("op", _on("cuda"), triton=_never, cuda=_never) == "reference"
    with use_backend("cuda"), pytest.raises(RuntimeError, match="flash.op: backend 'cuda' forced .* not built"):
        _dispatch.select("op", _on("cuda"), cuda=_never)
    with use_backend("triton"), pytest.raises(RuntimeError, match="no Triton kernel serves this call"):
        _dispatch.select("op", _on("cuda"), triton=lambda: False)
    with pytest.raises(ValueError, match="use_backend\\('gpu'\\)"):
        use_backend("gpu").__enter__()


@needs_interpreter
def test_use_backend_nests_and_restores():
    x, w = torch.randn(4, 32), torch.randn(32)
    expected = torch_flash.rms_norm(x, w)
    assert _dispatch.LAST["rms_norm"] == "reference"
    with use_backend("triton"):
        torch.testing.assert_close(torch_flash.rms_norm(x, w), expected)
        assert _dispatch.LAST["rms_norm"] == "triton"
        with use_backend(None):
            assert _dispatch.forced_backend() is None
            torch_flash.rms_norm(x, w)
            assert _dispatch.LAST["rms_norm"] == "reference"
        assert _dispatch.forced_backend() == "triton"
    assert _dispatch.forced_backend() is None


def test_use_backend_is_per_thread():
    entered, checked = threading.Event(), threading.Event()
    seen = {}

    def other():
        entered.wait(10)
        seen["other"] = _dispatch.forced_backend()
        checked.set()

    thread = threading.Thread(target=other)
    thread.start()
    with use_backend("reference"):
        entered.set()
        checked.wait(10)
        seen["own"] = _dispatch.forced_backend()
    thread.join()
    assert seen == {"other": None, "own": "reference"}


@needs_interpreter
def test_backward_inside_the_block_runs_on_its_backend():
    x, w = torch.randn(4, 32, requires_grad=True), torch.randn(32)
    y = torch_flash.rms_norm(x, w)
    assert _dispatch.LAST["rms_norm"] == "reference"
    with use_backend("triton"):
        y.sum().backward()
    assert _dispatch.LAST["rms_norm_backward"] == "triton"


@pytest.mark.cuda
def test_backward_inside_the_block_reaches_autograd_device_threads():
    x = torch.randn(4, 64, device="cuda", requires_grad=True)
    y = torch_flash.rms_norm(x, torch.randn(64, device="cuda"))
    with use_backend("reference"):
        y.sum().backward()  # runs on autograd's CUDA device thread
    assert _dispatch.LAST["rms_norm_backward"] == "reference"


def test_use_backend_inside_a_compiled_function():
    """The block is traced into the graph (no graph break: fullgraph) and reaches the op: the
    outer block forces a backend that cannot serve CPU tensors, so only the inner one's lets
    the first function compile, and the second, forcing it inside, fails at its trace."""
    x, w = torch.randn(4, 32), torch.randn(32)

    def inner_reference(x, w):
        with use_backend("reference"):
            return torch_flash.rms_norm(x, w) * 2

    def inner_cuda(x, w):
        with use_backend("cuda"):
            return torch_flash.rms_norm(x, w)

    torch._dynamo.reset()
    with use_backend("cuda"):
        out = torch.compile(inner_reference, backend="aot_eager", fullgraph=True)(x, w)
    torch.testing.assert_close(out, torch_flash.rms_norm(x, w) * 2)
    assert _dispatch.LAST["rms_norm"] == "reference"
    with pytest.raises(Exception, match="backend 'cuda' forced"):
        torch.compile(inner_cuda, backend="aot_eager", fullgraph=True)(x, w)
    torch._dynamo.reset()


def _python(code: str, **env) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "TORCH_FLASH_BACKEND"}
    run = subprocess.run([sys.executable, "-c", code], env={**environ, **env}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@needs_interpreter
def test_environment_variable_read_once_at_import():
    code = """
import os, torch, torch_flash
from torch_flash import _dispatch
x = torch.randn(4, 32)
torch_flash.rms_norm(x, None)
print(_dispatch.LAST["rms_norm"])
os.environ["TORCH_FLASH_BACKEND"] = "reference"  # not read again
torch_flash.rms_norm(x[:2], None)  # a new signature, a new choice
print(_dispatch.LAST["rms_norm"])
with torch_flash.use_backend(None):
    torch_flash.rms_norm(x[:3], None)
print(_dispatch.LAST["rms_norm"])
"""
    assert _python(code, TORCH_FLASH_BACKEND="triton").split() == ["triton", "triton", "reference"]
    bad = ("import torch, torch_flash\ntry:\n    torch_flash.rms_norm(torch.randn(2, 8), None)\n"
           "except RuntimeError as e:\n    print(e)")
    assert "backend 'gpu' forced (TORCH_FLASH_BACKEND): expected one of" in _python(bad, TORCH_FLASH_BACKEND="gpu")


def test_import_registers_and_changes_nothing_else():
    """No Inductor patch at import (it comes with the first compiled trace of an op), and
    meta_kernels/ and compile_passes/ mapped by the install, not by extending __path__."""
    code = """
import os, torch
from torch.torch_version import TorchVersion
from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
before = CppWrapperCpu.codegen_int_array_var
import torch_flash, torch_flash.meta_kernels as m, torch_flash.compile_passes as c
assert torch_flash.__path__ == [os.path.dirname(torch_flash.__file__)], torch_flash.__path__
assert os.path.basename(os.path.dirname(m.__file__)) == "meta_kernels"
assert os.path.basename(os.path.dirname(c.__file__)) == "compile_passes"
assert CppWrapperCpu.codegen_int_array_var is before
torch.compile(torch_flash.rms_norm, backend="aot_eager")(torch.randn(2, 8))
patched = CppWrapperCpu.codegen_int_array_var is not before
print(patched == (TorchVersion(torch.__version__) < (2, 15)))
"""
    assert _python(code).split()[-1] == "True"


def _calls_in_fp32():
    """(name, fn(*leaves), leaves): calls whose bodies would run bf16 ATen ops under autocast."""
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    x, w = torch.randn(24, 32), torch.randn(50, 32)
    t = torch.randint(0, 50, (24,))
    return [
        ("attention", lambda q, k, v: torch_flash.attention(q, k, v, causal=True), (q, k, v)),
        ("linear_cross_entropy", lambda x, w: torch_flash.linear_cross_entropy(x, w, t), (x, w)),
        ("linear_cross_entropy direct", lambda x, w: torch.ops.flash.linear_cross_entropy(x, w, t), (x, w)),
        ("rms_norm", lambda x, w: torch_flash.rms_norm(x, w[0]), (x, w)),
    ]


@pytest.mark.parametrize("index", range(len(_calls_in_fp32())))
def test_autocast_leaves_the_ops_dtypes_alone(index):
    """Under autocast an op computes in the dtypes it was given, as its kernels do: fp32 inputs
    give the results and gradients of the same call without autocast, bit for bit (its
    reference path would otherwise run autocast's bf16 matmuls)."""
    name, fn, inputs = _calls_in_fp32()[index]
    results = []
    for enabled in (False, True):
        leaves = [t.clone().requires_grad_() for t in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            out = fn(*leaves)
        out.sum().backward()
        results.append((out, *(t.grad for t in leaves)))
    for plain, autocast in zip(*results):
        assert autocast.dtype == plain.dtype and torch.equal(autocast, plain), name
