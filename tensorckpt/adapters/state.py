"""State dicts <-> flat leaves (spec section "State dicts").

A state is a tree of dicts (any ``Mapping``) with ``str`` keys. A leaf is a
``torch.Tensor`` or JSON-able data. Non-empty dicts are containers; an empty
dict is a (JSON) value, so it round-trips.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

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
            if check and isinstance(value, (list, tuple, Mapping)):
                _refuse_nested(value, key, key)
            out[key] = Leaf(path, check_value(dict(value) if isinstance(value, Mapping) else value, key) if check else value)


def _refuse_nested(value: object, key: str, where: str) -> None:
    """Refuse tensors and bytes inside a value (lists and dicts of data, at
    any depth), saying where: ``key[1][0]``, ``key.name``."""
    if isinstance(value, Mapping):
        items = ((f"{where}.{k}", v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    else:
        return
    for at, v in items:
        if is_tensor_leaf(v):
            raise UnsupportedValueError(
                f"{key!r}: a tensor at {at} (inside a {type(value).__name__}); tensors go in dicts, not lists: "
                "use a dict instead, e.g. {'0': t0, '1': t1}"
            )
        if isinstance(v, (bytes, bytearray, memoryview)):
            raise UnsupportedValueError(
                f"{key!r}: {type(v).__name__} at {at} (inside a {type(value).__name__}); values are JSON, which has no "
                "bytes: store them as a uint8 tensor under a dict key, e.g. "
                "torch.frombuffer(bytearray(data), dtype=torch.uint8)"
            )
        _refuse_nested(v, key, at)


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
