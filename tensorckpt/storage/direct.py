"""Reading and writing a local checkpoint's chunks without TensorStore: the
fast path of load, ``Checkpoint.read`` and save.

Every array tensorckpt writes has the same codec chain (spec section 7):
``sharding_indexed`` with inner chunks ``bytes`` (little-endian) + ``crc32c``
and the shard index (``bytes`` + ``crc32c``) at the end of each stored object.
The encoding and every check of it are :mod:`tensorckpt.storage.codec`'s
(pure, in memory); this module does the I/O: open, fstat, ``pread``/``preadv``,
writes, fsync, threads and their reused buffers. For a checkpoint on a local file system, a read of a box here opens each
stored object it overlaps, reads and checks its shard index, reads the inner
chunks it needs with ``preadv`` into a reused buffer (contiguous ones in one
call), checks each one's CRC-32C in hardware, and copies the wanted part
straight into the target. An object the read needs whole and whose size is
the one this library's writer gives it is read front to back in one pass,
its index last, and checked against the index the writer writes (any other
layout: read again, index first), so a cold same-layout load makes no seek
back to each object's end; on an object store, where the size is not asked,
such an object of at most ``WHOLE_READ_BYTES`` is fetched with its index in
one request (a range of the writer's size) instead of two. The bytes and the checks are TensorStore's (the
tests compare both readers on every dtype, layout and kind of damage); the
work per byte is less: no chunk allocations, no software CRC, reads that
stay in the CPU cache for the check and the copy (a warm 1 GiB load in one
process: 0.18 s against 0.26 s through TensorStore; benchmarks/README.md).

Writing is the mirror image: each stored object is encoded in a reused
buffer, inner chunk by inner chunk in C order (elements, then their
CRC-32C), written with ``os.write``, the index last, and fsynced right
away on the same thread, so the disk works while other threads encode the
next ones and the save's sync pass (``kv.sync_files``) has only their
directories left. The bytes are TensorStore's (tests/test_direct.py
compares them).

The I/O is one small interface, :class:`Objects` (whole-object writes,
a stored object's size, ranged reads; :class:`Sources` its reading half), so the same Writer / Pool / Reader
logic runs over any storage: :class:`LocalObjects` (the default for a
path: the fd / ``pread`` / ``preadv`` / ``os.write`` code described above),
:class:`tensorckpt.storage.fsspec.FsspecObjects` (``pipe_file``,
``info``, ``cat_ranges``: every inner-chunk run one object needs in one call)
and, for reads only, :class:`tensorckpt.storage.kvobjects.KvObjects` (a
TensorStore kvstore's byte ranges: S3, memory://; the index by a suffix
range, the size never asked).

Nothing here trusts the stored object: its size (where known), the index
CRC, every index entry (offset, length == the inner chunk's encoded size,
inside the object's data region, no two overlapping) are checked before a
byte of data is read. Where the size is not known, the data region is taken
as the most the object's inner chunks can fill: every read is still bounded
by the checked metadata, and an entry past the real data reads index bytes
or too few (a CRC-32C failure, or a short read); damage
raises :class:`CorruptCheckpointError` naming the object, chunk and inner
chunk. Objects are opened ``O_NOFOLLOW | O_NONBLOCK`` and must be regular
files, so a link or a FIFO planted as a chunk neither escapes nor blocks.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

import numpy as np

from ..errors import CheckpointPermissionError, CorruptCheckpointError
from ..format.metadata import MAX_INNER_CHUNK_BYTES, MAX_SHARD_INDEX_BYTES, TensorEntry
from ..layout.boxes import Box, chunk_box, read_plan
from . import codec, files
from . import threads as pools
from .arrays import chunk_key
from .files import write_durable

BUFFER_BYTES = 1 << 20  # largest single read (stays in the CPU cache for the check and copy that follow)
# stored objects read at once: reads of one overlap the checks and copies of others
# (8: 5-23 % faster cold than 4 in bench_load_path; 12-16 no faster)
THREADS = 8
WRITE_THREADS = 4  # stored objects written at once: one encodes while others wait on the disk
WHOLE_READ_BYTES = 1 << 20  # an object of unknown size at most this large that a read needs whole: one request
MAX_INDEX_BYTES = MAX_SHARD_INDEX_BYTES  # what this path buffers whole: the format's caps (spec 12), so every
MAX_INNER_BYTES = MAX_INNER_CHUNK_BYTES  # entry a reader accepts (parse_tensor_entry refuses the rest)


def available(local: bool) -> bool:
    """Whether reads of a checkpoint can take this path: local files, a
    little-endian host and the hardware CRC-32C function (the local
    backend's ``fast_chunks``)."""
    return local and sys.byteorder == "little" and codec.crc32c_at is not None


def usable(entry: TensorEntry) -> bool:
    """Whether this path reads ``entry``: its shard index and inner chunk are
    of a size it buffers whole (decided from the checked metadata, before
    any I/O, so a forged entry cannot make it allocate). Every entry that
    passed the root's validation is (the caps are the format's); a test
    lowers them to send entries to TensorStore."""
    g = codec.geometry(entry)
    return g.index_bytes <= MAX_INDEX_BYTES and g.encoded <= MAX_INNER_BYTES


class Stored(Protocol):
    """One stored object opened for reading."""

    @property
    def size(self) -> int | None:
        """Its size in bytes; None: not known without asking the store (an
        object store: reads rely on the checked metadata alone)."""
    @property
    def run_bytes(self) -> int:
        """The largest single read to ask of it (inner chunks stored back to back are read together)."""

    def pread(self, n: int, offset: int) -> bytes:
        """``n`` bytes from ``offset`` (fewer at the end)."""
    def tail(self, n: int) -> bytes:
        """The last ``n`` bytes (the shard index; fewer, or none, if the object is shorter)."""
    def measure(self) -> int | None:
        """The object's size, asked of the store if :attr:`size` is None
        (for a message about a damaged object; None: the store does not say)."""
    def fill(self, runs: list[tuple[int, int]], scratch: Callable[[int], memoryview]) -> Iterator[memoryview]:
        """For each ``(offset, nbytes)`` of ``runs`` in turn: the bytes read
        (``nbytes`` of them, fewer at the end), in ``scratch(n)`` (a reused
        buffer of at least ``n`` bytes) or in memory of its own, valid until
        the next is asked for."""
    def close(self) -> None: ...


class KnownSize:
    """:class:`Stored` methods of an object whose size is known when it is opened."""

    size: int

    @property
    def run_bytes(self) -> int:
        return BUFFER_BYTES  # read when used: a benchmark may change it

    def pread(self, n: int, offset: int) -> bytes:  # the subclass's
        raise NotImplementedError

    def tail(self, n: int) -> bytes:
        return self.pread(min(n, self.size), max(0, self.size - n))

    def measure(self) -> int | None:
        return self.size


class Sources(Protocol):
    """The stored objects under one checkpoint's root, by key relative to it, for reading."""

    def open(self, rel: str, where: str) -> Stored:
        """Open ``rel`` for reading; a missing, unreadable or not plain
        object raises the :class:`CorruptCheckpointError` (or
        :class:`CheckpointPermissionError`) naming ``where``."""


class Objects(Sources, Protocol):
    """:class:`Sources` that can also be written."""

    def put(self, rel: str, pieces: Iterator[memoryview], size: int = 0) -> None:
        """Store the object ``rel`` made of ``pieces`` (each valid until the
        next is asked for; ``size``: their total, when known), durable on return."""


class LocalObjects:
    """Objects as regular files under a local directory: written with
    ``os.write`` and fsynced, read with ``pread`` / ``preadv``, opened
    ``O_NOFOLLOW | O_NONBLOCK``."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._made: set[str] = set()  # directories known to exist

    def put(self, rel: str, pieces: Iterator[memoryview], size: int = 0) -> None:
        path = os.path.join(self.root, rel)
        parent = os.path.dirname(path)
        if parent not in self._made:
            os.makedirs(parent, exist_ok=True)
            self._made.add(parent)
        write_durable(path, pieces, files.direct_io(), size)

    def open(self, rel: str, where: str) -> LocalFile:
        try:
            fd = files.open_beneath(self.root, rel)  # no link followed: each directory, then the file
        except files.NotADirectory as e:
            raise CorruptCheckpointError(
                f"{where}: {e.args[0]} is not a directory (a link or special file; a writer makes none)") from None
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where}, is missing") from None
        except PermissionError:
            raise CheckpointPermissionError(
                f"{where}, cannot be read: permission denied (the file exists; fix its permissions, or read as its owner)"
            ) from None
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENXIO):  # O_NOFOLLOW met a link; a socket or device
                raise CorruptCheckpointError(f"{where}, is not a regular file (a link or special file; a writer makes none)") from None
            raise CorruptCheckpointError(f"{where}, cannot be opened ({err.strerror}; a link or unreadable file)") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(f"{where}, is not a regular file (a FIFO, device or directory; a writer makes none)")
        except BaseException:
            os.close(fd)
            raise
        return LocalFile(fd, st.st_size)


class LocalFile(KnownSize):
    """An open regular file (see :class:`Stored`)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size

    def pread(self, n: int, offset: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def fill(self, runs: list[tuple[int, int]], scratch: Callable[[int], memoryview]) -> Iterator[memoryview]:
        view = scratch(max((n for _, n in runs), default=0))
        for offset, nbytes in runs:
            yield view[:os.preadv(self.fd, [view[:nbytes]], offset)]

    def close(self) -> None:
        os.close(self.fd)


class InMemory(KnownSize):
    """A stored object already read whole (see :class:`Stored`)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.size = memoryview(data), len(data)

    def pread(self, n: int, offset: int) -> bytes:
        return bytes(self.data[offset:offset + n])

    def fill(self, runs: list[tuple[int, int]], scratch: Callable[[int], memoryview]) -> Iterator[memoryview]:
        for offset, nbytes in runs:
            yield self.data[offset:offset + nbytes]

    def close(self) -> None:
        pass


def objects_of(root: str | Objects) -> Objects:
    return LocalObjects(root) if isinstance(root, str) else root


def sources_of(root: str | Sources) -> Sources:
    return LocalObjects(root) if isinstance(root, str) else root


class Writer:
    """Writes whole stored objects of a checkpoint (``root``: a local
    directory, or any :class:`Objects`) on ``threads`` threads, each with
    its own reused buffer. :meth:`write` returns a future, done once the
    object is written and durable; :meth:`close` waits for every write it
    started."""

    def __init__(self, root: str | Objects, threads: int | None = None):
        self.objects = objects_of(root)
        self._local = threading.local()
        self._threads = max(1, threads or WRITE_THREADS)
        self._pool: ThreadPoolExecutor | None = pools.borrow("write", self._threads)  # kept for the next save once closed
        self._started: list[Future] = []

    def close(self) -> None:
        if self._pool is None:
            return
        wait(self._started)
        pools.give_back(self._pool, "write", self._threads)
        self._pool, self._started = None, []

    def write(self, key: str, entry: TensorEntry, pos: tuple[int, ...], data: np.ndarray) -> Future[str]:
        """Start writing chunk ``pos`` of array ``key``; ``data`` holds the
        chunk's elements (its box clipped to the array, any strides) and
        must stay unchanged until the future is done. The future's result is
        the object's digest (:func:`codec.new_digest`, spec 7.1)."""
        if self._pool is None:
            raise ValueError("this Writer is closed")
        future = _submit(self._pool, self._run, key, entry, pos, data)
        self._started.append(future)
        return future

    def _run(self, key: str, e: TensorEntry, pos: tuple[int, ...], data: np.ndarray) -> str:
        g = codec.geometry(e)
        size = codec.write_buffer(g, BUFFER_BYTES, files.ALIGN)
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._local.buf = files.aligned_buffer(size)
        digest = codec.new_digest()
        self.objects.put(f"{key}/{chunk_key(pos)}", codec.encode(g, data, buf, digest, files.ALIGN), g.bounds(pos)[0])
        return digest.hexdigest()


def _submit(pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Future:
    """``pool.submit``, or run now on this thread once the interpreter is
    exiting (an async save finishing at exit may no longer start threads)."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001 - the future carries it, as pool.submit's would
            done.set_exception(e)
        return done


class Pool:
    """Reads boxes of a checkpoint's tensors (``root``: a local directory,
    or any :class:`Sources`) on ``threads`` threads, each with its own
    reused buffer. Use as a context manager; on leaving, reads not started
    are cancelled and running ones finish."""

    def __init__(self, root: str | Sources, url: str, threads: int | None = None):
        self.objects, self.url = sources_of(root), url
        self._local = threading.local()
        self._threads = max(1, threads or THREADS)
        self._pool: ThreadPoolExecutor | None = pools.borrow("read", self._threads)  # kept for the next load once closed
        self._started: list[Future] = []

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is None:
            return
        for f in self._started:
            f.cancel()
        wait(self._started)
        pools.give_back(self._pool, "read", self._threads)
        self._pool, self._started = None, []

    def read(self, key: str, entry: TensorEntry, want: Box, dst: np.ndarray,
             digests: list[str] | None = None) -> list[Future]:
        """Start filling ``dst`` (shape ``want.shape``, the entry's numpy
        dtype, any strides) with the stored elements of ``want``: one future
        per stored object it overlaps. ``digests`` (format 1.3: every chunk's,
        C order of the grid): an object read whole is checked against its own."""
        if self._pool is None:
            raise ValueError("this Pool is closed")
        started = [_submit(self._pool, self._run, *job) for job in _jobs(key, entry, want, dst, digests)]
        self._started += started
        return started

    def read_batch(self, reads: list[tuple[str, TensorEntry, Box, np.ndarray, list[str] | None]]) -> Future:
        """:meth:`read` of each ``(key, entry, want, dst, digests)`` in turn,
        as one job on one thread: one future, one hand-off between threads
        for many small tensors instead of one per object (each costs more
        than a small object's read)."""
        if self._pool is None:
            raise ValueError("this Pool is closed")
        jobs = [job for read in reads for job in _jobs(*read)]
        started = _submit(self._pool, self._run_all, jobs)
        self._started.append(started)
        return started

    def _run_all(self, jobs: list[tuple]) -> None:
        for job in jobs:
            self._run(*job)

    def _run(self, *job: Any) -> None:
        reader = getattr(self._local, "reader", None)
        if reader is None:
            reader = self._local.reader = Reader(self.objects, self.url)
        reader.read_object(*job)


class Reader:
    """Reads stored objects of a checkpoint (``root``: a local directory, or
    any :class:`Sources`); holds one reused buffer (one Reader per thread)."""

    file_order = True  # whole objects of known size: data first, index last (see _in_file_order)

    def __init__(self, root: str | Sources, url: str):
        self.objects, self.url = sources_of(root), url
        self._buf = np.empty(0, np.uint8)

    def read(self, key: str, entry: TensorEntry, want: Box, dst: np.ndarray, digests: list[str] | None = None) -> None:
        """Fill ``dst`` with the stored elements of ``want`` (as :meth:`Pool.read`, on this thread)."""
        for piece in read_plan(entry.shape, entry.chunk_shape, want):
            self.read_object(key, entry, piece.chunk, want, dst, _digest_of(entry, piece.chunk, digests))

    # ------------------------------------------------------------ one object

    def read_object(self, key: str, e: TensorEntry, pos: tuple[int, ...], want: Box, dst: np.ndarray,
                    digest: str | None = None) -> None:
        """Fill the part of ``dst`` (``want``'s elements) that the stored
        object at grid position ``pos`` holds; where it reads the whole
        object, check its ``digest`` (if given; spec 7.1)."""
        rel = f"{key}/{chunk_key(pos)}"
        where = f"{self.url}/{rel}: tensor {key!r}, chunk {pos}"
        g = codec.geometry(e)
        obj = self.objects.open(rel, where)
        try:
            least, most = g.bounds(pos)
            if obj.size is None and self.file_order and least <= WHOLE_READ_BYTES and _covers(g, pos, want):
                try:  # one request for data and index, at the size the reference writer gives the object
                    whole = obj.pread(least, 0)
                except CorruptCheckpointError:  # shorter, or missing: read index first below, which says so
                    whole = b""
                if len(whole) == least and self._in_file_order(InMemory(whole), g, pos, want, dst, digest, where):
                    return
            if obj.size is None:  # not asked (a request saved): the index CRC and the entries' checks bound every read
                raw = obj.tail(g.index_bytes)
                try:
                    index = codec.decode_index(g, raw, where)
                except CorruptCheckpointError:
                    _check_size(obj.measure(), g, most, where)  # a size that explains the damage is named first
                    raise
                data_end = most - g.index_bytes  # an entry past the real data reads the index or too little: refused
            else:
                _check_size(obj.size, g, most, where)
                data_end = obj.size - g.index_bytes
                if g.count == 1 and self._single(obj, g, pos, want, dst, digest):
                    return
                if self.file_order and self._in_file_order(obj, g, pos, want, dst, digest, where):
                    return
                index = codec.decode_index(g, obj.pread(g.index_bytes, data_end), where)
            per_buf = max(1, obj.run_bytes // g.encoded)
            self._read_inner(obj, codec.plan_reads(g, index, data_end, pos, want, per_buf, where), dst, digest)
        finally:
            obj.close()

    def _single(self, obj: Stored, g: codec.Geometry, pos: tuple[int, ...], want: Box, dst: np.ndarray,
                digest: str | None) -> bool:
        """Read an object of one inner chunk that ``want`` covers in one call
        (the common small tensor: no read plan), with every check the general
        path makes; True once done. False, with nothing written to ``dst``,
        where it is laid out otherwise or fails a check: the general path
        then reads it again and names what is wrong."""
        size = g.encoded + g.index_bytes
        if obj.size != size or not _covers(g, pos, want):
            return False
        raw = obj.pread(size, 0)
        body = g.encoded - 4
        stored = raw[body:g.encoded]  # the inner chunk's CRC-32C
        if (len(raw) != size or raw[g.encoded:g.encoded + 16] != _one_entry(g.encoded)
                or codec.crc32c(raw[g.encoded:], 16) != int.from_bytes(raw[-4:], "little")
                or codec.crc32c(raw, body) != int.from_bytes(stored, "little")
                or (digest is not None and codec.digest_of_crcs(stored) != digest)):
            return False
        shard = chunk_box(pos, g.chunk, g.shape)
        block = np.frombuffer(raw, g.dtype, count=g.numel).reshape(g.inner)
        dst[shard.relative_to(want).slices()] = block[tuple(slice(0, n) for n in shard.shape)]
        return True

    def _in_file_order(self, obj: Stored, g: codec.Geometry, pos: tuple[int, ...], want: Box, dst: np.ndarray,
                       digest: str | None, where: str) -> bool:
        """Read an object that ``want`` covers whole and whose size is the
        reference writer's in one sequential pass, data first and index last
        (no seek back to the index at its end before the data: on a cold
        disk that is one random read per object), taking the index to be the
        one :func:`codec.encode` writes; True once done. False, with nothing
        to trust in ``dst``'s part yet, where the object is laid out otherwise
        (another writer's order) or fails a check: the caller then reads it
        index first, which names any damage."""
        if obj.size != g.bounds(pos)[0] or not _covers(g, pos, want):
            return False
        assumed = codec.reference_index(g, pos)
        data_end = obj.size - g.index_bytes
        try:
            reads = codec.plan_reads(g, assumed, data_end, pos, want, max(1, obj.run_bytes // g.encoded), where)
            self._read_inner(obj, reads, dst, digest)
            index = codec.decode_index(g, obj.pread(g.index_bytes, data_end), where)
        except CorruptCheckpointError:
            return False
        return bool(np.array_equal(index, assumed))

    def _scratch(self, n: int) -> memoryview:
        """This reader's reused buffer, of at least ``n`` bytes."""
        if len(self._buf) < n:
            self._buf = np.empty(n, np.uint8)
        return self._buf.data

    def _read_inner(self, obj: Stored, reads: codec.Reads, dst: np.ndarray, digest: str | None = None) -> None:
        """Read, check and copy into ``dst`` the inner chunks ``reads`` names;
        for a whole read, compare the object's ``digest`` (if given) with the
        one its stored CRC-32Cs give."""
        g = reads.geometry
        crcs = bytearray(4 * len(reads.corder)) if digest is not None and reads.whole else None
        body = g.encoded - 4
        check, src, to, encoded = reads.check, reads.src, reads.dst, g.encoded
        spans = [(first, (b - a) * encoded) for first, a, b in reads.runs]
        for (_, a, b), view in zip(reads.runs, obj.fill(spans, self._scratch), strict=True):
            nbytes = (b - a) * encoded
            if len(view) != nbytes:
                raise reads.short(len(view), nbytes)
            buf = np.frombuffer(view, np.uint8)
            addr = buf.ctypes.data
            for k in range(a, b):
                at = (k - a) * encoded
                check(k, view, addr, at)
                if crcs is not None:
                    j = 4 * int(reads.corder[k])
                    crcs[j:j + 4] = view[at + body:at + body + 4]
                dst[to[k]] = np.frombuffer(buf, g.dtype, count=g.numel, offset=at).reshape(g.inner)[src[k]]
            del buf, view  # a store's own read buffer (kvobjects) goes before the next is made
        if crcs is not None and reads.digest(crcs) != digest:
            raise CorruptCheckpointError(
                f"{reads.where}, does not have the digest its array records for this place: its inner chunks "
                "are intact but belong elsewhere (a chunk swapped or replayed from another tensor, position "
                "or checkpoint, or its inner chunks reordered)"
            )


def _jobs(key: str, entry: TensorEntry, want: Box, dst: np.ndarray, digests: list[str] | None) -> list[tuple]:
    """:meth:`Reader.read_object`'s arguments for each stored object ``want`` overlaps."""
    return [(key, entry, p.chunk, want, dst, _digest_of(entry, p.chunk, digests))
            for p in read_plan(entry.shape, entry.chunk_shape, want)]


@functools.lru_cache(maxsize=256)
def _one_entry(encoded: int) -> bytes:
    """The index entry of an object's only inner chunk, stored first: offset 0, ``encoded`` bytes."""
    return (0).to_bytes(8, "little") + encoded.to_bytes(8, "little")


def _covers(g: codec.Geometry, pos: tuple[int, ...], want: Box) -> bool:
    """Whether ``want`` holds every element of the object at grid position ``pos``."""
    shard = chunk_box(pos, g.chunk, g.shape)
    return shard.intersect(want) == shard


def _check_size(size: int | None, g: codec.Geometry, most: int, where: str) -> None:
    """Refuse an object of ``size`` bytes (None: unknown) that its inner
    chunks and index cannot make (``most``: the largest they make)."""
    if size is None:
        return
    if size > most:
        raise CorruptCheckpointError(
            f"{where}, is {size} bytes, more than its inner chunks and index can take ({most}): "
            "it is damaged or forged"
        )
    if size < g.index_bytes:
        raise CorruptCheckpointError(
            f"{where}, is malformed (truncated or damaged): {size} bytes, "
            f"shorter than its shard index ({g.index_bytes} bytes)"
        )


def _digest_of(entry: TensorEntry, pos: tuple[int, ...], digests: list[str] | None) -> str | None:
    """Chunk ``pos``'s entry of ``digests`` (C order of the grid), if any."""
    if digests is None:
        return None
    grid = tuple(-(-s // c) for s, c in zip(entry.shape, entry.chunk_shape))
    return digests[int(np.ravel_multi_index(pos, grid))] if grid else digests[0]
