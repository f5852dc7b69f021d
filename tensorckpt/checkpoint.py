"""``tensorckpt.open(path)``: a read-only view of a committed checkpoint that
needs no process group. It reads the root metadata once; tensors are read
lazily, whole or by region.

Everything stored is untrusted (spec section 12). The root ``zarr.json`` is
parsed and validated in Python before anything else (:func:`open_pinned`,
:func:`parse_root_bytes`); the arrays are read and checked by
:class:`tensorckpt.storage.reader.StoredArrays`, which :class:`Checkpoint`
extends with the public view: keys, tensor info, ``read`` by key and region,
``to_state_dict``.

A view reads one version (spec 10.7): it holds the directory it resolved
(:mod:`tensorckpt.storage.pinned`) and reads everything through it; a read
that a replace or deletion overlapped raises :class:`CheckpointChangedError`.
A location without a root is classified by :mod:`tensorckpt.identify`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import EllipsisType
from typing import Any

import numpy as np
import torch

from . import identify
from .adapters.state import unflatten
from .errors import CheckpointChangedError, InvalidIndexError, TensorckptError
from .format import dtypes
from .format.keys import flat_key, split_flat_key
from .format.metadata import (
    MAX_ROOT_JSON_BYTES,
    CheckpointMetadata,
    RootMetadata,
    TensorEntry,
    loads,
    parse_root,
)
from .layout.boxes import Box
from .storage import commit, direct, location, pinned
from .storage.backend import backend_for
from .storage.reader import TRUSTED_READ_BYTES, StoredArrays, short

Key = str | tuple[str, ...]  # a flat key, or its path of components
Index = int | slice | EllipsisType | tuple[int | slice | EllipsisType, ...]  # a region, as torch indexes


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
    incomplete and a committed checkpoint, and something else (identify.py)."""
    pin, data = open_pinned(loc)
    pin.close()
    return parse_root_bytes(loc, data)


def read_root_bytes(loc: location.Location) -> bytes:
    pin, data = open_pinned(loc)
    pin.close()
    return data


def open_pinned(loc: location.Location) -> tuple[pinned.Pin, bytes]:
    """Resolve the checkpoint at ``loc`` once (spec 10.7): a pin on the
    version found and its root ``zarr.json``. A replace that deletes the
    version between the two is retried; a location without a root raises
    what :func:`identify.no_root` finds there."""
    where = f"{loc}/{commit.ROOT_KEY}"
    for _ in range(5):
        try:
            pin = pinned.Pin(loc)
        except FileNotFoundError:
            identify.no_root(loc)
            raise  # pragma: no cover - no_root raises
        except NotADirectoryError:
            identify.no_root(loc)
            raise  # pragma: no cover
        except OSError as e:
            raise TensorckptError(f"{loc}: cannot be opened ({e.strerror or e})") from None
        try:
            gen, data = pin.read(commit.ROOT_KEY, MAX_ROOT_JSON_BYTES, where)
        except (OSError, ValueError) as e:
            pin.close()
            raise TensorckptError(f"{where}: cannot be read ({short(e)})") from None
        except BaseException:
            pin.close()
            raise
        if data is not None:
            pin.remember_root(gen, data)
            return pin, data
        gone = backend_for(loc).supports_rename and pin.changed()  # a replace renamed it away
        pin.close()
        if not gone:
            identify.no_root(loc)
    raise CheckpointChangedError(f"{loc}: the checkpoint was replaced again and again while it was opened; open it again")


def parse_root_bytes(loc: location.Location, data: bytes) -> RootMetadata:
    where = f"{loc}/{commit.ROOT_KEY}"
    return parse_root(loads(data, where), where, data)


