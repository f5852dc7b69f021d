"""Fixtures of the peer suite: ``peer`` runs every phase of ``_suite.PHASES``
once per session (lazily, on first use) and hands tests the results."""

from __future__ import annotations

import os
import sys
import time

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import _launch
import _suite


class Results:
    def __init__(self, base: str) -> None:
        self.base = base
        self.by_phase: dict[str, list[dict]] = {}
        self.seconds: dict[str, float] = {}
        for phase, world in _suite.PHASES:
            t = time.perf_counter()
            self.by_phase[phase] = _launch.run(world, phase, base)
            self.seconds[phase] = time.perf_counter() - t

    def get(self, phase: str, name: str, rank: int = 0):
        """The value scenario ``name`` returned on ``rank`` (re-raises its error)."""
        record = self.by_phase[phase][rank][name]
        if record[0] != "ok":
            _suite.reraise(name, record, rank)
        return record[1]

    def all(self, phase: str, name: str) -> list:
        """Every rank's value (re-raises the first error)."""
        return [self.get(phase, name, r) for r in range(len(self.by_phase[phase]))]


_RESULTS: list[Results] = []


@pytest.fixture(scope="session")
def peer(tmp_path_factory) -> Results:
    results = Results(str(tmp_path_factory.mktemp("peer")))
    _RESULTS.append(results)
    return results


def pytest_terminal_summary(terminalreporter) -> None:
    """Wall seconds per phase and the slowest scenarios (rank 0), when the phases ran."""
    for results in _RESULTS:
        phases = ", ".join(f"{p} {s:.1f}s" for p, s in results.seconds.items())
        terminalreporter.write_line(f"peer phases: {phases}")
        slow = sorted(((sec, f"{p}:{n}") for p, ranks in results.by_phase.items()
                       for n, sec in ranks[0][_suite.SECONDS].items()), reverse=True)[:6]
        terminalreporter.write_line("peer slowest scenarios: " + ", ".join(f"{n} {s:.1f}s" for s, n in slow))
