"""``tensorckpt.load_safetensors``: Hugging Face safetensors weights straight
into a sharded layout, with no conversion step.

Every tensor leaf of the state receives its part of the tensor of the same
name: a plain tensor the whole tensor, a DTensor (FSDP2 ``fully_shard``,
tensor parallelism, FSDP2 over TP with ``_StridedShard`` placements: one box
per rank, :func:`tensorckpt.adapters.sharded.mesh_box`) its local shard
under its own placements, a
:class:`tensorckpt.ShardedTensor` its box. A safetensors tensor is
contiguous and row-major, so a box is a set of byte ranges: one range per
combination of indices of the dimensions before the last one the box cuts
(an FSDP2 ``Shard(0)`` shard is one range, a ``Shard(1)`` column block one
range per row). Each rank reads exactly those ranges (no byte of another
rank's shard), straight into its tensor's memory when it is a contiguous
CPU tensor of the stored dtype. ``stats`` (a :class:`tensorckpt.LoadStats`)
reports bytes read and needed per rank; they are equal.

Only the headers are read in full; errors (a missing tensor, a shape or
dtype that differs) are shared through ``Group.collective``, as in save and
load, so that every rank raises the same one, naming every failing rank.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from ..adapters.sharded import local_part
from ..adapters.state import flatten
from ..engine.group import Group
from ..engine.load import LoadStats
from ..errors import CorruptCheckpointError, IncompatibleStateError
from ..layout.boxes import Box
from .core import SourceTensor
from .safetensors import SafetensorsSource

T = TypeVar("T")
State = TypeVar("State")
# one planned read: (safetensors name, stored tensor, target tensor, the target's box of the stored tensor)
Read = tuple[str, SourceTensor, torch.Tensor, Box]


def byte_ranges(shape: tuple[int, ...], box: Box, itemsize: int) -> tuple[np.ndarray, int]:
    """The file offsets (relative to the tensor's first byte, ascending) of
    the contiguous runs making up ``box`` of a row-major tensor of ``shape``,
    and the length of each run in bytes."""
    n = len(shape)
    if n == 0:
        return np.zeros(1, np.int64), itemsize
    d = n - 1  # the last dimension the box cuts: all after it are whole
    while d > 0 and box.shape[d] == shape[d] and box.offset[d] == 0:
        d -= 1
    inner = math.prod(shape[d + 1:])
    run = box.shape[d] * inner * itemsize
    strides = [math.prod(shape[i + 1:]) for i in range(n)]
    starts = np.zeros(1, np.int64) + box.offset[d] * strides[d]
    for i in range(d - 1, -1, -1):  # outer dimensions: C order, so the last varies fastest
        idx = (box.offset[i] + np.arange(box.shape[i], dtype=np.int64)) * strides[i]
        starts = (idx[:, None] + starts[None, :]).reshape(-1)
    return starts * itemsize, run


def load_safetensors(
    state: State,
    hf_dir: str | os.PathLike[str],
    *,
    rename: Callable[[str], str | None] | None = None,
    cast: bool = False,
    process_group: torch.distributed.ProcessGroup | None = None,
    strict: bool = True,
    stats: LoadStats | None = None,
) -> State:
    """Fill the tensors of ``state`` (a dict of tensors, DTensors,
    ShardedTensors and modules, or a ``torch.nn.Module``: the tensors of its
    ``state_dict()``, keyed ``name`` or ``key/name`` in a dict) from the
    safetensors file or HF directory ``hf_dir``, each rank reading only the
    byte ranges of its own part (module docstring). A state key ``k`` reads
    the tensor named ``rename(k)`` (default: ``k``; None skips the key).
    ``cast``: convert a stored dtype to the target's (else a mismatch is an
    :class:`IncompatibleStateError`). ``strict``: a state key the files lack
    is an error (else it is left as it is; e.g. a tied ``lm_head.weight``
    the files omit). Returns ``state``."""
    g = Group(process_group)
    stats = stats if stats is not None else LoadStats()
    target = _tensors_of(state)
    what = f"load_safetensors from {os.fspath(hf_dir)}"
    source, reads = _together(g, what, _plan, target, os.fspath(hf_dir), rename, cast, strict)
    try:
        _together(g, what, _read_all, source, reads, stats)
    finally:
        source.close()
    return state


def _together(g: Group, what: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on every rank, as one step of :meth:`Group.collective`:
    if it fails on any rank, every rank raises the same error, naming every
    failing rank, so that no rank goes on alone. The results stay on their
    ranks (only success or failure travels). One all-gather."""
    out: list[T] = []
    g.collective(lambda: out.append(fn(*args)), what=what)
    return out[0]


