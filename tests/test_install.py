"""A normal (non-editable) install puts meta_kernels/ and compile_passes/ inside torch_flash.

CI itself runs from an editable install; this checks the other kind in a throwaway venv that
borrows the already installed torch (no download, no build isolation)."""
import os
import subprocess
import sys
import venv

import pytest
import torch


@pytest.mark.slow
def test_normal_install(tmp_path, wheel):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    py = str(env_dir / "bin" / "python")
    # the installed torch also where this interpreter is itself a venv's, whose packages
    # system_site_packages does not reach (it means the base interpreter's)
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                             capture_output=True, text=True).stdout.strip()
    with open(os.path.join(purelib, "outer_site.pth"), "w") as f:
        f.write(os.path.dirname(os.path.dirname(torch.__file__)) + "\n")
    # the layout is what is tested (the wheel fixture: no CUDA extension build on a machine that
    # could do one). PYTHONPATH (a checkout run from, say) would shadow the installed package
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, cwd=tmp_path, env=env)
    code = ("import torch, torch_flash, torch_flash.meta_kernels as m, torch_flash.compile_passes as c, "
            "torch_flash.testing.llama as t; print(torch_flash.__file__, m.__file__, c.__file__, t.__file__); "
            "assert hasattr(torch.ops.flash, 'rms_norm')")
    out = subprocess.run([py, "-c", code], check=True, cwd=tmp_path, env=env, capture_output=True, text=True).stdout
    site = str(env_dir)
    assert all(p.startswith(site) for p in out.split()), out
    assert sys.prefix != site
