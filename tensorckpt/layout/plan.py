"""Save planning (pure): the ranks' local plans -> one global plan saying what
is stored (tensor entries, chunk grids) and who writes which stored object.
Frozen data (tensor entries, ints, bytes); testable without processes.

Rules: every distinct non-empty box of a tensor has one writer, one of the
ranks holding it; a replicated box goes to its least-loaded holder (bytes
assigned so far, tensors taken in key order, boxes in sorted order), ties to
the lowest rank. Where the chunk grid follows the boxes (even and
``torch.chunk``-style splits), the writer of a box writes the box. Where it
does not (irregular splits, see :mod:`tensorckpt.layout.regrid`), the writer
of a box writes the chunks that box owns, and sends the rest of the box, in
*pieces*, to the writers of the chunks they fall in; :class:`Regrid` lists
them. The array's zarr.json is written by the writer of its first box (or,
for a tensor with nothing to store, by its first holder).

Cost: rank 0 decodes each distinct table of tensors once; then, per tensor,
a few numpy passes over its holders' boxes (sorting at worst), so planning
grows linearly with ranks x tensors. A rank holds at most one box of each
tensor (see :class:`~tensorckpt.layout.local.LocalItems`), so the holders of
one tensor are distinct ranks and the least-loaded choices of its boxes are
independent of each other: they are made together.
"""

from __future__ import annotations

import bisect
import zlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..errors import IncompatibleStateError, TensorckptError
from ..format import dtypes, metadata
from ..format.metadata import TensorEntry, past_caps
from . import grid, regrid, tiling
from .boxes import Box, chunk_box
from .local import LocalItem, LocalItems, LocalPlan, Spec, decode_table

__all__ = [
    "LocalItem",
    "LocalItems",
    "LocalPlan",
    "Piece",
    "Regrid",
    "SavePlan",
    "build_save_plan",
    "merge_values",
    "plan_bytes",
]


@dataclass(frozen=True)
class Piece:
    """Rank ``src`` sends ``box`` (global coordinates) of tensor ``key`` to
    rank ``dst``, which writes the stored chunk ``chunk`` (clipped to the
    array) that holds it."""

    key: str
    chunk: Box
    src: int
    dst: int
    box: Box

    def to_json(self) -> list:
        return [self.key, self.chunk.to_json(), self.src, self.dst, self.box.to_json()]


@dataclass(frozen=True)
class Regrid:
    """How a tensor whose chunk grid does not follow its boxes is written,
    compactly (zlib-compressed little-endian integers, as the plan goes to
    every rank): ``owners``, int32, the rank writing each chunk of the grid
    in C order; ``pieces``, int64 rows ``(src, dst, offset..., shape...)``,
    in chunk order then box order: what rank ``src`` sends to rank ``dst``."""

    owners: bytes
    pieces: bytes

    @classmethod
    def pack(cls, owners: np.ndarray, pieces: np.ndarray) -> Regrid:
        return cls(zlib.compress(owners.astype("<i4").tobytes(), 1), zlib.compress(pieces.astype("<i8").tobytes(), 1))

    def owner_array(self) -> np.ndarray:
        return np.frombuffer(zlib.decompress(self.owners), "<i4")

    def piece_rows(self, ndim: int) -> np.ndarray:
        return np.frombuffer(zlib.decompress(self.pieces), "<i8").reshape(-1, 2 + 2 * ndim)



