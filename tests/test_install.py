"""A normal (non-editable) install puts meta_kernels/ and compile_passes/ inside torch_flash.

CI itself runs from an editable install; this checks the other kind in a throwaway venv that
borrows the already installed torch (no download, no build isolation)."""
import os
import shutil
import subprocess
import sys
import venv

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_normal_install(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    py = str(env_dir / "bin" / "python")
    # the installed torch also where this interpreter is itself a venv's, whose packages
    # system_site_packages does not reach (it means the base interpreter's)
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                             capture_output=True, text=True).stdout.strip()
    with open(os.path.join(purelib, "outer_site.pth"), "w") as f:
        f.write(os.path.dirname(os.path.dirname(torch.__file__)) + "\n")
    # build from a copy: an in-tree build leaves torch_flash.egg-info in the checkout, whose stale
    # metadata (entry points) would shadow the installed package's for anything run from there
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__",
                                                                  ".snap", ".wheels", ".gpu-peers", "bench_results"))
    # the layout is what is tested: no CUDA extension build on a machine that could do one. Without
    # build isolation where this environment can build wheels; a fresh venv's own setuptools (the
    # one ensurepip brings) cannot without the wheel package, so there pip isolates the build
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(src)]
    # PYTHONPATH (a checkout run from, say) would shadow the installed package in the venv
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TORCH_FLASH_BUILD_EXT": "0"}
    if subprocess.run(build + ["--no-build-isolation"], cwd=tmp_path, env=env, capture_output=True).returncode:
        subprocess.run(build, check=True, cwd=tmp_path, env=env)
    wheel = next((tmp_path / "dist").glob("torch_flash-*.whl"))
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, cwd=tmp_path, env=env)
    code = ("import torch, torch_flash, torch_flash.meta_kernels as m, torch_flash.compile_passes as c, "
            "torch_flash.testing.llama as t; print(torch_flash.__file__, m.__file__, c.__file__, t.__file__); "
            "assert hasattr(torch.ops.flash, 'rms_norm')")
    out = subprocess.run([py, "-c", code], check=True, cwd=tmp_path, env=env, capture_output=True, text=True).stdout
    site = str(env_dir)
    assert all(p.startswith(site) for p in out.split()), out
    assert sys.prefix != site
