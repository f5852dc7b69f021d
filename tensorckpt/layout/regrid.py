"""Chunk grids for irregular splits (pure; spec section "Chunking").

Zarr v3 chunk grids are regular, and every stored chunk must have exactly one
writer. The exchange-free grid, the gcd of the box starts along every
dimension (:func:`tensorckpt.layout.tiling.chunk_grid`), puts every chunk
inside one box, but an ``np.array_split``-style split (rows 1366, 1365, 1365
of 4096) makes it a 1-row grid: thousands of tiny stored objects.

So along a dimension where the gcd grid has more than :data:`FINE_FACTOR`
times as many chunks as there are distinct box starts, the chunk is instead
the largest box extent along it (what ``torch.chunk`` would have cut). Such a
grid no longer follows the boxes: each chunk gets one *owner*, the box
sharing the most elements with it (ties: the box first in sorted order), and
every other box overlapping the chunk sends that part, a *piece*, to the
owner's writer, which writes the chunk whole. This module computes the grid,
the owners and the pieces over box indices; :mod:`tensorckpt.layout.plan`
turns boxes into ranks.

Cost: a few numpy passes over the (box, chunk) pairs that share elements,
about as many as there are boxes plus chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import tiling

# A dimension is re-gridded when its gcd grid has more than this many chunks per distinct box start.
FINE_FACTOR = 2


def choose_grid(shape: tuple[int, ...], starts: np.ndarray, sizes: np.ndarray) -> tuple[tuple[int, ...], bool]:
    """The chunk grid (before capping to the shard size) for the distinct
    non-empty boxes ``[starts, starts + sizes)`` tiling ``shape``: along each
    dimension the gcd of the box starts, unless that gives more than
    ``FINE_FACTOR`` chunks per distinct start; then the largest box extent.
    Also whether any dimension took the largest extent: only then may a chunk
    straddle boxes.

    Linear in the number of boxes (no sort): the starts along a dimension
    are multiples of its gcd, so they are counted on a grid of that step."""
    fine = tiling.chunk_grid(shape, starts)
    chunk = list(fine)
    for d, (n, c) in enumerate(zip(shape, fine)):
        chunks = -(-n // c)
        if chunks <= FINE_FACTOR:
            continue
        if chunks <= FINE_FACTOR * len(starts):  # else surely more than FINE_FACTOR per distinct start
            seen = np.zeros(chunks, bool)
            seen[starts[:, d] // c] = True
            if chunks <= FINE_FACTOR * int(seen.sum()):
                continue
        chunk[d] = int(sizes[:, d].max())
    return tuple(chunk), tuple(chunk) != fine


def aligned(starts: np.ndarray, chunk: tuple[int, ...]) -> bool:
    """Whether every box starts on a chunk boundary. In a tiling every box
    end is then a chunk boundary too (or the array's end), so each chunk lies
    inside one box and nothing has to move."""
    return not len(starts) or not np.any(starts % np.array(chunk, np.int64))


@dataclass(frozen=True, eq=False)
class Ownership:
    """Who writes which chunk of a grid that does not follow the boxes, in
    box indices. ``chunks`` (n x ndim grid indices) are all the chunks of the
    grid in C order (a tiling leaves none empty), ``owner[i]`` the box
    writing ``chunks[i]``; ``owned`` counts the elements
    each box's writer writes. Piece ``j`` is the part
    ``[piece_start[j], + piece_size[j])`` that box ``src[j]`` sends to box
    ``dst[j]``, the owner of the chunk holding it; pieces are in chunk order
    (C order), then box order."""

    chunks: np.ndarray
    owner: np.ndarray
    owned: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    piece_start: np.ndarray
    piece_size: np.ndarray


def assign(shape: tuple[int, ...], chunk: tuple[int, ...], starts: np.ndarray, sizes: np.ndarray) -> Ownership:
    """Owners and pieces for the distinct non-empty boxes ``[starts, starts +
    sizes)`` tiling ``shape`` on the grid ``chunk``: each chunk is owned by
    the box sharing the most elements with it, ties going to the lower box
    index (boxes come sorted)."""
    box, index, p_start, p_size = _pairs(shape, chunk, starts, sizes)
    numel = tiling.row_product(p_size)
    dims = tuple(-(-n // c) for n, c in zip(shape, chunk))
    linear = np.ravel_multi_index(tuple(index.T), dims) if len(box) else np.zeros(0, np.intp)
    by_chunk = np.lexsort((box, -numel, linear))  # per chunk: most elements first, then the lower box
    first = np.ones(len(by_chunk), bool)
    first[1:] = linear[by_chunk[1:]] != linear[by_chunk[:-1]]
    group = np.cumsum(first) - 1  # chunk number of each pair, in by_chunk order
    heads = by_chunk[first]
    owner = box[heads]
    owner_of_pair = np.empty(len(box), np.intp)
    owner_of_pair[by_chunk] = owner[group]
    chunk_numel = np.add.reduceat(numel[by_chunk], np.flatnonzero(first)) if len(heads) else numel[:0]
    owned = np.zeros(len(starts), np.int64)
    np.add.at(owned, owner, chunk_numel)
    moved = np.flatnonzero(box != owner_of_pair)
    moved = moved[np.lexsort((box[moved], linear[moved]))]
    return Ownership(
        chunks=index[heads],
        owner=owner,
        owned=owned,
        src=box[moved],
        dst=owner_of_pair[moved],
        piece_start=p_start[moved],
        piece_size=p_size[moved],
    )


def _pairs(
    shape: tuple[int, ...], chunk: tuple[int, ...], starts: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (box, chunk) pair sharing elements: box indices, chunk grid
    indices (pairs x ndim), and the shared region's start and size. Each box
    overlaps a block of chunks; the pairs of box ``b`` enumerate its block
    in C order (a mixed-radix count)."""
    c = np.array(chunk, np.int64)
    ends = starts + sizes
    lo = starts // c
    span = -(-ends // c) - lo  # chunks the box overlaps, per dimension
    counts = tiling.row_product(span)
    box = np.repeat(np.arange(len(starts)), counts)
    rest = np.arange(len(box)) - np.repeat(np.cumsum(counts) - counts, counts)
    index = np.empty((len(box), len(chunk)), np.int64)
    for d in reversed(range(len(chunk))):
        radix = span[box, d]
        index[:, d] = lo[box, d] + rest % radix
        rest //= radix
    c_start = index * c
    c_end = np.minimum(c_start + c, np.array(shape, np.int64))
    p_start = np.maximum(starts[box], c_start)
    p_size = np.minimum(ends[box], c_end) - p_start
    return box, index, p_start, p_size
