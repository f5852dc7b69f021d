"""Hugging Face safetensors: read (one file, a directory of shards with
``model.safetensors.index.json``, or a directory of ``*.safetensors``) and
write (the HF layout, sharded by ``max_shard_size``).

A safetensors file is ``u64 little-endian N``, ``N`` bytes of JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}``, then the data; each tensor is contiguous, row-major, little
endian, at ``8 + N + begin``. The header is parsed here, in Python, and
checked before any data is read: its size is capped at
:data:`MAX_HEADER_BYTES` (100 MB, as the safetensors library does), every
entry must have a known dtype, a shape of non-negative ints, a byte range
matching its shape that lies inside the file and overlaps no other. Tensors
are read by byte range (rows ``[a, b)`` of a tensor are one range), so the
``safetensors`` package is not needed to read; writing is also done here.
A tensor key is its safetensors name as one key component
(``model.layers.0.weight``), so plain state dicts map key for key.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from collections.abc import Iterator
from types import TracebackType

import numpy as np
import torch

from ..errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    TensorckptError,
    UnsupportedValueError,
)
from ..format import dtypes
from .core import Progress, Source, SourceTensor, prefetch, slabs, unsupported_dtype

# what one output file holds, in file order: (key, tensor, dtype written, bytes)
Shard = list[tuple[str, SourceTensor, torch.dtype, int]]

MAX_HEADER_BYTES = 100_000_000
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# safetensors dtype -> torch dtype (the ones tensorckpt stores)
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
}
NAMES = {v: k for k, v in DTYPES.items()}
KNOWN_UNSTORABLE = ("U16", "U32", "U64", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "I4", "U4")


def parse_size(text: int | str) -> int:
    """``"5GB"`` -> 5 * 10**9, ``"500MiB"`` -> 500 * 2**20, an int as is (HF's convention)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(text).upper())
    if not m:
        raise TensorckptError(f"max_shard_size={text!r}: expected a size such as 5GB, 500MB, 2GiB or bytes")
    unit = m.group(2) or "B"
    base = 1024 if "I" in unit else 1000
    power = "BKMGT".index(unit[0]) if unit != "B" else 0
    return int(float(m.group(1)) * base**power)


class SafetensorsSource(Source):
    """The tensors of one or more safetensors files (all headers checked at construction)."""

    def __init__(self, path: str) -> None:
        self.description = path
        files, index = _files(path)
        self.tensors, self.values = [], {}
        self._fds: dict[str, int] = {}
        self.metadata: dict[str, str] = {}
        names: dict[str, str] = {}
        for f in files:
            header, start, _, meta = read_header(f)
            for name, (dtype, shape, begin, _end) in header.items():
                if name in names:
                    raise CorruptCheckpointError(f"{f}: tensor {name!r} is also in {names[name]}")
                names[name] = f
                self.tensors.append(SourceTensor((name,), dtype, shape, (f, start + begin)))
            self.metadata.update(meta)
        for name, file in (index or {}).items():
            if names.get(name) is None or os.path.basename(names[name]) != file:
                raise CorruptCheckpointError(
                    f"{os.path.join(path, INDEX_NAME)}: weight_map says {name!r} is in {file!r}, "
                    f"but {'it is in ' + names[name] if name in names else 'no shard holds it'}"
                )

    def read(self, t: SourceTensor, start: int, stop: int) -> torch.Tensor:
        file, at = t.ref
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDONLY)
        rows = stop - start if t.shape else 1
        out = torch.empty(((rows,) + t.shape[1:]) if t.shape else (), dtype=t.dtype)
        buf = memoryview(_bytes_view(out))  # type: ignore[arg-type]
        offset, done = at + start * t.row_bytes, 0
        while done < len(buf):
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n <= 0:
                raise CorruptCheckpointError(f"{file}: tensor {t.path[0]!r} is cut short (file truncated?)")
            done += n
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def _bytes_view(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)


