"""Reader of format 1.3: 1.2 plus position-bound integrity (spec/format-v1.md
9.8): the root members ``checkpoint_id`` (random, one per save),
``array_digests`` (flat key -> SHA-256 of the tensor's array ``zarr.json``)
and ``checksum`` (SHA-256 of the root document itself, the document's last
member). Each array ``zarr.json`` records the checkpoint id and the digest of
every chunk (7.1), which :mod:`tensorckpt.storage.reader` checks.

The checksum over the document's bytes is checked by
:func:`tensorckpt.format.versions.read_root` for every root that has one,
whatever version it claims (a flipped bit in ``format_version`` must not
turn the check off); here it is required.
"""

from __future__ import annotations

from dataclasses import replace

from ...errors import CorruptCheckpointError
from ..metadata import CHECKPOINT_ID, DIGEST_HEX, RootMetadata, _obj
from . import v1_2

VERSION = (1, 3)


def read(meta: dict, where: str) -> RootMetadata:
    """``attributes.tensorckpt`` of a root of format 1.3 or later."""
    root = v1_2.read(meta, where)
    ident = meta.get("checkpoint_id")
    if not isinstance(ident, str) or not CHECKPOINT_ID.fullmatch(ident):
        raise CorruptCheckpointError(f"{where}: checkpoint_id must be 32 lower-case hex digits, got {str(ident)[:80]!r}")
    if not isinstance(meta.get("checksum"), str):
        raise CorruptCheckpointError(f"{where}: a root of format 1.3 must end with its checksum member")
    digests = _obj(meta.get("array_digests"), f"{where}: array_digests")
    if digests.keys() != root.tensors.keys():
        extra = sorted(digests.keys() - root.tensors.keys())[:3]
        lacking = sorted(root.tensors.keys() - digests.keys())[:3]
        raise CorruptCheckpointError(
            f"{where}: array_digests must name exactly the tensors (extra: {extra}, lacking: {lacking})"
        )
    for key, d in digests.items():
        if not isinstance(d, str) or not DIGEST_HEX.fullmatch(d):
            raise CorruptCheckpointError(f"{where}: array_digests[{key!r}] must be 64 lower-case hex digits")
    return replace(root, checkpoint_id=ident, array_digests=dict(digests))
