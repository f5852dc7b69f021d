"""Worker processes of tests/test_read_during_replace.py (run with sys.executable).

    python replace_worker.py write PATH SECONDS            save versions 1, 2, ... over PATH
    python replace_worker.py manager ROOT SECONDS          a CheckpointManager (keep_last=2): new
                                                           steps, and the newest overwritten
    python replace_worker.py read KIND PATH READS SECONDS  read in a loop; print JSON counts

Every tensor of version ``v`` is filled with ``v`` and the value ``"v"`` is
``v``: a read that returns two different numbers is a mixed read. A reader
stops after READS reads or SECONDS, whichever comes first, and prints
``{"reads": n, "whole": n, "mixed": n, "retry": {error: n}, "other": [...]}``:
``retry`` counts the errors a reader may retry (the checkpoint changed while
it was read; between the renames of a replace, none or an incomplete one).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import torch

import tensorckpt
from tensorckpt.errors import (
    CheckpointChangedError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
)

RETRYABLE = (CheckpointChangedError, CheckpointNotFoundError, IncompleteCheckpointError)
SHAPES = {f"t{i}": (64, 16) for i in range(6)} | {"big": (512, 64)}  # "big": several chunk objects


def state(v: int) -> dict:
    return {"m": {k: torch.full(s, float(v)) for k, s in SHAPES.items()}, "v": v}


def write(path: str, seconds: float) -> None:
    end, v = time.monotonic() + seconds, 1
    opts = {"shard_bytes": 16 << 10, "inner_chunk_bytes": 4 << 10}
    while time.monotonic() < end:
        tensorckpt.save(state(v), path, overwrite=True, **opts)
        v += 1


def manager(root: str, seconds: float) -> None:
    end, v = time.monotonic() + seconds, 1
    m = tensorckpt.CheckpointManager(root, keep_last=2)
    opts = {"shard_bytes": 16 << 10, "inner_chunk_bytes": 4 << 10}
    step = 1
    while time.monotonic() < end:
        # overwrite the newest step once, then move on to a new step (retention retires the oldest)
        m.save(step, state(v), overwrite=True, **opts)
        v += 1
        if v % 2:
            step += 1


def versions(sd: dict) -> set[float]:
    """The version numbers a nested state dict holds."""
    seen = {float(sd["v"])}
    for t in sd["m"].values():
        seen.update(torch.unique(t).tolist())
    return seen


def read_once(kind: str, path: str) -> set[float]:
    if kind == "load":
        s = state(0)
        tensorckpt.load(s, path)
        return versions(s)
    if kind == "read":
        c = tensorckpt.open(path)
        return versions({"v": c.read("v"), "m": {k: c.read(f"m/{k}") for k in SHAPES}})
    if kind == "to_state_dict":
        return versions(tensorckpt.open(path).to_state_dict())
    if kind == "verify":
        r = tensorckpt.verify(path)
        if not r.ok:
            raise RuntimeError(f"verify reported problems: {r.problems[:2]}")
        return {1.0}
    if kind == "restore":
        s = state(0)
        if tensorckpt.CheckpointManager(path).restore(s) is None:
            raise CheckpointNotFoundError(f"{path}: no step yet")
        return versions(s)
    raise ValueError(kind)


def read(kind: str, path: str, reads: int, seconds: float) -> None:
    end = time.monotonic() + seconds
    out = {"reads": 0, "whole": 0, "mixed": 0, "retry": collections.Counter(), "other": []}
    while out["reads"] < reads and time.monotonic() < end:
        out["reads"] += 1
        try:
            seen = read_once(kind, path)
        except RETRYABLE as e:
            out["retry"][type(e).__name__] += 1
            continue
        except Exception as e:  # noqa: BLE001 - counted and reported
            if len(out["other"]) < 5:
                out["other"].append(f"{type(e).__name__}: {str(e)[:300]}")
            out.setdefault("n_other", 0)
            out["n_other"] += 1
            continue
        out["whole" if len(seen) == 1 else "mixed"] += 1
    print(json.dumps(out))


if __name__ == "__main__":
    torch.set_num_threads(1)
    cmd = sys.argv[1]
    if cmd == "write":
        write(sys.argv[2], float(sys.argv[3]))
    elif cmd == "manager":
        manager(sys.argv[2], float(sys.argv[3]))
    else:
        read(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
    os._exit(0)
