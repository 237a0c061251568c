"""What a rewrite found: every candidate site, rewritten or not, and why."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Site:
    family: str  # attention | norm | loss | rotary
    location: str  # user source line or module path
    anchor: str  # the distinctive node the search started from (softmax, rsqrt, ...)
    op: str | None = None  # flash op it became, None when left alone
    reason: str = ""  # why it was left alone (rewritten: what of it was not), in words a user can act on

    @property
    def rewritten(self) -> bool:
        return self.op is not None


@dataclass
class Report:
    sites: list[Site] = field(default_factory=list)

    def add(self, site: Site) -> None:
        self.sites.append(site)

    def counters(self) -> Counter:
        """Matches per op, as `flash.<op>` -> count."""
        return Counter(f"flash.{s.op}" for s in self.sites if s.rewritten)

    def extend(self, other: "Report") -> None:
        self.sites.extend(other.sites)

    def __str__(self) -> str:
        if not self.sites:
            return "no candidate sites found"
        lines = []
        for s in self.sites:
            what = f"-> flash.{s.op}" if s.rewritten else f"not rewritten: {s.reason}"
            if s.rewritten and s.reason:
                what += f" ({s.reason})"
            lines.append(f"[{s.family}] {s.anchor} at {s.location}: {what}")
        done = sum(s.rewritten for s in self.sites)
        lines.append(f"{done}/{len(self.sites)} sites rewritten")
        return "\n".join(lines)
