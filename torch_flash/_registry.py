"""The one table of torch-flash ops.

Every public op of the `flash` namespace has a row here. `tests/test_registry.py` walks
the table and fails when an op lacks any of its pieces: the schema, a fake from
`torch_flash.meta_kernels`, an autograd rule, a backward op with its own fake, a
plain-PyTorch reference in `torch_flash.reference.<stem>`, and opcheck samples in
`tests/ops/test_<stem>.py`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpEntry:
    name: str  # op name inside the `flash` namespace
    stem: str  # file stem shared by ops/, reference/, meta_kernels/, tests/ops/
    family: str  # compile-pass family: attention | norm | loss | rotary
    backward: str | None  # backward op, None for inference-only ops
    mutates: tuple[str, ...] = ()  # arguments the op writes in place
    public: bool = True  # has a torch_flash.<name> function (internal ops serve another op's autograd)


OPS: tuple[OpEntry, ...] = (
    OpEntry("attention", "attention", "attention", "attention_backward"),
    OpEntry("attention_with_lse", "attention", "attention", "attention_backward"),
    # the Hopper forward kernel (csrc/attention) that flash.attention calls where it serves
    OpEntry("attention_fwd_sm90", "attention", "attention", None, public=False),
    # the Hopper backward kernel (csrc/attention) that flash.attention_backward calls where it serves
    OpEntry("attention_bwd_sm90", "attention", "attention", None, public=False),
    OpEntry("attention_varlen", "attention_varlen", "attention", "attention_varlen_backward"),
    OpEntry("attention_decode", "attention_decode", "attention", None, ("k_cache", "v_cache")),
    OpEntry("rms_norm", "rms_norm", "norm", "rms_norm_backward"),
    OpEntry("add_rms_norm", "rms_norm", "norm", "add_rms_norm_backward"),
    OpEntry("layer_norm", "layer_norm", "norm", "layer_norm_backward"),
    OpEntry("add_layer_norm", "layer_norm", "norm", "add_layer_norm_backward"),
    # the autograd forwards of layer_norm / add_layer_norm: also each row's mean and rstd
    OpEntry("layer_norm_with_stats", "layer_norm", "norm", None, public=False),
    OpEntry("add_layer_norm_with_stats", "layer_norm", "norm", None, public=False),
    OpEntry("cross_entropy", "cross_entropy", "loss", "cross_entropy_backward"),
    # the autograd forward of cross_entropy: the loss and the row log-sum-exps its backward reuses
    OpEntry("cross_entropy_with_lse", "cross_entropy", "loss", None, public=False),
    # the backward of cross_entropy(inplace_backward=True): the gradient written over the logits
    OpEntry("cross_entropy_backward_inplace", "cross_entropy", "loss", None, ("logits",), public=False),
    # vocab-parallel cross_entropy: one vocabulary shard's row statistics, combined across ranks
    OpEntry("cross_entropy_shard_stats", "cross_entropy", "loss", None, public=False),
    OpEntry("linear_cross_entropy", "linear_cross_entropy", "loss", "linear_cross_entropy_backward"),
    # the autograd forward of linear_cross_entropy: loss and gradients in one pass
    OpEntry("linear_cross_entropy_with_grads", "linear_cross_entropy", "loss", None, public=False),
    # a compiled backward's step over the gradients the forward computed: scaled in place
    OpEntry("linear_cross_entropy_scale_", "linear_cross_entropy", "loss", None, ("grad",), public=False),
    OpEntry("rotary", "rotary", "rotary", "rotary_backward"),
    OpEntry("rotary_qk", "rotary", "rotary", "rotary_qk_backward"),
    # in-place forms, public as torch_flash.rotary / rotary_qk(..., inplace=True)
    OpEntry("rotary_", "rotary", "rotary", "rotary_backward", ("x",), public=False),
    OpEntry("rotary_qk_", "rotary", "rotary", "rotary_qk_backward", ("q", "k"), public=False),
)

BY_NAME = {e.name: e for e in OPS}


def backward_ops() -> list[tuple[str, str]]:
    """(backward op, stem) pairs, each once."""
    seen: dict[str, str] = {}
    for e in OPS:
        if e.backward is not None:
            seen.setdefault(e.backward, e.stem)
    return list(seen.items())
