"""Built-in adapters for torch objects: ``nn.Module``, ``optim.Optimizer``,
``optim.lr_scheduler.LRScheduler`` (spec: training-state.md).

Keys under each object's own key (``model``, ``optim``, ``sched`` here)::

    model/<fqn>                   the module's state_dict (DTensors under FSDP2)
    model/<prefix>_extra_state    get_extra_state(): tensors and JSON data
    optim/state/<fqn>/<name>      per-parameter state, by the parameter's FQN
    optim/param_groups            JSON: hyperparameters, "params" as FQN lists
    sched/<member>                the scheduler's state_dict (functions left out)

Design decisions:

- Optimizer state is keyed by parameter name, never by torch's integer ids,
  so a checkpoint means the same thing to any model built the same way. The
  names come from the ``nn.Module`` (s) found in the same state as the
  optimizer.
- A state tensor of its parameter's shape (Adam's moments, SGD's momentum) is
  a logical tensor laid out like the parameter (a DTensor shard under FSDP2),
  so it reshards with it. Another 0-d tensor (Adam's ``step``) is stored as a
  JSON number: as a tensor it would add one tiny array per parameter to the
  checkpoint. Loading makes it a tensor again (like the optimizer's own
  entry, or through the optimizer's ``load_state_dict``, which turns a number
  ``step`` into its tensor for torch's optimizers).
- Loading into an optimizer without state creates its state tensors from the
  checkpoint's entries and hands them to ``load_state_dict``: no optimizer
  step is taken, the parameters are untouched.
"""

from __future__ import annotations

import copy
import functools
import math
import types
from collections.abc import Callable, Mapping
from itertools import chain

import torch

from ..errors import IncompatibleStateError, UnsupportedValueError
from ..format import dtypes
from ..format.keys import split_flat_key
from ..format.metadata import TensorEntry, check_value
from . import meta
from .registry import Context, Stored, register
from .sharded import is_tensor_leaf
from .state import set_leaf

EXTRA_STATE = "_extra_state"  # torch.nn.Module's suffix for get_extra_state() keys
_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)


# ------------------------------------------------------------------ modules


class ModuleAdapter:
    """``state_dict()`` as is; ``load_state_dict()`` after the tensors were
    read in place (the module's own load hooks and ``set_extra_state`` run)."""

    def save_state(self, module, ctx):
        state = module.state_dict()
        for key, value in state.items():
            if key.endswith(EXTRA_STATE):
                _check_extra_state(value, f"{_where(module, ctx)}/{key}", key[: -len(EXTRA_STATE)].rstrip("."))
        return state

    def load_target(self, module, stored, ctx):
        return meta.materialized(module.state_dict())  # tensors on meta: new ones to read into

    def apply(self, module, loaded, ctx):
        with meta.assigning(module, lambda: _where(module, ctx)) as assign:  # modules built on meta
            module.load_state_dict(loaded, assign=assign)


def _check_extra_state(value, key: str, owner: str) -> None:
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


# --------------------------------------------------------------- optimizers


class OptimizerAdapter:
    """``{"state": {fqn: {name: value}}, "param_groups": [...]}``."""

    def save_state(self, opt, ctx):
        groups = _named_groups(opt, ctx)
        state = {}
        for fqn, p in chain.from_iterable(groups):
            if opt.state.get(p):
                for k, v in opt.state[p].items():
                    if isinstance(v, Mapping) and any(isinstance(x, torch.Tensor) for x in _leaves(v)):
                        raise UnsupportedValueError(
                            f"optimizer state {fqn!r}/{k!r} is a dict holding tensors; the spec stores each state "
                            "entry as one tensor or one JSON value (spec/training-state.md 4.2). Flatten it into "
                            "separate entries, or register an adapter for this optimizer"
                        )
                state[fqn] = {k: _scalar_as_data(v, p) for k, v in opt.state[p].items()}
        param_groups = [
            {**{k: _scalar_as_data(v) for k, v in g.items() if k not in ("params", "param_names")},
             "params": [fqn for fqn, _ in named]}
            for g, named in zip(opt.param_groups, groups)
        ]
        return {"state": state, "param_groups": param_groups}

    def load_target(self, opt, stored, ctx):
        if not stored.tensors and not stored.values:  # nothing stored: load reports the keys missing
            return self.save_state(opt, ctx)
        groups = _named_groups(opt, ctx)
        _check_names(groups, stored, _where(opt, ctx))
        params = dict(chain.from_iterable(groups))

        def target(path, entry):
            if len(path) == 3 and path[0] == "state":
                return _state_target(opt, params[path[1]], path[2], entry, path)
            return None  # not ours: load reports it

        return _tree(stored, target)

    def apply(self, opt, loaded, ctx):
        groups = _named_groups(opt, ctx)
        ids = {fqn: i for i, (fqn, _) in enumerate(chain.from_iterable(groups))}
        params = dict(chain.from_iterable(groups))
        state = {}
        for fqn, entries in loaded.get("state", {}).items():
            current = opt.state.get(params[fqn], {})
            state[ids[fqn]] = {k: _like(v, current.get(k)) for k, v in entries.items()}
        param_groups = [
            {**{k: _like(v, g.get(k)) for k, v in saved.items() if k != "params"},
             "params": [ids[fqn] for fqn, _ in named]}  # the optimizer's own order; state is by id
            for g, saved, named in zip(opt.param_groups, loaded["param_groups"], groups)
        ]
        opt.load_state_dict({"state": state, "param_groups": param_groups})