@dataclass(frozen=True)
class SavePlan:
    """The global plan. Who writes what is kept compactly, because the plan
    goes to every rank: ``held[i]`` is what rank ``ranks[i]`` holds, and
    ``written`` is a bit matrix (row per tensor in key order, column per
    entry of ``ranks``, ``numpy.packbits`` order) saying whether that rank
    is the writer of its box of that tensor. :meth:`writes_of` unpacks one
    rank's part. ``regrid`` holds the tensors whose chunk grid does not follow
    their boxes (none in the common case): who writes which chunk and the
    pieces ranks send each other first."""

    entries: dict[str, TensorEntry]
    meta_writers: dict[str, int]  # array key -> rank writing its zarr.json
    values: dict
    ranks: tuple[int, ...] = ()  # ascending
    held: tuple[LocalItems, ...] = ()
    written: bytes = b""
    regrid: dict[str, Regrid] = field(default_factory=dict)

    def writes_of(self, rank: int) -> tuple[tuple[str, Box], ...]:
        """The regions ``rank`` writes, in key order: its box of a tensor it
        writes, or, for a re-gridded tensor, each chunk it writes (in C order)."""
        i = bisect.bisect_left(self.ranks, rank)
        if i == len(self.ranks) or self.ranks[i] != rank:
            return ()
        row_bytes = (len(self.ranks) + 7) // 8
        byte, mask = i // 8, 0x80 >> (i % 8)
        row = {k: t for t, k in enumerate(sorted(self.entries))}
        mine: list[tuple[str, Box]] = []
        for it in self.held[i]:
            if not self.written[row[it.key] * row_bytes + byte] & mask:
                continue
            if it.key in self.regrid:
                mine.extend((it.key, b) for b in self._chunks_of(it.key, rank))
            else:
                mine.append((it.key, it.box))
        return tuple(sorted(mine, key=lambda w: w[0]))

    def _chunks_of(self, key: str, rank: int) -> list[Box]:
        e = self.entries[key]
        dims = tuple(-(-n // c) for n, c in zip(e.shape, e.chunk_shape))
        mine = np.unravel_index(np.flatnonzero(self.regrid[key].owner_array() == rank), dims)
        return [chunk_box(index, e.chunk_shape, e.shape) for index in zip(*(m.tolist() for m in mine))]

    def pieces_of(self, rank: int | None = None) -> tuple[Piece, ...]:
        """The pieces ``rank`` sends or receives (all pieces when None), in
        key order, then chunk order, then box order: the order of the exchange."""
        out = []
        for key in sorted(self.regrid):
            e = self.entries[key]
            n = len(e.shape)
            rows = self.regrid[key].piece_rows(n)
            if rank is not None:
                rows = rows[(rows[:, 0] == rank) | (rows[:, 1] == rank)]
            for r in rows.tolist():
                box = Box(tuple(r[2 : 2 + n]), tuple(r[2 + n :]))
                index = tuple(o // c for o, c in zip(box.offset, e.chunk_shape))
                out.append(Piece(key, chunk_box(index, e.chunk_shape, e.shape), r[0], r[1], box))
        return tuple(out)

    @property
    def moves_pieces(self) -> bool:
        """Whether any rank sends a piece: the same answer on every rank, so
        all ranks take part in the exchange or all skip it. Every re-gridded
        tensor moves some: a box starting inside a chunk shares that chunk
        with the box before it."""
        return bool(self.regrid)

    @property
    def writes(self) -> dict[int, tuple[tuple[str, Box], ...]]:
        """Every rank's writes (ranks writing nothing left out); for tests and inspection."""
        return {r: w for r in self.ranks if (w := self.writes_of(r))}


@dataclass(frozen=True, eq=False)
class _Layout:
    """The ranks holding one same table of tensors; their boxes as a matrix."""

    specs: tuple[Spec, ...]
    columns: tuple[int, ...]  # where each tensor's box starts in a row of ``boxes``
    slots: np.ndarray  # the ranks' indices in SavePlan.ranks
    boxes: np.ndarray  # (len(slots), width) int64
    first_slot: int  # of the rank coming first in the caller's list of plans
    first_position: int  # its position there


def build_save_plan(
    plans: list[LocalPlan],
    shard_bytes: int = grid.DEFAULT_SHARD_BYTES,
    inner_bytes: int = grid.DEFAULT_INNER_BYTES,
) -> SavePlan:
    values = merge_values(plans)
    ranks, held, layouts = _layouts(plans)
    by_key: dict[str, list[tuple[_Layout, int]]] = {}
    for lay in layouts:
        for j, (key, _, _) in enumerate(lay.specs):
            by_key.setdefault(key, []).append((lay, j))
    clash = sorted(set(values) & set(by_key))
    if clash:
        raise IncompatibleStateError(f"keys {clash[:10]} are tensors on some ranks and plain values on others")

    keys = sorted(by_key)
    load = np.zeros(len(ranks), np.int64)  # bytes assigned per rank
    written = np.zeros((len(keys), len(ranks)), bool)
    rank_of = np.array(ranks, np.int64)
    entries, meta, regrids = {}, {}, {}
    for t, key in enumerate(keys):
        entry, writers, meta[key], moved = _plan_tensor(key, by_key[key], rank_of, load, shard_bytes, inner_bytes)
        entries[key] = entry
        written[t, writers] = True
        if moved is not None:
            regrids[key] = moved
    return SavePlan(entries, meta, values, ranks, held, np.packbits(written, axis=1).tobytes(), regrids)


def _plan_tensor(
    key: str,
    holders: list[tuple[_Layout, int]],
    rank_of: np.ndarray,
    load: np.ndarray,
    shard_bytes: int,
    inner_bytes: int,
) -> tuple[TensorEntry, np.ndarray, int, Regrid | None]:
    """One tensor's entry, its writers (rank slots, one per distinct box in
    sorted order), the rank writing its zarr.json, and, when its chunk grid
    does not follow its boxes, who writes which chunk; adds the bytes the
    writers write to ``load``."""
    ref_layout, ref_j = min(holders, key=lambda h: h[0].first_position)
    _, dtype, shape = ref_layout.specs[ref_j]
    differ = [h for h in holders if h[0].specs[h[1]][1:] != (dtype, shape)]
    if differ:
        other, j = min(differ, key=lambda h: h[0].first_position)
        _, other_dtype, other_shape = other.specs[j]
        raise IncompatibleStateError(
            f"{key!r}: ranks disagree on the logical tensor: rank {int(rank_of[ref_layout.first_slot])} has "
            f"{list(shape)} {dtype}, rank {int(rank_of[other.first_slot])} has {list(other_shape)} {other_dtype}"
        )
    itemsize = dtypes.BY_TORCH[dtype].itemsize
    ndim = len(shape)
    parts = [lay.boxes[:, lay.columns[j] : lay.columns[j] + 2 * ndim] for lay, j in holders]
    rows = np.asfortranarray(np.concatenate(parts))  # holders x (offset, shape)
    slots = np.concatenate([lay.slots for lay, _ in holders])
    nonempty = tiling.row_product(rows[:, ndim:]) != 0
    if ndim and not nonempty.all():  # holders of an empty box write nothing
        rows, slots = tiling.take_rows(rows, nonempty), slots[nonempty]
    boxes, box_of = tiling.unique_rows(rows)
    starts, sizes = boxes[:, :ndim], boxes[:, ndim:]
    tiling.check_tiling(key, shape, starts, sizes)
    owned = None
    if not len(boxes) or (len(boxes) == 1 and not starts.any() and bool(np.all(sizes[0] == shape))):
        chunk = grid.single_writer_chunks(shape, itemsize, shard_bytes)
    else:
        chunk, coarse = regrid.choose_grid(shape, starts, sizes)
        chunk = grid.cap_chunks(chunk, itemsize, shard_bytes)
        if coarse and not regrid.aligned(starts, chunk):
            owned = regrid.assign(shape, chunk, starts, sizes)
    entry = TensorEntry(dtype, shape, chunk, grid.inner_chunks(chunk, itemsize, inner_bytes))
    _check_caps(key, entry, shard_bytes, inner_bytes)
    writers = _writers(box_of, slots, len(boxes), load)
    load[writers] += (tiling.row_product(sizes) if owned is None else owned.owned) * itemsize
    meta = int(rank_of[writers[0] if len(writers) else ref_layout.first_slot])
    return entry, writers, meta, None if owned is None else _regrid(owned, rank_of[writers])


def _check_caps(key: str, entry: TensorEntry, shard_bytes: int, inner_bytes: int) -> None:
    """Refuse, before anything is written, a tensor whose entry readers would
    refuse (spec 12: an encoded inner chunk over 256 MiB, a shard index over
    64 MiB), saying what to pass instead."""
    over = past_caps(entry)
    if not over:
        return
    if metadata.encoded_inner_bytes(entry) > metadata.MAX_INNER_CHUNK_BYTES:  # no divisor left to cut
        fix = ("no dimension of it can be divided further (inner chunks divide the stored chunk); reshape the "
               "tensor so that its dimensions have small factors, e.g. save it flattened")
    else:
        fix = (f"pass a larger inner_chunk_bytes= (now {inner_bytes}) or a smaller shard_bytes= (now {shard_bytes}): "
               f"a stored object holds at most {(metadata.MAX_SHARD_INDEX_BYTES - 4) // 16} inner chunks")
    raise TensorckptError(f"tensor {key!r} (shape {list(entry.shape)}, {entry.dtype}) cannot be saved: {over}; {fix}")


def _regrid(own: regrid.Ownership, writer_rank: np.ndarray) -> Regrid:
    """The ownership of a re-gridded tensor in ranks (``writer_rank``: the
    rank writing each box), packed."""
    pieces = np.column_stack([writer_rank[own.src], writer_rank[own.dst], own.piece_start, own.piece_size])
    return Regrid.pack(writer_rank[own.owner], pieces)


def _writers(box_of: np.ndarray, slots: np.ndarray, n_boxes: int, load: np.ndarray) -> np.ndarray:
    """For each box, the holder with the least ``load``, then the lowest
    rank. The holders (``slots``, holding box ``box_of``) are distinct ranks."""
    if len(box_of) == n_boxes:  # no replicas
        writers = np.empty(n_boxes, np.intp)
        writers[box_of] = slots
        return writers
    order = np.lexsort((slots, load[slots], box_of))
    grouped = box_of[order]
    first = np.ones(len(order), bool)
    first[1:] = grouped[1:] != grouped[:-1]
    return slots[order[first]]


def _layouts(plans: list[LocalPlan]) -> tuple[tuple[int, ...], tuple[LocalItems, ...], list[_Layout]]:
    """The ranks in ascending order, what each holds (equal tables sharing
    one bytes object, so the plan pickles each once), and the ranks grouped
    by table."""
    position = sorted(range(len(plans)), key=lambda i: plans[i].rank)
    ranks = tuple(plans[i].rank for i in position)
    twice = sorted(r for r, n in Counter(ranks).items() if n > 1)
    if twice:
        raise ValueError(f"local plans: each rank may appear once; ranks {twice[:10]} appear more than once")
    by_table: dict[bytes, list[int]] = {}
    for slot, i in enumerate(position):
        by_table.setdefault(plans[i].items.table, []).append(slot)
    shared = {table: table for table in by_table}  # one bytes object per distinct table
    held = tuple(LocalItems(len(p.items), shared[p.items.table], p.items.boxes) for p in (plans[i] for i in position))
    layouts = []
    for table, slots in by_table.items():
        specs = decode_table(table)
        columns = np.cumsum([0] + [2 * len(s) for _, _, s in specs]).tolist()
        raw = b"".join(zlib.decompress(held[s].boxes) for s in slots)
        boxes = np.frombuffer(raw, dtype="<i8")
        if any(len(held[s]) != len(specs) for s in slots) or boxes.size != columns[-1] * len(slots):
            raise ValueError("local plans: a table of tensors does not match its boxes")
        first = min(slots, key=lambda s: position[s])
        boxes = boxes.reshape(len(slots), columns[-1])
        layouts.append(_Layout(specs, tuple(columns[:-1]), np.array(slots), boxes, first, position[first]))
    return ranks, held, layouts


def merge_values(plans: list[LocalPlan]) -> dict:
    """Non-tensor values of all ranks; a key several ranks hold is stored once,
    so they must hold equal values: else :class:`IncompatibleStateError`
    naming the key and the ranks that differ (a per-rank value is stored with
    ``tensorckpt.per_rank``)."""
    values: dict = {}
    holder: dict[str, int] = {}
    differ: dict[str, list[int]] = {}
    for p in sorted(plans, key=lambda p: p.rank):
        for k, v in p.values.items():
            if k not in holder:
                values[k], holder[k] = v, p.rank
            elif v != values[k] or type(v) is not type(values[k]):  # 1 == 1.0 == True
                differ.setdefault(k, []).append(p.rank)
    if differ:
        keys = sorted(differ)
        shown = "; ".join(
            f"{k!r}: rank {holder[k]} has {_short(values[k])}, rank {differ[k][0]} has "
            f"{_short(next(p.values[k] for p in plans if p.rank == differ[k][0]))}"
            + (f" (ranks {differ[k]} differ from rank {holder[k]})" if len(differ[k]) > 1 else "")
            for k in keys[:5]
        )
        raise IncompatibleStateError(
            f"values differ across the ranks that hold them (a value is stored once): {shown}"
            + (f" and {len(keys) - 5} more keys" if len(keys) > 5 else "")
            + ". Nothing was written. Give every rank the same value, give what differs per rank distinct "
            "keys (e.g. a layer or expert number in the name, see tensorckpt.shift_layers), or wrap per-rank "
            "data in tensorckpt.per_rank(value) (stored as one row per rank)"
        )
    return values


def _short(v: object, limit: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def plan_bytes(plan: SavePlan, rank: int) -> int:
    e = plan.entries
    return sum(b.numel * e[k].itemsize for k, b in plan.writes_of(rank))
