"""Shared fixtures for the tensorckpt test suite."""

from __future__ import annotations

import itertools
import os

import pytest

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
