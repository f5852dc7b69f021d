"""torch.distributed.checkpoint (DCP) directories written by DCP's
``FileSystemWriter``: read and write.

A DCP directory holds ``.metadata`` (a pickle of DCP's ``Metadata``) and
``*.distcp`` files; every tensor chunk is one ``torch.save`` archive at a
byte range of a ``.distcp`` file, every other value a ``torch.save`` of it.

**Untrusted pickle.** ``.metadata`` is read by a restricted unpickler whose
``find_class`` allows only DCP's metadata classes
(``torch.distributed.checkpoint.metadata``: ``Metadata``, ``MetadataIndex``,
``TensorStorageMetadata``, ``BytesStorageMetadata``, ``ChunkStorageMetadata``,
``TensorProperties``, ``StorageMeta``, ``_MEM_FORMAT_ENCODING``; the
filesystem's ``_StorageInfo``), ``torch.Size``, torch dtypes and layouts,
``pathlib`` paths and ``collections.OrderedDict``; any other global (a
function to call, a class to build) is refused with an error naming it,
before it is called. Chunks and values are loaded with
``torch.load(weights_only=True)``. The unpickled structure is then checked:
file names are plain names of existing files, byte ranges lie inside them,
each tensor's chunks tile it exactly, no storage transforms (DCP's
compression extensions) are used.

**Keys.** DCP's default planner flattens a nested state dict and records,
in ``planner_data``, each flat FQN's key path: ``model.layers.0.weight``
-> ``("model", "layers.0.weight")``. That path is the tensorckpt key path
(flat key ``model/layers.0.weight``); without planner data a FQN is one
key component, key for key. Key paths through lists (an int component)
rebuild the list: ``optim.param_groups.0.lr`` -> ``[{"lr": ..., ...}]``,
which is then stored per parameter as format 1.2 does
(``optim/group_of/<fqn>``, ``optim/groups/<id>/<hparam>``; ``param_names``
dropped; DCP records no optimizer class, so ``optim/class`` is absent). The optimizer layout of DCP's ``get_state_dict`` (``optim.state.<fqn>.<name>``)
is thus spec/training-state.md's ``optim/state/<fqn>/<name>``, and a
0-d ``step`` tensor under it becomes the JSON number that layout stores: a
checkpoint saved with ``dcp.save({"model": msd, "optim": osd})`` after
``get_state_dict(model, opt)`` loads with ``tensorckpt.load({"model": model,
"optim": opt}, path)``. Sharded tensors (chunks in several ``.distcp``
files) become one logical array each.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from collections.abc import Iterator, Mapping
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import CorruptCheckpointError, TensorckptError, UnsupportedValueError
from ..format import dtypes
from ..layout import tiling
from .core import (
    Path,
    Progress,
    Source,
    SourceTensor,
    prefetch,
    slabs,
    unsupported_dtype,
)

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

METADATA_NAME = ".metadata"
_MD = "torch.distributed.checkpoint.metadata"
ALLOWED = {
    (_MD, n) for n in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, f: IO[bytes], where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise UnsupportedValueError(
            f"{self.where}: refused: the pickle asks for {module}.{name}, which is not a DCP metadata class; "
            "tensorckpt unpickles only DCP's own metadata types (this file may not come from DCP's FileSystemWriter)"
        )


def read_metadata(path: str) -> Metadata:
    """DCP's ``Metadata`` of the directory ``path``, through the restricted unpickler."""
    where = os.path.join(path, METADATA_NAME)
    try:
        with open(where, "rb") as f:
            md = _Unpickler(f, where).load()
    except FileNotFoundError:
        raise TensorckptError(f"{path}: no {METADATA_NAME} here; not a DCP checkpoint directory") from None
    except UnsupportedValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed pickle raises anything
        raise CorruptCheckpointError(f"{where}: cannot be unpickled as DCP metadata ({type(e).__name__}: {e})") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{where}: holds a {type(md).__name__}, not DCP Metadata")
    return md


