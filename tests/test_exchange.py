"""The chunk grid of irregular splits and its exchange plan (pure layout
math: tensorckpt.layout.regrid and the pieces of tensorckpt.layout.plan).

No processes: random irregular 1-D and 2-D partitions (np.array_split,
random cuts, guillotine splits, empty boxes, replicas), checked element by
element: every stored chunk has exactly one writer, and the writer's own part
plus the pieces sent to it tile the chunk exactly. Even and torch.chunk-style
splits move nothing. The multi-process side is tests/test_exchange_dist.py.
"""

from __future__ import annotations

import math
import os
import pickle
import sys
import time
from collections import Counter
from dataclasses import replace

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from layout_strategies import SETTINGS, all_chunks, coverage, grid_boxes, guillotine, nonempty  # noqa: E402

from tensorckpt.format import dtypes  # noqa: E402
from tensorckpt.layout import grid, regrid  # noqa: E402
from tensorckpt.layout.boxes import Box, box_arrays  # noqa: E402
from tensorckpt.layout.plan import LocalItem, LocalPlan, SavePlan, build_save_plan, plan_bytes  # noqa: E402

# ---------------------------------------------------------------- strategies


def array_split(n: int, k: int) -> list[int]:
    return [len(a) for a in np.array_split(np.arange(n), k)]


@st.composite
def irregular_sizes(draw, n: int) -> list[int]:
    """Interval sizes tiling ``range(n)``: np.array_split, random cuts, or
    either with empty intervals mixed in."""
    style = draw(st.sampled_from(["array_split", "random", "with_empty"]))
    if style == "array_split" or n < 2:
        sizes = array_split(n, draw(st.integers(1, 7)))
    else:
        points = sorted(draw(st.sets(st.integers(1, n - 1), max_size=6)))
        sizes = [b - a for a, b in zip([0, *points], [*points, n])]
    if style == "with_empty":
        for _ in range(draw(st.integers(1, 2))):
            sizes.insert(draw(st.integers(0, len(sizes))), 0)
    return sizes


@st.composite
def irregular_partitions(draw):
    """(shape, boxes): a 1-D or 2-D shape (sizes up to 40) and a product or
    guillotine partition of it (empty boxes kept)."""
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=2)))
    if len(shape) == 2 and draw(st.booleans()):
        return shape, draw(guillotine(shape))
    return shape, grid_boxes(shape, [draw(irregular_sizes(n)) for n in shape])


@st.composite
def held_plans(draw, partitions=irregular_partitions()):
    """LocalPlans of one tensor ``w`` over the partition's boxes, a few
    replicated on more ranks, ranks in shuffled order; plus the shape."""
    shape, boxes = draw(partitions)
    dtype = draw(st.sampled_from(["float32", "bfloat16", "int8"]))
    held = list(boxes) + draw(st.lists(st.sampled_from(boxes), max_size=3))  # replicas
    ranks = draw(st.permutations(range(len(held))))
    plans = [LocalPlan(r, (LocalItem("w", dtype, shape, b),)) for r, b in zip(ranks, held)]
    return shape, plans, draw(st.sampled_from([16, 256, grid.DEFAULT_SHARD_BYTES]))


# ------------------------------------------------------------------ checks


