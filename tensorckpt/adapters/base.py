"""What every adapter shares: the :class:`Adapter` protocol (and
:class:`MemoAdapter`, whose ``apply`` gets a memo from ``load_target``) and
the records passed to them (:class:`Context`, :class:`Stored`, :class:`Target`).

An adapter module (``torch_objects``, ``optimizer``, ``rng``, ``per_rank``,
the sampler in ``tensorckpt.data``) imports only this module, never the
registry; the registry (:mod:`.registry`) imports the adapters and lists the
built-in ones in one place. So no adapter module and the registry import each
other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..format.keys import flat_key
from ..format.metadata import TensorEntry


@dataclass(frozen=True)
class Context:
    """What an adapter may look at besides its object: the whole state (an
    optimizer finds its parameters' names in the modules beside it), and this
    process's rank and world size; for a load, its ``strict`` and ``partial``."""

    state: Mapping
    rank: int = 0
    world: int = 1
    strict: bool = True  # load(strict=...): name mismatches are errors
    partial: bool = False  # load(partial=...): the checkpoint may hold more than the state names


@dataclass(frozen=True)
class Stored:
    """The part of a checkpoint under one object's key: tensor entries and
    values by flat key relative to the object (``"layers.0.weight"``,
    ``"state/fc.weight/exp_avg"``)."""

    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    values: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Target:
    """``load_target``'s answer when ``apply`` needs to know more than the
    filled state (e.g. what the checkpoint held, since a target may ask for
    keys that are not stored, so that load reports them missing): ``state``
    is the plain state to load into; ``memo`` is handed back to ``apply`` as
    its fourth argument (:class:`MemoAdapter`). Nothing is written onto the
    user's object."""

    state: Mapping
    memo: object


class Adapter(Protocol):
    """Turns one kind of object into a plain state and back. ``save`` calls
    ``save_state`` once per object; ``load`` calls ``load_target`` on every
    rank (before any tensor is read), then, once the target is filled,
    ``apply``. Objects are visited in key-path order on every rank."""

    def save_state(self, obj: Any, ctx: Context) -> Mapping:
        """The plain state to save for ``obj``."""

    def load_target(self, obj: Any, stored: Stored, ctx: Context) -> Mapping:
        """The plain state to load into for ``obj`` (its tensors say which
        shape, dtype and shard they want); ``stored`` is what the checkpoint
        holds under the object's key."""

    def apply(self, obj: Any, loaded: Mapping, ctx: Context) -> None:
        """Put the loaded plain state (``load_target``'s, filled) into ``obj``."""


class MemoAdapter(Protocol):
    """An :class:`Adapter` whose ``apply`` needs to know what ``load_target``
    saw: ``load_target`` returns a :class:`Target` and ``apply`` receives its
    memo (the built-in RNG, per-rank and sampler adapters)."""

    def save_state(self, obj: Any, ctx: Context) -> Mapping: ...

    def load_target(self, obj: Any, stored: Stored, ctx: Context) -> Target: ...

    def apply(self, obj: Any, loaded: Mapping, ctx: Context, memo: Any) -> None: ...


AnyAdapter = Adapter | MemoAdapter


def key_in_state(obj: object, state: Mapping) -> str:
    """The flat key under which ``obj`` sits in ``state`` (for messages)."""
    path = _path_of(obj, state, ())
    return flat_key(path) if path else type(obj).__name__


def _path_of(obj: object, node: Mapping, prefix: tuple) -> tuple | None:
    for k, v in node.items():
        if v is obj:
            return (*prefix, k)
        if isinstance(v, Mapping):
            found = _path_of(obj, v, (*prefix, k))
            if found:
                return found
    return None
