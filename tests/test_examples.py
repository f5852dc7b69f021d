"""Every script in examples/ runs to completion (and checks itself)."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))

# Lines a script must print besides exiting 0 (it checks itself; these make
# sure the checks ran).
EXPECTED_OUTPUT = {
    "train_resume.py": [
        "resumed on 2 ranks = uninterrupted on 4 ranks",
        "epoch 0: every one of the 96 samples trained on exactly once: True",
        "epoch 1: every one of the 96 samples trained on exactly once: True",
        "status      committed (complete)",
    ],
}


def test_train_resume_is_an_example():
    assert "train_resume.py" in {p.name for p in EXAMPLES}


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script, tmp_path):
    r = subprocess.run([sys.executable, str(script), "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{script.name} failed:\n{r.stdout}\n{r.stderr}"
    assert r.stdout.strip(), f"{script.name} printed nothing"
    for line in EXPECTED_OUTPUT.get(script.name, []):
        assert line in r.stdout, f"{script.name} did not print {line!r}:\n{r.stdout}"
