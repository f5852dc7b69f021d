"""Distributed tensor leaves -> (local data, global shape, box).

Three kinds of tensor leaf say which part of a logical tensor a rank holds
(when saving) or wants (when loading):

- ``DTensor`` with ``Shard(d)`` / ``Replicate()`` placements on a 1- to 3-D
  mesh (FSDP2, tensor parallelism, 2-D meshes);
- :class:`ShardedTensor`, the explicit-offset contract for frameworks without
  DTensor (Megatron-style TP/PP);
- a plain tensor: the whole tensor (replicated on every rank that passes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UnsupportedValueError
from ..layout.boxes import Box

try:  # DTensor is optional: torch builds without distributed lack it
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover
    DTensor = Replicate = Shard = None


@dataclass(frozen=True)
class ShardedTensor:
    """This rank's box ``[global_offset, global_offset + local.shape)`` of the
    logical tensor of shape ``global_shape`` named by its key."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.local, torch.Tensor):
            raise UnsupportedValueError("ShardedTensor.local must be a torch.Tensor")
        object.__setattr__(self, "global_shape", tuple(int(s) for s in self.global_shape))
        object.__setattr__(self, "global_offset", tuple(int(s) for s in self.global_offset))
        n = len(self.global_shape)
        if self.local.dim() != n or len(self.global_offset) != n:
            raise UnsupportedValueError(
                f"ShardedTensor: local shape {list(self.local.shape)}, global_shape {list(self.global_shape)} "
                f"and global_offset {list(self.global_offset)} must have the same number of dimensions"
            )
        if any(o < 0 or o + s > g for o, s, g in zip(self.global_offset, self.local.shape, self.global_shape)):
            raise UnsupportedValueError(
                f"ShardedTensor: box at {list(self.global_offset)} of shape {list(self.local.shape)} "
                f"exceeds global_shape {list(self.global_shape)}"
            )

    @property
    def box(self) -> Box:
        return Box(self.global_offset, tuple(self.local.shape))


def is_tensor_leaf(value: object) -> bool:
    return isinstance(value, (torch.Tensor, ShardedTensor))


def local_part(key: str, value) -> tuple[torch.Tensor, tuple[int, ...], Box]:
    """(local tensor, global shape, box) of a tensor leaf on this rank."""
    if isinstance(value, ShardedTensor):
        return value.local, value.global_shape, value.box
    if DTensor is not None and isinstance(value, DTensor):
        for p in value.placements:
            if type(p) not in (Shard, Replicate):
                raise UnsupportedValueError(
                    f"{key!r}: DTensor placement {p} is not supported; use Shard(d) or Replicate() "
                    "(redistribute() a Partial tensor first)"
                )
        shape = tuple(value.shape)
        local = value.to_local()
        lshape, offset = compute_local_shape_and_global_offset(shape, value.device_mesh, value.placements)
        if tuple(local.shape) != tuple(lshape):
            raise UnsupportedValueError(
                f"{key!r}: DTensor local shard {list(local.shape)} differs from its placements' {list(lshape)}"
            )
        if 0 in lshape:  # an empty shard of an uneven split: holds nothing
            offset = tuple(0 for _ in shape)
        return local, shape, Box(tuple(offset), tuple(lshape))
    if isinstance(value, torch.Tensor):
        return value, tuple(value.shape), Box.full(value.shape)
    raise UnsupportedValueError(f"{key!r}: not a tensor")