class DCPSource(Source):
    """A DCP checkpoint directory (module docstring)."""

    def __init__(self, path: str) -> None:
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            TensorStorageMetadata,
        )

        self.description = path
        self.path = path
        md = read_metadata(path)
        where = os.path.join(path, METADATA_NAME)
        sd, storage = md.state_dict_metadata, md.storage_data
        if not isinstance(sd, dict) or not isinstance(storage, dict):
            raise CorruptCheckpointError(f"{where}: state_dict_metadata and storage_data must be dicts")
        self._where = {(idx.fqn, tuple(idx.offset) if idx.offset is not None else None): info for idx, info in storage.items()}
        sizes: dict[str, int] = {}
        for info in storage.values():
            self._check_info(info, sizes)
        planner = md.planner_data if isinstance(md.planner_data, dict) else {}
        self.tensors, raw_values = [], {}
        self._cache: dict[tuple, torch.Tensor] = {}
        self._fds: dict[str, int] = {}
        for fqn, m in sd.items():
            kp = planner.get(fqn, (fqn,))
            if not isinstance(kp, (tuple, list)) or not kp or not all(isinstance(p, (str, int)) for p in kp):
                raise CorruptCheckpointError(f"{where}: planner data for {fqn!r} is not a key path: {kp!r}")
            kp = tuple(kp)
            if isinstance(m, TensorStorageMetadata):
                self.tensors.append(self._tensor(fqn, kp, m, where))
            elif isinstance(m, BytesStorageMetadata):
                raw_values[kp] = self._value(fqn)
            else:
                raise CorruptCheckpointError(f"{where}: {fqn!r} has unknown storage metadata {type(m).__name__}")
        self.values = _assemble(raw_values)
        self._numbers_for_optimizer_steps()
        self.values = _per_parameter_groups(self.values)

    # -- checks
    def _check_info(self, info: Any, sizes: dict[str, int]) -> None:  # info: untrusted, from the pickle
        where = os.path.join(self.path, METADATA_NAME)
        name = getattr(info, "relative_path", None)
        off, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(name, str) or name != os.path.basename(name) or name in ("", ".", ".."):
            raise CorruptCheckpointError(f"{where}: storage file {name!r} is not a plain file name")
        if type(off) is not int or type(length) is not int or off < 0 or length < 0:
            raise CorruptCheckpointError(f"{where}: bad byte range {off!r}+{length!r} in {name!r}")
        if getattr(info, "transform_descriptors", None):
            raise UnsupportedValueError(
                f"{where}: {name!r} uses DCP storage transforms {list(info.transform_descriptors)}; "
                "only checkpoints without extensions (no compression) can be converted"
            )
        if name not in sizes:
            file = os.path.join(self.path, name)
            if not os.path.isfile(file):
                raise CorruptCheckpointError(f"{self.path}: data file {name!r} listed in {METADATA_NAME} is missing")
            sizes[name] = os.path.getsize(file)
        if off + length > sizes[name]:
            raise CorruptCheckpointError(
                f"{os.path.join(self.path, name)}: byte range {off}+{length} runs past the end of the "
                f"{sizes[name]}-byte file (truncated?)"
            )

    def _tensor(self, fqn: str, kp: tuple, m: TensorStorageMetadata, where: str) -> SourceTensor:
        dtype = getattr(m.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has no dtype")
        if dtypes.BY_TORCH.get(dtypes.torch_name(dtype)) is None:
            raise unsupported_dtype(str(dtype), fqn, self.path, list(dtypes.BY_TORCH))
        shape = tuple(int(s) for s in m.size)
        chunks = []
        for c in m.chunks:
            offsets, csizes = tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes)
            if len(offsets) != len(shape) or len(csizes) != len(shape):
                raise CorruptCheckpointError(f"{where}: a chunk of {fqn!r} has the wrong number of dimensions")
            if (fqn, offsets) not in self._where:
                raise CorruptCheckpointError(f"{where}: chunk at {list(offsets)} of {fqn!r} has no storage entry")
            chunks.append((offsets, csizes))
        if shape:
            try:
                tiling.check_tiling(fqn, shape, np.array([o for o, _ in chunks], np.int64).reshape(-1, len(shape)),
                                    np.array([s for _, s in chunks], np.int64).reshape(-1, len(shape)))
            except TensorckptError as e:
                raise CorruptCheckpointError(f"{where}: {e}") from None
        elif len(chunks) != 1:
            raise CorruptCheckpointError(f"{where}: 0-d tensor {fqn!r} must have one chunk")
        chunks.sort()
        path = tuple(str(p) for p in kp)
        return SourceTensor(path, dtype, shape, (fqn, tuple(chunks)))

    # -- data
    def _load(self, fqn: str, offsets: tuple[int, ...] | None, what: str = "tensor") -> object:
        """``torch.load(weights_only=True)`` of one stored item, read in place
        from its byte range (no intermediate copy of the whole item)."""
        info = self._where[(fqn, offsets)]
        file = os.path.join(self.path, info.relative_path)
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDONLY)
        try:
            return torch.load(io.BufferedReader(_Slice(fd, info.offset, info.length, file), 1 << 20),
                              map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsupportedValueError(
                f"{file}: refused: {what} {fqn!r} is not plain data (torch.load(weights_only=True): "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else e})"
            ) from None
        except Exception as e:  # noqa: BLE001 - a damaged archive raises anything
            raise CorruptCheckpointError(f"{file}: {what} {fqn!r} cannot be read ({type(e).__name__}: {e})") from None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        self._cache = {}

    def _value(self, fqn: str) -> object:
        return self._load(fqn, None, "value")

    def read(self, t: SourceTensor, start: int, stop: int) -> torch.Tensor:
        _, chunks = t.ref
        if not t.shape:
            return self._chunk(t, chunks[0], final=True).clone()
        whole = [c for c in chunks if c[0][0] <= start and c[0][0] + c[1][0] >= stop and c[1][1:] == t.shape[1:]]
        if whole:  # one chunk holds these rows whole: no copy
            (offsets, sizes), = whole[:1]
            data = self._chunk(t, (offsets, sizes), final=offsets[0] + sizes[0] <= stop)
            return data[start - offsets[0] : stop - offsets[0]]
        out = torch.empty((stop - start,) + t.shape[1:], dtype=t.dtype)
        for offsets, sizes in chunks:
            a, b = offsets[0], offsets[0] + sizes[0]
            if b <= start or a >= stop or 0 in sizes:
                continue
            data = self._chunk(t, (offsets, sizes), final=b <= stop)
            lo, hi = max(a, start), min(b, stop)
            dst = out[lo - start : hi - start]
            src = data[lo - a : hi - a]
            idx = tuple(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:]))
            dst[(slice(None),) + idx] = src
        return out

    def _chunk(self, t: SourceTensor, chunk: tuple[tuple[int, ...], tuple[int, ...]], final: bool) -> torch.Tensor:
        """One stored chunk; kept until the last slab that needs it (each chunk is loaded once)."""
        fqn = t.ref[0]
        key = (fqn, chunk[0])
        data = self._cache.pop(key, None)
        if data is None:
            loaded = self._load(fqn, chunk[0])
            if not isinstance(loaded, torch.Tensor) or tuple(loaded.shape) != chunk[1] or loaded.dtype != t.dtype:
                got = f"{list(loaded.shape)} {loaded.dtype}" if isinstance(loaded, torch.Tensor) else type(loaded).__name__
                raise CorruptCheckpointError(
                    f"{self.path}: chunk at {list(chunk[0])} of {fqn!r} holds {got}, the metadata says "
                    f"{list(chunk[1])} {t.dtype}"
                )
            data = loaded
        if not final:
            self._cache[key] = data
        return data

    def _numbers_for_optimizer_steps(self) -> None:
        """0-d tensors under ``K/state/<fqn>/<name>`` of an optimizer (``K``
        also has ``param_groups``) become JSON numbers (training-state.md 4.2)."""
        optims = {p[:-1] for p in self.values if p and p[-1] == "param_groups"}
        keep = []
        for t in self.tensors:
            if not t.shape and len(t.path) >= 3 and t.path[:-3] in optims and t.path[-3] == "state":
                v = self.read(t, 0, 1)
                if v.dtype == torch.bool:
                    self.values[t.path] = bool(v)
                    continue
                if not v.is_complex() and math.isfinite(float(v)):
                    self.values[t.path] = float(v) if v.is_floating_point() else int(v)
                    continue
            keep.append(t)
        self.tensors = keep


