"""Hugging Face transformers: `attn_implementation="torch_flash"` runs attention on the flash ops,
and `use_linear_cross_entropy(model)` computes a causal LM's training loss with
flash.linear_cross_entropy, never materialising the logits (at the end of this docstring).

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
   FlashAttention forward (behind a check of the mask it is given) and
   `AttentionMaskInterface.register(NAME, ...)` with its FlashAttention mask function (a 2D
   padding mask, or None when nothing is padded);
2. a private hook: `modeling_flash_attention_utils._lazy_imports` (the function that maps
   a flash implementation name to its functions; same signature in transformers 5.17 and
   5.23) is wrapped to answer NAME with `torch_flash.compat`'s FlashAttention-2 functions
   (`flash_attn_func`, `flash_attn_varlen_func`, which also take FlashAttention 3's `s_aux`:
   attention sinks) and transformers' own pad/unpad helpers. Every other name goes to the
   original. `register()` checks the hook took effect and raises a clear error on a
   transformers release where it does not;
3. models with attention sinks (gpt-oss, granite_swa, mimo_v2_flash, ...) list the flash
   kernels that take them in `_compatible_flash_implementations`, and transformers swaps any
   other flash name for one of those. `PreTrainedModel._check_and_adjust_attn_implementation`
   is wrapped so that such a model admits NAME too (an instance attribute, the class
   untouched).

transformers' own code then does the rest, as for FlashAttention 2: it reads which features
our functions take from their signatures (dropout_p, window_size, softcap, deterministic,
max_seqlen_q/k), unpads padded batches and calls the varlen op (left or right padding, KV
cache decoding with a padding mask), passes causal/scale/softcap/sliding window/dropout from
the model's config, and uses the dense op when nothing is padded.

Not covered: paged attention / continuous batching (the kvcache slot stays empty: not wired to
`compat.flash_attn_with_kvcache` nor tested through transformers), and models that build 4D
masks themselves instead of using the mask interface (a clear error, never silently wrong
results).

`use_linear_cross_entropy(model)`: Liger-Kernel's fused linear cross-entropy for HF models,
without a copy of each model's forward. In training (`model.training`) with `labels`, the
lm-head is called on zero tokens (a (..., 0, V) logits placeholder) and remembers the hidden
states; the model's own `loss_function` is replaced by one that reads them and calls
flash.linear_cross_entropy with transformers' causal-LM loss semantics (labels shifted by one,
`ignore_index`, `num_items_in_batch`, `shift_labels`), under autocast in the autocast dtype as
the lm-head would run. The model's forward runs unchanged otherwise (MoE auxiliary losses,
caches, hidden states); the output's `logits` is None, as Liger's. Evaluation and generation
get logits as before. The logits must reach the loss untouched (checked by identity: a model
that scales them, as Cohere or Granite do, is refused at the first step), except for the final
logit softcap of the classes in `SOFTCAP_MODELS`. Not tested: an lm-head sharded by FSDP or
tensor parallelism.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
import transformers
from transformers import AttentionInterface, PreTrainedModel
from transformers import modeling_flash_attention_utils as fa_utils
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from .. import compat
from ..ops.linear_cross_entropy import linear_cross_entropy

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


def _wrap_attn_check(original):
    @functools.wraps(original)
    def check(self, attn_implementation, *args, **kwargs):
        listed = getattr(self, "_compatible_flash_implementations", None)
        if attn_implementation == NAME and listed is not None and NAME not in listed:
            self._compatible_flash_implementations = [*listed, NAME]
        return original(self, attn_implementation, *args, **kwargs)

    check._torch_flash_original = original
    return check


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
    attn_check = getattr(PreTrainedModel, "_check_and_adjust_attn_implementation", None)
    if attn_check is None:
        raise RuntimeError("torch_flash.integrations.transformers: this transformers release has no "
                           "PreTrainedModel._check_and_adjust_attn_implementation, which register() hooks into; "
                           f"transformers {transformers.__version__} is installed")
    if not hasattr(attn_check, "_torch_flash_original"):
        PreTrainedModel._check_and_adjust_attn_implementation = _wrap_attn_check(attn_check)
    AttentionInterface.register(NAME, _attention_forward)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    (fns, _) = fa_utils.lazy_import_flash_attention(NAME)
    if fns[0] is not compat.flash_attn_func:
        raise RuntimeError("torch_flash.integrations.transformers: transformers did not load "
                           f"torch_flash's functions for '{NAME}' (transformers {transformers.__version__})")
    return NAME


# classes whose forward applies config.final_logit_softcapping (tanh(x / c) * c) between the
# lm-head and the loss, and nothing else (tests/test_transformers_integration.py)
SOFTCAP_MODELS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


class _FusedHead:
    """One patched model's state. `active` only within a training forward with labels; the
    lm-head then records its input (`hidden`) and output (the placeholder `logits`)."""

    def __init__(self, model, head: torch.nn.Linear):
        self.name = type(model).__name__
        self.model, self.head, self.hf_loss = model, head, model.loss_function
        self.original_forward, self.signature = model.forward, inspect.signature(model.forward)
        self.active, self.hidden, self.logits = False, None, None

    def head_forward(self, x):
        if not self.active:
            return torch.nn.Linear.forward(self.head, x)
        if self.hidden is not None:
            raise RuntimeError(f"torch_flash (transformers): {self.name} called its lm-head twice in one "
                               "forward; use_linear_cross_entropy supports one lm-head call per loss")
        self.hidden = x
        self.logits = torch.nn.Linear.forward(self.head, x.narrow(-2, 0, 0))
        return self.logits

    def loss(self, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
             shift_labels=None, **kwargs):
        """transformers' ForCausalLMLoss on flash.linear_cross_entropy, same arguments."""
        if not self.active:
            return self.hf_loss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        hidden, weight, bias = self.hidden, self.head.weight, self.head.bias
        self.hidden = None  # consumed: a second loss call without a head call is refused
        softcap = 0.0
        if hidden is None or logits is not self.logits:
            softcap = getattr(self.model.config, "final_logit_softcapping", None) or 0.0
            if hidden is None or self.name not in SOFTCAP_MODELS or not softcap:
                raise RuntimeError(
                    f"torch_flash (transformers): {self.name} changes the logits between its lm-head and "
                    "its loss_function (or calls them apart); use_linear_cross_entropy supports logits "
                    f"that reach the loss untouched, or softcapped by the classes {SOFTCAP_MODELS}")
        if weight.shape[0] != vocab_size:
            raise ValueError(f"torch_flash (transformers): {self.name}'s lm-head has {weight.shape[0]} "
                             f"outputs but the loss was given vocab_size={vocab_size}")
        if shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        hidden = hidden.reshape(-1, hidden.shape[-1])
        target = shift_labels.reshape(-1).to(hidden.device)
        if target.numel() != hidden.shape[0]:
            raise ValueError(f"torch_flash (transformers): {self.name} has {hidden.shape[0]} hidden states "
                             f"for the loss but {target.numel()} labels")
        device = hidden.device.type
        if torch.is_autocast_enabled(device):
            # the lm-head would run in the autocast dtype: so do the fused matmuls
            dtype = torch.get_autocast_dtype(device)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        reduction = "mean" if num_items_in_batch is None else "sum"
        loss = linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index,
                                    softcap=softcap, reduction=reduction)
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss

    def forward(self, *args, **kwargs):
        model = self.model
        # transformers computes a loss only when given labels (shift_labels, if also given,
        # replaces their shifted copy)
        labels = self.signature.bind_partial(*args, **kwargs).arguments.get("labels")
        if not (model.training and labels is not None):
            return self.original_forward(*args, **kwargs)
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(model.config, "return_dict", True)
        self.active, self.hidden, self.logits = True, None, None
        try:
            out = self.original_forward(*args, **kwargs, return_dict=True)
        finally:
            self.active, self.hidden, self.logits = False, None, None
        out = type(out)(**{f.name: None if f.name == "logits" else getattr(out, f.name)
                           for f in dataclasses.fields(out)})
        return out if return_dict else out.to_tuple()


