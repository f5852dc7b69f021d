"""Issue 12 ("never lose or mix data"), the commit / clean / manager side:
overwrite replaces only a checkpoint; clean and retention never follow a
link out of their root; two new saves to one path cannot both win; a commit
whose staging directory vanished publishes nothing; storage errors are
TensorckptErrors naming the path; the CLI never prints a traceback or raw
control characters. Default suite, about 20 s. Tests that need mounts
(read-only, full tmpfs) or a second user run only as root."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tensorckpt
from tests import dist as launcher  # worker processes (a fork server with torch and tensorckpt imported)
from tests.forge import reseal
from tensorckpt import cli
from tensorckpt.errors import CheckpointExistsError, TensorckptError
from tensorckpt.storage import commit, commit_local, location

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")

ROOT = os.geteuid() == 0
as_root = pytest.mark.skipif(not ROOT, reason="mounts / changing the user need root")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(k: float = 1.0) -> dict:
    return {"w": torch.arange(64, dtype=torch.float32) * k, "step": int(k)}


def _loads(path, k: float) -> bool:
    out = tensorckpt.load({"w": torch.empty(64), "step": 0}, path)
    return torch.equal(out["w"], torch.arange(64, dtype=torch.float32) * k) and out["step"] == int(k)


def _tree(path) -> dict:
    """Every name under ``path`` and its bytes (files) or link target."""
    out = {}
    for folder, dirs, files in os.walk(path):
        for n in dirs + files:
            p = os.path.join(folder, n)
            out[os.path.relpath(p, path)] = os.readlink(p) if os.path.islink(p) else (
                Path(p).read_bytes() if os.path.isfile(p) else None)
    return out


# ---------------------------------------------------------------- item 1


@pytest.mark.parametrize("kind", ["manager-root", "home", "file", "link", "zarr-store"])
def test_overwrite_replaces_only_a_checkpoint(tmp_path, kind):
    p = tmp_path / "target"
    if kind == "manager-root":
        tensorckpt.CheckpointManager(p).save(1, _state())
    elif kind == "home":
        p.mkdir()
        (p / ".bashrc").write_text("export A=1\n")
        (p / "notes").mkdir()
        (p / "notes" / "todo.txt").write_text("x")
    elif kind == "file":
        p.write_text("data")
    elif kind == "link":
        tensorckpt.save(_state(), tmp_path / "real")
        p.symlink_to(tmp_path / "real")
    else:
        p.mkdir()
        (p / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    before = _tree(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(CheckpointExistsError) as e:
            tensorckpt.save(_state(2), p, overwrite=overwrite)
        msg = str(e.value)
        assert str(p) in msg and "not a tensorckpt checkpoint" in msg and "pass overwrite=True" not in msg
        with pytest.raises(CheckpointExistsError):
            tensorckpt.async_save(_state(2), p, overwrite=overwrite).wait(30)
    assert _tree(tmp_path) == before  # nothing deleted, nothing left behind


def test_overwrite_still_replaces_checkpoints(tmp_path, mem_url):
    p = tmp_path / "c"
    tensorckpt.save(_state(1), p)
    with pytest.raises(CheckpointExistsError, match="pass overwrite=True"):
        tensorckpt.save(_state(2), p)
    tensorckpt.save(_state(2), p, overwrite=True)
    assert _loads(p, 2)
    (tmp_path / "empty").mkdir()  # an empty directory holds nothing to lose
    tensorckpt.save(_state(3), tmp_path / "empty", overwrite=True)
    assert _loads(tmp_path / "empty", 3)
    m = mem_url()
    tensorckpt.save(_state(1), m)
    tensorckpt.save(_state(2), m, overwrite=True)
    assert _loads(m, 2)
    root = mem_url("run")  # a memory:// manager root is not a checkpoint either
    tensorckpt.CheckpointManager(root).save(1, _state())
    with pytest.raises(CheckpointExistsError, match="not a tensorckpt checkpoint"):
        tensorckpt.save(_state(), root, overwrite=True)
    assert tensorckpt.CheckpointManager(root).latest() == 1


# ---------------------------------------------------------------- item 2

DECOYS = 3  # planted links per pass


def _plant(root, outside) -> list:
    """Links under ``root`` named like staging, retired and step locations,
    each to a committed checkpoint outside it."""
    links = []
    for i in range(DECOYS):
        for name in (f".step-0000000{i}.tensorckpt-staging-0123456789a{i}",
                     f".step-0000000{i}.tensorckpt-retired-0123456789a{i}", f"step-0000009{i}",
                     f".ckpt.tensorckpt-staging-0123456789a{i}", f".ckpt.tensorckpt-staging-0123456789a{i}-old"):
            (root / name).symlink_to(outside)
            links.append(root / name)
    return links


def test_clean_and_retention_never_follow_links(tmp_path):
    outside = tmp_path / "elsewhere" / "ckpt"
    tensorckpt.save(_state(7), outside)
    guard = _tree(outside)
    root = tmp_path / "run"
    mgr = tensorckpt.CheckpointManager(root, keep_last=1, reader_grace=0, grace=0)
    mgr.save(0, _state(0))
    tensorckpt.save(_state(5), root / "ckpt")
    links = _plant(root, outside)
    passes = 0
    for step in range(1, 6):
        mgr.save(step, _state(step))  # retention runs after every save
        mgr.prune()
        for target in (root / "ckpt", root / "step-00000001"):
            report = tensorckpt.clean(target, older_than=0)
            for x in report.leftovers:
                if os.path.islink(x.path):
                    assert not x.removed and "symbolic link" in x.reason
        passes += 1
        assert _tree(outside) == guard, f"pass {passes}: data outside the root was touched"
        assert all(p.is_symlink() for p in links), "a planted link was deleted or renamed"
        assert mgr.latest() == step  # never the linked checkpoint (it holds step 7)
    assert [s.step for s in mgr.steps()] == [5] and _loads(root / "ckpt", 5)
    print(f"deletions outside the root: 0 of {passes * len(links)} planted link visits")


def test_a_staging_named_link_is_not_adopted(tmp_path):
    """A link named like a complete copy of step 3 is not recovered as step 3,
    and the run's own save of step 3 is not refused because of it."""
    outside = tmp_path / "other-run" / "ckpt"
    tensorckpt.save(_state(9), outside)
    root = tmp_path / "run"
    mgr = tensorckpt.CheckpointManager(root, reader_grace=0, grace=0)
    mgr.save(1, _state(1))
    (root / ".step-00000003.tensorckpt-staging-aaaaaaaaaaaa").symlink_to(outside)
    mgr.prune()
    assert mgr.latest() == 1 and [s.step for s in mgr.steps()] == [1]
    mgr.save(3, _state(3))
    assert mgr.latest() == 3 and _loads(root / "step-00000003", 3) and _loads(outside, 9)
    with pytest.raises(CheckpointExistsError, match="symbolic link"):  # a step that is a link is not ours to replace
        (root / "step-00000004").symlink_to(outside)
        mgr.save(4, _state(4))
    assert _loads(outside, 9)


