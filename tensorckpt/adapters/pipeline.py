"""Pipeline parallelism: stage-local layer numbers <-> global layer keys.

A pipeline stage numbers its layers from 0 (``layers.0.weight`` on every
stage), but in a checkpoint each logical tensor needs one global key. Save a
stage's state through :func:`shift_layers` with the stage's first global layer
as ``offset``; load through the same call with the *loading* stage's offset.
Keys of different stages are then disjoint, so a PP=4 checkpoint loads at PP=2
(or PP=1) with no conversion:

    first = stage_offset(num_layers, pp_size, pp_rank)
    tensorckpt.save({"model": shift_layers(model.state_dict(), first)}, path, ...)

Given the module itself, :func:`shift_layers` returns it under the global
names; an optimizer of the stage's parameters next to it in the state is then
keyed by those names too, so its state reshards across stages the same way:

    state = {"model": shift_layers(model, first), "optim": optimizer}
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import overload

import torch

from .names import Renamed


def stage_offset(num_layers: int, pp_size: int, pp_rank: int) -> int:
    """Global index of the first layer of stage ``pp_rank`` when ``num_layers``
    are split as evenly as possible (earlier stages take the remainder)."""
    if not (0 <= pp_rank < pp_size) or num_layers < 0:
        raise ValueError(f"stage {pp_rank} of {pp_size} with {num_layers} layers is not a valid pipeline stage")
    base, extra = divmod(num_layers, pp_size)
    return pp_rank * base + min(pp_rank, extra)


@overload
def shift_layers(state: torch.nn.Module, offset: int, *, prefix: str = "layers") -> Renamed: ...
@overload
def shift_layers(state: Mapping, offset: int, *, prefix: str = "layers") -> dict: ...
def shift_layers(state: Mapping | torch.nn.Module, offset: int, *, prefix: str = "layers") -> dict | Renamed:
    """A new (nested) dict whose keys ``...{prefix}.{i}...`` read
    ``{prefix}.{i + offset}``; values are shared, not copied, so loading into
    the result fills the original tensors in place. For a ``torch.nn.Module``,
    the module seen under those names (a :class:`~tensorckpt.adapters.names.Renamed`),
    for saving and loading it and an optimizer of its parameters."""
    pattern = re.compile(rf"(^|\.){re.escape(prefix)}\.(\d+)(?=\.|$)")

    def rename(key: str) -> str:
        return pattern.sub(lambda m: f"{m.group(1)}{prefix}.{int(m.group(2)) + offset}", key, count=1)

    if isinstance(state, torch.nn.Module):
        return Renamed(state, rename)

    out: dict = {}
    for k, v in state.items():
        new = rename(k) if isinstance(k, str) else k
        if new in out:
            raise ValueError(f"shift_layers: keys collide at {new!r}")
        out[new] = shift_layers(v, offset, prefix=prefix) if isinstance(v, Mapping) else v
    return out
