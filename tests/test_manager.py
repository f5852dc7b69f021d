"""CheckpointManager (spec/manager.md): step directories, latest/restore,
retention (keep_last, keep_every, the readers' grace, never the newest),
leftovers and recovery, async saves, readers running while it saves and
retires, the ``tensorckpt list`` command, and a distributed job."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time

import pytest
import torch

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import dist

import tensorckpt
from tensorckpt import manager as manager_module
from tensorckpt.cli import main as cli_main
from tensorckpt.manager import parse_step_name, step_name
from tensorckpt.storage import commit, kv, location

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")


def _state(step: int, n: int = 32) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(n, n, generator=g), "b": torch.arange(5) * step}, "step": step}


def _target(n: int = 32) -> dict:
    return {"model": {"w": torch.zeros(n, n), "b": torch.zeros(5, dtype=torch.int64)}, "step": -1}


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["model"]["w"], b["model"]["w"]) and torch.equal(a["model"]["b"], b["model"]["b"]) \
        and a["step"] == b["step"]


@pytest.fixture(params=["file", "memory"])
def root(request, tmp_path, mem_url):
    return str(tmp_path / "run") if request.param == "file" else mem_url("run")


def _steps(mgr) -> list[int]:
    return [s.step for s in mgr.steps() if s.committed]


# ---------------------------------------------------------------- naming


def test_step_names():
    assert step_name(0) == "step-00000000" and step_name(100) == "step-00000100"
    assert step_name(123456789) == "step-123456789"
    assert parse_step_name("step-00000100") == 100 and parse_step_name("step-123456789") == 123456789
    for name in ("step-100", "step-0000100", "step-000000100", "step-+0000100", "Step-00000100", "step-00000100x",
                 "step-0000010٠", ".step-00000100", "step-"):
        assert parse_step_name(name) is None, name
    for bad in (-1, 1.0, True, "3", None):
        with pytest.raises(ValueError):
            step_name(bad)


def test_invalid_options(tmp_path):
    for kw in ({"keep_last": 0}, {"keep_every": -2}, {"keep_last": True}, {"reader_grace": -1}, {"grace": "1"}):
        with pytest.raises(ValueError):
            tensorckpt.CheckpointManager(tmp_path, **kw)


# ---------------------------------------------------------------- basics


def test_save_latest_restore_steps(root):
    mgr = tensorckpt.CheckpointManager(root)
    assert mgr.latest() is None and mgr.steps() == [] and mgr.restore(_target()) is None
    for step in (10, 20, 30):
        mgr.save(step, _state(step))
    assert mgr.latest() == 30
    t = _target()
    assert mgr.restore(t) == 30 and _same(t, _state(30))
    assert mgr.restore(t, step=10) == 10 and _same(t, _state(10))
    infos = mgr.steps()
    assert [(s.step, s.status, s.committed) for s in infos] == [(10, "committed", True), (20, "committed", True),
                                                                 (30, "committed", True)]
    assert infos[0].path == mgr.step_path(10) and infos[0].path.endswith("/step-00000010")
    assert all(s.bytes > 32 * 32 * 4 for s in infos) and mgr.list() == infos
    assert torch.equal(tensorckpt.open(mgr.step_path(20)).read("model/w"), _state(20)["model"]["w"])
    with pytest.raises(tensorckpt.CheckpointNotFoundError):
        mgr.restore(_target(), step=15)


def test_size_is_the_stored_bytes(tmp_path):
    mgr = tensorckpt.CheckpointManager(tmp_path)
    mgr.save(1, _state(1))
    files = [p for p in (tmp_path / "step-00000001").rglob("*") if p.is_file()]
    assert mgr.steps()[0].bytes == sum(p.stat().st_size for p in files)


def test_steps_must_not_go_back(root):
    mgr = tensorckpt.CheckpointManager(root)
    mgr.save(5, _state(5))
    with pytest.raises(tensorckpt.TensorckptError, match="older than"):
        mgr.save(4, _state(4))
    with pytest.raises(tensorckpt.CheckpointExistsError, match="overwrite=True"):
        mgr.save(5, _state(6))
    mgr.save(5, _state(6), overwrite=True)  # replacing the newest step is allowed
    t = _target()
    assert mgr.restore(t) == 5 and _same(t, _state(6))
    other = tensorckpt.CheckpointManager(root)  # a new manager (a restarted job) sees the same rule
    with pytest.raises(tensorckpt.TensorckptError, match="older than the newest committed step 5"):
        other.save(3, _state(3))
    other.delete(5)
    other.save(3, _state(3))  # after deleting the newer step, going back is possible
    assert other.latest() == 3


def test_other_entries_are_ignored(tmp_path):
    mgr = tensorckpt.CheckpointManager(tmp_path, keep_last=1, reader_grace=0)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "step-7").mkdir()  # not the canonical name: not a step
    tensorckpt.save(_state(1), tmp_path / "best")
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    assert _steps(mgr) == [2]
    assert sorted(os.listdir(tmp_path)) == ["best", "notes.txt", "step-00000002", "step-7"]


# ---------------------------------------------------------------- retention


def test_keep_last_and_keep_every(root):
    mgr = tensorckpt.CheckpointManager(root, keep_last=2, keep_every=5, reader_grace=0)
    for step in range(1, 13):
        mgr.save(step, _state(step))
    assert _steps(mgr) == [5, 10, 11, 12]
    for step in (5, 10, 11, 12):
        t = _target()
        assert mgr.restore(t, step=step) == step and _same(t, _state(step))
    if root.startswith("memory://"):
        assert not [k for k in kv.list_keys(location.parse(root)) if k.startswith(".")]
    else:
        assert sorted(os.listdir(root)) == [step_name(s) for s in (5, 10, 11, 12)]


def test_no_policy_keeps_everything(root):
    mgr = tensorckpt.CheckpointManager(root, reader_grace=0)
    for step in range(4):
        mgr.save(step, _state(step))
    assert _steps(mgr) == [0, 1, 2, 3]


def test_readers_grace_delays_retirement(tmp_path):
    mgr = tensorckpt.CheckpointManager(tmp_path, keep_last=1, reader_grace=0.6)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    assert _steps(mgr) == [1, 2]  # step 1 was the newest a moment ago: a reader may be opening it
    time.sleep(0.7)
    assert mgr.prune() == [1]
    assert _steps(mgr) == [2]


def test_readers_grace_in_memory_uses_the_managers_clock(mem_url):
    mgr = tensorckpt.CheckpointManager(mem_url("run"), keep_last=1, reader_grace=0.4)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    assert _steps(mgr) == [1, 2]
    time.sleep(0.5)
    mgr.prune()
    assert _steps(mgr) == [2]


def test_async_save_applies_retention_before_the_handle_completes(root):
    mgr = tensorckpt.CheckpointManager(root, keep_last=2, reader_grace=0)
    seen = []
    for step in range(1, 6):
        state = _state(step)
        h = mgr.async_save(step, state, on_durable=lambda h: seen.append(_steps(mgr)))
        assert isinstance(h, tensorckpt.SaveHandle)
        state["model"]["w"].zero_()  # the training loop goes on
    h.wait()
    assert _steps(mgr) == [4, 5] and seen[-1] == [4, 5]  # on_durable runs after the retention
    t = _target()
    assert mgr.restore(t) == 5 and _same(t, _state(5))


def test_a_failed_save_changes_nothing(tmp_path):
    mgr = tensorckpt.CheckpointManager(tmp_path, keep_last=1, reader_grace=0)
    mgr.save(5, _state(5))
    with pytest.raises(tensorckpt.UnsupportedValueError):
        mgr.save(6, {"bad": object()})
    (tmp_path / step_name(6)).mkdir()  # a local directory not made by a save: the save fails in the background
    h = mgr.async_save(6, _state(6))
    with pytest.raises(tensorckpt.CheckpointExistsError):
        h.wait()
    with pytest.raises(tensorckpt.CheckpointExistsError):
        mgr.wait()
    assert mgr.latest() == 5
    assert [(s.step, s.status) for s in mgr.steps()] == [(5, "committed"), (6, "incomplete")]
    mgr.prune()
    assert (tmp_path / step_name(6)).is_dir()  # spec 10.5 rule 1: not made by a save, left alone
    t = _target()
    assert mgr.restore(t) == 5 and _same(t, _state(5))


def test_newest_is_never_retired_and_saves_in_flight_are_left_alone(tmp_path):
    mgr = tensorckpt.CheckpointManager(tmp_path, keep_last=1, reader_grace=0, grace=0)
    mgr.save(1, _state(1))
    release = threading.Event()
    h = mgr.async_save(2, _state(2), on_durable=lambda _: release.wait(30))
    time.sleep(0.2)  # step 2 is committed but its handle is not done yet; its retention waits
    assert mgr._busy() == {2}
    release.set()
    h.wait()
    assert _steps(mgr) == [2]


def test_leftovers_follow_the_grace_period(tmp_path):
    mgr = tensorckpt.CheckpointManager(tmp_path, keep_last=2, reader_grace=0, grace=0.5)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    # the data of a save of step 3 that was interrupted (no root zarr.json), and a young one of step 4
    old = tmp_path / ".step-00000003.tensorckpt-staging-aaaaaaaaaaaa"
    shutil.copytree(tmp_path / "step-00000002", old)
    (old / "zarr.json").unlink()
    time.sleep(0.6)
    young = tmp_path / ".step-00000004.tensorckpt-staging-bbbbbbbbbbbb"
    shutil.copytree(old, young)
    assert [(s.step, s.status, len(s.leftovers)) for s in mgr.steps()] == [
        (1, "committed", 0), (2, "committed", 0), (3, "incomplete", 1), (4, "incomplete", 1)]
    assert mgr.steps()[2].bytes > 0
    with pytest.raises(tensorckpt.IncompleteCheckpointError):
        tensorckpt.open(mgr.step_path(3))
    mgr.prune()
    assert not old.exists() and young.exists()  # the young one may belong to a save in progress
    assert _steps(mgr) == [1, 2]


def test_a_complete_copy_at_a_staging_name_is_committed(tmp_path):
    """A save killed after writing its root zarr.json but before the rename
    leaves a whole checkpoint under a staging name: once older than ``grace``
    the retention moves it into place (spec 10.5 allows it) instead of
    losing it."""
    mgr = tensorckpt.CheckpointManager(tmp_path, keep_last=5, reader_grace=0, grace=0.3)
    mgr.save(1, _state(1))
    tensorckpt.save(_state(2), tmp_path / "tmp")
    os.rename(tmp_path / "tmp", tmp_path / ".step-00000002.tensorckpt-staging-cccccccccccc")
    assert mgr.latest() == 1  # readers never use a staging copy (spec 10.4)
    mgr.prune()
    assert mgr.latest() == 1  # too young: a save may be about to rename it
    time.sleep(0.4)
    mgr.prune()
    t = _target()
    assert mgr.latest() == 2 and mgr.restore(t) == 2 and _same(t, _state(2))
    assert sorted(os.listdir(tmp_path)) == ["step-00000001", "step-00000002"]


def test_a_replaced_step_version_is_kept_for_readers_then_cleaned_never_recovered(tmp_path):
    """Saving a step again keeps the version it replaced for its readers
    (spec 10.2 step 4, manager.md 1.4); retention removes it once older than
    ``grace`` and never commits it as the step, even when the step is gone."""
    mgr = tensorckpt.CheckpointManager(tmp_path, reader_grace=0, grace=0.3)
    mgr.save(1, _state(1))
    mgr.save(1, _state(2), overwrite=True)
    (kept,) = [n for n in os.listdir(tmp_path) if ".tensorckpt-replaced-" in n]
    assert kept.startswith(".step-00000001.") and _same(tensorckpt.open(tmp_path / kept).to_state_dict(), _state(1))
    assert [(s.step, s.status) for s in mgr.steps()] == [(1, "committed")]
    shutil.rmtree(tmp_path / "step-00000001")  # the step is gone: its replaced version must not come back as step 1
    time.sleep(0.4)
    mgr.prune()
    assert mgr.latest() is None and mgr.restore(_target()) is None
    assert sorted(os.listdir(tmp_path)) == []  # older than grace: cleaned


def test_a_copy_with_a_broken_root_is_not_committed(tmp_path):
    mgr = tensorckpt.CheckpointManager(tmp_path, reader_grace=0, grace=0)
    mgr.save(1, _state(1))
    copy = tmp_path / ".step-00000002.tensorckpt-staging-cccccccccccc"
    tensorckpt.save(_state(2), copy)
    root = (copy / "zarr.json").read_bytes()
    (copy / "zarr.json").write_bytes(root[: len(root) // 2])  # half written
    mgr.prune()
    assert mgr.latest() == 1 and copy.exists()


def test_the_staging_root_is_written_whole(tmp_path, monkeypatch):
    """A save killed while it writes the root zarr.json into its staging
    directory leaves no root there (it is written under another name, then
    renamed), so no half-written root passes for a complete copy."""
    real = commit.os.rename
    seen = []

    def rename(a, b, **kw):  # the root is renamed inside the staging directory (dir_fd: never through a link)
        fd = kw.get("src_dir_fd")
        data = open(os.open(a, os.O_RDONLY, dir_fd=fd), "rb").read() if fd is not None and not os.path.isdir(a) else None
        seen.append((os.path.basename(a), os.path.basename(b), data))
        return real(a, b, **kw)

    monkeypatch.setattr(commit.os, "rename", rename)
    tensorckpt.save(_state(1), tmp_path / "c")
    name, to, data = seen[0]
    assert to == "zarr.json" and name != "zarr.json" and json.loads(data)["node_type"] == "group"


def test_memory_complete_copy_is_recovered_with_grace_zero(mem_url):
    root = mem_url("run")
    mgr = tensorckpt.CheckpointManager(root, reader_grace=0, grace=0)
    mgr.save(1, _state(1))
    tensorckpt.save(_state(2), f"{root}/.step-00000002.tensorckpt-staging-dddddddddddd")
    kv.write(location.parse(f"{root}/step-00000002"), "model/w/c/0/0", b"partial copy")  # an interrupted copy
    mgr.prune()
    t = _target()
    assert mgr.restore(t) == 2 and _same(t, _state(2))
    assert not [k for k in kv.list_keys(location.parse(root)) if k.startswith(".")]


def test_interrupted_retirement_is_finished(tmp_path):
    mgr = tensorckpt.CheckpointManager(tmp_path, keep_last=1, reader_grace=0)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    shutil.copytree(tmp_path / "step-00000002", tmp_path / ".step-00000001.tensorckpt-retired-eeeeeeeeeeee")
    with pytest.raises(tensorckpt.CheckpointNotFoundError):
        tensorckpt.open(mgr.step_path(1))  # readers do not see retired steps
    mgr.prune()
    assert sorted(os.listdir(tmp_path)) == ["step-00000002"]


def test_retention_failure_is_a_warning(tmp_path, monkeypatch):
    mgr = tensorckpt.CheckpointManager(tmp_path, keep_last=1, reader_grace=0)
    mgr.save(1, _state(1))

    def broken(step):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(mgr, "_retire", broken)
    with pytest.warns(UserWarning, match="retention .* failed"):
        mgr.save(2, _state(2))
    assert _steps(mgr) == [1, 2]  # the save itself succeeded


# ---------------------------------------------------------------- readers


def _reader(mgr, stop: threading.Event, out: dict, with_restore: bool) -> None:
    while not stop.is_set():
        t = _target(64)
        try:
            if with_restore:
                step = mgr.restore(t)
            else:
                step = mgr.latest()
                if step is not None:
                    tensorckpt.load(t, mgr.step_path(step))
        except Exception as e:  # noqa: BLE001
            out["errors"].append(f"{type(e).__name__}: {e}")
            continue
        if step is None:
            continue
        out["loads"] += 1
        if not _same(t, _state(step, 64)):
            out["wrong"].append(step)


@pytest.mark.parametrize("with_restore", [False, True], ids=["latest+load", "restore"])
def test_readers_while_saving_and_retiring(tmp_path, with_restore, capsys):
    """Readers load the newest committed step again and again while the
    manager saves new steps (sync and async) and retires old ones: every load
    is bit-exact, none fails. With plain latest() + load() the readers rely
    on the readers' grace (spec/manager.md, R3); restore() also retries."""
    grace = 1.0 if not with_restore else 0.0
    mgr = tensorckpt.CheckpointManager(tmp_path, keep_last=1, reader_grace=grace)
    mgr.save(0, _state(0, 64))
    stop, out = threading.Event(), {"loads": 0, "errors": [], "wrong": []}
    readers = [threading.Thread(target=_reader, args=(mgr, stop, out, with_restore)) for _ in range(2)]
    for r in readers:
        r.start()
    step, t0 = 0, time.monotonic()
    try:
        while time.monotonic() - t0 < 2.5:
            step += 1
            if step % 2:
                mgr.save(step, _state(step, 64))
            else:
                mgr.async_save(step, _state(step, 64))
        mgr.wait()
        time.sleep(0.2)
    finally:
        stop.set()
        for r in readers:
            r.join(60)
    retired = step + 1 - len(_steps(mgr))
    with capsys.disabled():
        print(f"\nreaders ({'restore' if with_restore else 'latest + load'}): {out['loads']} loads during {step} saves, "
              f"{retired} steps retired, {len(out['errors'])} errors")
    assert not out["errors"], out["errors"][:5]
    assert not out["wrong"]
    assert out["loads"] >= 10 and retired >= 3


