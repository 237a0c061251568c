"""The optional CUDA extension torch_flash._C: its build spec, the build and info commands, and
loading (or not) at import. CPU-only and fast, except the marked ones; nvidia-cutlass optional."""
import json
import os
import subprocess
import sys

import pytest
import torch

import torch_flash
from torch_flash import _build, _dispatch, _extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUTLASS = _build.find_cutlass()


def _run(*args, env=None, cwd=ROOT):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=300)


@pytest.fixture
def csrc(tmp_path):
    """A fake csrc/ tree: shared sources, three head-dim instantiations, headers."""
    for name in ("module.cpp", "build_info.cu", "attention/attention.cpp", "attention/fwd_hdim64.cu",
                 "attention/fwd_hdim128.cu", "attention/fwd_hdim256.cu", "attention/fwd_hdim1280.cu",
                 "attention/fwd.cuh", "attention/fwd.h", "attention/util.hpp", "README.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    return tmp_path


def _names(spec):
    return sorted(os.path.relpath(s, spec.csrc) for s in spec.sources)


def test_spec_selects_head_dims(csrc, monkeypatch):
    monkeypatch.delenv("FLASH_HDIMS", raising=False)
    shared = ["attention/attention.cpp", "build_info.cu", "module.cpp"]
    default = _build.spec(csrc=str(csrc))
    assert default.hdims == (64, 128, 256)  # 1280 has a source but is not a default
    assert _names(default) == sorted(shared + [f"attention/fwd_hdim{d}.cu" for d in (64, 128, 256)])

    one = _build.spec("128", csrc=str(csrc))
    assert one.hdims == (128,)
    assert _names(one) == sorted(shared + ["attention/fwd_hdim128.cu"])  # not fwd_hdim1280
    for flags in (one.cxx_flags, one.nvcc_flags):
        assert "-DFLASH_HDIM_128" in flags and "-DFLASH_HDIM_64" not in flags

    monkeypatch.setenv("FLASH_HDIMS", "256, 64")
    assert _build.spec(csrc=str(csrc)).hdims == (64, 256)
    assert _build.spec("1280", csrc=str(csrc)).hdims == (1280,)  # an argument overrides the env


@pytest.mark.parametrize("value, match", [
    ("96", r"FLASH_HDIMS=96: no kernel source for head dim 96; valid: 64, 128, 256, 1280"),
    ("64,x", r"FLASH_HDIMS=64,x: expected a comma list of head dims"),
])
def test_spec_rejects_bad_head_dims(csrc, monkeypatch, value, match):
    monkeypatch.setenv("FLASH_HDIMS", value)
    with pytest.raises(ValueError, match=match):
        _build.spec(csrc=str(csrc))


def test_spec_flags(csrc):
    spec = _build.spec("64", csrc=str(csrc))
    nvcc = spec.nvcc_flags
    assert "-gencode=arch=compute_90a,code=sm_90a" in nvcc
    assert [f for f in nvcc if f.startswith("-std=")] == ["-std=c++17"]
    for macro in ("HALF_OPERATORS", "HALF_CONVERSIONS", "HALF2_OPERATORS", "BFLOAT16_OPERATORS",
                  "BFLOAT16_CONVERSIONS", "BFLOAT162_OPERATORS", "BFLOAT162_CONVERSIONS"):
        assert f"-U__CUDA_NO_{macro}__" in nvcc
    assert {"--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math", "-O3"} <= set(nvcc)
    assert nvcc[nvcc.index("--threads") + 1] == "2"
    assert spec.cxx_flags[:2] == ("-O3", "-std=c++20")
    version = CUTLASS[1] if CUTLASS else "none"
    for flags in (spec.cxx_flags, spec.nvcc_flags):  # argv words: torch quotes them for ninja
        assert f'-DFLASH_CUTLASS_VERSION="{version}"' in flags
    assert spec.include_dirs[0] == str(csrc)


@pytest.mark.skipif(CUTLASS is None, reason="nvidia-cutlass not installed")
def test_spec_includes_cutlass(csrc):
    spec = _build.spec(csrc=str(csrc))
    root = CUTLASS[0]
    assert spec.include_dirs[1:3] == tuple(os.path.join(root, d) for d in
                                           ("source/include", "source/tools/util/include"))
    assert all(os.path.isdir(d) for d in spec.include_dirs)
    assert os.path.isfile(os.path.join(spec.include_dirs[1], "cute", "tensor.hpp"))
    # the example's copy, with the backward's float-to-element assignments spelled as conversions
    example = os.path.join(spec.include_dirs[3], _build.EXAMPLE)
    for rel, old, new in _build.EXAMPLE_PATCHES:
        with open(os.path.join(example, rel)) as f:
            text = f.read()
        assert new in text and old not in text
    assert spec.cutlass_version == CUTLASS[1]


def test_build_dir_depends_on_the_spec(csrc):
    assert _build.build_dir(_build.spec("64", csrc=str(csrc))) != _build.build_dir(_build.spec("128", csrc=str(csrc)))
    assert _build.build_dir(_build.spec("64", csrc=str(csrc))) == _build.build_dir(_build.spec("64", csrc=str(csrc)))


def test_finds_the_checkout_sources():
    csrc = _build.find_csrc()
    if csrc is None:
        pytest.skip("no csrc/ sources in this checkout")
    assert os.path.isdir(csrc) and _build.spec(csrc=csrc).sources


cannot_build = pytest.mark.skipif(_build.why_not() is None, reason="the extension can be built here")


@cannot_build
def test_why_not_on_this_machine():
    reason = _build.why_not()
    if torch.version.cuda is None:
        assert reason == f"torch {torch.__version__} has no CUDA"


@cannot_build
def test_build_command_exits_1_with_the_reason():
    out = _run("-m", "torch_flash", "build", "--hdims", "128")
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"cannot build the CUDA extension here: {_build.why_not()}" in out.stderr


def test_info_reports_the_extension():
    out = _run("-m", "torch_flash", "info")
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("CUDA extension torch_flash._C"))
    if _extension.loaded():
        assert "loaded (" in row and "ops with CUDA kernels" in out.stdout
    elif _extension.error():
        assert "failed to load" in row
    else:
        assert "not built" in row
        assert (_build.why_not() or "run python -m torch_flash build") in row


