"""Tilings of one tensor, on arrays (pure; spec section "Chunking").

The distinct boxes that ranks hold of one tensor arrive as two int64 arrays of
shape ``(boxes, ndim)``: ``starts`` and ``sizes``. Whether they partition the
tensor, and the coarsest chunk grid aligned with them (which
:mod:`tensorckpt.layout.regrid` may coarsen further), then cost a few numpy
passes rather than a Python loop per box: a save over 8,960 ranks checks
1,000+ tensors of 8,960 boxes each.

:func:`tensorckpt.layout.boxes.check_partition` and
:func:`~tensorckpt.layout.boxes.chunk_grid` are the same checks on lists of
:class:`~tensorckpt.layout.boxes.Box`.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..errors import IncompatibleStateError

# Overlap check by coverage counting: at most this many cells (one per
# combination of distinct box boundaries), else a sweep over the boxes.
MAX_CELLS = 1 << 22


def chunk_grid(shape: tuple[int, ...], starts: np.ndarray) -> tuple[int, ...]:
    """Along every dimension, the gcd of all box starts (so every box
    boundary is a chunk boundary); a dimension where every box starts at 0
    gets the whole dimension, and zero-size dimensions get 1."""
    g = np.gcd.reduce(starts, axis=0) if len(starts) else np.zeros(len(shape), np.int64)
    return tuple(max(1, int(gd) if gd else n) for gd, n in zip(g, shape))


def check_tiling(key: str, shape: tuple[int, ...], starts: np.ndarray, sizes: np.ndarray) -> None:
    """Raise :class:`IncompatibleStateError` unless the boxes ``[starts,
    starts + sizes)`` tile ``shape`` exactly: inside it, disjoint, covering
    every element. Repeated boxes overlap; empty boxes are ignored once they
    lie inside the shape."""
    ends = starts + sizes
    outside = np.flatnonzero(row_any((starts < 0) | (sizes < 0) | (ends > np.array(shape, np.int64))))
    if len(outside):
        i = outside[0]
        raise IncompatibleStateError(
            f"{key!r}: shard {_box_json(starts[i], sizes[i])} lies outside the global shape {list(shape)}"
        )
    total = math.prod(shape)
    if total == 0:
        return
    numel = row_product(sizes)
    held = numel != 0
    if not held.all():
        starts, sizes, ends = take_rows(starts, held), take_rows(sizes, held), take_rows(ends, held)
    covered = int(numel[held].sum())
    overlap = overlaps(shape, starts, ends)
    if covered == total and not overlap:
        return
    what = "overlap" if covered > total or overlap else "leave elements uncovered"
    order = np.lexsort(np.hstack([starts, sizes]).T[::-1]) if starts.shape[1] else np.arange(len(starts))
    shown = [_box_json(starts[i], sizes[i]) for i in order[:8]]
    raise IncompatibleStateError(
        f"{key!r}: the ranks' shards of global shape {list(shape)} {what}: "
        f"{shown}{' ...' if len(order) > 8 else ''}; each element must be "
        "held by exactly one distinct shard (replicas must hold identical boxes)"
    )


def overlaps(shape: tuple[int, ...], starts: np.ndarray, ends: np.ndarray) -> bool:
    """Whether any two of the non-empty boxes ``[starts, ends)`` (inside
    ``shape``) share an element."""
    n, ndim = starts.shape
    if n <= 1 or ndim == 0:
        return n > 1
    full = (starts == 0) & (ends == np.array(shape, np.int64))
    varying = np.flatnonzero(~full.all(axis=0))
    if len(varying) <= 1:  # row or column sharding: intervals along one dimension
        if not len(varying):
            return True  # several boxes, all the whole tensor
        d = varying[0]
        order = np.argsort(starts[:, d], kind="stable")
        return bool(np.any(starts[order[1:], d] < np.maximum.accumulate(ends[order[:-1], d])))
    coords = [np.unique(np.concatenate([starts[:, d], ends[:, d]])) for d in range(ndim)]
    dims = tuple(len(c) for c in coords)
    if math.prod(dims) > MAX_CELLS:
        return _overlaps_sweep(starts, ends)
    return _coverage(coords, dims, starts, ends).max() > 1


def _coverage(coords: list[np.ndarray], dims: tuple[int, ...], starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """How many boxes hold each cell of the grid of all box boundaries: +1 or
    -1 at each box's corners (a difference array), then a running sum along
    every dimension."""
    lo = [np.searchsorted(c, starts[:, d]) for d, c in enumerate(coords)]
    hi = [np.searchsorted(c, ends[:, d]) for d, c in enumerate(coords)]
    size = math.prod(dims)
    diff = np.zeros(size, np.int64)
    for corner in itertools.product((False, True), repeat=len(dims)):
        at = np.ravel_multi_index([h if up else l for l, h, up in zip(lo, hi, corner)], dims)
        counts = np.bincount(at, minlength=size)
        if sum(corner) % 2:
            diff -= counts
        else:
            diff += counts
    cells = diff.reshape(dims)
    for d in range(len(dims)):
        np.cumsum(cells, axis=d, out=cells)
    return cells


def _overlaps_sweep(starts: np.ndarray, ends: np.ndarray) -> bool:
    """For boxes with too many distinct boundaries to count cells: sweep
    along the dimension with the most distinct starts, comparing only boxes
    whose ranges overlap along it."""
    d = max(range(starts.shape[1]), key=lambda i: len(np.unique(starts[:, i])))
    lo, hi = starts.tolist(), ends.tolist()
    active: list[int] = []
    for i in np.argsort(starts[:, d], kind="stable").tolist():
        active = [a for a in active if hi[a][d] > lo[i][d]]
        for a in active:
            if all(max(l1, l2) < min(h1, h2) for l1, l2, h1, h2 in zip(lo[a], lo[i], hi[a], hi[i])):
                return True
        active.append(i)
    return False


def unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of a 2-D int array in lexicographic order, and for
    each input row the index of its distinct row. Rows already strictly
    increasing (one box per rank, ranks in order) are returned as they are."""
    n, width = rows.shape
    if width == 0:
        return rows[: min(n, 1)], np.zeros(n, np.intp)
    if _strictly_increasing(rows):
        return rows, np.arange(n)
    order = np.lexsort(rows.T[::-1])
    ordered = rows[order]
    new = np.empty(n, bool)
    new[0] = True
    new[1:] = row_any(ordered[1:] != ordered[:-1])
    inverse = np.empty(n, np.intp)
    inverse[order] = np.cumsum(new) - 1
    return ordered[new], inverse


def _strictly_increasing(rows: np.ndarray) -> bool:
    """Whether each row is lexicographically greater than the one before."""
    if len(rows) <= 1:
        return True
    greater = np.zeros(len(rows) - 1, bool)  # decided by an earlier column
    for col in rows.T:
        step = col[1:] - col[:-1]
        if np.any(~greater & (step < 0)):
            return False
        greater |= step > 0
    return bool(greater.all())


# Boxes x ndim arrays are best kept column-major (Fortran order): numpy then
# loops along the long columns; row-wise reductions go column by column.


def take_rows(a: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return np.asfortranarray(a[mask])


def row_product(a: np.ndarray) -> np.ndarray:
    out = np.ones(len(a), np.int64)
    for col in a.T:
        out *= col
    return out


def row_any(a: np.ndarray) -> np.ndarray:
    out = np.zeros(len(a), bool)
    for col in a.T:
        out |= col
    return out


def _box_json(start: np.ndarray, size: np.ndarray) -> list:
    return [start.tolist(), size.tolist()]
