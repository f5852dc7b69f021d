"""Checks of the replication assumption a save makes.

A plain tensor in a rank's state is taken to be the whole tensor, the same on
every rank that passes it, and is written once (by one of its holders). A
value is likewise written once, from the lowest rank holding it. Where that
is not true (FSDP1's flat shards, which have the same shape on every rank; a
per-rank counter), the checkpoint would silently hold one rank's data for
all. So each rank sends a CRC-32C digest of each plain tensor it holds (the
values travel whole anyway), and rank 0 compares them before anything is
written; the save fails naming the key and the ranks that differ.

Cost: one CRC-32C pass over every plain tensor on every rank holding it
(hardware CRC-32C; a device-to-host copy first for accelerator tensors), on
every save, plan-cache hits included.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import numpy as np
import torch

from ..errors import IncompatibleStateError, UnsupportedValueError
from ..format import dtypes
from ..storage import codec

FlatParameter: type[torch.Tensor] | None  # FSDP1's flat parameter (torch builds without distributed lack it)
DTensor: type[torch.Tensor] | None
try:
    from torch.distributed.fsdp._flat_param import FlatParameter as _FlatParameter

    FlatParameter = _FlatParameter
except ImportError:  # pragma: no cover
    FlatParameter = None

try:
    from torch.distributed.tensor import DTensor as _DTensor

    DTensor = _DTensor
except ImportError:  # pragma: no cover
    DTensor = None

FLAT_PARAM_NAME = "_flat_param"  # FSDP1's name for its flat parameters (FLAT_PARAM in torch)

WHAT_TO_DO = (
    "a plain tensor or value is stored once, as if every rank held the same; for a tensor sharded across "
    "ranks pass a DTensor or tensorckpt.ShardedTensor(local, global_shape, global_offset), for data that "
    "differs by rank wrap it in tensorckpt.per_rank(...)"
)


def is_plain(value: object) -> bool:
    """A tensor leaf saved as the whole tensor, replicated (not a DTensor,
    tensorckpt ShardedTensor or torch's legacy ShardedTensor)."""
    if not isinstance(value, torch.Tensor):
        return False
    if DTensor is not None and isinstance(value, DTensor):
        return False
    return not type(value).__module__.startswith("torch.distributed._shard")


def check_not_flat(key: str, value: object) -> None:
    """Refuse FSDP1's flat parameters (``use_orig_params=False``) and state
    keyed by them: each rank holds a different flat shard of the same shape,
    which is not a replica and has no logical shape to reshard."""
    flat = FlatParameter is not None and isinstance(value, FlatParameter)
    if flat or any(FLAT_PARAM_NAME in part.split(".") for part in key.split("/")):
        raise UnsupportedValueError(
            f"{key!r}: an FSDP1 flat parameter (FullyShardedDataParallel with use_orig_params=False), or state "
            "keyed by one: each rank holds a different flat shard, which tensorckpt cannot reshard or store as "
            "one tensor. Wrap the model with use_orig_params=True, use FSDP2 (fully_shard), or save "
            "model.state_dict() under FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)"
        )


def digest(t: torch.Tensor) -> int:
    """CRC-32C of a tensor's bytes (C order)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    n = t.numel() * t.element_size()
    if n == 0:
        return 0
    if codec.crc32c_at is not None:
        return int(codec.crc32c_at(0, t.data_ptr(), n))
    return zlib.crc32(np.ascontiguousarray(dtypes.to_numpy(t)).view(np.uint8).data)  # pragma: no cover


def digests_of(leaves: Mapping, rank: int) -> dict[str, int]:
    """The digest of every plain tensor among ``leaves`` (flat key -> Leaf)."""
    return {
        key: digest(leaf.value)
        for key, leaf in leaves.items()
        if leaf.is_tensor and is_plain(leaf.value) and not leaf.value.is_meta  # meta: held by other ranks
    }


def check_replicas(digests: list[Mapping[str, int]]) -> None:
    """Rank 0: ``digests[r]`` are rank r's; a key whose digests differ fails
    the save, naming the key and which ranks hold which copy."""
    by_key: dict[str, dict[int, list[int]]] = {}
    for rank, ds in enumerate(digests):
        for key, d in (ds or {}).items():
            by_key.setdefault(key, {}).setdefault(d, []).append(rank)
    bad = sorted(k for k, groups in by_key.items() if len(groups) > 1)
    if not bad:
        return
    shown = []
    for key in bad[:5]:
        groups = sorted(by_key[key].values())
        shown.append(f"{key!r}: " + " vs ".join(f"ranks {g}" if len(g) > 1 else f"rank {g[0]}" for g in groups))
    more = f" and {len(bad) - 5} more keys" if len(bad) > 5 else ""
    raise IncompatibleStateError(
        "plain tensors differ across the ranks that hold them (they would be stored once, from one rank): "
        + "; ".join(shown) + more + f". Nothing was written. {WHAT_TO_DO}"
    )
