"""Built-in adapters for torch objects: ``nn.Module`` and
``optim.lr_scheduler.LRScheduler`` (spec: training-state.md); the optimizer's
is in :mod:`.optimizer`.

Keys under each object's own key (``model``, ``sched`` here)::

    model/<fqn>                   the module's state_dict (DTensors under FSDP2),
                                  by canonical name (no wrapper prefixes)
    model/<fqn>/tied_to           instead of model/<fqn>: the name of the
                                  tensor it is (tied weights are stored once)
    model/<prefix>_extra_state    get_extra_state(): tensors and JSON data
    sched/class                   the scheduler's class name
    sched/<member>                the scheduler's state_dict (functions left out)
"""

from __future__ import annotations

import copy
import functools
import math
import types
from collections.abc import Callable, Mapping, MutableMapping

import torch

from ..errors import IncompatibleStateError, UnsupportedValueError
from ..format import dtypes
from ..format.keys import split_flat_key
from ..format.metadata import TensorEntry, check_value
from . import meta
from .base import Context, Stored
from .names import Renamed, identity, module_of, stored_names
from .sharded import is_tensor_leaf
from .state import set_leaf

EXTRA_STATE = "_extra_state"  # torch.nn.Module's suffix for get_extra_state() keys
TIED_TO = "tied_to"  # K/<fqn>/tied_to: <fqn> is the tensor stored as K/<that name>
CLASS = "class"  # K/class: an optimizer's or scheduler's class name (format 1.2)
_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)


# ------------------------------------------------------------------ modules


class ModuleAdapter:
    """``state_dict()`` under canonical names, a tensor tied to an earlier one
    as its name; ``load_state_dict()`` after the tensors were read in place
    (the module's own load hooks and ``set_extra_state`` run). Also for a
    :class:`~.names.Renamed` module."""

    def save_state(self, obj: torch.nn.Module | Renamed, ctx: Context) -> dict:
        own = module_of(obj).state_dict()
        names = stored_names(obj, own, where_in(obj, ctx))
        out: dict[str, object] = {}
        first: dict[tuple, str] = {}  # identity of a tensor -> the name it is stored under
        for name, key in names.items():
            value = own[key]
            if key.endswith(EXTRA_STATE):
                _check_extra_state(value, f"{where_in(obj, ctx)}/{key}", key[: -len(EXTRA_STATE)].rstrip("."))
            elif isinstance(value, torch.Tensor) and (ident := identity(value)) is not None:
                if ident in first:
                    out[name] = {TIED_TO: first[ident]}
                    continue
                first[ident] = name
            out[name] = value
        return out

    def load_target(self, obj: torch.nn.Module | Renamed, stored: Stored, ctx: Context) -> dict:
        own = meta.materialized(module_of(obj).state_dict())  # tensors on meta: new ones to read into
        return {name: ({TIED_TO: tie} if (tie := _tie(stored, name)) is not None else own[key])
                for name, key in _load_names(obj, own, stored, ctx).items()}

    def apply(self, obj: torch.nn.Module | Renamed, loaded: Mapping, ctx: Context) -> None:
        module = module_of(obj)
        names = _load_names(obj, module.state_dict(), loaded, ctx)
        out: dict[str, object] = {}
        for name, key in names.items():
            value = loaded[name]
            if isinstance(value, Mapping) and set(value) == {TIED_TO} and not key.endswith(EXTRA_STATE):
                source = value[TIED_TO]
                if source not in loaded or not isinstance(loaded[source], torch.Tensor):
                    raise IncompatibleStateError(
                        f"{where_in(obj, ctx)}/{name}: stored as tied to {source!r}, which is not a tensor of "
                        "the module; load into a model built as when saving"
                    )
                value = loaded[source]  # the tensor read for its source: filled into both
            out[key] = value
        with meta.assigning(module, lambda: where_in(obj, ctx)) as assign:  # modules built on meta
            module.load_state_dict(out, assign=assign)


def _load_names(obj: torch.nn.Module | Renamed, own: Mapping, stored: Stored | Mapping, ctx: Context) -> dict[str, str]:
    """``{name in the plain state: the module's own key}``: the canonical
    name, or the module's own key where only that is stored (a checkpoint
    written before names were canonical, e.g. with DDP's ``module.``).
    ``stored``: what the checkpoint holds, or the loaded plain state."""
    names = stored_names(obj, own, where_in(obj, ctx))
    if all(key == name for name, key in names.items()):
        return names
    if isinstance(stored, Stored):
        held = {split_flat_key(k)[0] for k in (*stored.tensors, *stored.values)}
    else:
        held = set(stored)
    return {(key if key != name and name not in held and key in held else name): key for name, key in names.items()}


def _tie(stored: Stored, name: str) -> str | None:
    tie = stored.values.get(f"{name}/{TIED_TO}")
    return tie if isinstance(tie, str) and name not in stored.tensors else None


def _check_extra_state(value: object, key: str, owner: str) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _check_extra_state(v, f"{key}/{k}", owner)
        return
    if is_tensor_leaf(value):
        return
    try:
        check_value(value, key)
    except UnsupportedValueError as e:
        raise UnsupportedValueError(
            f"{key!r}: the extra state of module {owner or '(root)'!r} (its get_extra_state()) is not storable: "
            f"{e}. tensorckpt stores tensors and JSON data only and never pickles: make get_extra_state() "
            "return those, e.g. serialized bytes as a uint8 tensor, torch.frombuffer(bytearray(data), "
            "dtype=torch.uint8), and decode them in set_extra_state()"
        ) from None


# --------------------------------------------------------------- schedulers


