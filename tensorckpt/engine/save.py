"""Save: a collective over the process group (trivial in one process).

    every rank   flatten its state -> local plan (what it holds of each tensor),
                 a CRC-32C of each plain (replicated) tensor
    gather       local plans and digests -> rank 0                (collective 1)
    rank 0       replicas and values agree across ranks (engine/replicas.py),
                 global plan (chunk grids, one writer per stored object),
                 commit.begin (exists? where to write)
    broadcast    plan + commit decision, or an error              (collective 2)
    all-to-all   parts of boxes that chunks of other ranks need   (only if the
                 plan moves any, for irregular splits; see "exchange" below)
    every rank   write its boxes (or chunks), concurrently, each object's
                 digest computed as it is encoded; sync
    gather       success or error, and the digests -> rank 0     (collective 3)
    rank 0       every array's zarr.json (with its chunks' digests), then
                 commit (root zarr.json last, sealed: engine/seal.py), or abort
    broadcast    outcome                                          (collective 4)

Each step that may fail runs through ``Group.collective``: a failure on any
rank is raised on every rank, naming every failing rank. The number of
collectives is constant (4, or 5 with an exchange), whatever
the number of tensors. A save whose tensor layout (keys, shapes, dtypes,
boxes) is the same on every rank as in the previous successful save over the
same group reuses that save's plan (engine/plan_cache.py): ranks send only their values, and rank 0
skips planning.

What travels is typed: the keyword options become one :class:`SaveOptions`,
and collectives 1 to 3 carry :class:`LocalPlanMessage`, :class:`Decision` and
:class:`RankResult` (whose list becomes the root's ``save_stats``).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple

import tensorstore as ts
import torch

from .. import __version__
from ..adapters import registry
from ..adapters.sharded import local_part, saved_part
from ..adapters.state import flatten
from ..errors import TensorckptError, UnsupportedValueError
from ..format import dtypes
from ..format.metadata import RootMetadata, SaveStatsRecord, check_value, dumps, new_checkpoint_id
from ..layout import grid
from ..layout.boxes import Box, chunk_box, read_plan
from ..layout.plan import (
    LocalItem,
    LocalPlan,
    Piece,
    SavePlan,
    build_save_plan,
    merge_values,
    plan_bytes,
)
from ..storage import arrays, codec, commit, direct, kv, location
from ..storage.backend import backend_for
from ..storage.offload import HelperWriter, Offload
from . import plan_cache
from .group import Group, attempt
from .replicas import check_not_flat, check_replicas, digests_of
from .seal import Digests, merge, seal

_GROUP_JSON = dumps({"zarr_format": 3, "node_type": "group", "attributes": {}})

PHASES = ("plan", "stage", "write", "sync", "commit")


@dataclass(frozen=True)
class SaveOptions:
    """The keyword options of :func:`save` (and ``async_save``,
    ``CheckpointManager.save``), checked once by :meth:`of` and passed on as
    this object: ``metadata`` (JSON-able dict kept in the checkpoint's
    metadata), ``shard_bytes`` (largest stored object), ``inner_chunk_bytes``
    (unit of partial reads); None: the default (:mod:`tensorckpt.layout.grid`)."""

    metadata: dict | None = None
    shard_bytes: int | None = None
    inner_chunk_bytes: int | None = None

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> SaveOptions:
        """From ``save(**options)``: an unknown name is a TypeError listing
        the known ones; a size that is not a positive int a ValueError."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"save() got unknown options {unknown}; known: {known}")
        for name in ("shard_bytes", "inner_chunk_bytes"):
            v = options.get(name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"save({name}=...) must be a positive int, got {v!r}")
        return cls(**options)


# Messages between ranks (what each collective step gathers or broadcasts).


class LocalPlanMessage(NamedTuple):
    """Every rank -> rank 0 (collective 1): its local plan (no items on a plan
    cache hit), whether its layout is the one it saved last, and the digests
    of its plain tensors."""

    plan: LocalPlan
    same_layout: bool
    digests: dict


