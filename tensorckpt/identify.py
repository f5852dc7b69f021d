"""What is at a path that holds no committed tensorckpt checkpoint, and what
the user should do about it (spec 10.4).

A reader that finds no root ``zarr.json`` tells apart: nothing at all
(:class:`CheckpointNotFoundError`); something tensorckpt does not write (a
torch DCP directory, a safetensors or ``torch.save`` file, a Hugging Face
model directory, a :class:`~tensorckpt.CheckpointManager` root), named with
how to use it (:class:`NotACheckpointError`); and the leftovers of an
interrupted save (:class:`IncompleteCheckpointError`). No message ever
advises deleting data that tensorckpt did not write: only the staging
leftovers of its own saves.
"""

from __future__ import annotations

import os
import re

from .errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    NotACheckpointError,
    TensorckptError,
)
from .storage import commit, kv
from .storage.backend import backend_for
from .storage.location import Location

_STEP = re.compile(r"step-[0-9]{8,}")
_CONVERT = "convert it with `tensorckpt convert {src} DST` (or tensorckpt.convert) and use DST"


def no_root(loc: Location) -> None:
    """Raise the right error for a location without a root ``zarr.json``."""
    try:
        stale = commit.leftovers(loc)
        here = kv.exists(loc)
        whole = [str(s) for s in stale if not commit.is_replaced(s) and kv.read(s, commit.ROOT_KEY) is not None]
        what = describe(loc) if here else None
    except NotADirectoryError:
        raise CheckpointNotFoundError(f"{loc}: no checkpoint found (a parent is not a directory)") from None
    except (OSError, ValueError) as e:
        raise TensorckptError(f"{loc}/{commit.ROOT_KEY}: cannot be read ({e})") from None
    if what is not None:
        raise NotACheckpointError(what)
    if not here and not stale:
        raise CheckpointNotFoundError(f"{loc}: no checkpoint found")
    if whole:
        hint = f" A complete checkpoint from an interrupted replace sits at {', '.join(whole)}: open or load it there."
    elif stale:
        hint = (f" Load an earlier checkpoint; `tensorckpt clean {loc}` removes what interrupted saves left "
                "(never a committed checkpoint, never a save in progress).")
    else:
        hint = ""
    if stale:
        raise IncompleteCheckpointError(
            f"{loc}: the checkpoint was never committed (no root zarr.json); an interrupted save left "
            f"{', '.join(str(s) for s in stale)}.{hint}"
        )
    if backend_for(loc).supports_rename:  # a local save writes only under staging names (10.2): tensorckpt did not leave this
        raise IncompleteCheckpointError(
            f"{loc}: not a committed checkpoint: it was never committed or its root was removed (no root "
            "zarr.json), and no interrupted tensorckpt save left it so (a local save renames a complete "
            "directory into place). Pass the path of a committed checkpoint; tensorckpt does not treat this "
            "directory's contents as its own."
        )
    raise IncompleteCheckpointError(
        f"{loc}: the checkpoint was never committed (no root zarr.json); objects are stored under it, as an "
        "interrupted save to an object store leaves them (spec 10.3). Load an earlier checkpoint; if no save "
        f"is running, `tensorckpt clean {loc}` removes what the save left."
    )


def describe(loc: Location) -> str | None:
    """A message naming what is at ``loc`` and how to use it, when it is a
    kind of checkpoint or model tensorckpt recognises; else None."""
    src = str(loc)
    if backend_for(loc).supports_rename and os.path.isfile(loc.path):
        return _describe_file(loc.path)
    names = _names(loc)
    if ".metadata" in names or any(n.endswith(".distcp") for n in names):
        return f"{src}: a torch.distributed.checkpoint (DCP) directory, not a tensorckpt checkpoint; " + _CONVERT.format(src=src)
    has_st = any(n.endswith(".safetensors") for n in names) or "model.safetensors.index.json" in names
    if "config.json" in names and (has_st or "pytorch_model.bin" in names):
        return (f"{src}: a Hugging Face model directory, not a tensorckpt checkpoint; {_CONVERT.format(src=src)}, "
                "or read its weights with tensorckpt.load_safetensors")
    if has_st:
        return (f"{src}: a directory of safetensors files, not a tensorckpt checkpoint; {_CONVERT.format(src=src)}, "
                "or read it with tensorckpt.load_safetensors")
    steps = sorted(n for n in names if _STEP.fullmatch(n))
    if steps:
        return (f"{src}: a CheckpointManager root (steps {_few(steps)}), not a checkpoint: pass a step's path "
                f"({src}/{steps[-1]}) or use tensorckpt.CheckpointManager({src!r}).restore(state) (the newest "
                f"committed step); `tensorckpt list {src}` shows the steps")
    return None


def _describe_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError as e:
        return f"{path}: a file that cannot be read ({e.strerror}), not a tensorckpt checkpoint (a directory)"
    conv = _CONVERT.format(src=path)
    if head[:4] == b"PK\x03\x04":
        return f"{path}: a torch.save archive (zip), not a tensorckpt checkpoint; {conv}, or load it with torch.load"
    if head[:1] == b"\x80":
        return f"{path}: a torch.save file (legacy pickle format), not a tensorckpt checkpoint; {conv}"
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 1 << 32:
        return (f"{path}: a safetensors file, not a tensorckpt checkpoint; {conv}, or read it with "
                "tensorckpt.load_safetensors")
    return f"{path}: a file, not a tensorckpt checkpoint (a checkpoint is a directory with a root zarr.json)"


def _names(loc: Location) -> set[str]:
    return backend_for(loc).names(loc)


def _few(names: list[str], limit: int = 3) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
