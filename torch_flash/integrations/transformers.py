"""Hugging Face transformers: `attn_implementation="torch_flash"` runs attention on the flash ops.

    import torch_flash.integrations.transformers as tf_flash
    tf_flash.register()   # explicit and idempotent; importing this module registers nothing
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="torch_flash")
    model.set_attn_implementation("torch_flash")   # or switch a built model

How it plugs in, and why this way. transformers treats every implementation whose name
contains "flash" as a FlashAttention kernel (`utils.generic.is_flash_attention_requested`):
when a model is built or switched it preloads the kernel's functions by name
(`modeling_flash_attention_utils.lazy_import_flash_attention`), and for any name other than
the flash_attn packages' it looks for a kernel on the Hub, which fails for "torch_flash".
So rather than fight that, we join it, the way a Hub kernel joins
(`integrations.hub_kernels.load_and_register_attn_kernel`):

1. the public interfaces: `AttentionInterface.register(NAME, ...)` with transformers' own
   FlashAttention forward (behind a check of the mask it is given) and `AttentionMaskInterface.register(NAME, ...)` with its
   FlashAttention mask function (a 2D padding mask, or None when nothing is padded);
2. one private hook: `modeling_flash_attention_utils._lazy_imports` (the function that maps
   a flash implementation name to its functions; same signature in transformers 5.17 and
   5.23) is wrapped to answer NAME with `torch_flash.compat`'s FlashAttention-2 functions
   (`flash_attn_func`, `flash_attn_varlen_func`) and transformers' own pad/unpad helpers.
   Every other name goes to the original. `register()` checks the hook took effect and
   raises a clear error on a transformers release where it does not.

transformers' own code then does the rest, as for FlashAttention 2: it reads which features
our functions take from their signatures (dropout_p, window_size, softcap, deterministic,
max_seqlen_q/k), unpads padded batches and calls the varlen op (left or right padding, KV
cache decoding with a padding mask), passes causal/scale/softcap/sliding window/dropout from
the model's config, and uses the dense op when nothing is padded.

Not covered: paged attention / continuous batching (the kvcache slot stays empty: not wired to
`compat.flash_attn_with_kvcache` nor tested through transformers), attention
sinks (`s_aux`), models that list their own `_compatible_flash_implementations` (transformers
swaps any flash name for theirs), and models that build 4D masks themselves instead of using
the mask interface (a clear error, never silently wrong results).
"""
from __future__ import annotations

import functools

import transformers
from transformers import AttentionInterface
from transformers import modeling_flash_attention_utils as fa_utils
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from .. import compat

NAME = "torch_flash"


def _attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' FlashAttention forward, guarded: a mask that is not the (B, S) padding
    mask means the model built its own attention mask (it does not go through the mask
    interface) and the flash path would ignore it."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"torch_flash (transformers): {type(module).__name__} passed a {attention_mask.dim()}D "
            f"attention mask of shape {tuple(attention_mask.shape)}; attn_implementation="
            f"'{NAME}' needs the (batch, seq) padding mask of transformers' mask interface, "
            "which this model does not use: load it with attn_implementation='sdpa' or 'eager'")
    return flash_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _wrap_lazy_imports(original):
    @functools.wraps(original)
    def lazy_imports(implementation, *args, **kwargs):
        if implementation == NAME:
            # FlashAttention 2's (fn, varlen fn, kv-cache fn, pad, unpad)
            return (compat.flash_attn_func, compat.flash_attn_varlen_func, None,
                    fa_utils._pad_input, fa_utils._unpad_input)
        return original(implementation, *args, **kwargs)

    lazy_imports._torch_flash_original = original
    return lazy_imports


def register() -> str:
    """Make `attn_implementation="torch_flash"` available in transformers; returns the name.
    Idempotent; needs transformers >= 5 (checked with 5.17 and 5.23)."""
    hook = getattr(fa_utils, "_lazy_imports", None)
    if hook is None or not all(hasattr(fa_utils, n) for n in ("_pad_input", "_unpad_input",
                                                              "lazy_import_flash_attention")):
        raise RuntimeError(
            "torch_flash.integrations.transformers: this transformers release has no "
            "modeling_flash_attention_utils._lazy_imports/_pad_input/_unpad_input, which "
            f"register() hooks into (checked with 5.17 and 5.23); transformers {transformers.__version__} is installed")
    if not hasattr(hook, "_torch_flash_original"):
        fa_utils._lazy_imports = _wrap_lazy_imports(hook)
    AttentionInterface.register(NAME, _attention_forward)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    (fns, _) = fa_utils.lazy_import_flash_attention(NAME)
    if fns[0] is not compat.flash_attn_func:
        raise RuntimeError("torch_flash.integrations.transformers: transformers did not load "
                           f"torch_flash's functions for '{NAME}' (transformers {transformers.__version__})")
    return NAME

