"""The size caps of spec 12 on every path (issue 12 items 8, 9): an entry
whose encoded inner chunk is over 256 MiB or whose shard index is over
64 MiB is never planned by the writer (a clear error before anything is
staged) and is refused by every reader when it validates the root, before
any chunk I/O, so a forged one cannot reach TensorStore (which allocates
the inner chunk and aborts the process); a root zarr.json over its cap is
refused by the writer before the commit, leaving nothing behind."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tensorckpt
from tensorckpt.errors import CorruptCheckpointError, TensorckptError
from tensorckpt.format import metadata
from tensorckpt.format.metadata import MAX_INNER_CHUNK_BYTES, MAX_SHARD_INDEX_BYTES, TensorEntry, parse_tensor_entry
from tensorckpt.layout import grid
from tensorckpt.layout.boxes import Box
from tensorckpt.layout.plan import LocalItem, LocalItems, LocalPlan, build_save_plan
from tensorckpt.storage import arrays
from tests.forge import reseal

PRIME = 67_108_879  # a row of this many float32 is over the inner-chunk cap and has no divisor
ROOT = Path(__file__).parents[1]

# ------------------------------------------------------------------ entries


def _entry_doc(e: TensorEntry) -> dict:
    return json.loads(json.dumps(e.to_json()))


@pytest.mark.parametrize("entry, what", [
    (TensorEntry("float32", (8,), (2**38,), (2**38,)), "inner chunk"),  # 1 TiB
    (TensorEntry("float32", (8,), (MAX_INNER_CHUNK_BYTES // 4,), (MAX_INNER_CHUNK_BYTES // 4,)), "inner chunk"),
    (TensorEntry("uint8", (8,), (1 << 23,), (1,)), "shard index"),  # 8 Mi inner chunks: a 128 MiB index
])
def test_entries_past_the_caps_are_corrupt(entry, what):
    with pytest.raises(CorruptCheckpointError, match=f"tensors\\['w'\\]: .*{what}.*a reader accepts \\(spec 12\\)"):
        parse_tensor_entry(_entry_doc(entry), "root: tensors['w']")


def test_entries_at_the_caps_are_accepted():
    most_inner = (MAX_INNER_CHUNK_BYTES - 4) // 4
    parse_tensor_entry(_entry_doc(TensorEntry("float32", (8,), (most_inner,), (most_inner,))), "w")
    most_count = (MAX_SHARD_INDEX_BYTES - 4) // 16
    parse_tensor_entry(_entry_doc(TensorEntry("uint8", (8,), (most_count,), (1,))), "w")


# ------------------------------------------------------------------ writer


def _plan(shape: tuple[int, ...], dtype: str = "float32", **sizes: int):
    item = LocalItem("w", dtype, shape, Box((0,) * len(shape), shape))
    return build_save_plan([LocalPlan(0, LocalItems.of([item]), {})], **sizes)


def test_the_grid_cuts_any_factor_past_the_cap():
    """A row over 256 MiB whose length has only factors above 16 (left whole
    below the cap, so as not to cut slivers) is cut by them past it."""
    assert grid.inner_chunks((1, 17 * 3_947_591), 4) == (1, 3_947_591)
    assert grid.inner_chunks((1, 17 * 19), 4, 4) == (1, 17 * 19)  # below the cap: as before
    e = _plan((1, 17 * 3_947_591)).entries["w"]
    assert math.prod(e.inner_chunk_shape) * 4 + 4 <= MAX_INNER_CHUNK_BYTES


def test_the_plan_refuses_an_inner_chunk_past_the_cap():
    with pytest.raises(TensorckptError, match=rf"tensor 'w' \(shape \[1, {PRIME}\], float32\) cannot be saved: "
                                              r"its inner chunk .* 268435520 bytes encoded.*reshape the tensor"):
        _plan((1, PRIME))


def test_the_plan_refuses_a_shard_index_past_the_cap():
    with pytest.raises(TensorckptError, match=r"tensor 'w' .*shard index of \d+ bytes, more than the 67108864 .*"
                                              r"pass a larger inner_chunk_bytes= \(now 1\) or a smaller shard_bytes="):
        _plan((5 << 20,), "uint8", shard_bytes=64 << 20, inner_bytes=1)


def test_save_refuses_before_anything_is_staged(tmp_path):
    """Through the public save: a 5 MiB tensor in inner chunks of one byte
    needs an index of 80 MiB; refused, and nothing is written at all."""
    with pytest.raises(TensorckptError, match="tensor 'w'.*shard index.*inner_chunk_bytes="):
        tensorckpt.save({"w": torch.zeros(5 << 20, dtype=torch.uint8)}, tmp_path / "c", inner_chunk_bytes=1)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ readers


def _forge(path: Path, entry: TensorEntry, chunk_bytes: int) -> None:
    """Make root and array metadata agree on ``entry`` for tensor "w",
    resealed, with a sparse chunk object of ``chunk_bytes`` (what the entry
    says the object holds, so no size check refuses it)."""
    root = json.loads((path / "zarr.json").read_text())
    root["attributes"]["tensorckpt"]["tensors"]["w"] = entry.to_json()
    (path / "w" / "zarr.json").write_bytes(arrays.zarr_json(entry))
    reseal(path, root)  # before the object grows: its digest is computed from what is stored
    with open(path / "w" / arrays.chunk_key((0,) * len(entry.shape)), "r+b") as f:
        f.truncate(chunk_bytes)


_READERS = """
import sys, torch, tensorckpt
from tensorckpt.cli import main as cli
from tensorckpt.errors import CorruptCheckpointError
url, n = sys.argv[1], 8
for name, f in [("open", lambda: tensorckpt.open(url)),
                ("read", lambda: tensorckpt.open(url).read("w")),
                ("load", lambda: tensorckpt.load({"w": torch.zeros(n)}, url)),
                ("to_state_dict", lambda: tensorckpt.open(url).to_state_dict())]:
    try:
        f()
        print(name, "ACCEPTED")
    except CorruptCheckpointError as e:
        print(name, "refused", "'w'" in str(e) and "a reader accepts (spec 12)" in str(e))