def test_import_without_the_extension_is_silent():
    code = ("import importlib.util, warnings\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    import torch_flash, torch_flash._extension as e\n"
            "print(e.loaded(), e.error(), torch_flash._dispatch.extension_loaded(), "
            "importlib.util.find_spec('torch_flash._C') is not None, "
            "len([w for w in caught if 'torch_flash._C' in str(w.message)]))")
    # TORCH_FLASH_EXTENSION=0 skips loading whatever is there (how one rebuilds a library that aborts the import)
    for env, expect in ((None, ["False", "None", "False", "False", "0"]),
                        ({"TORCH_FLASH_EXTENSION": "0"}, ["False", "None", "False"])):
        out = _run("-c", code, env=env)
        assert out.returncode == 0, out.stderr
        if env is None and out.stdout.split()[3] == "True":
            continue  # built here: test_built_extension_serves_hopper
        assert out.stdout.split()[:len(expect)] == expect, out.stdout


def test_a_broken_extension_is_reported_not_raised(monkeypatch):
    def fail(name):
        raise ImportError(f"{name}: undefined symbol: _ZN3c1010Something")

    monkeypatch.setattr(_extension, "_tried", False)
    monkeypatch.setattr(_extension, "_module", None)
    monkeypatch.setattr(_extension, "_error", None)
    monkeypatch.setattr(_extension.importlib, "import_module", fail)
    with pytest.warns(RuntimeWarning, match="undefined symbol"):
        assert _extension.load() is None
    assert not _extension.loaded() and not _dispatch.extension_loaded()
    assert "undefined symbol" in _extension.error()
    assert _extension.build_info.__wrapped__() is None
    assert _extension.load() is None  # once


def test_not_built_is_silent(monkeypatch):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(_extension, "_tried", False)
    monkeypatch.setattr(_extension, "_module", None)
    monkeypatch.setattr(_extension, "_error", None)
    monkeypatch.setattr(_extension.importlib, "import_module", missing)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _extension.load() is None
    assert _extension.error() is None and not _extension.loaded()


def test_check_commands(csrc):
    if _build._cuda_home() is None:
        pytest.skip("no nvcc")
    spec = _build.spec("64", csrc=str(csrc))
    commands = dict(_build.check_commands(spec, str(csrc / "out")))
    assert sorted(commands) == sorted(spec.sources)
    nvcc = commands[str(csrc / "attention" / "fwd_hdim64.cu")]
    assert nvcc[0].endswith("nvcc") and "-gencode=arch=compute_90a,code=sm_90a" in nvcc and "-c" in nvcc
    cxx = commands[str(csrc / "module.cpp")]
    assert "-fsyntax-only" in cxx and f"-I{csrc}" in cxx