class _Slice(io.RawIOBase):
    """The byte range ``[start, start + length)`` of an open file, as a
    seekable read-only stream (what ``torch.load`` reads one item from)."""

    def __init__(self, fd: int, start: int, length: int, name: str) -> None:
        super().__init__()
        self.fd, self.start, self.length, self.pos, self.name_ = fd, start, length, 0, name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b: WriteableBuffer) -> int:
        view = memoryview(b)
        n = min(len(view), self.length - self.pos)
        if n <= 0:
            return 0
        got = os.preadv(self.fd, [view[:n]], self.start + self.pos)
        if got == 0:
            raise CorruptCheckpointError(f"{self.name_}: an item is cut short at byte {self.start + self.pos} (truncated?)")
        self.pos += got
        return got


def _assemble(raw: dict[tuple, object]) -> dict[Path, object]:
    """Values by key path; paths through lists (int components) rebuild the
    list at the path up to the first int."""
    out: dict[Path, object] = {}
    nested: dict[Path, dict] = {}
    for kp, v in raw.items():
        i = next((j for j, p in enumerate(kp) if isinstance(p, int)), None)
        if i is None:
            out[tuple(kp)] = _plain(v)
            continue
        node = nested.setdefault(tuple(str(p) for p in kp[:i]), {})
        for p in kp[i:-1]:
            node = node.setdefault(p, {})
        node[kp[-1]] = _plain(v)
    for base, tree in nested.items():
        value = _to_lists(tree)
        if base and base[-1] == "param_groups" and isinstance(value, list):
            value = [{k: g for k, g in group.items() if k != "param_names"} if isinstance(group, dict) else group for group in value]
        out[base] = value
    return out


