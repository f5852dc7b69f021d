"""A distributed sampler whose position survives a checkpoint, also under a
different data-parallel size (spec: rng-and-data.md, "Sampler").

    sampler = tensorckpt.ResumableSampler(len(dataset), seed=0)  # DP rank/size: the world's, or dp_mesh=mesh["dp"]
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=4)
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for batch in sampler.track(loader):  # counts each batch as the loop receives it
            train_step(batch)
            tensorckpt.save({"model": model, "data": sampler, "rng": tensorckpt.rng_state()}, path)

Design, in short:

- Each epoch has one order of all N samples, :func:`epoch_order`, from a
  specified hash (not ``torch.randperm``, whose algorithm a torch upgrade may
  change, silently breaking a resume).
- Rank r of W takes every W-th sample of that order, from r (like
  ``DistributedSampler``, without padding: ranks differ by at most one sample).
- Progress counts samples the training loop *consumed*, not samples handed
  out: DataLoader workers prefetch batches ahead of the loop, so iterating
  counts nothing. :meth:`ResumableSampler.track` counts each batch as the loop
  receives it; :meth:`ResumableSampler.advance` is the primitive under it.
- Resuming with the same world continues every rank's slice where it stopped:
  the same batches as an uninterrupted run. With a different world, the epoch
  so far becomes a closed *segment* (its world and every rank's count) and the
  samples not consumed yet are split over the new world: each sample of the
  epoch is consumed exactly once. Segments are kept until the epoch ends.

The state has a part all ranks share and one per rank (``rank/<r>/consumed``);
since the per-rank keys differ, a distributed save keeps every rank's part,
and a load gives every rank all of them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Any

import numpy as np
import torch.distributed as dist
from numpy.typing import NDArray
from torch.utils.data import DataLoader, Sampler

from .adapters.base import Context, Stored, Target, key_in_state
from .adapters.state import unflatten
from .errors import CorruptCheckpointError, IncompatibleStateError
from .format.keys import split_flat_key

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

VERSION = 1
_MASK = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    """SplitMix64's finalizer, on a Python int (mod 2^64)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _mix_array(z: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """:func:`_mix` of each element of a uint64 array (its arithmetic wraps mod 2^64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The order of samples ``0 .. num_samples - 1`` in an epoch: sorted by
    ``mix(k + i * 0x9E3779B97F4A7C15)`` (ties by i), where ``k = mix(mix(seed)
    ^ epoch)`` and mix is SplitMix64's finalizer, all mod 2^64; ``range``
    order without ``shuffle``."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    k = _mix(_mix(seed & _MASK) ^ (epoch & _MASK))
    i = np.arange(num_samples, dtype=np.uint64)
    return np.argsort(_mix_array(np.uint64(k) + i * np.uint64(_GOLDEN)), kind="stable").astype(np.int64)


def remaining(order: np.ndarray, segments: list[list]) -> np.ndarray:
    """``order`` without the samples consumed in ``segments`` ([world,
    counts] each, in order): in a segment of world W, rank r consumed the
    first ``counts[r]`` samples of ``rest[r::W]``."""
    for world, counts in segments:
        keep = np.ones(len(order), dtype=bool)
        for r, c in enumerate(counts):
            keep[r : r + world * c : world] = False
        order = order[keep]
    return order


