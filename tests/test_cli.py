import json
import subprocess
import sys

import torch

import tensorckpt
from tensorckpt.cli import main


def test_inspect_prints_tree_version_and_status(tmp_path, capsys):
    path = tmp_path / "c"
    tensorckpt.save({"model": {"w": torch.zeros(3, 4, dtype=torch.bfloat16)}, "step": 7}, path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "committed" in out and "format      1.1" in out
    assert "model/" in out and "[3, 4]" in out and "bfloat16" in out and "24 B" in out
    assert "step" in out and "= 7" in out


def test_inspect_json_and_module_entry(tmp_path):
    path = tmp_path / "c"
    tensorckpt.save({"w": torch.ones(2)}, path)
    r = subprocess.run([sys.executable, "-m", "tensorckpt", "inspect", "--json", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["complete"] is True and doc["tensors"]["w"]["shape"] == [2]


def test_inspect_reports_incomplete_and_missing(tmp_path, capsys):
    path = tmp_path / "c"
    tensorckpt.save({"w": torch.ones(2)}, path)
    (path / "zarr.json").unlink()
    assert main(["inspect", str(path)]) == 1
    assert "INCOMPLETE" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "no checkpoint found" in capsys.readouterr().err
