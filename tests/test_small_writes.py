"""Small stored objects are encoded by tensorckpt itself (storage/arrays.py)
and must be byte-identical to what TensorStore writes for the same data."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tensorckpt.format import dtypes
from tensorckpt.format.metadata import TensorEntry
from tensorckpt.layout import grid
from tensorckpt.layout.boxes import Box
from tensorckpt.storage import arrays, direct, kv, location

CASES = [
    ((), torch.float64),
    ((1,), torch.float32),
    ((7,), torch.bfloat16),
    ((100, 3), torch.float16),  # single-writer chunk rounds 100 rows up to 128: zero padding
    ((5, 4), torch.complex64),
    ((9,), torch.bool),
    ((3, 2, 2), torch.int64),
    ((6,), torch.float8_e4m3fn),
    ((4, 4), torch.uint8),
]


def _data(shape, dtype):
    g = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.float64 if not dtype.is_complex else torch.complex128).to(dtype)
    return torch.randint(0, 100, shape, generator=g, dtype=dtype)


@pytest.mark.parametrize("shape,dtype", CASES, ids=[f"{list(s)}-{d}" for s, d in CASES])
def test_encoded_object_equals_tensorstore_bytes(tmp_path, shape, dtype):
    name = dtypes.torch_name(dtype)
    itemsize = dtypes.BY_TORCH[name].itemsize
    chunk = grid.single_writer_chunks(shape, itemsize)
    entry = TensorEntry(name, shape, chunk, grid.inner_chunks(chunk, itemsize))
    t = _data(shape, dtype)
    box = Box.full(shape)
    pos = arrays.whole_chunk(entry, box)
    assert pos == (0,) * len(shape)

    ref = location.parse(str(tmp_path / "ref"))
    os.makedirs(ref.path)
    arr = arrays.open_write(ref, "a", entry).result()
    (arr[box.slices()] if shape else arr).write(dtypes.to_numpy(t)).result()
    expected = (tmp_path / "ref" / "a" / arrays.chunk_key(pos)).read_bytes()
    assert arrays.encode_whole_chunk(entry, dtypes.to_numpy(t)) == expected


def test_box_of_one_chunk_in_a_grid(tmp_path):
    entry = TensorEntry("float32", (10, 6), (4, 6), (4, 6))
    assert arrays.whole_chunk(entry, Box((4, 0), (4, 6))) == (1, 0)
    assert arrays.whole_chunk(entry, Box((8, 0), (2, 6))) == (2, 0)  # edge chunk, clipped
    assert arrays.whole_chunk(entry, Box((4, 0), (2, 6))) is None  # part of a chunk
    assert arrays.whole_chunk(entry, Box((0, 0), (8, 6))) is None  # two chunks
    assert arrays.whole_chunk(TensorEntry("float32", (8, 8), (8, 8), (4, 8)), Box.full((8, 8))) is None  # 2 inner chunks
    assert arrays.whole_chunk(entry, Box((0, 0), (0, 6))) is None

    data = np.arange(12, dtype=np.float32).reshape(2, 6)
    loc = location.parse(str(tmp_path / "ref"))
    os.makedirs(loc.path)
    arr = arrays.open_write(loc, "a", entry).result()
    arr[8:10, :].write(data).result()
    assert arrays.encode_whole_chunk(entry, data) == (tmp_path / "ref" / "a" / "c" / "2" / "0").read_bytes()
    kv.write(loc, "b/c/2/0", arrays.encode_whole_chunk(entry, data))
    assert (tmp_path / "ref" / "b" / "c" / "2" / "0").read_bytes() == (tmp_path / "ref" / "a" / "c" / "2" / "0").read_bytes()


def test_save_writes_small_tensors_without_opening_arrays(tmp_path, monkeypatch):
    import tensorckpt

    opened = []
    real = arrays.open_write
    monkeypatch.setattr(arrays, "open_write", lambda loc, key, entry: opened.append(key) or real(loc, key, entry))
    state = {f"t{i}": torch.arange(i + 1, dtype=torch.float32) for i in range(50)}
    state["big"] = torch.zeros(512, 1024)  # several inner chunks: storage.direct's writer, or TensorStore
    tensorckpt.save(state, tmp_path / "c", inner_chunk_bytes=64 << 10)
    assert opened == []
    monkeypatch.setattr(direct, "available", lambda is_local: False)
    tensorckpt.save(state, tmp_path / "c", inner_chunk_bytes=64 << 10, overwrite=True)
    assert opened == ["big"]
    loaded = tensorckpt.open(tmp_path / "c").to_state_dict()
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    assert tensorckpt.verify(tmp_path / "c").ok


def test_a_failing_small_write_fails_the_save_and_keeps_the_previous(tmp_path, monkeypatch):
    import tensorckpt

    tensorckpt.save({"w": torch.ones(3)}, tmp_path / "c")
    real = kv.write_many_async

    def failing(loc, objects):
        wait = real(loc, objects)
        if not any("/c" in k for k in objects):
            return wait

        def fail():
            wait()
            raise ValueError("FAILED_PRECEDING: Error writing local file: No space left on device")  # as TensorStore reports it

        return fail

    monkeypatch.setattr(kv, "write_many_async", failing)
    with pytest.raises(tensorckpt.TensorckptError, match="No space left"):
        tensorckpt.save({"w": torch.zeros(3)}, tmp_path / "c", overwrite=True)
    monkeypatch.undo()
    assert torch.equal(tensorckpt.open(tmp_path / "c").read("w"), torch.ones(3))