class SchedulerAdapter:
    """The scheduler's ``state_dict()`` as data. Functions (``LambdaLR``'s
    lambdas, as torch itself does) are left out; ±inf (``ReduceLROnPlateau``'s
    ``best``) is not JSON and becomes a 0-d float64 tensor; a dict with
    non-str keys (``MultiStepLR``'s ``milestones``) becomes [key, value] pairs."""

    def save_state(self, sched: torch.optim.lr_scheduler.LRScheduler, ctx: Context) -> dict:
        where = where_in(sched, ctx)
        members = sched.state_dict()
        if CLASS in members:
            raise UnsupportedValueError(
                f"{where!r}: the {type(sched).__name__} scheduler's state_dict() has a member {CLASS!r}, the key "
                "tensorckpt stores the class name under; rename the member or register an adapter for it"
            )
        return {CLASS: type(sched).__name__, **_encode(members, where, type(sched).__name__)}

    def load_target(self, sched: torch.optim.lr_scheduler.LRScheduler, stored: Stored, ctx: Context) -> dict:
        if not stored.tensors and not stored.values:
            return self.save_state(sched, ctx)
        check_class(sched, stored, where_in(sched, ctx), "LR scheduler")
        return tree(stored, lambda path, e: torch.empty(e.shape, dtype=dtype_of(e, path)))

    def apply(self, sched: torch.optim.lr_scheduler.LRScheduler, loaded: Mapping, ctx: Context) -> None:
        sched.load_state_dict(_decode({k: v for k, v in loaded.items() if k != CLASS}, sched.state_dict()))


def _encode(members: Mapping, where: str, kind: str) -> dict:
    out: dict[str, object] = {}
    for name, value in members.items():
        key = f"{where}/{name}"
        if isinstance(value, _FUNCTIONS):
            continue  # code, not state: the scheduler keeps the one it was built with
        if isinstance(value, float) and not math.isfinite(value):
            value = torch.tensor(value, dtype=torch.float64)
        elif isinstance(value, Mapping) and not all(isinstance(k, str) for k in value):
            value = check_value([[k, v] for k, v in value.items()], key)  # MultiStepLR's milestones: a Counter
        elif isinstance(value, Mapping) and value:
            value = _encode(value, key, kind)
        elif not isinstance(value, torch.Tensor):
            try:
                check_value(value, key)
            except UnsupportedValueError as e:
                raise UnsupportedValueError(
                    f"{e}. It is in the state_dict() of the {kind} scheduler: tensorckpt leaves out functions "
                    "but stores no other objects; override the scheduler's state_dict() and load_state_dict() "
                    "to leave it out or turn it into JSON data"
                ) from None
        out[name] = value
    return out


def _decode(loaded: Mapping, current: object) -> dict:
    """Invert :func:`_encode`, guided by the scheduler's ``current`` members."""
    out: dict[str, object] = {}
    for name, value in loaded.items():
        now = current.get(name) if isinstance(current, Mapping) else None
        is_float = isinstance(value, torch.Tensor) and value.shape == () and value.dtype == torch.float64
        is_pairs = isinstance(value, list) and all(isinstance(x, list) and len(x) == 2 for x in value)
        if is_float and not isinstance(now, torch.Tensor):
            value = value.item()  # a float that is not finite
        elif isinstance(now, MutableMapping) and is_pairs:  # back into the member's own mapping type (a Counter)
            rebuilt = copy.copy(now)  # keeps the type and what it holds besides the items (a defaultdict's factory)
            rebuilt.clear()
            rebuilt.update(dict(value))  # not update(value): a Counter counts the items of an iterable
            value = rebuilt
        elif isinstance(value, Mapping) and value:
            value = _decode(value, now)
        out[name] = value
    return out


# ------------------------------------------------------------------ helpers


def tree(stored: Stored, tensor_for: Callable[[tuple, TensorEntry], object]) -> dict:
    """A plain target shaped like what is stored: each value as a placeholder
    (load replaces it), each tensor from ``tensor_for(path, entry)`` (left
    out where it returns None)."""
    tree: dict = {}
    for key, value in stored.values.items():
        set_leaf(tree, split_flat_key(key), value)
    for key, entry in stored.tensors.items():
        path = split_flat_key(key)
        t = tensor_for(path, entry)
        if t is not None:
            set_leaf(tree, path, t)
    return tree


def dtype_of(entry: TensorEntry, path: tuple[str, ...]) -> torch.dtype:
    return dtypes.torch_dtype(dtypes.for_name(entry.dtype, "/".join(path)))


def where_in(obj: object, ctx: Context) -> str:
    """The key path of ``obj`` in the state, for messages."""

    def find(node: Mapping, prefix: tuple[str, ...]) -> tuple[str, ...] | None:
        for name, value in node.items():
            if value is obj:
                return prefix + (str(name),)
            if isinstance(value, Mapping) and (found := find(value, prefix + (str(name),))):
                return found
        return None

    path = find(ctx.state, ()) if isinstance(ctx.state, Mapping) else None
    return "/".join(path) if path else type(obj).__name__


def names_list(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return "[" + shown + (f" and {len(names) - limit} more" if len(names) > limit else "") + "]"


def check_class(obj: object, stored: Stored, where: str, kind: str) -> None:
    """A stored class name (``K/class``, format 1.2) must be ``obj``'s:
    another optimizer's or scheduler's state would load wrongly or fail deep
    inside torch. Checkpoints without one (format 1.0/1.1) are not checked."""
    saved = stored.values.get(CLASS)
    if saved is not None and saved != type(obj).__name__:
        raise IncompatibleStateError(
            f"{where!r}: the checkpoint holds the state of {kind} class {saved!r} there, but the state's {kind} "
            f"is of class {type(obj).__name__!r}; build the {kind} as when saving (a {saved}), or leave {where!r} "
            "out of the state"
        )

