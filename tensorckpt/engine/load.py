"""Load: resharding happens here. Every rank matches its target state against
the checkpoint index, then reads, for each tensor leaf, exactly the box it
wants (its DTensor shard, its ShardedTensor box, or the whole tensor) straight
into the target's memory. Only the inner chunks overlapping that box are
fetched; no rank materializes more than its own target.

Collectives: one broadcast of the root metadata from rank 0 (so thousands of
ranks do not all read it) and one all-gather of key mismatches (so every rank
makes the same strict decision); none for the data.
"""

from __future__ import annotations

import collections
import time
import warnings
from collections.abc import MutableMapping
from dataclasses import dataclass, field

import numpy as np
import tensorstore as ts
import torch

from ..adapters import registry
from ..adapters.sharded import local_part
from ..adapters.state import flatten, set_leaf
from ..checkpoint import Checkpoint, parse_root_bytes, read_root_bytes, wait
from ..errors import IncompatibleStateError, TensorckptError
from ..format import dtypes
from ..layout.boxes import Box, bytes_fetched
from ..storage import direct, location
from .group import Group, capture, reraise


IN_FLIGHT_BYTES = 128 << 20  # reads issued ahead of the oldest unfinished one


@dataclass
class LoadStats:
    """What one rank's load read: ``bytes_needed`` (its target boxes) and
    ``bytes_read`` (the stored inner chunks those boxes overlap, decoded
    whole). ``read_amplification`` is their ratio (1.0 is ideal).
    ``seconds`` maps each phase to wall time on this rank: ``plan`` (root
    metadata, key matching, target boxes), ``read`` (fetch, checksum,
    decode, straight into the targets) and ``copy`` (into targets the reads
    could not fill directly: CUDA, autograd or conjugate views)."""

    bytes_needed: int = 0
    bytes_read: int = 0
    tensors: int = 0
    per_tensor: dict[str, tuple[int, int]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def read_amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


def load(
    state: MutableMapping, path, *, process_group=None, strict: bool = True, stats: LoadStats | None = None
) -> MutableMapping:
    """Fill ``state`` in place from the checkpoint at ``path`` and return it.

    Each tensor leaf receives the stored data of its key: a plain tensor the
    whole tensor, a DTensor its local shard under its own placements, a
    :class:`~tensorckpt.ShardedTensor` its box, whatever layout wrote the
    checkpoint. Global shape and dtype must match. Every other leaf is
    replaced by the stored value. With ``strict``, a key present on one side
    only is an :class:`IncompatibleStateError`; otherwise it is reported (a
    warning) and skipped. Pass a :class:`LoadStats` as ``stats`` to learn the
    bytes read versus needed on this rank.
    """
    t0 = time.perf_counter()
    g = Group(process_group)
    loc = location.parse(path)
    if g.distributed and not loc.is_local:
        raise TensorckptError(f"{loc}: memory:// stores are per process; a distributed load needs a shared file path")
    raw, err = capture(read_root_bytes, loc) if g.rank == 0 else (None, None)
    raw, err = g.broadcast((raw, err))
    reraise(err)
    ckpt = Checkpoint(loc, _root=parse_root_bytes(loc, raw))
    index = ckpt.index
    user_state = state  # objects in it (modules, optimizers, ...) are loaded through plain targets
    prepared, err = capture(registry.for_load, state, index, registry.Context(state, g.rank, g.size))
    state, finish = prepared if err is None else ({}, None)
    targets, err = capture(flatten, state, False) if err is None else (None, err)
    stored = set(index.tensors) | set(index.values)
    missing = sorted(set(targets or ()) - stored)
    unexpected = sorted(stored - set(targets or ()))
    if g.distributed:  # a key is unexpected only if no rank wants it (pipeline stages hold disjoint keys)
        everyone = g.all_gather((missing, unexpected, err))
        for rank, (_, _, e) in enumerate(everyone):
            reraise(e, rank)
        missing = sorted(set().union(*(m for m, _, _ in everyone)))
        unexpected = sorted(set.intersection(*(set(u) for _, u, _ in everyone)))
    reraise(err)
    if missing or unexpected:
        msg = f"{ckpt.path}: state and checkpoint differ: " + "; ".join(
            f"{name}: {_list(keys)}" for name, keys in (("missing in checkpoint", missing), ("not in state", unexpected)) if keys
        )
        if strict:
            raise IncompatibleStateError(msg + ". Pass strict=False to load the keys both have")
        warnings.warn(msg + " (skipped, strict=False)", stacklevel=2)

    reads: dict[str, tuple[torch.Tensor, Box]] = {}
    for key, leaf in targets.items():
        if key in index.values:
            if leaf.is_tensor:
                raise IncompatibleStateError(f"{ckpt.path}: {key!r} is a tensor in the state but a value in the checkpoint")
            continue
        if key not in index.tensors:
            continue
        if not leaf.is_tensor:
            raise IncompatibleStateError(
                f"{ckpt.path}: {key!r} is a tensor in the checkpoint but a {type(leaf.value).__name__} in the "
                "state; put a tensor of the stored shape and dtype there (see Checkpoint.info)"
            )
        e = index.tensors[key]
        t, shape, box = local_part(key, leaf.value)
        if shape != e.shape or dtypes.torch_name(t.dtype) != e.dtype:
            raise IncompatibleStateError(
                f"{ckpt.path}: tensor {key!r} is stored as {list(e.shape)} {e.dtype} but the state "
                f"wants {list(shape)} {dtypes.torch_name(t.dtype)}"
            )
        reads[key] = (t, box)
    stats = stats if stats is not None else LoadStats()
    stats.seconds["plan"] = time.perf_counter() - t0
    _read_into(ckpt, reads, stats)
    for key, leaf in targets.items():
        if key in index.values:
            set_leaf(state, leaf.path, index.values[key])
    finish(state)
    return user_state


def _read_into(ckpt: Checkpoint, targets: dict[str, tuple[torch.Tensor, Box]], stats: LoadStats) -> None:
    """Read every target box, straight into the target's memory when it is a
    CPU tensor numpy can view, else into a buffer that is copied over as soon
    as its read is done. Reads are issued ahead up to ``IN_FLIGHT_BYTES`` of
    such buffers, so memory stays bounded whatever the state's size. A local
    checkpoint is read by :mod:`tensorckpt.storage.direct` (same bytes and
    checks, less CPU), any other through TensorStore."""
    t0 = time.perf_counter()
    ckpt.check_arrays(list(targets))
    fast = direct.available(ckpt.location.is_local)
    slow = [k for k in targets if not (fast and direct.usable(ckpt.index.tensors[k]))]
    srcs = ckpt.open_arrays(slow)
    pool = direct.Pool(ckpt.location.path, ckpt.path) if len(slow) < len(targets) else None
    pending: collections.deque = collections.deque()
    in_flight, copy_seconds = 0, 0.0

    def finish_oldest() -> None:
        nonlocal in_flight, copy_seconds
        key, futures, nbytes, t, buf = pending.popleft()
        for fut in futures:
            fut.result() if key not in srcs else wait(ckpt.path, key, fut)
        in_flight -= nbytes
        if buf is not None:
            c = time.perf_counter()
            with torch.no_grad():
                t.copy_(dtypes.from_numpy(buf, dtypes.for_torch(t.dtype)))
            copy_seconds += time.perf_counter() - c

    try:
        for key, (t, box) in targets.items():
            e = ckpt.index.tensors[key]
            itemsize = dtypes.BY_TORCH[e.dtype].itemsize
            need, got = box.numel * itemsize, bytes_fetched(e.shape, e.inner_chunk_shape, box, itemsize)
            stats.bytes_needed += need
            stats.bytes_read += got
            stats.tensors += 1
            stats.per_tensor[key] = (need, got)
            if box.numel == 0:
                continue
            ckpt.check_objects(key, box)
            buf = None
            if t.device.type == "cpu" and not t.requires_grad and not t.is_conj() and not t.is_neg():
                dst = dtypes.to_numpy(t)
            else:
                dst = buf = np.empty(tuple(t.shape), dtype=dtypes.for_torch(t.dtype).numpy)
            held = got if (buf is not None or key in srcs) else 0  # TensorStore holds what it decodes
            while pending and in_flight + held > IN_FLIGHT_BYTES:
                finish_oldest()
            if key in srcs:
                src = srcs[key][box.slices()] if box.shape else srcs[key]
                futures = [ts.array(dst, copy=False, write=True).write(src)]
            else:
                futures = pool.read(key, e, box, dst)
            pending.append((key, futures, held, t, buf))
            in_flight += held
        while pending:
            finish_oldest()
    finally:
        if pool is not None:
            pool.close()
    stats.seconds["read"] = time.perf_counter() - t0 - copy_seconds
    stats.seconds["copy"] = copy_seconds


def _list(keys: list[str], limit: int = 20) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
