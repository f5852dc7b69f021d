"""tensorckpt checkpoints as a conversion source (export reads them tensor
by tensor, or in slabs of rows for a tensor larger than the memory bound),
and ``torch.save`` files, both ways.

``torch.save`` files are read with ``torch.load(weights_only=True)`` only
(memory-mapped where the file is in the zip format, so only the tensors
being converted are paged in); a file whose unpickling needs anything else
(a pickled class, a function) is refused, with torch's reason, which names
the global it refused. The loaded object must be a dict (any nesting of
dicts, lists and tuples): nested dict keys become key path components,
list and tuple positions ``"0"``, ``"1"``..., tensors become tensors and the
rest must be JSON-able values. Writing a ``torch.save`` file needs the
whole state in memory (the format is one pickle); it is written to a
temporary name, synced and renamed.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping, Sequence

import torch

from ..checkpoint import Checkpoint
from ..errors import CheckpointExistsError, TensorckptError, UnsupportedValueError
from ..format.keys import split_flat_key
from ..storage.location import PathArg
from .core import Path, Progress, Source, SourceTensor, read_cast


class CheckpointSource(Source):
    """A committed tensorckpt checkpoint."""

    def __init__(self, path: PathArg) -> None:
        self.ckpt = Checkpoint(path)
        self.description = self.ckpt.path
        idx = self.ckpt.index
        self.tensors = [
            SourceTensor(split_flat_key(k), e.torch_dtype, tuple(e.shape), k)
            for k, e in sorted(idx.tensors.items())
        ]
        self.values = {split_flat_key(k): v for k, v in sorted(idx.values.items())}

    def read(self, t: SourceTensor, start: int, stop: int) -> torch.Tensor:
        if not t.shape:
            return self.ckpt.read(t.ref)
        return self.ckpt.read(t.ref, index=(slice(start, stop),))

    def row_align(self, t: SourceTensor) -> int:
        e = self.ckpt.index.tensors[t.ref]
        return e.inner_chunk_shape[0] if e.inner_chunk_shape else 1


class TorchSaveSource(Source):
    """The tensors and values of a ``torch.save`` file (module docstring)."""

    def __init__(self, path: str) -> None:
        self.description = path
        obj = load_weights_only(path)
        if not isinstance(obj, Mapping):
            raise UnsupportedValueError(
                f"{path}: holds a {type(obj).__name__}; only a dict (a state dict or a nest of them) can be converted"
            )
        self.tensors, self.values = [], {}
        self._data: dict[Path, torch.Tensor] = {}
        _walk(obj, (), self, path)

    def read(self, t: SourceTensor, start: int, stop: int) -> torch.Tensor:
        data = self._data[t.path]
        return data.detach().clone() if not t.shape else data[start:stop].detach().clone()

    def close(self) -> None:
        self._data = {}


def load_weights_only(path: str) -> object:
    """``torch.load(path, weights_only=True)``, memory-mapped when possible;
    anything the restricted unpickler refuses is a :class:`UnsupportedValueError`."""
    if not os.path.isfile(path):
        raise TensorckptError(f"{path}: no such file")
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:  # the legacy (non-zip) format cannot be mapped
            if "mmap" not in str(e) and "zip" not in str(e):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        reason = next((line for line in first if "Unsupported" in line or "global" in line.lower()), first[0] if first else "")
        raise UnsupportedValueError(
            f"{path}: refused: torch.load(weights_only=True) cannot load it ({reason.strip()}). Only tensors and "
            "plain Python data are converted; load it yourself in trusted code and save a state dict"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise TensorckptError(f"{path}: not a readable torch.save file ({str(e).splitlines()[0] if str(e) else e})") from None


def _walk(node: Mapping | Sequence, prefix: Path, src: TorchSaveSource, where: str) -> None:
    items = node.items() if isinstance(node, Mapping) else enumerate(node)
    for name, value in items:
        if not isinstance(name, (str, int)) or isinstance(name, bool):
            raise UnsupportedValueError(f"{where}: key {name!r} under {'/'.join(prefix) or 'the top level'!r} is not a str")
        path = prefix + (str(name),)
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                raise UnsupportedValueError(f"{where}: {'/'.join(path)!r} is a {value.layout} tensor; only dense tensors convert")
            src.tensors.append(SourceTensor(path, value.dtype, tuple(value.shape), None))
            src._data[path] = value
        elif (isinstance(value, Mapping) and value) or (
            isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, Mapping)) for v in value)
        ):
            _walk(value, path, src, where)
        else:
            src.values[path] = value


def write_torch_save(source: Source, tensors: list[SourceTensor], values: dict[Path, object], dst: str,
                     dtype: torch.dtype | None, progress: bool | None) -> None:
    """One ``torch.save`` file of the nested state (module docstring)."""
    from ..adapters.state import unflatten
    from .core import cast_dtype

    if os.path.lexists(dst):
        raise CheckpointExistsError(f"{dst}: already exists; choose a new destination or remove it first")
    bar = Progress(sum(t.ref.nbytes for t in tensors), "export", progress)
    leaves: dict = dict(values)
    try:
        for t in tensors:
            leaves[t.path] = read_cast(source, t, 0, t.shape[0] if t.shape else 1, cast_dtype(t, dtype))
            bar.update(t.ref.nbytes)
    finally:
        bar.close()
    tmp = f"{dst}.tensorckpt-convert-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(unflatten(leaves), f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
