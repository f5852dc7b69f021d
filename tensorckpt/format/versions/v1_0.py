"""Reader of format 1.0 (spec/format-v1.md 9.2-9.5): the core root members.

``format_version``, ``must_understand``, ``library_version``, ``created``,
``world_size``, ``user_metadata``, ``tensors`` and ``values``. Members it
does not know are ignored (9.2), among them ``save_stats``, which 1.1 added:
a 1.0 reader given a newer root reads every key and value of it.
"""

from __future__ import annotations

from ...errors import CorruptCheckpointError, UnsupportedVersionError
from ..metadata import (
    KNOWN_EXTENSIONS,
    RootMetadata,
    _check_key,
    _check_tree,
    _obj,
    parse_tensor_entry,
)

VERSION = (1, 0)


def read(meta: dict, where: str) -> RootMetadata:
    """``attributes.tensorckpt`` of a 1.x root, as 1.0 defines it."""
    must = meta.get("must_understand", [])
    if not isinstance(must, list) or not all(isinstance(m, str) for m in must):
        raise CorruptCheckpointError(f"{where}: must_understand must be a list of strings")
    unknown = [m for m in must if m not in KNOWN_EXTENSIONS]
    if unknown:
        raise UnsupportedVersionError(
            f"{where}: the checkpoint needs extensions this tensorckpt does not implement: "
            f"{', '.join(unknown)}; upgrade tensorckpt"
        )
    tensors_doc = _obj(meta.get("tensors"), f"{where}: tensors")
    values = _obj(meta.get("values", {}), f"{where}: values")
    tensors = {}
    for key, entry in tensors_doc.items():
        _check_key(key, where)
        tensors[key] = parse_tensor_entry(entry, f"{where}: tensors[{key!r}]")
    for key in values:
        _check_key(key, where)
        if key in tensors:
            raise CorruptCheckpointError(f"{where}: key {key!r} is both a tensor and a value")
    _check_tree([*tensors, *values], where)
    user = _obj(meta.get("user_metadata", {}), f"{where}: user_metadata")
    world = meta.get("world_size", 1)
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise CorruptCheckpointError(f"{where}: world_size must be a positive integer, got {world!r}")
    for name in ("library_version", "created"):
        if not isinstance(meta.get(name, ""), str):
            raise CorruptCheckpointError(f"{where}: {name} must be a string")
    return RootMetadata(
        tensors=tensors,
        values=values,
        format_version=meta["format_version"],
        library_version=meta.get("library_version", ""),
        created=meta.get("created", ""),
        world_size=world,
        user_metadata=user,
        must_understand=tuple(must),
    )
