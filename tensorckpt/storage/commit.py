"""The commit protocol (spec section "Commit"): a checkpoint becomes valid in
one atomic step, after all its data is durable, and saving over an existing
checkpoint never leaves a moment where neither the old nor the new one is
valid somewhere.

How that step is made depends on the storage, so it is a strategy that each
backend (:mod:`.backend`) names: :class:`~.commit_local.AtomicRenameCommit`
on file systems (spec 10.2: a staging directory renamed onto the target) and
:class:`~.commit_kv.RootLastCommit` on object stores (10.3: the root
``zarr.json`` written last). This module holds what both share: the
:class:`Commit` record, the staging names, the rule that tells a checkpoint
(or the leftovers of a save) from anything else, and the entry points the
engine calls (:func:`begin`, :func:`finish`, :func:`abort`), which check
and report errors the same way for both.

Only a tensorckpt checkpoint (committed, or the leftovers of a save) is ever
replaced, even with ``overwrite=True``; anything else at the target (a
directory of other files, a manager root, a plain file, a symbolic link) is
refused (spec 10.6).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..errors import CheckpointExistsError, TensorckptError
from . import kv
from .backend import backend_for
from .location import Location

ROOT_KEY = "zarr.json"
STAGING_INFIX = ".tensorckpt-staging-"
# Locally, the version a replace swapped out stays whole under this infix for the
# readers that opened it, until the next replace of the same target begins
# (or clean removes it after its grace): spec 10.2.
REPLACED_INFIX = ".tensorckpt-replaced-"
# The root is written under this name first. No key escapes to a name starting
# with "__" (spec 5.1), so it never collides with a tensor's directory.
PARTIAL_NAME = "__tensorckpt-root.partial"
# Made by begin() in the staging directory, checked and removed at the commit: a
# staging directory removed meanwhile and made again (by a late write) lacks it.
MARKER_NAME = "__tensorckpt-staging"
DELETING_SUFFIX = "-del"  # a local leftover is renamed to NAME-del before it is deleted
MAX_NAME_BYTES = 255
TOKEN_HEX = 12

_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD = -100
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


def new_token() -> str:
    return secrets.token_hex(TOKEN_HEX // 2)


def staging_location(target: Location, token: str) -> Location:
    return target.sibling(f".{target.name}{STAGING_INFIX}{token}")


def replaced_location(target: Location, token: str) -> Location:
    return target.sibling(f".{target.name}{REPLACED_INFIX}{token}")


def is_replaced(loc: Location) -> bool:
    """Whether ``loc`` is named as a replaced version (spec 10.2), not an interrupted save's staging."""
    return REPLACED_INFIX in loc.name


@dataclass(frozen=True)
class Commit:
    target: Location
    write_to: Location  # where the arrays go (staging, or the target itself)
    replacing: bool = False  # the target held a checkpoint when the save began
    identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the local staging directory begin() made

    @property
    def staged(self) -> bool:
        return self.write_to != self.target


class CommitStrategy(Protocol):
    """How a backend commits a save; called only through this module's
    functions: ``check_name`` and ``describe_foreign`` / ``occupied`` by
    :func:`begin`, then ``begin``; ``finish`` once every rank's data is
    durable, or ``abort``; ``only_copy`` when a commit failed."""

    def check_name(self, target: Location) -> None:
        """Raise ``InvalidPathError`` if the target's staging names cannot exist."""
    def describe_foreign(self, target: Location) -> str | None:
        """What is at ``target`` if not a checkpoint or a save's leftovers (see :func:`describe_foreign`)."""
    def occupied(self, target: Location) -> str | None:
        """What the overwrite refusal says is at ``target``, where not the default."""
    def begin(self, target: Location, staging: Location, exists: bool) -> Commit:
        """Decide where the save writes (and make it)."""
    def finish(self, c: Commit, root_json: bytes) -> None:
        """Write the root and make the checkpoint valid in one step."""
    def only_copy(self, c: Commit) -> bool:
        """Whether the staging copy is now the only copy of the new checkpoint (keep it)."""
    def abort(self, c: Commit) -> None:
        """Remove what an unsuccessful save wrote (never a committed target)."""
    def remove(self, loc: Location, complete: bool = True, rename_first: bool = False) -> str | None:
        """Delete a checkpoint location, root first (see :func:`remove`)."""
    def leftovers(self, target: Location) -> list[Location]:
        """Staging locations of interrupted saves to ``target``, and (locally)
        the versions finished replaces swapped out (:func:`is_replaced`)."""
    def promote(self, copy: Location, target: Location) -> bool:
        """Commit the complete staged ``copy`` at the uncommitted ``target`` (see :func:`promote`)."""
    def retire(self, loc: Location, trash: Location) -> None:
        """Delete committed ``loc`` so that no reader sees part of it (see :func:`retire`)."""


