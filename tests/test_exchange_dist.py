"""Irregular splits over real gloo process groups: the chunk owners receive
the pieces of their chunks in one all-to-all, then write each chunk whole.

One spawn of 4 workers runs every case, with save() and with async_save():

    irregular  at world 4: rows 1025/1025/1024/1024, uneven 2x2 blocks, a
               split with an empty box, a replicated box beside irregular
               ones, a plain replicated tensor and a regular DTensor, all in
               one state (one exchange for all of them)
    regular    even and torch.chunk-style splits only: no exchange at all
    failing    one rank fails to gather its pieces: every rank raises
    rows3      np.array_split rows 1366/1365/1365 of 4096 (the issue's case),
               columns 4/3/3 and a 1-D 4/3/3 split, over the subgroup of
               global ranks 1, 2, 3 (group ranks differ from global ones)

Async saves over the subgroup pass a background group created by every
process (async_save's background_group): torch 2.13 cannot create one for a
subgroup without every process taking part.

Each checkpoint is loaded back at world 4 as whole tensors, by torch.chunk
rows and by reversed np.array_split columns, every element checked. The
parent checks the chunk grids and counts the stored objects on disk.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import numpy as np
import pytest
import torch

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:  # spawned workers import this module by name
    sys.path.insert(0, _TESTS)

import dist  # noqa: E402

import tensorckpt  # noqa: E402
from tensorckpt import ShardedTensor  # noqa: E402

WORLD = 4
SENTINEL = -3
ROWS3 = {"w": ((4096, 8), torch.float32, 0), "cols": ((6, 10), torch.bfloat16, 1), "v": ((10,), torch.int64, 0)}
IRREGULAR = {
    "rows4": (4098, 4),  # array_split over 4: 1025, 1025, 1024, 1024
    "blocks": (13, 9),  # 2x2 blocks: rows 3/10, columns 2/7
    "empty": (7, 3),  # rows 3, -, 2, 2
    "mixed": (10, 5),  # rows [0, 4) on ranks 0 and 1, [4, 7) on 2, [7, 10) on 3
    "plain": (5, 3),  # replicated on every rank
    "dt": (8, 6),  # DTensor Shard(0): regular
}
REGULAR = {"even": (8, 6), "chunked": (10, 3)}  # even rows; torch.chunk rows 3/3/3/1
CASES = ("irregular_sync", "irregular_async", "regular_sync", "regular_async", "rows3_sync", "rows3_async")
SUB = [1, 2, 3]  # rows3 is saved over these global ranks


def original(key: str, shape, dtype=torch.float32) -> torch.Tensor:
    n = math.prod(shape)
    base = torch.arange(1, n + 1, dtype=torch.float64).reshape(shape)
    if dtype == torch.bfloat16:
        return base.to(dtype)  # < 256 elements: exact and distinct
    return (base * (0.5 if dtype.is_floating_point else 1) + 1000 * len(key)).to(dtype)


def split_sizes(n: int, parts: int) -> list[int]:
    return [len(a) for a in np.array_split(np.arange(n), parts)]


def chunk_sizes(n: int, parts: int) -> list[int]:
    step = -(-n // parts)
    return [max(0, min(step, n - i * step)) for i in range(parts)]


def box_of(t: torch.Tensor, offset, shape, fill: bool = False) -> ShardedTensor:
    """The box ``[offset, offset + shape)`` of ``t`` (a view), or with ``fill`` a
    sentinel tensor of that box's shape."""
    local = t[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
    if fill:
        local = torch.full(local.shape, SENTINEL, dtype=t.dtype)
    return ShardedTensor(local, tuple(t.shape), tuple(offset))


def along(t: torch.Tensor, dim: int, sizes: list[int], index: int, fill: bool = False) -> ShardedTensor:
    offset = [0] * t.dim()
    offset[dim] = sum(sizes[:index])
    shape = list(t.shape)
    shape[dim] = sizes[index]
    return box_of(t, offset, shape, fill)


# ------------------------------------------------------------------ states


def rows3_state(rank: int) -> dict:
    return {k: along(original(k, s, dt), d, split_sizes(s[d], 3), rank) for k, (s, dt, d) in ROWS3.items()}


def irregular_state(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    o = {k: original(k, s) for k, s in IRREGULAR.items()}
    block = [((0, 0), (3, 2)), ((0, 2), (3, 7)), ((3, 0), (10, 2)), ((3, 2), (10, 7))][rank]
    empty = [((0, 0), (3, 3)), ((3, 0), (0, 3)), ((3, 0), (2, 3)), ((5, 0), (2, 3))][rank]
    mixed = [((0, 0), (4, 5)), ((0, 0), (4, 5)), ((4, 0), (3, 5)), ((7, 0), (3, 5))][rank]
    return {
        "rows4": along(o["rows4"], 0, split_sizes(4098, WORLD), rank),
        "blocks": box_of(o["blocks"], *block),
        "empty": box_of(o["empty"], *empty),
        "mixed": box_of(o["mixed"], *mixed),
        "plain": o["plain"].clone(),
        "dt": distribute_tensor(o["dt"], init_device_mesh("cpu", (WORLD,)), [Shard(0)]),
        "step": 7,
    }


def regular_state(rank: int) -> dict:
    return {
        "even": along(original("even", REGULAR["even"]), 0, [2] * 4, rank),
        "chunked": along(original("chunked", REGULAR["chunked"]), 0, chunk_sizes(10, WORLD), rank),
    }


# ------------------------------------------------------------------ worker

_EXCHANGES: list[int] = []  # one entry per all-to-all this process made


def _count_exchanges() -> None:
    from tensorckpt.engine.group import Group

    inner = Group.all_to_all

    def counting(self, data, send_sizes, recv_sizes):
        _EXCHANGES.append(sum(send_sizes))
        return inner(self, data, send_sizes, recv_sizes)

    Group.all_to_all = counting


def save_case(name: str, state: dict, path: str, group=None, bg=None) -> tuple[str | None, int]:
    """Save (sync or async, by the case's name); (error, all-to-alls made)."""
    before = len(_EXCHANGES)
    try:
        if name.endswith("_async"):
            tensorckpt.async_save(state, path, process_group=group, background_group=bg).wait()
        else:
            tensorckpt.save(state, path, process_group=group)
        err = None
    except Exception as e:  # noqa: BLE001 - reported per case
        err = f"{type(e).__name__}: {e}"
    return err, len(_EXCHANGES) - before


def load_checks(rank: int, path: str, specs: dict) -> list[str]:
    """Load every tensor of ``specs`` (key -> (shape, dtype)) three ways;
    return what went wrong."""
    bad = []
    for how in ("whole", "chunk rows", "split cols"):
        state, want = {}, {}
        for k, (s, dt) in specs.items():
            o = original(k, s, dt)
            if how == "whole":
                state[k], want[k] = torch.full(s, SENTINEL, dtype=dt), o
            else:
                d = 0 if how == "chunk rows" else len(s) - 1
                sizes = chunk_sizes(s[d], WORLD) if how == "chunk rows" else split_sizes(s[d], WORLD)[::-1]
                state[k], want[k] = along(o, d, sizes, rank, fill=True), along(o, d, sizes, rank).local
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tensorckpt.load(state, path, strict=False)
        except Exception as e:  # noqa: BLE001
            bad.append(f"{path} {how}: load raised {type(e).__name__}: {e}")
            continue
        for k in specs:
            got = state[k].local if isinstance(state[k], ShardedTensor) else state[k]
            if not torch.equal(got, want[k]):
                n = int((got != want[k]).sum())
                bad.append(f"{path} {how} {k}: {n} of {want[k].numel()} elements differ")
    return bad


def worker(rank: int, world: int, base: str) -> dict:
    import torch.distributed as tdist

    import tensorckpt.engine.save as save_mod

    _count_exchanges()
    out = {"errors": {}, "exchanges": {}}
    for name in CASES[:4]:
        state = irregular_state(rank) if name.startswith("irregular") else regular_state(rank)
        out["errors"][name], out["exchanges"][name] = save_case(name, state, f"{base}/{name}")

    real_pack = save_mod._pack  # a rank failing to gather its pieces: every rank raises, none hangs
    if rank == 1:
        def failing(*args):
            raise RuntimeError("boom while packing")

        save_mod._pack = failing
    out["failing"] = save_case("failing", irregular_state(rank), f"{base}/failing")[0]
    save_mod._pack = real_pack

    sub = tdist.new_group(SUB)
    sub_bg = tdist.new_group(SUB, backend="gloo")
    sub2 = tdist.new_group(SUB)
    if rank in SUB:
        for name in CASES[4:]:
            state = rows3_state(SUB.index(rank))
            out["errors"][name], out["exchanges"][name] = save_case(name, state, f"{base}/{name}", sub, sub_bg)
        try:  # without a background group over a subgroup: a clear error on every member, no hang
            tensorckpt.async_save(rows3_state(SUB.index(rank)), f"{base}/no_bg", process_group=sub2).wait()
            out["no_bg"] = None
        except tensorckpt.TensorckptError as e:
            out["no_bg"] = str(e)
    tdist.barrier()

    flat = {k: (s, torch.float32) for k, s in IRREGULAR.items() if k != "dt"}
    specs = {
        "rows3": {k: (s, dt) for k, (s, dt, _) in ROWS3.items()},
        "irregular": flat | {"dt": (IRREGULAR["dt"], torch.float32)},
        "regular": {k: (s, torch.float32) for k, s in REGULAR.items()},
    }
    out["loads"] = [b for name in CASES for b in load_checks(rank, f"{base}/{name}", specs[name.rsplit("_", 1)[0]])]
    return out


# ------------------------------------------------------------------ parent


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("exchange"))
    return base, dist.run(WORLD, worker, base)


def stored_objects(path: str, key: str) -> int:
    """Chunk files of the array at ``key`` (the "c/..." keys of Zarr v3)."""
    return sum(len(files) for _, _, files in os.walk(os.path.join(path, key, "c")))


def test_every_save_commits(runs):
    _, results = runs
    errors = [f"rank {r}: {c}: {e}" for r, res in enumerate(results) for c, e in res["errors"].items() if e]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_array_split_4096_rows_is_3_objects(runs, mode):
    """1366/1365/1365 rows: chunk [1366, 8] (3 stored objects; the gcd grid
    gave 4,096), one exchange per save on each of the 3 ranks."""
    base, results = runs
    path = f"{base}/rows3_{mode}"
    ck = tensorckpt.open(path)
    assert ck.info("w").chunk_shape == (1366, 8)
    assert stored_objects(path, "w") == 3
    assert ck.info("cols").chunk_shape == (6, 4) and stored_objects(path, "cols") == 3
    assert ck.info("v").chunk_shape == (4,) and stored_objects(path, "v") == 3
    assert ck.metadata.world_size == 3
    assert [res["exchanges"].get(f"rows3_{mode}") for res in results] == [None, 1, 1, 1]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_irregular_world4_one_exchange(runs, mode):
    """Every irregular tensor of the state moves its pieces in the same single
    all-to-all; each has about one stored object per box."""
    base, results = runs
    path = f"{base}/irregular_{mode}"
    ck = tensorckpt.open(path)
    expect = {"rows4": (1025, 4), "blocks": (10, 7), "empty": (3, 3), "mixed": (4, 5), "plain": (5, 3), "dt": (2, 6)}
    assert {k: ck.info(k).chunk_shape for k in expect} == expect
    assert {k: stored_objects(path, k) for k in expect} == {
        "rows4": 4, "blocks": 4, "empty": 3, "mixed": 3, "plain": 1, "dt": 4
    }
    assert [res["exchanges"][f"irregular_{mode}"] for res in results] == [1] * WORLD
    assert ck.read("step") == 7


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_regular_splits_exchange_nothing(runs, mode):
    base, results = runs
    assert [res["exchanges"][f"regular_{mode}"] for res in results] == [0] * WORLD
    ck = tensorckpt.open(f"{base}/regular_{mode}")
    assert ck.info("even").chunk_shape == (2, 6) and ck.info("chunked").chunk_shape == (3, 3)


def test_every_element_loads_back(runs):
    _, results = runs
    bad = [f"rank {r}: {b}" for r, res in enumerate(results) for b in res["loads"]]
    assert not bad, "\n".join(bad[:40])


def test_a_rank_failing_before_the_exchange_fails_every_rank(runs):
    base, results = runs
    errors = [res["failing"] for res in results]
    assert all(e is not None and "boom while packing" in e for e in errors), errors
    with pytest.raises(tensorckpt.CheckpointNotFoundError):
        tensorckpt.open(f"{base}/failing")


def test_async_save_over_a_subgroup_asks_for_a_background_group(runs):
    res = runs[1]
    for rank in SUB:
        assert "background_group" in res[rank]["no_bg"] and "new_group" in res[rank]["no_bg"]
