"""The fsspec backend (see :mod:`.backend`): checkpoints on any file system
fsspec has an implementation for and TensorStore has no driver for
(``gs://`` through gcsfs, ``hdfs://``, ``abfs://``, ...), and on any fsspec
URL chosen explicitly (``fsspec+s3://bucket/x``, ``fsspec+file:///abs/x``;
:mod:`.location` parses them). The file system is
``fsspec.filesystem(PROTOCOL, **storage_options)``.

TensorStore cannot write there, so every chunk goes through tensorckpt's own
codec (:mod:`.direct` over :class:`FsspecObjects`: ``pipe_file`` for whole
objects, ``info`` for sizes, ``cat_ranges`` for the inner-chunk runs a box
needs, all of one object's runs in one call): the bytes are the same as
TensorStore writes, so a checkpoint written here reads through the S3 or
file backend and back. What the codec does not take (a partial write of a
stored chunk; entries past its buffers are past spec 12's caps and refused
at the root anyway) is refused with a clear error (``Location.kvstore``), never sent to a
TensorStore kvstore that does not exist.

Commit: root last (spec 10.3, :class:`.commit_kv.RootLastCommit`) with a
claim object, both conditional creates: atomic where the file system has an
exclusive create (``open(..., "xb")``: ``O_EXCL`` locally, ``If-None-Match:
*`` on s3fs), else a check then a write (fsspec's ``mode="create"``), which
does not exclude a second committer racing the first (spec 10.3). Objects
are durable when the file system says a write is complete (an object
store's PUT; fsspec's local file system does not fsync: a local checkpoint
that must survive a power cut belongs on the native file backend).

Listings and sizes are asked afresh (a file system's listing cache, as
s3fs keeps, is invalidated first): other processes write the same location.

Errors of the file system (``FileNotFoundError``, ``PermissionError``,
botocore's, ...) become :class:`TensorckptError` subclasses naming the URL
and the operation, never a storage option's value.
"""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import CheckpointPermissionError, CorruptCheckpointError, InvalidPathError, TensorckptError
from . import direct
from .commit_kv import RootLastCommit, stamped_age
from .location import FSSPEC_PREFIX, Location

WRITE_THREADS = 8  # small objects (zarr.json, small tensors) written at once


def file_system(loc: Location) -> tuple[Any, str]:
    """(the fsspec file system of ``loc``, the path of its root in it)."""
    import fsspec

    url = loc.path.removeprefix(FSSPEC_PREFIX)
    protocol = url.split("://", 1)[0]
    try:
        fs = fsspec.filesystem(protocol, **loc.storage_options)
    except ImportError as e:
        raise InvalidPathError(f"{loc}: the fsspec file system for {protocol!r} is not installed: {e}") from None
    except TypeError as e:  # an option the file system does not take: name the keys, never a value
        raise InvalidPathError(
            f"{loc}: fsspec's {protocol!r} file system refused the storage options "
            f"(keys: {', '.join(sorted(loc.storage_options)) or 'none'}): {type(e).__name__}") from None
    return fs, fs._strip_protocol(url).rstrip("/")


@contextlib.contextmanager
def errors(loc: Location, doing: str) -> Iterator[None]:
    """Turn a file system's error into a :class:`TensorckptError` naming the
    URL and the operation (a ``PermissionError``: :class:`CheckpointPermissionError`)."""
    try:
        yield
    except TensorckptError:
        raise
    except PermissionError as e:
        raise CheckpointPermissionError(
            f"{loc}: {doing} failed: permission denied ({_short(e)}); check the credentials in storage_options "
            "or the environment, and the permissions on the location") from e
    except FileNotFoundError as e:
        raise TensorckptError(f"{loc}: {doing} failed: not found ({_short(e)}); check that the bucket or "
                              "directory above the checkpoint exists") from e
    except Exception as e:
        raise TensorckptError(f"{loc}: {doing} failed: {type(e).__name__}: {_short(e)}") from e


def _short(e: BaseException) -> str:
    return str(e).splitlines()[0][:300] if str(e) else type(e).__name__