def _per_parameter_groups(values: dict[Path, object]) -> dict[Path, object]:
    """DCP's ``K/param_groups`` list (``params`` as FQN lists, as
    ``get_state_dict`` writes it) in the layout of format 1.2
    (training-state.md 4.2): ``K/group_of/<fqn>`` -> the id of the group's
    hyperparameters, ``K/groups/<id>/<hparam>``. DCP records no optimizer
    class, so ``K/class`` is left out (loading then does not check it)."""
    from ..adapters.optimizer import group_id

    out: dict[Path, object] = {}
    for path, value in values.items():
        groups = value if path and path[-1] == "param_groups" and isinstance(value, list) else None
        if groups is None or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
            out[path] = value
            continue
        base = path[:-1]
        for g in groups:
            hparams = {k: v for k, v in g.items() if k not in ("params", "param_names")}
            gid = group_id(hparams, "/".join(path))
            if hparams:
                out.update({(*base, "groups", gid, k): v for k, v in hparams.items()})
            else:
                out[(*base, "groups", gid)] = {}
            out.update({(*base, "group_of", str(fqn)): gid for fqn in g["params"]})
    return out


def _to_lists(node: object) -> object:
    if not isinstance(node, dict):
        return node
    if node and all(isinstance(k, int) for k in node):
        return [_to_lists(node[k]) for k in sorted(node)]
    return {str(k): _to_lists(v) for k, v in node.items()}


def _plain(v: object) -> object:
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, torch.Tensor) and v.dim() == 0:
        return v.item()
    return v


# ------------------------------------------------------------------- export


def _jobs(
    source: Source, tensors: list[SourceTensor], dtype: torch.dtype | None, slab_bytes: int
) -> Iterator[tuple[SourceTensor, int, int, torch.dtype]]:
    """Each tensor whole, or in slabs of rows of at most ``slab_bytes``
    (one DCP chunk each); an empty tensor is one empty chunk."""
    from .core import cast_dtype

    for t in tensors:
        d = cast_dtype(t, dtype)
        if not t.shape:
            yield t, 0, 1, d
            continue
        row = max(1, math.prod(t.shape[1:]) * dtypes.for_torch(d).itemsize)
        for a, b in slabs(t.shape[0], slab_bytes // row, source.row_align(t.ref)):
            yield t, a, b, d


def write(source: Source, tensors: list[SourceTensor], values: dict[Path, object], dst: str, *,
          dtype: torch.dtype | None, memory_bytes: int, progress: bool | None) -> None:
    """A DCP checkpoint directory at ``dst`` (new) that
    ``torch.distributed.checkpoint.load`` reads: one ``__0_0.distcp`` file,
    each tensor one chunk (or row slabs of at most ``memory_bytes``, one
    chunk each), values as ``torch.save`` bytes, ``planner_data`` mapping
    each FQN (key path joined by ``.``) to its key path."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from .safetensors import staging_dir

    name = "__0_0.distcp"
    sd: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage: dict = {}
    planner: dict = {}
    with staging_dir(dst) as stage:
        bar = Progress(sum(t.ref.nbytes for t in tensors), "export", progress)
        try:
            with open(os.path.join(stage, name), "wb") as f:
                def put(obj: object) -> tuple[int, int]:
                    buf = io.BytesIO()
                    torch.save(obj, buf)
                    at = f.tell()
                    f.write(buf.getbuffer())
                    return at, f.tell() - at

                chunks: dict[str, list] = {}
                for (t, a, b, d), data in prefetch(source, _jobs(source, tensors, dtype, memory_bytes // 2)):
                    fqn = ".".join(t.path)
                    planner[fqn] = t.path
                    offsets = torch.Size((a,) + (0,) * (len(t.shape) - 1)) if t.shape else torch.Size(())
                    at, length = put(data.contiguous())
                    chunks.setdefault(fqn, []).append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(data.shape)))
                    storage[MetadataIndex(fqn, offsets)] = _StorageInfo(name, at, length)
                    sd[fqn] = TensorStorageMetadata(TensorProperties(dtype=d), torch.Size(t.shape), chunks[fqn])
                    bar.update((b - a) * t.ref.row_bytes if t.shape else t.ref.nbytes)
                for path, v in values.items():
                    fqn = ".".join(path)
                    planner[fqn] = path
                    at, length = put(v)
                    sd[fqn] = BytesStorageMetadata()
                    storage[MetadataIndex(fqn)] = _StorageInfo(name, at, length)
                f.flush()
                os.fsync(f.fileno())
        finally:
            bar.close()
        md = Metadata(state_dict_metadata=sd, planner_data=planner, storage_data=storage, storage_meta=StorageMeta(), version="1.0.0")
        with open(os.path.join(stage, METADATA_NAME), "wb") as f:
            pickle.dump(md, f)
            f.flush()
            os.fsync(f.fileno())
