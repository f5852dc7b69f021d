"""Hypothesis strategies and brute-force helpers shared by the layout tests
(test_layout.py: boxes and grids; test_layout_plan.py: save plans): random
shapes (0-4 dims, sizes 0-12) and random box partitions (even,
np.array_split-style, torch.chunk-style, random cuts and non-grid
"guillotine" partitions).
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tensorckpt.layout.boxes import Box, chunk_box, chunks_in

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------ helpers


def inside(inner: Box, outer: Box) -> bool:
    return all(o <= i and ie <= oe for i, ie, o, oe in zip(inner.offset, inner.end, outer.offset, outer.end))


def all_chunks(shape, chunk):
    """Every chunk of the regular grid, clipped to the array."""
    return [chunk_box(idx, chunk, shape) for idx in chunks_in(Box.full(shape), chunk, shape)]


def coverage(shape, boxes) -> np.ndarray:
    """How many of ``boxes`` hold each element (boxes assumed in bounds)."""
    counts = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        counts[b.slices()] += 1
    return counts


def in_bounds(shape, b: Box) -> bool:
    return len(b.offset) == len(shape) and all(o >= 0 and e <= n for o, e, n in zip(b.offset, b.end, shape))


# --------------------------------------------------------------- strategies

shapes = st.lists(st.integers(0, 12), min_size=0, max_size=4).map(tuple)
nonzero_shapes = st.lists(st.integers(1, 12), min_size=0, max_size=4).map(tuple)
DTYPE_NAMES = ["float32", "bfloat16", "float64", "int8", "bool", "float8_e4m3fn"]


@st.composite
def cuts(draw, n: int) -> list[int]:
    """Sizes of consecutive intervals tiling ``range(n)`` (zero sizes allowed)."""
    style = draw(st.sampled_from(["whole", "even", "array_split", "chunk", "random"]))
    k = draw(st.integers(1, 5))
    if style == "whole" or n == 0:
        return [n]
    if style == "even":
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        d = draw(st.sampled_from(divisors))
        return [n // d] * d
    if style == "array_split":
        return [len(a) for a in np.array_split(np.arange(n), k)]
    if style == "chunk":  # torch.chunk / DTensor Shard: ceil-sized pieces, then empty ones
        c = -(-n // k)
        return [max(0, min(c, n - i * c)) for i in range(k)]
    points = sorted(draw(st.sets(st.integers(1, n - 1), max_size=4))) if n > 1 else []
    edges = [0, *points, n]
    return [b - a for a, b in zip(edges, edges[1:])]


def grid_boxes(shape, sizes_per_dim) -> list[Box]:
    """The product partition from per-dimension interval sizes (empty boxes kept)."""
    per_dim = []
    for sizes in sizes_per_dim:
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist()
        per_dim.append(list(zip(starts, sizes)))
    out = []
    for combo in itertools.product(*per_dim):
        out.append(Box(tuple(o for o, _ in combo), tuple(s for _, s in combo)))
    return out


@st.composite
def guillotine(draw, shape) -> list[Box]:
    """A non-grid partition: recursively split a box in two along a random
    dimension (neighbouring boxes need not share boundaries)."""
    boxes = [Box.full(shape)]
    for _ in range(draw(st.integers(0, 5))):
        i = draw(st.integers(0, len(boxes) - 1))
        b = boxes[i]
        dims = [d for d, s in enumerate(b.shape) if s > 1]
        if not dims:
            continue
        d = draw(st.sampled_from(dims))
        at = draw(st.integers(1, b.shape[d] - 1))
        lo = Box(b.offset, b.shape[:d] + (at,) + b.shape[d + 1 :])
        hi = Box(b.offset[:d] + (b.offset[d] + at,) + b.offset[d + 1 :], b.shape[:d] + (b.shape[d] - at,) + b.shape[d + 1 :])
        boxes[i : i + 1] = [lo, hi]
    return boxes


@st.composite
def partitions(draw, shape_strategy=shapes):
    """(shape, boxes, style): boxes tile ``shape``; may include empty boxes."""
    shape = draw(shape_strategy)
    if draw(st.booleans()) and all(shape):
        return shape, draw(guillotine(shape)), "guillotine"
    sizes = [draw(cuts(n)) for n in shape]
    return shape, grid_boxes(shape, sizes), "grid"


def nonempty(boxes):
    return [b for b in boxes if b.numel]


@st.composite
def box_in(draw, shape) -> Box:
    """Any box inside ``shape`` (possibly empty)."""
    off, sz = [], []
    for n in shape:
        o = draw(st.integers(0, n))
        off.append(o)
        sz.append(draw(st.integers(0, n - o)))
    return Box(tuple(off), tuple(sz))


@st.composite
def broken_partitions(draw):
    """A partition mutated so that it no longer tiles the shape."""
    shape, boxes, _ = draw(partitions(nonzero_shapes))
    boxes = sorted(set(nonempty(boxes)))
    i = draw(st.integers(0, len(boxes) - 1))
    b = boxes[i]
    kinds = ["drop", "duplicate"]
    if shape:
        kinds += ["shift", "grow", "shrink", "outside"]
    kind = draw(st.sampled_from(kinds))
    if kind == "drop":
        return shape, boxes[:i] + boxes[i + 1 :], kind
    if kind == "duplicate":  # the same box listed twice counts as an overlap
        return shape, boxes + [b], kind
    d = draw(st.integers(0, len(shape) - 1))

    def with_dim(box, off, size):
        return Box(box.offset[:d] + (off,) + box.offset[d + 1 :], box.shape[:d] + (size,) + box.shape[d + 1 :])

    if kind == "shift":
        step = draw(st.sampled_from([-1, 1]))
        new = with_dim(b, b.offset[d] + step, b.shape[d])
    elif kind == "grow":
        new = with_dim(b, b.offset[d], b.shape[d] + 1)  # into a neighbour, or out of bounds
    elif kind == "shrink":
        if b.shape[d] == 1:
            return shape, boxes[:i] + boxes[i + 1 :], "drop"
        new = with_dim(b, b.offset[d], b.shape[d] - 1)
    else:
        new = with_dim(b, shape[d] - b.shape[d] + 1, b.shape[d])
    return shape, boxes[:i] + [new] + boxes[i + 1 :], kind