class FsspecObjects:
    """The stored objects under one checkpoint's root on an fsspec file
    system, for :mod:`.direct` (see :class:`direct.Objects`)."""

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self.fs, self.root = file_system(loc)

    def put(self, rel: str, pieces: Iterator[memoryview], size: int = 0) -> None:
        data = b"".join(bytes(p) for p in pieces)  # each view is valid only until the next: copied
        with errors(self.loc, f"writing {rel}"):
            pipe(self.fs, f"{self.root}/{rel}", data)

    def open(self, rel: str, where: str) -> FsspecObject:
        path = f"{self.root}/{rel}"
        try:
            self.fs.invalidate_cache(path)  # another process may have replaced it: no cached listing's size
            info = self.fs.info(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where}, is missing") from None
        except PermissionError as e:
            raise CheckpointPermissionError(f"{where}, cannot be read: permission denied ({_short(e)})") from None
        except Exception as e:
            raise TensorckptError(f"{where}, cannot be examined: {type(e).__name__}: {_short(e)}") from e
        if info.get("type") != "file" or not isinstance(info.get("size"), int):
            raise CorruptCheckpointError(f"{where}, is not a plain object (a writer makes only plain objects)")
        return FsspecObject(self.fs, path, info["size"], where)


class FsspecObject(direct.KnownSize):
    """One stored object opened for ranged reads (see :class:`direct.Stored`)."""

    def __init__(self, fs: Any, path: str, size: int, where: str) -> None:
        self.fs, self.path, self.size, self.where = fs, path, size, where

    def pread(self, n: int, offset: int) -> bytes:
        return self.fill_one(offset, offset + n)

    def fill_one(self, start: int, end: int) -> bytes:
        try:
            return self.fs.cat_file(self.path, start=start, end=end)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.where}, is missing") from None
        except Exception as e:
            raise TensorckptError(f"{self.where}, cannot be read: {type(e).__name__}: {_short(e)}") from e

    def fill(self, runs: list[tuple[int, int]], scratch: Callable[[int], memoryview]) -> Iterator[memoryview]:
        if not runs:
            return
        try:
            got = self.fs.cat_ranges([self.path] * len(runs), [o for o, _ in runs], [o + n for o, n in runs],
                                     on_error="raise")
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.where}, is missing") from None
        except Exception as e:
            raise TensorckptError(f"{self.where}, cannot be read: {type(e).__name__}: {_short(e)}") from e
        for data in got:
            yield memoryview(data)

    def close(self) -> None:
        return None


def has_directories(fs: Any) -> bool:
    """Whether the file system has directories that must exist before a file
    in them (its paths are rooted at "/": local, sftp, hdfs). An object store
    has none, and its ``makedirs`` would create a missing bucket: never called there."""
    return getattr(fs, "root_marker", "") == "/"


def pipe(fs: Any, path: str, data: bytes) -> None:
    """Write a whole object, making the directories above it where the file system has them."""
    try:
        fs.pipe_file(path, data)
    except FileNotFoundError:
        if not has_directories(fs):
            raise  # an object store: the bucket is missing
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        fs.pipe_file(path, data)