r = tensorckpt.verify(url)
print("verify", r.ok, any("a reader accepts (spec 12)" in p.message for p in r.problems))
print("inspect", cli(["inspect", url]))
"""


@pytest.mark.parametrize("entry, chunk_bytes", [
    (TensorEntry("float32", (8,), (2**38,), (2**38,)), (1 << 40) + 4 + 20),  # 1 TiB inner chunk, a 1 TiB sparse object
    (TensorEntry("uint8", (8,), (1 << 23,), (1,)), 5 * 8 + (16 << 23) + 4),  # a 128 MiB index
])
def test_forged_entry_past_the_caps_never_reaches_tensorstore(tmp_path, entry, chunk_bytes):
    """Every read path refuses it at open, the same way (run in a child
    process: an abort in TensorStore must fail this test, not end the run)."""
    p = tmp_path / "c"
    tensorckpt.save({"w": torch.ones(8)}, p)
    _forge(p, entry, chunk_bytes)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _READERS, str(p)], capture_output=True, text=True, timeout=120, env=env,
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["open", "refused", "True", "read", "refused", "True", "load", "refused", "True",
                                "to_state_dict", "refused", "True", "verify", "False", "True", "inspect", "2"], r.stdout
    assert "a reader accepts (spec 12)" in r.stderr, r.stderr[-2000:]  # what inspect printed


# ------------------------------------------------------------------ root zarr.json


def test_save_refuses_a_root_past_its_cap(tmp_path, monkeypatch):
    """The root cap made small: the save fails before the commit, saying
    how big and why, and leaves nothing (no checkpoint, no staging)."""
    monkeypatch.setattr(metadata, "MAX_ROOT_JSON_BYTES", 4096)
    state = {f"t{i}": torch.ones(2) for i in range(40)} | {"lr": 1e-3}
    with pytest.raises(TensorckptError, match=r"root zarr.json would be \d+ bytes, more than the 4096 .*40 tensors"):
        tensorckpt.save(state, tmp_path / "c")
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    tensorckpt.save(state, tmp_path / "c")  # the same save within the real cap
    assert tensorckpt.verify(tmp_path / "c").ok
