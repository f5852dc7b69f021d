"""A local save makes durable exactly what it wrote (issue 17 item 4): an
fsync of every file and of every directory it added entries to, before the
commit's rename, and no syncfs of the whole file system when the files are
known (tensorckpt.storage.kv.sync_files)."""

from __future__ import annotations

import os
import stat
from collections import Counter

import pytest
import torch

import tensorckpt
from tensorckpt.storage import commit, direct, kv


def _state() -> dict:
    return {
        "big": torch.arange(300 * 400, dtype=torch.float32).reshape(300, 400),  # several stored objects
        "small": {"a": torch.ones(7), "b": torch.zeros(3, 2, dtype=torch.int64)},
        "step": 5,
    }


def _record(monkeypatch) -> tuple[list[str], list[str]]:
    """Record the paths os.fsync is called on (by fd) and each syncfs/sync."""
    fsynced: list[str] = []
    whole: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        fsynced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    inner = kv.sync_tree

    def sync_tree(path: str) -> None:
        whole.append(path)
        inner(path)

    monkeypatch.setattr(kv, "sync_tree", sync_tree)
    monkeypatch.setattr(os, "sync", lambda: whole.append("os.sync"))
    return fsynced, whole


@pytest.mark.parametrize("direct_path", [True, False], ids=["direct", "tensorstore"])
def test_save_fsyncs_every_file_and_directory_it_wrote(tmp_path, monkeypatch, direct_path):
    if not direct_path:
        monkeypatch.setattr(direct, "available", lambda local: False)
    fsynced, whole = _record(monkeypatch)
    path = tmp_path / "ckpt"
    tensorckpt.save(_state(), path, inner_chunk_bytes=100 * 100 * 4, shard_bytes=150 * 200 * 4)
    monkeypatch.undo()
    assert whole == [], "a save whose files are known must not flush the whole file system"
    staging = {p.split(os.sep + ".ckpt.tensorckpt-staging-")[1].split(os.sep)[0] for p in fsynced if ".ckpt.tensorckpt-staging-" in p}
    assert len(staging) == 1
    root = os.path.join(str(tmp_path), ".ckpt.tensorckpt-staging-" + staging.pop())
    synced = {os.path.relpath(p, root).replace(commit.PARTIAL_NAME, commit.ROOT_KEY) for p in fsynced
              if p.startswith(root + os.sep) or p == root}
    files, dirs = set(), {"."}
    for folder, subdirs, names in os.walk(path):
        rel = os.path.relpath(folder, path)
        dirs.update(os.path.normpath(os.path.join(rel, d)) for d in subdirs)
        files.update(os.path.normpath(os.path.join(rel, n)) for n in names)
    assert any("/c/" in f for f in files)
    assert files - synced == set(), f"files written but not fsynced: {sorted(files - synced)}"
    assert dirs - synced == set(), f"directories not fsynced: {sorted(dirs - synced)}"
    assert str(tmp_path) in fsynced, "the rename into place is made durable"
    target = {"big": torch.zeros(300, 400), "small": {"a": torch.zeros(7), "b": torch.zeros(3, 2, dtype=torch.int64)}, "step": 0}
    got = tensorckpt.load(target, path)
    assert torch.equal(got["big"], _state()["big"]) and got["step"] == 5


def test_each_directory_is_fsynced_once(tmp_path, monkeypatch):
    dirs: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            dirs.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    tensorckpt.save({f"t{i}": {"w": torch.ones(4), "v": torch.ones(2)} for i in range(20)}, tmp_path / "c")
    monkeypatch.undo()
    staging = [d for d in dirs if ".tensorckpt-staging-" in d]
    assert len(set(staging)) >= 61  # the staging directory, t0 .. t19, each one's w and v and their chunk folders c
    counts = Counter(staging)
    # chunk folders once; an array's folder (and those above it) once more by the seal, which writes
    # the array zarr.json with its chunks' digests after the data is durable (format 1.3, engine/seal.py);
    # the staging directory itself once more by the commit (after the root zarr.json)
    assert all(n == 1 for d, n in counts.items() if d.endswith("/c")), counts
    root = min(counts, key=len)
    assert all(n == 2 for d, n in counts.items() if not d.endswith("/c") and d != root), counts
    assert counts[root] == 3, counts


def test_sync_tree_stays_for_unknown_files(tmp_path):
    """``Backend.sync`` without the list of keys flushes the file system (syncfs)."""
    from tensorckpt.storage import location
    from tensorckpt.storage.backend import backend_for

    loc = location.parse(str(tmp_path / "x"))
    backend_for(loc).prepare(loc)
    (tmp_path / "x" / "f").write_bytes(b"1")
    backend_for(loc).sync(loc)
    backend_for(loc).sync(loc, ["f"])


def test_a_save_of_thousands_of_objects_syncs_the_file_system_once(tmp_path, monkeypatch):
    """Past kv.SYNCFS_ABOVE paths one syncfs replaces the fsyncs (measured
    cheaper for thousands of tiny tensors); the save still commits and loads."""
    monkeypatch.setattr(kv, "SYNCFS_ABOVE", 4)
    fsynced, whole = _record(monkeypatch)
    state = {f"t{i}": torch.full((3,), float(i)) for i in range(6)}
    tensorckpt.save(state, tmp_path / "ckpt")
    monkeypatch.undo()
    # one for the data, one for the sealed array documents (format 1.3: written after the data is durable)
    assert len(whole) == 2 and all(".ckpt.tensorckpt-staging-" in w for w in whole), whole
    out = {k: torch.zeros(3) for k in state}
    tensorckpt.load(out, tmp_path / "ckpt")
    assert all(torch.equal(out[k], state[k]) for k in state)
