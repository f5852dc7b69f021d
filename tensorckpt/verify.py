"""``tensorckpt.verify(path)``: check a whole checkpoint, as a reader should
before it trusts one from elsewhere (spec section 12).

- The root metadata (spec 9.5), every array ``zarr.json`` against its index
  entry (section 7), and the intermediate groups (section 4).
- Every chunk of every tensor: it is stored, it is a regular file (local
  stores), its size lies within what its inner chunks and index take, and it
  decodes with correct CRC-32C checksums (read like ``load`` reads: by
  :mod:`tensorckpt.storage.direct` on local files, else TensorStore).
- Since format 1.3 (spec 7.1, 9.8), position and version: the root's
  checksum (on open), each array ``zarr.json``'s digest as the root records
  it and its checkpoint id, and every chunk's digest as its array records it
  (:func:`_check_digest`: a chunk in the wrong place, or from another
  checkpoint, has intact CRC-32Cs but not its place's digest).

Memory stays bounded: a chunk is read in blocks of at most ``block_bytes``
cut along its inner chunks, a few blocks at a time. The work follows what is
stored, not what the index claims: stored chunks are found by listing, and a
chunk too small for what it should hold is reported without being read.
Problems are collected, not raised; only a missing checkpoint, an unsupported
version or an unreadable location raise.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorstore as ts

from .checkpoint import Checkpoint
from .errors import (
    CheckpointChangedError,
    CheckpointPermissionError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    TensorckptError,
)
from .format.metadata import loads
from .layout.boxes import Box
from .storage import arrays, codec, direct, location
from .storage.backend import backend_for
from .storage.reader import StoredArrays, chunk_error, read_object

BLOCK_BYTES = 16 << 20  # largest region read at once (an inner chunk larger than this is read alone)
IN_FLIGHT = 4  # blocks read concurrently
SHOWN_MISSING = 5  # missing chunks named in a report; the rest are counted

Progress = Callable[[int, int], None]  # (bytes checked so far, bytes in all tensors)
# the reads of one block in flight: (chunk position, bytes, what to wait on)
_Job = tuple[tuple[int, ...], int, Sequence[Future[None] | ts.WriteFutures]]


@dataclass(frozen=True)
class Problem:
    kind: str  # "incomplete" (never committed), "corrupt", or "permission" (exists, may not be read)
    where: str  # the file or stored object at fault
    message: str


@dataclass
class VerifyReport:
    path: str
    tensors: int = 0  # tensors whose metadata and chunks were checked
    chunks: int = 0  # stored chunks checked
    bytes: int = 0  # bytes of tensor data read back intact
    digests: int | None = None  # chunk digests that matched their place (spec 7.1); None: none stored (before 1.3)
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def status(self) -> str:
        if any(p.kind == "incomplete" for p in self.problems):
            return "incomplete"
        if self.problems and all(p.kind == "permission" for p in self.problems):
            return "unreadable"
        return "corrupt" if self.problems else "ok"

    def to_json(self) -> dict:
        return {
            "path": self.path, "ok": self.ok, "status": self.status,
            "tensors": self.tensors, "chunks": self.chunks, "bytes": self.bytes, "digests": self.digests,
            "problems": [{"kind": p.kind, "where": p.where, "message": p.message} for p in self.problems],
        }


def verify(path: location.PathArg, *, progress: Progress | None = None, block_bytes: int = BLOCK_BYTES,
           storage_options: Mapping[str, Any] | None = None) -> VerifyReport:
    """Check the checkpoint at ``path`` completely; see the module docstring.
    ``progress(done, total)`` is called as tensor bytes are checked;
    ``storage_options`` as in :func:`tensorckpt.save`."""
    loc = location.parse(path, storage_options)
    report = VerifyReport(loc.url)
    try:
        ckpt = Checkpoint(loc)
    except IncompleteCheckpointError as e:
        report.problems.append(Problem("incomplete", loc.url, str(e)))
        return report
    except CorruptCheckpointError as e:
        report.problems.append(Problem("corrupt", f"{loc.url}/zarr.json", str(e)))
        return report
    _check_groups(ckpt, report)
    if ckpt.index.checkpoint_id:
        report.digests = 0
    total = sum(e.nbytes for e in ckpt.index.tensors.values())

    def tick() -> None:
        if progress is not None:
            progress(report.bytes, total)

    fast = backend_for(loc).fast_chunks
    changed = CheckpointChangedError(
        f"{ckpt.path}: the checkpoint was replaced or deleted while it was verified; verify it again"
    )
    with ckpt, backend_for(loc).chunk_reader(ckpt.read_location, ckpt.path, threads=2) or contextlib.nullcontext() as pool:
        try:
            for key in sorted(ckpt.index.tensors):
                usable = fast and direct.usable(ckpt.index.tensors[key])
                _check_tensor(ckpt, key, report, tick, block_bytes, pool if usable else None)
        except OSError:
            if ckpt.changed():
                raise changed from None
            raise
        # problems a replace or deletion caused are not corruption; nor is a report of two versions
        if (report.problems or not ckpt.pinned) and ckpt.changed():
            raise changed
    return report


def _check_groups(ckpt: StoredArrays, report: VerifyReport) -> None:
    """Every proper prefix of a tensor's key must be a Zarr group (spec section 4)."""
    prefixes = {k.rsplit("/", i)[0] for k in ckpt.index.tensors for i in range(1, k.count("/") + 1)}
    for prefix in sorted(prefixes):
        where = f"{ckpt.path}/{prefix}/zarr.json"
        try:
            data = read_object(ckpt.read_location, f"{prefix}/zarr.json")
            if data is None:
                raise CorruptCheckpointError(f"{where}: missing; every prefix of a tensor's key must be a group")
            doc = loads(data, where)
            if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
                raise CorruptCheckpointError(f"{where}: not a Zarr v3 group")
        except CorruptCheckpointError as e:
            report.problems.append(Problem("corrupt", where, str(e)))