def dp_rank_and_size(
    rank: int | None, world: int | None, dp_group: dist.ProcessGroup | None = None, dp_mesh: DeviceMesh | None = None
) -> tuple[int, int]:
    """The data-parallel rank and size a sampler uses (see :class:`ResumableSampler`)."""
    given = [name for name, v in (("rank/world", rank if rank is not None else world), ("dp_group", dp_group),
                                  ("dp_mesh", dp_mesh)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"ResumableSampler: give one of rank=/world=, dp_group=, dp_mesh=; got {' and '.join(given)}")
    if rank is not None or world is not None:
        if rank is None or world is None:
            raise ValueError("ResumableSampler: rank= and world= go together (the data-parallel rank and size)")
        return rank, world
    if dp_mesh is not None:
        coordinate = dp_mesh.get_coordinate()
        if coordinate is None:
            raise ValueError("ResumableSampler(dp_mesh=...): this process is not in the mesh")
        r = 0
        for c, n in zip(coordinate, dp_mesh.shape):
            r = r * n + c
        return r, dp_mesh.size()
    on = dist.is_available() and dist.is_initialized()
    if dp_group is not None:
        if not on:
            raise ValueError("ResumableSampler(dp_group=...): torch.distributed is not initialized")
        return dist.get_rank(dp_group), dist.get_world_size(dp_group)
    if not on or dist.get_world_size() == 1:
        return (dist.get_rank() if on else 0), 1
    world_size = dist.get_world_size()
    smaller = sorted({len(r) for r in _group_ranks() if 1 < len(r) < world_size})
    if smaller:
        raise ValueError(
            f"ResumableSampler: process groups of {smaller} ranks exist besides the world of {world_size} (a "
            "DeviceMesh with several dimensions, or tensor/pipeline-parallel groups), so the whole world may not be "
            "the data-parallel group: ranks of one replica would get different samples. Pass the data-parallel "
            "group: dp_mesh=mesh['dp'] (HSDP: mesh['replicate', 'shard']), dp_group=pg, or rank=/world="
        )
    return dist.get_rank(), world_size


def _group_ranks() -> list:
    """The ranks of every process group this process belongs to."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return list(c10d._world.pg_group_ranks.values())
    except (ImportError, AttributeError):  # pragma: no cover - a torch without this registry: no check
        return []


class ResumableSampler(Sampler[int]):
    """Sample indices for one rank of the data-parallel (DP) group. ``data`` is
    the dataset or its length.

    The DP rank and size come from, in this order: ``rank=`` and ``world=``
    (the DP rank and size, explicitly); ``dp_mesh=`` (a DeviceMesh of the DP
    dimensions, e.g. ``mesh["dp"]``, or ``mesh["replicate", "shard"]`` for
    HSDP: the rank is this process's coordinate, row-major); ``dp_group=``
    (a process group); else the whole world of torch.distributed (0 of 1
    without it). The whole world is taken only while it is the only group:
    once a process group smaller than the world exists (a DeviceMesh of more
    than one dimension, tensor- or pipeline-parallel groups), the sampler
    refuses to guess, since ranks of one DP replica (TP peers) would get
    different samples; pass the DP group or mesh dimension then. Ranks with
    the same DP rank get the same samples.

    Use as ``DataLoader(..., sampler=sampler)``; iterate with
    ``sampler.track(loader)`` (or call :meth:`advance` per batch) so that the
    state counts what the training loop consumed. Save it in a state given to
    :func:`tensorckpt.save`; or :meth:`state_dict` / :meth:`load_state_dict`
    with every rank's part merged (see the module docstring).

    With ``drop_last``, every rank's slice of an epoch (or of a resumed
    epoch's rest) is cut to the same length; up to ``world - 1`` samples are
    then skipped. Without it, ranks' slices differ by at most one sample.
    """

    def __init__(
        self,
        data: Sized | int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int | None = None,
        world: int | None = None,
        dp_group: dist.ProcessGroup | None = None,
        dp_mesh: DeviceMesh | None = None,
    ) -> None:
        self.num_samples = data if isinstance(data, int) else len(data)
        rank, world = dp_rank_and_size(rank, world, dp_group, dp_mesh)
        if not 0 <= rank < world:
            raise ValueError(f"ResumableSampler: rank {rank} is not in [0, world={world})")
        if not 0 <= seed < 2**64:
            raise ValueError(f"ResumableSampler: seed {seed} is not in [0, 2^64)")
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.rank, self.world = rank, world
        self.epoch = 0
        self._segments: list[list] = []  # closed segments of this epoch: [world, counts]
        self._consumed = 0  # samples of this rank's slice consumed in the current segment
        self._cache: tuple | None = None

    # -------------------------------------------------------------- iterate

    def _slice(self) -> np.ndarray:
        """This rank's slice of the current segment."""
        key = (self.epoch, self.seed, self.shuffle, len(self._segments))
        if self._cache is None or self._cache[0] != key:
            rest = remaining(epoch_order(self.num_samples, self.seed, self.epoch, self.shuffle), self._segments)
            mine = rest[self.rank :: self.world]
            self._cache = (key, mine[: len(rest) // self.world] if self.drop_last else mine)
        return self._cache[1]

    def __iter__(self) -> Iterator[int]:
        """The samples of this epoch this rank has not consumed yet."""
        return iter(self._slice()[self._consumed :].tolist())

    def __len__(self) -> int:
        return max(len(self._slice()) - self._consumed, 0)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (a new order, nothing consumed); the epoch in progress
        (after a load, the saved one) keeps its progress."""
        if epoch != self.epoch:
            self.epoch, self._segments, self._consumed = epoch, [], 0

    def advance(self, samples: int) -> None:
        """Count ``samples`` more samples as consumed by the training loop (at
        most the rest of this rank's slice)."""
        if samples < 0:
            raise ValueError(f"ResumableSampler.advance: {samples} samples")
        self._consumed = min(self._consumed + samples, len(self._slice()))

    def track(self, loader: DataLoader) -> Iterator[Any]:
        """Iterate ``loader`` (a DataLoader over this sampler), counting each
        batch as consumed when the loop receives it; a checkpoint saved while
        the loop handles a batch resumes after that batch."""
        if getattr(loader, "sampler", None) is not self:
            raise ValueError("ResumableSampler.track: the loader's sampler is not this sampler; use DataLoader(..., sampler=sampler)")
        if loader.batch_size is None:
            raise ValueError("ResumableSampler.track: the loader has no batch_size; call sampler.advance(n) after each batch instead")
        return self._track(loader, loader.batch_size)

    def _track(self, loader: DataLoader, batch_size: int) -> Iterator[Any]:
        for batch in loader:
            self.advance(batch_size)  # the last batch may be smaller: advance stops at the slice's end
            yield batch

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict:
        """The shared part and this rank's part (under ``rank/<rank>``)."""
        return {
            "version": VERSION,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "world": self.world,
            "segments": [[w, list(c)] for w, c in self._segments],
            "rank": {str(self.rank): {"consumed": self._consumed}},
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Resume from a state holding every saving rank's part (as
        :func:`tensorckpt.load` provides)."""
        self._load(state, "ResumableSampler state")

    def _load(self, state: Mapping, where: str) -> None:
        s = _parse(state, where)
        if s["num_samples"] != self.num_samples:
            raise IncompatibleStateError(
                f"{where}: saved for a dataset of {s['num_samples']} samples, this sampler has {self.num_samples}; "
                "resume with the same dataset"
            )
        self.seed, self.shuffle, self.epoch = s["seed"], s["shuffle"], s["epoch"]
        counts, segments = s["counts"], s["segments"]
        if s["world"] == self.world:
            self._segments, self._consumed = segments, counts[self.rank]
        else:  # close the saved segment; the rest is split over this world
            self._segments = segments + ([[s["world"], counts]] if any(counts) else [])
            self._consumed = 0
        self._cache = None


def _parse(state: Mapping, where: str) -> dict:
    """Check a sampler state (every rank's part merged); the counts by rank."""

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise CorruptCheckpointError(f"{where}: {what}")

    def is_int(v: object, low: int = 0) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    need(isinstance(state, Mapping), "not a dict")
    need(state.get("version") == VERSION, f"version {state.get('version')!r}; this tensorckpt reads version {VERSION}")
    for name, low in (("num_samples", 0), ("seed", 0), ("epoch", 0), ("world", 1)):
        need(is_int(state.get(name), low), f"{name!r} must be an integer >= {low}, got {state.get(name)!r}")
    need(isinstance(state.get("shuffle"), bool), f"'shuffle' must be a boolean, got {state.get('shuffle')!r}")
    world, ranks = state["world"], state.get("rank")
    ranks = ranks if isinstance(ranks, Mapping) else {}
    missing = [r for r in range(world) if str(r) not in ranks]
    if missing:
        raise IncompatibleStateError(
            f"{where}: no progress for ranks {missing[:8]} of the saving world {world}; load it with every rank's "
            "part (tensorckpt.load provides them; with state_dict(), merge every rank's 'rank' dict)"
        )
    counts = [ranks[str(r)].get("consumed") if isinstance(ranks[str(r)], Mapping) else None for r in range(world)]
    segments = state.get("segments")
    if not isinstance(segments, list):
        raise CorruptCheckpointError(f"{where}: 'segments' must be a list, got {segments!r}")
    left = state["num_samples"]  # samples not consumed before each segment
    for seg in [*segments, [world, counts]]:
        need(
            isinstance(seg, list) and len(seg) == 2 and is_int(seg[0], 1) and isinstance(seg[1], list)
            and len(seg[1]) == seg[0] and all(is_int(c) for c in seg[1]),
            f"segment {seg!r} is not [world >= 1, [one count >= 0 per rank]]",
        )
        w, cs = seg
        need(all(c <= len(range(r, left, w)) for r, c in enumerate(cs)), f"segment {seg!r} counts more samples than there were")
        left -= sum(cs)
    return {**state, "counts": counts, "segments": [[w, list(c)] for w, c in segments]}


class SamplerAdapter:
    """Saves ``state_dict()``; loads every stored value under the sampler's key
    (every rank's part), whatever this rank's world. ``load_target``'s memo
    for ``apply``: whether the checkpoint holds a sampler state. Registered
    in :data:`tensorckpt.adapters.registry.BUILTINS`."""

    def save_state(self, obj: ResumableSampler, ctx: Context) -> dict:
        return obj.state_dict()

    def load_target(self, obj: ResumableSampler, stored: Stored, ctx: Context) -> Target:
        if not stored.values:  # ask for this rank's keys, so load reports them missing
            return Target(obj.state_dict(), memo=False)
        return Target(unflatten({split_flat_key(k): None for k in stored.values}), memo=True)

    def apply(self, obj: ResumableSampler, loaded: Mapping, ctx: Context, held: bool) -> None:
        if not held:  # strict=False, no sampler stored: unchanged
            return
        obj._load(loaded, repr(key_in_state(obj, ctx.state)))