def check_exchange(plans: list[LocalPlan], plan: SavePlan) -> None:
    """Element by element: every chunk of every tensor is written by exactly
    one rank, which holds or receives each of its elements exactly once; a
    piece comes from a rank holding it and lies in one chunk its receiver
    writes."""
    held = {(p.rank, it.key): it.box for p in plans for it in p.items}
    pieces = plan.pieces_of()
    for key, e in plan.entries.items():
        chunks = set(all_chunks(e.shape, e.chunk_shape))
        writers = Counter()
        for rank, writes in plan.writes.items():
            for k, region in writes:
                if k != key or not region.numel:
                    continue
                writers[region] += 1
                mine = held[(rank, key)]
                if key not in plan.regrid:
                    assert region == mine
                    continue
                assert region in chunks, f"{key}: rank {rank} writes {region}, not a chunk of {e.chunk_shape}"
                got = [p.box for p in pieces if p.key == key and p.dst == rank and p.chunk == region]
                own = region.intersect(mine)
                count = coverage(region.shape, [b.relative_to(region) for b in got + ([own] if own else [])])
                assert np.all(count == 1), f"{key}: chunk {region} of rank {rank}: own part {own} + pieces {got}"
        if math.prod(e.shape):
            assert np.all(coverage(e.shape, list(writers)) == 1), f"{key}: written regions do not tile the tensor"
        assert all(n == 1 for n in writers.values())
        for cb in chunks:  # every stored chunk inside one written region
            assert sum(1 for w in writers if cb.intersect(w) is not None) == 1, (key, cb)
    for p in pieces:
        assert p.src != p.dst and p.chunk in set(all_chunks(plan.entries[p.key].shape, plan.entries[p.key].chunk_shape))
        assert p.box.intersect(p.chunk) == p.box, p
        src = held[(p.src, p.key)]
        assert src.intersect(p.box) == p.box, f"rank {p.src} sends {p.box} but holds {src}"
        assert (p.key, p.chunk) in set(plan.writes_of(p.dst))
    assert plan.moves_pieces == bool(pieces) and bool(pieces) == bool(plan.regrid)


