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
    # every folder once, with the data: an array's zarr.json is written then (as in 1.2) and the seal
    # rewrites it in place with its chunks' digests (format 1.3, engine/seal.py: same inode, a file
    # fsync, no new directory entry); the staging directory itself once more by the commit (after
    # the root zarr.json)
    root = min(counts, key=len)
    assert all(n == 1 for d, n in counts.items() if d != root), counts
    assert counts[root] == 2, counts


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


def test_sealed_array_documents_are_the_bytes_written_as_new_files(tmp_path, monkeypatch):
    """A local save writes each array's zarr.json with its data and the seal
    rewrites it in place; the committed bytes are those of the seal writing
    it as a new file (how object stores and convert get it), chunk for chunk."""
    from tensorckpt.engine import save as save_module

    monkeypatch.setattr(save_module, "new_checkpoint_id", lambda: "ab" * 16)  # the same id: the same documents
    tensorckpt.save(_state(), tmp_path / "in_place")
    monkeypatch.setattr(kv, "rewrites_in_place", lambda loc: False)
    tensorckpt.save(_state(), tmp_path / "new_files")

    def files(root):
        return {os.path.relpath(os.path.join(d, n), root): open(os.path.join(d, n), "rb").read()
                for d, _, names in os.walk(root) for n in names if os.path.join(d, n) != os.path.join(root, "zarr.json")}

    a, b = files(tmp_path / "in_place"), files(tmp_path / "new_files")
    assert a == b and any(k.endswith("/zarr.json") and b'"chunk_digests"' in v for k, v in a.items())
    assert tensorckpt.verify(tmp_path / "in_place").ok


def test_rewrite_durably(tmp_path):
    """In place (a shorter document leaves no tail), only files that exist;
    elsewhere than on local files, nothing (the caller writes them)."""
    from tensorckpt.storage import location

    loc = location.parse(str(tmp_path))
    (tmp_path / "a").write_bytes(b"x" * 100)
    ino = os.stat(tmp_path / "a").st_ino
    assert kv.rewrite_durably(loc, {"a": b"short", "b": b"new"}) == {"b": b"new"}
    assert (tmp_path / "a").read_bytes() == b"short" and os.stat(tmp_path / "a").st_ino == ino
    assert not (tmp_path / "b").exists()
    mem = location.parse("memory://x/y")
    assert kv.rewrite_durably(mem, {"a": b"1"}) == {"a": b"1"}
