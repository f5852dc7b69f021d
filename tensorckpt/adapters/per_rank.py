"""Data that differs by rank, stored one row per rank (spec: rng-and-data.md,
"Per-rank data").

A plain tensor or value in a state is taken to be the same on every rank and
is stored once; :func:`per_rank` marks one that is not (a per-rank counter,
a rank's extra state):

    state = {"model": model, "seen": tensorckpt.per_rank(seen_tensor), "stats": tensorckpt.per_rank({"n": 3})}

A tensor of shape ``s`` is stored as one tensor ``K/rows`` of shape ``[world, *s]``,
row r written by rank r (as :func:`tensorckpt.rng_state` stores its rows); a
JSON value of rank r is stored under ``K/<r>``. At load, rank r gets row r
back (a tensor in place, a value as ``.value``). Saved by another number of
ranks than load it, the load fails (naming the key), unless ``strict=False``:
then ranks below the saved world get their row and the others keep their
value.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import CorruptCheckpointError, IncompatibleStateError, UnsupportedValueError
from ..format.keys import split_flat_key
from .base import Context, Stored, Target, key_in_state
from .sharded import ShardedTensor, is_tensor_leaf
from .state import unflatten

ROWS = "rows"  # K/rows: the [world, ...] tensor of a per-rank tensor


class PerRank:
    """A tensor or JSON value that differs by rank (:func:`per_rank`). After
    a load, ``value`` holds this rank's stored row (a tensor is filled in place)."""

    def __init__(self, value: object) -> None:
        if is_tensor_leaf(value) and type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise UnsupportedValueError(
                "tensorckpt.per_rank(...) takes a plain tensor or a JSON value; a DTensor or ShardedTensor "
                "already says which part each rank holds"
            )
        self.value = value

    def __repr__(self) -> str:
        return f"tensorckpt.per_rank({self.value!r})"


def per_rank(value: object) -> PerRank:
    """Mark ``value`` (a tensor, or JSON-able data) as this rank's own: saved
    as one row per rank instead of once for all (see the module docstring)."""
    return PerRank(value)


class PerRankAdapter:
    """Rank r's row in, rank r's row out; ``load_target``'s memo for
    ``apply``: the saved world (None: nothing stored)."""

    def save_state(self, obj: PerRank, ctx: Context) -> dict:
        v = obj.value
        if isinstance(v, torch.Tensor):
            t = v.detach()
            return {ROWS: ShardedTensor(t.unsqueeze(0), (ctx.world, *t.shape), (ctx.rank,) + (0,) * t.dim())}
        return {str(ctx.rank): v}

    def load_target(self, obj: PerRank, stored: Stored, ctx: Context) -> Target:
        key = key_in_state(obj, ctx.state)
        v = obj.value
        if isinstance(v, torch.Tensor):
            entry = stored.tensors.get(ROWS)
            shape = tuple(v.shape)
            if entry is None:  # nothing stored: ask for this world's row, so load reports the key missing
                local = torch.zeros((1, *shape), dtype=v.dtype)
                return Target({ROWS: ShardedTensor(local, (ctx.world, *shape), (ctx.rank,) + (0,) * len(shape))}, None)
            if len(entry.shape) != len(shape) + 1:
                raise IncompatibleStateError(
                    f"{key!r}: per-rank tensor stored as {list(entry.shape)}; the state's rows are {list(shape)}, "
                    f"so the checkpoint should hold [world, {', '.join(map(str, shape))}]"
                )
            rows = entry.shape[0]
            _check_world(key, rows, ctx)
            mine = ctx.rank < rows
            local = torch.zeros((1 if mine else 0, *entry.shape[1:]), dtype=v.dtype)
            return Target({ROWS: ShardedTensor(local, tuple(entry.shape), ((ctx.rank if mine else 0),) + (0,) * len(shape))}, rows)
        if not stored.values:
            return Target({str(ctx.rank): v}, None)
        ranks = {split_flat_key(k)[0] for k in stored.values}
        rows = len(ranks)
        if ranks != {str(r) for r in range(rows)}:
            raise CorruptCheckpointError(f"{key!r}: per-rank values are stored for ranks {sorted(ranks)}, not 0 .. n-1")
        _check_world(key, rows, ctx)
        return Target(unflatten({split_flat_key(k): None for k in stored.values}), rows)  # every row: the keys match on every rank

    def apply(self, obj: PerRank, loaded: Mapping, ctx: Context, rows: int | None) -> None:
        if rows is None or ctx.rank >= rows:  # nothing stored, or no row for this rank (strict=False)
            return
        if isinstance(obj.value, torch.Tensor):
            with torch.no_grad():
                obj.value.copy_(loaded[ROWS].local[0])
        else:
            obj.value = loaded[str(ctx.rank)]


def _check_world(key: str, rows: int, ctx: Context) -> None:
    if rows != ctx.world and ctx.strict:
        raise IncompatibleStateError(
            f"{key!r}: per-rank data saved by {rows} ranks, loaded by {ctx.world}; per-rank data has no rule "
            "for another world size. Load with strict=False to give ranks below "
            f"{rows} their row and leave the others' values unchanged"
        )

