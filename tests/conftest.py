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