class Decision(NamedTuple):
    """Rank 0 -> every rank (collective 2): the global plan, where to write,
    the root metadata to commit, and whether the plan came from the cache."""

    plan: SavePlan
    begun: commit.Commit  # what commit.begin decided: where to write
    meta: RootMetadata
    cache_hit: bool


class RankResult(NamedTuple):
    """Every rank -> rank 0 after writing (collective 3): its phase times
    (seconds, rounded to microseconds) and bytes written, for the root's
    ``save_stats``, and the digests of the objects it wrote."""

    seconds: dict[str, float]
    bytes_written: int
    digests: Digests | None = None


def stats_record(results: list[RankResult]) -> SaveStatsRecord:
    """Every rank's phase times and bytes, as stored in the root metadata."""
    return SaveStatsRecord.of_ranks([r.seconds for r in results], [r.bytes_written for r in results], PHASES[:4])


@dataclass
class SaveStats:
    """What one rank's save did and how long each phase took.

    ``seconds`` maps each phase to wall time on this rank: ``plan`` (local
    plan, gather, global plan, broadcast), ``stage`` (copying tensors to host
    memory: device-to-host, or into the reused buffers of an async save; and,
    for irregular splits, moving parts of chunks to their writers),
    ``write`` (encode, checksum and write; TensorStore does the three in one
    pipeline), ``sync`` (making this rank's writes durable) and ``commit``
    (waiting for every rank, then the commit). ``bytes_written`` and
    ``bytes_staged`` count tensor data. For an async save, ``stall_seconds``
    is the time the caller was blocked and ``durable_seconds`` the time from
    the call to the commit; ``staging_bytes_allocated`` is the host memory the
    staging pool had to allocate (0 once buffers are reused), and
    ``bytes_offloaded`` the tensor data of the stored objects its helper
    process wrote (``executor="process"``; the rest was written in-process).
    """

    plan_cache_hit: bool = False
    bytes_written: int = 0
    bytes_staged: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    stall_seconds: float | None = None
    durable_seconds: float | None = None
    staging_bytes_allocated: int = 0
    bytes_offloaded: int = 0

    def _phase(self, name: str, start: float) -> float:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - start
        return now

    def result(self) -> RankResult:
        """What this rank reports for the root's ``save_stats``."""
        return RankResult({p: round(self.seconds.get(p, 0.0), 6) for p in PHASES[:4]}, self.bytes_written)


def save(
    state: Mapping, path: location.PathArg, *, process_group: Any = None, overwrite: bool = False,
    stats: SaveStats | None = None, storage_options: Mapping[str, Any] | None = None, **options: Any
) -> None:
    """Save ``state`` (a dict of tensors and JSON-able data) to ``path``.

    With several ranks this is a collective over ``process_group`` (default:
    the default group when torch.distributed is initialized); each rank passes
    its own local view: DTensors, :class:`~tensorckpt.ShardedTensor` boxes, or
    plain tensors (the same full value on every rank that passes one).
    Framework objects (modules, optimizers, schedulers, anything with
    ``state_dict()``) are saved through their adapters.

    The checkpoint is valid only once fully written (the spec's commit
    protocol); an existing checkpoint at ``path`` needs ``overwrite=True`` and
    stays valid until the new one replaces it.

    Options: ``metadata`` (JSON-able dict kept in the checkpoint's metadata),
    ``shard_bytes`` (largest stored object, default 64 MiB),
    ``inner_chunk_bytes`` (unit of partial reads, default 256 KiB). Pass a
    :class:`SaveStats` as ``stats`` to learn what this rank did.
    ``storage_options`` configure the storage of an ``s3://`` or fsspec URL
    (endpoint, credentials, ...; see README "Object storage").
    """
    opts = SaveOptions.of(options)
    g = Group(process_group)
    loc = location.parse(path, storage_options)
    failed = None
    try:
        state = registry.for_save(state, registry.Context(state, g.rank, g.size))
    except Exception as e:  # an adapter failed here: the others learn it through the first collective
        if not g.distributed:
            raise
        failed = e
    run(state, loc, g, overwrite, opts, stats if stats is not None else SaveStats(), failed)


