"""A reader's hold on one version of a checkpoint (spec 10.7).

A replace swaps a new directory in at the path (spec 10.2) and deletes the
old one; a reader that opened objects by path one after the other would mix
the two. A :class:`Pin` resolves the location once:

- local: it opens the checkpoint's directory and reads everything relative to
  that descriptor (``/proc/self/fd/N/...``, which TensorStore and the direct
  reader use like any path, or ``openat``), so every object comes from the
  directory that was resolved first, even after it was renamed away. Once
  that directory is deleted, reads of it fail, and :meth:`Pin.changed` tells
  the caller that the failure is a replace (retry), not corruption;
- object stores (and local systems without ``/proc``): it remembers the root
  ``zarr.json`` (bytes and storage generation) and :meth:`Pin.changed`
  compares them after the reads. The root is deleted first and written last
  by a replace (10.3), so a read that overlapped one sees it change.

Small objects are read here too, with the size caps of spec 12 and without
following links: every directory on the way is opened ``O_NOFOLLOW``.
"""

from __future__ import annotations

import errno
import os
import stat

import tensorstore as ts

from ..errors import CorruptCheckpointError
from . import kv, location
from .backend import backend_for
from .files import NotADirectory, open_beneath
from .location import Location

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOT_PLAIN = (errno.ELOOP, errno.ENOTDIR, errno.ENXIO)


class Pin:
    """The version of the checkpoint at ``loc`` that this reader reads. Raises
    ``FileNotFoundError`` / ``NotADirectoryError`` (for the caller to
    classify) when there is no directory at a local ``loc``."""

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self.fd: int | None = None
        self.identity: object = None  # local: (st_dev, st_ino) of the directory; else the root's (generation, bytes)
        self.read_loc = loc  # where objects are read from
        self.pinned = False  # whether reads cannot see another version (a directory descriptor holds it)
        self.dir_id: tuple[int, int] | None = None  # local: the directory's (st_dev, st_ino)
        self.local = backend_for(loc).supports_rename  # a file system: a directory can be held open
        if not self.local:
            return
        self.fd = os.open(loc.path, _DIR_FLAGS)
        st = os.fstat(self.fd)
        self.dir_id = self.identity = (st.st_dev, st.st_ino)
        proc = f"/proc/self/fd/{self.fd}"
        try:
            p = os.stat(proc)
            if (p.st_dev, p.st_ino) == self.identity:
                self.read_loc, self.pinned = Location("file", proc), True
        except OSError:
            pass

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - at interpreter exit
            pass

    @property
    def root(self) -> str:
        """The local path every object is read under."""
        return self.read_loc.path

    def remember_root(self, generation: object, data: bytes | None) -> None:
        if not self.local or not self.pinned:
            self.identity = (generation, data)

    def changed(self) -> bool:
        """Whether the checkpoint at the path is no longer the version this
        pin holds (replaced, deleted, or mid-replace)."""
        if self.local:
            try:
                st = os.stat(self.loc.path)
            except OSError:
                return True
            if self.pinned:
                if self.fd is None:
                    return True  # closed
                return (st.st_dev, st.st_ino) != self.identity or os.fstat(self.fd).st_nlink == 0
            try:
                data = read_local(self.loc.path, "zarr.json", 1 << 62, str(self.loc))
            except (OSError, CorruptCheckpointError):
                return True
            return ((st.st_dev, st.st_ino), data) != self.identity
        try:
            return read_remote(self.loc, "zarr.json", 1 << 62, str(self.loc)) != self.identity
        except (OSError, ValueError, CorruptCheckpointError):
            return True

    def read(self, key: str, limit: int, where: str) -> tuple[object, bytes | None]:
        """A small object (a ``zarr.json``): (its generation or None, its
        bytes or None if absent). Refused, without reading it, when larger than
        ``limit`` bytes, or, locally, when it or a directory above it is not a
        plain file or directory (a link, FIFO or device)."""
        if not self.local:  # through the backend: its errors say what to fix (S3: credentials, bucket, endpoint)
            return backend_for(self.loc).read(self.loc, key, limit, where)
        data = read_local(self.fd if self.fd is not None else self.loc.path, key, limit, where)
        if not self.pinned and key == "zarr.json" and self.fd is not None:
            st = os.fstat(self.fd)
            return (st.st_dev, st.st_ino), data
        return None, data


def read_local(top: int | str, key: str, limit: int, where: str) -> bytes | None:
    """Read ``key`` under the directory ``top`` (a descriptor or a path),
    opening every component without following links (:func:`.files.open_beneath`)."""
    try:
        fd = open_beneath(top, key)
    except FileNotFoundError:
        return None
    except NotADirectory as e:
        raise CorruptCheckpointError(
            f"{where}: {e.args[0]} is not a directory (a link or special file; a writer makes none): refused") from None
    except OSError as e:
        if e.errno in _NOT_PLAIN:
            raise CorruptCheckpointError(f"{where}: not a regular file (a link or special file; a writer makes none)") from None
        if e.errno == errno.EISDIR:
            raise CorruptCheckpointError(f"{where}: a directory, not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{where}: not a regular file (a FIFO, device or directory; a writer makes none)")
        _check_size(st.st_size, limit, where)
        data = _read_to(fd, st.st_size + 1)  # a file that grew past its size is read to its size + 1
        _check_size(len(data), limit, where)
        return data
    finally:
        os.close(fd)


def _read_to(fd: int, most: int) -> bytes:
    """At most ``most`` bytes of ``fd`` from its offset, fewer at its end."""
    parts, got = [], 0
    while got < most and (part := os.read(fd, most - got)):
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def read_remote(loc: Location, key: str, limit: int, where: str) -> tuple[object, bytes | None]:
    b = backend_for(loc)
    if not b.kvstore:  # no TensorStore driver: the backend reads it (fsspec)
        return b.read(loc, key, limit, where)
    store = kv.result(loc, ts.KvStore.open(loc.kvstore(), context=location.CONTEXT), "opening the store")
    r = kv.result(loc, store.read(key), f"reading {key}")  # memory:// holds it in memory already; the cap still refuses it
    if r.state != "value":
        return None, None
    _check_size(len(r.value), limit, where)
    return r.stamp.generation, r.value


def _check_size(size: int, limit: int, where: str) -> None:
    if size > limit:
        raise CorruptCheckpointError(
            f"{where}: {size if size <= limit + 1 else 'more than ' + str(limit)} bytes, larger than a reader "
            f"accepts for this document ({limit} bytes, spec 12): it is damaged or forged"
        )
