"""``tensorckpt.open(path)``: a read-only view of a committed checkpoint that
needs no process group. It reads the root metadata once; tensors are read
lazily, whole or by region.

Everything stored is untrusted (spec section 12). The root ``zarr.json`` is
parsed and validated in Python before anything else. Each array's
``zarr.json`` is read and checked against its index entry in Python too, and
TensorStore is then opened with that checked metadata, so it never parses a
stored JSON document itself (its parser crashes on deeply nested input).
TensorStore decodes the chunks and verifies every CRC-32C; its errors become
:class:`CorruptCheckpointError` naming the tensor and the stored chunk.

A view reads one version (spec 10.7): it holds the directory it resolved
(:mod:`tensorckpt.storage.pinned`) and reads everything through it; a read
that a replace or deletion overlapped raises :class:`CheckpointChangedError`.
A location without a root is classified by :mod:`tensorckpt.identify`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import stat
from dataclasses import dataclass

import numpy as np
import tensorstore as ts
import torch

from . import identify
from .adapters.state import unflatten
from .errors import (
    CheckpointChangedError,
    CorruptCheckpointError,
    InvalidIndexError,
    TensorckptError,
)
from .format import dtypes
from .format.keys import flat_key, split_flat_key
from .format.metadata import (
    MAX_NODE_JSON_BYTES,
    MAX_ROOT_JSON_BYTES,
    CheckpointMetadata,
    RootMetadata,
    TensorEntry,
    loads,
    parse_root,
)
from .layout.boxes import Box, chunk_ranges
from .storage import arrays, commit, direct, kv, location, pinned
from .storage.arrays import check_array_metadata

# A read up to this size is allocated at once; a larger one first checks that
# the array stores at least that many bytes (version 1 does not compress), so
# a forged index cannot make a reader allocate out of proportion to the data.
TRUSTED_READ_BYTES = 64 << 20


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
        gone = loc.is_local and pin.changed()
        pin.close()
        if not gone:
            identify.no_root(loc)
    raise CheckpointChangedError(f"{loc}: the checkpoint was replaced again and again while it was opened; open it again")


def parse_root_bytes(loc: location.Location, data: bytes) -> RootMetadata:
    where = f"{loc}/{commit.ROOT_KEY}"
    return parse_root(loads(data, where), where)


def read_object(loc: location.Location, key: str) -> bytes | None:
    """A small stored object (a ``zarr.json``), or None if absent: at most
    ``MAX_NODE_JSON_BYTES``; a local one must be a regular file under plain
    directories (a FIFO would block forever, a link leads out)."""
    where = f"{loc}/{key}"
    if not loc.is_local:
        return pinned.read_remote(loc, key, MAX_NODE_JSON_BYTES, where)[1]
    try:
        return pinned.read_local(loc.path, key, MAX_NODE_JSON_BYTES, where)
    except (FileNotFoundError, NotADirectoryError):
        return None


class Checkpoint:
    """A committed checkpoint, opened read-only."""

    def __init__(self, path, _root: RootMetadata | None = None, _pin: pinned.Pin | None = None) -> None:
        self.location = location.parse(path)
        self._pin_error: str | None = None
        if _root is None:
            _pin, data = open_pinned(self.location)
            _root = parse_root_bytes(self.location, data)
        elif _pin is None:  # a distributed load: rank 0 read the root; see same_version
            try:
                _pin = pinned.Pin(self.location)
            except OSError as e:
                self._pin_error = f"cannot be opened any more ({e.strerror or e})"
        self._pin = _pin
        # every object is read from the version resolved first (spec 10.7); messages name the path
        self._read = _pin.read_loc if _pin is not None else self.location
        self._meta = _root
        self._arrays: dict[str, ts.TensorStore] = {}
        self._checked: set[str] = set()  # arrays whose zarr.json agrees with the index
        self._plain_dirs: set[str] = set()  # local directories found to be real directories, not links

    def close(self) -> None:
        """Release the hold on the version read (a directory descriptor
        locally); further reads fail. Also on leaving a ``with`` block."""
        self._arrays.clear()
        if self._pin is not None:
            self._pin.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def read_location(self) -> location.Location:
        """Where this view reads objects: locally ``/proc/self/fd/N``, the
        directory resolved at open (spec 10.7); else the location itself."""
        return self._read

    @property
    def pinned(self) -> bool:
        """Whether reads cannot see another version (a directory descriptor holds this one)."""
        return self._pin is not None and self._pin.pinned

    @property
    def version_id(self) -> tuple[int, int] | None:
        """Locally, the (device, inode) of the checkpoint directory this view reads."""
        return self._pin.dir_id if self._pin is not None else None

    def same_version(self, version_id: tuple[int, int] | None) -> None:
        """Raise :class:`CheckpointChangedError` unless this view reads the
        version ``version_id`` (another rank's :attr:`version_id`)."""
        if self._pin_error is not None or (self.location.is_local and self.version_id != version_id):
            raise CheckpointChangedError(
                f"{self.path}: the checkpoint was replaced between the root read and this rank's open "
                f"({self._pin_error or 'another directory'}); nothing was read: load again"
            )

    def changed(self) -> bool:
        """Whether the checkpoint at the path is no longer the version this view reads."""
        return self._pin is None or self._pin.changed()

    @contextlib.contextmanager
    def one_version(self):
        """Reads inside see one version of the checkpoint, or raise
        :class:`CheckpointChangedError` (retry) where a replace or deletion
        overlapped them: a failure caused by one is not reported as
        corruption, and where reads are not pinned to a directory (object
        stores) the root is compared after them."""
        self._check_open()
        try:
            yield
        except (CorruptCheckpointError, OSError):
            if self.changed():
                raise CheckpointChangedError(self._changed_message()) from None
            raise
        if not self.pinned and self.changed():
            raise CheckpointChangedError(self._changed_message())

    def _check_open(self) -> None:
        if self._pin is not None and self._pin.pinned and self._pin.fd is None:
            raise TensorckptError(f"{self.path}: this view was closed; open the checkpoint again to read it")

    def _changed_message(self) -> str:
        return (f"{self.path}: the checkpoint was replaced or deleted while it was read; nothing mixed from two "
                "versions was returned: open or load it again")

    # -- metadata
    @property
    def path(self) -> str:
        return self.location.url

    @property
    def metadata(self) -> CheckpointMetadata:
        return self._meta.header()

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
        return TensorInfo(k, e.shape, e.torch_dtype, e.nbytes, e.chunk_shape, e.inner_chunk_shape)

    # -- data
    def read(self, key, index=None):
        """The tensor at ``key`` (or only the region ``index``, a tuple of
        slices / ints), or the stored value if ``key`` is a non-tensor leaf.
        Raises :class:`CheckpointChangedError` (read again) where the
        checkpoint was replaced since it was opened and the data is gone."""
        k = self._key(key)
        if k in self._meta.values and index is None:
            return self._meta.values[k]
        e = self._entry(k)
        with self.one_version():
            return self._read_tensor(k, e, index)

    def _read_tensor(self, k: str, e: TensorEntry, index):
        self.check_arrays([k])
        norm = _normalize_index(index, e.shape, f"{self.path}: tensor {k!r}") if index is not None else ()
        rest = e.shape[len(norm):]  # the region read, in the array's coordinates (an int keeps its dimension)
        shape = tuple(len(range(ix.start, ix.stop, ix.step)) for ix in norm if isinstance(ix, slice)) + rest
        d = e.dtype_info
        self._check_backed(k, math.prod(shape) * d.itemsize)
        lo = tuple(ix if isinstance(ix, int) else ix.start for ix in norm) + (0,) * len(rest)
        hi = tuple(ix + 1 if isinstance(ix, int) else ix.stop for ix in norm) + rest
        box = Box(lo, tuple(h - l for l, h in zip(lo, hi)))
        self.check_objects(k, box)
        out = np.empty(shape, dtype=d.numpy)
        strided = out.size != box.numel  # a slice with a step: only part of the box
        fast = out.size and direct.available(self.location.is_local) and direct.usable(e)
        if fast and not strided:
            with direct.Pool(self._read.path, self.path) as pool:  # as load reads local checkpoints
                for f in pool.read(k, e, box, out.reshape(box.shape)):
                    f.result()
        elif fast and box.numel * d.itemsize <= max(TRUSTED_READ_BYTES, 4 * out.nbytes):
            # a strided read: the box around it, by the same reader and checks, then every step-th element
            self._check_backed(k, box.numel * d.itemsize)
            whole = np.empty(box.shape, dtype=d.numpy)
            with direct.Pool(self._read.path, self.path) as pool:
                for f in pool.read(k, e, box, whole):
                    f.result()
            out[...] = whole[tuple(slice(None, None, ix.step) if isinstance(ix, slice) else 0 for ix in norm)]
        else:
            self.read_into(k, self.array(k)[norm] if norm else self.array(k), out)
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
        """Open several arrays, each once its ``zarr.json`` is found to agree
        with the index (spec section 7). TensorStore gets the checked metadata
        and never reads the stored document."""
        todo = [k for k in keys if k not in self._arrays]
        self.check_arrays(todo)
        for k in todo:
            where = f"{self.path}/{k}/zarr.json"
            try:
                self._arrays[k] = arrays.open_read(self._read, k, self._meta.tensors[k]).result()
            except ValueError as err:
                raise CorruptCheckpointError(f"{where}: an array with this metadata cannot be opened ({short(err)})") from None
        return {k: self._arrays[k] for k in keys}

    def check_arrays(self, keys) -> None:
        """Check that every array's stored ``zarr.json`` agrees with its index
        entry (spec section 7); raise :class:`CorruptCheckpointError` naming
        the first that does not. Each array is checked once."""
        self._check_open()
        todo = [k for k in keys if k not in self._checked]
        remote = todo and not self.location.is_local
        store = ts.KvStore.open(self._read.kvstore(), context=location.CONTEXT).result() if remote else None
        reads = {k: _start_read(self._read, store, f"{k}/zarr.json") for k in todo}
        for k, pending in reads.items():
            where = f"{self.path}/{k}/zarr.json"
            try:
                data = pending()
            except (OSError, ValueError) as e:
                raise CorruptCheckpointError(f"{where}: cannot be read ({short(e)})") from None
            if data is None:
                raise CorruptCheckpointError(f"{where}: missing; the index lists tensor {k!r} but its array metadata is not stored")
            check_array_metadata(loads(data, where), self._meta.tensors[k], where)
            self._checked.add(k)

    def check_objects(self, key: str, region: Box) -> None:
        """Before TensorStore opens them: the stored objects of tensor ``key``
        that a read of ``region`` will open, and every directory above them, are plain files and directories
        on a local checkpoint. TensorStore follows links (out of the
        checkpoint) and blocks forever on a FIFO; a writer makes neither.
        A file larger than its inner chunks and index can take is refused
        too: TensorStore reads the span of the ranges it wants in one
        allocation, which a forged sparse file makes abort the process."""
        self._check_open()
        if not self.location.is_local:
            return
        e = self._meta.tensors[key]
        spans = chunk_ranges(region, e.chunk_shape, e.shape)
        if math.prod(len(s) for s in spans) == 0:
            return
        if math.prod(len(s) for s in spans) > 4096:  # many objects: one listing, proportional to what is stored
            for pos, size in self.chunk_objects(key).items():
                self._check_size(key, pos, size)
            return
        for pos in itertools.product(*spans):
            rel = "/".join((key, arrays.chunk_key(pos)))
            parts = rel.split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in self._plain_dirs:
                    self._lstat_is(d, stat.S_ISDIR, key)
                    self._plain_dirs.add(d)
            st = self._lstat_is(rel, stat.S_ISREG, key)
            if st is not None:
                self._check_size(key, pos, st.st_size)

    def _check_size(self, key: str, pos: tuple[int, ...], size: int | None) -> None:
        where = f"{self.path}/{key}/{arrays.chunk_key(pos)}"
        if size is None:
            raise CorruptCheckpointError(f"{where}: not a regular file (a link, FIFO or device; a writer makes none); tensor {key!r}")
        least, most = arrays.object_bytes_bounds(self._meta.tensors[key], pos)
        if size < least:  # as verify: TensorStore would trust its index and allocate what it claims
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r}, chunk {pos}, is malformed (truncated or damaged, or its tensor entry forged): "
                f"{size} bytes, but its inner chunks and index need at least {least}"
            )
        if size > most:
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r}, chunk {pos}, is {size} bytes, more than its inner chunks and index "
                f"can take ({most}): it is damaged or forged"
            )

    def _lstat_is(self, rel: str, kind, key: str) -> os.stat_result | None:
        try:
            st = os.lstat(os.path.join(self._read.path, rel))
        except FileNotFoundError:
            return None  # a missing object is the reader's to report
        except OSError as e:
            raise CorruptCheckpointError(f"{self.path}/{rel}: cannot be examined ({e.strerror}); tensor {key!r}") from None
        if not kind(st.st_mode):
            what = "directory" if kind is stat.S_ISDIR else "regular file"
            raise CorruptCheckpointError(
                f"{self.path}/{rel}: not a {what} (a link, FIFO or device; a writer makes none); tensor {key!r}"
            )
        return st

    def chunk_objects(self, key: str) -> dict[tuple[int, ...], int | None]:
        """The chunk objects stored for tensor ``key``: grid position -> size
        in bytes (None: not a regular file). Found by listing, so the work is
        proportional to what is stored, never to what the index claims.
        Other objects are ignored."""
        self._check_open()
        e = self._entry(key)
        grid = [-(-s // c) for s, c in zip(e.shape, e.chunk_shape)]
        out = {}
        for name, size in _object_sizes(self._read, key):
            parts = name.split("/")
            if parts[0] != "c" or len(parts) != len(grid) + 1 or not all(p.isascii() and p.isdigit() for p in parts[1:]):
                continue
            pos = tuple(int(p) for p in parts[1:])
            if parts[1:] == [str(i) for i in pos] and all(i < n for i, n in zip(pos, grid)):
                out[pos] = size
        return out

    def to_state_dict(self) -> dict:
        """The whole checkpoint as a nested dict of tensors and values."""
        leaves = {split_flat_key(k): v for k, v in self._meta.values.items()}
        with self.one_version():
            self.open_arrays(list(self._meta.tensors))
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

    def _check_backed(self, key: str, nbytes: int) -> None:
        """Refuse, before allocating, a read larger than all the array stores."""
        if nbytes <= TRUSTED_READ_BYTES:
            return
        stored = sum(n or 0 for n in self.chunk_objects(key).values())
        if nbytes > stored:
            e = self._meta.tensors[key]
            raise CorruptCheckpointError(
                f"{self.path}/{commit.ROOT_KEY}: tensor {key!r} is {list(e.shape)} {e.dtype}, so reading it needs "
                f"{nbytes} bytes, but its stored chunks hold only {stored} bytes; not allocating that"
            )


def _start_read(loc: location.Location, store: ts.KvStore, key: str):
    """Start reading a small object; returns a function giving its bytes or None."""
    if loc.is_local:
        return lambda: read_object(loc, key)
    future = store.read(key)

    def result() -> bytes | None:
        r = future.result()
        if r.state != "value":
            return None
        if len(r.value) > MAX_NODE_JSON_BYTES:
            raise CorruptCheckpointError(
                f"{loc}/{key}: more than {MAX_NODE_JSON_BYTES} bytes, larger than a reader accepts for an array "
                "zarr.json (spec 12): it is damaged or forged"
            )
        return r.value

    return result


def _object_sizes(loc: location.Location, prefix: str):
    """(key relative to ``prefix``, size) of every stored object under it. A
    local object that is not a regular file (a link, a FIFO, a device: none
    of which a writer makes) has size None; links are not followed."""
    if not loc.is_local:
        sub = location.Location(loc.scheme, f"{loc.path}/{prefix}")
        for name in kv.list_keys(sub):
            data = kv.read(sub, name)
            if data is not None:
                yield name, len(data)
        return
    top = os.path.join(loc.path, prefix)
    for folder, _, files in os.walk(top):
        for f in files:
            try:
                st = os.lstat(os.path.join(folder, f))
            except FileNotFoundError:
                continue  # deleted since it was listed (the checkpoint is being replaced: see one_version)
            size = st.st_size if stat.S_ISREG(st.st_mode) else None
            yield os.path.relpath(os.path.join(folder, f), top).replace(os.sep, "/"), size


# ----------------------------------------------------------------- indices


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


# ----------------------------------------------------------------- errors

_CHUNK_RE = re.compile(r'/c((?:/[0-9]+)*)"')  # the end of the stored object a TensorStore error quotes
_INNER_RE = re.compile(r"shard entry \{([0-9, ]*)\}/")
_SPEC_RE = re.compile(r"\s*\[tensorstore_spec=.*\]\s*$", re.S)


def wait(path: str, key: str, future):
    """Resolve a TensorStore read of tensor ``key``, turning its errors into a
    :class:`CorruptCheckpointError` naming the tensor and the stored chunk."""
    try:
        return future.result()
    except ValueError as e:
        raise CorruptCheckpointError(chunk_error(path, key, str(e))) from None


def chunk_error(path: str, key: str, msg: str) -> str:
    """The message for a failed read: which stored chunk (object path and
    grid position, and inner chunk when known) and what is wrong with it."""
    msg = short(msg)
    if "NOT_FOUND" in msg:
        what = "is missing"
    elif "Digest mismatch" in msg:
        what = "fails its CRC-32C checksum: the stored data is corrupt"
    else:
        what = "is malformed (truncated or damaged)"
    found = list(_CHUNK_RE.finditer(msg))
    if not found:
        return f"{path}: tensor {key!r}: a stored chunk {what} ({msg})"
    coords = found[-1].group(1)
    position = tuple(int(c) for c in coords.split("/")[1:])
    inner = _INNER_RE.search(msg)
    inner = f", inner chunk ({inner.group(1)})" if inner and inner.group(1) else ""
    return f"{path}/{key}/c{coords}: tensor {key!r}, chunk {position}{inner}, {what} ({msg})"


def short(e: object) -> str:
    """A TensorStore error without the long spec JSON it appends."""
    return _SPEC_RE.sub("", str(e))