def run(state: Mapping, loc: location.Location, g: Group, overwrite: bool, options: SaveOptions, stats: SaveStats,
        failed: BaseException | None = None, cache: plan_cache.PlanCache | None = None,
        offload: Offload | None = None) -> None:
    """The save protocol (module docstring) over ``g``. ``failed``: this rank
    already failed (an async save's staging); it still takes part, so every
    rank raises the error instead of waiting for it. Any rank's failure is
    raised on every rank, naming every failing rank (:meth:`Group.collective`).
    ``cache``: the plan cache (default: the group's, ``plan_cache.for_group``;
    an AsyncSaver passes its own). ``offload``: the helper process that
    writes the stored objects whose elements it can read (an AsyncSaver's
    with ``executor="process"``; storage/offload.py)."""
    t0 = time.perf_counter()
    plans = cache if cache is not None else plan_cache.for_group(g.pg)
    cache_key = plan_cache.key(g.size, options.shard_bytes, options.inner_chunk_bytes)
    layout: Any = None  # this rank's items, kept for the plan cache
    local_plans: list[list[LocalPlan]] = []  # rank 0: this save's local plans (no values), kept for the cache

    def local_plan() -> LocalPlanMessage:
        nonlocal layout
        if failed is not None:
            raise failed
        local, digests = _local_plan(state, g, loc)
        layout = local.items
        same = plans.layout(cache_key) == layout
        sent = LocalPlan(local.rank, (), local.values) if same else local  # a hit sends only values
        return LocalPlanMessage(sent, same, digests)

    plan, c, meta, hit = g.collective(
        local_plan, lambda gathered: _decide(gathered, loc, overwrite, options, g.size, plans, cache_key,
                                                          local_plans),
        what=f"save to {loc}", on_failure=lambda: plans.forget(cache_key),
    )
    stats.plan_cache_hit = hit
    stats.bytes_written = plan_bytes(plan, g.rank)
    t = stats._phase("plan", t0)

    received, err = _exchange(state, plan, g)
    stats._phase("stage", t)
    aborted = False

    def abort() -> None:
        nonlocal aborted
        plans.forget(cache_key)
        if g.rank == 0 and not aborted:
            commit.abort(c)
        aborted = True

    def write() -> RankResult:
        nonlocal aborted
        if err is not None:
            raise err
        try:
            digests = _write_local(state, plan, c.write_to, g.rank, stats, received, offload)
        except Exception:
            raise
        except BaseException:  # KeyboardInterrupt mid-write: leave nothing behind
            plans.forget(cache_key)
            if not aborted:
                commit.abort(c)
            aborted = True
            raise
        return stats.result()._replace(digests=digests)

    def finish(results: list[RankResult]) -> None:
        digests: Digests = {}
        for r in results:
            merge(digests, r.digests or {})
        commit.finish(c, seal(c.write_to, replace(meta, save_stats=stats_record(results)), digests))

    t = time.perf_counter()
    try:
        g.collective(write, finish, what=f"save to {loc}", on_failure=abort)
    finally:
        stats._phase("commit", t)
    plans.keep(cache_key, layout, plan, local_plans[0] if local_plans else None)  # cached only once it succeeded



# ----------------------------------------------------------------- steps


def _local_plan(state: Mapping, g: Group, loc: location.Location) -> tuple[LocalPlan, dict]:
    """This rank's local plan, and the digests of its plain (replicated)
    tensors, which rank 0 compares across ranks (none in a single process)."""
    if g.distributed and not backend_for(loc).shared:
        raise TensorckptError(f"{loc}: memory:// stores are per process; a distributed save needs a shared file path")
    items, values = [], {}
    leaves = flatten(state)
    for key, leaf in leaves.items():
        if leaf.is_tensor:
            check_not_flat(key, leaf.value)
            t, shape, box = saved_part(key, leaf.value, g.distributed)  # a meta tensor: held by other ranks
            check_tensor(key, t)
            items.append(LocalItem(key, dtypes.for_torch(t.dtype, key).torch_name, shape, box))
        else:
            values[key] = leaf.value
    return LocalPlan(g.rank, items, values), digests_of(leaves, g.rank) if g.distributed else {}


