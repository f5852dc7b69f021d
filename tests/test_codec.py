"""The shard codec alone (tensorckpt/storage/codec.py), in memory: geometry,
encode -> decode round trips (any shape, chunking, edge, buffer size), and
every defect of an index or inner chunk refused with the object and inner
chunk named. The byte-for-byte comparison with TensorStore is
tests/test_direct.py's and tests/test_small_writes.py's."""

from __future__ import annotations

import struct

import google_crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorckpt.errors import CorruptCheckpointError
from tensorckpt.format.metadata import TensorEntry
from tensorckpt.layout.boxes import Box, chunk_box, read_plan
from tensorckpt.storage import codec

pytestmark = pytest.mark.skipif(codec.crc32c_at is None, reason="no native CRC-32C")

WHERE = "mem://x/w/c/1/0: tensor 'w', chunk (1, 0)"
E = TensorEntry("float32", (48, 48), (32, 48), (16, 12))  # chunk (1, 0): 16 rows, 2 x 4 inner chunks, the
G = codec.geometry(E)  # second row of inner chunks wholly outside the array


def _chunk(data: np.ndarray, pos: tuple[int, ...], g: codec.Geometry) -> np.ndarray:
    return data[chunk_box(pos, g.chunk, g.shape).slices()]


def _decode(g: codec.Geometry, obj: bytes, pos: tuple[int, ...], want: Box, dst: np.ndarray,
            per_buf: int = 3) -> None:
    """What direct.Reader does with a file, on bytes in memory."""
    data_end = len(obj) - g.index_bytes
    index = codec.decode_index(g, obj[data_end:], WHERE)
    reads = codec.plan_reads(g, index, data_end, pos, want, per_buf, WHERE)
    buf = np.empty(reads.most, np.uint8)
    view = memoryview(buf)
    for first, a, b in reads.runs:
        n = (b - a) * g.encoded
        view[:n] = obj[first:first + n]
        for k in range(a, b):
            at = (k - a) * g.encoded
            reads.check(k, view, buf.ctypes.data, at)
            block = np.frombuffer(buf, g.dtype, count=g.numel, offset=at).reshape(g.inner)
            dst[reads.dst[k]] = block[reads.src[k]]


def _object(pos: tuple[int, ...] = (1, 0)) -> tuple[np.ndarray, bytes]:
    data = np.arange(48 * 48, dtype=np.float32).reshape(48, 48)
    return data, codec.encode_bytes(G, _chunk(data, pos, G))


def test_geometry():
    assert (G.grid, G.count, G.numel, G.encoded, G.index_bytes) == ((2, 4), 8, 192, 772, 132)
    assert G.dtype == np.float32 and codec.geometry(E) is G  # built once per entry
    assert G.bounds((1, 0)) == (4 * 772 + 132, 8 * 772 + 132)  # only the first row of inner chunks is stored
    assert G.bounds((0, 0)) == (8 * 772 + 132,) * 2


def test_edge_object_layout():
    data, obj = _object()
    assert len(obj) == G.bounds((1, 0))[0]
    index = codec.decode_index(G, obj[-G.index_bytes:], WHERE)
    assert index[:4].tolist() == [[k * 772, 772] for k in range(4)]
    assert (index[4:] == codec.EMPTY).all()
    first = np.frombuffer(obj, np.float32, count=192).reshape(16, 12)
    np.testing.assert_array_equal(first, data[32:48, 0:12])
    assert struct.unpack("<I", obj[768:772])[0] == google_crc32c.value(obj[:768])


def test_edge_padding_is_zero():
    e = TensorEntry("int16", (5, 7), (4, 8), (4, 8))  # chunk (1, 0): 1 x 7 elements of a 4 x 8 inner chunk
    g = codec.geometry(e)
    data = np.arange(35, dtype=np.int16).reshape(5, 7) + 1
    block = np.frombuffer(codec.encode_bytes(g, data[4:5, 0:7]), np.int16, count=32).reshape(4, 8)
    np.testing.assert_array_equal(block[0, :7], data[4])
    assert not block[0, 7] and not block[1:].any()


def test_streamed_into_a_small_buffer_is_the_same_bytes():
    data = np.random.default_rng(0).standard_normal((48, 48)).astype(np.float32)
    whole = codec.encode_bytes(G, _chunk(data, (0, 0), G))
    for size in (G.encoded, 2 * G.encoded + 5, 100 * G.encoded):
        buf = np.empty(size, np.uint8)
        pieces = [bytes(p) for p in codec.encode(G, _chunk(data, (0, 0), G), buf)]
        assert b"".join(pieces) == whole


def test_encode_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="cannot hold elements"):
        codec.encode_bytes(G, np.zeros((33, 48), np.float32))
    with pytest.raises(ValueError, match="buffer"):
        list(codec.encode(G, np.zeros((32, 48), np.float32), np.empty(10, np.uint8)))


@st.composite
def _cases(draw):
    ndim = draw(st.integers(0, 3))
    inner = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
    chunk = tuple(i * draw(st.integers(1, 3)) for i in inner)
    shape = tuple(draw(st.integers(1, 2 * c + 1)) for c in chunk)
    lo = tuple(draw(st.integers(0, s - 1)) for s in shape)
    hi = tuple(draw(st.integers(lo_ + 1, s)) for lo_, s in zip(lo, shape))
    dtype = draw(st.sampled_from(["float32", "int8", "float64", "bool", "bfloat16"]))
    return TensorEntry(dtype, shape, chunk, inner), Box(lo, tuple(h - lo_ for lo_, h in zip(lo, hi)))