def _tensors_of(node: object) -> object:
    """The state with every ``torch.nn.Module`` replaced by its
    ``state_dict()`` (whose tensors share the module's memory)."""
    if isinstance(node, torch.nn.Module):
        return node.state_dict()
    if isinstance(node, Mapping):
        return {k: _tensors_of(v) for k, v in node.items()}
    return node


def _plan(
    state: Mapping, hf_dir: str, rename: Callable[[str], str | None] | None, cast: bool, strict: bool
) -> tuple[SafetensorsSource, list[Read]]:
    source = SafetensorsSource(hf_dir)
    by_name = {t.path[0]: t for t in source.tensors}
    reads: list[Read] = []
    missing: list[str] = []
    for key, leaf in flatten(state, check_values=False).items():
        if not leaf.is_tensor:
            continue
        name = rename(key) if rename is not None else key
        if name is None:
            continue
        st = by_name.get(name)
        if st is None:
            missing.append(name)
            continue
        t, shape, box = local_part(key, leaf.value)
        if tuple(shape) != st.shape:
            raise IncompatibleStateError(
                f"{hf_dir}: tensor {name!r} is stored as {list(st.shape)} but the state's {key!r} is {list(shape)}"
            )
        if t.dtype != st.dtype and not cast:
            raise IncompatibleStateError(
                f"{hf_dir}: tensor {name!r} is stored as {st.dtype} but the state's {key!r} is {t.dtype}; "
                "pass cast=True to convert"
            )
        reads.append((name, st, t, box))
    if missing and strict:
        shown = ", ".join(repr(m) for m in missing[:10])
        raise IncompatibleStateError(
            f"{hf_dir}: {len(missing)} tensor(s) of the state are not in the files: {shown}"
            f"{' ...' if len(missing) > 10 else ''}. Pass rename= to map names, or strict=False"
        )
    return source, reads


def _read_all(source: SafetensorsSource, reads: list[Read], stats: LoadStats) -> None:
    import time

    t0 = time.perf_counter()
    for name, st, t, box in reads:
        file, at = st.ref
        itemsize = torch.empty((), dtype=st.dtype).element_size()
        need = box.numel * itemsize
        stats.tensors += 1
        stats.bytes_needed += need
        stats.per_tensor[name] = (need, need)
        if box.numel == 0:
            continue
        # a parameter (requires_grad) too: its detached alias shares its memory, as copy_ under no_grad writes it
        direct = t.device.type == "cpu" and t.dtype == st.dtype and t.is_contiguous()
        buf = t.detach() if direct else torch.empty(box.shape, dtype=st.dtype)
        view = memoryview(buf.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        starts, run = byte_ranges(st.shape, box, itemsize)
        fd = source._fds.get(file)
        if fd is None:
            fd = source._fds[file] = os.open(file, os.O_RDONLY)
        pos = 0
        for s in starts.tolist():
            done = 0
            while done < run:
                n = os.preadv(fd, [view[pos + done : pos + run]], at + s + done)
                if n <= 0:
                    raise CorruptCheckpointError(f"{file}: tensor {name!r} is cut short (file truncated?)")
                done += n
            pos += run
        stats.bytes_read += len(starts) * run
        if not direct:
            with torch.no_grad():
                t.copy_(buf)
    stats.seconds["read"] = time.perf_counter() - t0
