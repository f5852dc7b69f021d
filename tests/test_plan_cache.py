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


def test_saves_running_at_once_in_one_process_keep_a_consistent_cache(tmp_path):
    """Two threads saving at once (same process, same group, same options)
    both commit and load bit-exact, and the cache they leave serves the
    next saves correctly (it once kept one save's local plans with the other's
    plan, or failed with KeyError)."""
    import threading

    import torch

    import tensorckpt

    def state(n: int) -> dict:
        return {"w": torch.arange(n * 64, dtype=torch.float32).reshape(n, 64), "b": torch.full((n,), float(n))}

    errors: list[BaseException] = []

    def save(n: int, path) -> None:
        try:
            tensorckpt.save(state(n), path, shard_bytes=n * 64 * 2, inner_chunk_bytes=n * 32)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test below
            errors.append(e)

    for rnd in range(5):
        threads = [threading.Thread(target=save, args=(n, tmp_path / f"r{rnd}n{n}t{i}"))
                   for i, n in enumerate((8, 8, 12))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
    for rnd in range(5):
        for i, n in enumerate((8, 8, 12)):
            out = {"w": torch.zeros(n, 64), "b": torch.zeros(n)}
            tensorckpt.load(out, tmp_path / f"r{rnd}n{n}t{i}")
            want = state(n)
            assert torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"])
