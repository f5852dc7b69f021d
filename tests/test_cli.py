import io
import json
import shutil
import subprocess
import sys

import pytest
import torch

import tensorckpt
from tensorckpt.cli import main, verify


def test_inspect_prints_tree_version_and_status(tmp_path, capsys):
    path = tmp_path / "c"
    tensorckpt.save({"model": {"w": torch.zeros(3, 4, dtype=torch.bfloat16)}, "step": 7}, path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "committed" in out and f"format      {tensorckpt.FORMAT_VERSION}" in out
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


# ----------------------------------------------------------------- verify


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _corrupt_chunk(path) -> str:
    f = next(f for f in sorted((path / "w" / "c").rglob("*")) if f.is_file())
    data = bytearray(f.read_bytes())
    data[0] ^= 0x40
    f.write_bytes(bytes(data))
    return str(f)


def test_verify_ok_summary_and_json(tmp_path, capsys):
    path = tmp_path / "c"
    tensorckpt.save({"w": torch.ones(64, 8), "step": 1}, path, shard_bytes=512)
    assert main(["verify", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "status      OK" in out and "1 tensors, 4 chunks, 2.0 KiB read back" in out and "problems    0" in out
    assert err == ""  # no progress bar when stderr is not a terminal
    assert main(["verify", "--json", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["chunks"] == 4 and doc["bytes"] == 2048 and doc["problems"] == []


def test_verify_corrupt_and_incomplete_exit_1(tmp_path, capsys):
    path = tmp_path / "c"
    tensorckpt.save({"w": torch.ones(64, 8)}, path, shard_bytes=512)
    chunk = _corrupt_chunk(path)
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert "status      CORRUPT" in out and f"corrupt: {chunk}: tensor 'w'" in out and "CRC-32C" in out
    assert main(["verify", "--json", str(path)]) == 1
    assert json.loads(capsys.readouterr().out)["problems"][0]["where"] == chunk
    (path / "zarr.json").unlink()
    assert main(["verify", str(path)]) == 1
    assert "status      INCOMPLETE" in capsys.readouterr().out


def test_verify_other_errors_exit_2(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope")]) == 2
    assert "no checkpoint found" in capsys.readouterr().err
    path = tmp_path / "c"
    tensorckpt.save({"w": torch.ones(2)}, path)
    root = json.loads((path / "zarr.json").read_text())
    root["attributes"]["tensorckpt"]["format_version"] = "2.0"
    (path / "zarr.json").write_text(json.dumps(root))
    assert main(["verify", str(path)]) == 2
    assert "upgrade tensorckpt" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        main(["verify"])
    assert ei.value.code == 2


def test_verify_progress_bar_on_a_terminal_only(tmp_path):
    path = tmp_path / "c"
    tensorckpt.save({"w": torch.ones(64, 8)}, path, shard_bytes=512)
    err = _Terminal()
    assert verify(str(path), out=io.StringIO(), err=err) == 0
    assert "verify 100% [##############################] 2.0 KiB / 2.0 KiB" in err.getvalue()
    assert err.getvalue().endswith("\r\033[K")  # erased at the end
    err = _Terminal()
    assert verify(str(path), quiet=True, out=io.StringIO(), err=err) == 0
    assert err.getvalue() == ""


def test_verify_module_entry(tmp_path):
    path = tmp_path / "c"
    tensorckpt.save({"w": torch.ones(2)}, path)
    r = subprocess.run([sys.executable, "-m", "tensorckpt", "verify", "--json", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True


# ----------------------------------------------------------------- clean


def test_clean_dry_run_then_clean(tmp_path, capsys):
    path = tmp_path / "c"
    tensorckpt.save({"w": torch.ones(2)}, path)
    staging = tmp_path / ".c.tensorckpt-staging-0123456789ab"
    shutil.copytree(path, staging)
    (staging / "zarr.json").unlink()
    assert main(["clean", str(path)]) == 0
    out = capsys.readouterr().out
    assert "committed, left alone" in out and f"kept         {staging}: changed" in out
    assert main(["clean", "--older-than", "0", "--dry-run", str(path)]) == 0
    assert f"would remove {staging}: the data of an interrupted save" in capsys.readouterr().out
    assert staging.exists()
    assert main(["clean", "--older-than", "0", "--json", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["committed"] is True and [x["removed"] for x in doc["leftovers"]] == [True]
    assert not staging.exists() and tensorckpt.open(path).keys() == ["w"]
    assert main(["clean", str(path)]) == 0
    assert "no leftovers" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_clean_bad_grace_period_is_a_usage_error(tmp_path, value, capsys):
    with pytest.raises(SystemExit) as ei:
        main(["clean", "--older-than", value, str(tmp_path)])
    assert ei.value.code == 2 and "seconds" in capsys.readouterr().err