def test_prebuilt_objects_are_linked_while_their_key_matches(csrc, tmp_path, capsys, monkeypatch):
    """Kernel objects exported ahead (--export-objects) replace their sources in the extension
    while the key matches; editing a csrc header makes stale the objects whose sources include
    it, directly or not, and only those; the shared sources always compile here."""
    if _build._cuda_home() is None:
        pytest.skip("no nvcc")
    (csrc / "attention" / "fwd_hdim64.cu").write_text('#include "fwd.cuh"\n')  # beside it
    (csrc / "attention" / "fwd_hdim128.cu").write_text('#include "attention/fwd.h"\n')  # from csrc/
    (csrc / "attention" / "fwd.cuh").write_text('#include "util.hpp"\n#include "cute/tensor.hpp"\n')
    spec = _build.spec("64,128", csrc=str(csrc))
    kernels = _build.kernel_sources(spec)
    assert sorted(os.path.relpath(p, csrc) for p in kernels) == ["attention/fwd_hdim128.cu", "attention/fwd_hdim64.cu"]
    objects = tmp_path / "objects"
    objects.mkdir()
    manifest = {}
    for src in kernels:
        obj = os.path.basename(src) + ".o"
        (objects / obj).write_bytes(b"")
        manifest[obj] = {"source": os.path.relpath(src, csrc), "key": _build.kernel_key(spec, src)}
    (objects / _build.OBJECTS_MANIFEST).write_text(json.dumps(manifest))
    assert sorted(_build.prebuilt_objects(spec, str(objects))) == sorted(kernels)

    (csrc / "attention" / "util.hpp").write_text("// edited")
    found = _build.prebuilt_objects(spec, str(objects))
    assert list(found) == [str(csrc / "attention" / "fwd_hdim128.cu")]
    assert "compiling attention/fwd_hdim64.cu (stale" in capsys.readouterr().out
    from torch.utils import cpp_extension
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", _build._cuda_home())  # a CPU torch finds none
    ext = _build.extension(spec, prebuilt=found)
    assert str(csrc / "attention" / "fwd_hdim128.cu") not in ext.sources and str(csrc / "module.cpp") in ext.sources
    assert ext.extra_objects == [str(objects / "fwd_hdim128.cu.o")]

    (csrc / "attention" / "fwd.h").write_text("// edited")
    assert _build.prebuilt_objects(spec, str(objects)) == {}
    assert _build.prebuilt_objects(spec, str(tmp_path / "missing")) == {}


def test_build_always_links(csrc, tmp_path, monkeypatch):
    """build() has distutils relink every time (ninja still recompiles only what changed):
    distutils' own up-to-date check sees neither the headers nor the prebuilt objects."""
    import setuptools
    from torch.utils import cpp_extension
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", _build._cuda_home() or "/usr/local/cuda")
    monkeypatch.setattr(_build, "_cache_root", lambda: str(tmp_path / "cache"))
    seen = {}

    def run_command(self, name):  # instead of compiling: note the flag, leave an empty library
        cmd = self.get_command_obj(name)
        seen["force"] = cmd.force
        path = cmd.get_ext_fullpath(_build.NAME)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").close()

    monkeypatch.setattr(setuptools.Distribution, "run_command", run_command)
    target = _build.build(_build.spec("64", csrc=str(csrc)), dest=str(tmp_path))
    assert seen["force"] and os.path.exists(target)


def test_export_objects_compiles_only_what_changed(csrc, tmp_path, capsys):
    """--export-objects writes each kernel's object and the manifest that prebuilt_objects reads;
    run again, it keeps the objects whose key is unchanged and compiles the rest."""
    if _build._cuda_home() is None:
        pytest.skip("no nvcc")
    (csrc / "attention" / "fwd_hdim64.cu").write_text("__global__ void k64() {}\n")
    (csrc / "attention" / "fwd_hdim128.cu").write_text("__global__ void k128() {}\n")
    spec = _build.spec("64,128", csrc=str(csrc))
    out = tmp_path / "objects"
    _build.export_objects(spec, str(out))
    assert capsys.readouterr().out.count("compiling") == 2
    assert sorted(_build.prebuilt_objects(spec, str(out))) == sorted(_build.kernel_sources(spec))
    (csrc / "attention" / "fwd_hdim64.cu").write_text("__global__ void k64(int) {}\n")
    _build.export_objects(spec, str(out))
    printed = capsys.readouterr().out
    assert "compiling attention/fwd_hdim64.cu" in printed and "attention/fwd_hdim128.cu: up to date" in printed
    assert sorted(_build.prebuilt_objects(spec, str(out))) == sorted(_build.kernel_sources(spec))


