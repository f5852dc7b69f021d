"""A save with the same tensor layout as the previous one reuses its plan."""

import os
import sys

import torch

import tensorckpt

sys.path.insert(0, os.path.dirname(__file__))
import dist  # noqa: E402


def _save(state, path):
    s = tensorckpt.SaveStats()
    tensorckpt.save(state, path, stats=s)
    return s


def test_single_process_cache_hits_and_misses(tmp_path):
    w = torch.arange(12.0).reshape(3, 4)
    assert not _save({"w": w, "step": 1}, tmp_path / "a").plan_cache_hit
    hit = _save({"w": w + 1, "step": 2}, tmp_path / "b")  # same layout, new data and values
    assert hit.plan_cache_hit and hit.bytes_written == 48
    assert tensorckpt.open(tmp_path / "b").read("step") == 2
    assert torch.equal(tensorckpt.open(tmp_path / "b").read("w"), w + 1)
    assert not _save({"w": torch.zeros(4, 4), "step": 3}, tmp_path / "c").plan_cache_hit  # new shape
    assert not _save({"w": torch.zeros(4, 4), "v": torch.ones(1)}, tmp_path / "d").plan_cache_hit  # new key


def _cached_saves(rank, world, root):
    out = []
    for i in range(3):
        local = torch.full((2, 3), float(10 * i + rank))
        s = tensorckpt.SaveStats()
        tensorckpt.save({"w": tensorckpt.ShardedTensor(local, (2 * world, 3), (2 * rank, 0)), "step": i}, f"{root}/s{i}", stats=s)
        out.append(s.plan_cache_hit)
    return out


def test_distributed_cache_reuses_plan(tmp_path):
    hits = dist.run(2, _cached_saves, str(tmp_path))
    assert hits == [[False, True, True]] * 2
    ckpt = tensorckpt.open(tmp_path / "s2")
    assert ckpt.read("step") == 2
    assert torch.equal(ckpt.read("w"), torch.cat([torch.full((2, 3), 20.0), torch.full((2, 3), 21.0)]))
