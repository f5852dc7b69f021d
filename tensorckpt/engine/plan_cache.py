"""The save-plan cache: a save whose tensor layout (keys, shapes, dtypes,
boxes) is the same on every rank as in the previous successful save over the
same process group, with the same chunking options, reuses that save's plan
(engine/save.py's module docstring).

One :class:`PlanCache` belongs to one process group: every rank keeps the
layout it last saved successfully; rank 0 also keeps everyone's local plans
and the global plan. Who owns which cache:

- a synchronous :func:`tensorckpt.save` over a group uses :func:`for_group`,
  the one cache of that group object (held weakly: it goes with the group;
  keyed by the object itself, never its ``id``, so a new group never finds a
  dead group's plan);
- an :class:`~tensorckpt.AsyncSaver` owns the cache of its background group,
  and drops it in ``close()``.

:func:`clear` empties every synchronous cache (tests isolating themselves
from earlier saves in the same process; after re-creating groups by hand).
"""

from __future__ import annotations

import weakref
from typing import Any

from ..layout.plan import LocalPlan, SavePlan
from .group import group_key

Key = tuple  # (group size, shard_bytes, inner_chunk_bytes): one entry per chunking choice


def key(size: int, shard_bytes: int | None, inner_chunk_bytes: int | None) -> Key:
    """The entry of a cache that a save of ``size`` ranks with these chunking options uses."""
    return (size, shard_bytes, inner_chunk_bytes)


class PlanCache:
    """The plan cache of one process group, per chunking options (:func:`key`).

    A save reads ``layout`` (every rank) and ``plan`` (rank 0), notes rank 0's
    local plans with ``pend`` while it runs, and ``keep``s them once it has
    committed; a failed save ``forget``s the entry on every rank, so no rank
    reuses a plan another rank dropped."""

    def __init__(self) -> None:
        self._layout: dict[Key, Any] = {}  # every rank: the items it last saved successfully
        self._plans: dict[Key, tuple[list[LocalPlan], SavePlan]] = {}  # rank 0: local plans + plan
        self._pending: dict[Key, list[LocalPlan]] = {}  # rank 0: the local plans of the save in flight

    def layout(self, k: Key) -> Any:
        """This rank's items in the last successful save (None: none yet)."""
        return self._layout.get(k)

    def plan(self, k: Key) -> tuple[list[LocalPlan], SavePlan] | None:
        """Rank 0: every rank's local plan and the global plan of that save."""
        return self._plans.get(k)

    def pend(self, k: Key, plans: list[LocalPlan]) -> None:
        """Rank 0: the local plans of the save in flight (kept once it commits)."""
        self._pending[k] = plans

    def keep(self, k: Key, layout: Any, plan: SavePlan, rank0: bool) -> None:
        """The save with ``layout`` (and, on rank 0, ``plan``) committed."""
        self._layout[k] = layout
        if rank0:
            self._plans[k] = (self._pending.pop(k), plan)

    def forget(self, k: Key) -> None:
        """The save failed: drop the entry (every rank does, alike)."""
        self._layout.pop(k, None)
        self._plans.pop(k, None)
        self._pending.pop(k, None)

    def clear(self) -> None:
        """Drop every entry."""
        self._layout.clear()
        self._plans.clear()
        self._pending.clear()


_BY_GROUP: weakref.WeakKeyDictionary[object, PlanCache] = weakref.WeakKeyDictionary()
_SINGLE = PlanCache()  # torch.distributed not initialized: one process, no group


def for_group(process_group: object | None) -> PlanCache:
    """The plan cache of synchronous saves over ``process_group`` (None: the
    default group, or no group when torch.distributed is not initialized)."""
    pg = group_key(process_group)
    if pg is None:
        return _SINGLE
    cache = _BY_GROUP.get(pg)
    if cache is None:
        cache = _BY_GROUP[pg] = PlanCache()
    return cache


def clear() -> None:
    """Forget the plans of every synchronous save of this process (an
    :class:`~tensorckpt.AsyncSaver`'s own cache goes with its ``close()``)."""
    _SINGLE.clear()
    for cache in list(_BY_GROUP.values()):
        cache.clear()
