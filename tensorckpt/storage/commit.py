"""The commit protocol (spec section "Commit"): a checkpoint becomes valid in
one atomic step, after all its data is durable, and saving over an existing
checkpoint never leaves a moment where neither the old nor the new one is
valid somewhere.

- Local files: everything, root ``zarr.json`` included, is written into a
  staging directory beside the target (``.NAME.tensorckpt-staging-TOKEN``),
  synced, then renamed onto the target. Replacing a checkpoint swaps the two
  directories atomically (``renameat2(RENAME_EXCHANGE)``) and then deletes
  the old one.
- Object stores (no rename; ``memory://`` here): a new checkpoint is written
  in place and the root ``zarr.json`` is written last. Replacing one writes
  and commits the new checkpoint at the staging prefix first, then deletes
  the old, copies the new in and writes its root ``zarr.json`` last; until
  then the complete new checkpoint stays at the staging prefix, and
  :func:`status` names it.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

from ..errors import CheckpointExistsError, TensorckptError
from . import kv
from .location import Location

ROOT_KEY = "zarr.json"
STAGING_INFIX = ".tensorckpt-staging-"


def new_token() -> str:
    return secrets.token_hex(6)


def staging_location(target: Location, token: str) -> Location:
    return target.sibling(f".{target.name}{STAGING_INFIX}{token}")


@dataclass(frozen=True)
class Commit:
    target: Location
    write_to: Location  # where the arrays go (staging, or the target itself)

    @property
    def staged(self) -> bool:
        return self.write_to != self.target


def begin(target: Location, overwrite: bool, token: str) -> Commit:
    """Check the target and decide where to write. Raises
    :class:`CheckpointExistsError` if anything is there and not ``overwrite``."""
    if kv.exists(target) and not overwrite:
        raise CheckpointExistsError(
            f"{target}: a checkpoint (or the leftovers of one) already exists; "
            "pass overwrite=True to replace it, or choose another path"
        )
    if target.is_local or kv.exists(target):
        return Commit(target, staging_location(target, token))
    return Commit(target, target)


def finish(c: Commit, root_json: bytes) -> None:
    """Make the written data durable, then commit it with ``root_json``. A
    storage error is raised as a :class:`TensorckptError` naming the target
    (and, if the old checkpoint is already gone, where the new one is whole)."""
    try:
        if c.target.is_local:
            _finish_local(c, root_json)
            return
        kv.write(c.write_to, ROOT_KEY, root_json)
        if c.staged:  # replace: the new checkpoint is complete at the staging prefix
            kv.delete(c.target, ROOT_KEY)  # the old one stops being valid before any of its data goes
            kv.delete_all(c.target)
            kv.copy_all(c.write_to, c.target, skip=(ROOT_KEY,))
            kv.write(c.target, ROOT_KEY, root_json)
            _discard(c.write_to)
    except (OSError, ValueError) as e:  # TensorStore reports storage errors as ValueError
        where = ""
        if _only_copy(c):
            where = f"; the new checkpoint is complete at {c.write_to}: move it into place to recover it (spec 10.5)"
        raise TensorckptError(f"{c.target}: committing the checkpoint failed: {e}{where}") from e


def _finish_local(c: Commit, root_json: bytes) -> None:
    """Every rank has already synced its own writes (engine.save); here only
    the root zarr.json and the renames need to become durable."""
    staging, target = c.write_to.path, c.target.path
    os.makedirs(staging, exist_ok=True)
    # written under a temporary name, then renamed: a staging directory holds a
    # root zarr.json only once it is whole (spec 10.5 takes such a leftover for
    # a complete checkpoint; a save killed mid-write must not leave half a root)
    partial = os.path.join(staging, f".{ROOT_KEY}.partial")
    with open(partial, "wb") as f:
        f.write(root_json)
        f.flush()
        os.fsync(f.fileno())
    os.rename(partial, os.path.join(staging, ROOT_KEY))
    kv.fsync_dir(staging)
    parent = os.path.dirname(target)
    old = None
    if not os.path.lexists(target):
        os.rename(staging, target)
    elif kv.exchange(staging, target):
        old = c.write_to  # now holds the old checkpoint
    else:  # no atomic swap: move the old aside first; it stays whole until deleted
        old = Location("file", f"{staging}-old")
        os.rename(target, old.path)
        os.rename(staging, target)
    kv.fsync_dir(parent)
    if old is not None:
        _discard(old)


def _discard(loc: Location) -> None:
    """Delete a copy that the commit made stale. The checkpoint is committed by
    now, so a failure here does not fail the save: what stays is a stale
    leftover that ``tensorckpt clean`` removes (spec 10.5 rule 5)."""
    try:
        kv.delete_all(loc)
    except (OSError, ValueError):
        pass


def abort(c: Commit) -> None:
    """Remove what an unsuccessful save wrote (never the target, unless the
    target itself was being written fresh). A complete staging copy is kept
    while the target is not committed: a replace that failed after the old
    checkpoint was deleted (10.3) has no other copy left (spec 10.5 rule 5)."""
    if _only_copy(c):
        return
    kv.delete_all(c.write_to)


def _only_copy(c: Commit) -> bool:
    """Whether an object-store replace got past deleting the old checkpoint:
    the target is not committed and the staging prefix holds the whole new
    one (locally the old checkpoint is never deleted before the new one is in
    place, 10.2). When unsure, True: keeping a copy is the safe side."""
    if c.target.is_local or not c.staged:
        return False
    try:
        return kv.read(c.target, ROOT_KEY) is None and kv.read(c.write_to, ROOT_KEY) is not None
    except (OSError, ValueError):
        return True


def leftovers(target: Location) -> list[Location]:
    """Staging locations of interrupted saves to ``target``."""
    prefix = f".{target.name}{STAGING_INFIX}"
    parent = target.sibling("")
    if target.is_local:
        try:
            names = os.listdir(parent.path or "/")
        except FileNotFoundError:
            return []
        return [target.sibling(n) for n in sorted(names) if n.startswith(prefix)]
    names = {k.split("/", 1)[0] for k in kv.list_keys(parent) if k.startswith(prefix)}
    return [target.sibling(n) for n in sorted(names)]