def _decide(gathered: list[LocalPlanMessage], loc: location.Location, overwrite: bool, options: SaveOptions,
            world: int, cache: plan_cache.PlanCache, cache_key: plan_cache.Key,
            local_plans: list[list[LocalPlan]]) -> Decision:
    """Rank 0: the global plan (cached or new), where to write, and the root
    metadata. Plain tensors held by several ranks must be equal (their digests),
    and so must values: both are checked before anything is written."""
    check_replicas([m.digests for m in gathered])
    cached = cache.plan(cache_key)
    hit = cached is not None and all(m.same_layout for m in gathered)
    if hit and cached is not None:
        plans = [replace(old, values=m.plan.values) for old, m in zip(cached[0], gathered)]
        plan = replace(cached[1], values=merge_values(plans))
    else:
        if cached is not None:  # ranks whose layout did not change sent no items: take them from the cache
            plans = [cached[0][r] if m.same_layout and not m.plan.items else m.plan for r, m in enumerate(gathered)]
            plans = [replace(p, values=m.plan.values) for p, m in zip(plans, gathered)]
        else:
            if any(m.same_layout for m in gathered):
                raise TensorckptError("plan cache out of step across ranks; call save() again")
            plans = [m.plan for m in gathered]
        plan = build_save_plan(
            plans,
            options.shard_bytes or grid.DEFAULT_SHARD_BYTES,
            options.inner_chunk_bytes or grid.DEFAULT_INNER_BYTES,
        )
    local_plans.append([replace(p, values={}) for p in plans])  # cached once the save succeeds
    user = check_value(options.metadata or {}, "metadata")
    if not isinstance(user, dict):
        raise UnsupportedValueError("save(metadata=...) must be a dict")
    meta = RootMetadata(
        tensors=plan.entries,
        values=plan.values,
        library_version=__version__,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        world_size=world,
        user_metadata=user,
        checkpoint_id=new_checkpoint_id(),
    )
    c = commit.begin(loc, overwrite, commit.new_token())
    return Decision(plan, c, meta, hit)


# -------------------------------------------------------------- exchange
#
# Where a tensor's chunk grid does not follow its boxes (irregular splits, see
# tensorckpt.layout.regrid), the writer of a chunk first receives the parts of
# it other ranks hold. All pieces of all tensors move in one all-to-all, in
# the plan's order, through host memory; a plan moving no piece (even and
# torch.chunk-style splits) has no exchange at all, on every rank alike.


def _exchange(state: Mapping, plan: SavePlan, g: Group) -> tuple[dict, BaseException | None]:
    """Send this rank's pieces and receive the ones it needs: key -> [(box,
    host tensor)]. A rank failing to gather its pieces still takes part
    (sending zeros), so that no peer waits for it, and returns the error."""
    if not plan.moves_pieces:
        return {}, None
    pieces = plan.pieces_of(g.rank)
    sends = sorted((p for p in pieces if p.src == g.rank), key=lambda p: p.dst)  # stable: plan order per peer
    recvs = sorted((p for p in pieces if p.dst == g.rank), key=lambda p: p.src)
    send_sizes, recv_sizes = [0] * g.size, [0] * g.size
    for p in sends:
        send_sizes[p.dst] += _nbytes(plan, p)
    for p in recvs:
        recv_sizes[p.src] += _nbytes(plan, p)
    data, err = attempt(_pack, state, sends)
    if err is not None:
        data = torch.zeros(sum(send_sizes), dtype=torch.uint8)
    got, e = attempt(g.all_to_all, data, send_sizes, recv_sizes)
    if err is not None or e is not None:
        return {}, err or e
    received: dict[str, list] = {}
    at = 0
    for p in recvs:
        n = _nbytes(plan, p)
        dtype = plan.entries[p.key].torch_dtype
        part = got[at : at + n].clone().view(dtype).reshape(p.box.shape)  # clone: aligned for the view
        received.setdefault(p.key, []).append((p.box, part))
        at += n
    return received, None


