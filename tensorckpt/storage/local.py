"""The local file system backend (``file`` locations; see :mod:`.backend`).

Small objects go through TensorStore's ``file`` kvstore (:mod:`.kv`) or are
read here without following links (:mod:`.pinned`); chunks are encoded and
decoded by :mod:`.direct` (same bytes as TensorStore, less CPU) where the
host allows it; a save commits by atomic rename (:mod:`.commit_local`).
Everything below a checkpoint is a plain file or directory: a link or a
special file is reported (size None), never followed.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from collections.abc import Collection, Iterator

from . import direct, kv, pinned
from .commit_local import AtomicRenameCommit
from .location import Location


class LocalFileSystem:
    """A POSIX file system: directories, atomic renames, modification times."""

    supports_rename = True
    timeout = None
    records_times = True
    kvstore = True
    shared = True
    commit = AtomicRenameCommit()

    @property
    def fast_chunks(self) -> bool:
        return direct.available(True)

    fast_reads = fast_chunks

    def read(self, loc: Location, key: str, limit: int, where: str) -> tuple[object, bytes | None]:
        try:
            return None, pinned.read_local(loc.path, key, limit, where)
        except (FileNotFoundError, NotADirectoryError):
            return None, None

    def read_range(self, loc: Location, key: str, start: int, length: int) -> bytes | None:
        try:
            fd = os.open(os.path.join(loc.path, key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            return os.pread(fd, length, start)
        finally:
            os.close(fd)

    def write(self, loc: Location, key: str, data: bytes) -> None:
        kv.write(loc, key, data)

    def list(self, loc: Location, limit: int | None = None) -> list[str]:
        if not os.path.isdir(loc.path):
            return []
        return kv.ts_list(loc, limit)

    def names(self, loc: Location) -> set[str]:
        try:
            return set(os.listdir(loc.path))
        except OSError:
            return set()

    def exists(self, loc: Location) -> bool:
        return os.path.lexists(loc.path)

    def sizes(self, loc: Location, prefix: str) -> Iterator[tuple[str, int | None]]:
        top = os.path.join(loc.path, prefix)
        for folder, _, files in os.walk(top):
            for f in files:
                try:
                    st = os.lstat(os.path.join(folder, f))
                except FileNotFoundError:
                    continue  # deleted since it was listed (the checkpoint is being replaced)
                size = st.st_size if stat.S_ISREG(st.st_mode) else None
                yield os.path.relpath(os.path.join(folder, f), top).replace(os.sep, "/"), size

    def age(self, loc: Location) -> float | None:
        """The later of mtime and ctime of anything under ``loc`` (modified, created, renamed)."""
        newest = 0.0
        for folder, dirs, files in os.walk(loc.path):
            for name in [".", *dirs, *files]:
                try:
                    st = os.lstat(os.path.join(folder, name))
                except FileNotFoundError:
                    continue
                newest = max(newest, st.st_mtime, st.st_ctime)
        if not newest:
            try:  # a plain file, not a directory
                st = os.lstat(loc.path)
                newest = max(st.st_mtime, st.st_ctime)
            except FileNotFoundError:
                return None
        return max(0.0, time.time() - newest)

    def committed_at(self, loc: Location) -> float | None:
        """The latest mtime / ctime of the root ``zarr.json`` and of the directory."""
        t = 0.0
        for p in (os.path.join(loc.path, "zarr.json"), loc.path):
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                return None
            t = max(t, st.st_mtime, st.st_ctime)
        return t

    def delete(self, loc: Location, key: str) -> None:
        kv.delete(loc, key)

    def delete_all(self, loc: Location) -> None:
        shutil.rmtree(loc.path, ignore_errors=True)

    def prepare(self, loc: Location) -> None:
        os.makedirs(loc.path, exist_ok=True)

    def sync(self, loc: Location, keys: Collection[str] | None = None, fsynced: Collection[str] = ()) -> None:
        if keys is None:
            kv.sync_tree(loc.path)
        else:
            kv.sync_files(loc.path, keys, fsynced)

    def chunk_writer(self, loc: Location) -> direct.Writer | None:
        return direct.Writer(loc.path) if self.fast_chunks else None

    def chunk_reader(self, loc: Location, url: str, threads: int | None = None) -> direct.Pool | None:
        return direct.Pool(loc.path, url, threads=threads) if self.fast_chunks else None
