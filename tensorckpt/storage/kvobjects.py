"""A checkpoint's stored objects in a TensorStore kvstore (``s3://``,
``memory://``) for :mod:`.direct`'s Reader / Pool: the reads of load and
``Checkpoint.read`` there go through tensorckpt's own codec, as local and
fsspec ones do, so every check of :mod:`.codec` applies (index CRC, entries
inside the data, no overlaps, every inner chunk's CRC-32C, the chunk digests
of format 1.3). :class:`tensorckpt.storage.tskv.KvStore` gives them
(``chunk_reader``).

Each object is read by byte ranges of its kvstore (``KvStore.read(key,
byte_range=...)``): one the read needs whole of at most 1 MiB by one range of
the size this library's writer gives it, data and index together (direct.py
``WHOLE_READ_BYTES``; checked against the index that writer writes, else read
as follows); otherwise the shard index by a suffix range (``slice(-n, None)``:
S3's ``Range: bytes=-n``), so its size is never asked, then the inner chunks
it needs, stored back to back, in runs of at most ``RUN_BYTES``, all issued at
once and checked in order as they arrive; the reads in flight of all the
objects one reader reads at once (``THREADS``) hold at most
``IN_FLIGHT_BYTES`` (a :class:`Budget`), so its memory does not grow with the
objects' size.

Memory beyond the target (issue 14: a load's peak at most 1.2x its target):
each read's bytes are one allocation (TensorStore's result as ``bytes``),
freed as soon as its inner chunks are copied out (TensorStore's own copy
once converted, the caller's view right after it is used, before the next
read's bytes are made: tests/test_s3_memory.py), and all of them are made by
one thread (:class:`_BytesMaker`): glibc keeps freed blocks below its
dynamic mmap threshold (which rises to the largest block freed) in the arena
of the thread that allocated them, out of ``malloc_trim``'s reach, so eight
reading threads making their own kept up to eight arenas of free runs.
bench_s3's world-2 load (270 MiB per rank; 2026-12-01, a busy machine):
x1.43 of its target before, x1.05 with one maker (rep 1 x1.23, then x1.04),
the same 450 requests, the same time.

Without the size, safety rests on the checked metadata alone:
every read is at most one run, within what the object's inner chunks can take;
an entry past the real data reads the index (its CRC-32C fails) or too little
(refused as truncated); a damaged index is reported with the object's size
when the store gives it (:meth:`KvObject.measure`: one more request, only
then). A replace during the reads is the caller's to detect (the pinned root,
and the digests of 1.3).

Errors: a missing object or short read is a :class:`CorruptCheckpointError`
naming the object, tensor and chunk; any other failure of the store goes
through the backend's translation (S3: :func:`tensorckpt.storage.tskv.s3_error`,
naming the URL, the operation and what to fix), each wait bounded by the
backend's timeout (:func:`.kv.result`).
"""

from __future__ import annotations

import collections
import os
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import tensorstore as ts

from ..errors import CorruptCheckpointError, TensorckptError
from . import kv
from .location import Location

RUN_BYTES = 8 << 20  # one ranged request at most (S3's advice for ranged GETs: 8-16 MiB)
IN_FLIGHT_BYTES = 32 << 20  # reads in flight of one reader, all its objects together
THREADS = 8  # objects read at once (each waits on the network most of the time)
PROBE_AT = 1 << 40  # a byte offset past any stored object: the store answers with the object's size
_SIZE = re.compile(r"<ActualObjectSize>(\d+)</ActualObjectSize>|value of size (\d+)")

ErrorFn = Callable[[Location, ValueError, str], TensorckptError]


