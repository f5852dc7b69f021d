"""The codec of every stored object, in memory: ``sharding_indexed`` with
inner chunks ``bytes`` (little-endian) + ``crc32c`` and the shard index
(``bytes`` + ``crc32c``) at the end (spec section 7, "Arrays").

Pure: no file I/O. :mod:`tensorckpt.storage.direct` (the local fast path:
open, ``preadv``, writes, fsync, threads, buffers) and
:func:`tensorckpt.storage.arrays.encode_whole_chunk` (small objects written
through the kvstore) call it; the bytes are TensorStore's
(tests/test_direct.py, tests/test_small_writes.py compare them).

- :func:`geometry` -- the layout of one array's stored objects, a frozen
  :class:`Geometry` built once per :class:`TensorEntry` (:func:`geometry_of`
  from its fields: the save's helper process, :mod:`.offload`).
- :func:`encode` / :func:`encode_bytes` -- one stored object from a chunk's
  elements: inner chunk by inner chunk in C order (elements, then their
  CRC-32C), the index last; into a caller's reused buffer, piece by piece,
  or as one ``bytes``.
- :func:`new_digest` / :func:`chunk_digest` / :func:`digest_of_crcs` -- the
  object digest of format 1.3 (spec 7.1): SHA-256 over the stored CRC-32Cs
  of the object's inner chunks in C order of the inner grid, computed while
  encoding (:func:`encode` feeds it), from a chunk's elements alone (objects
  TensorStore writes), or from what a reader read (:meth:`Reads.digest`,
  :func:`stored_crcs`).
- :func:`decode_index` -- a shard index checked (size, CRC-32C);
  :func:`plan_reads` -- the inner chunks of one object that a wanted box
  needs, their index entries checked (the empty marker, length == the
  encoded size, inside the data region, no two overlapping), in file order,
  grouped into contiguous reads; :meth:`Reads.check` -- one inner chunk's
  CRC-32C.

It lives in ``storage/`` rather than ``format/`` because it is the byte
encoding the storage layer writes and reads, uses the layout's box math and
the native CRC-32C library, and ``format/`` imports nothing but itself.
Errors are :class:`CorruptCheckpointError` naming the object (``where``,
given by the caller: "URL/key/c/i/j: tensor 'k', chunk (i, j)") and the
inner chunk.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import itertools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import google_crc32c
import numpy as np

from ..errors import CorruptCheckpointError
from ..layout.boxes import Box, chunk_box, chunk_ranges

if TYPE_CHECKING:  # not imported: the save's helper process imports this module without torch (offload_helper.py)
    from ..format.metadata import TensorEntry

EMPTY = 2**64 - 1  # both fields of the index entry of an inner chunk never written
Crc = Callable[[int, Any, int], int]  # (crc so far, an address or bytes, length) -> crc


def _hardware_crc() -> Crc | None:
    """google-crc32c's C function ``crc32c_extend(crc, address, length)``
    (hardware CRC-32C where the CPU has it), called on memory addresses: its
    Python API only takes ``bytes``, which would cost a copy per chunk."""
    if google_crc32c.implementation != "c":
        return None
    libs = os.path.join(os.path.dirname(os.path.dirname(google_crc32c.__file__)), "google_crc32c.libs")
    for candidate in sorted(glob.glob(os.path.join(libs, "libcrc32c*.so*"))) + ["libcrc32c.so.1"]:
        try:
            lib = ctypes.CDLL(candidate)
        except OSError:
            continue
        fn = lib.crc32c_extend
        fn.restype, fn.argtypes = ctypes.c_uint32, [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        return fn
    return None


crc32c_at: Crc | None = _hardware_crc()
"""``crc32c_at(0, address, length)``: the CRC-32C of memory, or None where
there is no native function (then :func:`decode_index` and
:meth:`Reads.check` are not usable; :func:`encode` still is)."""


def crc32c(data: bytes, length: int | None = None) -> int:
    """The CRC-32C of ``data`` (of its first ``length`` bytes, without a copy
    where the native function exists)."""
    n = len(data) if length is None else length
    if crc32c_at is not None:
        return crc32c_at(0, data, n)  # ctypes passes bytes as their address
    return int(google_crc32c.value(data[:n]))


class Digest(Protocol):
    """What :func:`new_digest` returns (hashlib's running hash)."""

    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_digest() -> Digest:
    """A running object digest (spec 7.1): SHA-256, fed the stored CRC-32C
    (4 bytes, little-endian) of each inner chunk in C order of the inner grid."""
    return hashlib.sha256()


def digest_of_crcs(crcs: bytes) -> str:
    """The object digest (64 lower-case hex digits) of the concatenated
    stored CRC-32Cs of its inner chunks, in C order of the inner grid."""
    return hashlib.sha256(crcs).hexdigest()


# ------------------------------------------------------------------ geometry


@dataclass(frozen=True)
class Geometry:
    """The layout of an array's stored objects (one per chunk)."""

    shape: tuple[int, ...]  # the array's
    chunk: tuple[int, ...]  # one stored object's (a shard)
    inner: tuple[int, ...]  # one inner chunk's
    grid: tuple[int, ...]  # inner chunks per object along each dimension
    count: int  # inner chunks per object
    dtype: np.dtype  # of the elements (the host's order: callers run on little-endian hosts)
    numel: int  # elements of one inner chunk
    encoded: int  # bytes of one encoded inner chunk: its elements, then a CRC-32C
    index_bytes: int  # bytes of the index: 16 per inner chunk, then a CRC-32C

    def bounds(self, pos: tuple[int, ...]) -> tuple[int, int]:
        """The least and the most bytes the object at grid position ``pos``
        can hold: every inner chunk that intersects the array, then the
        index; at most every inner chunk of the shard."""
        clipped = tuple(min(p * c + c, s) - p * c for p, c, s in zip(pos, self.chunk, self.shape))
        return self.stored_bytes(clipped), self.count * self.encoded + self.index_bytes

    def stored_bytes(self, elements: tuple[int, ...]) -> int:
        """The size of the object :func:`encode` makes of a chunk whose
        elements (its box clipped to the array) have shape ``elements``."""
        return math.prod(-(-n // i) for n, i in zip(elements, self.inner)) * self.encoded + self.index_bytes


@functools.lru_cache(maxsize=1 << 12)
def geometry(entry: TensorEntry) -> Geometry:
    """The :class:`Geometry` of ``entry``'s array (cached: entries are immutable)."""
    return geometry_of(tuple(entry.shape), tuple(entry.chunk_shape), tuple(entry.inner_chunk_shape), entry.dtype_info.numpy)


def geometry_of(shape: tuple[int, ...], chunk: tuple[int, ...], inner: tuple[int, ...], dtype: np.dtype) -> Geometry:
    """The :class:`Geometry` of an array of ``shape`` stored in objects of
    ``chunk`` with inner chunks ``inner`` (checked metadata: ``inner``
    divides ``chunk``) of elements ``dtype``."""
    grid = tuple(c // i for c, i in zip(chunk, inner))
    numel, count = math.prod(inner), math.prod(grid)
    return Geometry(shape, chunk, inner, grid, count, dtype, numel, numel * dtype.itemsize + 4, 16 * count + 4)


# ------------------------------------------------------------------ encoding


def encode(g: Geometry, data: np.ndarray, buf: np.ndarray, digest: Digest | None = None,
           align: int = 1) -> Iterator[memoryview]:
    """The stored object of one chunk, as views of ``buf`` (a uint8 array of
    at least ``g.encoded`` bytes, ``align + g.encoded`` with ``align``; each
    view is valid until the next one is asked for), the index last. ``data``
    holds the chunk's elements: its box clipped to the array, any strides.
    Inner chunks wholly outside the array are not stored (their index entry
    is empty); the rest of an edge inner chunk is the zero fill value.

    ``align``: every view but the last two (the data's last bytes past a
    multiple of ``align``, the index) starts at ``buf``'s start and is a
    multiple of ``align`` bytes long (the bytes past the last multiple move
    to the buffer's start and go out with the next view), so with ``buf``
    page-aligned a writer can hand all but the object's end to ``O_DIRECT``
    (:func:`.files.write_durable`)."""
    if data.ndim != len(g.chunk) or any(n > c for n, c in zip(data.shape, g.chunk)):
        raise ValueError(f"a chunk of shape {g.chunk} cannot hold elements of shape {data.shape}")
    if len(buf) < g.encoded + (align if align > 1 else 0):
        raise ValueError(f"a buffer of {len(buf)} bytes cannot hold an inner chunk of {g.encoded} (aligned to {align})")
    inner, encoded, body = g.inner, g.encoded, g.encoded - 4
    view, used, offset = buf.data, 0, 0
    native = crc32c_at
    if native is not None:
        addr = buf.ctypes.data

        def crc(at: int) -> int:
            return native(0, addr + at, body)
    else:
        def crc(at: int) -> int:
            return int(google_crc32c.value(bytes(view[at:at + body])))

    index = np.full((g.count, 2), EMPTY, "<u8")
    for j, which in enumerate(np.ndindex(*g.grid)):
        lo = tuple(w * i for w, i in zip(which, inner))  # inside the chunk
        if any(l >= n for l, n in zip(lo, data.shape)):
            continue  # wholly outside the array: not stored, marked empty
        size = tuple(min(i, n - l) for i, n, l in zip(inner, data.shape, lo))
        block = np.frombuffer(buf, g.dtype, count=g.numel, offset=used).reshape(inner)
        if size != inner:
            block.fill(0)  # the edge: elements outside the array are the zero fill value
        block[tuple(slice(0, n) for n in size)] = data[tuple(slice(l, l + n) for l, n in zip(lo, size))]
        stored = crc(used).to_bytes(4, "little")
        view[used + body:used + encoded] = stored
        if digest is not None:
            digest.update(stored)
        index[j] = (offset, encoded)
        used, offset = used + encoded, offset + encoded
        if used + encoded > len(buf):
            cut = used - used % align
            yield view[:cut]
            buf[:used - cut] = buf[cut:used]  # the unaligned rest (shorter than cut: no overlap) goes out next
            used -= cut
    cut = used - used % align
    if cut:
        yield view[:cut]
    if used > cut:
        yield view[cut:used]
    raw = index.tobytes()
    yield memoryview(raw + crc32c(raw).to_bytes(4, "little"))


def write_buffer(g: Geometry, target: int, align: int = 1) -> int:
    """The bytes of a writer's reused buffer for :func:`encode`: as many
    whole inner chunks as fit in ``target`` (at least one), plus ``align``
    for the carried rest when ``align > 1``."""
    return max(1, target // g.encoded) * g.encoded + (align if align > 1 else 0)


def encode_bytes(g: Geometry, data: np.ndarray) -> bytes:
    """The stored object of one chunk (as :func:`encode`) as one ``bytes``."""
    buf = np.empty(max(g.encoded, g.count * g.encoded), np.uint8)  # the whole object: no piece is overwritten
    return b"".join(encode(g, data, buf))


def chunk_digest(g: Geometry, data: np.ndarray, buf: np.ndarray | None = None) -> str:
    """The object digest of the stored object :func:`encode` makes of
    ``data`` (for objects TensorStore encodes and writes itself: the CRC-32Cs
    are its, tests/test_integrity.py compares). ``buf``: a reused scratch
    buffer of at least ``g.encoded`` bytes (None: one is allocated)."""
    if buf is None or len(buf) < g.encoded:
        buf = np.empty(max(g.encoded, min(g.count * g.encoded, 1 << 20)), np.uint8)
    h = new_digest()
    for _ in encode(g, data, buf, h):
        pass
    return h.hexdigest()


def encoded_bytes(g: Geometry, data: np.ndarray) -> tuple[bytes, str]:
    """:func:`encode_bytes` and the object's digest."""
    buf = np.empty(max(g.encoded, g.count * g.encoded), np.uint8)
    h = new_digest()
    return b"".join(encode(g, data, buf, h)), h.hexdigest()


def stored_crcs(g: Geometry, index: np.ndarray, pos: tuple[int, ...]) -> list[tuple[int, int]]:
    """Where the stored CRC-32C of each inner chunk of the object at grid
    position ``pos`` that intersects the array lies, in C order of the inner
    grid: ``(linear inner index, byte offset)``; ``index`` is checked
    (:func:`decode_index`) and its entries are checked here as
    :func:`plan_reads` checks them."""
    shard = chunk_box(pos, g.chunk, g.shape)
    present = []
    for j, which in enumerate(np.ndindex(*g.grid)):
        if all(w * i < n for w, i, n in zip(which, g.inner, shard.shape)):
            present.append(j)
    return [(j, int(index[j, 0]) + g.encoded - 4) for j in present]


def reference_index(g: Geometry, pos: tuple[int, ...]) -> np.ndarray:
    """The index :func:`encode` writes for the object at grid position
    ``pos``: the inner chunks that intersect the array back to back in C
    order of the inner grid, the rest empty (the layout a reader may read
    in file order before its index: :meth:`.direct.Reader.read_object`)."""
    shard = chunk_box(pos, g.chunk, g.shape)
    index = np.full((g.count, 2), EMPTY, "<u8")
    if not g.grid:
        index[0] = (0, g.encoded)
        return index
    lo = np.stack(np.meshgrid(*[np.arange(n) for n in g.grid], indexing="ij"), -1).reshape(-1, len(g.grid))
    present = (lo * np.asarray(g.inner) < np.asarray(shard.shape)).all(axis=1)
    index[present, 0] = np.arange(int(present.sum()), dtype="<u8") * g.encoded
    index[present, 1] = g.encoded
    return index


# ------------------------------------------------------------------ decoding


def decode_index(g: Geometry, raw: bytes, where: str) -> np.ndarray:
    """The index of a stored object (``raw``: its last ``g.index_bytes``
    bytes) as ``(count, 2)`` uint64 (offset, length) rows, its CRC-32C checked."""
    if len(raw) != g.index_bytes:
        raise CorruptCheckpointError(f"{where}, is malformed (truncated or damaged): the shard index is cut short")
    if crc32c(raw, len(raw) - 4) != int.from_bytes(raw[-4:], "little"):
        raise CorruptCheckpointError(f"{where}, shard index fails its CRC-32C checksum: the stored data is corrupt")
    return np.frombuffer(raw, "<u8", count=2 * g.count).reshape(g.count, 2)


@dataclass(frozen=True)
class Reads:
    """The inner chunks of one stored object that a read needs, in file
    order (``k`` counts them), their index entries checked. ``runs`` are
    ``(file offset, first k, end k)``: inner chunks stored back to back, at
    most ``per_buf`` of them, read in one call into a buffer that then holds
    inner chunk ``k`` at ``(k - first) * geometry.encoded``; ``src[k]``
    slices its part of the wanted box from the decoded inner chunk,
    ``dst[k]`` that part's place in the destination."""

    where: str
    geometry: Geometry
    crc: Crc  # the native CRC-32C (plan_reads refuses to plan without it)
    runs: list[tuple[int, int, int]]
    src: list[tuple[slice, ...]]
    dst: list[tuple[slice, ...]]
    names: np.ndarray  # grid position of inner chunk k, for messages
    most: int  # the largest run, in bytes
    corder: np.ndarray  # inner chunk k's rank in C order of the inner grid among those read
    whole: bool  # every inner chunk of the object that intersects the array is read

    def digest(self, crcs: bytearray) -> str:
        """The object digest, from ``crcs``: the stored CRC-32C of inner
        chunk ``k`` at ``4 * corder[k]`` (a whole read only)."""
        return digest_of_crcs(bytes(crcs))

    def check(self, k: int, view: memoryview, addr: int, at: int) -> None:
        """Check the CRC-32C of inner chunk ``k``, held in ``view`` (whose
        memory starts at address ``addr``) from byte ``at``."""
        body = self.geometry.encoded - 4
        if self.crc(0, addr + at, body) != int.from_bytes(view[at + body:at + body + 4], "little"):
            raise CorruptCheckpointError(
                f"{self.where}, inner chunk {_name(self.names[k])}, fails its CRC-32C checksum: the stored data is corrupt"
            )

    def short(self, got: int, nbytes: int) -> CorruptCheckpointError:
        """The error for a read of ``nbytes`` that returned ``got``."""
        return CorruptCheckpointError(f"{self.where}, is malformed (truncated or damaged): {got} of {nbytes} bytes read")


def plan_reads(g: Geometry, index: np.ndarray, data_end: int, pos: tuple[int, ...], want: Box,
               per_buf: int, where: str) -> Reads:
    """The :class:`Reads` of the object at grid position ``pos`` (its data
    region: the first ``data_end`` bytes) for the part of ``want`` inside it,
    after checking the index entries of exactly those inner chunks: none
    empty, each ``g.encoded`` bytes inside the data region, no two sharing a
    byte (the order they are stored in is the writer's choice: the reference
    writer's is C order, zarr-python's another)."""
    if crc32c_at is None:
        raise RuntimeError("reading stored objects in memory needs the native CRC-32C (google-crc32c's C build)")
    encoded = g.encoded
    shard = chunk_box(pos, g.chunk, g.shape)
    need = shard.intersect(want)
    if need is None:
        raise ValueError(f"chunk {pos} holds no element of {want}")
    local = Box(tuple(o - s for o, s in zip(need.offset, shard.offset)), need.shape)
    spans = chunk_ranges(local, g.inner, tuple(shard.shape))
    linear: np.ndarray
    if g.grid:
        axes = np.meshgrid(*[np.arange(r.start, r.stop) for r in spans], indexing="ij")
        grid = np.stack(axes, -1).reshape(-1, len(g.grid))
        linear = np.asarray(np.ravel_multi_index(tuple(grid.T), g.grid))
    else:  # a 0-d tensor: one inner chunk
        grid, linear = np.zeros((1, 0), np.int64), np.zeros(1, np.int64)
    entries = index[linear]
    _check_entries(g, entries, grid, data_end, where)
    order = np.argsort(entries[:, 0], kind="stable")
    offsets = entries[order, 0].astype(np.int64)
    if len(offsets) > 1 and (np.diff(offsets) < encoded).any():
        j = int(np.argmax(np.diff(offsets) < encoded))
        raise CorruptCheckpointError(
            f"{where}, inner chunks {_name(grid[order[j]])} and {_name(grid[order[j + 1]])}, are malformed "
            f"(damaged or forged): their index entries (offsets {int(offsets[j])} and {int(offsets[j + 1])}, "
            f"{encoded} bytes each) overlap; a writer stores each inner chunk in bytes of its own"
        )
    # runs of inner chunks stored back to back, each at most one buffer
    starts = [0]
    for b in (np.flatnonzero(np.diff(offsets) != encoded) + 1).tolist() + [len(offsets)]:
        while b - starts[-1] > per_buf:
            starts.append(starts[-1] + per_buf)
        starts.append(b)
    starts = sorted(set(starts))
    runs = [(int(offsets[a]), a, b) for a, b in itertools.pairwise(starts)]
    # in file order: each inner chunk's part of ``want``, in the inner chunk's and in dst's coordinates
    inner = np.asarray(g.inner, np.int64)
    lo = np.asarray(shard.offset, np.int64) + grid[order] * inner
    part_lo = np.maximum(lo, np.asarray(want.offset, np.int64))
    part_hi = np.minimum(np.minimum(lo + inner, np.asarray(g.shape, np.int64)), np.asarray(want.end, np.int64))
    src = [tuple(map(slice, a, b)) for a, b in zip((part_lo - lo).tolist(), (part_hi - lo).tolist())]
    dst = [tuple(map(slice, a, b)) for a, b in zip((part_lo - want.offset).tolist(), (part_hi - want.offset).tolist())]
    most = max((b - a) * encoded for _, a, b in runs)
    return Reads(where, g, crc32c_at, runs, src, dst, grid[order], most, order, need == shard)


def _check_entries(g: Geometry, entries: np.ndarray, grid: np.ndarray, data_end: int, where: str) -> None:
    """Refuse the first index entry (row ``j`` of ``entries``, the inner chunk
    at ``grid[j]``) that is empty, of another length than ``g.encoded``, or
    not inside the first ``data_end`` bytes."""
    encoded = g.encoded
    missing = (entries[:, 0] == EMPTY) & (entries[:, 1] == EMPTY)
    bad = ~missing & ((entries[:, 1] != encoded) | (entries[:, 0] > max(data_end - encoded, -1)))
    if not (missing.any() or bad.any() or data_end < encoded):
        return
    j = int(np.argmax(missing | bad)) if (missing.any() or bad.any()) else 0
    which = _name(grid[j])
    if missing[j]:
        raise CorruptCheckpointError(f"{where}, inner chunk {which}, is missing (never written)")
    raise CorruptCheckpointError(
        f"{where}, inner chunk {which}, is malformed (truncated or damaged): index entry "
        f"offset {int(entries[j, 0])}, length {int(entries[j, 1])}, where {encoded} bytes inside the "
        f"first {max(data_end, 0)} are expected"
    )


def _name(pos: np.ndarray) -> str:
    return "(" + ", ".join(str(int(x)) for x in pos) + ")"