def _nbytes(plan: SavePlan, p: Piece) -> int:
    return p.box.numel * plan.entries[p.key].itemsize


def _pack(state: Mapping, sends: list[Piece]) -> torch.Tensor:
    """The pieces this rank sends, as bytes, in order."""
    leaves = flatten(state, check_values=False)
    parts = [torch.empty(0, dtype=torch.uint8)]
    for p in sends:
        t, _, held = local_part(p.key, leaves[p.key].value)
        part = _host(t[p.box.relative_to(held).slices()]).contiguous()
        parts.append(part.reshape(-1).view(torch.uint8))
    return torch.cat(parts)


def _assemble(region: Box, t: torch.Tensor, held: Box, pieces: list) -> torch.Tensor:
    """The data of ``region`` (a chunk this rank writes): its own part from
    ``t`` (its box ``held``, on the host) and the received ``pieces``. The
    plan's pieces and the own part tile the chunk exactly."""
    if region.intersect(held) == region:  # inside this rank's own box
        return t[region.relative_to(held).slices()]
    out = torch.empty(region.shape, dtype=t.dtype)
    own = region.intersect(held)
    if own is not None:
        out[own.relative_to(region).slices()] = t[own.relative_to(held).slices()]
    for box, part in pieces:
        if box.intersect(region) is not None:
            out[box.relative_to(region).slices()] = part
    return out


# ----------------------------------------------------------------- write


def _write_local(
    state: Mapping, plan: SavePlan, loc: location.Location, rank: int, stats: SaveStats, received: dict | None = None,
    offload: Offload | None = None,
) -> Digests:
    """Write this rank's boxes (or chunks, assembled with the ``received``
    pieces) and group ``zarr.json`` objects, all concurrently; return the
    digest of every stored object written (spec 7.1: computed from the
    CRC-32Cs the encoding makes, by the direct writer or, for objects
    TensorStore writes, by :func:`codec.chunk_digest`). Then make exactly those
    objects durable (the ones :meth:`Backend.chunk_writer` wrote are as
    they are written; only their directories are left). Whatever
    happens, every write issued is finished before returning, so an abort
    that follows cannot race a write still in flight."""
    received = received or {}
    leaves = flatten(state, check_values=False)
    objects = {f"{gk}/zarr.json": _GROUP_JSON for gk in _groups(plan)} if rank == 0 else {}  # arrays': seal()
    backend = backend_for(loc)
    backend.prepare(loc)  # also when this rank writes nothing
    mine = plan.writes_of(rank)
    meta_write = kv.write_many_async(loc, objects)
    small = {(k, b): pos for k, b in mine if (pos := arrays.whole_chunk(plan.entries[k], b)) is not None}
    own = backend.fast_chunks  # encode stored objects here rather than through TensorStore
    fast = {k for k, b in mine if own and (k, b) not in small and direct.usable(plan.entries[k])}
    start, staging = time.perf_counter(), 0.0
    writer: Any = backend.chunk_writer(loc) if fast else None
    if writer is not None and offload is not None:
        writer = offload.writer(writer)  # the helper process writes what lies in its shared staging
    opened = {k: arrays.open_write(loc, k, plan.entries[k]) for k in {k for k, b in mine if (k, b) not in small} - fast}
    writes, encoded, small_write = [], {}, lambda: None
    digests: Digests = {}
    digesting: list[tuple[str, tuple[int, ...], Any]] = []  # the direct writer's futures give the digests
    written, fsynced = set(objects), set()  # the keys of every object this rank writes; those already durable
    try:
        host: dict[str, tuple[torch.Tensor, Box]] = {}  # the current key: its chunks share one host copy
        for key, box in mine:
            t0 = time.perf_counter()
            if key not in host:
                tensor, _, held = local_part(key, leaves[key].value)
                host = {key: (_host(tensor), held)}
            tensor, held = host[key]
            if box != held:  # a chunk of a re-gridded tensor
                tensor = _assemble(box, tensor, held, received.get(key, []))
            staging += time.perf_counter() - t0
            if not box.numel:
                continue
            data = dtypes.to_numpy(tensor)
            if (key, box) in small:  # one inner chunk: encoded here, written in one batch below
                pos = small[key, box]
                encoded[f"{key}/{arrays.chunk_key(pos)}"], digests.setdefault(key, {})[pos] = codec.encoded_bytes(
                    codec.geometry(plan.entries[key]), data)
            else:  # one write per stored object: a failure settles only once all are done
                e = plan.entries[key]
                for p in read_plan(e.shape, e.chunk_shape, box):
                    written.add(name := f"{key}/{arrays.chunk_key(p.chunk)}")
                    if writer is not None and key in fast and p.src == chunk_box(p.chunk, e.chunk_shape, e.shape):
                        w = writer.write(key, e, p.chunk, data[p.dst.slices()])
                        writes.append((key, w))
                        digesting.append((key, p.chunk, w))
                        fsynced.add(name)
                    else:
                        if key not in opened:
                            opened[key] = arrays.open_write(loc, key, e)
                        writes.append((key, opened[key].result()[p.src.slices()].write(data[p.dst.slices()])))
                        digests.setdefault(key, {})[p.chunk] = codec.chunk_digest(codec.geometry(e), data[p.dst.slices()])
        small_write = kv.write_many_async(loc, encoded)
        written.update(encoded)
    finally:
        failure = _settle(loc, writes, opened, meta_write, small_write)
        if writer is not None:
            writer.close()
            if isinstance(writer, HelperWriter):
                stats.bytes_offloaded += writer.offloaded  # the helper process's share (offload.py)
    stats.seconds["stage"] = stats.seconds.get("stage", 0.0) + staging
    stats.seconds["write"] = time.perf_counter() - start - staging
    if failure is not None:
        raise failure
    t = time.perf_counter()
    try:
        if isinstance(writer, HelperWriter):  # the helper process fsyncs them (offload.py)
            writer.sync(written, fsynced)
        else:
            backend.sync(loc, written, fsynced)
    except OSError as e:
        raise TensorckptError(f"{loc}: making the written data durable failed: {e}") from e
    stats._phase("sync", t)
    for key, pos, w in digesting:
        digests.setdefault(key, {})[pos] = w.result()
    return digests


