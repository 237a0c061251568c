"""Rewrites of naive PyTorch into `flash` ops, on pre-dispatch ATen graphs (the IR of
torch.export and of make_fx(pre_dispatch=True)), before autograd, so that the fused ops'
own backward runs in training. Installed as torch_flash.compile_passes."""
from __future__ import annotations

from typing import Iterable

import torch.fx as fx

from .graph import normalize
from .patterns import FAMILIES
from .report import Report, Site

__all__ = ["FAMILIES", "Report", "Site", "rewrite_graph"]


def rewrite_graph(gm: fx.GraphModule, families: Iterable[str] | None = None) -> Report:
    """Rewrite gm in place with the chosen families (all by default); returns the report."""
    chosen = list(FAMILIES) if families is None else list(families)
    unknown = set(chosen) - set(FAMILIES)
    if unknown:
        raise ValueError(f"torch_flash: unknown op families {sorted(unknown)}; known: {sorted(FAMILIES)}")
    normalize(gm)
    report = Report()
    for fam in chosen:
        for rewrite in FAMILIES[fam]:
            rewrite(gm, report)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return report
