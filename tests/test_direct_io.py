"""Large stored objects are written around the page cache (``O_DIRECT``):
the encoder's aligned pieces, the bytes on disk (still TensorStore's), the
page cache left behind by a save (in-process and through the async save's
helper process), ``TENSORCKPT_DIRECT_IO=0`` and file systems that refuse
``O_DIRECT``."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorckpt
from tensorckpt.format.metadata import TensorEntry
from tensorckpt.storage import codec, direct, files

pytestmark = pytest.mark.skipif(not files.DIRECT or codec.crc32c_at is None, reason="no O_DIRECT or native CRC-32C")

BIG = torch.arange(1024 * 1024, dtype=torch.float32).reshape(1024, 1024)  # one 4 MiB object of 16 inner chunks


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 40), st.sampled_from([16, 512, 4096]), st.integers(1, 6), st.data())
def test_aligned_pieces_are_the_same_object(rows, cols, align, per_buf, data):
    """Every piece but the last two (the data's end, the index) starts at
    the buffer's start and is a multiple of ``align`` long; joined, they are
    the object unaligned encoding makes."""
    inner = (rows, cols)
    chunk = (rows * data.draw(st.integers(1, 8)), cols * data.draw(st.integers(1, 4)))
    shape = tuple(data.draw(st.integers(1, c)) for c in chunk)
    g = codec.geometry(TensorEntry("float32", shape, chunk, inner))
    values = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    buf = files.aligned_buffer(codec.write_buffer(g, per_buf * g.encoded, align))
    pieces = []
    for p in codec.encode(g, values, buf, None, align):
        pieces.append((bytes(p), np.frombuffer(p, np.uint8).ctypes.data))
    assert b"".join(b for b, _ in pieces) == codec.encode_bytes(g, values)
    for b, address in pieces[:-2]:
        assert len(b) % align == 0 and len(b) > 0 and address == buf.ctypes.data


def test_aligned_encoding_needs_room_for_the_carried_rest():
    g = codec.geometry(TensorEntry("float32", (8, 8), (8, 8), (2, 8)))
    with pytest.raises(ValueError, match="aligned to 4096"):
        list(codec.encode(g, np.zeros((8, 8), np.float32), np.empty(g.encoded + 100, np.uint8), None, 4096))


def _direct_ok(where: Path) -> bool:
    try:
        fd = os.open(where / ".probe", os.O_WRONLY | os.O_CREAT | files.DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(where / ".probe")
    return True


@pytest.fixture
def where(tmp_path):
    if not _direct_ok(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    return tmp_path


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _cached_fraction(path: Path) -> float:
    """The share of ``path``'s pages in the page cache (mincore)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, size, vec):
                raise OSError(ctypes.get_errno(), "mincore")
            return sum(v & 1 for v in vec) / pages
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)


def _big_object(root: Path) -> Path:
    (obj,) = [p for p in (root / "w" / "c").rglob("*") if p.is_file()]
    assert obj.stat().st_size > 4 << 20
    return obj


def _saved(root: Path, how: str) -> tuple[Path, float]:
    """Save BIG at ``root`` (``how``: save, or an async save's executor):
    its object, the share of it cached once saved; loaded back exactly."""
    state = {"w": BIG.clone()}
    if how == "save":
        tensorckpt.save(state, root)
    else:
        with tensorckpt.AsyncSaver(executor=how) as saver:
            saver.save(state, root).wait()
    obj = _big_object(root)
    cached = _cached_fraction(obj)  # before the load reads it into the cache
    target = {"w": torch.zeros_like(BIG)}
    tensorckpt.load(target, root)
    assert torch.equal(target["w"], BIG)
    return obj, cached


