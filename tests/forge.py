"""Forging checkpoints in tests as an attacker would: after editing a root or
array ``zarr.json`` of a format 1.3 checkpoint, :func:`reseal` recomputes what
binds them (spec 9.8: the array documents' chunk digests and checkpoint id,
the root's ``array_digests`` and ``checksum``). The checksums are integrity,
not authenticity: a forged checkpoint that is resealed must still be refused
by the checks behind them, which the tests that use this exercise."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tensorckpt.format.arrays import chunk_count
from tensorckpt.format import metadata
from tensorckpt.format.metadata import ATTRIBUTE, parse_tensor_entry, seal
from tensorckpt.storage import arrays, codec

MOST_DIGESTS = 100_000  # a forged grid of more chunks keeps an array document without them


def reseal(path: Path, root: dict | None = None) -> None:
    """Write ``root`` (default: the stored one) as ``path``'s root
    ``zarr.json``, its arrays' documents and its checksum made to agree."""
    path = Path(path)
    if root is None:
        root = json.loads((path / "zarr.json").read_bytes())
    attrs = root.get("attributes") if isinstance(root, dict) else None
    meta = attrs.get(ATTRIBUTE) if isinstance(attrs, dict) else None
    if not isinstance(meta, dict) or "checksum" not in meta or not isinstance(meta.get("tensors"), dict):
        (path / "zarr.json").write_text(json.dumps(root))  # before 1.3, or broken past sealing: as it is
        return
    meta.pop("checksum")
    sums = {}
    for key, entry_doc in meta["tensors"].items():
        f = path / key / "zarr.json"
        if not f.is_file():
            continue
        try:
            doc = json.loads(f.read_bytes())
            entry = _parse_entry(entry_doc, key)
        except Exception:  # noqa: BLE001 - a document the test broke on purpose: only its digest is recorded
            sums[key] = hashlib.sha256(f.read_bytes()).hexdigest()
            continue
        attrs = doc.get("attributes", {}).get(ATTRIBUTE) if isinstance(doc.get("attributes"), dict) else None
        if isinstance(attrs, dict) and chunk_count(entry) <= MOST_DIGESTS:
            attrs["checkpoint_id"] = meta["checkpoint_id"]
            attrs["chunk_digests"] = [_digest(path / key, entry, pos) for pos in _grid(entry)]
            f.write_text(json.dumps(doc))
        sums[key] = hashlib.sha256(f.read_bytes()).hexdigest()
    meta["array_digests"] = sums
    meta["checksum"] = "0" * 64
    (path / "zarr.json").write_bytes(seal(json.dumps(root, ensure_ascii=False).encode()))


def _parse_entry(doc: object, key: str):
    """``parse_tensor_entry``, but past the size caps of spec 12 too: a
    forgery may be, and is still given digests that agree with it."""
    caps = metadata.MAX_INNER_CHUNK_BYTES, metadata.MAX_SHARD_INDEX_BYTES
    metadata.MAX_INNER_CHUNK_BYTES = metadata.MAX_SHARD_INDEX_BYTES = 2**64
    try:
        return parse_tensor_entry(doc, key)
    finally:
        metadata.MAX_INNER_CHUNK_BYTES, metadata.MAX_SHARD_INDEX_BYTES = caps


def _grid(entry) -> list[tuple[int, ...]]:
    import numpy as np

    if chunk_count(entry) == 0:
        return []
    return [tuple(int(i) for i in p) for p in np.ndindex(*[-(-s // c) for s, c in zip(entry.shape, entry.chunk_shape)])]


def _digest(array: Path, entry, pos: tuple[int, ...]) -> str:
    """The digest of the stored chunk ``pos``, or zeros where none can be made."""
    f = array / arrays.chunk_key(pos)
    g = codec.geometry(entry)
    try:
        raw = f.read_bytes()
        index = codec.decode_index(g, raw[len(raw) - g.index_bytes:], str(f))
        return codec.digest_of_crcs(b"".join(raw[at:at + 4] for _, at in codec.stored_crcs(g, index, pos)))
    except Exception:  # noqa: BLE001 - missing or damaged: no digest fits it
        return "0" * 64