def os_error(path: object, e: OSError, doing: str) -> TensorckptError:
    """A :class:`TensorckptError` for a storage error at ``path``: what failed
    and what to do about it."""
    hint = {
        errno.EROFS: "the file system is read-only: save to a writable path, or remount it read-write",
        errno.EACCES: "permission denied: check the permissions of the directory (and its parents), or choose another path",
        errno.EPERM: "operation not permitted: check the permissions and attributes of the directory, or choose another path",
        errno.ENOSPC: "no space left on the device: free space or choose another path",
        errno.EDQUOT: "disk quota exceeded: free space or choose another path",
        errno.ENAMETOOLONG: "a name in the path is too long: choose a shorter path",
        errno.ENOTDIR: "a component of the path is not a directory (a file is in the way): choose another path",
        errno.ELOOP: "the path has a loop of symbolic links: fix the links or choose another path",
    }.get(e.errno or 0, "check the path and the storage it is on")
    detail = e.strerror or str(e)
    where = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
    return TensorckptError(f"{path}: {doing} failed: {detail}{where}; {hint}")


def renameat2(src: str, dst: str, flags: int, src_dir_fd: int = _AT_FDCWD, dst_dir_fd: int = _AT_FDCWD) -> int:
    """Linux renameat2: 0 on success, else the errno (ENOSYS where there is no
    such call; EINVAL where the file system does not support ``flags``)."""
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return errno.ENOSYS
    if fn(src_dir_fd, os.fsencode(src), dst_dir_fd, os.fsencode(dst), flags) == 0:
        return 0
    return ctypes.get_errno()


def describe_foreign(target: Location) -> str | None:
    """What is at ``target`` if it is not a tensorckpt checkpoint (committed, or
    the leftovers of a save): a phrase for an error message; None if it is one
    (or nothing, or an empty directory) and a save may replace it."""
    return backend_for(target).commit.describe_foreign(target)


def nodes_and_chunks(keys: list[str]) -> bool:
    """Every key is a Zarr node (``.../zarr.json``) or a chunk (below a ``c/``)."""
    return all(k.split("/")[-1] == ROOT_KEY or "/c/" in f"/{k}" for k in keys)


def root_below(keys: list[str], read: Callable[[str], bytes | None]) -> bool:
    """Whether a ``zarr.json`` below the top is a checkpoint root (a manager
    root, another run's checkpoint): then it is not one checkpoint's leftover."""
    return any(is_root(read(k)) for k in keys if k.endswith("/" + ROOT_KEY))


def is_root(doc: bytes | None) -> bool:
    """Whether ``doc`` is a checkpoint root zarr.json (a group with attributes.tensorckpt)."""
    try:
        d = json.loads(doc or b"")
    except ValueError:
        return False
    return (isinstance(d, dict) and d.get("node_type") == "group" and isinstance(d.get("attributes"), dict)
            and "tensorckpt" in d["attributes"])  # an array's zarr.json has tensorckpt attributes too


def begin(target: Location, overwrite: bool, token: str) -> Commit:
    """Check the target and decide where to write (locally: make the staging
    directory). Raises :class:`CheckpointExistsError` if anything is there and
    not ``overwrite``, or if what is there is not a tensorckpt checkpoint."""
    try:
        return _begin(target, overwrite, token)
    except TensorckptError:
        raise
    except (OSError, ValueError) as e:
        if isinstance(e, OSError):
            raise os_error(target, e, "starting the save") from e
        raise TensorckptError(f"{target}: starting the save failed: {e}") from e