def _files(path: str) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of ``path`` (a file, or a directory with an index
    or with ``*.safetensors`` files) and the index's weight map, if any."""
    if os.path.isfile(path):
        return [path], None
    if not os.path.isdir(path):
        raise TensorckptError(f"{path}: no such safetensors file or directory")
    index_path = os.path.join(path, INDEX_NAME)
    if os.path.exists(index_path):
        try:
            with open(index_path, "rb") as f:
                doc = json.loads(f.read(MAX_HEADER_BYTES + 1))
        except (OSError, ValueError) as e:
            raise CorruptCheckpointError(f"{index_path}: not a readable JSON index ({e})") from None
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise CorruptCheckpointError(f"{index_path}: 'weight_map' must map tensor names to file names")
        for file in set(wm.values()):
            if file != os.path.basename(file) or file in ("", ".", ".."):
                raise CorruptCheckpointError(f"{index_path}: shard name {file!r} is not a plain file name")
            if not os.path.isfile(os.path.join(path, file)):
                raise CorruptCheckpointError(f"{index_path}: shard {file!r} is missing from {path}")
        return [os.path.join(path, f) for f in sorted(set(wm.values()))], wm
    found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not found:
        raise TensorckptError(f"{path}: no *.safetensors files here")
    return [os.path.join(path, n) for n in found], None


