"""Readers running while another process replaces the checkpoint they read
(issue 12 item 3, spec 10.7): every read sees one whole version, or raises an
error it may retry (CheckpointChangedError; between the renames of a
fallback replace, none or an incomplete one); never a mix of two versions,
never a false corruption report.

Each reader kind (``load``, ``Checkpoint.read`` of every key,
``to_state_dict``, ``verify``; ``CheckpointManager.restore`` and ``load`` of
the newest step path while a manager overwrites its newest step and retires
old ones) runs in its own process (tests/replace_worker.py) against a writer
process saving versions 1, 2, ... over the path, each tensor filled with its
version number. Bounded: each reader stops after its quota of reads or its
time limit; the writer stops after its time limit. The test prints the counts.

TENSORCKPT_REPLACE_READS scales the quotas (default 1: 1,000 reads (and 100 restores) in the
replace test, ~15-25 s on a busy 2-core machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import tensorckpt

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import replace_worker

SCALE = float(os.environ.get("TENSORCKPT_REPLACE_READS", "1"))
WORKER = os.path.join(_TESTS, "replace_worker.py")
OPTS = {"shard_bytes": 16 << 10, "inner_chunk_bytes": 4 << 10}


def _env() -> dict:
    env = dict(os.environ)
    root = os.path.dirname(_TESTS)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(writer: list[str], readers: dict[str, int], path: str, seconds: float) -> dict[str, dict]:
    env = _env()
    w = subprocess.Popen([sys.executable, WORKER, *writer], env=env)
    procs = {}
    try:
        time.sleep(0.3)
        procs = {
            kind: subprocess.Popen([sys.executable, WORKER, "read", kind, path, str(n), str(seconds)],
                                   stdout=subprocess.PIPE, env=env, text=True)
            for kind, n in readers.items()
        }
        out = {}
        for kind, p in procs.items():
            stdout, _ = p.communicate(timeout=seconds + 60)
            assert p.returncode == 0, f"reader {kind} failed"
            out[kind] = json.loads(stdout.strip().splitlines()[-1])
        return out
    finally:
        for p in [*procs.values(), w]:
            if p.poll() is None:
                p.kill()
                p.wait()


def _check(counts: dict[str, dict], least: int) -> None:
    print()
    for kind, c in counts.items():
        print(f"  {kind:14s} reads {c['reads']:5d}  whole {c['whole']:5d}  mixed {c['mixed']}  "
              f"retry {dict(c['retry'])}  other {c.get('n_other', 0)}")
    total = sum(c["reads"] for c in counts.values())
    assert sum(c["mixed"] for c in counts.values()) == 0, counts
    assert all(not c["other"] for c in counts.values()), {k: c["other"] for k, c in counts.items()}
    assert all(c["whole"] > 0 for c in counts.values()), counts  # each kind read something whole
    assert total >= least, f"only {total} reads in the time limit: {counts}"


def _fast_dir(tmp_path) -> str:
    """tmpfs where there is one (replaces are fastest there, so readers overlap
    them most: 951 of 988 loads mixed before the fix), else the test's directory."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        import tempfile

        return tempfile.mkdtemp(prefix="tensorckpt-replace-", dir=shm)
    return str(tmp_path)


def test_readers_see_one_version_during_replaces(tmp_path):
    base = _fast_dir(tmp_path)
    try:
        path = os.path.join(base, "ckpt")
        tensorckpt.save(replace_worker.state(0), path, **OPTS)
        quota = {"load": 350, "read": 250, "to_state_dict": 200, "verify": 200}
        quota = {k: max(1, int(n * SCALE)) for k, n in quota.items()}
        seconds = 40 * max(1.0, SCALE)
        counts = _run(["write", path, str(seconds)], quota, path, seconds)
        _check(counts, least=min(1000, int(1000 * SCALE)))
        final = tensorckpt.open(path).to_state_dict()
        assert len(replace_worker.versions(final)) == 1 and final["v"] > 10  # the writer replaced it many times
    finally:
        if base != str(tmp_path):
            import shutil

            shutil.rmtree(base, ignore_errors=True)


def test_restore_during_overwrite_and_retention(tmp_path):
    root = str(tmp_path / "run")
    m = tensorckpt.CheckpointManager(root, keep_last=2)
    m.save(0, replace_worker.state(0), **OPTS)
    quota = {"restore": max(1, int(100 * SCALE))}
    seconds = 25 * max(1.0, SCALE)
    counts = _run(["manager", root, str(seconds)], quota, root, seconds)
    _check(counts, least=min(50, int(100 * SCALE)))
    assert tensorckpt.CheckpointManager(root).latest() > 3


def test_memory_store_readers_see_one_version():
    """memory:// (an object store: no rename, 10.3): a thread replaces the
    checkpoint while this one loads and reads it; the root is compared after
    the reads, so a read that overlapped a replace raises
    CheckpointChangedError instead of returning a mix."""
    import threading

    path = f"memory://replace-{os.getpid()}/ckpt"
    tensorckpt.save(replace_worker.state(0), path, **OPTS)
    stop = threading.Event()

    def writer() -> None:
        v = 1
        while not stop.is_set():
            tensorckpt.save(replace_worker.state(v), path, overwrite=True, **OPTS)
            v += 1

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    counts = {"reads": 0, "whole": 0, "mixed": 0, "retry": {}, "other": []}
    end = time.monotonic() + 8
    try:
        while time.monotonic() < end and counts["reads"] < int(300 * SCALE):
            counts["reads"] += 1
            kind = ("load", "read", "to_state_dict")[counts["reads"] % 3]
            try:
                seen = replace_worker.read_once(kind, path)
            except replace_worker.RETRYABLE as e:
                counts["retry"][type(e).__name__] = counts["retry"].get(type(e).__name__, 0) + 1
                continue
            counts["whole" if len(seen) == 1 else "mixed"] += 1
    finally:
        stop.set()
        t.join(timeout=60)
    _check({"memory": counts}, least=30)
