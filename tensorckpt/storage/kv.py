"""The primitive storage operations the backends (:mod:`.backend`) and the
commit strategies are built of: whole objects through TensorStore's kvstore
layer (read, write, list, delete, copy), and the system calls that make
local writes durable. :func:`list_keys`, :func:`exists` and
:func:`delete_all` ask the location's backend (a file system lists and
deletes directories, an object store keys). The fault-injection tests wrap
these functions to count and fail storage operations."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable, Collection
from concurrent.futures import wait
from typing import Any

import tensorstore as ts

from ..errors import TensorckptError
from . import threads
from .backend import backend_for
from .files import fsync_path
from .location import CONTEXT, Location

_libc = ctypes.CDLL(None, use_errno=True)
SYNC_THREADS = 8  # fsyncs at once: the file system batches their journal commits


NO_VALUE = b"\x02"  # TensorStore's storage generation of an absent object: ``if_equal`` it is a conditional create


def result(loc: Location, future: ts.Future, doing: str) -> Any:
    """``future.result()``, bounded by the backend's timeout: past it, a
    :class:`TensorckptError` naming the location and the operation (an
    endpoint that accepts connections and never answers must not hang us)."""
    timeout = backend_for(loc).timeout
    if timeout is None:
        return future.result()
    try:
        return future.result(timeout=timeout)
    except TimeoutError:
        future.cancel()
        raise TensorckptError(
            f"{loc}: {doing} got no answer within {timeout:g} s; check that the endpoint "
            "(AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL) is reachable, or raise TENSORCKPT_S3_TIMEOUT") from None


def _own(loc: Location) -> Any:
    """The backend of ``loc`` where it does its own object I/O (no TensorStore
    driver: fsspec), else None."""
    b = backend_for(loc)
    return None if b.kvstore else b


def open_store(loc: Location, sub: str = "") -> ts.KvStore:
    """The TensorStore kvstore of ``loc`` (or of ``sub`` inside it)."""
    return result(loc, ts.KvStore.open(loc.kvstore(sub), context=CONTEXT), "opening the store")


def read(loc: Location, key: str) -> bytes | None:
    """The object's bytes, or None if it does not exist."""
    if (own := _own(loc)) is not None:
        return own.get(loc, key)
    r = result(loc, open_store(loc).read(key), f"reading {key}")
    return r.value if r.state == "value" else None


def read_range(loc: Location, key: str, start: int, length: int) -> bytes | None:
    """``length`` bytes of ``key`` from ``start`` (fewer at its end) by a
    byte-range request; None if absent."""
    if (own := _own(loc)) is not None:
        return own.read_range(loc, key, start, length)
    store = open_store(loc)
    try:
        r = result(loc, store.read(key, byte_range=slice(start, start + length)), f"reading {key}")
    except ValueError as e:
        if "OUT_OF_RANGE" not in str(e):
            raise
        try:  # past its end: what is left from start (shorter than length)
            r = result(loc, store.read(key, byte_range=slice(start, None)), f"reading {key}")
        except ValueError as e2:
            if "OUT_OF_RANGE" not in str(e2):
                raise
            return b""
    return r.value if r.state == "value" else None


def write(loc: Location, key: str, data: bytes) -> None:
    if (own := _own(loc)) is not None:
        return own.write(loc, key, data)
    result(loc, open_store(loc).write(key, data), f"writing {key}")


def create(loc: Location, key: str, data: bytes) -> bool:
    """Write ``key`` only if it does not exist (S3: ``If-None-Match: *``);
    False: it existed, nothing was written."""
    if (own := _own(loc)) is not None:
        return own.create(loc, key, data)
    stamp = result(loc, open_store(loc).write(key, data, if_equal=NO_VALUE), f"creating {key}")
    return bool(stamp.generation)


def delete(loc: Location, key: str) -> None:
    if (own := _own(loc)) is not None:
        return own.delete(loc, key)
    result(loc, open_store(loc).delete_range(ts.KvStore.KeyRange(key, key + "\0")), f"deleting {key}")


def list_keys(loc: Location, limit: int | None = None) -> list[str]:
    """Keys under ``loc`` (relative to it), sorted; at most ``limit`` if given."""
    return backend_for(loc).list(loc, limit)


