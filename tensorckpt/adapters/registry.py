"""Framework objects in a state <-> plain state dicts (spec: "Objects").

A state given to ``save``/``load`` may hold, at any depth, objects that are
not tensors or data: a ``torch.nn.Module``, an optimizer, an LR scheduler, a
dataloader, :func:`tensorckpt.rng_state`. An *adapter* turns such an object
into a plain state (dicts of tensors and data) when saving, says what to
read for it when loading, and puts the loaded state back into it.

Adapters are registered in one place (:func:`register`); the first whose
``match`` accepts an object wins, the generic one (anything with
``state_dict()`` and ``load_state_dict()``) comes last. A new framework adds
one module that calls :func:`register`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..format.keys import flat_key
from ..format.metadata import RootMetadata, TensorEntry
from .sharded import is_tensor_leaf


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


class Adapter(Protocol):
    def save_state(self, obj, ctx: Context) -> Mapping:
        """The plain state to save for ``obj``."""

    def load_target(self, obj, stored: Stored, ctx: Context) -> Mapping:
        """The plain state to load into for ``obj`` (its tensors say which
        shape, dtype and shard they want); ``stored`` is what the checkpoint
        holds under the object's key."""

    def apply(self, obj, loaded: Mapping, ctx: Context) -> None:
        """Put the loaded plain state (``load_target``'s, filled) into ``obj``."""


_ADAPTERS: list[tuple[Callable[[object], bool], Adapter]] = []
_BUILTINS_LOADED = False


def register(match: type | tuple | Callable[[object], bool], adapter: Adapter) -> None:
    """Use ``adapter`` for objects that are instances of ``match`` (a type or
    tuple of types) or for which ``match(obj)`` is true. Later registrations
    take precedence over earlier ones, so users can override built-ins."""
    _load_builtins()
    pred = (lambda o, t=match: isinstance(o, t)) if isinstance(match, (type, tuple)) else match
    _ADAPTERS.insert(0, (pred, adapter))


def adapter_for(obj) -> Adapter | None:
    if obj is None or is_tensor_leaf(obj) or isinstance(obj, (Mapping, str, bytes, int, float, bool, list, tuple)):
        return None
    _load_builtins()
    for pred, adapter in _ADAPTERS:
        if pred(obj):
            return adapter
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return GENERIC
    return None


class _Generic:
    """Anything with ``state_dict()`` / ``load_state_dict()`` (torchdata's
    ``StatefulDataLoader``, user classes)."""

    def save_state(self, obj, ctx):
        return obj.state_dict()

    def load_target(self, obj, stored, ctx):
        return obj.state_dict()

    def apply(self, obj, loaded, ctx):
        obj.load_state_dict(loaded)


GENERIC = _Generic()


def for_save(state: Mapping, ctx: Context) -> Mapping:
    """``state`` with every adapted object replaced by its plain state (the
    same object when there is none)."""
    found = _objects(state, ()) if isinstance(state, Mapping) else None
    if not found:
        return state
    out = _mirror(state)
    for path, obj, adapter in found:
        _set(out, path, adapter.save_state(obj, ctx))
    return out


def for_load(
    state: MutableMapping, index: RootMetadata, ctx: Context
) -> tuple[MutableMapping, Callable[[MutableMapping], None]]:
    """The plain target state to load into, and ``finish(plain)`` to call once
    it is filled: it applies each object's loaded state and copies the other
    loaded values back into ``state``."""
    found = _objects(state, ()) if isinstance(state, Mapping) else None
    if not found:
        return state, lambda plain: None
    plain = _mirror(state)
    for path, obj, adapter in found:
        _set(plain, path, adapter.load_target(obj, _stored(index, path), ctx))
    object_paths = {path for path, _, _ in found}

    def finish(filled: MutableMapping) -> None:
        for path, obj, adapter in found:
            adapter.apply(obj, _get(filled, path), ctx)
        _copy_values(filled, state, (), object_paths)

    return plain, finish


# ----------------------------------------------------------------- tree walking


def _objects(node: Mapping, prefix: tuple[str, ...]) -> list[tuple[tuple[str, ...], object, Adapter]]:
    """The adapted objects of the tree, sorted by key path: objects whose
    ``state_dict()`` / ``load_state_dict()`` run collectives must be handled
    in the same order on every rank, whatever the order of each rank's dicts."""
    return sorted(_find(node, prefix), key=lambda found: tuple(map(str, found[0])))


def _find(node: Mapping, prefix: tuple[str, ...]) -> list[tuple[tuple[str, ...], object, Adapter]]:
    found = []
    for name, value in node.items():
        if isinstance(value, Mapping):
            found += _find(value, prefix + (name,))
        else:
            adapter = adapter_for(value)
            if adapter is not None:
                found.append((prefix + (name,), value, adapter))
    return found


def _mirror(node: Mapping) -> dict:
    """New dicts all the way down; leaves shared."""
    return {k: _mirror(v) if isinstance(v, Mapping) else v for k, v in node.items()}


def _set(tree: MutableMapping, path: tuple[str, ...], value) -> None:
    for name in path[:-1]:
        tree = tree[name]
    tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...]):
    for name in path:
        tree = tree[name]
    return tree


def _copy_values(src: Mapping, dst: MutableMapping, prefix: tuple[str, ...], skip: set) -> None:
    for name, value in src.items():
        path = prefix + (name,)
        if path in skip:
            continue
        if isinstance(value, Mapping) and isinstance(dst.get(name), MutableMapping) and value:
            _copy_values(value, dst[name], path, skip)
        elif not isinstance(value, torch.Tensor) and not is_tensor_leaf(value):
            dst[name] = value


def _stored(index: RootMetadata, path: tuple[str, ...]) -> Stored:
    prefix = flat_key(path) + "/"
    n = len(prefix)
    return Stored(
        tensors={k[n:]: e for k, e in index.tensors.items() if k.startswith(prefix)},
        values={k[n:]: v for k, v in index.values.items() if k.startswith(prefix)},
    )


def _load_builtins() -> None:
    """Import the built-in adapter modules (they call :func:`register`)."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    from . import (
        optimizer,  # noqa: F401  (Optimizer)
        rng,  # noqa: F401  (rng_state())
        torch_objects,  # noqa: F401  (Module, LRScheduler)
    )
