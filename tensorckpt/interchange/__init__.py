"""Interchange: take in and give out the checkpoints users already have.

    tensorckpt.convert("dcp_dir", "ckpt/step-100")                        # DCP -> tensorckpt
    tensorckpt.convert("hf_model/", "ckpt/base")                          # safetensors -> tensorckpt
    tensorckpt.convert("model.pt", "ckpt/base")                           # torch.save -> tensorckpt
    tensorckpt.convert("ckpt/step-100", "hf_out", to_format="safetensors",
                       only="model/", strip_prefix="model/", dtype=torch.bfloat16)
    tensorckpt.convert("ckpt/step-100", "dcp_out", to_format="dcp")

Formats: ``tensorckpt``, ``dcp`` (torch.distributed.checkpoint
FileSystemWriter directories), ``safetensors`` (one file, or a directory of
shards with ``model.safetensors.index.json``), ``torch`` (a ``torch.save``
file, read with ``weights_only=True`` only). The source format is detected
from what is at ``src`` (a root ``zarr.json`` of a tensorckpt checkpoint, a
``.metadata`` file, ``*.safetensors`` files, any other file: torch.save);
the destination format defaults to ``tensorckpt`` (``safetensors`` when
``dst`` ends in ``.safetensors``, ``torch`` for ``.pt``/``.pth``/``.bin``).

Every conversion streams (each source byte read once, each destination byte
written once, host memory bounded by ``memory_bytes``, see
:mod:`tensorckpt.interchange.core`) and produces its result atomically: a
tensorckpt destination is an ordinary committed checkpoint written through
the library's save path (crc32c-checked), other destinations are written in
a staging directory and renamed. A destination that exists is an error.
Key mapping per format: :mod:`.dcp`, :mod:`.safetensors`, :mod:`.native`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import CheckpointExistsError, TensorckptError
from ..storage import kv, location
from ..storage.backend import backend_for
from . import core
from .hf_load import load_safetensors

FORMATS = ("tensorckpt", "dcp", "safetensors", "torch")
OPTIONS = ("to_format", "only", "strip_prefix", "add_prefix", "max_shard_size", "memory_bytes",
           "shard_bytes", "inner_chunk_bytes", "metadata")


def detect(src: location.PathArg) -> str:
    """The format of what is at ``src``."""
    loc = location.parse(src)
    if not backend_for(loc).supports_rename:  # an object store holds only tensorckpt checkpoints
        return "tensorckpt"
    path = loc.path
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if "zarr.json" in names:
            return "tensorckpt"
        if ".metadata" in names:
            return "dcp"
        if any(n.endswith(".safetensors") for n in names) or "model.safetensors.index.json" in names:
            return "safetensors"
        if any(n.endswith(".distcp") for n in names):
            raise TensorckptError(f"{src}: a DCP directory without its .metadata file; it cannot be read")
        raise TensorckptError(
            f"{src}: cannot tell the format (no zarr.json, .metadata or *.safetensors); pass src_format= / --from"
        )
    if os.path.isfile(path):
        with open(path, "rb") as f:
            head = f.read(8)
        if path.endswith(".safetensors"):
            return "safetensors"
        if head[:2] == b"PK" or head[:1] == b"\x80":  # a zip archive or a legacy pickle
            return "torch"
        return "safetensors" if len(head) == 8 and head[7] == 0 and head[6] == 0 else "torch"
    raise TensorckptError(f"{src}: nothing there")


def _with_options(path: Any, storage_options: Mapping[str, Any] | None) -> Any:
    """``path`` as a location with ``storage_options`` where it takes options; else as given."""
    if not storage_options:
        return path
    loc = location.parse(path)
    return location.parse(loc, storage_options) if location.takes_options(loc) else path


def _dst_format(dst: str | os.PathLike[str]) -> str:
    d = os.fspath(dst) if not isinstance(dst, str) else dst
    if d.endswith(".safetensors"):
        return "safetensors"
    if d.endswith((".pt", ".pth", ".bin")):
        return "torch"
    return "tensorckpt"


def open_source(src: location.PathArg, fmt: str) -> core.Source:
    if fmt == "tensorckpt":
        from .native import CheckpointSource

        return CheckpointSource(src)
    path = location.parse(src).path
    if fmt == "dcp":
        from .dcp import DCPSource

        return DCPSource(path)
    if fmt == "safetensors":
        from .safetensors import SafetensorsSource

        return SafetensorsSource(path)
    if fmt == "torch":
        from .native import TorchSaveSource

        return TorchSaveSource(path)
    raise TensorckptError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    src_format: str | None = None,
    rename: Callable[[str], str | None] | None = None,
    dtype: torch.dtype | str | None = None,
    progress: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> core.ImportReport | list[str] | None:
    """Convert the checkpoint at ``src`` into ``dst`` (module docstring).

    ``src_format`` / ``to_format``: one of :data:`FORMATS` (detected / from
    ``dst``'s name when None). Keys are flat keys (``model/layers.0.weight``):
    ``only`` (a prefix or tuple of prefixes to keep), ``strip_prefix``,
    ``add_prefix``, then ``rename(key)`` returning the new key or None to drop
    it. ``dtype`` casts floating-point tensors (e.g. ``torch.bfloat16``).
    ``progress``: a bar on stderr (None: only when stderr is a terminal).
    Options: ``max_shard_size`` (safetensors, default ``"5GB"``),
    ``memory_bytes`` (the bound on tensor data held, default 256 MiB),
    ``shard_bytes``, ``inner_chunk_bytes``, ``metadata`` (tensorckpt: kept in
    the checkpoint's metadata beside ``converted_from``: source format and path).
    Returns an :class:`~tensorckpt.interchange.core.ImportReport` for a
    tensorckpt destination, the file names for safetensors.
    ``storage_options`` (as in :func:`tensorckpt.save`) apply to ``src`` and
    ``dst`` where they are ``s3://`` or fsspec URLs (a local side takes none).
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"convert() got unknown options {unknown}; known: {list(OPTIONS)}")
    to = options.pop("to_format", None) or _dst_format(dst)
    src, dst = _with_options(src, storage_options), _with_options(dst, storage_options)
    fmt = src_format or detect(src)
    for f in (fmt, to):
        if f not in FORMATS:
            raise TensorckptError(f"unknown format {f!r}; known: {', '.join(FORMATS)}")
    only = options.pop("only", None)
    sel = core.Selection(
        only=(only,) if isinstance(only, str) else tuple(only or ()),
        strip_prefix=options.pop("strip_prefix", None) or "",
        add_prefix=options.pop("add_prefix", None) or "",
        rename=rename,
    )
    if isinstance(dtype, str):
        cast = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(cast, torch.dtype):
            raise TensorckptError(f"dtype={dtype!r} is not a torch dtype (e.g. bfloat16, float16)")
        dtype = cast
    memory = options.pop("memory_bytes", None) or core.DEFAULT_MEMORY_BYTES
    dloc = location.parse(dst)
    if kv.exists(dloc):  # checked before the source is read; the commit checks again
        raise CheckpointExistsError(f"{dst}: already exists; convert writes a new destination: remove it or choose another")
    with open_source(src, fmt) as source:
        if to == "tensorckpt":
            return core.write_tensorckpt(source, dst, sel=sel, dtype=dtype, progress=progress, memory_bytes=memory,
                                         shard_bytes=options.get("shard_bytes"),
                                         inner_chunk_bytes=options.get("inner_chunk_bytes"),
                                         metadata={"converted_from": {"format": fmt, "path": str(src)},
                                                   **(options.get("metadata") or {})})
        tensors, values = core.select(source, sel)
        out = location.parse(dst).path
        if to == "safetensors":
            from . import safetensors

            if values:  # safetensors holds tensors only
                shown = ", ".join(repr(core.flat_key(p)) for p in list(values)[:5])
                warnings.warn(f"{src}: {len(values)} non-tensor value(s) are not written to safetensors: {shown}"
                              f"{' ...' if len(values) > 5 else ''} (select tensors with only=)", stacklevel=2)

            return safetensors.write(source, tensors, out, max_shard_size=options.get("max_shard_size") or "5GB",
                                     dtype=dtype, memory_bytes=memory, progress=progress)
        if to == "dcp":
            from . import dcp

            dcp.write(source, tensors, values, out, dtype=dtype, memory_bytes=memory, progress=progress)
            return None
        from .native import write_torch_save

        write_torch_save(source, tensors, values, out, dtype, progress)
        return None


__all__ = ["FORMATS", "convert", "detect", "load_safetensors"]
