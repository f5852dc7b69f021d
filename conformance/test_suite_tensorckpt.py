"""tensorckpt itself against the conformance suite: on a local path, on
memory://, and with tiny shards and inner chunks."""

from __future__ import annotations

import itertools

import pytest

import tensorckpt

from .suite import ConformanceSuite

_n = itertools.count()


@pytest.fixture(autouse=True)
def _fresh_save_plan_cache():
    # Isolation from earlier tests in the same session: while a failed save can
    # leave a wrong plan in tensorckpt's per-process save-plan cache (see
    # tests/test_errors.py::test_failed_save_does_not_affect_the_next_save),
    # start every test with an empty one.
    from tensorckpt.engine import plan_cache

    plan_cache.clear()


class TestTensorckpt(ConformanceSuite):
    def save(self, state, path):
        tensorckpt.save(state, path)

    def load(self, state, path):
        return tensorckpt.load(state, path)


class TestTensorckptMemory(TestTensorckpt):
    def make_path(self, tmp_path, name):
        return f"memory://conformance-{next(_n)}/{name}"

    test_golden_v1 = None  # goldens are local files, read by TestTensorckpt already


class TestTensorckptSmallChunks(TestTensorckpt):
    """Many shards and inner chunks for every tensor."""

    def save(self, state, path):
        tensorckpt.save(state, path, shard_bytes=48, inner_chunk_bytes=16)

    test_golden_v1 = None  # the save hook plays no part there; TestTensorckpt reads the goldens
