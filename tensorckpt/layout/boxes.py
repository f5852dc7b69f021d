"""Boxes and the pure math of distributed layouts (spec section "Chunking").

A *box* is the hyper-rectangle ``[offset, offset + shape)`` of a logical
tensor that one rank holds (when saving) or wants (when loading). Saving turns
the writers' boxes into one regular chunk grid, in which every chunk lies inside
exactly one writer's box when the split allows it (see
:mod:`tensorckpt.layout.regrid` for irregular splits); loading turns a wanted
box into the stored pieces it overlaps. No I/O, no torch.distributed:
everything here is testable alone.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import IncompatibleStateError
from . import tiling


@dataclass(frozen=True, order=True)
class Box:
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property  # not functools.cached_property: in 3.11 its one lock serializes every thread's first access
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))

    def intersect(self, other: Box) -> Box | None:
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        hi = tuple(min(a, b) for a, b in zip(self.end, other.end))
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))

    def relative_to(self, outer: Box) -> Box:
        return Box(tuple(a - b for a, b in zip(self.offset, outer.offset)), self.shape)

    def to_json(self) -> list:
        return [list(self.offset), list(self.shape)]


def chunk_grid(shape: tuple[int, ...], boxes: list[Box]) -> tuple[int, ...]:
    """The coarsest regular grid whose chunks each lie inside one box: along
    every dimension, the gcd of all box starts (so each box boundary is a chunk
    boundary). Even and ``torch.chunk``-style splits give chunk = box; an
    irregular split (4, 3, 3) gives a finer grid, for which the save planner
    picks a coarser one instead (:func:`tensorckpt.layout.regrid.choose_grid`).
    Zero-size dimensions get 1."""
    starts, _ = box_arrays(boxes, len(shape))
    return tiling.chunk_grid(tuple(shape), starts)


def check_partition(key: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """Raise :class:`IncompatibleStateError` unless the distinct ``boxes``
    tile ``shape`` exactly: inside it, disjoint, covering every element."""
    for b in boxes:
        if len(b.offset) != len(shape) or len(b.shape) != len(shape):
            raise IncompatibleStateError(f"{key!r}: shard {b.to_json()} lies outside the global shape {list(shape)}")
    tiling.check_tiling(key, tuple(shape), *box_arrays(boxes, len(shape)))


def box_arrays(boxes: list[Box], ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """``boxes`` as the (starts, sizes) int64 arrays of :mod:`tensorckpt.layout.tiling`."""
    starts = np.array([b.offset for b in boxes], np.int64).reshape(len(boxes), ndim)
    sizes = np.array([b.shape for b in boxes], np.int64).reshape(len(boxes), ndim)
    return starts, sizes


def chunk_ranges(box: Box, chunk: tuple[int, ...], shape: tuple[int, ...]) -> list[range]:
    """Per dimension, the grid indices of the chunks a box overlaps (clipped
    to the array)."""
    return [
        range(o // c, -(-min(e, n) // c)) if s else range(0)
        for o, e, s, c, n in zip(box.offset, box.end, box.shape, chunk, shape)
    ]


def chunks_in(box: Box, chunk: tuple[int, ...], shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Grid indices of the chunks a box overlaps (clipped to the array)."""
    return itertools.product(*chunk_ranges(box, chunk, shape))


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
