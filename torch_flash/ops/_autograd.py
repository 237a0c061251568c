"""Autograd for an op whose backward needs state that only a sibling op returns.

`flash.attention` returns `out`, but its backward needs the log-sum-exp that
`flash.attention_with_lse` computes in the same pass; recomputing it would cost a matmul.
`torch.library.register_autograd` only sees an op's own outputs, so this helper registers
the op's Autograd kernel by hand (the mechanism `register_autograd` uses inside): the
forward runs the sibling, keeps its extra state on `ctx`, and returns the public outputs.
With no gradient needed it dispatches straight to the op's own kernel.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch._library.custom_ops import CustomOpDef

# Autograd rules registered through this helper, by op name (the registry test reads it).
REGISTERED: dict[str, Callable] = {}


def register_autograd_via(opdef: CustomOpDef, *, forward: Callable[..., tuple[Any, Any]],
                          setup_context: Callable, backward: Callable, pass_needs_grad: bool = False) -> None:
    """forward(**inputs) -> (output, state); setup_context(ctx, inputs, output, state);
    backward(ctx, *grad_outputs) -> {input name: gradient}. pass_needs_grad: forward(needs_grad,
    **inputs) with the frozenset of input names that need a gradient, for a forward that
    computes gradients itself and should skip the others."""
    overload = opdef._opoverload
    # bind by the schema: triton_op's implementation is a (*args, **kwargs) wrapper
    arguments = overload._schema.arguments
    names = [a.name for a in arguments]
    defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}

    class _Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            inputs = dict(zip(names, args))
            if pass_needs_grad:
                needs = frozenset(n for n, need in zip(names, ctx.needs_input_grad) if need)
                output, state = forward(needs, **inputs)
            else:
                output, state = forward(**inputs)
            setup_context(ctx, inputs, output, state)
            return output

        @staticmethod
        def backward(ctx, *grads):
            got = backward(ctx, *grads)
            return tuple(got.get(n) for n in names)

    def autograd_kernel(*args, **kwargs):
        given = {**dict(zip(names, args)), **kwargs}
        values = [given[n] if n in given else defaults[n] for n in names]
        needs_grad = torch.is_grad_enabled() and any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in values)
        if not needs_grad:
            with torch._C._AutoDispatchBelowAutograd():
                return overload(*args, **kwargs)
        return _Function.apply(*values)

    with warnings.catch_warnings():
        # custom_op installs an Autograd kernel that runs register_autograd's rule; this one
        # replaces it (torch 2.11 refuses the override unless it is asked for explicitly)
        warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
        opdef._lib.impl(opdef._name, autograd_kernel, "Autograd", allow_override=True)
    REGISTERED[opdef._qualname.split("::")[1]] = autograd_kernel


def grad_or_empty(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Custom ops cannot return None: an absent weight or bias gets an empty gradient."""
    return like.new_empty(0) if grad is None else grad
