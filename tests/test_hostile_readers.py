"""Forged and foreign input on every read path (issue 12 items 7, 8, 9, 10,
12): overlapping or unordered shard-index entries, a forged huge inner chunk,
metadata documents of gigabytes, links to outside the checkpoint, and things
that are not tensorckpt checkpoints at all. load, open/read,
to_state_dict, verify and inspect treat each the same way."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch

import tensorckpt
from tests.forge import reseal
from tensorckpt.cli import main as cli
from tensorckpt.errors import CorruptCheckpointError, NotACheckpointError
from tensorckpt.format.metadata import (
    MAX_NODE_JSON_BYTES,
    MAX_ROOT_JSON_BYTES,
    TensorEntry,
)
from tensorckpt.storage import arrays

W = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
N, ENCODED = 8, 16 * 12 * 4 + 4  # inner chunks per object, bytes of one encoded inner chunk


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "ckpt"
    tensorckpt.save({"model": {"w": W}}, path, inner_chunk_bytes=16 * 16 * 4, shard_bytes=32 * 48 * 4)
    e = tensorckpt.open(path).index.tensors["model/w"]
    assert (e.chunk_shape, e.inner_chunk_shape) == ((32, 48), (16, 12))
    return path


def _readers(path: Path):
    """Each read path: (name, a function that reads everything)."""
    return [
        ("load", lambda: tensorckpt.load({"model": {"w": torch.zeros_like(W)}}, path)),
        ("read", lambda: tensorckpt.open(path).read("model/w")),
        ("read region", lambda: tensorckpt.open(path).read("model/w", index=(slice(32, 64),))),
        ("read strided", lambda: tensorckpt.open(path).read("model/w", index=(slice(32, 64, 2),))),
        ("to_state_dict", lambda: tensorckpt.open(path).to_state_dict()),
    ]


def _all_refuse(path: Path, match: str) -> None:
    for name, f in _readers(path):
        with pytest.raises(CorruptCheckpointError, match=match):
            f()
            pytest.fail(f"{name} accepted it")
    report = tensorckpt.verify(path)
    assert not report.ok and any(match in p.message or match in p.where for p in report.problems), report.problems


# ------------------------------------------------------------------ item 7


def _rewrite_index(obj: Path, change) -> None:
    data = obj.read_bytes()
    entries = np.frombuffer(data[-(16 * N + 4):-4], "<u8").reshape(N, 2).copy()
    change(entries)
    raw = entries.astype("<u8").tobytes()
    obj.write_bytes(data[: -(16 * N + 4)] + raw + struct.pack("<I", google_crc32c.value(raw)))


@pytest.mark.parametrize("kind", ["same bytes", "half overlapping"])
def test_overlapping_index_entries_refused(ckpt, kind):
    """Two inner chunks pointed at the same bytes (each CRC intact), or at
    overlapping ones: refused by every reader, never returned."""
    def change(e):
        if kind == "same bytes":
            e[1] = e[0]
        else:
            e[1, 0] = e[0, 0] + ENCODED // 2

    _rewrite_index(ckpt / "model" / "w" / "c" / "1" / "0", change)
    for name, f in _readers(ckpt):
        with pytest.raises(CorruptCheckpointError, match="overlap|malformed"):
            f()
            pytest.fail(f"{name} accepted it")
    report = tensorckpt.verify(ckpt)
    assert not report.ok and "overlap" in report.problems[0].message


def test_inner_chunks_in_another_order_are_read(ckpt):
    """The sharding codec lets a writer store inner chunks in any order
    (zarr-python's is not C order): entries out of C order that do not
    overlap are read, each inner chunk from its own entry."""
    obj = ckpt / "model" / "w" / "c" / "1" / "0"
    data = bytearray(obj.read_bytes())
    a, b = bytes(data[:ENCODED]), bytes(data[ENCODED:2 * ENCODED])
    data[:ENCODED], data[ENCODED:2 * ENCODED] = b, a  # swap the stored bytes of inner chunks 0 and 1
    obj.write_bytes(bytes(data))
    _rewrite_index(obj, lambda e: e.__setitem__([0, 1], e[[1, 0]]))  # and their index entries
    assert torch.equal(tensorckpt.open(ckpt).read("model/w"), W)
    assert tensorckpt.verify(ckpt).ok


# ------------------------------------------------------------------ item 8


def _forge(path: Path, key: str, entry: TensorEntry) -> None:
    root = json.loads((path / "zarr.json").read_text())
    root["attributes"]["tensorckpt"]["tensors"][key] = entry.to_json()
    (path / key / "zarr.json").write_bytes(arrays.zarr_json(entry))
    reseal(path, root)  # the digests and checksum of format 1.3 agree with the forgery too


def test_forged_huge_inner_chunk_refused_before_tensorstore(tmp_path):
    """A 1 TiB inner chunk on which root and array metadata agree: read,
    load and to_state_dict refuse it, as verify does, instead of aborting
    the interpreter in TensorStore (run in a child process: an abort there
    must fail this test, not end the test run)."""
    p = tmp_path / "c"
    tensorckpt.save({"w": torch.ones(8)}, p)
    _forge(p, "w", TensorEntry("float32", (8,), (2**38,), (2**38,)))
    code = textwrap.dedent(f"""
        import torch, tensorckpt
        from tensorckpt.errors import CorruptCheckpointError
        p = {str(p)!r}
        for name, f in [("read", lambda: tensorckpt.open(p).read("w")),
                        ("load", lambda: tensorckpt.load({{"w": torch.zeros(8)}}, p)),
                        ("to_state_dict", lambda: tensorckpt.open(p).to_state_dict())]:
            try:
                f()
                print(name, "ACCEPTED")
            except CorruptCheckpointError as e:
                assert "a reader accepts (spec 12)" in str(e) and "'w'" in str(e), str(e)  # refused at open (the cap)
                print(name, "refused")
        assert not tensorckpt.verify(p).ok
        print("done")
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["read", "refused", "load", "refused", "to_state_dict", "refused", "done"], r.stdout


# ------------------------------------------------------------------ item 9


@pytest.mark.parametrize("which", ["root", "array", "group"])
def test_sparse_huge_zarr_json_refused(ckpt, which, capsys):
    """An 8 GiB (sparse) zarr.json: refused with a clear error naming the cap,
    without reading it (no MemoryError, little memory)."""
    doc = {"root": ckpt / "zarr.json", "array": ckpt / "model" / "w" / "zarr.json",
           "group": ckpt / "model" / "zarr.json"}[which]
    with open(doc, "r+b") as f:
        f.truncate(8 << 30)
    cap = MAX_ROOT_JSON_BYTES if which == "root" else MAX_NODE_JSON_BYTES
    tracemalloc.start()
    try:
        if which == "root":
            for f in (lambda: tensorckpt.open(ckpt), lambda: tensorckpt.load({"model": {"w": torch.zeros_like(W)}}, ckpt)):
                with pytest.raises(CorruptCheckpointError, match=f"larger than a reader accepts.*{cap}"):
                    f()
            assert cli(["inspect", str(ckpt)]) != 0
            assert "larger than a reader accepts" in capsys.readouterr().err
        elif which == "array":
            for name, f in _readers(ckpt):
                with pytest.raises(CorruptCheckpointError, match=f"larger than a reader accepts.*{cap}"):
                    f()
        report = tensorckpt.verify(ckpt)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20
    assert not report.ok and any("larger than a reader accepts" in p.message for p in report.problems), report.problems


# ------------------------------------------------------------------ item 10


@pytest.mark.parametrize("what", ["root zarr.json", "array zarr.json", "group zarr.json", "array dir", "group dir"])
def test_links_refused_on_every_path(ckpt, tmp_path, what):
    """A link planted in the checkpoint (to an intact copy outside it) is
    refused by every reader, verify included; a writer makes none."""
    outside = tmp_path / "outside"
    shutil.copytree(ckpt, outside)
    rel = {"root zarr.json": "zarr.json", "array zarr.json": "model/w/zarr.json", "group zarr.json": "model/zarr.json",
           "array dir": "model/w", "group dir": "model"}[what]
    target = ckpt / rel
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink()
    target.symlink_to(outside / rel)
    if what == "root zarr.json":
        for f in (lambda: tensorckpt.open(ckpt), lambda: tensorckpt.load({"model": {"w": torch.zeros_like(W)}}, ckpt)):
            with pytest.raises(CorruptCheckpointError, match="link"):
                f()
        report = tensorckpt.verify(ckpt)
        assert not report.ok and "link" in report.problems[0].message
        return
    if what != "group zarr.json":  # the group's zarr.json is not needed to read (spec 4); verify checks it
        _all_refuse(ckpt, "link")
    report = tensorckpt.verify(ckpt)
    assert not report.ok and any("link" in p.message for p in report.problems), report.problems


# ------------------------------------------------------------------ item 12


def _dcp(path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(path))


def _safetensors(path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(3)}, str(path))


