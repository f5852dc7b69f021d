"""Load: resharding happens here. Every rank matches its target state against
the checkpoint index, then reads, for each tensor leaf, exactly the box it
wants (its DTensor shard, its ShardedTensor box, or the whole tensor) straight
into the target's memory. Only the inner chunks overlapping that box are
fetched; no rank materializes more than its own target.

Collectives: one broadcast of the root metadata from rank 0 (so thousands of
ranks do not all read it), one all-gather of key mismatches and target
problems (so every rank makes the same strict decision, and a bad target on
one rank fails every rank before anyone reads), and one all-gather of the
outcome of the reads (a corrupt chunk read by one rank fails every rank);
none for the data itself.
"""

from __future__ import annotations

import collections
import itertools
import time
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts
import torch

from ..adapters import registry
from ..adapters.sharded import local_part
from ..adapters.state import flatten, set_leaf
from ..checkpoint import open_pinned, parse_root_bytes
from ..errors import IncompatibleStateError, TensorckptError
from ..format import dtypes
from ..format.metadata import TensorEntry
from ..layout.boxes import Box, bytes_fetched
from ..storage import direct, location
from ..storage.backend import backend_for
from ..storage.reader import StoredArrays, wait
from .group import Group

IN_FLIGHT_BYTES = 128 << 20  # reads issued ahead of the oldest unfinished one
SLAB_BYTES = 32 << 20  # the largest buffer one read fills (targets it cannot fill directly, casts)
SMALL_BYTES = 256 << 10  # a tensor read straight into its target up to this size joins a batch of reads ...
BATCH = 64  # ... of at most this many tensors, one job of the reader's threads (direct.Pool.read_batch)


class RootMessage(NamedTuple):
    """Rank 0 -> every rank: the root ``zarr.json`` bytes of the version it
    resolved, and that version's directory id (spec 10.7)."""

    raw: bytes
    version: tuple[int, int] | None  # local: the directory's (st_dev, st_ino); None elsewhere


class KeyReport(NamedTuple):
    """Every rank -> every rank: the keys its target names that the
    checkpoint lacks, and the stored keys its target does not name."""

    missing: list[str]
    unexpected: list[str]


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
    state: MutableMapping,
    path: location.PathArg,
    *,
    process_group: Any = None,
    strict: bool = True,
    partial: bool = False,
    cast: bool = False,
    stats: LoadStats | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> MutableMapping:
    """Fill ``state`` in place from the checkpoint at ``path`` and return it.

    Each tensor leaf receives the stored data of its key: a plain tensor the
    whole tensor, a DTensor its local shard under its own placements, a
    :class:`~tensorckpt.ShardedTensor` its box, whatever layout wrote the
    checkpoint. Global shapes must match. Every other leaf is replaced by the
    stored value.

    ``strict`` (default): a key present on one side only is an
    :class:`IncompatibleStateError`; with ``strict=False`` it is reported (a
    warning) and skipped. ``partial=True``: the checkpoint may hold more than
    the state names; its entries the state does not name are ignored without
    a warning (keys the state names but the checkpoint lacks still fail when
    ``strict``). Dtypes must match, unless ``cast=True``: then each stored
    dtype is converted to the target's (float32 -> bfloat16, bfloat16 ->
    float32, int32 -> int64, ...; a conversion across kinds, such as float to
    int or complex to real, is refused), through bounded buffers of the
    stored dtype.

    A collective when distributed: a failure on any rank (a bad target
    shape, a corrupt chunk) raises on every rank the same error, naming
    every failing rank. Pass a :class:`LoadStats` as ``stats`` to learn the
    bytes read versus needed on this rank.

    Every rank reads the one version of the checkpoint that rank 0 found at
    ``path`` (spec 10.7). If a replace or a deletion of the checkpoint
    overlaps the load so that this version cannot be read whole, the load
    raises :class:`~tensorckpt.errors.CheckpointChangedError` (tensors of
    ``state`` may then hold part of that version): load again.
    """
    t0 = time.perf_counter()
    g = Group(process_group)
    loc = location.parse(path, storage_options)
    what = f"load from {loc}"
    if g.distributed and not backend_for(loc).shared:
        raise TensorckptError(f"{loc}: memory:// stores are per process; a distributed load needs a shared file path")
    held: dict = {}

    def root(_: list) -> RootMessage:
        held["pin"], raw = open_pinned(loc)  # rank 0 resolves the version every rank reads (spec 10.7)
        return RootMessage(raw, held["pin"].dir_id)

    raw, version = g.collective(None, root, what=what)
    ckpt = StoredArrays(loc, parse_root_bytes(loc, raw), held.get("pin"), raw)  # the same bytes everywhere
    try:
        return _load(state, ckpt, g, version, strict, partial, cast, stats, t0)
    finally:
        ckpt.close()


