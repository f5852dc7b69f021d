"""The commit's last step in format 1.3 (spec/format-v1.md 7.1, 9.8), on the
committer once every writer reported the digests of the objects it wrote:
every array ``zarr.json`` with the checkpoint's id and its chunks' digests,
made durable, then the root document that records those documents' digests
and is sealed by its own checksum. Used by :mod:`.save` (rank 0's
``finish``) and :mod:`tensorckpt.interchange.core` (``convert``)."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np

from ..errors import TensorckptError
from ..format import metadata
from ..format.arrays import array_json, chunk_count
from ..format.metadata import MAX_NODE_JSON_BYTES, RootMetadata, TensorEntry, dumps, new_checkpoint_id, root_group_json
from ..storage import kv, location
from ..storage.backend import backend_for

Digests = dict[str, dict[tuple[int, ...], str]]  # flat key -> chunk position -> object digest (spec 7.1)


def merge(into: Digests, more: Digests) -> Digests:
    """``into`` with the digests of ``more`` (another writer's, another batch's) added."""
    for key, of_key in more.items():
        into.setdefault(key, {}).update(of_key)
    return into


def seal(loc: location.Location, meta: RootMetadata, digests: Digests) -> bytes:
    """Write every array's ``zarr.json`` with the checkpoint's id and its
    chunks' ``digests`` (spec 7.1), make them durable, and return the root
    ``zarr.json`` that commits ``meta`` (given an id here if it has none),
    with those documents' digests and its own checksum (9.8)."""
    if not meta.checkpoint_id:
        meta = replace(meta, checkpoint_id=new_checkpoint_id())
    docs = {}
    for key, e in meta.tensors.items():
        of_key = digests.get(key, {})
        order = [tuple(int(i) for i in pos) for pos in np.ndindex(*_grid(e))] if chunk_count(e) else []
        lacking = [pos for pos in order if pos not in of_key]
        if lacking:
            raise TensorckptError(f"{loc}: tensor {key!r}: no writer reported chunk {lacking[0]} (a bug; nothing committed)")
        docs[f"{key}/zarr.json"] = doc = array_json(e, meta.checkpoint_id, [of_key[pos] for pos in order])
        if len(doc) > MAX_NODE_JSON_BYTES:  # ~250,000 chunks (spec 9.8): a larger tensor needs larger chunks
            raise TensorckptError(
                f"{loc}: tensor {key!r} has {len(order)} chunks, whose digests make its zarr.json larger than "
                f"readers accept ({MAX_NODE_JSON_BYTES} bytes, spec 12); save it with a larger shard_bytes"
            )
    sums = {k.removesuffix("/zarr.json"): hashlib.sha256(d).hexdigest() for k, d in docs.items()}
    meta = replace(meta, array_digests=sums)
    root = root_group_json(meta)
    _check_root_size(loc, meta, root)  # before anything more is written
    try:
        kv.write_many_async(loc, docs)()
    except OSError as err:
        raise TensorckptError(f"{loc}: writing the array metadata (zarr.json of each tensor) failed: {err}") from err
    try:
        backend_for(loc).sync(loc, set(docs))
    except OSError as err:
        raise TensorckptError(f"{loc}: making the array metadata durable failed: {err}") from err
    return root


def _check_root_size(loc: location.Location, meta: RootMetadata, root: bytes) -> None:
    """Refuse a root ``zarr.json`` larger than readers accept (spec 12), saying
    what makes it large: the index (one entry and one digest per tensor) or
    the values."""
    cap = metadata.MAX_ROOT_JSON_BYTES
    if len(root) <= cap:
        return
    values = len(dumps(meta.values))
    raise TensorckptError(
        f"{loc}: the root zarr.json would be {len(root)} bytes, more than the {cap} readers accept (spec 12): "
        f"{len(meta.tensors)} tensors (about {(len(root) - values) // max(1, len(meta.tensors))} bytes of index each) "
        f"and {len(meta.values)} values ({values} bytes of JSON); nothing was committed. Save fewer, larger tensors "
        "(e.g. stack per-layer ones) or store large values as tensors"
    )


def _grid(e: TensorEntry) -> tuple[int, ...]:
    """Chunks of ``e``'s grid along each dimension."""
    return tuple(-(-s // c) for s, c in zip(e.shape, e.chunk_shape))
