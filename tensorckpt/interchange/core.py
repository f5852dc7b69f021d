"""The streaming core of conversion: a *source* lists its tensors (key path,
dtype, shape) and values from metadata alone and reads any run of rows of a
tensor on demand; a *sink* consumes a source one bounded piece at a time.

Importing into tensorckpt goes through the library's own save path
(:mod:`tensorckpt.engine.save`) in one process: the whole save plan (chunk
grids, one entry per tensor) is built from the source's metadata before any
data is read, the checkpoint is staged by :func:`tensorckpt.storage.commit.begin`,
the data is written batch by batch by the engine's writer (the same
encoder, crc32c checksums and files as ``tensorckpt.save``), and the root
``zarr.json`` is committed last, atomically. One batch is written while
the next is read. Memory bound: a batch holds at most ``memory_bytes / 2``
of tensor data (``memory_bytes`` defaults to 256 MiB) or one stored object
(``shard_bytes``, default 64 MiB) if that is larger; a tensor larger than
that is read and written in slabs of whole stored objects along its first
dimension. With the writer's encoding buffers and threads the process
grows by about ``memory_bytes`` plus a few MiB of buffers (measured peak
RSS after a warm-up, 96 MiB state, 8 MiB bound: +8 to +11 MiB importing and
+8 exporting with glibc's mmap threshold fixed, which tests/test_convert.py
checks stays under 24 MiB; with glibc's default dynamic threshold freed
slabs stay in the heap and the same run grew by 10-43 MiB). Exports
(safetensors, DCP) likewise read the next slab of at most ``memory_bytes /
2`` while writing the current one, from a checkpoint saved by any number
of ranks (a slab reads the parts of every rank's stored objects it crosses;
no tensor is gathered whole: tests/test_export_memory.py). A ``torch.save``
export is the exception: one pickle of the whole selected state, which it
holds in memory. Every source byte is read once and every stored byte
written once.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TextIO, cast

import torch

from .. import __version__
from ..adapters.sharded import ShardedTensor
from ..adapters.state import unflatten
from ..engine import save as engine_save
from ..engine.seal import Digests, merge, seal
from ..errors import TensorckptError, UnsupportedValueError
from ..format import dtypes
from ..format.keys import flat_key, split_flat_key
from ..format.metadata import RootMetadata, TensorEntry, check_value
from ..layout import grid
from ..layout.boxes import Box
from ..layout.plan import LocalItem, LocalItems, LocalPlan, build_save_plan
from ..storage import commit, location

DEFAULT_MEMORY_BYTES = 256 << 20

Path = tuple[str, ...]


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of a source: its destination key path, dtype and shape;
    ``ref`` is whatever the source needs to find its bytes."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    ref: Any = None  # the source's handle; for a selected tensor, the source's SourceTensor

    @property
    def key(self) -> str:
        return flat_key(self.path)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * _itemsize(self.dtype) if self.shape else self.nbytes


class Source:
    """What every format reader provides. ``tensors`` and ``values`` come
    from metadata only; :meth:`read` reads rows ``[start, stop)`` of the
    first dimension (the whole tensor for a 0-d one)."""

    description = "source"
    tensors: list[SourceTensor]
    values: dict[Path, object]

    def read(self, t: SourceTensor, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    def row_align(self, t: SourceTensor) -> int:
        """Reads of ``t`` starting at multiples of this many rows read each
        stored byte once (a tensorckpt source: its inner chunks' rows)."""
        return 1

    def close(self) -> None:
        pass

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------- key selection


@dataclass
class Selection:
    """Which keys go to the destination and under what name: keys not
    starting with ``only`` are dropped, then ``strip_prefix`` is removed and
    ``add_prefix`` prepended, then ``rename(key)`` (returning a key, or None
    to drop it) is applied. Keys are flat keys (``model/layers.0.weight``)."""

    only: tuple[str, ...] = ()
    strip_prefix: str = ""
    add_prefix: str = ""
    rename: Callable[[str], str | None] | None = None

    def apply(self, key: str) -> str | None:
        if self.only and not any(key.startswith(p) for p in self.only):
            return None
        if self.strip_prefix and key.startswith(self.strip_prefix):
            key = key[len(self.strip_prefix):]
        key = self.add_prefix + key
        if self.rename is not None:
            new = self.rename(key)
            if new is not None and not isinstance(new, str):
                raise TensorckptError(f"rename({key!r}) returned {new!r}; it must return a str key or None")
            return new or None
        return key or None


def select(source: Source, sel: Selection) -> tuple[list[SourceTensor], dict[Path, object]]:
    """The source's tensors and values under their destination key paths."""
    tensors: list[SourceTensor] = []
    values: dict[Path, object] = {}
    seen: dict[str, str] = {}
    for t in source.tensors:
        key = sel.apply(t.key)
        if key is None:
            continue
        path = split_flat_key(key)
        _claim(seen, key, t.key, source)
        tensors.append(SourceTensor(path, t.dtype, t.shape, t))
    for p, v in source.values.items():
        key = sel.apply(flat_key(p))
        if key is None:
            continue
        _claim(seen, key, flat_key(p), source)
        values[split_flat_key(key)] = v
    return tensors, values


def _claim(seen: dict, key: str, was: str, source: Source) -> None:
    if key in seen:
        raise TensorckptError(
            f"{source.description}: keys {seen[key]!r} and {was!r} both become {key!r}; change the rename"
        )
    seen[key] = was


def cast_dtype(t: SourceTensor, dtype: torch.dtype | None) -> torch.dtype:
    """The destination dtype: ``dtype`` for floating-point tensors when given
    (integer and bool tensors keep theirs)."""
    return dtype if dtype is not None and t.dtype.is_floating_point else t.dtype


def read_cast(source: Source, t: SourceTensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of ``t`` (a selected tensor, ``ref`` the source's) in ``dtype``."""
    data = source.read(t.ref, start, stop)
    return data if data.dtype == dtype else data.to(dtype)


def prefetch(
    source: Source, jobs: Iterable[tuple[SourceTensor, int, int, torch.dtype]]
) -> Iterator[tuple[tuple[SourceTensor, int, int, torch.dtype], torch.Tensor]]:
    """``(job, rows read)`` for each ``(tensor, start, stop, dtype)`` job in
    order, the next one read by a background thread while the caller writes
    the current one: reading and writing overlap, with two slabs in memory."""
    with ThreadPoolExecutor(1, thread_name_prefix="tensorckpt-read") as pool:
        ahead: tuple[tuple[SourceTensor, int, int, torch.dtype], Future[torch.Tensor]] | None = None
        for job in jobs:
            fut = pool.submit(read_cast, source, *job)
            if ahead is not None:
                yield ahead[0], ahead[1].result()
            ahead = (job, fut)
        if ahead is not None:
            yield ahead[0], ahead[1].result()


def slabs(rows: int, rows_per: int, align: int = 1) -> Iterator[tuple[int, int]]:
    """Row ranges ``[a, b)`` covering ``rows``: ``rows_per`` rows each,
    rounded down to a multiple of ``align`` (at least ``align``)."""
    rows_per = max(align, rows_per - rows_per % align)
    for a in range(0, max(rows, 1), rows_per):
        yield a, min(rows, a + rows_per)


# ----------------------------------------------------------------- progress


class Progress:
    """Bytes done out of a total: tqdm when installed and ``stream`` is a
    terminal, else a plain one-line bar on stderr; nothing when disabled."""

    def __init__(self, total: int, label: str, enabled: bool | None = None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        on = enabled if enabled is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.total, self.done, self.label, self.shown, self.bar = total, 0, label, 0.0, None
        self.enabled = on
        if on:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label, file=self.stream)

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.shown < 0.2 and self.done < self.total:
            return
        self.shown = now
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        self.stream.write(f"\r{self.label} {frac:4.0%} {self.done / 2**20:.0f} / {self.total / 2**20:.0f} MiB")
        self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.shown:
            self.stream.write("\n")
            self.stream.flush()


# ------------------------------------------------------ import into tensorckpt


@dataclass
class _Part:
    """A batch of the save plan, shaped as the engine's writer reads a plan:
    the entries whose objects it writes, whose ``zarr.json`` it writes, and
    the regions of each."""

    entries: dict[str, TensorEntry]
    meta_writers: dict[str, int]
    values: dict
    regions: list[tuple[str, Box]] = field(default_factory=list)

    def writes_of(self, rank: int) -> tuple[tuple[str, Box], ...]:
        return tuple(self.regions)


@dataclass
class ImportReport:
    """What a conversion wrote: tensors, values, bytes read from the source
    and written, the largest batch held in memory, seconds."""

    path: str
    tensors: int = 0
    values: int = 0
    bytes_read: int = 0
    largest_batch_bytes: int = 0
    seconds: float = 0.0


def write_tensorckpt(
    source: Source,
    dst: location.PathArg,
    *,
    sel: Selection,
    dtype: torch.dtype | None = None,
    progress: bool | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    shard_bytes: int | None = None,
    inner_chunk_bytes: int | None = None,
    metadata: dict | None = None,
) -> ImportReport:
    """Write ``source`` as a committed tensorckpt checkpoint at ``dst``
    (module docstring: plan first, then bounded batches, commit last).
    Nothing is committed unless every tensor was read and written."""
    t0 = time.perf_counter()
    loc = location.parse(dst)
    tensors, values = select(source, sel)
    items, json_values = [], {}
    for t in tensors:
        d = cast_dtype(t, dtype)
        if dtypes.torch_name(d) not in dtypes.BY_TORCH:  # before anything is staged
            if d != t.dtype:
                raise UnsupportedValueError(
                    f"{source.description}: dtype={d} (asked for tensor {t.key!r}) cannot be stored by tensorckpt; "
                    f"storable: {', '.join(dtypes.BY_TORCH)}. Cast to one of them"
                )
            raise unsupported_dtype(str(t.dtype), t.key, source.description, list(dtypes.BY_TORCH))
        items.append(LocalItem(t.key, dtypes.for_torch(d, t.key).torch_name, t.shape, Box.full(t.shape)))
    for p, v in values.items():
        key = flat_key(p)
        json_values[key] = check_value(v, key)
    shard = shard_bytes or grid.DEFAULT_SHARD_BYTES
    plan = build_save_plan([LocalPlan(0, LocalItems.of(items), json_values)], shard, inner_chunk_bytes or grid.DEFAULT_INNER_BYTES)
    user = cast(dict, check_value(dict(metadata or {}), "metadata"))  # a dict stays a dict
    meta = RootMetadata(
        tensors=plan.entries,
        values=plan.values,
        library_version=__version__,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        world_size=1,
        user_metadata=user,
    )
    report = ImportReport(loc.url, len(tensors), len(values))
    bar = Progress(sum(t.nbytes for t in tensors), "convert", progress)
    c = commit.begin(loc, False, commit.new_token())
    stats = engine_save.SaveStats()
    try:
        # batch k is written (by the engine, in a thread) while batch k + 1 is read: two in memory
        with ThreadPoolExecutor(1, thread_name_prefix="tensorckpt-convert") as pool:
            writing = None
            digests: Digests = {}
            for part, state, held in _batches(source, tensors, plan.entries, dtype, max(memory_bytes // 2, 1), bar):
                if writing is not None:
                    merge(digests, writing.result())
                writing = pool.submit(_write_batch, state, part, c.write_to, stats)
                report.largest_batch_bytes = max(report.largest_batch_bytes, held)
                del part, state  # the writer holds them until it is done
            if writing is not None:
                merge(digests, writing.result())
        # the last part: no data, only every group's zarr.json (values' groups too)
        groups = _Part(plan.entries, dict.fromkeys(plan.entries, -1), plan.values)
        _write_batch({}, groups, c.write_to, stats)
        stats.bytes_written = sum(e.nbytes for e in plan.entries.values())
        save_stats = engine_save.stats_record([stats.result()])  # spec 9.7's save_stats, for the one writer
        commit.finish(c, seal(c.write_to, dataclasses.replace(meta, save_stats=save_stats), digests))
    except BaseException:
        commit.abort(c)
        raise
    finally:
        bar.close()
    report.bytes_read = bar.done
    report.seconds = time.perf_counter() - t0
    return report


def _write_batch(state: dict, part: _Part, loc: location.Location, total: engine_save.SaveStats) -> Digests:
    """One batch through the engine's writer (encode, crc32c, write, sync);
    its phase times are added to ``total``; returns its objects' digests."""
    stats = engine_save.SaveStats()
    digests = engine_save._write_local(state, part, loc, 0, stats)  # type: ignore[arg-type]  # a _Part reads as a plan
    for phase, seconds in stats.seconds.items():
        total.seconds[phase] = total.seconds.get(phase, 0.0) + seconds
    return digests


def _batches(source: Source, tensors: list[SourceTensor], entries: dict[str, TensorEntry],
             dtype: torch.dtype | None, memory_bytes: int, bar: Progress) -> Iterator[tuple[_Part, dict, int]]:
    """Yield (part, state, bytes held): whole tensors grouped up to
    ``memory_bytes``, or slabs of whole stored objects of a larger tensor."""
    part, held = _Part({}, {}, {}), 0
    state: dict[Path, object] = {}

    def flush() -> tuple[_Part, dict, int]:
        nonlocal part, state, held
        out = (part, unflatten(state), held)
        part, state, held = _Part({}, {}, {}), {}, 0
        return out

    for t in tensors:
        key = t.key
        e = entries[key]
        d = cast_dtype(t, dtype)
        nbytes = math.prod(t.shape) * _itemsize(d)
        if nbytes <= memory_bytes or len(t.shape) == 0:
            if held and held + nbytes > memory_bytes:
                yield flush()
            data = read_cast(source, t, 0, t.shape[0] if t.shape else 1, d)
            bar.update(t.ref.nbytes)
            _check_read(source, t, data)
            state[t.path] = data
            del data
            part.entries[key], part.meta_writers[key] = e, 0
            part.regions.append((key, Box.full(t.shape)))
            held += nbytes
            continue
        if held:
            yield flush()
        row_bytes = math.prod(t.shape[1:]) * _itemsize(d)
        unit = e.chunk_shape[0]  # whole stored objects; also whole source units (inner chunks) when they fit
        both = math.lcm(unit, source.row_align(t.ref))
        if both * row_bytes <= memory_bytes:
            unit = both
        per = max(1, memory_bytes // max(1, unit * row_bytes)) * unit
        for i, (a, b) in enumerate(slabs(t.shape[0], per)):
            data = read_cast(source, t, a, b, d)
            bar.update((b - a) * t.ref.row_bytes)
            _check_read(source, t, data, b - a)
            box = Box((a,) + (0,) * (len(t.shape) - 1), tuple(data.shape))
            part.entries[key] = e
            part.meta_writers[key] = 0 if i == 0 else -1  # its zarr.json once, with the first slab
            part.regions.append((key, box))
            state[t.path] = ShardedTensor(data, t.shape, box.offset)
            held = data.numel() * data.element_size()
            del data
            yield flush()
    if held or part.regions:
        yield flush()


def _check_read(source: Source, t: SourceTensor, data: torch.Tensor, rows: int | None = None) -> None:
    want = t.shape if rows is None else (rows,) + t.shape[1:]
    if tuple(data.shape) != tuple(want):
        raise TensorckptError(
            f"{source.description}: tensor {t.ref.key!r} read as {list(data.shape)}, expected {list(want)}"
        )


def unsupported_dtype(name: str, key: str, where: str, known: list[str]) -> UnsupportedValueError:
    return UnsupportedValueError(
        f"{where}: tensor {key!r} has dtype {name}, which tensorckpt cannot store; "
        f"storable: {', '.join(known)}. Drop it (only=/rename=) or convert it to a storable dtype first"
    )
