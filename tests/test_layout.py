"""Property tests of the pure layout math (tensorckpt.layout): chunk grids,
partition checks, read plans, bytes fetched and the global save plan.

No I/O and no processes: random shapes (0-4 dims, sizes 0-12) and random box
partitions (even, np.array_split-style, torch.chunk-style, random cuts and
non-grid "guillotine" partitions, with replicated duplicates), checked against
brute-force element counts.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
from tensorckpt.layout.plan import LocalItem, LocalPlan, build_save_plan, plan_bytes

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


# --------------------------------------------------------- build_save_plan


@st.composite
def local_plans(draw):
    """Random LocalPlans: several keys, each a partition held by several
    ranks (replicas, ranks holding an empty box, ranks lacking the key)."""
    n_keys = draw(st.integers(1, 3))
    keys = {}
    holders: dict[int, list[LocalItem]] = {}
    n_ranks = draw(st.integers(1, 6))
    for k in range(n_keys):
        key = f"m/t{k}"
        shape, boxes, _ = draw(partitions())
        dtype = draw(st.sampled_from(DTYPE_NAMES))
        real = sorted(set(nonempty(boxes)))
        if not real and shape and 0 not in shape:
            real = [Box.full(shape)]
        keys[key] = (shape, dtype, real)
        n_ranks = max(n_ranks, len(real))
        order = draw(st.permutations(range(n_ranks)))
        for box, r in zip(real, order):  # every box has at least one holder
            holders.setdefault(r, []).append(LocalItem(key, dtype, shape, box))
        if not real:  # nothing to store (a zero-size dimension): someone still holds the key
            holders.setdefault(order[0], []).append(LocalItem(key, dtype, shape, Box.full(shape)))
        for r in order[max(1, len(real)) :]:
            what = draw(st.sampled_from(["replica", "empty", "nothing"]))
            if what == "replica" and real:
                box = draw(st.sampled_from(real))
            elif what == "empty" and shape:
                box = Box((0,) * len(shape), (0,) + shape[1:])
            else:
                continue
            holders.setdefault(r, []).append(LocalItem(key, dtype, shape, box))
    # items are per key; ranks [0, n_ranks) all exist (possibly holding nothing)
    values = {r: {"step": r, f"v{r}": [r]} for r in range(n_ranks)}
    plans = [LocalPlan(r, tuple(holders.get(r, ())), values[r]) for r in range(n_ranks)]
    shard_bytes = draw(st.sampled_from([1, 16, 64, grid.DEFAULT_SHARD_BYTES]))
    return plans, keys, shard_bytes


@SETTINGS
@given(local_plans())
def test_build_save_plan(case):
    plans, keys, shard_bytes = case
    plan = build_save_plan(plans, shard_bytes=shard_bytes, inner_bytes=max(1, shard_bytes // 4))
    held = {(p.rank, it.key, it.box) for p in plans for it in p.items}
    writes = Counter((k, b) for r, ws in plan.writes.items() for k, b in ws)
    for r, ws in plan.writes.items():
        for k, b in ws:
            assert (r, k, b) in held, f"rank {r} writes {k} {b} which it does not hold"
    assert set(plan.entries) == set(keys)
    for key, (shape, dtype, real) in keys.items():
        e = plan.entries[key]
        assert (e.shape, e.dtype) == (shape, dtype)
        written = [b for (k, b), n in writes.items() if k == key]
        for b in written:
            assert writes[(key, b)] == 1, f"{key} {b} has {writes[(key, b)]} writers"
        assert set(written) == set(real), (key, written, real)
        assert all(c % i == 0 for c, i in zip(e.chunk_shape, e.inner_chunk_shape))
        for cb in all_chunks(shape, e.chunk_shape):
            in_written = [b for b in written if inside(cb, b)]
            assert len(in_written) == 1, f"{key}: stored chunk {cb} (grid {e.chunk_shape}) lies in {in_written}"
        holders = {p.rank for p in plans for it in p.items if it.key == key}
        assert plan.meta_writers[key] in holders
    # values: the lowest rank holding a value wins
    assert plan.values["step"] == 0
    assert all(plan.values[f"v{p.rank}"] == [p.rank] for p in plans)
    assert sum(plan_bytes(plan, p.rank) for p in plans) == sum(
        b.numel * dtypes.BY_TORCH[keys[k][1]].itemsize for (k, b) in writes
    )


@SETTINGS
@given(st.integers(1, 6), st.integers(1, 12), st.sampled_from([(5, 3), (64,), (), (2, 2, 2)]))
def test_replicated_writes_are_spread(n_ranks, k_tensors, shape):
    """N identical full replicas of K equal tensors: no rank writes more than ceil(K/N)."""
    items = tuple(LocalItem(f"t{i:02d}", "float32", shape, Box.full(shape)) for i in range(k_tensors))
    plan = build_save_plan([LocalPlan(r, items) for r in range(n_ranks)])
    per_rank = Counter(r for r, ws in plan.writes.items() for _ in ws)
    assert sum(per_rank.values()) == k_tensors
    assert max(per_rank.values()) <= -(-k_tensors // n_ranks), per_rank
    assert len(per_rank) == min(n_ranks, k_tensors)


def test_hsdp_replicas_spread():
    """[Replicate(), Shard(0)] on a 2x2 mesh: 4 equal tensors, 8 boxes, 2 per rank."""
    items = {0: [], 1: [], 2: [], 3: []}
    for t in range(4):
        for r in range(4):
            half = r % 2
            items[r].append(LocalItem(f"t{t}", "float32", (8, 6), Box((4 * half, 0), (4, 6))))
    plan = build_save_plan([LocalPlan(r, tuple(items[r])) for r in range(4)])
    assert {r: len(plan.writes_of(r)) for r in range(4)} == {0: 2, 1: 2, 2: 2, 3: 2}


@pytest.mark.parametrize(
    "other",
    [
        LocalItem("enc/layer.0.weight", "float32", (8, 5), Box((4, 0), (4, 5))),  # shape
        LocalItem("enc/layer.0.weight", "bfloat16", (8, 4), Box((4, 0), (4, 4))),  # dtype
    ],
)
def test_ranks_disagreeing_on_tensor_name_the_key(other):
    mine = LocalItem("enc/layer.0.weight", "float32", (8, 4), Box((0, 0), (4, 4)))
    with pytest.raises(IncompatibleStateError, match=r"'enc/layer\.0\.weight'.*disagree"):
        build_save_plan([LocalPlan(0, (mine,)), LocalPlan(1, (other,))])


def test_tensor_value_clash_names_the_key():
    with pytest.raises(IncompatibleStateError, match="step"):
        build_save_plan([LocalPlan(0, (LocalItem("step", "int64", (), Box((), ())),)), LocalPlan(1, (), {"step": 3})])


def test_bad_partition_names_the_key():
    a = LocalItem("w", "float32", (8,), Box((0,), (5,)))
    b = LocalItem("w", "float32", (8,), Box((4,), (4,)))
    with pytest.raises(IncompatibleStateError, match="'w'.*overlap"):
        build_save_plan([LocalPlan(0, (a,)), LocalPlan(1, (b,))])
