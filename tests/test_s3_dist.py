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
import dist  # noqa: E402
from s3proxy import S3Proxy  # noqa: E402
from test_s3_faults import _keys, kill_after  # noqa: E402

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
        assert not any(x.removed for x in tensorckpt.clean(url).leftovers)  # S3 gives no age: kept by default
        assert all(x.removed for x in tensorckpt.clean(url, older_than=0).leftovers)
        assert _keys(moto, url) == []
