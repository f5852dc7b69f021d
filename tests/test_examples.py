"""Every script in examples/ runs to completion (and checks itself)."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script, tmp_path):
    r = subprocess.run([sys.executable, str(script), "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{script.name} failed:\n{r.stdout}\n{r.stderr}"
    assert r.stdout.strip(), f"{script.name} printed nothing"
