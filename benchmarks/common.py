"""Helpers the benchmark scripts share (run them from the repository root:
``python benchmarks/NAME.py``, which puts this folder on ``sys.path``)."""

from __future__ import annotations

import os

import torch


def drop_caches() -> str | None:
    """Drop the page cache (needs root); None on success, else why not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def fsync_path(path: str) -> None:
    """fsync a file or directory by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(state, path) -> None:
    """torch.save into ``path/ckpt.pt``, durable: fsync of the file and of
    the new directory entry."""
    os.makedirs(path)
    with open(os.path.join(path, "ckpt.pt"), "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(path)
