"""Shared fixtures for the tensorckpt test suite."""

from __future__ import annotations

import itertools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from s3server import BUCKET, MotoServer  # noqa: E402

_counter = itertools.count()


@pytest.fixture
def mem_url():
    """A factory of ``memory://`` URLs unique to this process.

    memory:// stores live in tensorckpt's process-wide TensorStore context, so
    every test must use fresh names."""

    def make(tag: str = "ckpt") -> str:
        return f"memory://t{os.getpid()}-{next(_counter)}/{tag}"

    return make


@pytest.fixture
def fresh_plan_cache():
    """Start the test with an empty save-plan cache.

    tensorckpt.engine.plan_cache keeps a per-group plan cache; while a failed
    save can leave a wrong plan in it (see test_errors.py,
    test_failed_save_does_not_affect_the_next_save), one test's failure would
    leak into the next test's saves. Tests of that bug run inside one test,
    so this isolation does not hide it."""
    from tensorckpt.engine import plan_cache

    plan_cache.clear()
    yield


@pytest.fixture(scope="session")
def moto():
    pytest.importorskip("moto.server", reason="moto[server] is not installed (the test extra)")
    with MotoServer() as server:
        server.make_bucket(BUCKET)
        yield server


@pytest.fixture
def s3(moto, monkeypatch):
    """A factory of fresh ``s3://`` URLs on the test server (its environment set)."""
    for k, v in moto.env().items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN", "TENSORCKPT_S3_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    run = f"t{os.getpid()}-{next(_counter)}"

    def make(name: str = "ckpt") -> str:
        return f"s3://{BUCKET}/{run}/{name}"

    return make
