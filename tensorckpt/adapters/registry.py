"""Framework objects in a state <-> plain state dicts (spec: "Objects").

A state given to ``save``/``load`` may hold, at any depth, objects that are
not tensors or data: a ``torch.nn.Module``, an optimizer, an LR scheduler, a
dataloader, :func:`tensorckpt.rng_state`. An *adapter* (:class:`~.base.Adapter`)
turns such an object into a plain state (dicts of tensors and data) when
saving, says what to read for it when loading, and puts the loaded state back
into it.

Which adapter an object gets is decided here, in this order: adapters the
user registered (:func:`register`, the latest first), then the built-in ones
in the order of :data:`BUILTINS` (the first whose type matches wins), then the
generic one (anything with ``state_dict()`` and ``load_state_dict()``). The
engines call :func:`for_save` and :func:`for_load`. A new built-in adapter is
a module that imports :mod:`.base` and one line in :data:`BUILTINS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

from ..data import ResumableSampler, SamplerAdapter
from ..format.keys import flat_key
from ..format.metadata import RootMetadata
from .base import Adapter, AnyAdapter, Context, MemoAdapter, Stored, Target
from .names import Renamed
from .optimizer import OptimizerAdapter
from .per_rank import PerRank, PerRankAdapter
from .rng import RNGAdapter, RNGState
from .sharded import is_tensor_leaf
from .torch_objects import ModuleAdapter, SchedulerAdapter

__all__ = ["BUILTINS", "Adapter", "AnyAdapter", "Context", "MemoAdapter", "Stored", "Target", "adapter_for", "for_load", "for_save", "register"]

BUILTINS: tuple[tuple[type | tuple[type, ...], AnyAdapter], ...] = (
    # first match wins; the types are disjoint today, specific ones would go first
    (ResumableSampler, SamplerAdapter()),
    (PerRank, PerRankAdapter()),
    (RNGState, RNGAdapter()),
    (torch.optim.Optimizer, OptimizerAdapter()),
    (torch.optim.lr_scheduler.LRScheduler, SchedulerAdapter()),
    ((torch.nn.Module, Renamed), ModuleAdapter()),
)

_USER: list[tuple[Callable[[object], bool], AnyAdapter]] = []  # register(): the latest first


def register(match: type | tuple | Callable[[object], bool], adapter: AnyAdapter) -> None:
    """Use ``adapter`` for objects that are instances of ``match`` (a type or
    tuple of types) or for which ``match(obj)`` is true. Later registrations
    take precedence over earlier ones and over the built-ins, so users can
    override them."""
    pred = (lambda o, t=match: isinstance(o, t)) if isinstance(match, (type, tuple)) else match
    _USER.insert(0, (pred, adapter))


def adapter_for(obj: object) -> AnyAdapter | None:
    """The adapter of ``obj``, or None for tensors, data and plain containers."""
    if obj is None or is_tensor_leaf(obj) or isinstance(obj, (Mapping, str, bytes, int, float, bool, list, tuple)):
        return None
    for pred, adapter in _USER:
        if pred(obj):
            return adapter
    for types, adapter in BUILTINS:
        if isinstance(obj, types):
            return adapter
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return GENERIC
    return None


class _Generic:
    """Anything with ``state_dict()`` / ``load_state_dict()`` (torchdata's
    ``StatefulDataLoader``, user classes)."""

    def save_state(self, obj: Any, ctx: Context) -> Mapping:
        return obj.state_dict()

    def load_target(self, obj: Any, stored: Stored, ctx: Context) -> Mapping:
        return obj.state_dict()

    def apply(self, obj: Any, loaded: Mapping, ctx: Context) -> None:
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
    memos: list[tuple] = []  # per object: () or (memo,), the extra argument of its apply
    for path, obj, adapter in found:
        target = adapter.load_target(obj, _stored(index, path), ctx)
        if isinstance(target, Target):
            _set(plain, path, target.state)
            memos.append((target.memo,))
        else:
            _set(plain, path, target)
            memos.append(())
    object_paths = {path for path, _, _ in found}

    def finish(filled: MutableMapping) -> None:
        for (path, obj, adapter), memo in zip(found, memos):
            adapter.apply(obj, _get(filled, path), ctx, *memo)
        _copy_values(filled, state, (), object_paths)

    return plain, finish


# ----------------------------------------------------------------- tree walking


def _objects(node: Mapping, prefix: tuple[str, ...]) -> list[tuple[tuple[str, ...], object, AnyAdapter]]:
    """The adapted objects of the tree, sorted by key path: objects whose
    ``state_dict()`` / ``load_state_dict()`` run collectives must be handled
    in the same order on every rank, whatever the order of each rank's dicts."""
    return sorted(_find(node, prefix), key=lambda found: tuple(map(str, found[0])))


def _find(node: Mapping, prefix: tuple[str, ...]) -> list[tuple[tuple[str, ...], object, AnyAdapter]]:
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


def _set(tree: MutableMapping, path: tuple[str, ...], value: object) -> None:
    for name in path[:-1]:
        tree = tree[name]
    tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...]) -> Any:
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

