"""The benchmark scripts run (tiny sizes): figures quoted in notes come from
them, so they must not rot. This checks they work and verify their loads, not
their speed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    "bench_single": ["--size-gib", "0.01", "--reps", "1", "--d-model", "64"],
    "bench_small": ["--tensors", "50", "--numel", "64", "--reps", "1", "--load-mib", "8"],
    "bench_dist": ["--size-gib", "0.03", "--reps", "1"],
    "bench_plan_scale": ["--ranks", "64", "128", "--layers", "2"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_runs(name, tmp_path):
    args = [sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"), *CASES[name]]
    if name != "bench_plan_scale":
        args += ["--dir", str(tmp_path)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "FAIL" not in r.stdout
