"""Loads of many small tensors: read in batches by one thread each
(engine/load.py ``SMALL_BYTES`` / ``BATCH``), each object of one inner chunk
in one call (direct.Reader._single), every check of the general path kept."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import tensorckpt
from tensorckpt.errors import CorruptCheckpointError
from tensorckpt.storage import direct


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    state: dict[str, torch.Tensor] = {f"norm{i}": torch.randn(8 + i, generator=g) for i in range(150)}
    state["scalar"] = torch.tensor(2.5)
    state["bf16"] = torch.randn(3, 5, generator=g).to(torch.bfloat16)
    state["ints"] = torch.arange(-7, 30, dtype=torch.int64).reshape(37, 1)
    state["flags"] = torch.rand(11, generator=g) > 0.5
    state["empty"] = torch.zeros(0, 4)
    state["big"] = torch.randn(300, 300, generator=g)  # not small: read the general way, in the same load
    return state


def _zeros(state):
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _chunk(path, key):
    return next(p for p in sorted((path / key / "c").rglob("*")) if p.is_file())


def test_many_small_tensors_load_bit_exact_in_batches(tmp_path, monkeypatch):
    state = _state()
    tensorckpt.save(state, tmp_path / "c")
    batches, single = [], []
    real_batch, real_single = direct.Pool.read_batch, direct.Reader._single
    monkeypatch.setattr(direct.Pool, "read_batch", lambda self, reads: batches.append(len(reads)) or real_batch(self, reads))
    monkeypatch.setattr(direct.Reader, "_single", lambda self, *a: single.append(1) or real_single(self, *a))
    target = _zeros(state)
    tensorckpt.load(target, tmp_path / "c")
    assert all(torch.equal(target[k], v) for k, v in state.items())
    assert len(batches) >= 3 and max(batches) <= 64 and sum(batches) == len(state) - 2  # all but "big" and "empty"
    assert len(single) == sum(batches)  # each small object read in one call


@pytest.mark.parametrize("damage", ["flip", "swap", "truncate", "link-dir"])
def test_damage_among_small_tensors_is_named(tmp_path, damage):
    state = _state()
    p = tmp_path / "c"
    tensorckpt.save(state, p)
    a = _chunk(p, "norm70")
    if damage == "flip":
        raw = bytearray(a.read_bytes())
        raw[5] ^= 0x10
        a.write_bytes(bytes(raw))
        match = r"norm70.*CRC-32C"
    elif damage == "swap":  # two objects of one geometry: one tensor's object over its sibling's
        state = {"x": torch.ones(8), "y": torch.zeros(8)}
        p = tmp_path / "d"
        tensorckpt.save(state, p)
        shutil.copyfile(_chunk(p, "x"), _chunk(p, "y"))
        match = r"y.*digest"
    elif damage == "truncate":
        a.write_bytes(a.read_bytes()[:-3])
        match = r"norm70"
    else:
        cdir = p / "norm70" / "c"
        moved = tmp_path / "elsewhere"
        cdir.rename(moved)
        os.symlink(moved, cdir, target_is_directory=True)
        match = r"norm70.*not a directory"
    target = _zeros(state)
    with pytest.raises(CorruptCheckpointError, match=match):
        tensorckpt.load(target, p)
