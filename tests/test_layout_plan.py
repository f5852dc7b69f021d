"""Property tests of the global save plan (tensorckpt.layout.plan): writer
assignment and replica spreading, the vectorized planner against the
reference one it replaced, compact local plans, and linear growth with the
number of ranks. The box and grid math under it is tested in test_layout.py.

No I/O and no processes: random local plans built from the partitions of
layout_strategies.py.
"""

from __future__ import annotations

import itertools
import math
import pickle
from collections import Counter
from dataclasses import replace

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
    in_bounds,
    inside,
    nonempty,
    partitions,
    shapes,
)

from tensorckpt.errors import IncompatibleStateError
from tensorckpt.format import dtypes
from tensorckpt.format.metadata import RootMetadata, TensorEntry, root_group_json
from tensorckpt.layout import grid, tiling
from tensorckpt.layout.boxes import (
    Box,
    box_arrays,
    check_partition,
)
from tensorckpt.layout.plan import (
    LocalItem,
    LocalItems,
    LocalPlan,
    Piece,
    build_save_plan,
    merge_values,
    plan_bytes,
)

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
    values = {r: {"step": 0, f"v{r}": [r]} for r in range(n_ranks)}  # a shared key: equal on every rank
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
        for k, b in ws:  # a re-gridded tensor's chunks: see test_exchange.py
            assert (r, k, b) in held or k in plan.regrid, f"rank {r} writes {k} {b} which it does not hold"
    assert set(plan.entries) == set(keys)
    for key, (shape, dtype, real) in keys.items():
        e = plan.entries[key]
        assert (e.shape, e.dtype) == (shape, dtype)
        written = [b for (k, b), n in writes.items() if k == key]
        for b in written:
            assert writes[(key, b)] == 1, f"{key} {b} has {writes[(key, b)]} writers"
        if key in plan.regrid:
            assert set(written) == set(all_chunks(shape, e.chunk_shape)), (key, written)
        else:
            assert set(written) == set(real), (key, written, real)
        assert all(c % i == 0 for c, i in zip(e.chunk_shape, e.inner_chunk_shape))
        for cb in all_chunks(shape, e.chunk_shape):
            in_written = [b for b in written if inside(cb, b)]
            assert len(in_written) == 1, f"{key}: stored chunk {cb} (grid {e.chunk_shape}) lies in {in_written}"
        holders = {p.rank for p in plans for it in p.items if it.key == key}
        assert plan.meta_writers[key] in holders
    # values: the union; a key several ranks hold has one value
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
    # one key, different values on two ranks: one would be lost (format-v1.md 9.4, since 1.2)
    with pytest.raises(IncompatibleStateError, match=r"'lr': rank 0 has 0.1, rank 2 has 0.2"):
        build_save_plan([LocalPlan(0, (), {"lr": 0.1}), LocalPlan(1, (), {"lr": 0.1}), LocalPlan(2, (), {"lr": 0.2})])
    with pytest.raises(IncompatibleStateError, match="'flag': rank 0 has True, rank 1 has 1"):  # 1 == True in Python, not in JSON
        build_save_plan([LocalPlan(0, (), {"flag": True}), LocalPlan(1, (), {"flag": 1})])


def test_bad_partition_names_the_key():
    a = LocalItem("w", "float32", (8,), Box((0,), (5,)))
    b = LocalItem("w", "float32", (8,), Box((4,), (4,)))
    with pytest.raises(IncompatibleStateError, match="'w'.*overlap"):
        build_save_plan([LocalPlan(0, (a,)), LocalPlan(1, (b,))])


# ------------------------------------- the vectorized planner vs a reference
#
# The reference is the straightforward planner this package used to ship: one
# Python object per box, replicas grouped in a dict, writers chosen one box at
# a time. The vectorized planner must agree with it exactly: same entries,
# writes, zarr.json writers and values, or the same error.


def reference_check_partition(key, shape, boxes):
    for b in boxes:
        if len(b.offset) != len(shape) or any(o < 0 or e > n for o, e, n in zip(b.offset, b.end, shape)):
            raise IncompatibleStateError(f"{key!r}: shard {b.to_json()} lies outside the global shape {list(shape)}")
    total = math.prod(shape)
    if total == 0:
        return
    held = sorted(b for b in boxes if b.numel)
    covered = sum(b.numel for b in held)
    disjoint = all(a.intersect(b) is None for a, b in itertools.combinations(held, 2))
    if covered == total and disjoint:
        return
    what = "overlap" if covered > total or not disjoint else "leave elements uncovered"
    raise IncompatibleStateError(
        f"{key!r}: the ranks' shards of global shape {list(shape)} {what}: "
        f"{[b.to_json() for b in held[:8]]}{' ...' if len(held) > 8 else ''}; each element must be "
        "held by exactly one distinct shard (replicas must hold identical boxes)"
    )