def use_linear_cross_entropy(model: PreTrainedModel) -> PreTrainedModel:
    """Patch a transformers causal LM (in place; returns it) so that its training loss runs on
    flash.linear_cross_entropy and the (tokens, vocab) logits never exist: the output's logits
    is None in training with labels. Idempotent. Models with a loss_function of their own, an
    lm-head that is not an nn.Linear, or logits changed before the loss are refused."""
    if getattr(model, "_torch_flash_lce", None) is not None:
        return model
    name = type(model).__name__
    head = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    if type(head) is not torch.nn.Linear:
        raise TypeError(f"torch_flash.use_linear_cross_entropy: {name} needs to be a transformers model "
                        f"whose output embeddings are a torch.nn.Linear, got {type(head).__name__}")
    if hasattr(model, "_loss_function") or getattr(model, "loss_type", None) not in (None, "ForCausalLM"):
        raise ValueError(f"torch_flash.use_linear_cross_entropy: {name} has its own loss function "
                         f"or a loss_type other than transformers' ForCausalLM, the loss this fuses "
                         f"(loss_type={getattr(model, 'loss_type', None)!r})")
    state = _FusedHead(model, head)
    head.forward = state.head_forward
    model.loss_function = state.loss
    model.forward = state.forward
    model._torch_flash_lce = state
    return model
