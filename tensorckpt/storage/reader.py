"""Reading the stored arrays of one version of a checkpoint, as
``tensorckpt.open`` (:class:`tensorckpt.checkpoint.Checkpoint`, a subclass),
``engine/load.py`` and ``verify.py`` do.

Everything stored is untrusted (spec section 12). Each array's
``zarr.json`` is read (size-capped) and checked against its index entry in
Python (:func:`tensorckpt.format.arrays.check_array_metadata`), and
TensorStore is then opened with that checked metadata, so it never parses a
stored JSON document itself (its parser crashes on deeply nested input).
On a file system the objects a read will open, and the directories above
them, must be plain files and directories of a plausible size, and a large
read must be backed by as many stored bytes. The chunks are decoded and
every CRC-32C (and since 1.3 every chunk digest) checked by tensorckpt's own
codec where the backend has it (``fast_reads``: local files, fsspec, S3 and
memory://; :meth:`_chunk_reader`), else by TensorStore, whose errors become
:class:`CorruptCheckpointError` naming the tensor and the stored chunk
(:func:`wait`, :func:`chunk_error`); on S3 the sizes of the objects
TensorStore will read are asked first (:meth:`StoredArrays.check_objects`).

A reader reads one version (spec 10.7): it holds the :class:`~.pinned.Pin`
it is given and reads everything through it; a read that a replace or
deletion overlapped raises :class:`CheckpointChangedError`
(:meth:`StoredArrays.one_version`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import itertools
import math
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from typing import Self

import numpy as np
import tensorstore as ts

from ..errors import CheckpointChangedError, CorruptCheckpointError, TensorckptError
from ..format.arrays import check_array_metadata, chunk_digests
from ..format.metadata import MAX_NODE_JSON_BYTES, RootMetadata, TensorEntry, loads
from ..layout.boxes import Box, chunk_ranges
from . import arrays, commit, direct, location, pinned, threads
from .backend import backend_for
from .pinned import Pin

# A read up to this size is allocated at once; a larger one first checks that
# the array stores at least that many bytes (version 1 does not compress), so
# a forged index cannot make a reader allocate out of proportion to the data.
TRUSTED_READ_BYTES = 64 << 20

META_THREADS = 8  # threads reading array zarr.json documents (local checkpoints) ...
META_BATCH = 64  # ... in jobs of at most this many


def read_object(loc: location.Location, key: str) -> bytes | None:
    """A small stored object (a ``zarr.json``), or None if absent: at most
    ``MAX_NODE_JSON_BYTES``; a local one must be a regular file under plain
    directories (a FIFO would block forever, a link leads out)."""
    return backend_for(loc).read(loc, key, MAX_NODE_JSON_BYTES, f"{loc}/{key}")[1]


class StoredArrays:
    """The arrays of the checkpoint at ``loc`` whose validated root metadata
    is ``root``, read from the version ``pin`` holds (None: pin it here, as
    every rank of a distributed load does after rank 0 read the root; see
    :meth:`same_version`). Close it (or leave its ``with`` block) to release
    the pin."""

    def __init__(self, loc: location.Location, root: RootMetadata, pin: pinned.Pin | None = None,
                 raw: bytes | None = None) -> None:
        self.location = loc
        self._pin_error: str | None = None
        if pin is None:  # a distributed load: rank 0 read the root (its bytes: raw); see same_version
            try:
                pin = pinned.Pin(loc)
            except OSError as e:
                self._pin_error = f"cannot be opened any more ({e.strerror or e})"
            else:
                if not pin.local and raw is not None:
                    self._pin_error = _hold_root(pin, raw)
        self._pin = pin
        self._backend = backend_for(loc)
        self._fs = self._backend.supports_rename  # a file system: directories, links, special files
        # every object is read from the version resolved first (spec 10.7); messages name the path
        self._read = pin.read_loc if pin is not None else loc
        self._meta = root
        self._arrays: dict[str, ts.TensorStore] = {}
        self._checked: set[str] = set()  # arrays whose zarr.json agrees with the index
        self._digests: dict[str, list[str]] = {}  # since 1.3: each checked array's chunk digests (spec 7.1)
        self._plain_dirs: set[str] = set()  # local directories found to be real directories, not links
        self._sizes: dict[str, int | None] | None = None  # a shared object store: every object's size, asked once

    def close(self) -> None:
        """Release the hold on the version read (a directory descriptor
        locally); further reads fail. Also on leaving a ``with`` block."""
        self._arrays.clear()
        if self._pin is not None:
            self._pin.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def read_location(self) -> location.Location:
        """Where this view reads objects: locally ``/proc/self/fd/N``, the
        directory resolved at open (spec 10.7); else the location itself."""
        return self._read

    @property
    def pinned(self) -> bool:
        """Whether reads cannot see another version (a directory descriptor holds this one)."""
        return self._pin is not None and self._pin.pinned

    @property
    def version_id(self) -> tuple[int, int] | None:
        """Locally, the (device, inode) of the checkpoint directory this view reads."""
        return self._pin.dir_id if self._pin is not None else None

    def same_version(self, version_id: tuple[int, int] | None) -> None:
        """Raise :class:`CheckpointChangedError` unless this view reads the
        version ``version_id`` (another rank's :attr:`version_id`)."""
        if self._pin_error is not None or (self._fs and self.version_id != version_id):
            raise CheckpointChangedError(
                f"{self.path}: the checkpoint was replaced between the root read and this rank's open "
                f"({self._pin_error or 'another directory'}); nothing was read: load again"
            )

    def changed(self) -> bool:
        """Whether the checkpoint at the path is no longer the version this view reads."""
        return self._pin is None or self._pin.changed()

    @contextlib.contextmanager
    def one_version(self) -> Iterator[None]:
        """Reads inside see one version of the checkpoint, or raise
        :class:`CheckpointChangedError` (retry) where a replace or deletion
        overlapped them: a failure caused by one is not reported as
        corruption, and where reads are not pinned to a directory (object
        stores) the root is compared after them."""
        self._check_open()
        try:
            yield
        except (CorruptCheckpointError, OSError):
            if self.changed():
                raise CheckpointChangedError(self._changed_message()) from None
            raise
        if not self.pinned and self.changed():
            raise CheckpointChangedError(self._changed_message())

    def _check_open(self) -> None:
        if self._pin is not None and self._pin.pinned and self._pin.fd is None:
            raise TensorckptError(f"{self.path}: this view was closed; open the checkpoint again to read it")

    def _changed_message(self) -> str:
        return (f"{self.path}: the checkpoint was replaced or deleted while it was read; nothing mixed from two "
                "versions was returned: open or load it again")

    @property
    def path(self) -> str:
        return self.location.url

    @property
    def index(self) -> RootMetadata:
        return self._meta

    def _chunk_reader(self) -> direct.Pool:
        pool = self._backend.chunk_reader(self._read, self.path)
        if pool is None:
            raise TensorckptError(f"{self.path}: no chunk reader for this storage")  # callers check fast_reads
        return pool

    def read_into(self, key: str, src: ts.TensorStore, out: np.ndarray) -> None:
        """Copy ``src`` (a view of this checkpoint's array ``key``) into ``out``."""
        if out.size:
            wait(self.path, key, ts.array(out, copy=False, write=True).write(src))

    def array(self, key: str) -> ts.TensorStore:
        """The opened TensorStore array of ``key``, checked against the index."""
        if key not in self._arrays:
            self._arrays.update(self.open_arrays([key]))
        return self._arrays[key]

    def open_arrays(self, keys: Iterable[str]) -> dict[str, ts.TensorStore]:
        """Open several arrays, each once its ``zarr.json`` is found to agree
        with the index (spec section 7). TensorStore gets the checked metadata
        and never reads the stored document."""
        todo = [k for k in keys if k not in self._arrays]
        self.check_arrays(todo)
        for k in todo:
            where = f"{self.path}/{k}/zarr.json"
            try:
                self._arrays[k] = arrays.open_read(self._read, k, self._meta.tensors[k]).result()
            except ValueError as err:
                raise CorruptCheckpointError(f"{where}: an array with this metadata cannot be opened ({short(err)})") from None
        return {k: self._arrays[k] for k in keys}

    def check_arrays(self, keys: Iterable[str]) -> None:
        """Check that every array's stored ``zarr.json`` agrees with its index
        entry (spec section 7); raise :class:`CorruptCheckpointError` naming
        the first that does not. Each array is checked once."""
        self._check_open()
        todo = [k for k in keys if k not in self._checked]
        remote = todo and not self._fs and self._backend.kvstore
        store = ts.KvStore.open(self._read.kvstore(), context=location.CONTEXT).result() if remote else None
        pin = self._pin if self._pin is not None and self._pin.fd is not None else None  # openat from its directory
        if pin is not None and len(todo) > 1:  # on threads, in batches: a cold cache reads the documents' inodes at once
            per = max(1, min(META_BATCH, len(todo) // META_THREADS))
            with threads.borrowed("meta", META_THREADS) as pool:
                batches = [pool.submit(self._read_local_batch, pin, todo[i:i + per]) for i in range(0, len(todo), per)]
                try:
                    self._check_documents({k: functools.partial(_nth, batches[i // per], i % per) for i, k in enumerate(todo)})
                finally:
                    for f in batches:
                        f.cancel()
                    concurrent.futures.wait(batches)
            return
        self._check_documents({k: functools.partial(self._read_local, pin, f"{k}/zarr.json") if pin is not None
                               else _start_read(self._read, store, f"{k}/zarr.json") for k in todo})

    def _check_documents(self, reads: dict[str, Callable[[], bytes | None]]) -> None:
        """:meth:`check_arrays` of the documents ``reads`` gives (key -> a function giving its bytes)."""
        for k, pending in reads.items():
            where = f"{self.path}/{k}/zarr.json"
            try:
                data = pending()
            except (OSError, ValueError) as e:
                raise CorruptCheckpointError(f"{where}: cannot be read ({short(e)})") from None
            if data is None:
                raise CorruptCheckpointError(f"{where}: missing; the index lists tensor {k!r} but its array metadata is not stored")
            doc = loads(data, where)
            check_array_metadata(doc, self._meta.tensors[k], where)  # what is malformed, named first
            self._check_digest(k, data, where)
            if self._meta.checkpoint_id and isinstance(doc, dict):
                self._digests[k] = chunk_digests(doc, self._meta.tensors[k], self._meta.checkpoint_id, where)
            self._checked.add(k)

    def _read_local_batch(self, pin: Pin, keys: list[str]) -> list[bytes | Exception | None]:
        """Each array ``zarr.json`` of ``keys`` (or the error reading it), relative to the pinned directory."""
        out: list[bytes | Exception | None] = []
        for k in keys:
            try:
                out.append(self._read_local(pin, f"{k}/zarr.json"))
            except (OSError, ValueError, CorruptCheckpointError) as e:
                out.append(e)
        return out

    def _read_local(self, pin: Pin, key: str) -> bytes | None:
        """A small object, relative to ``pin``'s directory (each directory opened ``O_NOFOLLOW``)."""
        return pin.read(key, MAX_NODE_JSON_BYTES, f"{self.path}/{key}")[1]

    def _check_digest(self, key: str, data: bytes, where: str) -> None:
        """Since 1.3 (spec 9.8): the array's ``zarr.json`` is the one whose
        digest the (checksummed) root records for ``key``."""
        want = self._meta.array_digests.get(key)
        if self._meta.checkpoint_id and hashlib.sha256(data).hexdigest() != want:
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r}: its array metadata is not the one this checkpoint's root records "
                "(damaged, or an array directory swapped with another or copied from another checkpoint)"
            )

    def chunk_digests(self, key: str) -> list[str] | None:
        """The digest of every chunk of tensor ``key`` (C order of its grid),
        as its checked ``zarr.json`` records them; None before format 1.3."""
        self.check_arrays([key])
        return self._digests.get(key)

    def check_objects(self, key: str, region: Box, codec: bool = False) -> None:
        """Before a read opens them: the stored objects of tensor ``key``
        that a read of ``region`` will open, and every directory above them, are plain files and directories
        on a local checkpoint. TensorStore follows links (out of the
        checkpoint) and blocks forever on a FIFO; a writer makes neither.
        A file larger than its inner chunks and index can take is refused
        too: TensorStore reads the span of the ranges it wants in one
        allocation, which a forged sparse file makes abort the process. On
        an object store (S3, memory://) the sizes are checked
        the same way, as the store gives them (:meth:`_check_stored_sizes`),
        unless the read goes through tensorckpt's own codec (``codec``:
        :mod:`.direct`, whose every allocation is bounded by the checked
        metadata): there nothing is asked of the store beforehand, and on a
        local checkpoint the codec opens each directory and then the object
        ``O_NOFOLLOW`` (the object ``O_NONBLOCK`` too) and checks what it is
        itself (:func:`.files.open_beneath`)."""
        self._check_open()
        if codec:
            return  # read by the codec: bounded without the sizes; locally it opens no link nor special file
        e = self._meta.tensors[key]
        spans = chunk_ranges(region, e.chunk_shape, e.shape)
        if math.prod(len(s) for s in spans) == 0:
            return
        if not self._fs:  # an object store (S3, memory://): the same bounds, before TensorStore fetches anything
            self._check_stored_sizes(key, spans)
            return
        if math.prod(len(s) for s in spans) > 4096:  # many objects: one listing, proportional to what is stored
            for pos, size in self.chunk_objects(key).items():
                self._check_size(key, pos, size)
            return
        for pos in itertools.product(*spans):
            rel = "/".join((key, arrays.chunk_key(pos)))
            parts = rel.split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in self._plain_dirs:
                    self._lstat_is(d, stat.S_ISDIR, key)
                    self._plain_dirs.add(d)
            st = self._lstat_is(rel, stat.S_ISREG, key)
            if st is not None:
                self._check_size(key, pos, st.st_size)

    def _check_stored_sizes(self, key: str, spans: list[range]) -> None:
        """The sizes of an object store's objects, asked of the store without
        fetching them (S3: one tiny ranged request each, all at once), once
        per checkpoint version for all its objects: one round trip per load,
        not one per tensor. A missing object is the reader's to report."""
        if self._sizes is None:
            self._sizes = dict(_object_sizes(self._read, ""))
        if math.prod(len(s) for s in spans) > 4096:
            positions: Iterable[tuple[int, ...]] = (
                pos for pos in self.chunk_objects(key) if all(p in s for p, s in zip(pos, spans)))
        else:
            positions = itertools.product(*spans)
        for pos in positions:
            size = self._sizes.get(f"{key}/{arrays.chunk_key(pos)}")
            if size is not None:
                self._check_size(key, pos, size)

    def _check_size(self, key: str, pos: tuple[int, ...], size: int | None) -> None:
        where = f"{self.path}/{key}/{arrays.chunk_key(pos)}"
        if size is None:
            raise CorruptCheckpointError(f"{where}: not a regular file (a link, FIFO or device; a writer makes none); tensor {key!r}")
        least, most = arrays.object_bytes_bounds(self._meta.tensors[key], pos)
        if size < least:  # as verify: TensorStore would trust its index and allocate what it claims
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r}, chunk {pos}, is malformed (truncated or damaged, or its tensor entry forged): "
                f"{size} bytes, but its inner chunks and index need at least {least}"
            )
        if size > most:
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r}, chunk {pos}, is {size} bytes, more than its inner chunks and index "
                f"can take ({most}): it is damaged or forged"
            )

    def _lstat_is(self, rel: str, kind: Callable[[int], bool], key: str) -> os.stat_result | None:
        try:
            st = os.lstat(os.path.join(self._read.path, rel))
        except FileNotFoundError:
            return None  # a missing object is the reader's to report
        except OSError as e:
            raise CorruptCheckpointError(f"{self.path}/{rel}: cannot be examined ({e.strerror}); tensor {key!r}") from None
        if not kind(st.st_mode):
            what = "directory" if kind is stat.S_ISDIR else "regular file"
            raise CorruptCheckpointError(
                f"{self.path}/{rel}: not a {what} (a link, FIFO or device; a writer makes none); tensor {key!r}"
            )
        return st

    def chunk_objects(self, key: str) -> dict[tuple[int, ...], int | None]:
        """The chunk objects stored for tensor ``key``: grid position -> size
        in bytes (None: not a regular file). Found by listing, so the work is
        proportional to what is stored, never to what the index claims.
        Other objects are ignored."""
        self._check_open()
        e = self._entry(key)
        grid = [-(-s // c) for s, c in zip(e.shape, e.chunk_shape)]
        out = {}
        for name, size in _object_sizes(self._read, key):
            parts = name.split("/")
            if parts[0] != "c" or len(parts) != len(grid) + 1 or not all(p.isascii() and p.isdigit() for p in parts[1:]):
                continue
            pos = tuple(int(p) for p in parts[1:])
            if parts[1:] == [str(i) for i in pos] and all(i < n for i, n in zip(pos, grid)):
                out[pos] = size
        return out

    def _entry(self, k: str) -> TensorEntry:
        e = self._meta.tensors.get(k)
        if e is None:
            kind = "a value, not a tensor" if k in self._meta.values else "not in the checkpoint"
            raise KeyError(f"{self.path}: key {k!r} is {kind}")
        return e

    def _check_backed(self, key: str, nbytes: int) -> None:
        """Refuse, before allocating, a read larger than all the array stores."""
        if nbytes <= TRUSTED_READ_BYTES:
            return
        stored = sum(n or 0 for n in self.chunk_objects(key).values())
        if nbytes > stored:
            e = self._meta.tensors[key]
            raise CorruptCheckpointError(
                f"{self.path}/{commit.ROOT_KEY}: tensor {key!r} is {list(e.shape)} {e.dtype}, so reading it needs "
                f"{nbytes} bytes, but its stored chunks hold only {stored} bytes; not allocating that"
            )


def _nth(batch: concurrent.futures.Future, i: int) -> bytes | None:
    """Item ``i`` of a :meth:`StoredArrays._read_local_batch`, raised if it is an error."""
    got = batch.result()[i]
    if isinstance(got, Exception):
        raise got
    return got


def _start_read(loc: location.Location, store: ts.KvStore | None, key: str) -> Callable[[], bytes | None]:
    """Start reading a small object; returns a function giving its bytes or None."""
    if store is None:
        return lambda: read_object(loc, key)
    future = store.read(key)

    def result() -> bytes | None:
        r = future.result()
        if r.state != "value":
            return None
        if len(r.value) > MAX_NODE_JSON_BYTES:
            raise CorruptCheckpointError(
                f"{loc}/{key}: more than {MAX_NODE_JSON_BYTES} bytes, larger than a reader accepts for an array "
                "zarr.json (spec 12): it is damaged or forged"
            )
        return r.value

    return result


def _hold_root(pin: pinned.Pin, raw: bytes) -> str | None:
    """An object store: make ``pin`` hold the version whose root ``zarr.json``
    rank 0 read (``raw``), so that :meth:`StoredArrays.changed` compares the
    root with it; or say why this rank sees another version."""
    try:
        generation, data = pin.read(commit.ROOT_KEY, len(raw), f"{pin.loc}/{commit.ROOT_KEY}")
    except (OSError, ValueError, CorruptCheckpointError) as e:
        return f"its root zarr.json cannot be read ({e})"
    if data != raw:
        return "its root zarr.json is not the one rank 0 read"
    pin.remember_root(generation, data)
    return None


def _object_sizes(loc: location.Location, prefix: str) -> Iterator[tuple[str, int | None]]:
    """(key relative to ``prefix``, size) of every stored object under it. A
    local object that is not a regular file (a link, a FIFO, a device: none
    of which a writer makes) has size None; links are not followed."""
    return backend_for(loc).sizes(loc, prefix)


# ----------------------------------------------------------------- errors

_CHUNK_RE = re.compile(r'/c((?:/[0-9]+)*)"')  # the end of the stored object a TensorStore error quotes
_INNER_RE = re.compile(r"shard entry \{([0-9, ]*)\}/")
_SPEC_RE = re.compile(r"\s*\[tensorstore_spec=.*\]\s*$", re.DOTALL)


def wait(path: str, key: str, future: ts.Future | ts.WriteFutures) -> object:
    """Resolve a TensorStore read of tensor ``key``, turning its errors into a
    :class:`CorruptCheckpointError` naming the tensor and the stored chunk."""
    try:
        return future.result()
    except ValueError as e:
        raise CorruptCheckpointError(chunk_error(path, key, str(e))) from None


def chunk_error(path: str, key: str, msg: str) -> str:
    """The message for a failed read: which stored chunk (object path and
    grid position, and inner chunk when known) and what is wrong with it."""
    msg = short(msg)
    if "NOT_FOUND" in msg:
        what = "is missing"
    elif "Digest mismatch" in msg:
        what = "fails its CRC-32C checksum: the stored data is corrupt"
    else:
        what = "is malformed (truncated or damaged)"
    found = list(_CHUNK_RE.finditer(msg))
    if not found:
        return f"{path}: tensor {key!r}: a stored chunk {what} ({msg})"
    coords = found[-1].group(1)
    position = tuple(int(c) for c in coords.split("/")[1:])
    m = _INNER_RE.search(msg)
    inner = f", inner chunk ({m.group(1)})" if m and m.group(1) else ""
    return f"{path}/{key}/c{coords}: tensor {key!r}, chunk {position}{inner}, {what} ({msg})"


def short(e: object) -> str:
    """A TensorStore error without the long spec JSON it appends."""
    return _SPEC_RE.sub("", str(e))