def reference_grid(shape, boxes):
    """Spec section 8's reference chunk grid, before capping, from its
    wording: along each dimension the gcd of the box starts (the whole
    dimension when none is offset), unless that makes more than twice as many
    chunks as there are distinct starts; then the largest box extent."""
    chunk = []
    for d, n in enumerate(shape):
        starts = {b.offset[d] for b in boxes}
        c = max(1, math.gcd(*starts) or n)
        if -(-n // c) > 2 * len(starts):
            c = max(b.shape[d] for b in boxes)
        chunk.append(c)
    return tuple(chunk)


def reference_owners(shape, chunk, boxes):
    """Chunk -> the index of the box sharing the most elements with it (ties:
    the first box), for every chunk, one at a time."""
    owners = {}
    for cb in all_chunks(shape, chunk):
        shared = [(cb.intersect(b).numel if cb.intersect(b) else 0, -i) for i, b in enumerate(boxes)]
        owners[cb] = -max(shared)[1]
    return owners


def reference_build_save_plan(plans, shard_bytes, inner_bytes):
    by_key = {}
    for p in plans:
        for it in p.items:
            by_key.setdefault(it.key, []).append((p.rank, it))
    values = merge_values(plans)
    clash = sorted(set(values) & set(by_key))
    if clash:
        raise IncompatibleStateError(f"keys {clash[:10]} are tensors on some ranks and plain values on others")
    entries, writes, meta, load, pieces = {}, {}, {}, {p.rank: 0 for p in plans}, []
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
        replicas = {}
        for rank, it in holders:
            if it.box.numel or not first.shape:
                replicas.setdefault(it.box, []).append(rank)
        boxes = sorted(replicas)
        reference_check_partition(key, first.shape, boxes)
        if boxes == [Box.full(first.shape)] or not boxes:
            chunk = grid.single_writer_chunks(first.shape, itemsize, shard_bytes)
        else:
            chunk = grid.cap_chunks(reference_grid(first.shape, boxes), itemsize, shard_bytes)
        entries[key] = TensorEntry(first.dtype, first.shape, chunk, grid.inner_chunks(chunk, itemsize, inner_bytes))
        follows = all(o % c == 0 for b in boxes for o, c in zip(b.offset, chunk))
        owners = {} if follows else reference_owners(first.shape, chunk, boxes)
        writer_of = {}
        for i, box in enumerate(boxes):
            writer = min(replicas[box], key=lambda r: (load[r], r))
            writer_of[i] = writer
            mine = [box] if follows else [cb for cb, o in owners.items() if o == i]
            load[writer] += sum(b.numel for b in mine) * itemsize
            writes.setdefault(writer, []).extend((key, b) for b in mine)
            meta.setdefault(key, writer)
        meta.setdefault(key, holders[0][0])
        for cb, o in owners.items():
            for i, box in enumerate(boxes):
                part = cb.intersect(box)
                if i != o and part is not None:
                    pieces.append(Piece(key, cb, writer_of[i], writer_of[o], part))
    writes = {r: tuple(w) for r, w in writes.items() if w}
    return entries, writes, meta, values, tuple(pieces)


def outcome(f, *args):
    try:
        return "ok", f(*args)
    except IncompatibleStateError as e:
        return "error", str(e)


@st.composite
def any_boxes(draw):
    """Valid, broken and arbitrary box lists (with repeats), in any order."""
    kind = draw(st.sampled_from(["partition", "broken", "arbitrary"]))
    if kind == "partition":
        shape, boxes, _ = draw(partitions())
    elif kind == "broken":
        shape, boxes, _ = draw(broken_partitions())
    else:
        shape = draw(shapes)
        boxes = draw(st.lists(box_in(shape), max_size=6))
    return shape, draw(st.permutations(boxes + draw(st.lists(st.sampled_from(boxes), max_size=2)) if boxes else []))


@SETTINGS
@given(any_boxes())
def test_check_partition_matches_reference(case):
    shape, boxes = case
    assert outcome(check_partition, "k", shape, boxes) == outcome(reference_check_partition, "k", shape, boxes)


@SETTINGS
@given(any_boxes())
def test_check_partition_sweep_matches_cell_count(case):
    """The sweep used past MAX_CELLS decides overlaps like cell counting."""
    shape, boxes = case
    held = [b for b in boxes if b.numel and in_bounds(shape, b)]
    if len(shape) < 2 or not held:
        return
    starts, sizes = box_arrays(held, len(shape))
    coords = [np.unique(np.concatenate([starts[:, d], starts[:, d] + sizes[:, d]])) for d in range(len(shape))]
    by_cells = tiling._coverage(coords, tuple(map(len, coords)), starts, starts + sizes).max() > 1
    assert tiling._overlaps_sweep(starts, starts + sizes) == by_cells
    assert by_cells == bool(np.any(coverage(shape, held) > 1))


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)), max_size=12))
def test_unique_rows(rows):
    rows = np.array(rows, np.int64).reshape(len(rows), 3)
    uniq, inverse = tiling.unique_rows(rows)
    expected = np.unique(rows, axis=0) if len(rows) else rows
    np.testing.assert_array_equal(uniq, expected)
    np.testing.assert_array_equal(uniq[inverse], rows)


