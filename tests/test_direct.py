"""Load's fast path (tensorckpt.storage.direct) against TensorStore, the
reference reader: the same elements for every dtype, chunking, region and
destination layout; the same verdict, with the object and inner chunk named,
for every kind of damage."""

from __future__ import annotations

import json

import os
import struct
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import tensorstore as ts
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorckpt
from tensorckpt import CorruptCheckpointError
from tensorckpt.checkpoint import Checkpoint
from tensorckpt.format import dtypes
from tensorckpt.layout.boxes import Box
from tensorckpt.storage import arrays, direct, files

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")
GOLDEN = Path(__file__).resolve().parent.parent / "conformance" / "golden"


def _random(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


DTYPES = [getattr(torch, name) for name in dtypes.BY_TORCH]
shapes = st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple)


@st.composite
def cases(draw):
    shape = draw(shapes)
    dtype = draw(st.sampled_from(DTYPES))
    itemsize = dtypes.for_torch(dtype).itemsize
    inner = draw(st.sampled_from([itemsize, 4 * itemsize, 16 * itemsize, 1 << 18]))
    shard = draw(st.sampled_from([inner, 4 * inner, 1 << 26]))
    lo = tuple(draw(st.integers(0, n - 1)) for n in shape)
    hi = tuple(draw(st.integers(a + 1, n)) for a, n in zip(lo, shape))
    return shape, dtype, inner, shard, Box(lo, tuple(h - a for a, h in zip(lo, hi))), draw(st.booleans())


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(cases())
def test_direct_reads_what_was_saved(tmp_path_factory, case):
    shape, dtype, inner, shard, box, strided = case
    path = tmp_path_factory.mktemp("direct") / "ckpt"
    t = _random(shape, dtype, seed=len(shape) + inner)
    tensorckpt.save({"t": t}, path, inner_chunk_bytes=inner, shard_bytes=shard)
    ckpt = Checkpoint(path)
    e = ckpt.index.tensors["t"]
    npd = dtypes.for_torch(dtype).numpy
    if strided:  # a destination that is a transposed view: any strides work
        dst = np.zeros(box.shape[::-1], npd).T
    else:
        dst = np.zeros(box.shape, npd)
    direct.Reader(str(path), str(path)).read("t", e, box, dst)
    want = dtypes.to_numpy(t)[box.slices()] if shape else dtypes.to_numpy(t)
    assert dst.tobytes(order="C") == want.tobytes(order="C")  # bitwise
    via_api = ckpt.read("t", box.slices()) if shape else ckpt.read("t")
    assert torch.equal(via_api, dtypes.from_numpy(dst.copy(order="C"), dtypes.for_torch(dtype)))
    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / "t")}}).result()  # TensorStore alone
    reference = arr[box.slices()].read().result() if shape else arr.read().result()
    assert reference.tobytes() == dst.tobytes(order="C")


@pytest.mark.parametrize("golden", sorted(p.name for p in (GOLDEN / "v1").iterdir() if (p / "checkpoint").is_dir()))
def test_goldens_load_the_same_through_both_readers(golden, monkeypatch):
    path = GOLDEN / "v1" / golden / "checkpoint"
    with monkeypatch.context() as m:
        m.setattr(direct, "available", lambda is_local: False)
        reference = tensorckpt.open(path).to_state_dict()  # read through TensorStore
    target = _map(reference, lambda v: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
    tensorckpt.load(target, path)  # local: the fast path
    pairs = list(_leaves(reference, target))
    assert any(isinstance(r, torch.Tensor) for r, _ in pairs)
    for r, t in pairs:
        if isinstance(r, torch.Tensor):  # bitwise: the dtypes golden holds NaNs
            assert r.dtype == t.dtype and dtypes.to_numpy(r).tobytes() == dtypes.to_numpy(t).tobytes()
        else:
            assert r == t


def _map(tree, fn):
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    return fn(tree)


def _leaves(a, b):
    if isinstance(a, dict):
        for k in a:
            yield from _leaves(a[k], b[k])
    else:
        yield a, b


# ----------------------------------------------------------------- damage

W = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "ckpt"
    tensorckpt.save({"w": W}, path, inner_chunk_bytes=16 * 16 * 4, shard_bytes=32 * 48 * 4)
    e = Checkpoint(path).index.tensors["w"]
    assert (e.chunk_shape, e.inner_chunk_shape) == ((32, 48), (16, 12))  # 2 objects of 2 x 4 inner chunks
    return path


def _object(path: Path) -> Path:
    return path / "w" / "c" / "1" / "0"


N = 8  # inner chunks per stored object: [32, 48] in [16, 12]
ENCODED = 16 * 12 * 4 + 4
COLS = 4


def _index(data: bytes) -> tuple[bytes, np.ndarray]:
    raw = data[-(16 * N + 4):]
    return raw, np.frombuffer(raw[:-4], "<u8").reshape(N, 2).copy()


def _with_index(data: bytes, entries: np.ndarray) -> bytes:
    raw = entries.astype("<u8").tobytes()
    return data[: -(16 * N + 4)] + raw + struct.pack("<I", google_crc32c.value(raw))


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:]