# ---------------------------------------------------------------- item 4


def _racer(paths: list, k: int, barrier, out) -> None:
    """Save to each of ``paths`` in turn; both racers commit each one at once."""
    inner = commit_local._finish_local

    def finish(c, root_json):
        barrier.wait(60)  # both saves have written everything: now both commit
        inner(c, root_json)

    commit_local._finish_local = finish
    for path in paths:
        try:
            tensorckpt.save(_state(k), path)
            out.put((path, k, "saved"))
        except Exception as e:  # noqa: BLE001 - reported to the parent
            out.put((path, k, f"{type(e).__name__}: {e}"))


ROUNDS = int(os.environ.get("TENSORCKPT_RACE_ROUNDS", "4"))  # more: TENSORCKPT_RACE_ROUNDS=50


def test_two_new_saves_cannot_both_win(tmp_path):
    ctx = launcher.context()
    paths = [str(tmp_path / f"c{r}") for r in range(ROUNDS)]
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [launcher.process(ctx, _racer, (paths, k, barrier, out)) for k in (1, 2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 240
    results: dict = {}
    try:
        for _ in range(2 * ROUNDS):
            path, k, what = out.get(timeout=max(1, deadline - time.monotonic()))
            results.setdefault(path, {})[k] = what
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    both = 0
    for path in paths:
        won = [k for k, v in results[path].items() if v == "saved"]
        both += len(won) == 2
        assert len(won) == 1, f"{path}: {results[path]}"
        lost = results[path][3 - won[0]]
        assert "CheckpointExistsError" in lost and "another save committed" in lost, lost
        assert _loads(path, won[0])  # the winner's checkpoint, whole and unmixed
        assert commit.leftovers(location.parse(path)) == []  # the loser cleaned up
    print(f"concurrent new saves: both reported success in {both} of {ROUNDS} races")


# ---------------------------------------------------------------- item 5


@pytest.mark.parametrize("how", ["removed", "remade"])
def test_a_replace_whose_staging_vanished_publishes_nothing(tmp_path, monkeypatch, how):
    p = tmp_path / "c"
    tensorckpt.save(_state(1), p)
    inner = commit_local._finish_local

    def finish(c, root_json):  # `tensorckpt clean --older-than 0` runs after the writes, before the commit
        report = tensorckpt.clean(p, older_than=0)
        assert [x.removed for x in report.leftovers] == [True]
        if how == "remade":  # a late write re-creates the directory: a different, incomplete one
            os.mkdir(c.write_to.path)
        inner(c, root_json)

    monkeypatch.setattr(commit_local, "_finish_local", finish)
    with pytest.raises(TensorckptError, match="staging directory .* while the save ran.*old checkpoint is untouched"):
        tensorckpt.save(_state(2), p, overwrite=True)
    monkeypatch.undo()
    assert _loads(p, 1)
    assert tensorckpt.verify(p).ok


def _cleaner(path: str, stop_at: float, ready) -> None:
    from tensorckpt.clean import clean

    while time.time() < stop_at:
        with contextlib.suppress(TensorckptError):
            clean(path, older_than=0)
        ready.set()


def test_clean_racing_replaces_never_publishes_a_partial_checkpoint(tmp_path):
    """A process running ``clean --older-than 0`` in a loop while this one
    replaces the checkpoint: each replace either succeeds whole or fails and
    leaves the previous checkpoint whole (bounded: 40 saves or 20 s, stopping
    once 3 saves were cut short)."""
    p = tmp_path / "c"
    n = 1 << 18
    base = torch.arange(n, dtype=torch.float32)
    tensorckpt.save({"w": base, "step": 0}, p)
    ctx = launcher.context()
    ready = ctx.Event()
    cleaner = launcher.process(ctx, _cleaner, (str(p), time.time() + 120, ready))
    cleaner.start()
    current, outcomes = 0, {"ok": 0, "failed": 0}
    try:
        assert ready.wait(60)
        deadline = time.monotonic() + 20
        for k in range(1, 41):
            try:
                tensorckpt.save({"w": base + k, "step": k}, p, overwrite=True, shard_bytes=1 << 12)
                current = k
                outcomes["ok"] += 1
            except TensorckptError:
                outcomes["failed"] += 1
            out = tensorckpt.load({"w": torch.empty(n), "step": -1}, p)
            assert out["step"] == current and torch.equal(out["w"], base + current), f"save {k}: lost or mixed data"
            if outcomes["failed"] >= 3 or time.monotonic() > deadline:
                break
    finally:
        cleaner.kill()
        cleaner.join(10)
    print(f"replaces racing clean: {outcomes}; incomplete checkpoints published: 0 of {sum(outcomes.values())}")


# ---------------------------------------------------------------- item 11


@pytest.mark.parametrize("path, what", [
    ("a\0b", "NUL"), ("x" * 240, "at most"), ("x" * 255, "at most"), ("file://", "absolute path"),
    ("file://localhost", "absolute path"), ("file://localhost/", None),
])
def test_bad_paths_are_tensorckpt_errors(tmp_path, monkeypatch, path, what):
    monkeypatch.chdir(tmp_path)
    if what is None:  # file://localhost/ is the root directory: not a checkpoint, refused without harm
        with pytest.raises(CheckpointExistsError, match="not a tensorckpt checkpoint"):
            tensorckpt.save(_state(), path, overwrite=True)
        return
    target = path if "://" in path else str(tmp_path / path)
    calls = [lambda: tensorckpt.save(_state(), target), lambda: tensorckpt.async_save(_state(), target).wait(30)]
    if what != "at most":  # a manager root of that name is fine: its steps have short names
        calls.append(lambda: tensorckpt.CheckpointManager(target).save(1, _state()))
    for call in calls:
        with pytest.raises(TensorckptError, match=what):
            call()
    assert os.listdir(tmp_path) == []  # no current-directory checkpoint, no leftovers


def test_key_named_like_the_root_temporary_saves(tmp_path):
    state = {".zarr.json.partial": torch.ones(3), "__tensorckpt-root.partial": torch.zeros(2)}
    tensorckpt.save(state, tmp_path / "c")
    out = tensorckpt.load({k: torch.empty_like(v) for k, v in state.items()}, tmp_path / "c")
    assert all(torch.equal(out[k], v) for k, v in state.items())


@pytest.mark.parametrize("kind", ["loop", "fifo", "below-a-file"])
def test_bad_manager_roots(tmp_path, capsys, kind):
    root = tmp_path / "root"
    if kind == "loop":
        root.symlink_to(tmp_path / "root")
    elif kind == "fifo":
        os.mkfifo(root)
    else:
        (tmp_path / "file").write_text("x")
        root = tmp_path / "file" / "root"
    with pytest.raises(TensorckptError) as e:
        tensorckpt.CheckpointManager(root).save(1, _state())
    assert str(root) in str(e.value)
    assert cli.main(["list", str(root)]) == 2 and str(root) in capsys.readouterr().err
    for target in (root, root / "c"):
        assert cli.main(["clean", str(target), "--older-than", "0"]) in (0, 2)  # an answer, never a traceback
    with pytest.raises(TensorckptError):
        tensorckpt.CheckpointManager(root).prune()


@contextlib.contextmanager
def _tmpfs(path, size: str = "4m"):
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _readonly(path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)


@as_root
def test_read_only_target(tmp_path):
    with _tmpfs(tmp_path / "ro") as ro:
        tensorckpt.save(_state(1), ro / "c")
        mgr = tensorckpt.CheckpointManager(ro / "run", reader_grace=0, grace=0)
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        os.mkdir(ro / ".c.tensorckpt-staging-0123456789ab")  # a leftover clean cannot remove
        _readonly(ro)
        calls = {
            "save": lambda: tensorckpt.save(_state(2), ro / "new"),
            "replace": lambda: tensorckpt.save(_state(2), ro / "c", overwrite=True),
            "async save": lambda: tensorckpt.async_save(_state(2), ro / "new").wait(30),
            "manager save": lambda: mgr.save(3, _state(3)),
            "manager delete": lambda: mgr.delete(1),
        }
        for what, call in calls.items():
            with pytest.raises(TensorckptError, match="read-only") as e:
                call()
            assert str(ro) in str(e.value), what
        report = tensorckpt.clean(ro / "c", older_than=0)
        assert [(x.removed, "removal failed" in x.reason) for x in report.leftovers] == [(False, True)]
        assert _loads(ro / "c", 1) and mgr.latest() == 2
        assert cli.main(["clean", str(ro / "c"), "--older-than", "0"]) == 0


@as_root
def test_full_target(tmp_path):
    with _tmpfs(tmp_path / "full", size="256k") as full:
        big = {"w": torch.randn(1 << 17)}
        with pytest.raises(TensorckptError, match="full"):
            tensorckpt.save(big, full / "c")
        assert os.listdir(full) == []


@as_root
def test_permission_denied_target(tmp_path):
    d = tmp_path / "locked"
    d.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    os.seteuid(65534)  # nobody: may read d, not write it
    try:
        for call in (lambda: tensorckpt.save(_state(), d / "c"), lambda: tensorckpt.CheckpointManager(d / "r").save(1, _state())):
            with pytest.raises(TensorckptError, match="permission denied") as e:
                call()
            assert str(d) in str(e.value)
    finally:
        os.seteuid(0)
    assert os.listdir(d) == []


# ---------------------------------------------------------------- item 13


def test_leftover_of_a_kept_step_is_cleaned(tmp_path):
    root = tmp_path / "run"
    mgr = tensorckpt.CheckpointManager(root, keep_last=2, reader_grace=0, grace=0)
    mgr.save(1, _state(1))
    stale = root / ".step-00000001.tensorckpt-staging-0123456789ab"
    stale.mkdir()
    (stale / "junk").write_bytes(b"x" * 100)
    mgr.save(2, _state(2))  # step 1 is kept (keep_last=2); its leftover goes
    assert not stale.exists() and mgr.latest() == 2 and [s.step for s in mgr.steps()] == [1, 2]


def test_cli_list_of_a_checkpoint_and_a_missing_root(tmp_path, capsys):
    tensorckpt.save(_state(), tmp_path / "c")
    assert cli.main(["list", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "is a checkpoint, not a CheckpointManager root" in err and "tensorckpt inspect" in err
    assert cli.main(["list", str(tmp_path / "nothing")]) == 2 and "no such directory" in capsys.readouterr().err


def test_cli_inspect_escapes_control_characters(tmp_path, capsys):
    tensorckpt.save({"\x1b[31mred": torch.ones(2), "v": "\x07bell"}, tmp_path / "c",
                    metadata={"note": "\x1b]0;pwned\x07", "\x1b": 1})
    root = tmp_path / "c" / "zarr.json"  # a hostile writer: control characters in the root's strings
    doc = json.loads(root.read_text())
    doc["attributes"]["tensorckpt"].update(library_version="\x1b]0;title\x07", created="\x1b[2J")
    reseal(tmp_path / "c", doc)  # sealed (format 1.3): inspect shows it
    for args in (["inspect", str(tmp_path / "c")], ["list", str(tmp_path)], ["clean", str(tmp_path / "c")]):
        cli.main(args)
        out = capsys.readouterr()
        assert "\x1b" not in out.out + out.err and "\x07" not in out.out + out.err


def test_cli_inspect_into_a_closed_pipe(tmp_path):
    tensorckpt.save({f"k{i}": torch.ones(1) for i in range(300)}, tmp_path / "c")
    p = subprocess.run(f"{sys.executable} -m tensorckpt inspect {tmp_path / 'c'} | head -n 2", shell=True, check=False,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert len(p.stdout.splitlines()) == 2 and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr


# ------------------------------------------------ item 13: a gloo peer dies


def _dies_mid_save(rank: int, world: int, path: str) -> str:
    import tensorckpt.engine.save as save_module

    if rank == 1:
        def die(*_a, **_kw):
            os._exit(3)  # killed while writing: its sockets close

        save_module._write_local = die
    try:
        tensorckpt.save({"w": torch.ones(8)}, path)
        return "saved"
    except TensorckptError as e:
        return f"TensorckptError: {e}"
    except Exception as e:  # noqa: BLE001 - the bug: a raw gloo error
        return f"raw {type(e).__name__}: {e}"


def test_a_peer_dying_mid_save(tmp_path):
    ctx = launcher.context()
    queue, port = ctx.Queue(), launcher._free_port()
    path = str(tmp_path / "c")
    procs = [launcher.process(ctx, launcher._worker, (r, 2, port, _dies_mid_save, (path,), queue), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, ok, value = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert rank == 0 and ok and value.startswith("TensorckptError") and "lost its peers" in value, value
    assert not os.path.exists(path) and os.listdir(tmp_path) == []  # the survivor removed the staging directory


def test_two_new_memory_saves_cannot_both_win(mem_url, monkeypatch):
    """Object stores: the root is a conditional create (memory://: under a
    process-wide lock); two threads both find the location empty, both
    write, and both commit."""
    import threading

    path = mem_url()
    begun = threading.Barrier(2, timeout=60)
    begin = commit.begin

    def begin_both(*a, **kw):
        c = begin(*a, **kw)
        begun.wait()  # both saves checked the (empty) target before either writes
        return c

    monkeypatch.setattr(commit, "begin", begin_both)
    results: dict = {}

    def racer(k: int) -> None:
        try:
            tensorckpt.save({"w": torch.ones(4) * k}, path)
            results[k] = "saved"
        except CheckpointExistsError as e:
            results[k] = str(e)

    threads = [threading.Thread(target=racer, args=(k,), name=f"racer{k}") for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [1, 2] and list(results.values()).count("saved") == 1, results
    assert any("another save committed" in v for v in results.values())
