"""Zarr v3 arrays through TensorStore: asynchronous open, write and read of
the arrays whose metadata :mod:`tensorckpt.format.arrays` defines (spec
section "Arrays"), and the bounds on a stored object's size."""

from __future__ import annotations

import functools
import math
import sys

import numpy as np
import tensorstore as ts

from ..format.arrays import zarr_metadata
from ..format.metadata import TensorEntry, dumps
from ..layout.boxes import Box
from . import codec
from .location import CONTEXT, SYNC_CONTEXT, Location

SYNC_OBJECT_BYTES = 4 << 20  # stored objects TensorStore writes from this size on are synced as they are written


def _spec(loc: Location, key: str) -> dict:
    return {"driver": "zarr3", "kvstore": loc.kvstore(key)}


@functools.lru_cache(maxsize=1 << 16)
def zarr_json(entry: TensorEntry) -> bytes:
    """The bytes of the array's ``zarr.json`` (cached: entries are immutable,
    and a save that reuses its plan writes the same ones again)."""
    return dumps({"zarr_format": 3, "node_type": "array", **zarr_metadata(entry)})


def open_write(loc: Location, key: str, entry: TensorEntry) -> ts.Future:
    """Open array ``key`` for writing chunks without touching its ``zarr.json``
    (written separately, by one rank). Every chunk is stored even when it
    equals the fill value, so a missing chunk always means missing data."""
    spec = _spec(loc, key) | {
        "metadata": zarr_metadata(entry),
        "assume_metadata": True,
        "store_data_equal_to_fill_value": True,
    }
    d = entry.dtype_info
    big = math.prod(entry.chunk_shape) * d.itemsize >= SYNC_OBJECT_BYTES
    return ts.open(spec, context=SYNC_CONTEXT if big else CONTEXT, write=True)


def open_read(loc: Location, key: str, entry: TensorEntry) -> ts.Future:
    """Open array ``key`` for reading, with the metadata its index entry
    implies. The caller has checked the stored ``zarr.json`` against it
    (format.arrays.check_array_metadata), so TensorStore never parses a stored
    document; a missing chunk is an error, never read as the fill value."""
    spec = _spec(loc, key) | {"metadata": zarr_metadata(entry), "assume_metadata": True, "fill_missing_data_reads": False}
    return ts.open(spec, context=CONTEXT, read=True)


def object_bytes_bounds(entry: TensorEntry, pos: tuple[int, ...]) -> tuple[int, int]:
    """The least and the most bytes the stored object at grid position ``pos``
    can hold (spec section 7): every inner chunk that intersects the array,
    encoded (elements + CRC-32C), then the index (16 bytes per inner chunk of
    the shard, then a CRC-32C); at most every inner chunk of the shard. A
    reader refuses an object outside these bounds before reading it."""
    return codec.geometry(entry).bounds(pos)


# ----------------------------------------------------------------- small arrays
#
# A stored object that is one inner chunk (every tensor up to the inner chunk
# size, ~256 KiB) is encoded here and written as plain bytes through the
# kvstore, in one batch with the others, instead of opening a TensorStore
# array per tensor: thousands of small tensors save several times faster.
# The bytes are exactly what TensorStore writes (tests/test_small_writes.py).


def whole_chunk(entry: TensorEntry, box: Box) -> tuple[int, ...] | None:
    """The grid position of the stored object that ``box`` fills exactly
    (clipped at the array's edge), if that object holds a single inner
    chunk; else None."""
    if sys.byteorder != "little" or entry.inner_chunk_shape != entry.chunk_shape or box.numel == 0:
        return None
    pos = []
    for o, n, c, s in zip(box.offset, box.shape, entry.chunk_shape, entry.shape):
        if o % c or o + n != min(o + c, s):
            return None
        pos.append(o // c)
    return tuple(pos)


def chunk_key(pos: tuple[int, ...]) -> str:
    """The object key of chunk ``pos`` (default chunk key encoding, "/")."""
    return "/".join(("c", *map(str, pos)))


def encode_whole_chunk(entry: TensorEntry, data: np.ndarray) -> bytes:
    """The stored object of one chunk that is one inner chunk: the chunk (data
    padded with the zero fill value to the chunk shape) in C order,
    little-endian, then its CRC-32C; then the shard index (offset 0, length)
    and the index's CRC-32C (spec section "Arrays"; :mod:`.codec`)."""
    return codec.encode_bytes(codec.geometry(entry), data)

