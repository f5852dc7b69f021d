"""``tensorckpt.clean``: the leftover rule of spec 10.5. Committed checkpoints
are never touched (a reader of one always reads it bit-exact while clean
runs), a save in progress is never cut short, and the only complete copy of
a checkpoint is kept."""

from __future__ import annotations

import shutil
import threading
import time
import types

import pytest
import torch

import tensorckpt
from tensorckpt.storage import commit, kv, location

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")

OLD = 0.4  # older_than in these tests; leftovers made before a sleep of AGE are older
AGE = 0.5
W = torch.arange(1 << 16, dtype=torch.float32).reshape(256, 256)


def _state(k: float = 1.0) -> dict:
    return {"w": W * k, "g": {"b": torch.arange(5)}, "step": int(k)}


def _staging(tmp_path, name: str = "ckpt", token: str = "0123456789ab"):
    return tmp_path / f".{name}.tensorckpt-staging-{token}"


def _leftover(tmp_path, token: str, complete: bool):
    """A copy of the committed checkpoint under a staging name, with or without its root."""
    s = _staging(tmp_path, token=token)
    shutil.copytree(tmp_path / "ckpt", s)
    if not complete:
        (s / "zarr.json").unlink()
    return s


def _same(path, k: float = 1.0) -> bool:
    out = tensorckpt.load({"w": torch.empty(256, 256), "g": {"b": torch.empty(5, dtype=torch.int64)}, "step": 0}, path)
    return torch.equal(out["w"], W * k) and out["step"] == int(k)


def test_old_leftovers_go_young_ones_stay(tmp_path):
    p = tmp_path / "ckpt"
    tensorckpt.save(_state(), p)
    garbage = _leftover(tmp_path, "aaaaaaaaaaaa", complete=False)
    stale = _leftover(tmp_path, "bbbbbbbbbbbb", complete=True)  # the old checkpoint of a replace
    time.sleep(AGE)
    young = _leftover(tmp_path, "cccccccccccc", complete=False)

    dry = tensorckpt.clean(p, older_than=OLD, dry_run=True)
    assert [(x.path, x.removed) for x in dry.leftovers] == [(str(garbage), True), (str(stale), True), (str(young), False)]
    assert garbage.exists() and stale.exists()  # a dry run removes nothing

    report = tensorckpt.clean(p, older_than=OLD)
    assert report.committed and [x.removed for x in report.leftovers] == [True, True, False]
    assert "a save may still be writing it" in report.leftovers[2].reason
    assert not garbage.exists() and not stale.exists() and young.exists()
    assert _same(p)


def test_default_grace_period_keeps_recent_leftovers(tmp_path):
    p = tmp_path / "ckpt"
    tensorckpt.save(_state(), p)
    s = _leftover(tmp_path, "aaaaaaaaaaaa", complete=False)
    (x,) = tensorckpt.clean(p).leftovers
    assert not x.removed and x.age < 60 and s.exists()


def test_only_complete_copy_is_kept(tmp_path):
    """The fallback of spec 10.2 step 4 interrupted between its renames: no
    committed target, and two complete checkpoints at staging names."""
    p = tmp_path / "ckpt"
    tensorckpt.save(_state(), p)
    new = _leftover(tmp_path, "aaaaaaaaaaaa", complete=True)
    p.rename(tmp_path / f"{new.name}-old")
    time.sleep(AGE)
    report = tensorckpt.clean(p, older_than=0)
    assert not report.committed and len(report.leftovers) == 2
    assert not any(x.removed for x in report.leftovers)
    assert all("the only one" in x.reason for x in report.leftovers)
    assert _same(new)


def test_uncommitted_local_target_is_not_a_save_leftover(tmp_path):
    p = tmp_path / "ckpt"
    tensorckpt.save(_state(), p)
    (p / "zarr.json").unlink()
    (x,) = tensorckpt.clean(p, older_than=0).leftovers
    assert x.path == str(p) and not x.removed and "not left by a save" in x.reason
    assert (p / "w").exists()


def test_memory_store_has_no_ages(mem_url):
    url = mem_url()
    tensorckpt.save(_state(), url)
    target = location.parse(url)
    staging = commit.staging_location(target, "0123456789ab")
    kv.copy_all(target, staging, skip=(commit.ROOT_KEY,))
    (x,) = tensorckpt.clean(url).leftovers
    assert not x.removed and "age is unknown" in x.reason
    (x,) = tensorckpt.clean(url, older_than=0).leftovers
    assert x.removed and not kv.exists(staging)
    assert _same(url)
    kv.delete(target, commit.ROOT_KEY)  # an object-store save interrupted before its commit
    (x,) = tensorckpt.clean(url, older_than=0).leftovers
    assert x.path == url and x.removed and not kv.exists(target)
    with pytest.raises(tensorckpt.CheckpointNotFoundError):
        tensorckpt.open(url)


