"""Adds the optional CUDA extension torch_flash._C to the build pyproject.toml describes.

It is built when torch has CUDA and nvcc and nvidia-cutlass are present, which needs pip's
`--no-build-isolation` (an isolated build has no torch); otherwise the install is pure Python
and the build says why, once. TORCH_FLASH_BUILD_EXT=0 skips the extension, =1 makes a build
that is impossible here an error; FLASH_HDIMS and MAX_JOBS as in torch_flash/_build.py.
"""
import importlib.util
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_build_module():
    # by file path: importing the torch_flash package would import torch, which pip's build
    # isolation does not have
    path = os.path.join(HERE, "torch_flash", "_build.py")
    spec = importlib.util.spec_from_file_location("_torch_flash_build", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _pure_python(reason):
    class BuildPy(build_py):
        # build_py runs once per wheel or editable build, unlike setup.py itself
        def run(self):
            print(f"torch-flash: building without the CUDA extension ({reason})", flush=True)
            super().run()

    return {"cmdclass": {"build_py": BuildPy}}


def _extension_args():
    mode = os.environ.get("TORCH_FLASH_BUILD_EXT", "")
    if mode not in ("", "0", "1"):
        sys.exit(f"torch-flash: TORCH_FLASH_BUILD_EXT={mode}: expected 0 (skip) or 1 (require)")
    if mode == "0":
        return _pure_python("TORCH_FLASH_BUILD_EXT=0")
    build = _load_build_module()
    reason = build.why_not()
    if reason and mode == "1":
        sys.exit(f"torch-flash: TORCH_FLASH_BUILD_EXT=1, but the CUDA extension cannot be built: {reason}")
    if reason:
        return _pure_python(reason)
    try:
        spec = build.spec()
    except ValueError as e:
        sys.exit(f"torch-flash: {e}")
    from torch.utils.cpp_extension import BuildExtension

    return {"ext_modules": [build.extension(spec, relative_to=HERE)], "cmdclass": {"build_ext": BuildExtension}}


setup(**_extension_args())
