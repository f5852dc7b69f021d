"""Loading into modules built on the meta device (``torch.device("meta")``,
then e.g. ``fully_shard``): their tensors have no memory to read into.

The module adapter reads into :func:`materialized` targets instead (new,
uninitialised tensors of the same layout) and, inside :func:`assigning`,
hands them to the module with ``load_state_dict(..., assign=True)``. Tied
parameters (one tensor under several names) stay tied; tensors no
checkpoint holds (non-persistent buffers) are named in a warning. A bare meta
tensor outside a module is refused by :func:`tensorckpt.adapters.sharded.local_part`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from itertools import chain

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[misc,assignment]  # absent in this torch build


def materialized(state: Mapping) -> dict:
    """``state`` (a module's ``state_dict()``) with every tensor on the meta
    device replaced by a new, uninitialised one of the same layout, for a load
    to fill: a DTensor keeps its mesh and placements, its local tensor
    allocated on the mesh's device type; a plain tensor goes to the CPU.
    Tensors shared by several keys (tied weights) stay shared."""
    out, made = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.is_meta:
            if id(value) not in made:
                made[id(value)] = _allocate(value)
            value = made[id(value)]
        out[key] = value
    return out


def _allocate(value: torch.Tensor) -> torch.Tensor:
    if DTensor is not None and isinstance(value, DTensor):
        mesh = value.device_mesh
        local = torch.empty(value.to_local().shape, dtype=value.dtype, device=mesh.device_type)
        return DTensor.from_local(local, mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride())
    return torch.empty(value.shape, dtype=value.dtype, device="cpu")


@contextlib.contextmanager
def assigning(module: torch.nn.Module, where: Callable[[], str]) -> Iterator[bool]:
    """``with assigning(module, where) as assign: module.load_state_dict(loaded, assign=assign)``.
    ``assign`` is whether the module has tensors on meta; if so, parameters
    tied before the load are tied again after it (``assign=True`` gives each
    name its own Parameter), and tensors left on meta are warned about."""
    named = list(chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)))
    if not any(t.is_meta for _, t in named):
        yield False
        return
    ties: dict[int, list[str]] = {}
    for name, t in module.named_parameters(remove_duplicate=False):
        ties.setdefault(id(t), []).append(name)
    yield True
    for names in (n for n in ties.values() if len(n) > 1):
        first = module.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, first)
    left = [n for n, t in chain(module.named_parameters(), module.named_buffers()) if t.is_meta]
    if left:
        warnings.warn(
            f"{where()!r}: loaded, but {left[:10]}{' and more' if len(left) > 10 else ''} are still on the meta "
            "device: they are not in the module's state_dict() (non-persistent buffers), so no checkpoint holds "
            "them. Compute them again (e.g. the module's own initialisation) before use",
            stacklevel=5,
        )