@pytest.mark.parametrize("how", ["save", "thread", "process"])
def test_a_save_leaves_its_large_objects_out_of_the_page_cache(where, how, monkeypatch):
    """Written with O_DIRECT, a save's data does not fill the page cache
    (nor cost the copy into it); the object's last page goes through it."""
    if how == "process" and not hasattr(os, "memfd_create"):
        pytest.skip("no helper-process executor here")
    assert _saved(where / "direct", how)[1] < 0.05
    monkeypatch.setenv(files.DIRECT_ENV, "0")  # the helper reads it when it starts: a new saver here
    assert _saved(where / "cached", how)[1] > 0.9


def test_a_file_system_that_refuses_o_direct_gets_the_page_cache(where, monkeypatch):
    """fcntl refusing O_DIRECT (EINVAL, as tmpfs does) or a write refusing
    it: the same bytes, through the page cache."""
    tensorckpt.save({"w": BIG}, where / "ref")
    expected = _big_object(where / "ref").read_bytes()
    real_fcntl = files.fcntl.fcntl

    def refusing_fcntl(fd, cmd, arg=0):
        if cmd == files.fcntl.F_SETFL and arg & files.DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument (injected)")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(files, "fcntl", types.SimpleNamespace(fcntl=refusing_fcntl, F_GETFL=files.fcntl.F_GETFL,
                                                             F_SETFL=files.fcntl.F_SETFL))
    obj, cached = _saved(where / "fcntl", "save")
    assert obj.read_bytes() == expected and cached > 0.9
    monkeypatch.undo()

    refused = []

    def refusing_write(fd, data):
        if real_fcntl(fd, files.fcntl.F_GETFL) & files.DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument (injected)")
        return os.write(fd, data)

    fake = types.SimpleNamespace(**{n: getattr(os, n) for n in dir(os) if not n.startswith("__")})
    fake.write = refusing_write
    monkeypatch.setattr(files, "os", fake)
    obj, cached = _saved(where / "write", "save")
    assert refused and obj.read_bytes() == expected and cached > 0.9


def test_objects_of_many_aligned_pieces_are_tensorstores_bytes(where, monkeypatch):
    """With a small write buffer every object is many O_DIRECT pieces and a
    buffered end: byte for byte what TensorStore writes."""
    monkeypatch.setattr(direct, "BUFFER_BYTES", 3 * 4100)
    t = torch.randn(300, 70)
    opts = {"inner_chunk_bytes": 20 * 70 * 4, "shard_bytes": 160 * 70 * 4}  # 2 objects of 8 inner chunks
    tensorckpt.save({"t": t}, where / "fast", **opts)
    monkeypatch.setattr(direct, "available", lambda is_local: False)
    tensorckpt.save({"t": t}, where / "ts", **opts)
    for obj in (where / "fast" / "t" / "c").rglob("*"):
        if obj.is_file():
            assert obj.read_bytes() == (where / "ts" / obj.relative_to(where / "fast")).read_bytes()
    target = {"t": torch.zeros_like(t)}
    tensorckpt.load(target, where / "fast")
    assert torch.equal(target["t"], t)


def test_a_large_object_is_reserved_whole_before_it_is_written(where, monkeypatch):
    """O_DIRECT allocates blocks as each piece lands (4-6 extents per 16 MiB
    object on ext4 when four threads write at once): the writer reserves the
    object's exact size first, keeping the file's size; a file system
    without fallocate just writes."""
    if files._fallocate is None:
        pytest.skip("no fallocate here")
    calls = []
    real = files._fallocate
    monkeypatch.setattr(files, "_fallocate", lambda fd, mode, at, n: calls.append((mode, at, n)) or real(fd, mode, at, n))
    obj, _ = _saved(where / "reserved", "save")
    assert calls == [(files.FALLOC_FL_KEEP_SIZE, 0, obj.stat().st_size)]

    def unsupported(fd, mode, at, n):
        ctypes.set_errno(errno.EOPNOTSUPP)
        return -1

    monkeypatch.setattr(files, "_fallocate", unsupported)
    obj2, _ = _saved(where / "unsupported", "save")
    assert obj2.read_bytes() == obj.read_bytes()