def _damage(kind: str, obj: Path) -> str:
    """Damage the stored object; return what the error must say."""
    data = obj.read_bytes()
    _, entries = _index(data)
    enc = ENCODED
    if kind == "data bit":
        k = int(np.argsort(entries[:, 0])[4])  # the fifth inner chunk in the file
        obj.write_bytes(_flip(data, int(entries[k, 0]) + 100))
        return "fails its CRC-32C checksum"
    if kind == "chunk crc":
        obj.write_bytes(_flip(data, int(entries[0, 0]) + enc - 2))
        return "fails its CRC-32C checksum"
    if kind == "index bit":
        obj.write_bytes(_flip(data, len(data) - 20))
        return "CRC-32C"
    if kind == "truncated":
        obj.write_bytes(data[:50])
        return "malformed"
    if kind == "cut in the middle":
        obj.write_bytes(data[:enc] + data[2 * enc:])
        return "malformed"
    if kind == "wrong length":
        entries[2, 1] = enc - 4
        obj.write_bytes(_with_index(data, entries))
        return "malformed"
    if kind == "offset past the data":
        entries[3, 0] = len(data)
        obj.write_bytes(_with_index(data, entries))
        return "malformed"
    if kind == "huge offset":
        entries[3, 0] = 2**64 - 2
        obj.write_bytes(_with_index(data, entries))
        return "malformed"
    if kind == "missing inner chunk":
        entries[N - 1] = 2**64 - 1
        obj.write_bytes(_with_index(data, entries))
        return "missing"
    if kind == "empty file":
        obj.write_bytes(b"")
        return "malformed"
    if kind == "deleted":
        obj.unlink()
        return "missing"
    if kind == "sparse and huge":  # TensorStore would allocate all of it at once and abort
        with open(obj, "r+b") as f:
            f.truncate(1 << 40)
        return "more than its inner chunks and index can take"
    raise AssertionError(kind)


KINDS = ["data bit", "chunk crc", "index bit", "truncated", "cut in the middle", "wrong length",
         "offset past the data", "huge offset", "missing inner chunk", "empty file", "deleted", "sparse and huge"]


@pytest.mark.parametrize("kind", KINDS)
def test_damage_is_named_by_load(ckpt, kind):
    says = _damage(kind, _object(ckpt))
    target = {"w": torch.zeros_like(W)}
    with pytest.raises(CorruptCheckpointError, match=says) as info:
        tensorckpt.load(target, ckpt)
    msg = str(info.value)
    assert "'w'" in msg and "/w/c/1/0" in msg, msg


@pytest.mark.parametrize("kind", KINDS)
def test_tensorstore_agrees_on_damage(ckpt, kind, monkeypatch):
    """The reference reader refuses the same objects (its message differs)."""
    _damage(kind, _object(ckpt))
    monkeypatch.setattr(direct, "available", lambda is_local: False)
    with pytest.raises(CorruptCheckpointError):
        tensorckpt.load({"w": torch.zeros_like(W)}, ckpt)


def test_undamaged_object_and_other_regions_still_read(ckpt):
    _damage("data bit", _object(ckpt))
    e = Checkpoint(ckpt).index.tensors["w"]
    top = np.zeros((32, 48), np.float32)
    direct.Reader(str(ckpt), str(ckpt)).read("w", e, Box((0, 0), (32, 48)), top)  # the other object
    np.testing.assert_array_equal(top, W[:32].numpy())


def test_damage_names_the_inner_chunk(ckpt):
    obj = _object(ckpt)
    _, entries = _index(obj.read_bytes())
    _damage("data bit", obj)
    k = int(np.argsort(entries[:, 0])[4])
    row, col = divmod(k, COLS)
    e = Checkpoint(ckpt).index.tensors["w"]
    with pytest.raises(CorruptCheckpointError, match=rf"chunk \(1, 0\), inner chunk \({row}, {col}\), fails"):
        direct.Reader(str(ckpt), str(ckpt)).read("w", e, Box((32, 0), (32, 48)), np.zeros((32, 48), np.float32))


