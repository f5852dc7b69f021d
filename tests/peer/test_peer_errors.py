"""Ports of DCP's test_checkpoint.py::TestDistributedFailure: a failure on
some ranks of a save or a load is raised on every rank (DCP: one
CheckpointException naming the failed ranks), and a failed save commits
nothing. DCP injects faults with a faulty storage writer / reader; these
ports fail one rank's state (an unstorable value, a wrong shape) or one
rank's write / read step (patched in that rank only).
"""

from __future__ import annotations

import os

import pytest
import torch
from _suite import path, scenario

import tensorckpt


def _state():
    return {"replicated": torch.arange(100.0).view(10, 10), "bytes": [1, 2, 3, 4]}


def _outcome(fn) -> str | None:
    try:
        fn()
        return None
    except Exception as e:
        return type(e).__name__


def _committed(p: str) -> str:
    try:
        tensorckpt.open(p)
        return "committed"
    except tensorckpt.TensorckptError as e:
        return type(e).__name__


@scenario("w4")
def save_failures_w4(rank: int, world: int, base: str):
    from tensorckpt.engine import save as save_module

    out = {}
    # one rank's state holds a value that cannot be stored
    bad = _state()
    if rank == 2:
        bad["bytes"] = {1, 2}
    out["unstorable_on_rank2"] = _outcome(lambda: tensorckpt.save(bad, path(base, "fail_value")))
    # one rank's write fails (DCP: fail_write_data=[2] / fail_write_data_async=[3])
    real = save_module._write_local

    def failing(*a, **k):
        raise OSError("injected write failure")

    if rank == 3:
        save_module._write_local = failing
    try:
        out["write_on_rank3"] = _outcome(lambda: tensorckpt.save(_state(), path(base, "fail_write")))
    finally:
        save_module._write_local = real
    torch.distributed.barrier()
    out["committed"] = {n: _committed(path(base, n)) for n in ("fail_value", "fail_write")}
    tensorckpt.save(_state(), path(base, "good"))  # the next save works
    return out


def test_save_error_handling(peer):
    """Port of test/distributed/checkpoint/test_checkpoint.py::TestDistributedFailure::test_save_error_handling
    (fail_write_data / fail_prepare_local_plan on one rank): every rank raises, nothing is committed, the
    next save succeeds."""
    for r in peer.all("w4", "save_failures_w4"):
        assert r["unstorable_on_rank2"] == "UnsupportedValueError", r
        assert r["write_on_rank3"] is not None, r
        assert all(v != "committed" for v in r["committed"].values()), r["committed"]
    assert tensorckpt.open(path(peer.base, "good")).read("replicated").shape == (10, 10)


def test_save_error_handling_no_dist(tmp_path, monkeypatch):
    """Port of test/distributed/checkpoint/test_checkpoint.py::TestDistributedFailure::test_save_error_handling_no_dist."""
    from tensorckpt.engine import save as save_module

    def failing(*a, **k):
        raise OSError("injected write failure")

    monkeypatch.setattr(save_module, "_write_local", failing)
    with pytest.raises(Exception, match="injected write failure"):
        tensorckpt.save(_state(), str(tmp_path / "c"))
    with pytest.raises(tensorckpt.TensorckptError):
        tensorckpt.open(str(tmp_path / "c"))


@scenario("w4")
def save_adapter_failure_w4(rank: int, world: int, base: str):
    """One rank's module cannot be saved (its get_extra_state returns an object), over a gloo
    group with a 5 s timeout: a rank left waiting in a collective times out instead of hanging."""
    import datetime

    import torch.distributed as dist

    class Odd(torch.nn.Linear):
        def get_extra_state(self):
            return object() if rank == 2 else {"ok": 1}

        def set_extra_state(self, state):
            pass

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
    torch.manual_seed(0)
    out = _outcome(lambda: tensorckpt.save({"model": Odd(2, 2)}, path(base, "fail_adapter"), process_group=group))
    return out


def test_save_error_in_an_adapter_on_one_rank(peer):
    """Port of test/distributed/checkpoint/test_checkpoint.py::TestDistributedFailure::test_save_error_handling
    (fail_prepare_local_plan on one rank, here an adapter's save_state failing on rank 2): every rank raises
    the UnsupportedValueError (it once hung: rank 2 raised before the save's first collective and the
    others waited in it until the process group's timeout)."""
    outcomes = peer.all("w4", "save_adapter_failure_w4")
    assert outcomes == ["UnsupportedValueError"] * 4, outcomes