class Checkpoint(StoredArrays):
    """A committed checkpoint, opened read-only."""

    def __init__(self, path: str | os.PathLike | location.Location, *, storage_options: Mapping[str, Any] | None = None) -> None:
        loc = location.parse(path, storage_options)
        pin, data = open_pinned(loc)
        super().__init__(loc, parse_root_bytes(loc, data), pin)

    @property
    def metadata(self) -> CheckpointMetadata:
        return self._meta.header()

    def keys(self) -> list[str]:
        """Flat keys of every leaf (tensors and values), sorted."""
        return sorted([*self._meta.tensors, *self._meta.values])

    def __contains__(self, key: Key) -> bool:
        k = self._key(key)
        return k in self._meta.tensors or k in self._meta.values

    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r}, {len(self._meta.tensors)} tensors, {len(self._meta.values)} values)"

    def info(self, key: Key) -> TensorInfo:
        k = self._key(key)
        e = self._entry(k)
        return TensorInfo(k, e.shape, e.torch_dtype, e.nbytes, e.chunk_shape, e.inner_chunk_shape)

    def read(self, key: Key, index: Index | None = None) -> Any:
        """The tensor at ``key`` (or only the region ``index``, a tuple of
        slices / ints), or the stored value (JSON) if ``key`` is a non-tensor leaf.
        Raises :class:`CheckpointChangedError` (read again) where the
        checkpoint was replaced since it was opened and the data is gone."""
        k = self._key(key)
        if k in self._meta.values and index is None:
            return self._meta.values[k]
        e = self._entry(k)
        with self.one_version():
            return self._read_tensor(k, e, index)

    def _read_tensor(self, k: str, e: TensorEntry, index: Index | None) -> torch.Tensor:
        self.check_arrays([k])
        norm = _normalize_index(index, e.shape, f"{self.path}: tensor {k!r}") if index is not None else ()
        rest = e.shape[len(norm):]  # the region read, in the array's coordinates (an int keeps its dimension)
        shape = tuple(len(range(ix.start, ix.stop, ix.step)) for ix in norm if isinstance(ix, slice)) + rest
        d = e.dtype_info
        self._check_backed(k, math.prod(shape) * d.itemsize)
        lo = tuple(ix if isinstance(ix, int) else ix.start for ix in norm) + (0,) * len(rest)
        hi = tuple(ix + 1 if isinstance(ix, int) else ix.stop for ix in norm) + rest
        box = Box(lo, tuple(h - l for l, h in zip(lo, hi)))
        numel = math.prod(shape)
        strided = numel != box.numel  # a slice with a step: only part of the box
        fast = numel > 0 and self._backend.fast_reads and direct.usable(e)
        # a strided read: the box around it, by the same reader and checks, unless far larger than asked
        fast = fast and (not strided or box.numel * d.itemsize <= max(TRUSTED_READ_BYTES, 4 * numel * d.itemsize))
        self.check_objects(k, box, codec=fast)
        out = np.empty(shape, dtype=d.numpy)
        if fast and not strided:
            with self._chunk_reader() as pool:  # as load reads
                for f in pool.read(k, e, box, out.reshape(box.shape), self.chunk_digests(k)):
                    f.result()
        elif fast:  # strided: the box around it, then every step-th element
            self._check_backed(k, box.numel * d.itemsize)
            whole = np.empty(box.shape, dtype=d.numpy)
            with self._chunk_reader() as pool:
                for f in pool.read(k, e, box, whole, self.chunk_digests(k)):
                    f.result()
            out[...] = whole[tuple(slice(None, None, ix.step) if isinstance(ix, slice) else 0 for ix in norm)]
        else:
            self.read_into(k, self.array(k)[norm] if norm else self.array(k), out)
        return dtypes.from_numpy(out, d)

    def to_state_dict(self) -> dict:
        """The whole checkpoint as a nested dict of tensors and values."""
        leaves = {split_flat_key(k): v for k, v in self._meta.values.items()}
        with self.one_version():
            self.check_arrays(list(self._meta.tensors))  # every array document first, all at once
            for k in self._meta.tensors:
                leaves[split_flat_key(k)] = self.read(k)
        return unflatten(leaves)

    def _key(self, key: Key) -> str:
        return flat_key(tuple(key)) if isinstance(key, tuple) else key


# ----------------------------------------------------------------- indices


def _normalize_index(index: object, shape: tuple[int, ...], where: str) -> tuple[slice | int, ...]:
    """Indices as torch understands them (negative ints and slice bounds count
    from the end; slices clamp), checked against ``shape`` before any read.
    ``index`` comes from the caller: anything else is an InvalidIndexError."""
    index = index if isinstance(index, tuple) else (index,)
    if sum(ix is Ellipsis for ix in index) > 1:
        raise InvalidIndexError(f"{where}: an index can have only one Ellipsis")
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1 :]
    if len(index) > len(shape):
        raise InvalidIndexError(f"{where}: {len(index)} indices for a {len(shape)}-d tensor of shape {list(shape)}")
    out: list[slice | int] = []
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