@st.composite
def messy_local_plans(draw):
    """local_plans(), in any order, sometimes broken: a rank disagreeing on a
    tensor's dtype or shape, or holding a box that breaks the partition."""
    plans, _, shard_bytes = draw(local_plans())
    plans = list(draw(st.permutations(plans)))
    holding = [i for i, p in enumerate(plans) if len(p.items)]
    if holding and draw(st.booleans()):
        i = draw(st.sampled_from(holding))
        items = list(plans[i].items)
        j = draw(st.integers(0, len(items) - 1))
        it = items[j]
        how = draw(st.sampled_from(["dtype", "shape", "box"]))
        if how == "dtype":
            items[j] = replace(it, dtype="int16" if it.dtype != "int16" else "float32")
        elif how == "shape":
            items[j] = LocalItem(it.key, it.dtype, (*it.shape, 1), Box((*it.box.offset, 0), (*it.box.shape, 1)))
        else:
            items[j] = replace(it, box=draw(box_in(tuple(n + 1 for n in it.shape))))
        plans[i] = replace(plans[i], items=tuple(items))
    return plans, shard_bytes


@SETTINGS
@given(messy_local_plans())
def test_build_save_plan_matches_reference(case):
    plans, shard_bytes = case
    inner = max(1, shard_bytes // 4)
    got = outcome(build_save_plan, plans, shard_bytes, inner)
    want = outcome(reference_build_save_plan, plans, shard_bytes, inner)
    if got[0] == "ok":
        got = ("ok", (got[1].entries, got[1].writes, got[1].meta_writers, got[1].values, got[1].pieces_of()))
    assert got == want


def test_replicas_go_to_the_least_loaded_holder():
    """HSDP-style: 3 replicas x 2 shards of several tensors, plus one tensor
    only rank 0 holds, which loads rank 0 first."""
    big = LocalItem("a", "float32", (64,), Box.full((64,)))
    plans = []
    for r in range(6):
        half = Box(((r % 2) * 4, 0), (4, 3))
        items = [LocalItem(f"t{i}", "float32", (8, 3), half) for i in range(5)]
        plans.append(LocalPlan(r, ([big] if r == 0 else []) + items))
    got = build_save_plan(plans)
    want = reference_build_save_plan(plans, grid.DEFAULT_SHARD_BYTES, grid.DEFAULT_INNER_BYTES)
    assert (got.entries, got.writes, got.meta_writers) == want[:3]
    # greedy by bytes: rank 0 already writes "a" (256 B), so the t_i (48 B each) go to the others
    assert {r: len(w) for r, w in got.writes.items()} == {0: 1, 1: 2, 2: 3, 3: 2, 4: 2, 5: 1}


# ------------------------------------------------------ compact local plans


def test_local_items_round_trip():
    items = (
        LocalItem("m/w", "bfloat16", (8, 4), Box((4, 0), (4, 4))),
        LocalItem("m/s", "int64", (), Box((), ())),
        LocalItem("m/e", "float32", (0, 3), Box((0, 0), (0, 3))),
    )
    plan = LocalPlan(3, items, {"step": 1})
    assert isinstance(plan.items, LocalItems) and len(plan.items) == 3
    assert tuple(plan.items) == items and plan.items[1] == items[1]
    back = pickle.loads(pickle.dumps(plan))
    assert back == plan and tuple(back.items) == items
    flat = np.array([4, 0, 4, 4, 0, 0, 0, 3])
    assert LocalItems.from_arrays([(i.key, i.dtype, i.shape) for i in items], flat) == plan.items
    assert replace(plan, items=()).items == LocalItems.of(()) and not replace(plan, items=()).items
    assert LocalItems.of(items[:1]) != plan.items


def test_local_items_reject_bad_input():
    w = LocalItem("w", "float32", (8,), Box((0,), (4,)))
    with pytest.raises(ValueError, match="'w'"):
        LocalItems.of([w, w])
    with pytest.raises(IncompatibleStateError, match="'w'.*outside"):
        LocalItems.of([LocalItem("w", "float32", (8,), Box((0, 0), (4, 1)))])
    with pytest.raises(ValueError, match="expected 2 numbers"):
        LocalItems.from_arrays([("w", "float32", (8,))], np.zeros(3))


def test_save_plan_pickles_and_replaces():
    items = [LocalItem("w", "float32", (8, 2), Box((4 * r, 0), (4, 2))) for r in range(2)]
    plan = build_save_plan([LocalPlan(r, (items[r],), {"v": 0, f"r{r}": r}) for r in range(2)])
    back = pickle.loads(pickle.dumps(plan))
    assert back == plan and back.writes_of(1) == (("w", items[1].box),) and back.writes_of(7) == ()
    assert replace(plan, values={"v": 9}).writes == plan.writes
    assert plan_bytes(plan, 0) == 32


# ------------------------------------------------------------ linear growth


def fsdp_plans(world: int, n_tensors: int) -> list[LocalPlan]:
    """Shard(0) of ``n_tensors`` tensors of 1,000 rows over ``world`` ranks."""
    plans = []
    for r in range(world):
        rows = -(-1000 // world)
        lo, hi = min(r * rows, 1000), min((r + 1) * rows, 1000)
        box = Box((lo, 0), (hi - lo, 64))
        plans.append(LocalPlan(r, [LocalItem(f"layers.{i}.w", "bfloat16", (1000, 64), box) for i in range(n_tensors)]))
    return plans


def test_plan_sizes_grow_linearly():
    """Not timed: what the collectives carry grows linearly with ranks (a
    constant per rank), and the root metadata does not grow with ranks."""
    sizes = {}
    for world in (50, 100, 200):
        plans = fsdp_plans(world, 40)
        gathered = sum(len(pickle.dumps(p)) for p in plans)
        plan = build_save_plan(plans)
        meta = root_group_json(RootMetadata(plan.entries, {}, world_size=world))
        sizes[world] = (gathered / world, len(pickle.dumps(plan)) / world, len(meta))
        assert sum(len(plan.writes_of(r)) for r in range(world)) == 40 * min(world, 1000)
    per_rank = [s[0] for s in sizes.values()]
    assert max(per_rank) < 1.2 * min(per_rank) and max(per_rank) < 1000  # bytes per rank for 40 tensors
    broadcast = [s[1] for s in sizes.values()]  # per rank: a fixed part (entries, one table) amortized
    assert broadcast == sorted(broadcast, reverse=True)
    meta = [s[2] for s in sizes.values()]  # only the digits of chunk shapes and world_size differ
    assert max(meta) - min(meta) < 100


def job_layouts():
    """(name, plans) for a few job-shaped layouts over 24-48 ranks."""
    shapes = {"embed": (1000, 16), "w": (48, 40), "b": (40,), "s": ()}

    def items(box_of):
        return [LocalItem(k, "bfloat16", s, box_of(s)) for k, s in shapes.items()]

    def chunk_split(n, parts, i):  # torch.chunk: ceil-sized pieces, then empty ones
        step = -(-n // parts)
        return min(i * step, n), min((i + 1) * step, n)

    def fsdp(world, r):
        def box(s):
            if not s:
                return Box((), ())
            lo, hi = chunk_split(s[0], world, r)
            return Box((lo, *[0] * (len(s) - 1)), (hi - lo, *s[1:]))

        return box

    def tp_fsdp(tp, dp, r):  # 2-D: rows over dp, columns over tp
        def box(s):
            if len(s) < 2:
                return fsdp(dp, r // tp)(s)
            (r0, r1), (c0, c1) = chunk_split(s[0], dp, r // tp), chunk_split(s[1], tp, r % tp)
            return Box((r0, c0), (r1 - r0, c1 - c0))

        return box

    yield "fsdp", [LocalPlan(r, items(fsdp(48, r))) for r in range(48)]
    yield "tp x fsdp", [LocalPlan(r, items(tp_fsdp(4, 8, r))) for r in range(32)]
    yield "hsdp", [LocalPlan(r, items(fsdp(8, r % 8))) for r in range(24)]  # 3 replicas of 8 shards
    yield "shuffled", [LocalPlan(r, items(fsdp(8, r % 8))) for r in (5, 17, 0, 23, 8, *range(1, 5), *range(9, 17))]


@pytest.mark.parametrize("name, plans", list(job_layouts()), ids=lambda v: v if isinstance(v, str) else "")
def test_job_layouts_match_reference(name, plans):
    got = build_save_plan(plans, shard_bytes=256, inner_bytes=64)
    want = reference_build_save_plan(plans, 256, 64)
    assert (got.entries, got.writes, got.meta_writers, got.values, got.pieces_of()) == want
    assert not got.moves_pieces  # torch.chunk-style splits: chunk = box