def test_memory_leftover_ages_from_its_saves_stamp(mem_url, monkeypatch):
    """memory:// keeps no modification times, but a save stamps its staging
    marker: a replace whose store failed at its commit and again at its abort
    leaves a leftover that clean keeps while young and removes once older."""
    from tensorckpt.storage import commit_kv

    url = mem_url()
    tensorckpt.save(_state(), url)
    real_write, real_delete_all = kv.write, kv.delete_all

    def write(loc, key, data):
        if commit.STAGING_INFIX in loc.url and key == commit.ROOT_KEY:
            raise OSError(5, "the store went away")
        return real_write(loc, key, data)

    def delete_all(loc):
        if commit.STAGING_INFIX in loc.url:
            raise OSError(5, "the store went away")
        return real_delete_all(loc)

    with monkeypatch.context() as m:
        m.setattr(kv, "write", write)
        m.setattr(kv, "delete_all", delete_all)
        with pytest.raises(tensorckpt.TensorckptError, match="went away"):
            tensorckpt.save(_state(2.0), url, overwrite=True)
    (x,) = tensorckpt.clean(url, older_than=OLD).leftovers
    assert not x.removed and x.age is not None and x.age < OLD and "a save may still be writing it" in x.reason
    real = time.time
    monkeypatch.setattr(commit_kv, "time", types.SimpleNamespace(time=lambda: real() + 2 * OLD))  # time passes
    (x,) = tensorckpt.clean(url, older_than=OLD).leftovers
    assert x.removed and x.age is not None and x.age >= 2 * OLD
    assert commit.leftovers(location.parse(url)) == [] and _same(url)


def test_reader_of_committed_checkpoint_is_never_raced(tmp_path):
    """A reader loads the committed checkpoint over and over while clean
    removes large leftovers beside it: every read is bit-exact."""
    p = tmp_path / "ckpt"
    tensorckpt.save(_state(), p)
    for i in range(4):
        _leftover(tmp_path, f"{i:012x}", complete=i % 2 == 0)
    time.sleep(AGE)
    reads, bad, stop = [], [], threading.Event()

    def reader():
        while not stop.is_set():
            (reads if _same(p) else bad).append(1)

    t = threading.Thread(target=reader)
    t.start()
    try:
        while not reads:
            time.sleep(0.01)
        report = tensorckpt.clean(p, older_than=OLD)
        n = len(reads)
        while len(reads) < n + 2:  # and some reads after it
            time.sleep(0.01)
    finally:
        stop.set()
        t.join()
    assert [x.removed for x in report.leftovers] == [True] * 4
    assert bad == [] and len(reads) >= 3
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ckpt"]


def test_save_in_progress_is_not_cut_short(tmp_path, monkeypatch):
    """clean runs while a save has written its staging directory and waits to
    commit: the staging directory stays, and the save commits intact."""
    p = tmp_path / "ckpt"
    tensorckpt.save(_state(), p)
    finish, reached, release = commit.finish, threading.Event(), threading.Event()

    def paused_finish(c, root_json):
        reached.set()
        assert release.wait(30)
        finish(c, root_json)

    monkeypatch.setattr(commit, "finish", paused_finish)
    errors = []
    t = threading.Thread(target=lambda: _run(errors, lambda: tensorckpt.save(_state(2.0), p, overwrite=True)))
    t.start()
    try:
        assert reached.wait(30)
        time.sleep(AGE)
        for report in (tensorckpt.clean(p), tensorckpt.clean(p, older_than=60)):
            (x,) = report.leftovers
            assert not x.removed and "a save may still be writing it" in x.reason
    finally:
        release.set()
        t.join()
    assert errors == [] and _same(p, 2.0)
    (x,) = tensorckpt.clean(p, older_than=0).leftovers  # only the version the replace kept for its readers
    assert x.removed and x.complete and ".tensorckpt-replaced-" in x.path
    assert tensorckpt.clean(p, older_than=0).leftovers == []


def _run(errors: list, fn) -> None:
    try:
        fn()
    except BaseException as e:  # reported by the test's thread
        errors.append(e)


def test_invalid_grace_period(tmp_path):
    with pytest.raises(ValueError, match="older_than"):
        tensorckpt.clean(tmp_path / "ckpt", older_than=-1)
