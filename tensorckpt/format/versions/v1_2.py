"""Reader of format 1.2: the root document is 1.1's, unchanged.

1.2 changed training-state keys only (spec/training-state.md 3.3, 4.2, 4.4,
5): per-parameter optimizer groups (``K/class``, ``K/group_of/<fqn>``,
``K/groups/<id>/<hparam>``) instead of ``K/param_groups``, scheduler
``K/class``, tied tensors stored once (``K/<fqn>/tied_to``). Those are keys
and values of the index, which every 1.x root reader reads; the adapters
interpret them by what is stored (the optimizer's layout is chosen in
:func:`tensorckpt.adapters.optimizer.optimizer_layout`). This module exists so
that the version has its reader, and so that a later change of the root in
1.2 has its place.
"""

from __future__ import annotations

from ..metadata import RootMetadata
from . import v1_1

VERSION = (1, 2)


def read(meta: dict, where: str) -> RootMetadata:
    """``attributes.tensorckpt`` of a root of format 1.2 or later."""
    return v1_1.read(meta, where)