def ts_list(loc: Location, limit: int | None = None) -> list[str]:
    """:func:`list_keys` through TensorStore (the location must exist)."""
    keys = [k.decode("utf-8", "replace") for k in result(loc, open_store(loc).list(), "listing")]
    keys.sort()
    return keys[:limit] if limit is not None else keys


def exists(loc: Location) -> bool:
    """Whether anything at all is stored under ``loc``."""
    return backend_for(loc).exists(loc)


def delete_all(loc: Location) -> None:
    backend_for(loc).delete_all(loc)


def ts_delete_all(loc: Location) -> None:
    """Delete every key under ``loc`` through TensorStore."""
    result(loc, open_store(loc).delete_range(ts.KvStore.KeyRange()), "deleting")


def copy_all(src: Location, dst: Location, skip: tuple[str, ...] = ()) -> None:
    """Copy every object under ``src`` to ``dst`` (object stores have no rename)."""
    if (own := _own(src)) is not None:
        return own.copy_all(src, dst, skip)
    s, d = open_store(src), open_store(dst)
    futures = []
    for key in list_keys(src):
        if key not in skip:
            futures.append(d.write(key, result(src, s.read(key), f"reading {key}").value))
    for f in futures:
        result(dst, f, "copying")


SYNCFS_ABOVE = 1024  # paths to fsync beyond which one syncfs is cheaper (bench_durable.py, "many")


def sync_files(root: str, keys: Collection[str], fsynced: Collection[str] = ()) -> None:
    """Make the objects ``keys`` under the local directory ``root`` durable,
    and nothing else: an fsync of each (but those in ``fsynced``, synced as
    they were written) and of every directory on their paths, from each
    one's parent up to ``root``, each once (their entries), all on several
    threads. Only what this process wrote is flushed, so the time does not
    depend on what other processes have left dirty on the same file system,
    as one ``syncfs`` would (benchmarks/README.md, "Durability"). Past
    ``SYNCFS_ABOVE`` paths (a save of thousands of tiny tensors) one syncfs
    is used instead: measured cheaper there, quiet or beside a neighbour
    dirtying the page cache (bench_durable.py's "many" rows)."""
    if not keys:
        return
    paths = sync_paths(root, keys, fsynced)
    if len(paths) > SYNCFS_ABOVE:  # one syncfs costs less than thousands of fsyncs, even beside a busy neighbour
        sync_tree(root)
        return
    if len(paths) > 2:
        with threads.borrowed("sync", SYNC_THREADS) as pool:
            try:
                futures = [pool.submit(fsync_path, p) for p in paths]
            except RuntimeError:  # the interpreter is exiting (an async save finishing at exit): no new threads
                futures = []
            wait(futures)  # all done before the pool is given back
        if futures:
            for f in futures:
                f.result()  # raises the first failure
            return
    for p in paths:
        fsync_path(p)


def sync_paths(root: str, keys: Collection[str], fsynced: Collection[str] = ()) -> list[str]:
    """What :func:`sync_files` fsyncs: the objects ``keys`` but those in
    ``fsynced``, then every directory on their paths up to ``root``, each once."""
    files = [os.path.join(root, k) for k in keys if k not in fsynced]
    dirs: set[str] = set()
    for k in keys:
        d = os.path.dirname(k)
        while d and d not in dirs:
            dirs.add(d)
            d = os.path.dirname(d)
    return [*files, *(os.path.join(root, d) for d in dirs), root]


def sync_tree(path: str) -> None:
    """Make everything written under a local directory durable: one syncfs of
    its file system, which also flushes what other processes wrote there
    (:func:`sync_files` where the written files are known)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            if err != errno.ENOSYS:  # a failed writeback must fail the save, not be ignored
                raise OSError(err, f"syncfs failed: {os.strerror(err)}", path)
            os.sync()
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """fsync of a directory the caller named (a link to it is followed: a manager root may be one)."""
    fsync_path(path, os.O_RDONLY)


def write_many_async(loc: Location, objects: dict[str, bytes]) -> Callable[[], None]:
    """Start writing several small objects; returns a function that waits."""
    if not objects:
        return lambda: None
    if (own := _own(loc)) is not None:
        return own.write_many(loc, objects)
    store = open_store(loc)
    futures = [store.write(k, v) for k, v in objects.items()]

    def wait() -> None:
        try:
            for f in futures:
                result(loc, f, "writing")
        finally:  # after a failure the rest must not land later, in a checkpoint saved since (a no-op once done)
            for f in futures:
                f.cancel()

    return wait
