"""One stored object written to a local file and made durable, one fsync
of a path, and one object opened for reading without following a link
below the checkpoint: the file I/O of :class:`.direct.LocalObjects` (the
in-process writer and reader) and what the async save's helper process does
(:mod:`.offload_helper`, which imports nothing heavier than this and
:mod:`.codec`)."""

from __future__ import annotations

import errno
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


DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO must not block the open


def open_beneath(top: int | str, rel: str) -> int:
    """A descriptor of ``rel`` under the directory ``top`` (a descriptor,
    kept open, or a path, which may itself be a link) opened for reading,
    each directory below ``top`` opened ``O_NOFOLLOW`` in turn, then the file
    (``O_NONBLOCK`` too): no link is followed below ``top``. A directory on
    the way that is a link or none raises :class:`NotADirectory`; the file's
    own open raises its ``OSError`` (ELOOP: a link)."""
    parts = rel.split("/")
    cur = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if isinstance(top, str) else top
    try:
        for i, part in enumerate(parts[:-1]):
            try:
                nxt = os.open(part, DIR_FLAGS, dir_fd=cur)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
                    raise NotADirectory("/".join(parts[:i + 1])) from None
                raise
            if cur is not top:
                os.close(cur)
            cur = nxt
        return os.open(parts[-1], READ_FLAGS, dir_fd=cur)
    finally:
        if cur is not top:
            os.close(cur)


class NotADirectory(Exception):
    """A component of a path (``args[0]``, relative) that is a link or no directory."""