def _hf(path: Path) -> None:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _safetensors(path / "model.safetensors")


def _manager(path: Path) -> None:
    tensorckpt.CheckpointManager(path).save(7, {"w": torch.ones(3)})


FOREIGN = {
    "dcp": (_dcp, "torch.distributed.checkpoint (DCP) directory"),
    "torch.save": (lambda p: torch.save({"w": torch.ones(3)}, p), "torch.save archive"),
    "torch.save legacy": (lambda p: torch.save({"w": torch.ones(3)}, p, _use_new_zipfile_serialization=False),
                          "torch.save file (legacy"),
    "safetensors": (_safetensors, "a safetensors file"),
    "hugging face": (_hf, "Hugging Face model directory"),
    "manager root": (_manager, "CheckpointManager root"),
}


@pytest.mark.parametrize("kind", list(FOREIGN))
def test_foreign_data_is_named_never_deleted(tmp_path, kind, capsys):
    """What is not a tensorckpt checkpoint is named, with what to do
    (convert it; a step's path), by load, open, verify and inspect; no
    message advises deleting it, and nothing is deleted."""
    make, says = FOREIGN[kind]
    path = tmp_path / "thing"
    make(path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    todo = "step-00000007" if kind == "manager root" else "tensorckpt convert"
    for f in (lambda: tensorckpt.load({"w": torch.zeros(3)}, path), lambda: tensorckpt.open(path),
              lambda: tensorckpt.verify(path)):
        with pytest.raises(NotACheckpointError) as info:
            f()
        msg = str(info.value)
        assert says in msg and todo in msg and str(path) in msg, msg
        assert "delete" not in msg.lower() and "interrupted" not in msg, msg
    assert cli(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert says in err and "delete" not in err.lower()
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_closed_view_refuses_reads(ckpt):
    """A closed view no longer holds its directory: reading is an error, never
    a read of whatever now has its descriptor number."""
    with tensorckpt.open(ckpt) as c:
        assert torch.equal(c.read("model/w", index=(slice(1, 9, 3), 2)), W[1:9:3, 2])
    with pytest.raises(tensorckpt.TensorckptError, match="closed"):
        c.read("model/w")


def test_plain_directory_without_root_is_not_called_an_interrupted_save(tmp_path):
    """A directory without a root zarr.json and no staging leftovers next to
    it is not what a tensorckpt save leaves: no advice to delete it."""
    d = tmp_path / "data"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    with pytest.raises(tensorckpt.IncompleteCheckpointError) as info:
        tensorckpt.open(d)
    assert "delete" not in str(info.value).lower() and "not written by" not in str(info.value)
    assert (d / "notes.txt").exists()
