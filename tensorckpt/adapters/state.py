"""State dicts <-> flat leaves (spec section "State dicts").

A state is a tree of dicts (any ``Mapping``) with ``str`` keys. A leaf is a
``torch.Tensor`` or JSON-able data. Non-empty dicts are containers; an empty
dict is a (JSON) value, so it round-trips.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch

from ..errors import UnsupportedValueError
from ..format.keys import flat_key
from ..format.metadata import check_value
from .sharded import is_tensor_leaf


@dataclass(frozen=True)
class Leaf:
    path: tuple[str, ...]
    value: object  # a tensor (torch.Tensor, DTensor, ShardedTensor) or JSON-able data

    @property
    def is_tensor(self) -> bool:
        return is_tensor_leaf(self.value)


def flatten(state: Mapping, check_values: bool = True) -> dict[str, Leaf]:
    """Every leaf of ``state`` by flat key, in depth-first order."""
    if not isinstance(state, Mapping):
        raise UnsupportedValueError(f"the state must be a dict of tensors and data, got {type(state).__name__}")
    out: dict[str, Leaf] = {}
    _walk(state, (), out, check_values)
    return out


def _walk(node: Mapping, prefix: tuple[str, ...], out: dict[str, Leaf], check: bool) -> None:
    for name, value in node.items():
        path = prefix + (name,)
        try:
            key = flat_key(path)  # validates that name is a str
        except UnsupportedValueError as e:
            where = "/".join(map(str, prefix)) or "the top level"
            raise UnsupportedValueError(f"in {where!r}: {e}") from None
        if isinstance(value, Mapping) and value:
            _walk(value, path, out, check)
        elif is_tensor_leaf(value):
            out[key] = Leaf(path, value)
        else:
            if check and isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
                raise UnsupportedValueError(
                    f"{key!r}: a {type(value).__name__} of tensors; use a dict instead, e.g. "
                    "{'0': t0, '1': t1}"
                )
            out[key] = Leaf(path, check_value(dict(value) if isinstance(value, Mapping) else value, key) if check else value)


def set_leaf(state: MutableMapping, path: tuple[str, ...], value: object) -> None:
    node = state
    for name in path[:-1]:
        node = node.setdefault(name, {})
    node[path[-1]] = value


def unflatten(leaves: dict[tuple[str, ...], object]) -> dict:
    out: dict = {}
    for path, value in leaves.items():
        set_leaf(out, path, value)
    return out
