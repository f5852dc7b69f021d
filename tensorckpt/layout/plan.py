"""Save planning (pure): the ranks' local plans -> one global plan saying what
is stored (tensor entries, chunk grids) and who writes which stored object.
Frozen, JSON-able data; testable without processes."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import IncompatibleStateError
from ..format import dtypes
from ..format.metadata import TensorEntry
from . import grid
from .boxes import Box, check_partition, chunk_grid


@dataclass(frozen=True)
class LocalItem:
    """One rank holds ``box`` of tensor ``key`` (global ``shape``, ``dtype``)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    box: Box


@dataclass(frozen=True)
class LocalPlan:
    rank: int
    items: tuple[LocalItem, ...]
    values: dict = field(default_factory=dict)  # flat key -> JSON value


@dataclass(frozen=True)
class SavePlan:
    entries: dict[str, TensorEntry]
    writes: dict[int, tuple[tuple[str, Box], ...]]  # rank -> the boxes it writes
    meta_writers: dict[str, int]  # array key -> rank writing its zarr.json
    values: dict

    def writes_of(self, rank: int) -> tuple[tuple[str, Box], ...]:
        return self.writes.get(rank, ())


def build_save_plan(
    plans: list[LocalPlan],
    shard_bytes: int = grid.DEFAULT_SHARD_BYTES,
    inner_bytes: int = grid.DEFAULT_INNER_BYTES,
) -> SavePlan:
    by_key: dict[str, list[tuple[int, LocalItem]]] = {}
    for p in plans:
        for it in p.items:
            by_key.setdefault(it.key, []).append((p.rank, it))
    values = merge_values(plans)
    clash = sorted(set(values) & set(by_key))
    if clash:
        raise IncompatibleStateError(f"keys {clash[:10]} are tensors on some ranks and plain values on others")

    entries, writes, meta = {}, {}, {}
    load: dict[int, int] = {p.rank: 0 for p in plans}  # bytes assigned per rank
    for key in sorted(by_key):
        holders = by_key[key]
        first = holders[0][1]
        for rank, it in holders:
            if (it.dtype, it.shape) != (first.dtype, first.shape):
                raise IncompatibleStateError(
                    f"{key!r}: ranks disagree on the logical tensor: rank {holders[0][0]} has "
                    f"{list(first.shape)} {first.dtype}, rank {rank} has {list(it.shape)} {it.dtype}"
                )
        itemsize = dtypes.BY_TORCH[first.dtype].itemsize
        replicas: dict[Box, list[int]] = {}
        for rank, it in holders:
            if it.box.numel or not first.shape:
                replicas.setdefault(it.box, []).append(rank)
        boxes = sorted(replicas)
        check_partition(key, first.shape, boxes)
        if boxes == [Box.full(first.shape)] or not boxes:
            chunk = grid.single_writer_chunks(first.shape, itemsize, shard_bytes)
        else:
            chunk = grid.cap_chunks(chunk_grid(first.shape, boxes), itemsize, shard_bytes)
        entries[key] = TensorEntry(first.dtype, first.shape, chunk, grid.inner_chunks(chunk, itemsize, inner_bytes))
        for box in boxes:  # replicated boxes go to the least-loaded holder
            holders_of_box = replicas[box]
            writer = holders_of_box[0] if len(holders_of_box) == 1 else min(holders_of_box, key=lambda r: (load[r], r))
            load[writer] += box.numel * itemsize
            writes.setdefault(writer, []).append((key, box))
            meta.setdefault(key, writer)
        meta.setdefault(key, holders[0][0])
    return SavePlan(entries, {r: tuple(w) for r, w in writes.items()}, meta, values)


def merge_values(plans: list[LocalPlan]) -> dict:
    """Non-tensor values of all ranks; for a key several ranks hold, the lowest rank's."""
    values: dict = {}
    for p in sorted(plans, key=lambda p: p.rank):
        for k, v in p.values.items():
            values.setdefault(k, v)
    return values


def plan_bytes(plan: SavePlan, rank: int) -> int:
    e = plan.entries
    return sum(b.numel * dtypes.BY_TORCH[e[k].dtype].itemsize for k, b in plan.writes_of(rank))