def _named_groups(opt, ctx: Context) -> list[list[tuple[str, torch.Tensor]]]:
    """The optimizer's param groups as (FQN, parameter) lists. A parameter's
    FQN is its name in the first module of the state that has it; when the
    optimizer's parameters come from several modules, the name is prefixed
    with the module's key path (``gen.fc.weight``)."""
    owners: dict[int, tuple[tuple[str, ...], str]] = {}
    for path, module in _modules(ctx.state, ()):
        for name, p in module.named_parameters():
            owners.setdefault(id(p), (path, name))
    for i, g in enumerate(opt.param_groups):
        for j, p in enumerate(g["params"]):
            if id(p) not in owners:
                where = _where(opt, ctx)
                raise UnsupportedValueError(
                    f"{where!r}: parameter {j} of param group {i} (shape {list(p.shape)}) belongs to no "
                    "torch.nn.Module in the state; optimizer state is keyed by parameter name, so put the model "
                    "(the nn.Module itself, not its state_dict()) in the same state dict, e.g. "
                    f"{{'model': model, {where.split('/')[-1]!r}: optimizer}}"
                )
    several = len({owners[id(p)][0] for g in opt.param_groups for p in g["params"]}) > 1

    def fqn(p) -> str:
        path, name = owners[id(p)]
        return ".".join(path + (name,)) if several else name

    return [[(fqn(p), p) for p in g["params"]] for g in opt.param_groups]


def _check_names(groups, stored: Stored, where: str) -> None:
    saved = stored.values.get("param_groups")
    if not isinstance(saved, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved):
        raise IncompatibleStateError(
            f"{where!r}: the checkpoint holds no optimizer state there (no valid 'param_groups' list); "
            f"it holds {_names(sorted([*stored.tensors, *stored.values]))}"
        )
    mine = [[fqn for fqn, _ in g] for g in groups]
    theirs = [g["params"] for g in saved]
    with_state = {split_flat_key(k)[1] for k in [*stored.tensors, *stored.values] if k.startswith("state/")}
    only_ckpt = sorted((set(chain.from_iterable(theirs)) | with_state) - set(chain.from_iterable(mine)))
    only_opt = sorted(set(chain.from_iterable(mine)) - set(chain.from_iterable(theirs)))
    if only_ckpt or only_opt:
        raise IncompatibleStateError(
            f"{where!r}: the optimizer's parameter names differ from the checkpoint's: only in the checkpoint: "
            f"{_names(only_ckpt)}; only in the optimizer: {_names(only_opt)}. Names are FQNs in the module(s) "
            "next to the optimizer in the state; build the model and optimizer as when saving"
        )
    if len(mine) != len(theirs):
        raise IncompatibleStateError(
            f"{where!r}: the checkpoint has {len(theirs)} param groups, the optimizer {len(mine)}"
        )
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if set(a) != set(b):
            raise IncompatibleStateError(
                f"{where!r}: param group {i} differs: only in the checkpoint's: {_names(sorted(set(b) - set(a)))}; "
                f"only in the optimizer's: {_names(sorted(set(a) - set(b)))}"
            )


def _state_target(opt, p: torch.Tensor, name: str, entry: TensorEntry, path) -> torch.Tensor:
    """Where to read ``state/<fqn>/<name>``: the optimizer's own tensor when it
    matches, else a new one, laid out like the parameter when of its shape."""
    dtype = _dtype(entry, path)
    current = opt.state.get(p, {}).get(name)
    if isinstance(current, torch.Tensor) and tuple(current.shape) == entry.shape and current.dtype == dtype:
        return current
    if entry.shape == tuple(p.shape):
        return torch.zeros_like(p.detach(), dtype=dtype)  # a DTensor shard for a DTensor parameter
    return torch.zeros(entry.shape, dtype=dtype, device=p.device)


