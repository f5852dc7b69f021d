"""The fault and latency proxy of the S3 tests and benchmarks
(tests/s3proxy.py) does what its users rely on: it passes a checkpoint
through unchanged and counts the bytes, adds its delay, injects the
faults it is told to (TensorStore's retries absorb a few transient ones),
and a killed proxy fails a save with a clear error instead of a hang."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

import tensorckpt
from tensorckpt import TensorckptError

sys.path.insert(0, os.path.dirname(__file__))
from s3proxy import Faults, S3Proxy  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")


@pytest.fixture
def proxied(moto, s3, monkeypatch):
    with S3Proxy(moto.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        yield proxy, s3


def test_passes_a_checkpoint_through_and_counts_bytes(proxied):
    proxy, s3 = proxied
    w = torch.randn(256, 256)
    tensorckpt.save({"w": w}, url := s3())
    assert proxy.requests["PUT"] >= 2 and proxy.bytes_in >= w.numel() * 4
    proxy.reset_counts()
    out = {"w": torch.zeros_like(w)}
    tensorckpt.load(out, url)
    assert torch.equal(out["w"], w)
    assert w.numel() * 4 <= proxy.bytes_out < 1.2 * w.numel() * 4


def test_latency_is_added_per_request(proxied):
    proxy, s3 = proxied
    tensorckpt.save({"w": torch.ones(4)}, url := s3())
    proxy.latency_s, proxy.requests = 0.05, type(proxy.requests)()
    t = time.perf_counter()
    tensorckpt.open(url).read("w")
    assert time.perf_counter() - t >= 0.05 * max(1, min(proxy.requests.values()))


def test_transient_503s_are_retried(proxied):
    proxy, s3 = proxied
    proxy.faults = Faults(rate=0.5, kinds=("503", "500"), methods=("PUT",), limit=3, seed=1)
    w = torch.randn(64, 64)
    tensorckpt.save({"w": w}, url := s3())
    assert sum(proxy.faults.injected.values()) == 3
    out = {"w": torch.zeros_like(w)}
    tensorckpt.load(out, url)
    assert torch.equal(out["w"], w)


def test_a_killed_server_fails_the_save_clearly(proxied, monkeypatch):
    proxy, s3 = proxied
    monkeypatch.setenv("TENSORCKPT_S3_TIMEOUT", "5")
    proxy.kill()
    t = time.perf_counter()
    with pytest.raises(TensorckptError, match="s3://"):
        tensorckpt.save({"w": torch.ones(4)}, s3())
    assert time.perf_counter() - t < 60
    proxy.revive()
    tensorckpt.save({"w": torch.ones(4)}, url := s3("after"))
    assert torch.equal(tensorckpt.open(url).read("w"), torch.ones(4))
