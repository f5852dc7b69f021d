"""Reader of format 1.1: 1.0 plus the optional root member ``save_stats``
(spec/format-v1.md 9.7), per-rank phase times and bytes of the save.

It is informational; if present it must have the form of 9.7 (9.5 rule 6),
else the checkpoint is corrupt. Unknown phases and members inside it are
kept and ignored.
"""

from __future__ import annotations

from dataclasses import replace

from ...errors import CorruptCheckpointError
from ..metadata import MAX_INT, RootMetadata, SaveStatsRecord, _obj
from . import v1_0

VERSION = (1, 1)


def read(meta: dict, where: str) -> RootMetadata:
    """``attributes.tensorckpt`` of a root of format 1.1 or later."""
    root = v1_0.read(meta, where)
    stats = save_stats(meta.get("save_stats"), root.world_size, where)
    return root if stats is None else replace(root, save_stats=stats)


def save_stats(doc: object, world: int, where: str) -> SaveStatsRecord | None:
    """Validate the optional ``save_stats`` member (9.7): per-phase lists of
    ``world_size`` finite non-negative seconds, and bytes written per rank.
    Unknown phases and members are kept and ignored."""
    if doc is None:
        return None
    what = f"{where}: save_stats"
    doc = _obj(doc, what)
    seconds = _obj(doc.get("seconds", {}), f"{what}.seconds")
    for phase, times in seconds.items():
        if not (isinstance(times, list) and len(times) == world and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1e9 for x in times
        )):
            raise CorruptCheckpointError(f"{what}.seconds[{phase!r}] must list {world} non-negative numbers, one per rank")
    written = doc.get("bytes_written", [])  # not [0] * world: world_size is untrusted too
    if "bytes_written" in doc and not (isinstance(written, list) and len(written) == world and all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_INT for x in written
    )):
        raise CorruptCheckpointError(f"{what}.bytes_written must list {world} non-negative integers, one per rank")
    return SaveStatsRecord.from_json(doc)
