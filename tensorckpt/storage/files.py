"""One stored object written to a local file and made durable: the writes
of :class:`.direct.LocalObjects` (the in-process writer) and of the async
save's helper process (:mod:`.offload_helper`, which imports nothing heavier
than this and :mod:`.codec`)."""

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