class _BytesMaker:
    """The one thread that turns every read's result into ``bytes``, for all
    the readers of this process (see the module's docstring: glibc keeps
    freed blocks in the arena of the thread that allocated them, so one
    allocating thread keeps one arena's worth, where eight reading threads
    kept eight). Started when first used; a forked child starts its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def bytes_of(self, r: ts.KvStore.ReadResult) -> bytes:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="tensorckpt-kv-bytes")
            pool = self._pool
        try:
            made = pool.submit(_value_of, r)
        except RuntimeError:  # the interpreter is exiting (no new threads): made here
            return r.value
        return made.result()

    def forget(self) -> None:
        self._lock, self._pool = threading.Lock(), None


def _value_of(r: ts.KvStore.ReadResult) -> bytes:
    return r.value


_MAKER = _BytesMaker()
os.register_at_fork(after_in_child=_MAKER.forget)


def size_in(msg: str) -> int | None:
    """The object size an out-of-range answer names (S3's 416
    ``ActualObjectSize``, the memory store's message), if any."""
    m = _SIZE.search(msg)
    return int(m.group(1) or m.group(2)) if m else None


class Budget:
    """Bytes of reads in flight, shared by the threads of one reader. A
    thread holding none waits for its first read; one holding some only
    adds reads that fit, so a thread always either progresses or holds
    nothing (no deadlock)."""

    def __init__(self, limit: int) -> None:
        self.free = limit
        self._cv = threading.Condition()

    def take(self, n: int, wait: bool) -> bool:
        with self._cv:
            if wait:
                while self.free < n:
                    self._cv.wait()
            elif self.free < n:
                return False
            self.free -= n
            return True

    def give(self, n: int) -> None:
        if n:
            with self._cv:
                self.free += n
                self._cv.notify_all()


class KvObjects:
    """The stored objects under ``loc``, for reading (see :class:`.direct.Sources`:
    TensorStore's arrays write them);
    ``error`` turns a failure of the store into the error to raise."""

    def __init__(self, loc: Location, error: ErrorFn) -> None:
        self.loc, self.error = loc, error
        self.budget = Budget(IN_FLIGHT_BYTES)
        try:
            self.store = kv.open_store(loc)
        except ValueError as e:
            raise error(loc, e, "opening the store") from e

    def open(self, rel: str, where: str) -> KvObject:
        return KvObject(self, rel, where)


class KvObject:
    """One stored object read by byte ranges (see :class:`.direct.Stored`);
    nothing is asked of the store until a read."""

    size: int | None = None  # never asked: a request saved per object
    run_bytes = RUN_BYTES

    def __init__(self, objects: KvObjects, rel: str, where: str) -> None:
        self.objects, self.rel, self.where = objects, rel, where
        self._pending: collections.deque[tuple[ts.Future, int, int, int]] = collections.deque()  # (read, offset, bytes, held)
        self._lent = 0  # the budget held by the bytes last given to the caller

    def _start(self, byte_range: slice) -> ts.Future:
        return self.objects.store.read(self.rel, byte_range=byte_range)

    def _result(self, future: ts.Future, wanted: int, start: int | None) -> bytes:
        """The bytes of a started read of ``wanted`` bytes from ``start``
        (None: a suffix, of which an object shorter than ``wanted`` gives
        none); a read past the object's end is refused as truncated."""
        objects = self.objects
        doing = f"reading {self.rel}"
        try:
            r = kv.result(objects.loc, future, doing)
        except ValueError as e:
            if "OUT_OF_RANGE" not in str(e):
                raise objects.error(objects.loc, e, doing) from e
            if start is None:
                return b""  # shorter than its index: the caller says so, with the size if the store gives it
            size = size_in(str(e))
            got = "fewer" if size is None else max(0, min(wanted, size - start))
            raise CorruptCheckpointError(
                f"{self.where}, is malformed (truncated or damaged): {got} of {wanted} bytes read") from None
        if r.state == "missing":
            raise CorruptCheckpointError(f"{self.where}, is missing")
        if r.state != "value":
            raise CorruptCheckpointError(f"{self.where}, cannot be read (the store answered {r.state!r})")
        return _MAKER.bytes_of(r)

    def pread(self, n: int, offset: int) -> bytes:
        return self._result(self._start(slice(offset, offset + n)), n, offset)

    def tail(self, n: int) -> bytes:
        return self._result(self._start(slice(-n, None)), n, None) if n else b""

    def measure(self) -> int | None:
        try:
            kv.result(self.objects.loc, self._start(slice(PROBE_AT, PROBE_AT + 1)), f"reading the size of {self.rel}")
        except ValueError as e:
            return size_in(str(e))
        return None  # PROBE_AT bytes or more: no size named

    def fill(self, runs: list[tuple[int, int]], scratch: Callable[[int], memoryview]) -> Iterator[memoryview]:
        todo = collections.deque(runs)
        budget = self.objects.budget
        while todo or self._pending:
            while todo and budget.take(held := min(todo[0][1], IN_FLIGHT_BYTES), wait=not self._pending):
                offset, nbytes = todo.popleft()
                self._pending.append((self._start(slice(offset, offset + nbytes)), offset, nbytes, held))
            future, offset, nbytes, self._lent = self._pending.popleft()  # close() gives it back if this fails
            view = memoryview(self._result(future, nbytes, offset))
            del future  # TensorStore's copy of the bytes goes now, not with the next read
            yield view
            try:
                view.release()  # the bytes go now, before the next read's are made
            except BufferError:
                pass  # the caller still holds them: they go with its last reference
            budget.give(self._lent)  # the caller is done with them
            self._lent = 0

    def close(self) -> None:
        """Give back what this object's reads hold (also when the caller
        stopped reading half-way: a refused inner chunk), cancelling those
        still in flight; the caller always closes it (``Reader.read_object``),
        so the budget never depends on when a dropped generator is collected."""
        budget = self.objects.budget
        while self._pending:
            future, _, _, held = self._pending.popleft()
            future.cancel()
            budget.give(held)
        budget.give(self._lent)
        self._lent = 0
