"""Property tests of the pure box and grid math (tensorckpt.layout.boxes,
tensorckpt.layout.grid): chunk grids, partition checks, read plans and bytes
fetched. The save plan built on them is tested in test_layout_plan.py.

No I/O and no processes: random shapes and box partitions from
layout_strategies.py (with replicated duplicates), checked against
brute-force element counts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from layout_strategies import (
    DTYPE_NAMES,
    SETTINGS,
    all_chunks,
    box_in,
    broken_partitions,
    coverage,
    grid_boxes,
    inside,
    nonempty,
    nonzero_shapes,
    partitions,
    shapes,
)

from tensorckpt.errors import IncompatibleStateError
from tensorckpt.format import dtypes
from tensorckpt.layout import grid
from tensorckpt.layout.boxes import (
    Box,
    bytes_fetched,
    check_partition,
    chunk_box,
    chunk_grid,
    chunks_in,
    read_plan,
)

# ------------------------------------------------------------- chunk_grid


@SETTINGS
@given(partitions(), st.integers(0, 3))
def test_chunk_grid_chunks_lie_inside_exactly_one_box(part, dup):
    shape, boxes, _ = part
    real = nonempty(boxes)
    # replicated duplicates must not change the grid's correctness
    with_dups = real + real[:dup]
    chunk = chunk_grid(shape, with_dups)
    assert len(chunk) == len(shape)
    assert all(c >= 1 for c in chunk)
    for b in real:
        assert all(o % c == 0 for o, c in zip(b.offset, chunk)), (b, chunk)
    distinct = set(real)
    for cb in all_chunks(shape, chunk):
        holders = [b for b in distinct if inside(cb, b)]
        assert len(holders) == 1, f"chunk {cb} of grid {chunk} lies in {holders} (boxes {sorted(distinct)})"


@SETTINGS
@given(st.lists(st.integers(1, 12), min_size=1, max_size=4), st.data())
def test_chunk_grid_even_split_is_the_box(shape, data):
    """Even (and torch.chunk-style where the starts are multiples of the
    first size) splits give chunk == box."""
    shape = tuple(shape)
    sizes = []
    for n in shape:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        parts = data.draw(st.sampled_from(divisors))
        sizes.append([n // parts] * parts)
    boxes = grid_boxes(shape, sizes)
    assert chunk_grid(shape, boxes) == boxes[0].shape


def test_chunk_grid_examples():
    assert chunk_grid((10,), [Box((0,), (4,)), Box((4,), (3,)), Box((7,), (3,))]) == (1,)
    assert chunk_grid((10, 7), [Box((0, 0), (5, 7)), Box((5, 0), (5, 7))]) == (5, 7)
    assert chunk_grid((10,), [Box((0,), (4,)), Box((4,), (4,)), Box((8,), (2,))]) == (4,)  # torch.chunk style
    assert chunk_grid((0, 3), []) == (1, 3)
    assert chunk_grid((), [Box((), ())]) == ()


# --------------------------------------------------------- check_partition


@SETTINGS
@given(partitions())
def test_check_partition_accepts_partitions(part):
    shape, boxes, _ = part
    check_partition("k", shape, sorted(set(boxes)))
    check_partition("k", shape, sorted(set(nonempty(boxes))))


@SETTINGS
@given(broken_partitions())
def test_check_partition_rejects_overlaps_and_gaps(broken):
    shape, boxes, kind = broken
    with pytest.raises(IncompatibleStateError, match="'the/key'"):
        check_partition("the/key", shape, boxes)


@SETTINGS
@given(nonzero_shapes.flatmap(lambda s: st.tuples(st.just(s), st.lists(box_in(s), min_size=0, max_size=5))))
def test_check_partition_matches_brute_force(case):
    """On arbitrary box sets: accepted iff every element is held exactly once."""
    shape, boxes = case
    counts = coverage(shape, boxes)
    ok = bool(np.all(counts == 1))
    if ok:
        check_partition("k", shape, boxes)
    else:
        with pytest.raises(IncompatibleStateError):
            check_partition("k", shape, boxes)


def test_check_partition_messages():
    with pytest.raises(IncompatibleStateError, match="'w'.*overlap"):
        check_partition("w", (4,), [Box((0,), (3,)), Box((2,), (2,))])
    with pytest.raises(IncompatibleStateError, match="'w'.*uncovered"):
        check_partition("w", (4,), [Box((0,), (2,)), Box((3,), (1,))])
    with pytest.raises(IncompatibleStateError, match="'w'.*outside"):
        check_partition("w", (4,), [Box((0,), (5,))])
    # overlap and gap with a matching element count
    with pytest.raises(IncompatibleStateError, match="'w'"):
        check_partition("w", (3,), [Box((0,), (2,)), Box((1,), (1,))])
    check_partition("w", (0, 5), [])
    check_partition("w", (), [Box((), ())])


# --------------------------------------------------------------- read_plan


chunked = shapes.flatmap(
    lambda s: st.tuples(
        st.just(s),
        st.tuples(*[st.integers(1, max(1, n) + 2) for n in s]),
        box_in(s),
    )
)


@SETTINGS
@given(chunked)
def test_read_plan_covers_target_exactly_once(case):
    shape, chunk, want = case
    pieces = read_plan(shape, chunk, want)
    counts = np.zeros(want.shape, dtype=np.int64)
    full = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    out = np.full(want.shape, -1, dtype=np.int64)
    for p in pieces:
        assert p.src.shape == p.dst.shape
        assert p.src.numel > 0
        assert tuple(s - o for s, o in zip(p.src.offset, want.offset)) == p.dst.offset
        stored = chunk_box(p.chunk, chunk, shape)
        assert inside(p.src, stored), (p, stored)
        assert inside(p.src, want)
        counts[p.dst.slices()] += 1
        out[p.dst.slices()] = full[p.src.slices()]
    assert np.all(counts == 1), counts
    np.testing.assert_array_equal(out, full[want.slices()])
    # distinct stored chunks: a piece per overlapped chunk, no more
    assert len({p.chunk for p in pieces}) == len(pieces)


@SETTINGS
@given(
    nonzero_shapes.flatmap(
        lambda s: st.tuples(st.just(s), partitions(st.just(s)), partitions(st.just(s)), st.sampled_from(DTYPE_NAMES))
    )
)
def test_read_plan_reshards_any_source_to_any_target(case):
    """Source partition -> its stored chunk grid; every box of a different
    target partition is read exactly once, each piece from one stored chunk
    that lies in one source box; the target boxes together read every element once."""
    shape, (_, src_boxes, _), (_, dst_boxes, _), dtype = case
    src = sorted(set(nonempty(src_boxes)))
    itemsize = dtypes.BY_TORCH[dtype].itemsize
    chunk = chunk_grid(shape, src)
    inner = grid.inner_chunks(chunk, itemsize, 64)
    total = np.zeros(shape, dtype=np.int64)
    for want in dst_boxes:
        counts = np.zeros(want.shape, dtype=np.int64)
        for p in read_plan(shape, chunk, want):
            stored = chunk_box(p.chunk, chunk, shape)
            assert inside(p.src, stored)
            assert sum(inside(stored, b) for b in src) == 1, (stored, src)
            counts[p.dst.slices()] += 1
            total[p.src.slices()] += 1
        assert np.all(counts == 1)
        need = want.numel * itemsize
        got = bytes_fetched(shape, inner, want, itemsize)
        assert got >= need
        if all(o % c == 0 and e % c == 0 for o, e, c in zip(want.offset, want.end, inner)):
            assert got == need
    assert np.all(total == 1)


@SETTINGS
@given(chunked, st.sampled_from([1, 2, 4, 8]))
def test_bytes_fetched(case, itemsize):
    shape, inner, want = case
    need = want.numel * itemsize
    got = bytes_fetched(shape, inner, want, itemsize)
    assert got >= need
    if want.numel == 0:
        assert got == 0
        return
    # brute force: every overlapped inner chunk, decoded whole
    n_chunks = len(list(chunks_in(want, inner, shape)))
    assert got == n_chunks * math.prod(inner) * itemsize
    aligned = all(o % c == 0 and e % c == 0 for o, e, c in zip(want.offset, want.end, inner))
    if aligned:
        assert got == need


@SETTINGS
@given(partitions(nonzero_shapes), st.sampled_from(DTYPE_NAMES), st.sampled_from([1, 64, grid.DEFAULT_INNER_BYTES]))
def test_writer_boxes_are_inner_chunk_aligned(part, dtype, inner_bytes):
    """Inner chunks never straddle a writer's box, so reading back exactly a
    writer's box fetches nothing of its neighbours (only the edge padding of
    the array's last inner chunk, stored at full size)."""
    shape, boxes, _ = part
    real = sorted(set(nonempty(boxes)))
    itemsize = dtypes.BY_TORCH[dtype].itemsize
    chunk = chunk_grid(shape, real)
    inner = grid.inner_chunks(chunk, itemsize, inner_bytes)
    for b in real:
        assert all(o % c == 0 for o, c in zip(b.offset, inner))
        assert all(e % c == 0 or e == n for e, c, n in zip(b.end, inner, shape))
        padded = math.prod(-(-e // c) * c - o for o, e, c in zip(b.offset, b.end, inner))
        assert bytes_fetched(shape, inner, b, itemsize) == padded * itemsize
        if all(e % c == 0 for e, c in zip(b.end, inner)):
            assert bytes_fetched(shape, inner, b, itemsize) == b.numel * itemsize


# ------------------------------------------------------------- grid helpers


@SETTINGS
@given(shapes, st.sampled_from(DTYPE_NAMES), st.sampled_from([1, 7, 64, 1000, 1 << 20]))
def test_single_writer_and_inner_chunks(shape, dtype, target):
    itemsize = dtypes.BY_TORCH[dtype].itemsize
    chunk = grid.single_writer_chunks(shape, itemsize, max(target, itemsize))
    assert len(chunk) == len(shape) and all(c >= 1 for c in chunk)
    assert tuple(chunk[1:]) == tuple(max(1, n) for n in shape[1:])
    inner = grid.inner_chunks(chunk, itemsize, target)
    assert all(c % i == 0 for c, i in zip(chunk, inner))
    capped = grid.cap_chunks(chunk, itemsize, target)
    assert all(c % i == 0 for c, i in zip(chunk, capped))
