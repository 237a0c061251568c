"""The post-grad pass the flash backend adds to Inductor's (config.post_grad_custom_post_pass).

A compiled backward of flash.linear_cross_entropy hands out the gradients its forward computed,
scaled in place by flash.linear_cross_entropy_scale_ (torch_flash/ops/linear_cross_entropy.py,
_backward), on buffers AOTAutograd donates to the backward. AOTAutograd functionalizes that
mutation (auto_functionalized_v2) and Inductor's reinplacing does not undo it for a graph input
whose mutation the program does not show (torch 2.11-2.13, fx_passes/reinplace.py, can_inplace),
donated or not: it clones the gradient, into the donated buffer itself, a copy of dweight onto
itself each step (0.7 ms at 8192 x 4096 x 128256 on an H100, 1.8 % of the step). Where the
mutated tensor is a donated input of a backward graph that nothing else reads, this pass calls
the op on it in place.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.utils import get_donated_idxs


def _donated_inputs(graph: fx.Graph) -> set[fx.Node]:
    """The placeholders AOTAutograd donated to this graph if it is a backward one (its
    upstream gradients are the tangents_* inputs), else none."""
    placeholders = list(graph.find_nodes(op="placeholder"))
    if not any(str(p.target).startswith("tangents") for p in placeholders):
        return set()
    return {placeholders[i] for i in get_donated_idxs() or () if i < len(placeholders)}


def scale_donated_in_place(graph: fx.Graph) -> None:
    """auto_functionalized_v2(linear_cross_entropy_scale_, grad=whole donated input) -> the op
    on that input, except under CUDA graphs."""
    from torch._inductor import config

    if config.triton.cudagraphs:
        # mode="reduce-overhead": the gradients would be the forward graph's outputs, in the
        # memory its next replay writes, where the clone gives them the backward's own
        return
    op = torch.ops.flash.linear_cross_entropy_scale_.default
    donated = _donated_inputs(graph)
    for node in list(graph.find_nodes(op="call_function", target=torch.ops.higher_order.auto_functionalized_v2)):
        kw = node.kwargs
        bases = kw.get("_all_bases", ())
        views = [k for k in kw if k.startswith("_grad_") and k != "_grad_base_index"]
        if (node.args[0] is not op or len(bases) != 1 or bases[0] not in donated or views
                or set(bases[0].users) != {node}
                or any(u.target is not operator.getitem for u in node.users)):
            continue
        base = bases[0]
        with graph.inserting_before(node):
            graph.call_function(op, (base, kw["grad_loss"]))
        for user in list(node.users):  # item 0: the op's result (none), 1: the updated base
            if user.args[1] == 1:
                user.replace_all_uses_with(base)
            graph.erase_node(user)
        graph.erase_node(node)


class FlashPostGradPass(CustomGraphPass):
    """scale_donated_in_place after the pass the user had there (previous), if any."""

    def __init__(self, previous=None):
        self.previous = previous

    def __call__(self, graph: fx.Graph) -> None:
        if self.previous is not None:
            self.previous(graph)
        scale_donated_in_place(graph)

    def uuid(self):
        """For Inductor's cache: this file and the previous pass (None: not cacheable)."""
        mine = get_hash_for_files((__file__,))
        if self.previous is None:
            return mine
        theirs = self.previous.uuid() if hasattr(self.previous, "uuid") else None
        return None if theirs is None else (mine, theirs)