class FsspecStore:
    """Any fsspec file system (module docstring)."""

    supports_rename = False
    records_times = False
    kvstore = False  # TensorStore has no driver for these locations: this backend does its own object I/O
    shared = True
    timeout = None
    commit = RootLastCommit(claim=True)

    @property
    def fast_chunks(self) -> bool:
        return direct.available(True)  # else every chunk is refused (Location.kvstore): there is no other codec

    fast_reads = fast_chunks

    def _fs(self, loc: Location) -> tuple[Any, str]:
        return file_system(loc)

    # ------------------------------------------------------------ small objects

    def read(self, loc: Location, key: str, limit: int, where: str) -> tuple[object, bytes | None]:
        fs, root = self._fs(loc)
        with errors(loc, f"reading {key}"):
            try:
                # at most limit + 1 bytes are fetched (a file system may allocate the range asked for)
                data = fs.cat_file(f"{root}/{key}", start=0, end=limit + 1 if limit < 1 << 30 else None)
            except (FileNotFoundError, NotADirectoryError):
                return None, None
            except IsADirectoryError:
                raise CorruptCheckpointError(f"{where}: a directory, not a plain object") from None
        if len(data) > limit:
            raise CorruptCheckpointError(
                f"{where}: more than {limit} bytes, larger than a reader accepts for this document (spec 12): "
                "it is damaged or forged")
        return None, data

    def get(self, loc: Location, key: str) -> bytes | None:
        """The whole object, or None if absent."""
        fs, root = self._fs(loc)
        with errors(loc, f"reading {key}"):
            try:
                return fs.cat_file(f"{root}/{key}")
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                return None

    def read_range(self, loc: Location, key: str, start: int, length: int) -> bytes | None:
        fs, root = self._fs(loc)
        with errors(loc, f"reading {key}"):
            try:
                return fs.cat_file(f"{root}/{key}", start=start, end=start + length)
            except (FileNotFoundError, NotADirectoryError):
                return None

    def write(self, loc: Location, key: str, data: bytes) -> None:
        fs, root = self._fs(loc)
        with errors(loc, f"writing {key}"):
            pipe(fs, f"{root}/{key}", data)

    def create(self, loc: Location, key: str, data: bytes) -> bool:
        """Write ``key`` only if it does not exist; False: it existed. A file
        system with directories: ``open(..., "xb")`` (``O_EXCL`` locally); an
        object store: ``pipe_file(mode="create")`` (s3fs: ``If-None-Match: *``;
        elsewhere fsspec's check then write, not atomic: module docstring)."""
        fs, root = self._fs(loc)
        path = f"{root}/{key}"
        with errors(loc, f"creating {key}"):
            try:
                if not has_directories(fs):
                    fs.pipe_file(path, data, mode="create")
                    return True
                try:
                    fs.makedirs(posixpath.dirname(path), exist_ok=True)
                    with fs.open(path, "xb") as f:
                        f.write(data)
                except (ValueError, NotImplementedError):  # no exclusive open: check, then write
                    fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                return False
            except OSError as e:
                if "PreconditionFailed" in str(e) or "412" in str(e):  # If-None-Match refused the write
                    return False
                raise
        return True

    def write_many(self, loc: Location, objects: dict[str, bytes]) -> Callable[[], None]:
        """Start writing several small objects; returns a function that waits."""
        if not objects:
            return lambda: None
        pool = ThreadPoolExecutor(min(WRITE_THREADS, len(objects)), thread_name_prefix="tensorckpt-fsspec")
        futures = [pool.submit(self.write, loc, k, v) for k, v in objects.items()]
        pool.shutdown(wait=False)

        def wait() -> None:
            for f in futures:
                f.result()

        return wait

    def copy_all(self, src: Location, dst: Location, skip: tuple[str, ...] = ()) -> None:
        for key in self.list(src):
            if key not in skip:
                data = self.get(src, key)
                if data is not None:
                    self.write(dst, key, data)

    # ------------------------------------------------------------ listing, deleting

    def _find(self, loc: Location) -> dict[str, dict]:
        fs, root = self._fs(loc)
        with errors(loc, "listing"):
            try:
                fs.invalidate_cache(root)  # other processes write here: list afresh (s3fs caches listings)
                found = fs.find(root, detail=True)
            except (FileNotFoundError, NotADirectoryError):
                return {}
        prefix = root + "/"
        return {p[len(prefix):]: info for p, info in found.items() if p.startswith(prefix) and info.get("type") == "file"}

    def list(self, loc: Location, limit: int | None = None) -> list[str]:
        keys = sorted(self._find(loc))
        return keys[:limit] if limit is not None else keys

    def names(self, loc: Location) -> set[str]:
        return {k.split("/", 1)[0] for k in self._find(loc)}

    def exists(self, loc: Location) -> bool:
        return bool(self._find(loc))

    def sizes(self, loc: Location, prefix: str) -> Iterator[tuple[str, int | None]]:
        for key, info in self._find(loc.child(prefix)).items():
            size = info.get("size")
            yield key, size if isinstance(size, int) else None

    def age(self, loc: Location) -> float | None:
        return stamped_age(loc)  # the stamp a save keeps in its marker (commit_kv), as on S3

    def delete(self, loc: Location, key: str) -> None:
        fs, root = self._fs(loc)
        with errors(loc, f"deleting {key}"):
            try:
                fs.rm_file(f"{root}/{key}")
            except FileNotFoundError:
                pass

    def delete_all(self, loc: Location) -> None:
        fs, root = self._fs(loc)
        with errors(loc, "deleting"):
            try:
                fs.rm(root, recursive=True)
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------ saves and loads

    def prepare(self, loc: Location) -> None:
        return None

    def sync(self, loc: Location, keys: Collection[str] | None = None, fsynced: Collection[str] = ()) -> None:
        return None  # every write is complete (as durable as the file system makes it) when it returns

    def chunk_writer(self, loc: Location) -> direct.Writer:
        return direct.Writer(FsspecObjects(loc))

    def chunk_reader(self, loc: Location, url: str, threads: int | None = None) -> direct.Pool:
        return direct.Pool(FsspecObjects(loc), url, threads=threads)