def _begin(target: Location, overwrite: bool, token: str) -> Commit:
    strategy = backend_for(target).commit
    strategy.check_name(target)
    exists = kv.exists(target)
    if exists:
        foreign = strategy.describe_foreign(target)
        if foreign is not None:
            raise CheckpointExistsError(
                f"{target}: this is {foreign}, not a tensorckpt checkpoint; a save replaces only a checkpoint, "
                "even with overwrite=True: choose another path, or move what is there away yourself")
        if not overwrite:
            what = strategy.occupied(target) or "a checkpoint (or the leftovers of one) already exists"
            raise CheckpointExistsError(
                f"{target}: {what}; pass overwrite=True to replace it, or choose another path")
    return strategy.begin(target, staging_location(target, token), exists)


def finish(c: Commit, root_json: bytes) -> None:
    """Make the written data durable, then commit it with ``root_json``. A
    storage error is raised as a :class:`TensorckptError` naming the target
    (and, if the old checkpoint is already gone, where the new one is whole)."""
    strategy = backend_for(c.target).commit
    try:
        strategy.finish(c, root_json)
    except TensorckptError:
        raise
    except (OSError, ValueError) as e:  # TensorStore reports storage errors as ValueError
        where = ""
        if strategy.only_copy(c):
            where = f"; the new checkpoint is complete at {c.write_to}: move it into place to recover it (spec 10.5)"
        if isinstance(e, OSError) and not where:
            raise os_error(c.target, e, "committing the checkpoint") from e
        raise TensorckptError(f"{c.target}: committing the checkpoint failed: {e}{where}") from e


def raced(c: Commit) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"{c.target}: another save committed a checkpoint here while this one ran (concurrent saves to one "
        "path are not supported, spec 10.1); this save was not committed and its data is discarded: "
        "the other save's checkpoint is intact. Save to another path, or again with overwrite=True")


def discard(loc: Location) -> None:
    """Delete a copy that the commit made stale. The checkpoint is committed by
    now, so a failure here does not fail the save: what stays is a stale
    leftover that ``tensorckpt clean`` removes (spec 10.5 rule 5)."""
    try:
        remove(loc)
    except (OSError, ValueError):
        pass


def remove(loc: Location, complete: bool = True, rename_first: bool = False) -> str | None:
    """Delete a checkpoint location, root ``zarr.json`` first, never following
    a symbolic link (a link is left alone: it is not ours). ``rename_first``:
    locally, rename it to ``NAME-del`` first. Returns None once nothing is
    left at ``loc``, else why something stayed."""
    return backend_for(loc).commit.remove(loc, complete, rename_first)


def abort(c: Commit) -> None:
    """Remove what an unsuccessful save wrote (never the target, unless the
    target itself was being written fresh). A complete staging copy is kept
    while the target is not committed: a replace that failed after the old
    checkpoint was deleted (10.3) has no other copy left (spec 10.5 rule 5)."""
    strategy = backend_for(c.target).commit
    if not strategy.only_copy(c):
        strategy.abort(c)


def leftovers(target: Location) -> list[Location]:
    """Staging locations of interrupted saves to ``target`` (local: every name
    with the staging prefix, links included; callers never follow them)."""
    return backend_for(target).commit.leftovers(target)


def promote(copy: Location, target: Location) -> bool:
    """Move a complete copy left at a staging name into place at the
    uncommitted ``target``, as a commit would (spec 10.5: the manager's
    recovery): locally a no-replace rename, on object stores a copy with the
    root ``zarr.json`` written last. False: left alone (``target`` exists
    locally, or ``copy`` is no longer a directory, or has no root any more)."""
    return backend_for(target).commit.promote(copy, target)


def retire(loc: Location, trash: Location) -> None:
    """Delete the committed checkpoint ``loc`` so that no reader ever sees
    part of it: locally renamed to ``trash`` first (readers then find
    nothing), then deleted, root ``zarr.json`` first; on object stores the
    root ``zarr.json`` is deleted first (``trash`` unused)."""
    backend_for(loc).commit.retire(loc, trash)
