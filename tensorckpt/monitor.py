"""Per-phase save statistics across ranks (spec 9.7), summarized so that a
straggler rank or a slow storage path shows at a glance. Used by
``tensorckpt inspect`` (cli.py) on a checkpoint's ``metadata.save_stats``."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .format.metadata import SaveStatsRecord


@dataclass(frozen=True)
class PhaseSummary:
    phase: str
    min: float
    median: float
    max: float
    slowest_rank: int

    def to_json(self) -> dict[str, float | int]:
        return {"min": self.min, "median": self.median, "max": self.max, "slowest_rank": self.slowest_rank}


def summarize(save_stats: SaveStatsRecord | None) -> list[PhaseSummary]:
    """min / median / max seconds of each recorded phase across ranks, and
    the slowest rank."""
    out = []
    for phase, times in ((save_stats.seconds or {}) if save_stats is not None else {}).items():
        if times:
            slowest = max(range(len(times)), key=lambda r: (times[r], -r))
            out.append(PhaseSummary(phase, min(times), statistics.median(times), max(times), slowest))
    return out


def render(save_stats: SaveStatsRecord | None) -> list[str]:
    """Lines for ``tensorckpt inspect``: one per phase, then bytes written."""
    rows = summarize(save_stats)
    if save_stats is None or not rows:
        return []
    written = save_stats.bytes_written or ()
    lines = [f"save phases over {len(written) or '?'} rank(s), seconds:",
             f"  {'phase':<8}{'min':>10}{'median':>10}{'max':>10}  slowest rank"]
    for r in rows:
        lines.append(f"  {r.phase:<8}{r.min:>10.3f}{r.median:>10.3f}{r.max:>10.3f}  {r.slowest_rank}")
    if written:
        top = max(range(len(written)), key=lambda i: written[i])
        lines.append(f"  bytes written: total {sum(written)}, most {written[top]} (rank {top})")
    return lines