def _settle(loc: location.Location, writes: list[tuple[str, Any]], opened: dict[str, ts.Future],
            meta_write: Callable[[], None], small_write: Callable[[], None]) -> Exception | None:
    """Wait for every issued write; return the first failure."""
    failure = None
    for key, w in writes:
        try:
            w.result()
        except Exception as e:  # noqa: BLE001 - every write is waited for; the first failure is returned
            failure = failure or TensorckptError(f"{loc}: writing tensor {key!r} failed: {e}")
    for f in opened.values():
        try:
            f.result()
        except Exception as e:  # noqa: BLE001 - as above (TensorStore raises ValueError with a status string)
            failure = failure or TensorckptError(f"{loc}: opening an array failed: {e}")
    try:
        meta_write()
    except Exception as e:  # noqa: BLE001 - as above
        failure = failure or TensorckptError(f"{loc}: writing metadata failed: {e}")
    try:
        small_write()
    except Exception as e:  # noqa: BLE001 - as above
        failure = failure or TensorckptError(f"{loc}: writing small tensors failed: {e}")
    return failure


def _groups(plan: SavePlan) -> set[str]:
    keys = [*plan.entries, *plan.values]
    return {k.rsplit("/", i)[0] for k in keys for i in range(1, k.count("/") + 1)}


def _host(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.cpu() if t.device.type != "cpu" else t


def check_tensor(key: str, t: torch.Tensor) -> None:
    if t.layout != torch.strided or t.is_meta:
        raise UnsupportedValueError(f"{key!r}: only dense tensors with data can be saved (got {t.layout}, {t.device})")
