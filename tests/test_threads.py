"""Saves reuse their threads (storage/threads.py): no threads started and joined by
every save, and a borrowed pool is its borrower's alone."""

from __future__ import annotations

import threading

import torch

import tensorckpt
from tensorckpt.storage import direct, kv
from tensorckpt.storage import threads as pools


def _state() -> dict:
    return {"model": {"a": torch.randn(64, 64), "b": torch.arange(10.0)}, "big": torch.randn(512, 1024)}


def test_saves_reuse_their_threads(tmp_path, monkeypatch):
    state = _state()
    tensorckpt.save(state, tmp_path / "warm", inner_chunk_bytes=64 << 10)  # several objects: the writer's threads too
    started = []
    real = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self.name) or real(self))
    for i in range(10):
        tensorckpt.save(state, tmp_path / f"c{i}", inner_chunk_bytes=64 << 10)
    # at most the pools' own threads, created as they are first needed (a pool starts one only when all are busy);
    # each save used to start and join its own (~9 a save)
    assert len([n for n in started if n.startswith("tensorckpt-")]) <= kv.SYNC_THREADS + direct.WRITE_THREADS
    target = {"model": {"a": torch.zeros(64, 64), "b": torch.zeros(10)}, "big": torch.zeros(512, 1024)}
    tensorckpt.load(target, tmp_path / "c9")
    assert torch.equal(target["big"], state["big"]) and torch.equal(target["model"]["a"], state["model"]["a"])


def test_a_borrowed_pool_is_its_borrowers_alone():
    a = pools.borrow("test", 2)
    b = pools.borrow("test", 2)
    assert a is not b
    pools.give_back(a, "test", 2)
    assert pools.borrow("test", 2) is a  # kept, idle, for the next borrower
    pools.give_back(a, "test", 2)
    pools.give_back(b, "test", 2)
