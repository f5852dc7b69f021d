"""async_save over real gloo process groups: the background collectives run
on a group of their own while training keeps using the default one; a rank
whose staging fails makes every rank's save fail; statistics of every rank
are kept with the checkpoint; the process executor's helpers write each
rank's objects. One spawn of 2 workers runs every case."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import dist  # noqa: E402

import tensorckpt  # noqa: E402


def _full(step: int) -> torch.Tensor:
    return torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5) + 100 * step


def _worker(rank: int, world: int, base: str) -> dict:
    import torch.distributed as dist_
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    dist_.new_group([0])  # groups created before the first async_save (TP/PP groups do this) must not matter

    def state(step):
        return {
            "w": distribute_tensor(_full(step), mesh, [Shard(0)]),
            "rep": torch.full((3,), float(step)),
            "rows": tensorckpt.ShardedTensor(torch.full((2, 4), float(rank + step)), (2 * world, 4), (2 * rank, 0)),
            "step": step,
        }

    # 1. two saves in a row, training collectives while each is in flight
    handles = []
    for step in (1, 2):
        s = state(step)
        h = tensorckpt.async_save(s, f"{base}/c{step}")
        s["w"].to_local().fill_(-1)  # the loop changes its state at once
        s["rows"].local.fill_(-1)
        t = torch.ones(4)
        for _ in range(20):
            dist_.all_reduce(t)  # default group, while the save runs in the background
        handles.append(h)
    handles[-1].wait()
    assert all(h.exception() is None for h in handles)
    out["cache_hit"] = handles[1].stats.plan_cache_hit
    out["allocated"] = [h.stats.staging_bytes_allocated for h in handles]
    out["all_reduce"] = t.tolist()

    # 2. load step 2 into another layout: Shard(1)
    target = {
        "w": distribute_tensor(torch.zeros(6, 5), mesh, [Shard(1)]),
        "rep": torch.zeros(3),
        "rows": torch.zeros(2 * world, 4),
        "step": 0,
    }
    tensorckpt.load(target, f"{base}/c2")
    out["loaded_w"] = target["w"].full_tensor().tolist()
    out["loaded_rows"] = target["rows"].tolist()
    out["loaded_step"] = target["step"]

    # 3. one rank's staging fails: it raises at the call, every other rank's handle fails
    s = state(3)
    if rank == 1:
        s["bad"] = object()
    else:
        s["bad"] = 0
    try:
        h = tensorckpt.async_save(s, f"{base}/c3")
        out["c3"] = type(h.exception()).__name__, str(h.exception())
    except tensorckpt.TensorckptError as e:
        out["c3"] = "raised", type(e).__name__
    # 4. the group is not wedged: the next save works
    tensorckpt.async_save(state(4), f"{base}/c4").wait()

    # 5. a straggler: rank 1's storage is slow to sync (a wrapped sync)
    import time

    from tensorckpt.storage import kv

    inner = kv.sync_files

    def slow(*args):
        if rank == 1:
            time.sleep(0.5)
        return inner(*args)

    kv.sync_files = slow
    try:
        tensorckpt.save(state(5), f"{base}/straggler")
    finally:
        kv.sync_files = inner

    # 6. a saver of one's own: its own background group, buffers and plan cache; closed at the end
    with tensorckpt.AsyncSaver() as saver:
        mine = [saver.save(state(step), f"{base}/own{step}") for step in (6, 7)]
    out["own"] = [(h.done(), h.stats.plan_cache_hit, h.stats.staging_bytes_allocated > 0) for h in mine]

    # 7. the process executor: each rank's helper process writes its objects; loaded into another layout
    big = torch.arange(1024 * 512, dtype=torch.float32).reshape(1024, 512)
    with tensorckpt.AsyncSaver(executor="process") as saver:
        s = {"w": distribute_tensor(big, mesh, [Shard(0)]), "step": 8}
        h = saver.save(s, f"{base}/proc")
        s["w"].to_local().fill_(-1)
        h.wait()
    out["offloaded"] = h.stats.bytes_offloaded
    target = {"w": distribute_tensor(torch.zeros(1024, 512), mesh, [Shard(1)]), "step": 0}
    tensorckpt.load(target, f"{base}/proc")
    out["proc"] = torch.equal(target["w"].full_tensor(), big), target["step"]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("async_dist")
    return base, dist.run(2, _worker, str(base))


def test_saves_are_exact_and_training_collectives_unaffected(results):
    base, res = results
    for step in (1, 2):
        c = tensorckpt.open(base / f"c{step}")
        assert torch.equal(c.read("w"), _full(step))
        assert torch.equal(c.read("rep"), torch.full((3,), float(step)))
        assert torch.equal(c.read("rows"), torch.cat([torch.full((2, 4), float(r + step)) for r in range(2)]))
    for r in res:
        assert r["all_reduce"] == [2.0**20] * 4


def test_second_save_reuses_plan_and_buffers(results):
    _, res = results
    for r in res:
        assert r["cache_hit"] is True
        assert r["allocated"][0] > 0 and r["allocated"][1] == 0


def test_load_into_another_layout(results):
    _, res = results
    for r in res:
        assert r["loaded_w"] == _full(2).tolist()
        assert r["loaded_rows"] == torch.cat([torch.full((2, 4), float(x + 2)) for x in range(2)]).tolist()
        assert r["loaded_step"] == 2


def test_one_rank_failing_to_stage_fails_every_rank(results):
    base, res = results
    assert res[1]["c3"] == ("raised", "UnsupportedValueError")
    name, msg = res[0]["c3"]
    assert name == "UnsupportedValueError" and "'bad'" in msg and "rank 1" in msg
    assert not (base / "c3").exists()
    assert tensorckpt.open(base / "c4").to_state_dict()["step"] == 4


def test_every_rank_statistics_are_kept(results):
    base, _ = results
    stats = tensorckpt.open(base / "c2").metadata.save_stats
    assert all(len(v) == 2 for v in stats["seconds"].values())
    assert sum(stats["bytes_written"]) == 6 * 5 * 4 + 3 * 4 + 4 * 4 * 4


def test_inspect_shows_the_straggler(results, capsys):
    from tensorckpt.cli import main

    base, _ = results
    assert main(["inspect", str(base / "straggler")]) == 0
    text = capsys.readouterr().out
    assert "save phases over 2 rank(s)" in text
    sync = next(line for line in text.splitlines() if line.strip().startswith("sync"))
    assert sync.split()[-1] == "1" and float(sync.split()[3]) >= 0.5  # max >= the delay, slowest rank 1
    assert main(["inspect", "--json", str(base / "straggler")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["save_phases"]["sync"]["slowest_rank"] == 1
    assert doc["save_phases"]["sync"]["max"] >= 0.5 > doc["save_phases"]["sync"]["min"]


def test_an_async_saver_of_its_own(results):
    base, res = results
    for r in res:
        assert r["own"] == [(True, False, True), (True, True, False)]
    assert torch.equal(tensorckpt.open(base / "own7").read("w"), _full(7))


def test_the_process_executor_over_a_group(results):
    base, res = results
    for r in res:
        assert r["offloaded"] == 512 * 512 * 4  # each rank's half, written by its own helper
        assert r["proc"] == (True, 8)
    assert tensorckpt.verify(base / "proc").ok