@settings(max_examples=60, deadline=None)
@given(_cases())
def test_round_trip(case):
    e, want = case
    g = codec.geometry(e)
    data = (np.arange(max(1, np.prod(e.shape)), dtype=np.int64) % 97).astype(g.dtype).reshape(e.shape)
    dst = np.zeros(want.shape, g.dtype)
    for piece in read_plan(e.shape, e.chunk_shape, want):
        obj = codec.encode_bytes(g, _chunk(data, piece.chunk, g))
        least, most = g.bounds(piece.chunk)
        assert least == len(obj) <= most
        _decode(g, obj, piece.chunk, want, dst)
    np.testing.assert_array_equal(dst, data[want.slices()])


# ------------------------------------------------------------------ defects


def _with_index(obj: bytes, rows: list[list[int]] | np.ndarray, crc: bool = True) -> bytes:
    raw = np.asarray(rows, "<u8").tobytes()
    return obj[:-G.index_bytes] + raw + struct.pack("<I", google_crc32c.value(raw) ^ (0 if crc else 1))


def _rows() -> np.ndarray:
    _, obj = _object((0, 0))
    return codec.decode_index(G, obj[-G.index_bytes:], WHERE).copy()


def _refused(obj: bytes, says: str) -> str:
    want = Box((0, 0), (32, 48))
    with pytest.raises(CorruptCheckpointError) as info:
        _decode(G, obj, (0, 0), want, np.zeros(want.shape, np.float32))
    msg = str(info.value)
    assert msg.startswith(WHERE + ", ") and says in msg, msg
    return msg


def test_index_crc():
    _refused(_with_index(_object((0, 0))[1], _rows(), crc=False), "shard index fails its CRC-32C checksum")


def test_index_cut_short():
    with pytest.raises(CorruptCheckpointError, match="the shard index is cut short"):
        codec.decode_index(G, b"\0" * (G.index_bytes - 1), WHERE)


def test_missing_inner_chunk():
    rows = _rows()
    rows[6] = codec.EMPTY
    _refused(_with_index(_object((0, 0))[1], rows), "inner chunk (1, 2), is missing (never written)")


def test_empty_marker_outside_the_wanted_box_is_not_read():
    rows = _rows()
    rows[7] = codec.EMPTY
    dst = np.zeros((16, 12), np.float32)
    data, obj = _object((0, 0))
    _decode(G, _with_index(obj, rows), (0, 0), Box((0, 0), (16, 12)), dst)
    np.testing.assert_array_equal(dst, data[:16, :12])


@pytest.mark.parametrize("kind", ["length", "past the data", "huge offset"])
def test_bad_entry(kind):
    rows = _rows()
    if kind == "length":
        rows[2, 1] = G.encoded - 4
    elif kind == "past the data":
        rows[2, 0] = 8 * G.encoded - 1
    else:
        rows[2, 0] = 2**64 - 2
    msg = _refused(_with_index(_object((0, 0))[1], rows), "inner chunk (0, 2), is malformed (truncated or damaged): index entry")
    assert f"where {G.encoded} bytes inside the first {8 * G.encoded} are expected" in msg


def test_data_region_smaller_than_one_inner_chunk():
    rows = _rows()
    obj = _with_index(_object((0, 0))[1], rows)
    _refused(obj[:10] + obj[-G.index_bytes:], "inner chunk (0, 0), is malformed")


@pytest.mark.parametrize("shift", [0, G.encoded // 2])
def test_overlapping_entries(shift):
    rows = _rows()
    rows[5, 0] = rows[1, 0] + shift
    _refused(_with_index(_object((0, 0))[1], rows), "inner chunks (0, 1) and (1, 1), are malformed (damaged or forged)")


def test_any_order_without_overlap_is_read():
    data, obj = _object((0, 0))
    rows = _rows()
    a, b = obj[:G.encoded], obj[G.encoded:2 * G.encoded]
    swapped = b + a + obj[2 * G.encoded:]
    rows[[0, 1], 0] = rows[[1, 0], 0]
    dst = np.zeros((32, 48), np.float32)
    _decode(G, _with_index(swapped, rows), (0, 0), Box((0, 0), (32, 48)), dst)
    np.testing.assert_array_equal(dst, data[:32])


def test_inner_chunk_crc_names_the_inner_chunk():
    _, obj = _object((0, 0))
    at = 6 * G.encoded + 100
    bad = obj[:at] + bytes([obj[at] ^ 1]) + obj[at + 1:]
    _refused(bad, "inner chunk (1, 2), fails its CRC-32C checksum: the stored data is corrupt")


def test_runs_group_contiguous_inner_chunks_up_to_the_buffer():
    rows = _rows()
    g = G
    index = codec.decode_index(g, _with_index(_object((0, 0))[1], rows)[-g.index_bytes:], WHERE)
    reads = codec.plan_reads(g, index, 8 * g.encoded, (0, 0), Box((0, 0), (32, 48)), 3, WHERE)
    assert reads.runs == [(0, 0, 3), (3 * g.encoded, 3, 6), (6 * g.encoded, 6, 8)]
    assert reads.most == 3 * g.encoded
