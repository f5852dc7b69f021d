"""Boxes and the pure math of distributed layouts (spec section "Chunking").

A *box* is the hyper-rectangle ``[offset, offset + shape)`` of a logical
tensor that one rank holds (when saving) or wants (when loading). Saving turns
the writers' boxes into one regular chunk grid in which every chunk lies inside
exactly one writer's box; loading turns a wanted box into the stored pieces it
overlaps. No I/O, no torch.distributed: everything here is testable alone.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property

from ..errors import IncompatibleStateError


@dataclass(frozen=True, order=True)
class Box:
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def full(cls, shape) -> "Box":
        return cls((0,) * len(shape), tuple(shape))

    @cached_property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape))

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))

    def intersect(self, other: "Box") -> "Box | None":
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        hi = tuple(min(a, b) for a, b in zip(self.end, other.end))
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))

    def relative_to(self, outer: "Box") -> "Box":
        return Box(tuple(a - b for a, b in zip(self.offset, outer.offset)), self.shape)

    def to_json(self) -> list:
        return [list(self.offset), list(self.shape)]


def chunk_grid(shape: tuple[int, ...], boxes: list[Box]) -> tuple[int, ...]:
    """The coarsest regular grid whose chunks each lie inside one box: along
    every dimension, the gcd of all box starts (so each box boundary is a chunk
    boundary). Even and ``torch.chunk``-style splits give chunk = box; an
    irregular split (4, 3, 3) gives a finer grid. Zero-size dimensions get 1."""
    chunk = []
    for d, n in enumerate(shape):
        g = 0
        for b in boxes:
            g = math.gcd(g, b.offset[d])
        chunk.append(max(1, g if g else n))
    return tuple(chunk)


def check_partition(key: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """Raise :class:`IncompatibleStateError` unless the distinct ``boxes``
    tile ``shape`` exactly: inside it, disjoint, covering every element."""
    total = math.prod(shape)
    for b in boxes:
        if len(b.offset) != len(shape) or any(o < 0 or e > n for o, e, n in zip(b.offset, b.end, shape)):
            raise IncompatibleStateError(f"{key!r}: shard {b.to_json()} lies outside the global shape {list(shape)}")
    if total == 0:
        return
    nonempty = [b for b in boxes if b.numel]
    covered = sum(b.numel for b in nonempty)
    if covered == total and (_split_along_one_dim(shape, nonempty) or _disjoint(nonempty)):
        return
    nonempty.sort()
    what = "overlap" if covered > total or not _disjoint(nonempty) else "leave elements uncovered"
    raise IncompatibleStateError(
        f"{key!r}: the ranks' shards of global shape {list(shape)} {what}: "
        f"{[b.to_json() for b in nonempty[:8]]}{' ...' if len(nonempty) > 8 else ''}; each element must be "
        "held by exactly one distinct shard (replicas must hold identical boxes)"
    )


def _split_along_one_dim(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """Fast path for the common layouts (row or column sharding): all boxes
    span every dimension but one, and along it they follow each other with no
    gap or overlap."""
    varying = {d for b in boxes for d, (o, s) in enumerate(zip(b.offset, b.shape)) if o != 0 or s != shape[d]}
    if len(varying) > 1:
        return False
    if not varying:
        return len(boxes) == 1
    d = varying.pop()
    pos = 0
    for b in sorted(boxes, key=lambda b: b.offset[d]):
        if b.offset[d] != pos:
            return False
        pos += b.shape[d]
    return pos == shape[d]


def _disjoint(boxes: list[Box]) -> bool:
    """Sweep along the dimension with the most distinct box starts: only boxes
    whose ranges overlap along it are compared, so grid layouts (row, column
    or 2-D sharding) cost O(n log n)."""
    if not boxes or not boxes[0].shape:
        return len(boxes) <= 1
    d = max(range(len(boxes[0].shape)), key=lambda i: len({b.offset[i] for b in boxes}))
    active: list[Box] = []
    for b in sorted(boxes, key=lambda b: b.offset[d]):
        active = [a for a in active if a.end[d] > b.offset[d]]
        if any(a.intersect(b) is not None for a in active):
            return False
        active.append(b)
    return True


def chunks_in(box: Box, chunk: tuple[int, ...], shape: tuple[int, ...]):
    """Grid indices of the chunks a box overlaps (clipped to the array)."""
    ranges = [
        range(o // c, -(-min(e, n) // c)) if s else range(0)
        for o, e, s, c, n in zip(box.offset, box.end, box.shape, chunk, shape)
    ]
    return itertools.product(*ranges)


def chunk_box(index: tuple[int, ...], chunk: tuple[int, ...], shape: tuple[int, ...]) -> Box:
    off = tuple(i * c for i, c in zip(index, chunk))
    return Box(off, tuple(min(c, n - o) for o, c, n in zip(off, chunk, shape)))


@dataclass(frozen=True)
class ReadPiece:
    """Copy stored region ``src`` (global coordinates, inside one stored
    chunk ``chunk``) to ``dst`` (coordinates inside the target box)."""

    chunk: tuple[int, ...]
    src: Box
    dst: Box


def read_plan(shape: tuple[int, ...], chunk: tuple[int, ...], want: Box) -> list[ReadPiece]:
    """The pieces of stored chunks that make up ``want``: each wanted element
    comes from exactly one piece."""
    out = []
    for idx in chunks_in(want, chunk, shape):
        part = chunk_box(idx, chunk, shape).intersect(want)
        if part is not None:
            out.append(ReadPiece(idx, part, part.relative_to(want)))
    return out


def bytes_fetched(shape: tuple[int, ...], inner: tuple[int, ...], want: Box, itemsize: int) -> int:
    """Bytes a reader decodes to get ``want``: every inner chunk it overlaps,
    whole (an inner chunk at the array's edge is stored at full size)."""
    if want.numel == 0:
        return 0
    per_dim = []
    for o, e, c in zip(want.offset, want.end, inner):
        first, last = o // c, (e - 1) // c
        per_dim.append((last + 1 - first) * c)
    return math.prod(per_dim) * itemsize