def test_restore_retries_when_the_newest_step_is_retired_under_it(tmp_path, monkeypatch):
    mgr = tensorckpt.CheckpointManager(tmp_path, keep_last=1, reader_grace=0)
    mgr.save(1, _state(1))
    real = manager_module._load
    calls = []

    def racing(state, path, **kw):
        calls.append(path)
        if len(calls) == 1:  # between latest() and the read, a newer step commits and step 1 is retired
            other = tensorckpt.CheckpointManager(tmp_path, keep_last=1, reader_grace=0)
            other.save(2, _state(2))
        return real(state, path, **kw)

    monkeypatch.setattr(manager_module, "_load", racing)
    t = _target()
    assert mgr.restore(t) == 2 and _same(t, _state(2))
    assert calls == [mgr.step_path(1), mgr.step_path(2)]
    # an explicit step is not retried
    calls.clear()
    monkeypatch.setattr(manager_module, "_load", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    shutil.rmtree(tmp_path / "step-00000002" / "model" / "w")
    with pytest.raises(tensorckpt.CorruptCheckpointError):
        mgr.restore(_target(), step=2)
    assert calls == [1]
    with pytest.raises(tensorckpt.CorruptCheckpointError):  # still committed: a real problem, not retried
        mgr.restore(_target())
    assert calls == [1, 1]


# ---------------------------------------------------------------- cli


def test_cli_list(tmp_path, capsys):
    mgr = tensorckpt.CheckpointManager(tmp_path)
    mgr.save(100, _state(1))
    stale = tmp_path / ".step-00000200.tensorckpt-staging-ffffffffffff"
    stale.mkdir()
    (stale / "x").write_bytes(b"12345")
    assert cli_main(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["100", "committed"] and out[0].rstrip().endswith("step-00000100")
    assert out[1].split()[:4] == ["200", "incomplete", "5", "B"] and "1 leftover" in out[1]
    assert cli_main(["list", "--json", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(d["step"], d["status"]) for d in doc] == [(100, "committed"), (200, "incomplete")]
    assert doc[1]["bytes"] == 5 and doc[1]["leftovers"] == [str(stale)]
    mgr.save(100, _state(2), overwrite=True)  # its replaced version is listed as such, not as an interrupted save
    assert cli_main(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "1 replaced version(s) kept for readers" in out[0] and "interrupted" not in out[0]


# ---------------------------------------------------------------- distributed


def _dist_worker(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    mgr = tensorckpt.CheckpointManager(root, keep_last=2, keep_every=10, reader_grace=0)
    out = {"latest_before": mgr.latest(), "restore_before": mgr.restore({"w": torch.zeros(8, 4)})}

    def full(step):
        return torch.arange(32, dtype=torch.float32).reshape(8, 4) + step

    for step in (5, 10, 15, 20):
        state = {"w": distribute_tensor(full(step), mesh, [Shard(0)]), "step": step}
        if step % 10:
            mgr.save(step, state)
        else:
            h = mgr.async_save(step, state)
            state["w"].to_local().fill_(-1)
            h.wait()
    out["latest"] = mgr.latest()
    target = {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(1)]), "step": 0}  # another layout
    out["restored"] = mgr.restore(target)
    out["w"] = target["w"].full_tensor().tolist()
    out["step"] = target["step"]
    try:
        mgr.save(3, {"w": distribute_tensor(full(3), mesh, [Shard(0)]), "step": 3})
    except tensorckpt.TensorckptError as e:
        out["back"] = type(e).__name__, "older than" in str(e)
    out["steps"] = [s.step for s in mgr.steps()]
    return out


def test_distributed_manager(tmp_path):
    res = dist.run(2, _dist_worker, str(tmp_path))
    for r in res:
        assert r["latest_before"] is None and r["restore_before"] is None
        assert r["latest"] == 20 and r["restored"] == 20 and r["step"] == 20
        assert r["w"] == (torch.arange(32, dtype=torch.float32).reshape(8, 4) + 20).tolist()
        assert r["back"] == ("TensorckptError", True)  # every rank raises the same error
        assert r["steps"] == [10, 15, 20]
    assert sorted(os.listdir(tmp_path)) == ["step-00000010", "step-00000015", "step-00000020"]
    assert commit.leftovers(location.parse(str(tmp_path / "step-00000020"))) == []
