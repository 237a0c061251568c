"""A `flash_attn` package made of torch_flash.compat, so that FlashAttention's own test files run
against compat unchanged (scripts/fa_suite.py runs them).

`install()` puts the modules in sys.modules: `flash_attn` (the attention functions),
`flash_attn.flash_attn_interface`, `.bert_padding`, `.layers.rotary`, `.ops.triton.layer_norm`,
`.losses.cross_entropy`, plus the private helpers FlashAttention's tests import from it. Loaded
as a pytest plugin (`pytest -p torch_flash.testing.fa_shim`), it installs itself at import,
refuses to run if the real flash_attn is already imported, and skips, with the reason, the tests
that check something compat does not promise (SKIPS). Without a GPU the test modules still
import (their module-level device queries get a stand-in answer) and every test is skipped.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

from .. import compat
from ..compat import bert_padding, flash_attn_interface, layers, losses, ops
from ..compat.layers import rotary
from ..compat.losses import cross_entropy
from ..compat.ops import triton as ops_triton
from ..compat.ops.triton import layer_norm

VERSION = "2.8.4"  # the FlashAttention release whose API compat follows

# test function -> why it is skipped (not a missing feature: an intended difference)
SKIPS = {
    "test_flash_attn_kvcache_paged_block_table_bounds":
        "compat does not synchronise with the GPU to validate cache_seqlens against block_table "
        "(flash.attention_decode gives NaN for such a sequence instead of reading out of bounds)",
    "test_flash_attn_varlen_paged_kv_num_splits":
        "calls FlashAttention's private _flash_attn_varlen_forward (seqused_k, num_splits)",
    "test_flash_attn_generator_arg_must_be_none": "calls FlashAttention's compiled extension directly",
    "test_compilation_count": "counts compilations of FlashAttention's own Triton kernel "
                              "(flash_attn.ops.triton.rotary.rotary_kernel)",
}


def _get_block_size_n(device, head_dim, is_dropout, is_causal) -> int:
    """The key block of compat's S_dmask encoding: one block covers every row (each row of
    S_dmask is scaled by its own maximum, torch_flash/compat/_attn_probs.py)."""
    return 1 << 30


def _interface() -> types.ModuleType:
    """flash_attn.flash_attn_interface: compat's functions and the private names tests import."""
    mod = types.ModuleType("flash_attn.flash_attn_interface", flash_attn_interface.__doc__)
    for name in compat.__all__:
        setattr(mod, name, getattr(flash_attn_interface, name))
    mod._get_block_size_n = _get_block_size_n
    mod.USE_TRITON_ROCM = False
    return mod


def install() -> None:
    """Register the shim's modules as `flash_attn...` (idempotent)."""
    if "flash_attn" in sys.modules:
        if getattr(sys.modules["flash_attn"], "__torch_flash_shim__", False):
            return
        raise RuntimeError("torch_flash.testing.fa_shim: the real flash_attn is already imported; run the "
                           "suite in a process that has not imported it")
    root = types.ModuleType("flash_attn", "torch_flash.compat presented as flash_attn (torch_flash.testing.fa_shim)")
    root.__path__ = []  # a package, so that its submodules import
    root.__version__ = VERSION
    root.__torch_flash_shim__ = True
    for name in compat.__all__:
        setattr(root, name, getattr(compat, name))
    modules = {
        "flash_attn": root,
        "flash_attn.flash_attn_interface": _interface(),
        "flash_attn.bert_padding": bert_padding,
        "flash_attn.layers": layers,
        "flash_attn.layers.rotary": rotary,
        "flash_attn.ops": ops,
        "flash_attn.ops.triton": ops_triton,
        "flash_attn.ops.triton.layer_norm": layer_norm,
        "flash_attn.losses": losses,
        "flash_attn.losses.cross_entropy": cross_entropy,
    }
    for name, module in modules.items():
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)


def _cpu_stand_ins() -> None:
    """FlashAttention's test modules ask for the GPU's compute capability at import; without a
    GPU, answer Hopper's so that they import (their tests are then skipped)."""
    torch.cuda.get_device_capability = lambda device=None: (9, 0)


install()
if not torch.cuda.is_available():
    _cpu_stand_ins()


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (FlashAttention's tests run on device='cuda')")
    for item in items:
        name = getattr(item, "originalname", None) or item.name.split("[")[0]
        if name in SKIPS:
            item.add_marker(pytest.mark.skip(reason=f"fa_shim: {SKIPS[name]}"))
        elif not torch.cuda.is_available():
            item.add_marker(no_gpu)
