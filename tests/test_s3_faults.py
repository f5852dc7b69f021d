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


# ---------------------------------------------------------------- slow and failing responses

TRANSIENT = ("503", "500", "drop", "cut")  # "cut": half a response body, then the connection closes


@pytest.mark.timeout(60)
def test_transient_faults_and_latency_are_retried(proxied, moto):
    """A fraction of the requests fail (each kind, on writes and reads) and
    every request is slowed down: retried within location.S3_RETRIES, the
    save commits and the load is bit-exact."""
    proxy, s3 = proxied
    url, sd = s3(), _state(n=12)
    proxy.latency_s = 0.01
    proxy.faults = Faults(rate=0.3, kinds=TRANSIENT[:3], methods=("PUT",), limit=6, seed=3)  # a PUT has no body to cut
    tensorckpt.save(sd, url)
    assert sum(proxy.faults.injected.values()) >= 3
    proxy.faults = Faults(rate=0.3, kinds=TRANSIENT, methods=("GET",), limit=6, seed=4)
    assert _equal(tensorckpt.load(_empty(12), url), sd)
    assert sum(proxy.faults.injected.values()) >= 3
    assert tensorckpt.verify(url).ok


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,path", [("503", "/t5/"), ("500", "ckpt/zarr.json")], ids=["a-tensor", "the-root"])
def test_persistent_write_faults_fail_the_save_and_commit_nothing(proxied, moto, monkeypatch, kind, path):
    """Every write of one tensor (or of the root zarr.json: the commit) fails:
    the save ends in a clear error once the retries are spent, commits
    nothing, and its abort removes what it wrote."""
    proxy, s3 = proxied
    monkeypatch.setenv("TENSORCKPT_S3_TIMEOUT", "20")  # longer than the retries: their error is the one seen
    url = s3()
    proxy.faults = Faults(rate=1.0, kinds=(kind,), methods=("PUT",), path=path)
    t = time.monotonic()
    with pytest.raises(TensorckptError) as e:
        tensorckpt.save(_state(n=12), url)
    assert time.monotonic() - t < 30
    assert url in str(e.value) and ("SlowDown" if kind == "503" else "InternalError") in str(e.value)
    assert "retry attempts failed" in str(e.value)
    assert _keys(moto, url) == []  # no partial commit, and nothing left behind
    proxy.faults = Faults()
    tensorckpt.save(_state(2.0, n=12), url)
    assert _equal(tensorckpt.load(_empty(12), url), _state(2.0, n=12))


@pytest.mark.timeout(60)
def test_persistent_read_faults_fail_the_load_clearly(proxied, monkeypatch):
    proxy, s3 = proxied
    monkeypatch.setenv("TENSORCKPT_S3_TIMEOUT", "20")
    url = s3()
    tensorckpt.save(_state(n=12), url)
    proxy.faults = Faults(rate=1.0, kinds=("cut",), methods=("GET",), path="/t7/c")
    target = _empty(12)
    t = time.monotonic()
    with pytest.raises(TensorckptError) as e:
        tensorckpt.load(target, url)
    assert time.monotonic() - t < 30
    assert url in str(e.value) and "t7" in str(e.value) and "partial" in str(e.value)
    proxy.faults = Faults()
    assert _equal(tensorckpt.load(target, url), _state(n=12))  # the same target, bit-exact once it heals
