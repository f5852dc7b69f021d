"""Distributed checkpoints on S3 (gloo ranks, tests/dist.py) against the moto
server of the session, behind the fault proxy (tests/s3proxy.py) where a
test needs it: a world-2 save whose server is killed mid-save fails on
every rank with an error naming the URL, commits nothing, and its leftovers
go with ``clean``; FSDP2 DTensor and legacy ShardedTensor states save and
load (resharded) on S3 as they do locally."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import tensorckpt
from tensorckpt import TensorckptError

sys.path.insert(0, os.path.dirname(__file__))
import dist
from s3proxy import S3Proxy
from test_s3_faults import _keys, kill_after

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")


def _rows(n: int, rank: int, world: int) -> tuple[int, int]:
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def _full(i: int) -> torch.Tensor:
    return torch.arange(40 * 24, dtype=torch.float32).reshape(40, 24) / (i + 1)


def _sharded_state(rank: int, world: int, n: int = 16) -> dict:
    out = {}
    for i in range(n):
        a, b = _rows(40, rank, world)
        out[f"t{i}"] = tensorckpt.ShardedTensor(_full(i)[a:b].clone(), (40, 24), (a, 0))
    return out


def _save_expecting_failure(rank: int, world: int, url: str) -> str:
    try:
        tensorckpt.save(_sharded_state(rank, world), url)
    except TensorckptError as e:
        return f"TensorckptError: {e}"
    return "saved"


@pytest.mark.timeout(150)
def test_server_killed_mid_distributed_save(moto, s3, monkeypatch):
    with S3Proxy(moto.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)  # the ranks inherit the environment
        monkeypatch.setenv("TENSORCKPT_S3_TIMEOUT", "3")
        url = s3()
        kill_after(proxy, 12)
        results = dist.run(2, _save_expecting_failure, url, timeout=120)
        assert all(r.startswith("TensorckptError") and url in r for r in results), results
        proxy.revive()
        assert "zarr.json" not in _keys(moto, url)  # nothing committed
        with pytest.raises(tensorckpt.IncompleteCheckpointError):
            tensorckpt.open(url)
        kept = tensorckpt.clean(url).leftovers  # younger than the default grace, by the save's stamp: kept
        assert kept and all(not x.removed and x.age is not None for x in kept), kept
        assert all(x.removed for x in tensorckpt.clean(url, older_than=0).leftovers)
        assert _keys(moto, url) == []


def _net() -> torch.nn.Module:
    """Two layers with all-distinct values (11 rows over 2 ranks: uneven FSDP shards)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(5, 11), torch.nn.Linear(11, 3))
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) / (i + 7))
    return m


def _fsdp2_and_legacy(rank: int, world: int, base: str) -> bool:
    from test_strided_dist import legacy_tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    m = fully_shard(_net(), mesh=mesh)
    tensorckpt.save({"model": m}, f"{base}/fsdp2")
    back = fully_shard(_net(), mesh=mesh)
    with torch.no_grad():
        for p in back.parameters():
            p.zero_()
    tensorckpt.load({"model": back}, f"{base}/fsdp2")
    ok = all(torch.equal(p.full_tensor(), q) for p, q in zip(back.parameters(), _net().parameters()))
    ref = {"x": torch.arange(30.0).reshape(10, 3), "few": torch.arange(6.0).reshape(3, 2) + 100}
    tensorckpt.save({k: legacy_tensor(v.shape, 0, world, v) for k, v in ref.items()}, f"{base}/legacy")
    by_cols = {k: legacy_tensor(v.shape, 1, world, None) for k, v in ref.items()}
    tensorckpt.load(by_cols, f"{base}/legacy")  # resharded: rows saved, columns loaded
    for k, st in by_cols.items():
        for s in st.local_shards():
            box = tuple(slice(o, o + n) for o, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))
            ok = ok and torch.equal(s.tensor, ref[k][box])
    as_dt = {k: distribute_tensor(torch.zeros(v.shape), mesh, [Shard(1)]) for k, v in ref.items()}
    tensorckpt.load(as_dt, f"{base}/legacy")
    return bool(ok and all(torch.equal(v.full_tensor(), ref[k]) for k, v in as_dt.items()))


@pytest.mark.timeout(200)
def test_fsdp2_dtensor_and_legacy_sharded_tensor_on_s3(s3):
    base = s3("dist")
    assert dist.run(2, _fsdp2_and_legacy, base, timeout=180) == [True, True]
    plain = _net()
    with torch.no_grad():
        for p in plain.parameters():
            p.zero_()
    tensorckpt.load({"model": plain}, f"{base}/fsdp2")  # world 2 -> 1, into a plain module
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), _net().parameters()))
    assert tensorckpt.verify(f"{base}/fsdp2").ok and tensorckpt.verify(f"{base}/legacy").ok
