"""Zarr v3 arrays through TensorStore: the array metadata tensorckpt writes
(spec section "Arrays") and asynchronous open, write and read."""

from __future__ import annotations

import tensorstore as ts

from ..format import dtypes
from ..format.metadata import ATTRIBUTE, TensorEntry, dumps
from .location import CONTEXT, Location

_BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC = {"name": "crc32c"}


def zarr_metadata(entry: TensorEntry) -> dict:
    """The array's ``zarr.json`` content (without ``zarr_format``/``node_type``)."""
    d = dtypes.BY_TORCH[entry.dtype]
    return {
        "shape": list(entry.shape),
        "data_type": d.zarr_name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(entry.chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": d.fill_value,
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(entry.inner_chunk_shape),
                    "codecs": [_BYTES, _CRC],
                    "index_codecs": [_BYTES, _CRC],
                    "index_location": "end",
                },
            }
        ],
        "attributes": {ATTRIBUTE: {"dtype": entry.dtype}},
    }


def _spec(loc: Location, key: str) -> dict:
    return {"driver": "zarr3", "kvstore": loc.kvstore(key)}


def zarr_json(entry: TensorEntry) -> bytes:
    """The bytes of the array's ``zarr.json``."""
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
    return ts.open(spec, context=CONTEXT, write=True)


def open_read(loc: Location, key: str, entry: TensorEntry) -> ts.Future:
    """Open array ``key`` for reading. Its ``zarr.json`` must match what the
    index says tensorckpt wrote (TensorStore checks every member: shape, data
    type, chunking, codecs incl. crc32c, attributes), and a missing chunk is an
    error, never read as the fill value."""
    spec = _spec(loc, key) | {"open": True, "metadata": zarr_metadata(entry), "fill_missing_data_reads": False}
    return ts.open(spec, context=CONTEXT, read=True)