def _check_tensor(ckpt: StoredArrays, key: str, report: VerifyReport, tick: Callable[[], None], block_bytes: int,
                  pool: direct.Pool | None = None) -> None:
    """Check one tensor's metadata and every stored chunk: through ``pool``
    (:mod:`tensorckpt.storage.direct`, local checkpoints) or TensorStore."""
    e = ckpt.index.tensors[key]
    where = f"{ckpt.path}/{key}"
    try:
        if pool is None:
            arr = ckpt.array(key)
        else:
            ckpt.check_arrays([key])  # the pool reads without TensorStore
    except CorruptCheckpointError as err:
        report.problems.append(Problem("corrupt", f"{where}/zarr.json", str(err)))
        return  # its chunks cannot be interpreted
    report.tensors += 1
    if math.prod(e.shape) == 0:
        return  # no chunks
    stored = ckpt.chunk_objects(key)
    grid = [-(-s // c) for s, c in zip(e.shape, e.chunk_shape)]
    _report_missing(key, where, grid, stored, report)
    d = e.dtype_info
    failed: set[tuple[int, ...]] = set()
    pending: collections.deque[_Job] = collections.deque()

    def settle(job: _Job) -> None:
        pos, nbytes, futures = job
        try:
            for future in futures:
                future.result()
        except (ValueError, CorruptCheckpointError, CheckpointPermissionError) as err:
            if pos not in failed:
                failed.add(pos)
                msg = str(err) if isinstance(err, TensorckptError) else chunk_error(ckpt.path, key, str(err))
                kind = "permission" if isinstance(err, CheckpointPermissionError) else "corrupt"
                report.problems.append(Problem(kind, _object(where, pos), msg))
            return
        report.bytes += nbytes
        tick()

    for pos in sorted(stored):
        report.chunks += 1
        size, (need, most) = stored[pos], arrays.object_bytes_bounds(e, pos)
        if size is None or not need <= size <= most:  # not read: a FIFO would block, a link leads outside
            what = "is not a regular file" if size is None else (
                f"is {size} bytes, but its inner chunks and index need at least {need}: it is truncated"
                if size < need else f"is {size} bytes, more than its inner chunks and index can take ({most})")
            obj = _object(where, pos)
            report.problems.append(Problem("corrupt", obj, f"{obj}: tensor {key!r}, chunk {pos}, {what}"))
            continue
        lo = tuple(i * c for i, c in zip(pos, e.chunk_shape))
        hi = tuple(min(a + c, s) for a, c, s in zip(lo, e.chunk_shape, e.shape))
        for blo, bhi in _blocks(lo, hi, e.inner_chunk_shape, d.itemsize, block_bytes):
            out = np.empty(tuple(h - l for l, h in zip(blo, bhi)), dtype=d.numpy)
            futures: Sequence[Future[None] | ts.WriteFutures]
            if pool is not None:
                futures = pool.read(key, e, Box(tuple(blo), out.shape), out)
            else:
                src = arr[tuple(slice(l, h) for l, h in zip(blo, bhi))] if blo else arr
                futures = [ts.array(out, copy=False, write=True).write(src)]
            pending.append((pos, out.nbytes, futures))
            if len(pending) >= IN_FLIGHT:
                settle(pending.popleft())
    while pending:
        settle(pending.popleft())
    digests = ckpt.chunk_digests(key)
    if digests is None:
        return  # before format 1.3
    for pos in sorted(stored):
        size, (need, most) = stored[pos], arrays.object_bytes_bounds(e, pos)
        if pos in failed or size is None or not need <= size <= most:
            continue  # reported above
        if _check_digest(ckpt, key, pos, size, digests, report, block_bytes):
            report.digests = (report.digests or 0) + 1


def _check_digest(ckpt: StoredArrays, key: str, pos: tuple[int, ...], size: int, digests: list[str],
                  report: VerifyReport, block_bytes: int) -> bool:
    """Compare the digest of chunk ``pos`` (its data already read intact) with
    the one its array records for that place (spec 7.1): from its index and
    the stored CRC-32C of each inner chunk, read in spans of at most
    ``block_bytes``. Returns whether it matched."""
    e = ckpt.index.tensors[key]
    obj = _object(f"{ckpt.path}/{key}", pos)
    g = codec.geometry(e)
    backend, name = backend_for(ckpt.location), f"{key}/{arrays.chunk_key(pos)}"
    where = f"{obj}: tensor {key!r}, chunk {pos}"

    def read(start: int, length: int) -> bytes:
        raw = backend.read_range(ckpt.read_location, name, start, length)
        if raw is None or len(raw) != length:
            raise CorruptCheckpointError(f"{where}, changed while it was verified")
        return raw

    try:
        index = codec.decode_index(g, read(size - g.index_bytes, g.index_bytes), where)
        places = [at for _, at in codec.stored_crcs(g, index, pos)]
        crcs, span = {}, sorted(places)
        while span:
            first = span[0]
            group = [at for at in span if at + 4 - first <= max(block_bytes, 4)]
            raw = read(first, group[-1] + 4 - first)
            crcs.update({at: raw[at - first:at - first + 4] for at in group})
            span = span[len(group):]
        grid = [-(-s // c) for s, c in zip(e.shape, e.chunk_shape)]
        want = digests[int(np.ravel_multi_index(pos, grid))] if grid else digests[0]
        if codec.digest_of_crcs(b"".join(crcs[at] for at in places)) != want:
            raise CorruptCheckpointError(
                f"{where}, does not have the digest its array records for this place: its inner chunks are intact "
                "but belong elsewhere (a chunk swapped or replayed from another tensor, position or checkpoint, "
                "or its inner chunks reordered)"
            )
    except CorruptCheckpointError as err:
        report.problems.append(Problem("corrupt", obj, str(err)))
        return False
    return True


def _report_missing(key: str, where: str, grid: list[int], stored: dict, report: VerifyReport) -> None:
    """Name the first few grid positions without a stored chunk and count the
    rest. The loop stops after ``len(stored) + SHOWN_MISSING`` positions, so a
    forged grid of 2^60 chunks costs no more than the real ones."""
    count = math.prod(grid) - len(stored)
    if count <= 0:
        return
    shown = []
    for pos in _positions(grid):
        if pos not in stored:
            shown.append(pos)
            if len(shown) == SHOWN_MISSING:
                break
    names = ", ".join(_object(where, p).removeprefix(where + "/") for p in shown)
    more = f" and {count - len(shown)} more" if count > len(shown) else ""
    report.problems.append(Problem(
        "corrupt", _object(where, shown[0]),
        f"{where}: tensor {key!r}: {count} of {math.prod(grid)} chunks are missing: {names}{more}",
    ))


def _positions(grid: list[int]) -> Iterator[tuple[int, ...]]:
    """Grid positions in C order, lazily: ``itertools.product`` would first
    build every ``range`` as a tuple, 2^31 entries for a forged grid."""
    pos = [0] * len(grid)
    while True:
        yield tuple(pos)
        d = len(grid) - 1
        while d >= 0 and pos[d] == grid[d] - 1:
            pos[d] = 0
            d -= 1
        if d < 0:
            return
        pos[d] += 1


def _object(where: str, pos: tuple[int, ...]) -> str:
    return f"{where}/{arrays.chunk_key(pos)}"


def _blocks(
    lo: tuple[int, ...], hi: tuple[int, ...], inner: tuple[int, ...], itemsize: int, limit: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split the box ``[lo, hi)`` (one chunk, within the array) into blocks
    along inner-chunk boundaries, each at most ``limit`` bytes unless a single
    inner chunk is larger. Leading dimensions are cut first."""
    block = [h - l for l, h in zip(lo, hi)]
    for d in range(len(block)):
        if math.prod(block) * itemsize <= limit:
            break
        rest = math.prod(block) * itemsize // block[d]  # bytes of one index along d
        block[d] = min(block[d], max(inner[d], limit // rest // inner[d] * inner[d]))
    starts = [range(l, h, b) for l, h, b in zip(lo, hi, block)]
    for start in itertools.product(*starts):
        yield start, tuple(min(s + b, h) for s, b, h in zip(start, block, hi))
