"""FlashAttention's Python API over the flash ops, module for module: an existing user changes
only the import (`flash_attn` -> `torch_flash.compat`, `flash_attn.layers.rotary` ->
`torch_flash.compat.layers.rotary`, ...). The attention functions are also importable from here,
as from `flash_attn`.

    from torch_flash.compat import flash_attn_func   # was: from flash_attn import flash_attn_func
"""
from .flash_attn_interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                   flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                   flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
