import contextlib
import os
import pathlib
import shutil
import subprocess
import sys
import zlib

import pytest

from _gpu_workers import worker_gpu

# before anything starts CUDA (torch.cuda.is_available() below does), which reads the variable once
if (_gpu := worker_gpu(os.environ)) is not None:
    os.environ["CUDA_VISIBLE_DEVICES"] = _gpu

import torch  # noqa: E402

# The ops choose their path per call (also in the processes tests start); tests that pin one
# use the force_backend fixture. torch_flash reads the variable at import.
os.environ.pop("TORCH_FLASH_BACKEND", None)
# Without a GPU, Triton kernels run under the interpreter (TRITON_INTERPRET is read when a
# kernel is decorated, i.e. at import). CPU calls still take the reference path unless a
# test forces the Triton backend.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# one autotune config per kernel: tests check results, the benchmarks tune
os.environ.setdefault("TORCH_FLASH_AUTOTUNE", "0")
# Under pytest-xdist (-n N) the workers share the machine's cores: each takes its share of
# threads, and so do the processes it starts, instead of every worker oversubscribing all cores.
# Inductor compiles its C++ in the worker itself, without a pool of compile processes: the
# workers already keep every core busy (test_backend.py::test_train_llama_block: 8% less CPU).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    _threads = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(_threads)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    import torch._inductor.config  # noqa: E402  (after TRITON_INTERPRET above)
    torch._inductor.config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    # fresh inputs per test, reproducible per test name (crc32: str hash() is salted per process);
    # under pytest-xdist's --dist loadgroup a test marked xdist_group has "@<group>" appended to
    # its node id: the seed stays the one of its plain name
    nodeid = request.node.nodeid
    if request.node.get_closest_marker("xdist_group") and "@" in nodeid:
        nodeid = nodeid.rpartition("@")[0]
    torch.manual_seed(zlib.crc32(nodeid.encode()))


@pytest.fixture
def force_backend():
    """force_backend(name): the flash ops run on backend `name` (torch_flash.use_backend; None:
    the per-call choice) for the rest of the test."""
    import torch_flash  # here: TRITON_INTERPRET above must come first
    with contextlib.ExitStack() as stack:
        yield lambda name: stack.enter_context(torch_flash.use_backend(name))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    """A wheel of this checkout without the CUDA extension, built once for the tests of a normal
    install (tests/test_install.py, tests/test_extension_build.py): once per run also under
    pytest-xdist, whose workers share the parent of their base temp directories."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return _build_wheel(tmp_path_factory.mktemp("wheel"))
    from filelock import FileLock  # a dependency of torch
    shared = tmp_path_factory.getbasetemp().parent
    with FileLock(str(shared / "wheel.lock")):
        built = shared / "wheel.path"
        if built.exists():
            return pathlib.Path(built.read_text())
        path = _build_wheel(shared / "wheel")
        built.write_text(str(path))
        return path


def _build_wheel(tmp: pathlib.Path) -> pathlib.Path:
    tmp.mkdir(exist_ok=True)
    # from a copy: an in-tree build leaves build/ and torch_flash.egg-info in the checkout, whose stale
    # metadata (entry points) would shadow the installed package's for anything run from there
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "*.so",
                                                              ".snap", ".wheels", ".gpu-peers", "bench_results"))
    # Without build isolation where this environment can build wheels; a fresh venv's own setuptools
    # (the one ensurepip brings) cannot without the wheel package, so there pip isolates the build.
    # PYTHONPATH (a checkout run from, say) would shadow the installed package where it is used.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TORCH_FLASH_BUILD_EXT": "0"}
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"), str(src)]
    if subprocess.run(build + ["--no-build-isolation"], cwd=tmp, env=env, capture_output=True).returncode:
        subprocess.run(build, check=True, cwd=tmp, env=env)
    return next((tmp / "dist").glob("torch_flash-*.whl"))


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
