"""``tensorckpt.open(path)``: a read-only view of a committed checkpoint that
needs no process group. It reads the root metadata once; tensors are read
lazily, whole or by region."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorstore as ts
import torch

from .adapters.state import unflatten
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidIndexError,
)
from .format import dtypes
from .format.keys import flat_key, split_flat_key
from .format.metadata import RootMetadata, TensorEntry, loads, parse_root
from .storage import arrays, commit, kv, location


@dataclass(frozen=True)
class CheckpointMetadata:
    format_version: str
    library_version: str
    created: str
    world_size: int
    user_metadata: dict
    save_stats: dict | None = None  # per-rank phase times of the save (spec 9.7); None before format 1.1


@dataclass(frozen=True)
class TensorInfo:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]


def read_root(loc: location.Location) -> RootMetadata:
    """Read and validate the root metadata, telling apart a missing, an
    incomplete and a committed checkpoint."""
    return parse_root_bytes(loc, read_root_bytes(loc))


def read_root_bytes(loc: location.Location) -> bytes:
    data = kv.read(loc, commit.ROOT_KEY)
    if data is None:
        stale = commit.leftovers(loc)
        if kv.exists(loc) or stale:
            found = ", ".join(str(s) for s in ([loc] if kv.exists(loc) else []) + stale)
            whole = [str(s) for s in stale if kv.read(s, commit.ROOT_KEY) is not None]
            hint = (
                f" A complete checkpoint from an interrupted replace sits at {', '.join(whole)}: open or load it there."
                if whole
                else " Load an earlier checkpoint, or delete these and save again."
            )
            raise IncompleteCheckpointError(
                f"{loc}: the checkpoint was never committed (no root zarr.json); an interrupted "
                f"save left data at {found}.{hint}"
            )
        raise CheckpointNotFoundError(f"{loc}: no checkpoint found")
    return data


def parse_root_bytes(loc: location.Location, data: bytes) -> RootMetadata:
    where = f"{loc}/{commit.ROOT_KEY}"
    return parse_root(loads(data, where), where)


class Checkpoint:
    """A committed checkpoint, opened read-only."""

    def __init__(self, path, _root: RootMetadata | None = None) -> None:
        self.location = location.parse(path)
        self._meta = _root if _root is not None else read_root(self.location)
        self._arrays: dict[str, ts.TensorStore] = {}

    # -- metadata
    @property
    def path(self) -> str:
        return self.location.url

    @property
    def metadata(self) -> CheckpointMetadata:
        m = self._meta
        return CheckpointMetadata(m.format_version, m.library_version, m.created, m.world_size, m.user_metadata, m.save_stats)

    @property
    def index(self) -> RootMetadata:
        return self._meta

    def keys(self) -> list[str]:
        """Flat keys of every leaf (tensors and values), sorted."""
        return sorted([*self._meta.tensors, *self._meta.values])

    def __contains__(self, key) -> bool:
        k = self._key(key)
        return k in self._meta.tensors or k in self._meta.values

    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r}, {len(self._meta.tensors)} tensors, {len(self._meta.values)} values)"

    def info(self, key) -> TensorInfo:
        k = self._key(key)
        e = self._entry(k)
        return TensorInfo(k, e.shape, dtypes.torch_dtype(dtypes.BY_TORCH[e.dtype]), e.nbytes, e.chunk_shape, e.inner_chunk_shape)

    # -- data
    def read(self, key, index=None):
        """The tensor at ``key`` (or only the region ``index``, a tuple of
        slices / ints), or the stored value if ``key`` is a non-tensor leaf."""
        k = self._key(key)
        if k in self._meta.values and index is None:
            return self._meta.values[k]
        e = self._entry(k)
        arr = self.array(k)
        if index is not None:
            arr = arr[_normalize_index(index, e.shape, f"{self.path}: tensor {k!r}")]
        d = dtypes.BY_TORCH[e.dtype]
        out = np.empty(tuple(arr.shape), dtype=d.numpy)
        self.read_into(k, arr, out)
        return dtypes.from_numpy(out, d)

    def read_into(self, key: str, src: ts.TensorStore, out: np.ndarray) -> None:
        """Copy ``src`` (a view of this checkpoint's array ``key``) into ``out``."""
        if out.size:
            wait(self.path, key, ts.array(out, copy=False, write=True).write(src))

    def array(self, key: str) -> ts.TensorStore:
        """The opened TensorStore array of ``key``, checked against the index."""
        if key not in self._arrays:
            self._arrays.update(self.open_arrays([key]))
        return self._arrays[key]

    def open_arrays(self, keys) -> dict[str, ts.TensorStore]:
        """Open several arrays concurrently, validating each against the index."""
        futures = {k: arrays.open_read(self.location, k, self._meta.tensors[k]) for k in keys if k not in self._arrays}
        for k, f in futures.items():
            a = wait(self.path, k, f)
            e = self._meta.tensors[k]
            if tuple(a.shape) != e.shape or a.dtype.numpy_dtype != dtypes.BY_TORCH[e.dtype].numpy:
                raise CorruptCheckpointError(
                    f"{self.path}/{k}/zarr.json: array is {list(a.shape)} {a.dtype.name} but the "
                    f"checkpoint index says {list(e.shape)} {e.dtype}"
                )
            self._arrays[k] = a
        return {k: self._arrays[k] for k in keys}

    def to_state_dict(self) -> dict:
        """The whole checkpoint as a nested dict of tensors and values."""
        self.open_arrays(list(self._meta.tensors))
        leaves = {split_flat_key(k): v for k, v in self._meta.values.items()}
        for k in self._meta.tensors:
            leaves[split_flat_key(k)] = self.read(k)
        return unflatten(leaves)

    # -- helpers
    def _key(self, key) -> str:
        return flat_key(tuple(key)) if isinstance(key, tuple) else key

    def _entry(self, k: str) -> TensorEntry:
        e = self._meta.tensors.get(k)
        if e is None:
            kind = "a value, not a tensor" if k in self._meta.values else "not in the checkpoint"
            raise KeyError(f"{self.path}: key {k!r} is {kind}")
        return e


def _normalize_index(index, shape: tuple[int, ...], where: str) -> tuple:
    """Indices as torch understands them (negative ints and slice bounds count
    from the end; slices clamp), checked against ``shape`` before any read."""
    index = index if isinstance(index, tuple) else (index,)
    if sum(ix is Ellipsis for ix in index) > 1:
        raise InvalidIndexError(f"{where}: an index can have only one Ellipsis")
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1 :]
    if len(index) > len(shape):
        raise InvalidIndexError(f"{where}: {len(index)} indices for a {len(shape)}-d tensor of shape {list(shape)}")
    out = []
    for i, (ix, n) in enumerate(zip(index, shape)):
        if isinstance(ix, slice):
            try:
                start, stop, step = ix.indices(n)
            except (TypeError, ValueError) as err:
                raise InvalidIndexError(f"{where}: bad slice {ix!r} in dimension {i}: {err}") from None
            if step < 1:
                raise InvalidIndexError(f"{where}: slice {ix!r} in dimension {i} needs a positive step")
            out.append(slice(start, max(start, stop), step))
        elif isinstance(ix, int) and not isinstance(ix, bool):
            if not -n <= ix < n:
                raise InvalidIndexError(f"{where}: index {ix} is out of range for dimension {i} of size {n}")
            out.append(ix % n)
        else:
            raise InvalidIndexError(f"{where}: index {ix!r} in dimension {i} is not an int or a slice")
    return tuple(out)


def wait(path: str, key: str, future):
    """Resolve a TensorStore future, turning its errors into tensorckpt ones."""
    try:
        return future.result()
    except ValueError as e:
        msg = str(e)
        if "DATA_LOSS" in msg or "checksum" in msg.lower() or "digest" in msg.lower():
            raise CorruptCheckpointError(f"{path}: tensor {key!r}: stored data is corrupt ({msg})") from None
        if "NOT_FOUND" in msg:
            what = "a stored chunk is missing" if "chunk" in msg else "its array metadata (zarr.json) is missing"
            raise CorruptCheckpointError(f"{path}: tensor {key!r}: {what} ({msg})") from None
        if "FAILED_PRECONDITION" in msg or "Mismatch" in msg:
            raise CorruptCheckpointError(
                f"{path}/{key}/zarr.json: the array metadata does not match the checkpoint index ({msg})"
            ) from None
        raise CorruptCheckpointError(f"{path}: tensor {key!r}: {msg}") from None