def _load(state: MutableMapping, ckpt: StoredArrays, g: Group, version: tuple[int, int] | None, strict: bool,
          partial: bool, cast: bool, stats: LoadStats | None, t0: float) -> MutableMapping:
    what = f"load from {ckpt.location}"
    index = ckpt.index
    ctx = registry.Context(state, g.rank, g.size, strict=strict, partial=partial)
    prepared: dict = {}

    def prepare() -> KeyReport:
        ckpt.same_version(version)  # every rank reads the directory rank 0 resolved, or all fail
        plain, finish = registry.for_load(state, index, ctx)  # objects (modules, ...) load through plain targets
        targets = flatten(plain, False)
        stored = set(index.tensors) | set(index.values)
        prepared.update(plain=plain, finish=finish, targets=targets, reads=_targets(ckpt, targets, cast))
        return KeyReport(sorted(set(targets) - stored), sorted(stored - set(targets)))

    everyone: list[KeyReport] = g.collective(prepare, what=what)
    # a key is unexpected only if no rank wants it (pipeline stages hold disjoint keys)
    missing = sorted(set().union(*(set(r.missing) for r in everyone)))
    unexpected = [] if partial else sorted(set.intersection(*(set(r.unexpected) for r in everyone)))
    if missing or unexpected:
        msg = f"{ckpt.path}: state and checkpoint differ: " + "; ".join(
            f"{name}: {_list(keys)}" for name, keys in (("missing in checkpoint", missing), ("not in state", unexpected)) if keys
        )
        if strict:
            hint = "Pass strict=False to load the keys both have" + (
                "" if missing else ", or partial=True to load a part of the checkpoint"
            )
            raise IncompatibleStateError(f"{msg}. {hint}")
        warnings.warn(msg + " (skipped, strict=False)", stacklevel=3)

    stats = stats if stats is not None else LoadStats()
    stats.seconds["plan"] = time.perf_counter() - t0

    def read() -> None:
        with ckpt.one_version():  # a replace during the reads: CheckpointChangedError, never mixed data
            _read_into(ckpt, prepared["reads"], stats)
        plain = prepared["plain"]
        for key, leaf in prepared["targets"].items():
            if key in index.values:
                set_leaf(plain, leaf.path, index.values[key])
        prepared["finish"](plain)

    g.collective(read, what=what)
    return state


def _targets(ckpt: StoredArrays, targets: dict, cast: bool) -> dict[str, tuple[torch.Tensor, Box]]:
    """The tensor reads of this rank: key -> (target's local tensor, its box);
    refuses a leaf of the wrong kind, shape or (without ``cast``) dtype."""
    index = ckpt.index
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
        name = dtypes.torch_name(t.dtype)
        if shape != e.shape or (name != e.dtype and not cast):
            raise IncompatibleStateError(
                f"{ckpt.path}: tensor {key!r} is stored as {list(e.shape)} {e.dtype} but the state "
                f"wants {list(shape)} {name}"
                + ("" if shape != e.shape else f"; pass cast=True to convert {e.dtype} to {name} on load")
            )
        if name != e.dtype:
            dtypes.for_torch(t.dtype, key)
            if not torch.can_cast(e.torch_dtype, t.dtype):
                raise IncompatibleStateError(
                    f"{ckpt.path}: tensor {key!r} is stored as {e.dtype}; cast=True converts within a kind or "
                    f"to a wider one, not {e.dtype} to {name}: load it into a {e.dtype} tensor and convert it yourself"
                )
        reads[key] = (t, box)
    return reads


