"""Zarr v3 arrays through TensorStore: the array metadata tensorckpt writes
(spec section "Arrays") and asynchronous open, write and read."""

from __future__ import annotations

import functools
import math
import sys

import numpy as np
import tensorstore as ts

from ..errors import CorruptCheckpointError
from ..format import dtypes
from ..format.metadata import ATTRIBUTE, TensorEntry, dumps
from ..layout.boxes import Box
from . import codec
from .location import CONTEXT, SYNC_CONTEXT, Location

SYNC_OBJECT_BYTES = 4 << 20  # stored objects from this size on are synced as they are written

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
    d = dtypes.BY_TORCH[entry.dtype]
    big = math.prod(entry.chunk_shape) * d.itemsize >= SYNC_OBJECT_BYTES
    return ts.open(spec, context=SYNC_CONTEXT if big else CONTEXT, write=True)


def open_read(loc: Location, key: str, entry: TensorEntry) -> ts.Future:
    """Open array ``key`` for reading, with the metadata its index entry
    implies. The caller has checked the stored ``zarr.json`` against it
    (check_array_metadata), so TensorStore never parses a stored
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


# ----------------------------------------------------------------- array metadata


def check_array_metadata(doc: object, entry: TensorEntry, where: str) -> None:
    """Check an array's ``zarr.json`` against its index entry, as spec
    section 7 requires: exactly the members tensorckpt writes, where a member
    equal to its Zarr default may be omitted, ``dimension_names`` and
    ``must_understand: false`` extensions are ignored, and only
    ``attributes.tensorckpt.dtype`` of the attributes is checked."""
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: not a JSON object")
    want = {"zarr_format": 3, "node_type": "array", **zarr_metadata(entry)}
    if doc.get("storage_transformers", []) != []:
        raise CorruptCheckpointError(f"{where}: storage_transformers are not allowed")
    got = {
        k: v for k, v in doc.items()
        if k not in ("dimension_names", "storage_transformers")
        and not (isinstance(v, dict) and v.get("must_understand") is False and k not in want)
    }
    _fill_defaults(got, dtypes.BY_TORCH[entry.dtype].itemsize)
    attrs = got.get("attributes")
    if isinstance(attrs, dict) and isinstance(attrs.get("tensorckpt"), dict):
        got["attributes"] = {"tensorckpt": {"dtype": attrs["tensorckpt"].get("dtype")}}
    if _same(got.get("fill_value"), want["fill_value"], numbers=True):
        got["fill_value"] = want["fill_value"]  # 0 and 0.0 are the same JSON number
    for member in sorted(want.keys() | got.keys()):
        if member not in want:
            raise CorruptCheckpointError(f"{where}: unexpected member {member!r}")
        if member not in got:
            raise CorruptCheckpointError(f"{where}: member {member!r} is missing")
        if not _same(got[member], want[member]):
            raise CorruptCheckpointError(
                f"{where}: {member} is {_clip(got[member])} but the checkpoint index implies {_clip(want[member])}"
            )


def _fill_defaults(doc: dict, itemsize: int) -> None:
    """Put back the members Zarr lets a writer omit (spec section 7), where
    the documents around them have the expected shape."""
    enc = doc.get("chunk_key_encoding")
    if isinstance(enc, dict) and enc.get("name") == "default" and "configuration" not in enc:
        doc["chunk_key_encoding"] = {**enc, "configuration": {"separator": "/"}}
    codecs = doc.get("codecs")
    if not (isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict)):
        return
    cfg = codecs[0].get("configuration")
    if not isinstance(cfg, dict):
        return
    cfg = {"index_location": "end", **cfg}
    inner = cfg.get("codecs")
    if itemsize == 1 and isinstance(inner, list) and inner and inner[0] == {"name": "bytes"}:
        cfg["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}, *inner[1:]]
    doc["codecs"] = [{**codecs[0], "configuration": cfg}]


def _same(a: object, b: object, numbers: bool = False) -> bool:
    """JSON equality that tells true from 1, and (unless ``numbers``) 1 from 1.0."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], numbers) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y, numbers) for x, y in zip(a, b))
    if numbers and type(a) in (int, float) and type(b) in (int, float):
        return a == b
    return type(a) is type(b) and a == b


def _clip(v: object, limit: int = 120) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[:limit] + "..."
