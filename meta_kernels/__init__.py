"""Fake (meta) implementations of the `flash` ops: shapes, dtypes and strides only.

Installed as torch_flash.meta_kernels. Each module mirrors torch_flash/ops/<stem>.py and
runs the same input checks, so bad input fails at trace time (torch.compile, export).
"""
import importlib

from torch_flash._registry import OPS

for _stem in dict.fromkeys(e.stem for e in OPS):
    importlib.import_module(f"{__name__}.{_stem}")
