"""Rewrites of naive PyTorch into `flash` ops, on pre-dispatch ATen graphs (the IR of
torch.export and of make_fx(pre_dispatch=True)), before autograd, so that the fused ops'
own backward runs in training. Installed as torch_flash.compile_passes."""
from __future__ import annotations

from typing import Iterable

import torch.fx as fx

from .graph import normalize, regions_of, wrapped_args
from .patterns import FAMILIES
from .report import Report, Site

__all__ = ["FAMILIES", "Report", "Site", "rewrite_graph"]


def rewrite_graph(gm: fx.GraphModule, families: Iterable[str] | None = None) -> Report:
    """Rewrite gm in place with the chosen families (all by default), and the subgraphs of its
    regions (graph.regions) alike; returns the report, the sites in a region named by it."""
    chosen = list(FAMILIES) if families is None else list(families)
    unknown = set(chosen) - set(FAMILIES)
    if unknown:
        raise ValueError(f"torch_flash: unknown op families {sorted(unknown)}; known: {sorted(FAMILIES)}")
    normalize(gm)
    report = Report()
    for fam in chosen:
        for rewrite in FAMILIES[fam]:
            rewrite(gm, report)
    # a region (under another autocast or grad mode, checkpointed, a branch of torch.cond) is a
    # subgraph of its own: rewritten in place, so its flash ops run as the model's ops did there
    for name, sub, outer in regions_of(gm):
        with wrapped_args(sub, outer):
            inner = rewrite_graph(sub, chosen)
        for site in inner.sites:
            site.reason = f"inside {name}" + (f": {site.reason}" if site.reason else "")
        report.extend(inner)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return report