def _slabs(e: TensorEntry, box: Box, itemsize: int) -> list[tuple[slice, Box]]:
    """``box`` cut along its first dimension into parts of at most
    ``SLAB_BYTES`` (one row at least), cut at multiples of the inner chunks'
    first dimension, so no stored inner chunk is decoded twice more than it
    must: (rows of the box, the part's box)."""
    if not box.shape or box.numel * itemsize <= SLAB_BYTES:
        return [(slice(None), box)]
    row = box.numel // box.shape[0] * itemsize
    step = max(1, SLAB_BYTES // max(row, 1))
    inner = e.inner_chunk_shape[0]
    if step >= inner:
        step -= step % inner
    start, end = box.offset[0], box.end[0]
    cuts = [start, *range(-(-(start + 1) // step) * step, end, step), end]
    out = []
    for a, b in itertools.pairwise(cuts):
        if b > a:
            out.append((slice(a - start, b - start), Box((a, *box.offset[1:]), (b - a, *box.shape[1:]))))
    return out


def _read_into(ckpt: StoredArrays, targets: dict[str, tuple[torch.Tensor, Box]], stats: LoadStats) -> None:
    """Read every target box, straight into the target's memory when it is a
    CPU tensor numpy can view and has the stored dtype, else into buffers of
    the stored dtype (at most ``SLAB_BYTES`` each) that are copied over, with
    conversion, as soon as their read is done. Reads are issued ahead up to
    ``IN_FLIGHT_BYTES`` of such buffers, so memory stays bounded whatever the
    state's size. Where the backend has it (``fast_reads``: local files, S3,
    memory://, fsspec) tensorckpt's own codec reads
    (:mod:`tensorckpt.storage.direct`: same bytes, the chunk digests of 1.3
    checked, less CPU), else TensorStore."""
    t0 = time.perf_counter()
    ckpt.check_arrays(list(targets))
    backend = backend_for(ckpt.location)
    fast = backend.fast_reads
    slow = [k for k in targets if not (fast and direct.usable(ckpt.index.tensors[k]))]
    srcs = ckpt.open_arrays(slow)
    pool = backend.chunk_reader(ckpt.read_location, ckpt.path) if len(slow) < len(targets) else None
    pending: collections.deque = collections.deque()
    in_flight, copy_seconds = 0, 0.0
    batch: list[tuple[str, TensorEntry, Box, np.ndarray, list[str] | None]] = []

    def issue_batch() -> None:
        if batch and pool is not None:
            pending.append((None, [pool.read_batch(batch)], 0, None, None, None))
            batch.clear()

    def finish_oldest() -> None:
        nonlocal in_flight, copy_seconds
        key, futures, nbytes, t, buf, stored = pending.popleft()
        for fut in futures:
            fut.result() if key not in srcs else wait(ckpt.path, key, fut)
        in_flight -= nbytes
        if buf is not None:
            c = time.perf_counter()
            with torch.no_grad():
                t.copy_(dtypes.from_numpy(buf, stored))  # converts the dtype when cast
            copy_seconds += time.perf_counter() - c

    try:
        for key, (t, box) in targets.items():
            e = ckpt.index.tensors[key]
            stored = e.dtype_info
            itemsize = stored.itemsize
            need, got = box.numel * itemsize, bytes_fetched(e.shape, e.inner_chunk_shape, box, itemsize)
            stats.bytes_needed += need
            stats.bytes_read += got
            stats.tensors += 1
            stats.per_tensor[key] = (need, got)
            if box.numel == 0:
                continue
            ckpt.check_objects(key, box, codec=key not in srcs)
            into = (
                t.device.type == "cpu" and not t.requires_grad and not t.is_conj() and not t.is_neg()
                and dtypes.torch_name(t.dtype) == e.dtype
            )
            if into and pool is not None and key not in srcs and need <= SMALL_BYTES:
                batch.append((key, e, box, dtypes.to_numpy(t), ckpt.chunk_digests(key)))
                if len(batch) >= BATCH:
                    issue_batch()
                continue
            parts = [(slice(None), box)] if into else _slabs(e, box, itemsize)
            for rows, part in parts:
                sub = t if part is box else t[rows]
                buf = None
                if into:
                    dst = dtypes.to_numpy(t)
                else:
                    dst = buf = np.empty(part.shape, dtype=stored.numpy)
                held = bytes_fetched(e.shape, e.inner_chunk_shape, part, itemsize) if (buf is not None or key in srcs) else 0
                if buf is not None:
                    held += part.numel * itemsize  # TensorStore holds what it decodes; the buffer too
                while pending and in_flight + held > IN_FLIGHT_BYTES:
                    finish_oldest()
                futures: list[Any]
                if pool is not None and key not in srcs:
                    futures = pool.read(key, e, part, dst, ckpt.chunk_digests(key))
                else:
                    src = srcs[key][part.slices()] if part.shape else srcs[key]
                    futures = [ts.array(dst, copy=False, write=True).write(src)]
                pending.append((key, futures, held, sub, buf, stored))
                in_flight += held
        issue_batch()
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
