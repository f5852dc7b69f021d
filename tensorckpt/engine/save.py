"""Synchronous save: plan -> create arrays -> write every chunk concurrently ->
sync -> commit. Single process for now; the multi-writer protocol builds on
the same plan (one writer per stored chunk)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping

import torch

from .. import __version__
from ..errors import TensorckptError, UnsupportedValueError
from ..adapters.state import Leaf, flatten
from ..format import dtypes
from ..format.keys import flat_key
from ..format.metadata import RootMetadata, TensorEntry, check_value, dumps, root_group_json
from ..layout import grid
from ..storage import arrays, commit, kv, location

_GROUP_JSON = dumps({"zarr_format": 3, "node_type": "group", "attributes": {}})
OPTIONS = ("metadata", "shard_bytes", "inner_chunk_bytes")


def save(state: Mapping, path, *, process_group=None, overwrite: bool = False, **options) -> None:
    """Save ``state`` (a dict of tensors and JSON-able data) to ``path``.

    The checkpoint is valid only once fully written (see the spec's commit
    protocol); an existing checkpoint at ``path`` needs ``overwrite=True`` and
    stays valid until the new one replaces it atomically.

    Options: ``metadata`` (JSON-able dict kept in the checkpoint's metadata),
    ``shard_bytes`` (largest stored object, default 64 MiB),
    ``inner_chunk_bytes`` (unit of partial reads, default 2 MiB).
    """
    _check_options(options)
    _single_process(process_group)
    loc = location.parse(path)
    user = check_value(options.get("metadata") or {}, "metadata")
    if not isinstance(user, dict):
        raise UnsupportedValueError("save(metadata=...) must be a dict")
    leaves = flatten(state)
    entries = {k: plan_entry(k, leaf.value, options) for k, leaf in leaves.items() if leaf.is_tensor}
    values = {k: leaf.value for k, leaf in leaves.items() if not leaf.is_tensor}
    meta = RootMetadata(
        tensors=entries,
        values=values,
        library_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        world_size=1,
        user_metadata=user,
    )
    root_json = root_group_json(meta)
    c = commit.begin(loc, overwrite, commit.new_token())
    try:
        _write_groups(c.write_to, leaves)
        _write_arrays(c.write_to, {k: leaves[k] for k in entries}, entries)
        commit.finish(c, root_json)
    except BaseException:
        commit.abort(c)
        raise


def plan_entry(key: str, t: torch.Tensor, options: Mapping) -> TensorEntry:
    d = dtypes.for_torch(t.dtype, key)
    if t.layout != torch.strided or t.is_meta:
        raise UnsupportedValueError(f"{key!r}: only dense tensors with data can be saved (got {t.layout}, {t.device})")
    shape = tuple(t.shape)
    shard = grid.single_writer_chunks(shape, d.itemsize, options.get("shard_bytes", grid.DEFAULT_SHARD_BYTES))
    inner = grid.inner_chunks(shard, d.itemsize, options.get("inner_chunk_bytes", grid.DEFAULT_INNER_BYTES))
    return TensorEntry(d.torch_name, shape, shard, inner)


def _write_groups(loc: location.Location, leaves: Mapping[str, Leaf]) -> None:
    groups = {flat_key(leaf.path[:i]) for leaf in leaves.values() for i in range(1, len(leaf.path))}
    kv.write_many(loc, {f"{g}/zarr.json": _GROUP_JSON for g in groups})


def _write_arrays(loc: location.Location, leaves: Mapping[str, Leaf], entries: Mapping[str, TensorEntry]) -> None:
    opened = {k: arrays.create(loc, k, e) for k, e in entries.items()}
    writes = []
    for key, fut in opened.items():
        t = leaves[key].value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.numel() == 0:
            fut.result()
            continue
        writes.append((key, fut.result().write(dtypes.to_numpy(t))))
    for key, w in writes:
        try:
            w.result()
        except Exception as e:  # TensorStore raises ValueError with a status string
            raise TensorckptError(f"{loc}: writing tensor {key!r} failed: {e}") from e


def _check_options(options: Mapping) -> None:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"save() got unknown options {unknown}; known: {list(OPTIONS)}")
    for name in ("shard_bytes", "inner_chunk_bytes"):
        v = options.get(name)
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"save({name}=...) must be a positive int, got {v!r}")


def _single_process(process_group) -> None:
    import torch.distributed as dist

    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size(process_group) if dist.is_initialized() else 1
    if world > 1:
        raise NotImplementedError(
            "tensorckpt does not save from several processes yet; call save() on one rank "
            "with the full state, or pass process_group of size 1"
        )

