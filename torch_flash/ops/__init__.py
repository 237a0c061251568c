"""The `flash` ops: importing this package registers every op of torch_flash._registry.

One module per op stem (schema, dispatch, autograd, public function); the fakes live in
torch_flash.meta_kernels and are registered by torch_flash/__init__.py right after.
"""
import importlib

from .._registry import OPS

for _stem in dict.fromkeys(e.stem for e in OPS):
    importlib.import_module(f"{__name__}.{_stem}")
