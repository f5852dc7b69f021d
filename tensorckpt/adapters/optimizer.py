"""The built-in adapter of ``torch.optim.Optimizer`` (spec: training-state.md 4).

Keys under the optimizer's key ``K`` (format 1.2)::

    K/class                       the optimizer's class name ("AdamW")
    K/group_of/<fqn>              the id of the hyperparameters of <fqn>'s group
    K/groups/<id>/<hparam>        those hyperparameters (id: a digest of them)
    K/state/<fqn>/<name>          per-parameter state, by the parameter's FQN

Every key is either distinct per parameter or, for a key several ranks write,
the same value on each of them (an id is a digest of its content), so when
ranks hold different parameters (expert or pipeline parallelism) the union of
what they save is the checkpoint, with no step of its own.

Loading matches per parameter: each of the optimizer's groups takes the
hyperparameters stored for its parameters (which must agree). Checkpoints of
format 1.0/1.1 (``K/param_groups``, a list of groups with "params" FQN lists)
are read through the same matching; which layout is stored is decided in one
place, :func:`optimizer_layout`.

Design decisions:

- Optimizer state is keyed by parameter name, never by torch's integer ids,
  so a checkpoint means the same thing to any model built the same way. The
  names come from the ``nn.Module`` (s) found in the same state as the
  optimizer, without wrapper prefixes (:mod:`.names`).
- A state tensor of its parameter's shape (Adam's moments, SGD's momentum) is
  a logical tensor laid out like the parameter (a DTensor shard under FSDP2),
  so it reshards with it. Another 0-d tensor (Adam's ``step``) is stored as a
  JSON number: as a tensor it would add one tiny array per parameter.
- Loading into an optimizer without state creates its state tensors from the
  checkpoint's entries and hands them to ``load_state_dict``: no optimizer
  step is taken, the parameters are untouched.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections.abc import Iterator, Mapping
from itertools import chain

import torch

from ..errors import IncompatibleStateError, UnsupportedValueError
from ..format.metadata import TensorEntry
from .base import Context, Stored
from .names import Renamed, module_of, namer, sharded_fsdp1
from .torch_objects import CLASS, check_class, dtype_of, names_list, tree, where_in

GROUP_OF, GROUPS, STATE, LEGACY_GROUPS = "group_of", "groups", "state", "param_groups"
_ID_CHARS = 16  # hex digits of a group id (64 bits of SHA-256)


class OptimizerAdapter:
    """Saves the 1.2 layout (module docstring); loads it and the 1.0/1.1 one."""

    def save_state(self, opt: torch.optim.Optimizer, ctx: Context) -> dict:
        groups = named_groups(opt, ctx)
        state: dict[str, dict] = {}
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
            elif p in opt.state:
                state[fqn] = {}
        hparams: dict[str, dict] = {}
        group_of: dict[str, str] = {}
        for g, named in zip(opt.param_groups, groups):
            hp = {k: _scalar_as_data(v) for k, v in g.items() if k not in ("params", "param_names")}
            gid = group_id(hp, where_in(opt, ctx))
            hparams[gid] = hp
            group_of.update((fqn, gid) for fqn, _ in named)
        out: dict = {CLASS: type(opt).__name__}
        if group_of:
            out[GROUP_OF] = group_of
            out[GROUPS] = hparams
        if state:
            out[STATE] = state
        return out

    def load_target(self, opt: torch.optim.Optimizer, stored: Stored, ctx: Context) -> dict:
        if not stored.tensors and not stored.values:  # nothing stored: load reports the keys missing
            return self.save_state(opt, ctx)
        where = where_in(opt, ctx)
        check_class(opt, stored, where, "optimizer")
        saved = tree(stored, lambda path, e: e)
        hparams = stored_hparams(saved, where, sorted([*stored.tensors, *stored.values]))
        with_state = set(saved.get(STATE, {})) if isinstance(saved.get(STATE), Mapping) else set()
        groups = named_groups(opt, ctx)
        params = dict(chain.from_iterable(groups))
        _check_names(opt, groups, hparams, with_state, ctx, where)
        ours = set(params)

        def target(path: tuple[str, ...], entry: TensorEntry) -> torch.Tensor | None:
            if len(path) == 3 and path[0] == STATE and path[1] in ours:
                return _state_target(opt, params[path[1]], path[2], entry, path)
            return None

        out = tree(stored, target)
        for kind in (GROUP_OF, STATE):  # a parameter the optimizer lacks (strict=False, partial=True): not read
            if isinstance(out.get(kind), dict):
                for fqn in set(out[kind]) - ours:
                    del out[kind][fqn]
                if not out[kind]:
                    del out[kind]
        return out

    def apply(self, opt: torch.optim.Optimizer, loaded: Mapping, ctx: Context) -> None:
        where = where_in(opt, ctx)
        groups = named_groups(opt, ctx)
        hparams = stored_hparams(loaded, where, sorted(loaded))
        ids = {fqn: i for i, (fqn, _) in enumerate(chain.from_iterable(groups))}
        loaded_state = loaded.get(STATE, {}) if isinstance(loaded.get(STATE), Mapping) else {}
        state: dict[int, dict] = {}
        for fqn, p in chain.from_iterable(groups):
            current = opt.state.get(p, {})
            if fqn in loaded_state:
                state[ids[fqn]] = {k: _like(v, current.get(k)) for k, v in loaded_state[fqn].items()}
            elif current:  # not stored (strict=False, else load_target raised): it stays as it is
                state[ids[fqn]] = dict(current)
        param_groups = []
        for g, named in zip(opt.param_groups, groups):
            mine = [hparams[fqn] for fqn, _ in named if fqn in hparams]
            saved = mine[0] if mine else {k: v for k, v in g.items() if k not in ("params", "param_names")}
            param_groups.append({**{k: _like(v, g.get(k)) for k, v in saved.items()},
                                 "params": [ids[fqn] for fqn, _ in named]})  # the optimizer's order; state is by id
        opt.load_state_dict({"state": state, "param_groups": param_groups})


def group_id(hparams: Mapping, where: str) -> str:
    """The id of a group's hyperparameters: a digest of their canonical JSON,
    so that ranks holding a group with the same hyperparameters write the
    same key with the same value."""
    try:
        text = json.dumps(hparams, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UnsupportedValueError(
            f"{where!r}: a param group's hyperparameters are not JSON data ({e}); tensorckpt stores them as JSON"
        ) from None
    return hashlib.sha256(text.encode()).hexdigest()[:_ID_CHARS]


LAYOUT_1_0, LAYOUT_1_2 = "1.0", "1.2"  # the two optimizer layouts (training-state.md 4.4 and 4.2)


def optimizer_layout(saved: Mapping) -> str:
    """Which optimizer layout is stored under ``K`` (a tree of what is
    stored): the one place that chooses. ``K/param_groups`` stored means the
    1.0/1.1 layout (training-state.md 4.4: a reader MUST read it "when
    ``K/param_groups`` is stored"), anything else the 1.2 one (4.2). It is
    chosen by what is stored, not by ``format_version``: the spec defines it
    so (the key names tell the layouts apart, and a 1.1 checkpoint converted
    or copied key by key keeps its layout), and a checkpoint whose version
    and layout disagree is the validator's to report
    (``optimizer-legacy-layout``), not a reason to misread it."""
    return LAYOUT_1_0 if saved.get(LEGACY_GROUPS) is not None else LAYOUT_1_2


def stored_hparams(saved: Mapping, where: str, keys: list[str]) -> dict[str, dict]:
    """``{fqn: hyperparameters of its group}`` from what is stored under the
    optimizer's key (a tree), in the layout :func:`optimizer_layout` finds."""
    if optimizer_layout(saved) == LAYOUT_1_0:
        legacy = saved[LEGACY_GROUPS]
        if not isinstance(legacy, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in legacy):
            raise IncompatibleStateError(f"{where!r}: the checkpoint's {LEGACY_GROUPS!r} is not a list of param groups")
        return {fqn: {k: v for k, v in g.items() if k != "params"} for g in legacy for fqn in g["params"]}
    group_of, groups = saved.get(GROUP_OF, {}), saved.get(GROUPS, {})
    if not isinstance(group_of, Mapping) or not isinstance(groups, Mapping) or (
        not group_of and STATE not in saved and CLASS not in saved
    ):
        raise IncompatibleStateError(
            f"{where!r}: the checkpoint holds no optimizer state there (no {GROUP_OF!r}/{GROUPS!r} or "
            f"{LEGACY_GROUPS!r}); it holds {names_list(keys)}"
        )
    out = {}
    for fqn, gid in group_of.items():
        hp = groups.get(gid) if isinstance(gid, str) else None
        if not isinstance(hp, Mapping):
            raise IncompatibleStateError(
                f"{where!r}: {GROUP_OF}/{fqn} names the group {gid!r}, which is not stored under {where}/{GROUPS}"
            )
        out[fqn] = dict(hp)
    return out


def _check_names(
    opt: torch.optim.Optimizer, groups: list[list[tuple[str, torch.Tensor]]], hparams: dict[str, dict],
    with_state: set[str], ctx: Context, where: str,
) -> None:
    """Per-parameter matching (training-state.md 4.3): names of the optimizer
    the checkpoint lacks, state the checkpoint lacks, groups whose parameters'
    stored hyperparameters disagree. Names only the checkpoint has are left
    out of the target: under expert or pipeline parallelism other ranks hold
    them, and load reports the keys that no rank wants (unless partial)."""
    mine = [fqn for fqn, _ in chain.from_iterable(groups)]
    theirs = set(hparams) | with_state
    only_ckpt = sorted(theirs - set(mine))
    only_opt = sorted(set(mine) - theirs)
    if only_opt and ctx.strict:  # only_ckpt is normal here: other ranks may hold them (load checks the union)
        raise IncompatibleStateError(
            f"{where!r}: the optimizer's parameter names differ from the checkpoint's: only in the checkpoint: "
            f"{names_list(only_ckpt)}; only in the optimizer: {names_list(only_opt)}. Names are FQNs in the "
            "module(s) next to the optimizer in the state; build the model and optimizer as when saving, or "
            "pass strict=False to load the parameters both have"
        )
    if only_opt:
        warnings.warn(f"{where!r}: no optimizer state stored for {names_list(only_opt)}: kept as it is (strict=False)",
                      stacklevel=6)
    params = dict(chain.from_iterable(groups))
    lacking = sorted(f for f in mine if f in theirs and f not in with_state and opt.state.get(params[f]))
    if lacking and ctx.strict:
        raise IncompatibleStateError(
            f"{where!r}: the optimizer has state for {names_list(lacking)}, the checkpoint has none for them (they "
            "had no state when it was saved); loading would drop it. Pass strict=False to keep it"
        )
    if lacking:
        warnings.warn(f"{where!r}: the checkpoint has no state for {names_list(lacking)}: the optimizer's own is "
                      "kept (strict=False)", stacklevel=6)
    for i, named in enumerate(groups):
        seen: dict[str, str] = {}
        for fqn, _ in named:
            if fqn in hparams:
                key = json.dumps(hparams[fqn], sort_keys=True)
                seen.setdefault(key, fqn)
        if len(seen) > 1:
            a, b = list(seen.values())[:2]
            diff = sorted(k for k in hparams[a].keys() | hparams[b].keys() if hparams[a].get(k) != hparams[b].get(k))
            raise IncompatibleStateError(
                f"{where!r}: param group {i} of the optimizer holds {a!r} and {b!r}, whose stored hyperparameters "
                f"differ ({', '.join(map(repr, diff))}); put parameters of different stored groups in different "
                "param groups"
            )


def named_groups(opt: torch.optim.Optimizer, ctx: Context) -> list[list[tuple[str, torch.Tensor]]]:
    """The optimizer's param groups as (FQN, parameter) lists. A parameter's
    FQN is its (canonical) name in the first module of the state that has it;
    when the optimizer's parameters come from several modules, the name is
    prefixed with the module's key path (``gen.fc.weight``)."""
    owners: dict[int, tuple[tuple[str, ...], str]] = {}
    for path, obj in _modules(ctx.state, ()):
        if sharded_fsdp1(module_of(obj)) is not None:
            raise UnsupportedValueError(
                f"{where_in(opt, ctx)!r}: the model at {'/'.join(path)!r} is FSDP1 (FullyShardedDataParallel) "
                "sharding its parameters: the optimizer's parameters are flat local shards, which this adapter "
                "cannot name as logical tensors. Use FSDP2 (torch.distributed.fsdp.fully_shard), or save "
                "FullyShardedDataParallel.optim_state_dict(model, optimizer) (a plain state dict) instead of the optimizer"
            )
        name_of = namer(obj)
        for name, p in module_of(obj).named_parameters():
            owners.setdefault(id(p), (path, name_of(name)))
    for i, g in enumerate(opt.param_groups):
        for j, p in enumerate(g["params"]):
            if id(p) not in owners:
                where = where_in(opt, ctx)
                raise UnsupportedValueError(
                    f"{where!r}: parameter {j} of param group {i} (shape {list(p.shape)}) belongs to no "
                    "torch.nn.Module in the state; optimizer state is keyed by parameter name, so put the model "
                    "(the nn.Module itself, not its state_dict()) in the same state dict, e.g. "
                    f"{{'model': model, {where.split('/')[-1]!r}: optimizer}}"
                )
    several = len({owners[id(p)][0] for g in opt.param_groups for p in g["params"]}) > 1

    def fqn(p: torch.Tensor) -> str:
        path, name = owners[id(p)]
        return ".".join(path + (name,)) if several else name

    return [[(fqn(p), p) for p in g["params"]] for g in opt.param_groups]


def _modules(node: Mapping, prefix: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], torch.nn.Module | Renamed]]:
    for name, value in node.items():
        if isinstance(value, (torch.nn.Module, Renamed)):
            yield prefix + (name,), value
        elif isinstance(value, Mapping):
            yield from _modules(value, prefix + (name,))