def read_header(path: str) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], int, int, dict]:
    """Parse and check the header of one file: name -> (dtype, shape, begin,
    end) with offsets relative to the data start; the data start, the file
    size and the ``__metadata__``."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptCheckpointError(f"{path}: {size} bytes, too short for a safetensors header")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES:
                raise CorruptCheckpointError(
                    f"{path}: header of {n} bytes exceeds the cap of {MAX_HEADER_BYTES} bytes (not a safetensors file?)"
                )
            if 8 + n > size:
                raise CorruptCheckpointError(f"{path}: header of {n} bytes runs past the end of the {size}-byte file (truncated?)")
            raw = f.read(n)
    except OSError as e:
        raise TensorckptError(f"{path}: cannot be read ({e})") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: the header is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path}: the header must be a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CorruptCheckpointError(f"{path}: '__metadata__' must map strings to strings")
    start, out, spans = 8 + n, {}, []
    for name, ent in doc.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(ent, dict) or set(ent) - {"dtype", "shape", "data_offsets"} or len(ent) != 3:
            raise CorruptCheckpointError(f"{where}: an entry must have exactly 'dtype', 'shape' and 'data_offsets'")
        name_dt, shape, offs = ent["dtype"], ent["shape"], ent["data_offsets"]
        if not isinstance(name_dt, str) or name_dt not in DTYPES:
            if isinstance(name_dt, str) and name_dt in KNOWN_UNSTORABLE:
                raise unsupported_dtype(name_dt, name, path, list(DTYPES))
            raise CorruptCheckpointError(f"{where}: unknown dtype {name_dt!r}")
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape) or len(shape) > 32:
            raise CorruptCheckpointError(f"{where}: shape {shape!r} must be a list of non-negative ints")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs) and 0 <= offs[0] <= offs[1]):
            raise CorruptCheckpointError(f"{where}: data_offsets {offs!r} must be [begin, end] with 0 <= begin <= end")
        dtype = DTYPES[name_dt]
        nbytes = math.prod(shape) * dtypes.for_torch(dtype).itemsize
        if offs[1] - offs[0] != nbytes:
            raise CorruptCheckpointError(f"{where}: data_offsets {offs} hold {offs[1] - offs[0]} bytes; shape {shape} {name_dt} needs {nbytes}")
        if start + offs[1] > size:
            raise CorruptCheckpointError(f"{where}: data_offsets {offs} run past the end of the file ({size - start} data bytes; truncated?)")
        out[name] = (dtype, tuple(shape), offs[0], offs[1])
        if nbytes:
            spans.append((offs[0], offs[1], name))
    spans.sort()
    for (a0, a1, an), (b0, b1, bn) in itertools.pairwise(spans):
        if b0 < a1:
            raise CorruptCheckpointError(f"{path}: tensors {an!r} {[a0, a1]} and {bn!r} {[b0, b1]} overlap")
    return out, start, size, meta


# ------------------------------------------------------------------- export


def write(source: Source, tensors: list[SourceTensor], dst: str, *, max_shard_size: int | str = "5GB",
          dtype: torch.dtype | None = None, memory_bytes: int, progress: bool | None = None,
          metadata: dict[str, str] | None = None) -> list[str]:
    """Write ``tensors`` (selected from ``source``) as safetensors in the HF
    layout into the new directory ``dst``: ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` shards of at most ``max_shard_size``
    bytes (a larger tensor gets a shard of its own) plus
    ``model.safetensors.index.json``. Written in a staging directory and
    renamed into place, so ``dst`` appears complete or not at all. Returns
    the file names."""
    from .core import cast_dtype

    limit = parse_size(max_shard_size)
    plan: list[Shard] = [[]]
    size = 0
    for t in tensors:
        d = cast_dtype(t, dtype)
        if d not in NAMES:
            asked = f" (dtype={d} was asked for)" if d != t.dtype else ""
            raise UnsupportedValueError(
                f"{dst}: tensor {t.key!r} would be written as {d}{asked}, which this writer has no safetensors "
                f"dtype for; writable: {', '.join(str(k).removeprefix('torch.') for k in NAMES)}. Cast with dtype= "
                "or leave it out (only=/rename=)"
            )
        nbytes = math.prod(t.shape) * dtypes.for_torch(d).itemsize
        if plan[-1] and size + nbytes > limit:
            plan.append([])
            size = 0
        plan[-1].append((t.key, t, d, nbytes))
        size += nbytes
    if dst.endswith(".safetensors"):  # one file, whatever its size
        plan = [[item for shard in plan for item in shard]]
    n = len(plan)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    bar = Progress(sum(t.ref.nbytes for t in tensors), "export", progress)
    if dst.endswith(".safetensors"):
        if os.path.lexists(dst):
            raise CheckpointExistsError(f"{dst}: already exists; choose a new destination or remove it first")
        parent, base = os.path.split(os.path.abspath(dst))
        tmp = os.path.join(parent, f".{base}.tensorckpt-convert-{os.getpid()}-{os.urandom(3).hex()}")
        try:
            _write_file(source, tmp, plan[0], memory_bytes, bar, metadata)
            os.rename(tmp, dst)
        finally:
            bar.close()
            if os.path.exists(tmp):
                os.unlink(tmp)
        return [base]
    with staging_dir(dst) as stage:
        try:
            for name, shard in zip(names, plan):
                _write_file(source, os.path.join(stage, name), shard, memory_bytes, bar, metadata)
        finally:
            bar.close()
        if n > 1:
            index = {
                "metadata": {"total_size": sum(s for shard in plan for *_, s in shard)},
                "weight_map": {key: name for name, shard in zip(names, plan) for key, *_ in shard},
            }
            _write_small(os.path.join(stage, INDEX_NAME), json.dumps(index, indent=2).encode())
    return names + ([INDEX_NAME] if n > 1 else [])


def _write_file(source: Source, path: str, shard: Shard, memory_bytes: int, bar: Progress,
                metadata: dict[str, str] | None) -> None:
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    at = 0
    for key, t, d, nbytes in shard:
        header[key] = {"dtype": NAMES[d], "shape": list(t.shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for (t, a, b, _d), data in prefetch(source, _jobs(source, shard, memory_bytes // 2)):
            if not data.is_contiguous():
                data = data.contiguous()
            f.write(memoryview(_bytes_view(data)))  # type: ignore[arg-type]
            bar.update((b - a) * t.ref.row_bytes if t.shape else t.ref.nbytes)
        f.flush()
        os.fsync(f.fileno())


def _jobs(source: Source, shard: Shard, slab_bytes: int) -> Iterator[tuple[SourceTensor, int, int, torch.dtype]]:
    """The reads making up a shard's data, in file order: whole small
    tensors, slabs of rows of at most ``slab_bytes`` of larger ones."""
    for _, t, d, nbytes in shard:
        if not t.shape:
            yield t, 0, 1, d
            continue
        row = max(1, nbytes // max(1, t.shape[0]))
        for a, b in slabs(t.shape[0], slab_bytes // row, source.row_align(t.ref)):
            if b > a:
                yield t, a, b, d


def _write_small(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class staging_dir:
    """``with staging_dir(dst) as stage:`` write into ``stage``; on success it
    is synced and renamed to ``dst`` (which must not exist), else removed."""

    def __init__(self, dst: str) -> None:
        self.dst = os.path.abspath(dst)
        if os.path.lexists(self.dst):
            raise CheckpointExistsError(f"{dst}: already exists; choose a new destination or remove it first")
        parent, name = os.path.split(self.dst)
        self.stage = os.path.join(parent, f".{name}.tensorckpt-convert-{os.getpid()}-{os.urandom(3).hex()}")

    def __enter__(self) -> str:
        os.makedirs(self.stage)
        return self.stage

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        import shutil

        if kind is not None:
            shutil.rmtree(self.stage, ignore_errors=True)
            return
        fd = os.open(self.stage, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if os.path.lexists(self.dst):
            shutil.rmtree(self.stage, ignore_errors=True)
            raise CheckpointExistsError(f"{self.dst}: appeared while converting; the result was discarded")
        os.rename(self.stage, self.dst)
        fd = os.open(os.path.dirname(self.dst), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
