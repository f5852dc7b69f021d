"""Load: match the target state against the checkpoint index, then read every
tensor concurrently straight into the target's memory."""

from __future__ import annotations

import warnings
from collections.abc import MutableMapping

import numpy as np
import tensorstore as ts
import torch

from ..adapters.state import flatten, set_leaf
from ..checkpoint import Checkpoint, wait
from ..errors import IncompatibleStateError
from ..format import dtypes
from .save import _single_process


def load(state: MutableMapping, path, *, process_group=None, strict: bool = True) -> MutableMapping:
    """Fill ``state`` in place from the checkpoint at ``path`` and return it.

    Each tensor leaf is overwritten with the stored tensor of the same key
    (same shape and dtype required); every other leaf is replaced by the
    stored value. With ``strict`` a key present on one side only is an
    :class:`IncompatibleStateError`; otherwise it is reported (a warning) and
    skipped.
    """
    _single_process(process_group)
    ckpt = Checkpoint(path)
    index = ckpt.index
    targets = flatten(state, check_values=False)
    stored = set(index.tensors) | set(index.values)
    missing = sorted(set(targets) - stored)
    unexpected = sorted(stored - set(targets))
    if missing or unexpected:
        msg = f"{ckpt.path}: state and checkpoint differ: " + "; ".join(
            f"{name}: {_list(keys)}" for name, keys in (("missing in checkpoint", missing), ("not in state", unexpected)) if keys
        )
        if strict:
            raise IncompatibleStateError(msg + ". Pass strict=False to load the keys both have")
        warnings.warn(msg + " (skipped, strict=False)", stacklevel=2)

    reads = {}
    for key, leaf in targets.items():
        if key in index.values:
            if leaf.is_tensor:
                raise IncompatibleStateError(f"{ckpt.path}: {key!r} is a tensor in the state but a value in the checkpoint")
            continue
        if key not in index.tensors:
            continue
        if not leaf.is_tensor:
            raise IncompatibleStateError(
                f"{ckpt.path}: {key!r} is a tensor in the checkpoint but a {type(leaf.value).__name__} in the "
                "state; put a tensor of the stored shape and dtype there (see Checkpoint.info)"
            )
        e = index.tensors[key]
        t = leaf.value
        if tuple(t.shape) != e.shape or dtypes.torch_name(t.dtype) != e.dtype:
            raise IncompatibleStateError(
                f"{ckpt.path}: tensor {key!r} is stored as {list(e.shape)} {e.dtype} but the state "
                f"wants {list(t.shape)} {dtypes.torch_name(t.dtype)}"
            )
        reads[key] = t
    _read_into(ckpt, reads)
    for key, leaf in targets.items():
        if key in index.values:
            set_leaf(state, leaf.path, index.values[key])
    return state


def _read_into(ckpt: Checkpoint, targets: dict[str, torch.Tensor]) -> None:
    """Issue every read at once, each into the target's own memory when it is a
    CPU tensor numpy can view; otherwise into a buffer, then copied."""
    srcs = ckpt.open_arrays(list(targets))
    pending, copies = [], []
    for key, t in targets.items():
        if t.numel() == 0:
            continue
        if t.device.type == "cpu" and not t.requires_grad:
            dst = dtypes.to_numpy(t)
        else:
            dst = np.empty(tuple(t.shape), dtype=dtypes.for_torch(t.dtype).numpy)
            copies.append((t, dst))
        pending.append((key, ts.array(dst, copy=False, write=True).write(srcs[key])))
    for key, fut in pending:
        wait(ckpt.path, key, fut)
    with torch.no_grad():
        for t, buf in copies:
            t.copy_(dtypes.from_numpy(buf, dtypes.for_torch(t.dtype)))


def _list(keys: list[str], limit: int = 20) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")