def test_a_whole_object_is_read_in_one_pass_data_first(ckpt, monkeypatch):
    """A same-layout load reads each object front to back, its index (at its
    end) last: no seek back to the index before the data."""
    size = _object(ckpt).stat().st_size  # both objects are of this size
    reads: dict[int, list[tuple[int, int]]] = {}  # inode -> (offset, bytes) of each read of it, in order
    real_pread, real_preadv = os.pread, os.preadv

    def record(fd, offset, n):
        st = os.fstat(fd)
        if st.st_size == size:
            reads.setdefault(st.st_ino, []).append((offset, n))

    def pread(fd, n, offset):
        record(fd, offset, n)
        return real_pread(fd, n, offset)

    def preadv(fd, views, offset):
        record(fd, offset, sum(len(v) for v in views))
        return real_preadv(fd, views, offset)

    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "preadv", preadv)
    target = {"w": torch.zeros_like(W)}
    tensorckpt.load(target, ckpt)
    assert torch.equal(target["w"], W)
    assert len(reads) == 2, reads
    for of_one in reads.values():  # the objects are read on several threads at once: each in order
        assert sorted(of_one) == of_one and of_one[0][0] == 0 and of_one[-1] == (size - 16 * N - 4, 16 * N + 4)
        assert sum(n for _, n in of_one) == size  # every byte once


