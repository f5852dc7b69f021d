"""The array metadata of the format (spec section 7): the ``zarr.json`` every
array tensorckpt writes has (:func:`zarr_metadata`), and the check that a
stored one agrees with its index entry (:func:`check_array_metadata`),
done in Python before TensorStore opens the array with the checked
metadata. Since format 1.3 the document also records the checkpoint's id
and every chunk's digest (:func:`array_json`, :func:`chunk_digests`; spec
7.1). Pure: used by the writer (``storage/arrays.py``, ``engine/save.py``)
and the reader (``storage/reader.py``)."""

from __future__ import annotations

from ..errors import CorruptCheckpointError
from .metadata import ATTRIBUTE, DIGEST_HEX, TensorEntry, dumps

_BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC = {"name": "crc32c"}


def zarr_metadata(entry: TensorEntry) -> dict:
    """The array's ``zarr.json`` content (without ``zarr_format``/``node_type``)."""
    d = entry.dtype_info
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
    _fill_defaults(got, entry.itemsize)
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


# ----------------------------------------------------------- integrity (1.3)


def chunk_count(entry: TensorEntry) -> int:
    """The number of chunks of the array's grid (0 for an empty array)."""
    n = 1
    for s, c in zip(entry.shape, entry.chunk_shape):
        n *= -(-s // c)
    return n


def array_json(entry: TensorEntry, checkpoint_id: str, digests: list[str]) -> bytes:
    """The bytes of the array's ``zarr.json`` of format 1.3 (spec 7.1):
    section 7's members, with ``attributes.tensorckpt`` also holding the
    checkpoint's id and the digest of every chunk, in C order of the grid."""
    doc = {"zarr_format": 3, "node_type": "array", **zarr_metadata(entry)}
    doc["attributes"] = {ATTRIBUTE: {"dtype": entry.dtype, "checkpoint_id": checkpoint_id, "chunk_digests": digests}}
    return dumps(doc)


def chunk_digests(doc: dict, entry: TensorEntry, checkpoint_id: str, where: str) -> list[str]:
    """The chunk digests an array ``zarr.json`` of format 1.3 records (its
    document already checked by :func:`check_array_metadata`): one per chunk
    of the grid, in C order, recorded for the checkpoint ``checkpoint_id``."""
    attrs = doc["attributes"][ATTRIBUTE]
    if attrs.get("checkpoint_id") != checkpoint_id:
        raise CorruptCheckpointError(
            f"{where}: belongs to another checkpoint (checkpoint_id {str(attrs.get('checkpoint_id'))[:40]!r}, "
            f"the root's is {checkpoint_id!r}): an array directory copied or replayed from elsewhere"
        )
    digests = attrs.get("chunk_digests")
    n = chunk_count(entry)
    if not (isinstance(digests, list) and len(digests) == n
            and all(isinstance(d, str) and DIGEST_HEX.fullmatch(d) for d in digests)):
        raise CorruptCheckpointError(f"{where}: chunk_digests must list {n} digests (64 lower-case hex digits each)")
    return digests
