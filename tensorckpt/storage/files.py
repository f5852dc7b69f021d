"""One stored object written to a local file and made durable, one fsync
of a path, and one object opened for reading without following a link
below the checkpoint: the file I/O of :class:`.direct.LocalObjects` (the
in-process writer and reader) and what the async save's helper process does
(:mod:`.offload_helper`, which imports nothing heavier than this and
:mod:`.codec`)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW  # never through a planted link
ALIGN = 4096  # O_DIRECT's alignment of memory, length and file offset (4 KiB serves 512-byte devices too)
DIRECT = getattr(os, "O_DIRECT", 0)
DIRECT_ENV = "TENSORCKPT_DIRECT_IO"  # "0": every write through the page cache


def direct_io() -> bool:
    """Whether large objects are written with ``O_DIRECT`` (the default where the OS has it)."""
    return bool(DIRECT) and os.environ.get(DIRECT_ENV, "1") != "0"


def aligned_buffer(n: int) -> np.ndarray:
    """``n`` bytes of page-aligned memory (anonymous ``mmap``) as a uint8 array."""
    return np.frombuffer(mmap.mmap(-1, n), np.uint8)


def write_durable(path: str, pieces: Iterable[memoryview], direct: bool = False, size: int = 0) -> None:
    """Write ``pieces`` in turn as the file ``path`` (its directory exists),
    fsynced before returning (its directory entry is the caller's to sync).

    ``direct``: pieces that start the file back to back, each page-aligned in
    memory and a multiple of :data:`ALIGN` long, bypass the page cache
    (``O_DIRECT``, set on the descriptor for them and cleared at the first
    piece that is not, which with :func:`.codec.encode`'s ``align`` is only
    the object's end). Through the page cache a 1 GiB save spent 0.4-1.4 s
    of kernel CPU (torch.save and DCP up to 2.6-3.2 s), with O_DIRECT
    0.2-0.4 s, on this project's 2-core VM (benchmarks/bench_write_path.py):
    CPU a training loop beside a background save no longer loses. A file
    system that refuses O_DIRECT (EINVAL) gets the piece through the page
    cache.

    ``size``: the file's final size, reserved before the first O_DIRECT
    write (``fallocate``, keeping the size, where the file system has it), so
    the blocks of files written at once on several threads stay contiguous
    (O_DIRECT allocates as each piece lands: 4-6 extents per 16 MiB object
    on ext4 without, 1 with)."""
    fd = os.open(path, FLAGS, 0o644)
    on = False  # O_DIRECT set on fd
    try:
        for piece in pieces:
            while piece:
                direct = direct and _aligned(piece)  # once through the page cache, always (the offset may not align)
                if direct != on:
                    if direct and size > ALIGN:  # only the first piece can go direct: nothing is written yet
                        _reserve(fd, size)
                    on = _set_direct(fd, direct)
                    direct = on  # refused: the page cache from here on
                try:
                    piece = piece[os.write(fd, piece):]
                except OSError as e:
                    if not on or e.errno != errno.EINVAL:
                        raise
                    on = direct = _set_direct(fd, False)  # O_DIRECT refused at the write: the page cache
        os.fsync(fd)
    finally:
        os.close(fd)


def _reserve(fd: int, size: int) -> None:
    """Allocate ``size`` bytes for ``fd`` without changing its size; a file
    system without ``fallocate`` is left as it is (never glibc's emulation,
    which writes zeros)."""
    if _fallocate is not None and _fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, size):
        e = ctypes.get_errno()
        if e not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise OSError(e, os.strerror(e))


def _libc_fallocate() -> Any:
    try:
        f = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return f


FALLOC_FL_KEEP_SIZE = 1
_fallocate = _libc_fallocate() if sys.platform.startswith("linux") else None


def _aligned(piece: memoryview) -> bool:
    return len(piece) % ALIGN == 0 and np.frombuffer(piece, np.uint8).ctypes.data % ALIGN == 0


def _set_direct(fd: int, on: bool) -> bool:
    """Set or clear O_DIRECT on ``fd``; whether it is set after (False: the file system refused it)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | DIRECT if on else flags & ~DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL or not on:
            raise
        return False
    return on


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