def stored_objects(plan: SavePlan, key: str) -> int:
    e = plan.entries[key]
    return math.prod(-(-n // c) for n, c in zip(e.shape, e.chunk_shape))


# ------------------------------------------------------------------ properties


@SETTINGS
@given(held_plans())
def test_every_chunk_has_one_writer_and_pieces_tile_it(case):
    shape, plans, shard_bytes = case
    plan = build_save_plan(plans, shard_bytes=shard_bytes, inner_bytes=8)
    check_exchange(plans, plan)
    itemsize = dtypes.BY_TORCH[plan.entries["w"].dtype].itemsize
    assert sum(plan_bytes(plan, p.rank) for p in plans) == math.prod(shape) * itemsize


@SETTINGS
@given(held_plans())
def test_stored_objects_are_few(case):
    """Before capping to the shard size, a dimension has at most twice as
    many chunks as distinct box starts, or, re-gridded, at most one per
    distinct start."""
    shape, plans, _ = case
    real = sorted({it.box for p in plans for it in p.items if it.box.numel})
    plan = build_save_plan(plans)
    chunk = plan.entries["w"].chunk_shape
    if len(real) == 1 and real[0] == Box.full(shape):
        return
    for d, (n, c) in enumerate(zip(shape, chunk)):
        starts = len({b.offset[d] for b in real})
        assert -(-n // c) <= max(2, 2 * starts), (d, n, c, starts)
        if c != max(1, math.gcd(*{b.offset[d] for b in real}) or n):
            assert -(-n // c) <= starts


@st.composite
def regular_partitions(draw):
    """Even and torch.chunk-style splits (ceil-sized pieces, empty ones
    last), 1-3 dims."""
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
    sizes = []
    for n in shape:
        k = draw(st.integers(1, 8))
        if draw(st.booleans()):
            step = -(-n // k)
            sizes.append([max(0, min(step, n - i * step)) for i in range(k)])
        else:
            k = max(d for d in range(1, k + 1) if n % d == 0)
            sizes.append([n // k] * k)
    return shape, grid_boxes(shape, sizes)


@SETTINGS
@given(held_plans(regular_partitions()))
def test_regular_splits_move_nothing(case):
    shape, plans, shard_bytes = case
    plan = build_save_plan(plans, shard_bytes=shard_bytes)
    assert not plan.moves_pieces and not plan.regrid and not plan.pieces_of()
    boxes = sorted({it.box for p in plans for it in p.items if it.box.numel})
    if len(boxes) > 1:
        assert plan.entries["w"].chunk_shape == grid.cap_chunks(
            boxes[0].shape, dtypes.BY_TORCH[plan.entries["w"].dtype].itemsize, shard_bytes
        )


@SETTINGS
@given(irregular_partitions())
def test_owner_shares_the_most_elements(case):
    shape, boxes = case
    real = sorted(set(nonempty(boxes)))
    starts, sizes = box_arrays(real, len(shape))
    chunk, _ = regrid.choose_grid(shape, starts, sizes)
    own = regrid.assign(shape, chunk, starts, sizes)
    assert len(own.chunks) == len(all_chunks(shape, chunk))
    for index, owner in zip(own.chunks.tolist(), own.owner.tolist()):
        cb = all_chunks(shape, chunk)[np.ravel_multi_index(index, [-(-n // c) for n, c in zip(shape, chunk)])]
        shared = [cb.intersect(b).numel if cb.intersect(b) else 0 for b in real]
        assert shared[owner] == max(shared) and shared.index(max(shared)) == owner
    assert own.owned.sum() == math.prod(shape)


# ------------------------------------------------------------------ examples


def rows(n: int, sizes: list[int], cols: int = 8, dtype: str = "float32", key: str = "w") -> list[LocalPlan]:
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    return [
        LocalPlan(r, (LocalItem(key, dtype, (n, cols), Box((o, 0), (s, cols))),))
        for r, (o, s) in enumerate(zip(offsets, sizes))
    ]


def test_array_split_4096_rows_over_3():
    """The issue's case: rows 1366, 1365, 1365 of 4096. The gcd grid was
    1 row (4,096 stored objects); now 3, and rank 2 sends one row to rank 1."""
    plans = rows(4096, [1366, 1365, 1365], cols=4096, dtype="bfloat16")
    plan = build_save_plan(plans)
    assert plan.entries["w"].chunk_shape == (1366, 4096)
    assert stored_objects(plan, "w") == 3
    (p,) = plan.pieces_of()
    assert (p.src, p.dst, p.box, p.chunk) == (2, 1, Box((2731, 0), (1, 4096)), Box((1366, 0), (1366, 4096)))
    assert plan.writes == {
        0: (("w", Box((0, 0), (1366, 4096))),),
        1: (("w", Box((1366, 0), (1366, 4096))),),
        2: (("w", Box((2732, 0), (1364, 4096))),),
    }
    assert plan.pieces_of(0) == () and plan.pieces_of(1) == plan.pieces_of(2) == (p,)
    check_exchange(plans, plan)


def test_spec_examples():
    """Spec section 8: 10x6 rows 4/3/3 -> [4, 6]; rows 6/3/3 of 12 keep
    the gcd grid [3, 6] (4 chunks, at most twice the 3 boxes)."""
    assert build_save_plan(rows(10, [4, 3, 3], cols=6)).entries["w"].chunk_shape == (4, 6)
    kept = build_save_plan(rows(12, [6, 3, 3], cols=6))
    assert kept.entries["w"].chunk_shape == (3, 6) and not kept.moves_pieces


def test_2d_array_split_blocks():
    """np.array_split of a 10x11 tensor into 3x3 blocks (rows 4/3/3, columns
    4/4/3): chunks [4, 4], 9 stored objects instead of 110."""
    shape, plans = (10, 11), []
    for r, b in enumerate(grid_boxes((10, 11), [array_split(10, 3), array_split(11, 3)])):
        plans.append(LocalPlan(r, (LocalItem("w", "float32", shape, b),)))
    plan = build_save_plan(plans)
    assert plan.entries["w"].chunk_shape == (4, 4) and stored_objects(plan, "w") == 9
    check_exchange(plans, plan)


def test_ties_go_to_the_first_box():
    """Rows [0, 2) and [2, 4) share chunk [0, 4) equally: the first box owns
    it. Chunk [4, 8) goes to [5, 8) (3 elements) over [4, 5) (1)."""
    starts, sizes = np.array([[0], [2], [4], [5]]), np.array([[2], [2], [1], [3]])
    own = regrid.assign((8,), (4,), starts, sizes)
    assert own.owner.tolist() == [0, 3]  # chunk [4, 8): box 3 shares 3 elements, box 2 one
    assert own.src.tolist() == [1, 2] and own.dst.tolist() == [0, 3]


def test_replicas_split_the_work():
    """Rows 4/3/3 with every box on two ranks: one writer per box (spread by
    load), and pieces go from the sending box's writer to the chunk's."""
    plans = []
    for r in range(6):
        o, s = [(0, 4), (4, 3), (7, 3)][r % 3]
        plans.append(LocalPlan(r, (LocalItem("w", "float32", (10, 5), Box((o, 0), (s, 5))),)))
    plan = build_save_plan(plans)
    check_exchange(plans, plan)
    (p,) = plan.pieces_of()
    assert p.box == Box((7, 0), (1, 5)) and p.src in (2, 5) and p.dst in (1, 4)
    assert set(plan.writes) == {0, 1, 2}


def test_empty_boxes_and_mixed_tensors():
    """Ranks holding empty boxes take no part; a regular tensor in the same
    plan moves nothing; pieces come in key order."""
    sizes = {0: 3, 1: 0, 2: 2, 3: 2}  # rows [0,3), -, [3,5), [5,7) of 7
    offsets = {0: 0, 1: 3, 2: 3, 3: 5}
    plans = []
    for r in range(4):
        items = [
            LocalItem("a", "float32", (7, 3), Box((offsets[r], 0), (sizes[r], 3))),
            LocalItem("b", "float32", (8, 2), Box((2 * r, 0), (2, 2))),  # even
            LocalItem("c", "int8", (7,), Box((offsets[r],), (sizes[r],))),
        ]
        plans.append(LocalPlan(r, items))
    plan = build_save_plan(plans)
    check_exchange(plans, plan)
    assert set(plan.regrid) == {"a", "c"}
    assert [(p.key, p.src, p.dst, p.box.offset) for p in plan.pieces_of()] == [("a", 3, 2, (5, 0)), ("c", 3, 2, (5,))]
    assert plan.pieces_of(1) == () and "b" not in {p.key for p in plan.pieces_of()}


def test_plan_with_pieces_pickles_and_replaces():
    plans = rows(10, [4, 3, 3])
    plan = build_save_plan(plans, shard_bytes=64)
    back = pickle.loads(pickle.dumps(plan))
    assert back.pieces_of() == plan.pieces_of() and back.writes == plan.writes
    assert replace(plan, values={"v": 1}).pieces_of() == plan.pieces_of()
    assert plan.entries["w"].chunk_shape == (4, 4)  # capped to 64 bytes: row 7 moves in two pieces
    assert [p.to_json() for p in plan.pieces_of(1)] == [
        ["w", [[4, 0], [4, 4]], 2, 1, [[7, 0], [1, 4]]],
        ["w", [[4, 4], [4, 4]], 2, 1, [[7, 4], [1, 4]]],
    ]


def test_array_split_at_scale_plans_quickly():
    """np.array_split of 64 tensors over 2,000 ranks: about one piece per rank
    and tensor, planned in well under a second per 100k boxes (not a tight
    bound: shared CI machines)."""
    world, plans = 2000, []
    n = 2000 * 7 + 13
    sizes = array_split(n, world)
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    for r in range(world):
        items = [LocalItem(f"t{i:02d}", "bfloat16", (n, 16), Box((offsets[r], 0), (sizes[r], 16))) for i in range(64)]
        plans.append(LocalPlan(r, items))
    t0 = time.perf_counter()
    plan = build_save_plan(plans)
    elapsed = time.perf_counter() - t0
    assert all(stored_objects(plan, k) <= world for k in plan.entries)
    assert len(plan.pieces_of()) <= 64 * world
    assert len(plan.writes_of(world // 2)) >= 64
    assert elapsed < 10, elapsed


def test_choose_grid_rule():
    starts = np.array([[0], [1366], [2731]])
    sizes = np.array([[1366], [1365], [1365]])
    assert regrid.choose_grid((4096,), starts, sizes) == ((1366,), True)
    assert regrid.choose_grid((12,), np.array([[0], [6], [9]]), np.array([[6], [3], [3]])) == ((3,), False)
    assert regrid.choose_grid((10, 6), np.array([[0, 0], [4, 0], [7, 0]]), np.array([[4, 6], [3, 6], [3, 6]])) == (
        (4, 6),
        True,
    )
    assert regrid.aligned(np.array([[0], [3], [6], [9]]), (3,)) and not regrid.aligned(starts, (1366,))
