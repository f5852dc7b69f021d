"""Faults and bad input on S3, through the public API, against the moto
server of the session (conftest.py) behind the fault and latency proxy
(tests/s3proxy.py): the server killed in the middle of a save (sync, async,
under a CheckpointManager; distributed: tests/test_s3_dist.py), transient
and persistent 503 / 500 / dropped / cut responses, wrong credentials, a
missing bucket, a malformed URL and an endpoint that does not answer, and
hostile objects on S3. Every test is bounded in time; a failed save never
commits anything, and a load under faults is bit-exact or fails clearly."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

import tensorckpt
from tensorckpt import TensorckptError

sys.path.insert(0, os.path.dirname(__file__))
from s3proxy import Faults, S3Proxy  # noqa: E402
from s3server import BUCKET  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")
# TENSORCKPT_S3_TIMEOUT in these tests: a request to a dead server fails after this, or after the retries
# (location.S3_RETRIES, ~7 s), whichever comes first
TIMEOUT_S = "3"


def _keys(moto, url: str) -> list[str]:
    """Every object under ``url``, listed with boto3 (not through tensorckpt)."""
    prefix = url.removeprefix(f"s3://{BUCKET}/") + "/"
    pages = moto.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"][len(prefix):] for p in pages for o in p.get("Contents", []))


def _state(k: float = 1.0, n: int = 24) -> dict:
    """Many small tensors (many PUTs: a kill lands in the middle), bfloat16 among them."""
    g = torch.Generator().manual_seed(int(k * 1000))
    sd: dict = {f"t{i}": torch.randn(64, 48, generator=g) * k for i in range(n)}
    sd["h"] = (torch.randn(40, 30, generator=g) * k).to(torch.bfloat16)
    sd["step"] = int(k)
    return sd


def _empty(n: int = 24) -> dict:
    return {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in _state(1.0, n).items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@pytest.fixture
def proxied(moto, s3, monkeypatch):
    """(proxy, s3 URL factory): every S3 request of the test goes through the proxy."""
    with S3Proxy(moto.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        monkeypatch.setenv("TENSORCKPT_S3_TIMEOUT", TIMEOUT_S)
        yield proxy, s3


def kill_after(proxy: S3Proxy, puts: int) -> threading.Thread:
    """Kill the server (the proxy) once ``puts`` more PUT requests have passed."""
    start = proxy.requests["PUT"]

    def watch() -> None:
        deadline = time.monotonic() + 60
        while proxy.requests["PUT"] < start + puts and time.monotonic() < deadline:
            time.sleep(0.001)
        proxy.kill()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _uncommitted(moto, url: str) -> None:
    """Nothing was committed at ``url``: no root zarr.json (listed with boto3)."""
    assert "zarr.json" not in _keys(moto, url)


# ---------------------------------------------------------------- the server killed mid-save


@pytest.mark.timeout(60)
def test_server_killed_mid_save(proxied, moto):
    proxy, s3 = proxied
    url = s3()
    kill_after(proxy, 8)
    t = time.monotonic()
    with pytest.raises(TensorckptError) as e:
        tensorckpt.save(_state(), url)
    assert time.monotonic() - t < 30
    assert url in str(e.value) and "writ" in str(e.value)  # the URL and the operation
    proxy.revive()
    _uncommitted(moto, url)
    with pytest.raises(tensorckpt.IncompleteCheckpointError):
        tensorckpt.open(url)
    _clean_removes_leftovers(moto, url)
    tensorckpt.save(_state(2.0), url)  # the location is usable again
    time.sleep(1)  # the killed save's writes were cancelled: none of them lands in this checkpoint later
    assert _equal(tensorckpt.load(_empty(), url), _state(2.0))


def _clean_removes_leftovers(moto, url: str) -> None:
    """S3 keeps no modification times tensorckpt can read: the leftovers stay
    under the default grace (age unknown) and go with older_than=0."""
    if not _keys(moto, url) and not tensorckpt.clean(url).leftovers:
        return  # the save's own abort removed everything
    report = tensorckpt.clean(url)
    assert report.leftovers and not any(x.removed for x in report.leftovers)
    assert all("age is unknown" in x.reason for x in report.leftovers)
    report = tensorckpt.clean(url, older_than=0)
    assert all(x.removed for x in report.leftovers)
    assert _keys(moto, url) == [] and not tensorckpt.clean(url, older_than=0).leftovers


@pytest.mark.timeout(60)
def test_server_killed_mid_async_save(proxied, moto):
    proxy, s3 = proxied
    url = s3()
    kill_after(proxy, 8)
    h = tensorckpt.async_save(_state(), url)
    with pytest.raises(TensorckptError) as e:
        h.wait(40)
    assert url in str(e.value) and "writ" in str(e.value)
    proxy.revive()
    _uncommitted(moto, url)
    _clean_removes_leftovers(moto, url)


@pytest.mark.timeout(90)
def test_server_killed_mid_save_under_a_manager(proxied, moto):
    proxy, s3 = proxied
    root = s3("run")
    mgr = tensorckpt.CheckpointManager(root, keep_last=1, reader_grace=0, grace=0)
    mgr.save(1, _state(1.0))
    kill_after(proxy, 8)
    with pytest.raises(TensorckptError) as e:
        mgr.save(2, _state(2.0))
    assert mgr.step_path(2) in str(e.value)
    proxy.revive()
    _uncommitted(moto, mgr.step_path(2))
    again = tensorckpt.CheckpointManager(root, keep_last=1, reader_grace=0, grace=0)  # a restarted job
    assert again.latest() == 1
    out = _empty()
    assert again.restore(out) == 1 and _equal(out, _state(1.0))  # the previous step, bit-exact
    again.save(3, _state(3.0))  # its retention removes step 2's leftovers (grace=0) and retires step 1
    names = {k.split("/", 1)[0] for k in _keys(moto, root)}
    assert names == {"step-00000003"}, names
    assert _equal(tensorckpt.load(_empty(), again.step_path(3)), _state(3.0))