@scenario("w4")
def load_failures_w4(rank: int, world: int, base: str):
    from tensorckpt.engine import load as load_module

    tensorckpt.save(_state(), path(base, "load_src"))
    out = {}
    out["not_found"] = _outcome(lambda: tensorckpt.load(_state(), path(base, "nope")))
    extra = _state()
    if rank == 0:
        extra["only_rank0"] = torch.zeros(3)
    out["missing_on_rank0"] = _outcome(lambda: tensorckpt.load(extra, path(base, "load_src")))
    shape = _state()
    if rank == 3:
        shape["replicated"] = torch.zeros(5, 10)
    out["shape_on_rank3"] = _outcome(lambda: tensorckpt.load(shape, path(base, "load_src")))
    # one rank's read fails (DCP: fail_read_data=[3] / fail_read_data_async=[1])
    real = load_module._read_into

    def failing(*a, **k):
        raise tensorckpt.CorruptCheckpointError("injected read failure")

    if rank == 1:
        load_module._read_into = failing
    try:
        out["read_on_rank1"] = _outcome(lambda: tensorckpt.load(_state(), path(base, "load_src")))
    finally:
        load_module._read_into = real
    return out


def test_load_error_handling_raised_everywhere_today(peer):
    """Port of test/distributed/checkpoint/test_checkpoint.py::TestDistributedFailure::test_load_error_handling
    (fail_read_metadata / fail_prepare_global_plan): a missing checkpoint, and a key only one rank wants,
    raise on every rank."""
    for r in peer.all("w4", "load_failures_w4"):
        assert r["not_found"] == "CheckpointNotFoundError", r
        assert r["missing_on_rank0"] == "IncompatibleStateError", r


def test_load_error_handling(peer):
    """Port of test/distributed/checkpoint/test_checkpoint.py::TestDistributedFailure::test_load_error_handling
    (fail_prepare_local_plan=[1], fail_read_data=[3]): a wrong shape on rank 3, a failed read on rank 1,
    raise on every rank."""
    rs = peer.all("w4", "load_failures_w4")
    assert [r["shape_on_rank3"] for r in rs] == ["IncompatibleStateError"] * 4, [r["shape_on_rank3"] for r in rs]
    assert [r["read_on_rank1"] for r in rs] == ["CorruptCheckpointError"] * 4, [r["read_on_rank1"] for r in rs]


def test_load_error_handling_no_dist(tmp_path):
    """Port of test/distributed/checkpoint/test_checkpoint.py::TestDistributedFailure::test_load_error_handling_no_dist."""
    tensorckpt.save(_state(), str(tmp_path / "c"))
    with pytest.raises(tensorckpt.CheckpointNotFoundError):
        tensorckpt.load(_state(), str(tmp_path / "nope"))
    with pytest.raises(tensorckpt.IncompatibleStateError, match="replicated"):
        tensorckpt.load({"replicated": torch.zeros(5, 10), "bytes": []}, str(tmp_path / "c"))
    os.remove(str(tmp_path / "c" / "zarr.json"))
    with pytest.raises(tensorckpt.TensorckptError):
        tensorckpt.load(_state(), str(tmp_path / "c"))


# ------------------------------------------------ legacy torch ShardedTensor


def _legacy(world: int, fill: bool):
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = sharded_tensor.zeros(spec, 20, 20)
    if fill:
        for shard in st.local_shards():
            off = shard.metadata.shard_offsets[0]
            n = shard.tensor.shape[0]
            shard.tensor.copy_(torch.arange(off * 20, (off + n) * 20, dtype=torch.float).view(n, 20))
    return st


@scenario("w4")
def legacy_sharded_tensor_w4(rank: int, world: int, base: str):
    state = {"sharded": _legacy(world, True), **_state()}
    tensorckpt.save(state, path(base, "legacy"))
    return True


@scenario("w2")
def legacy_sharded_tensor_w2(rank: int, world: int, base: str):
    st = _legacy(world, False)
    tensorckpt.load({"sharded": st, **_state()}, path(base, "legacy"))
    return [(s.metadata.shard_offsets[0], s.tensor.numpy().copy()) for s in st.local_shards()]


def test_sharded_tensor_save_and_reshard(peer):
    """Port of test/distributed/checkpoint/test_checkpoint.py::TestDistributedFailure::test_dummy_writer_works
    / test_dummy_reader_works (a ``sharded_tensor.rand`` ChunkShardingSpec tensor, a replicated tensor and
    bytes): saved at world 4, loaded into a 2-rank ShardedTensor and read whole."""
    import numpy as np

    peer.all("w4", "legacy_sharded_tensor_w4")
    expected = np.arange(400, dtype=np.float32).reshape(20, 20)
    for r in peer.all("w2", "legacy_sharded_tensor_w2"):
        for off, t in r:
            assert np.array_equal(t, expected[off: off + t.shape[0]])
    assert np.array_equal(tensorckpt.open(path(peer.base, "legacy")).read("sharded").numpy(), expected)
