"""Distributed tensor leaves -> (local data, global shape, box).

Four kinds of tensor leaf say which part of a logical tensor a rank holds
(when saving) or wants (when loading):

- ``DTensor`` with ``Shard(d)`` / ``_StridedShard(d, sf)`` / ``Replicate()``
  placements on a 1- to 3-D mesh (FSDP2, tensor parallelism, FSDP2 over
  tensor parallelism, HSDP x TP);
- :class:`ShardedTensor`, the explicit-offset contract for frameworks without
  DTensor (Megatron-style TP/PP);
- torch's legacy ``torch.distributed._shard.sharded_tensor.ShardedTensor``
  (FSDP1 ``SHARDED_STATE_DICT``) holding at most one local shard;
- a plain tensor: the whole tensor (replicated on every rank that passes it).

A rank's part of a tensor is one box (spec/format-v1.md 8.4). Shard and
Replicate placements always give one, and so do the ``_StridedShard``
placements FSDP2 builds (its split factor is the number of shards the later
mesh dimensions cut the same tensor dimension into: those cut first). Other
``_StridedShard`` placements, and a torch ShardedTensor with several local
shards on one rank, are refused, naming the key, rather than stored wrongly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedValueError
from ..layout.boxes import Box

try:  # DTensor is optional: torch builds without distributed lack it
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover
    DTensor = Replicate = Shard = None  # type: ignore[misc,assignment]  # absent in this torch build

try:  # private in torch: FSDP2 over tensor parallelism places parameters with it
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover
    _StridedShard = None  # type: ignore[misc,assignment]  # absent in this torch build

try:  # torch's legacy ShardedTensor (deprecated by torch, still written by FSDP1)
    from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
except ImportError:  # pragma: no cover
    TorchShardedTensor = None  # type: ignore[misc,assignment]  # absent in this torch build


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


def local_part(key: str, value: object) -> tuple[torch.Tensor, tuple[int, ...], Box]:
    """(local tensor, global shape, box) of a tensor leaf on this rank."""
    if isinstance(value, ShardedTensor):
        return _not_meta(key, value.local), value.global_shape, value.box
    if DTensor is not None and isinstance(value, DTensor):
        return _dtensor_part(key, value)
    if TorchShardedTensor is not None and isinstance(value, TorchShardedTensor):
        return _legacy_part(key, value)
    if isinstance(value, torch.Tensor):
        return _not_meta(key, value), tuple(value.shape), Box.full(value.shape)
    raise UnsupportedValueError(f"{key!r}: not a tensor")


def saved_part(key: str, value: object, elsewhere: bool) -> tuple[torch.Tensor, tuple[int, ...], Box]:
    """:func:`local_part` for a save. With ``elsewhere`` (a distributed save),
    a tensor on the meta device holds no data on this rank (e.g. the layers of
    other pipeline stages in a model built on meta, only this stage
    materialised), so it is an empty box of its logical tensor; some other
    rank must hold the data (the plan checks that every element is held).
    In one process it is refused, as by :func:`local_part`."""
    if not elsewhere or (TorchShardedTensor is not None and isinstance(value, TorchShardedTensor)):
        return local_part(key, value)
    if isinstance(value, ShardedTensor):
        local, shape = value.local, value.global_shape
    elif isinstance(value, torch.Tensor):
        local = value.to_local() if DTensor is not None and isinstance(value, DTensor) else value
        shape = tuple(value.shape)
    else:
        return local_part(key, value)  # not a tensor: refused there
    if local.is_meta:
        if not shape:
            _not_meta(key, local)  # a 0-d tensor has no empty box: refused
        empty = (0,) * len(shape)
        return torch.empty(empty, dtype=local.dtype), shape, Box(empty, empty)
    return local_part(key, value)


def _not_meta(key: str, t: torch.Tensor) -> torch.Tensor:
    if t.is_meta:
        raise UnsupportedValueError(
            f"{key!r}: the tensor is on the meta device, so it has no data: nothing can be saved from it or "
            "loaded into it. Allocate it first (module.to_empty(device=...)), or, to load, put the "
            "torch.nn.Module itself in the state: tensorckpt then allocates its meta parameters and buffers "
            "with the same layout and assigns the loaded tensors to it"
        )
    return t


def _dtensor_part(key: str, value: DTensor) -> tuple[torch.Tensor, tuple[int, ...], Box]:
    for p in value.placements:
        if type(p) not in (Shard, Replicate) and not _is_strided(p):
            raise UnsupportedValueError(
                f"{key!r}: DTensor placement {p} is not supported; use Shard(d), _StridedShard(d) or "
                "Replicate() (redistribute() a Partial tensor first)"
            )
    shape = tuple(value.shape)
    local = _not_meta(key, value.to_local())
    coordinate = value.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh: it holds nothing
        return local, shape, Box((0,) * len(shape), (0,) * len(shape))
    box = mesh_box(key, shape, tuple(value.device_mesh.shape), coordinate, value.placements)
    lshape = box.shape
    if tuple(local.shape) != tuple(lshape):
        raise UnsupportedValueError(
            f"{key!r}: DTensor local shard {list(local.shape)} differs from its placements' {list(lshape)}"
        )
    if 0 in lshape:  # an empty shard of an uneven split: holds nothing
        box = Box((0,) * len(shape), tuple(lshape))
    return local, shape, box


def mesh_box(
    key: str, shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: Sequence[int], placements: Sequence[Any]
) -> Box:
    """The box a mesh coordinate holds (spec/format-v1.md 8.4). ``Shard(d)``
    placements cut dimension ``d`` left to right, like torch's
    ``compute_local_shape_and_global_offset``; ``_StridedShard`` placements
    the way FSDP2 lays data out: ``_StridedShard(d, sf)`` on mesh dimension ``i`` shards dimension ``d``
    *after* the ``Shard(d)`` placements to its right whose mesh sizes
    multiply to ``sf`` (tensor parallelism shards first, FSDP then shards the
    local tensor). Every sharding of ``d`` keeps the ``torch.chunk`` piece of
    its rank, so the result is one box. Placements of another form (``sf``
    not matched by the shards to the right) are refused: they describe no
    layout FSDP2 builds."""
    by_dim: dict[int, list[int]] = {}  # tensor dimension -> the mesh dimensions sharding it, in mesh order
    for i, p in enumerate(placements):
        if isinstance(p, Shard) or _is_strided(p):
            by_dim.setdefault(p.dim, []).append(i)
    start, size = [0] * len(shape), list(shape)
    for d, ops in by_dim.items():
        for mesh_dim in _sharding_order(key, d, ops, mesh_shape, placements):
            n, r = mesh_shape[mesh_dim], coordinate[mesh_dim]
            piece = -(-size[d] // n)  # torch.chunk's piece size; the pieces past the end are empty
            start[d] += r * piece
            size[d] = max(0, min(piece, size[d] - r * piece))
    return Box(tuple(start), tuple(size))


def _sharding_order(
    key: str, d: int, ops: list[int], mesh_shape: tuple[int, ...], placements: Sequence[Any]
) -> list[int]:
    """The mesh dimensions ``ops`` sharding tensor dimension ``d`` (in mesh
    order), in the order they cut it: each ``_StridedShard`` after the
    shards to its right that its split factor counts."""
    if not any(_is_strided(placements[i]) for i in ops):
        return ops
    order, k = [], 0
    while k < len(ops):
        p = placements[ops[k]]
        if not _is_strided(p):
            order.append(ops[k])
            k += 1
            continue
        product, m = 1, k + 1
        while m < len(ops) and product < int(p.split_factor) and not _is_strided(placements[ops[m]]):
            product *= mesh_shape[ops[m]]
            m += 1
        if product != int(p.split_factor):
            raise UnsupportedValueError(
                f"{key!r}: DTensor placements {tuple(placements)} on a {list(mesh_shape)} mesh: {p} on mesh "
                f"dimension {ops[k]} is not followed by Shard({d}) placements over {p.split_factor} ranks in all, "
                "as FSDP2 over tensor parallelism makes them; tensorckpt stores one box per rank and tensor and "
                "this layout gives several. redistribute() the tensor to Shard/Replicate placements first"
            )
        order += ops[k + 1 : m] + [ops[k]]
        k = m
    return order


def _is_strided(p: object) -> bool:
    return _StridedShard is not None and isinstance(p, _StridedShard)


def _legacy_part(key: str, value: TorchShardedTensor) -> tuple[torch.Tensor, tuple[int, ...], Box]:
    shape = tuple(value.metadata().size)
    shards = value.local_shards()
    if len(shards) > 1:
        raise UnsupportedValueError(
            f"{key!r}: this rank holds {len(shards)} shards of a torch ShardedTensor; tensorckpt stores one box "
            "per rank and tensor. Use one shard per rank (ChunkShardingSpec with each rank once), a DTensor, "
            "or tensorckpt.ShardedTensor"
        )
    if not shards:  # more ranks than chunks: this rank holds nothing
        dtype = value.metadata().tensor_properties.dtype
        return torch.empty((0,) * len(shape), dtype=dtype), shape, Box((0,) * len(shape), (0,) * len(shape))
    local, md = shards[0].tensor, shards[0].metadata
    box = Box(tuple(int(o) for o in md.shard_offsets), tuple(int(s) for s in md.shard_sizes))
    if 0 in box.shape:  # an empty shard (more ranks than chunks): its offset may lie past the end
        box = Box((0,) * len(shape), box.shape)
    if tuple(local.shape) != box.shape or len(shape) != len(box.shape) or any(e > n for e, n in zip(box.end, shape)):
        raise UnsupportedValueError(
            f"{key!r}: torch ShardedTensor shard {list(local.shape)} at {list(box.offset)} does not match its "
            f"metadata {list(box.shape)} inside {list(shape)}"
        )
    return _not_meta(key, local), shape, box