@pytest.mark.slow
def test_installed_package_ships_the_sources(tmp_path, wheel):
    """A normal install carries csrc/ inside torch_flash, so `python -m torch_flash build` works there."""
    if _build.find_csrc() is None:
        pytest.skip("no csrc/ sources in this checkout")
    target = tmp_path / "site"
    out = _run("-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    shipped = sorted(os.path.relpath(p, target / "torch_flash" / "csrc")
                     for p in _build._sources_under(str(target / "torch_flash" / "csrc")))
    assert shipped == sorted(os.path.relpath(p, _build.find_csrc()) for p in _build._sources_under(_build.find_csrc()))
    env = {"PYTHONPATH": str(target)}
    out = _run("-c", "import torch_flash._build as b; print(b.find_csrc())", env=env, cwd=tmp_path)
    assert out.stdout.strip() == str(target / "torch_flash" / "csrc"), out.stderr
    if _build.why_not() is not None:
        out = _run("-m", "torch_flash", "build", env=env, cwd=tmp_path)
        assert out.returncode == 1 and "cannot build the CUDA extension here" in out.stderr


@pytest.mark.cuda
def test_built_extension_serves_hopper():
    """On the GPU machine after `pip install --no-build-isolation -e .` or `python -m torch_flash build`."""
    if _extension.error():
        pytest.fail(f"torch_flash._C failed to load: {_extension.error()}")
    if not _extension.loaded():
        pytest.skip(f"torch_flash._C not built ({_build.why_not() or 'run python -m torch_flash build'})")
    info = _extension.build_info()
    assert "sm_90a" in info["archs"]
    assert info["hdims"] and all(f"_hdim{d}" in "".join(_build._sources_under(_build.find_csrc()))
                                 for d in info["hdims"])
    assert info["ops"], info
    for op in info["ops"]:
        assert op.startswith("flash::")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"), op
    assert _dispatch.extension_loaded()
    assert torch_flash._extension.path().startswith(os.path.dirname(torch_flash.__file__))


def test_sweep_params_match_the_header():
    """scripts/sweep_attention_sm90.py passes AttentionFwdSm90Params through ctypes: its
    fields must be the header's, in order (a drift would hand the kernel shifted values)."""
    import importlib.util
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "csrc", "attention", "attention_fwd_sm90.h")) as f:
        header = f.read()
    body = header[header.index("struct AttentionFwdSm90Params {"):]
    body = re.sub(r"//[^\n]*", "", body[:body.index("};")])
    declared = []
    for decl in body.split(";")[:-1]:
        decl = re.sub(r"\(\*(\w+)\)\(.*\)", r"\1", decl.split("{", 1)[-1])  # function pointer
        declared += [re.search(r"(\w+)\s*$", piece).group(1) for piece in decl.split(",")]
    spec = importlib.util.spec_from_file_location("sweep", os.path.join(root, "scripts", "sweep_attention_sm90.py"))
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    assert [name for name, _ in sweep.Params._fields_] == declared


def test_fast_path_is_not_part_of_the_cuda_extension():
    csrc = _build.find_csrc()
    if csrc is None:
        pytest.skip("no csrc/ sources in this checkout")
    fast = _build.fast_sources(csrc)
    assert fast and all(os.sep + _build.FAST_SUBDIR + os.sep in p for p in fast)
    assert not set(fast) & set(_build.spec(csrc=csrc).sources)


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch compiles the fast path")
def test_fast_path_without_cuda_is_silent():
    code = ("import torch, torch_flash; from torch_flash import _extension; "
            "x = torch_flash.rms_norm(torch.randn(4, 32), torch.randn(32)); "
            "print(_extension.load_fast(), _extension.fast_error())")
    out = _run("-c", code)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.strip() == f"None torch {torch.__version__} has no CUDA"
    info = _run("-m", "torch_flash", "info")
    assert f"eager fast path (csrc/fast)    unavailable (torch {torch.__version__} has no CUDA)" in info.stdout


def test_fast_path_off_by_environment(monkeypatch):
    monkeypatch.setattr(_extension, "_fast_tried", False)
    monkeypatch.setattr(_extension, "_fast", None)
    monkeypatch.setattr(_extension, "_fast_error", None)
    monkeypatch.setenv("TORCH_FLASH_FAST", "0")
    assert _extension.load_fast() is None and _extension.fast_error() == "disabled (TORCH_FLASH_FAST=0)"
