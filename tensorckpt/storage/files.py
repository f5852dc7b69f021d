"""One stored object written to a local file and made durable, and one
fsync of a path: the writes of :class:`.direct.LocalObjects` (the
in-process writer) and what the async save's helper process does
(:mod:`.offload_helper`, which imports nothing heavier than this and
:mod:`.codec`)."""

from __future__ import annotations

import os
from collections.abc import Iterable

FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW  # never through a planted link


def write_durable(path: str, pieces: Iterable[memoryview]) -> None:
    """Write ``pieces`` in turn as the file ``path`` (its directory exists),
    fsynced before returning (its directory entry is the caller's to sync)."""
    fd = os.open(path, FLAGS, 0o644)
    try:
        for piece in pieces:
            while piece:
                piece = piece[os.write(fd, piece):]
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: str, flags: int = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC) -> None:
    """fsync of a file or directory, by default opened without following a link."""
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