@pytest.mark.parametrize("order", ["reversed", "columns first"])
def test_inner_chunks_stored_in_another_order_load_and_verify(ckpt, order):
    """Another writer may store an object's inner chunks in any order (its
    index says where): loads read them right, and verify passes."""
    for obj in (ckpt / "w" / "c" / "0" / "0", _object(ckpt)):
        data = obj.read_bytes()
        _, entries = _index(data)
        perm = list(range(N))[::-1] if order == "reversed" else [r * COLS + c for c in range(COLS) for r in range(N // COLS)]
        body = b"".join(data[int(entries[k, 0]):int(entries[k, 0]) + ENCODED] for k in perm)
        for place, k in enumerate(perm):
            entries[k, 0] = place * ENCODED
        obj.write_bytes(_with_index(body + data[-(16 * N + 4):], entries))
    target = {"w": torch.zeros_like(W)}
    tensorckpt.load(target, ckpt)
    assert torch.equal(target["w"], W)
    assert tensorckpt.verify(ckpt).status == "ok"
    # without the chunk digests of format 1.3 (older checkpoints): the index alone says where each inner chunk is
    e = Checkpoint(ckpt).index.tensors["w"]
    got = np.zeros((64, 48), np.float32)
    direct.Reader(str(ckpt), str(ckpt)).read("w", e, Box((0, 0), (64, 48)), got, digests=None)
    np.testing.assert_array_equal(got, W.numpy())


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_not_a_regular_file_neither_blocks_nor_escapes(ckpt, tmp_path, kind):
    obj = _object(ckpt)
    outside = tmp_path / "outside"
    outside.write_bytes(obj.read_bytes())
    obj.unlink()
    if kind == "fifo":
        os.mkfifo(obj)
    elif kind == "symlink":
        obj.symlink_to(outside)
    else:
        obj.mkdir()
    e = Checkpoint(ckpt).index.tensors["w"]
    with pytest.raises(CorruptCheckpointError, match="/w/c/1/0"):  # the reader alone, without load's lstat checks
        direct.Reader(str(ckpt), str(ckpt)).read("w", e, Box((32, 0), (32, 48)), np.zeros((32, 48), np.float32))
    with pytest.raises(CorruptCheckpointError, match="/w/c/1/0"):
        tensorckpt.load({"w": torch.zeros_like(W)}, ckpt)


def test_oversized_index_goes_through_tensorstore(tmp_path, monkeypatch):
    """Entries whose index or inner chunk exceed what the fast path buffers
    are read by TensorStore, in the same load."""
    path = tmp_path / "ckpt"
    state = {"a": torch.arange(4096.0), "b": torch.arange(100.0)}
    tensorckpt.save(state, path, inner_chunk_bytes=64)  # "a": 256 inner chunks -> a 4 KiB index
    monkeypatch.setattr(direct, "MAX_INDEX_BYTES", 1024)
    used = []
    real, batch = direct.Pool.read, direct.Pool.read_batch
    monkeypatch.setattr(direct.Pool, "read", lambda self, key, *a: used.append(key) or real(self, key, *a))
    monkeypatch.setattr(direct.Pool, "read_batch", lambda self, reads: used.extend(r[0] for r in reads) or batch(self, reads))
    target = {"a": torch.zeros(4096), "b": torch.zeros(100)}
    tensorckpt.load(target, path)
    assert used == ["b"] and torch.equal(target["a"], state["a"]) and torch.equal(target["b"], state["b"])


def test_load_without_the_fast_path(tmp_path, monkeypatch):
    """TensorStore stays a complete reader (it is the only one for object stores)."""
    monkeypatch.setattr(direct, "available", lambda is_local: False)
    monkeypatch.setattr(direct.Pool, "read", lambda *a: pytest.fail("fast path used"))
    path = tmp_path / "ckpt"
    state = {"w": W, "p": torch.nn.Parameter(torch.randn(7, 5)), "b": torch.arange(9).to(torch.bfloat16)}
    tensorckpt.save(state, path, inner_chunk_bytes=256)
    target = {"w": torch.zeros_like(W), "p": torch.nn.Parameter(torch.zeros(7, 5)), "b": torch.zeros(9, dtype=torch.bfloat16)}
    tensorckpt.load(target, path)
    assert all(torch.equal(target[k].detach(), state[k].detach()) for k in state)


@pytest.mark.parametrize("kind", KINDS)
def test_verify_reports_the_same_damage(ckpt, kind):
    _damage(kind, _object(ckpt))
    report = tensorckpt.verify(ckpt)
    assert report.status == "corrupt" and [p.where for p in report.problems] == [str(_object(ckpt))], report.problems


# ----------------------------------------------------------------- writing


def _objects(root: Path) -> dict[str, bytes]:
    """Every stored object below the root, an array zarr.json without its
    checkpoint_id (random per save, format 1.3): its chunk digests must agree too."""
    return {str(p.relative_to(root)): _without_id(p) for p in sorted(root.rglob("*")) if p.is_file() and p.parent != root}


def _without_id(p: Path) -> bytes:
    if p.name != "zarr.json":
        return p.read_bytes()
    doc = json.loads(p.read_bytes())
    doc.get("attributes", {}).get("tensorckpt", {}).pop("checkpoint_id", None)
    return json.dumps(doc).encode()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(cases())
def test_writer_bytes_are_tensorstores(tmp_path_factory, case):
    """Every stored object the fast writer makes is byte for byte what
    TensorStore writes for the same chunk (edges and padding included)."""
    shape, dtype, inner, shard, _, _ = case
    root = tmp_path_factory.mktemp("write")
    t = _random(shape, dtype, seed=7)
    tensorckpt.save({"t": t}, root / "fast", inner_chunk_bytes=inner, shard_bytes=shard)
    real = direct.available
    try:
        direct.available = lambda is_local: False
        tensorckpt.save({"t": t}, root / "ts", inner_chunk_bytes=inner, shard_bytes=shard)
    finally:
        direct.available = real
    assert _objects(root / "fast") == _objects(root / "ts")


def test_writer_is_used_for_multi_chunk_objects(tmp_path, monkeypatch):
    calls = []
    real = direct.Writer.write
    monkeypatch.setattr(direct.Writer, "write", lambda self, key, e, pos, data: calls.append((key, pos)) or real(self, key, e, pos, data))
    tensorckpt.save({"w": W, "tiny": torch.ones(3)}, tmp_path / "c", inner_chunk_bytes=16 * 16 * 4, shard_bytes=32 * 48 * 4)
    assert sorted(calls) == [("w", (0, 0)), ("w", (1, 0))]  # "tiny" is one inner chunk: the small-object path
    target = {"w": torch.zeros_like(W), "tiny": torch.zeros(3)}
    tensorckpt.load(target, tmp_path / "c")
    assert torch.equal(target["w"], W) and torch.equal(target["tiny"], torch.ones(3))


@pytest.mark.parametrize("fail", ["write", "fsync", "open"])
def test_a_failing_write_fails_the_save_and_keeps_the_previous(tmp_path, monkeypatch, fail):
    import errno
    import types

    path = tmp_path / "c"
    tensorckpt.save({"w": W}, path, inner_chunk_bytes=16 * 16 * 4, shard_bytes=32 * 48 * 4)
    fake = types.SimpleNamespace(**{n: getattr(os, n) for n in dir(os) if not n.startswith("__")})
    seen = []

    def failing(*a, **kw):
        seen.append(fail)
        if len(seen) == 2:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return getattr(os, fail)(*a, **kw)

    setattr(fake, fail, failing)
    monkeypatch.setattr(files, "os", fake)  # the direct writer's file writes (storage/files.py)
    monkeypatch.setattr(arrays, "SYNC_OBJECT_BYTES", 1)  # every object is fsynced as written
    with pytest.raises(tensorckpt.TensorckptError, match="No space left"):
        tensorckpt.save({"w": W * 2}, path, overwrite=True, inner_chunk_bytes=16 * 16 * 4, shard_bytes=32 * 48 * 4)
    assert len(seen) >= 2
    monkeypatch.undo()
    target = {"w": torch.zeros_like(W)}
    tensorckpt.load(target, path)
    assert torch.equal(target["w"], W)
    assert tensorckpt.verify(path).ok
