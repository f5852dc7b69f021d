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

import threading
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

    A save reads ``layout`` (every rank) and ``plan`` (rank 0) and, once it
    has committed, ``keep``s its layout (every rank) with its local plans and
    plan (rank 0) in one step, so two saves running at once in one process
    (threads) leave a consistent entry, the last one's; a failed save
    ``forget``s the entry on every rank, so no rank reuses a plan another
    rank dropped."""

    def __init__(self) -> None:
        self._layout: dict[Key, Any] = {}  # every rank: the items it last saved successfully
        self._plans: dict[Key, tuple[list[LocalPlan], SavePlan]] = {}  # rank 0: local plans + plan
        self._lock = threading.Lock()

    def layout(self, k: Key) -> Any:
        """This rank's items in the last successful save with ``k`` (None: none)."""
        return self._layout.get(k)

    def plan(self, k: Key) -> tuple[list[LocalPlan], SavePlan] | None:
        """Rank 0: every rank's local plan and the global plan of that save."""
        return self._plans.get(k)

    def keep(self, k: Key, layout: Any, plan: SavePlan, local_plans: list[LocalPlan] | None) -> None:
        """The save with ``layout`` committed; on rank 0 (``local_plans`` given)
        also its local plans (without values) and ``plan``."""
        with self._lock:
            self._layout[k] = layout
            if local_plans is not None:
                self._plans[k] = (local_plans, plan)

    def forget(self, k: Key) -> None:
        """The save failed: drop the entry (every rank does, alike)."""
        with self._lock:
            self._layout.pop(k, None)
            self._plans.pop(k, None)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._layout.clear()
            self._plans.clear()


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
