"""Per-phase save statistics across ranks (spec 9.7), summarized so that a
straggler rank or a slow storage path shows at a glance."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class PhaseSummary:
    phase: str
    min: float
    median: float
    max: float
    slowest_rank: int

    def to_json(self) -> dict:
        return {"min": self.min, "median": self.median, "max": self.max, "slowest_rank": self.slowest_rank}


def summarize(save_stats: dict | None) -> list[PhaseSummary]:
    """min / median / max seconds of each recorded phase across ranks, and
    the slowest rank."""
    out = []
    for phase, times in (save_stats or {}).get("seconds", {}).items():
        if times:
            slowest = max(range(len(times)), key=lambda r: (times[r], -r))
            out.append(PhaseSummary(phase, min(times), statistics.median(times), max(times), slowest))
    return out


def render(save_stats: dict | None) -> list[str]:
    """Lines for ``tensorckpt inspect``: one per phase, then bytes written."""
    rows = summarize(save_stats)
    if not rows:
        return []
    written = save_stats.get("bytes_written", [])
    lines = [f"save phases over {len(written) or '?'} rank(s), seconds:",
             f"  {'phase':<8}{'min':>10}{'median':>10}{'max':>10}  slowest rank"]
    for r in rows:
        lines.append(f"  {r.phase:<8}{r.min:>10.3f}{r.median:>10.3f}{r.max:>10.3f}  {r.slowest_rank}")
    if written:
        top = max(range(len(written)), key=lambda i: written[i])
        lines.append(f"  bytes written: total {sum(written)}, most {written[top]} (rank {top})")
    return lines