def _state_target(
    opt: torch.optim.Optimizer, p: torch.Tensor, name: str, entry: TensorEntry, path: tuple[str, ...]
) -> torch.Tensor:
    """Where to read ``state/<fqn>/<name>``: the optimizer's own tensor when it
    matches, else a new one, laid out like the parameter when of its shape."""
    dtype = dtype_of(entry, path)
    current = opt.state.get(p, {}).get(name)
    if isinstance(current, torch.Tensor) and tuple(current.shape) == entry.shape and current.dtype == dtype:
        return current
    if entry.shape == tuple(p.shape):
        return torch.zeros_like(p.detach(), dtype=dtype)  # a DTensor shard for a DTensor parameter
    return torch.zeros(entry.shape, dtype=dtype, device=p.device)


def _leaves(value: object) -> Iterator[object]:
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def _scalar_as_data(value: object, p: torch.Tensor | None = None) -> object:
    """A real 0-d tensor as a number (unless its parameter is 0-d too, or the
    number is not finite); anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and (p is None or p.dim() > 0) and not value.is_complex():
        number = value.item()
        if not isinstance(number, float) or math.isfinite(number):
            return number
    return value


def _like(value: object, current: object) -> object:
    """``value`` as loaded, turned back into ``current``'s kind: a 0-d tensor
    of its dtype and device for a number, a tuple for a list."""
    if isinstance(current, torch.Tensor) and isinstance(value, (bool, int, float)):
        return torch.tensor(value, dtype=current.dtype, device=current.device)
    if isinstance(current, tuple) and isinstance(value, list):
        return tuple(value)
    return value