def _leaves(value):
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def _scalar_as_data(value, p: torch.Tensor | None = None):
    """A real 0-d tensor as a number (unless its parameter is 0-d too, or the
    number is not finite); anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and (p is None or p.dim() > 0) and not value.is_complex():
        number = value.item()
        if not isinstance(number, float) or math.isfinite(number):
            return number
    return value


def _like(value, current):
    """``value`` as loaded, turned back into ``current``'s kind: a 0-d tensor
    of its dtype and device for a number, a tuple for a list."""
    if isinstance(current, torch.Tensor) and isinstance(value, (bool, int, float)):
        return torch.tensor(value, dtype=current.dtype, device=current.device)
    if isinstance(current, tuple) and isinstance(value, list):
        return tuple(value)
    return value


# --------------------------------------------------------------- schedulers


class SchedulerAdapter:
    """The scheduler's ``state_dict()`` as data. Functions (``LambdaLR``'s
    lambdas, as torch itself does) are left out; ±inf (``ReduceLROnPlateau``'s
    ``best``) is not JSON and becomes a 0-d float64 tensor; a dict with
    non-str keys (``MultiStepLR``'s ``milestones``) becomes [key, value] pairs."""

    def save_state(self, sched, ctx):
        return _encode(sched.state_dict(), _where(sched, ctx), type(sched).__name__)

    def load_target(self, sched, stored, ctx):
        if not stored.tensors and not stored.values:
            return self.save_state(sched, ctx)
        return _tree(stored, lambda path, e: torch.empty(e.shape, dtype=_dtype(e, path)))

    def apply(self, sched, loaded, ctx):
        sched.load_state_dict(_decode(loaded, sched.state_dict()))


def _encode(members: Mapping, where: str, kind: str) -> dict:
    out = {}
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


def _decode(loaded: Mapping, current) -> dict:
    """Invert :func:`_encode`, guided by the scheduler's ``current`` members."""
    out = {}
    for name, value in loaded.items():
        now = current.get(name) if isinstance(current, Mapping) else None
        is_float = isinstance(value, torch.Tensor) and value.shape == () and value.dtype == torch.float64
        is_pairs = isinstance(value, list) and all(isinstance(x, list) and len(x) == 2 for x in value)
        if is_float and not isinstance(now, torch.Tensor):
            value = value.item()  # a float that is not finite
        elif isinstance(now, Mapping) and is_pairs:  # back into the member's own mapping type
            pairs, value = value, copy.copy(now)
            value.clear()
            value.update({k: v for k, v in pairs})
        elif isinstance(value, Mapping) and value:
            value = _decode(value, now)
        out[name] = value
    return out


# ------------------------------------------------------------------ helpers


def _tree(stored: Stored, tensor_for: Callable[[tuple, TensorEntry], torch.Tensor | None]) -> dict:
    """A plain target shaped like what is stored: each value as a placeholder
    (load replaces it), each tensor from ``tensor_for(path, entry)``."""
    tree: dict = {}
    for key, value in stored.values.items():
        set_leaf(tree, split_flat_key(key), value)
    for key, entry in stored.tensors.items():
        path = split_flat_key(key)
        t = tensor_for(path, entry)
        if t is not None:
            set_leaf(tree, path, t)
    return tree


def _dtype(entry: TensorEntry, path: tuple[str, ...]) -> torch.dtype:
    return dtypes.torch_dtype(dtypes.for_name(entry.dtype, "/".join(path)))


def _modules(node: Mapping, prefix: tuple[str, ...]):
    for name, value in node.items():
        if isinstance(value, torch.nn.Module):
            yield prefix + (name,), value
        elif isinstance(value, Mapping):
            yield from _modules(value, prefix + (name,))


def _where(obj, ctx: Context) -> str:
    """The key path of ``obj`` in the state, for messages."""

    def find(node: Mapping, prefix: tuple[str, ...]):
        for name, value in node.items():
            if value is obj:
                return prefix + (str(name),)
            if isinstance(value, Mapping) and (found := find(value, prefix + (str(name),))):
                return found
        return None

    path = find(ctx.state, ()) if isinstance(ctx.state, Mapping) else None
    return "/".join(path) if path else type(obj).__name__


def _names(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return "[" + shown + (f" and {len(names) - limit} more" if len(names) > limit else "") + "]"


register(torch.nn.Module, ModuleAdapter())
register(torch.optim.Optimizer, OptimizerAdapter())
register(torch.optim.lr_scheduler.LRScheduler, SchedulerAdapter())
