"""The commit protocol (spec section "Commit"): a checkpoint becomes valid in
one atomic step, after all its data is durable, and saving over an existing
checkpoint never leaves a moment where neither the old nor the new one is
valid somewhere.

- Local files: everything, root ``zarr.json`` included, is written into a
  staging directory beside the target (``.NAME.tensorckpt-staging-TOKEN``),
  made by :func:`begin` (its identity is checked again at the commit: a
  staging directory removed or replaced meanwhile fails the save), synced,
  then renamed onto the target. A new target is committed with a no-replace
  rename (``renameat2(RENAME_NOREPLACE)``): of two saves racing to create it,
  the second fails. Replacing a checkpoint swaps the two directories
  atomically (``renameat2(RENAME_EXCHANGE)``) and then deletes the old one.
- Object stores (no rename; ``memory://`` here): a new checkpoint is written
  in place and the root ``zarr.json`` is written last, only if none exists
  (a conditional create). Replacing one writes and commits the new
  checkpoint at the staging prefix first, then deletes the old, copies the
  new in and writes its root ``zarr.json`` last; until then the complete new
  checkpoint stays at the staging prefix, and :func:`status` names it.

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
import shutil
import stat
import threading
from dataclasses import dataclass

from ..errors import CheckpointExistsError, InvalidPathError, TensorckptError
from . import kv
from .location import Location

ROOT_KEY = "zarr.json"
STAGING_INFIX = ".tensorckpt-staging-"
# The root is written under this name first. No key escapes to a name starting
# with "__" (spec 5.1), so it never collides with a tensor's directory.
PARTIAL_NAME = "__tensorckpt-root.partial"
# Made by begin() in the staging directory, checked and removed at the commit: a
# staging directory removed meanwhile and made again (by a late write) lacks it.
MARKER_NAME = "__tensorckpt-staging"
DELETING_SUFFIX = "-del"  # a local leftover is renamed to NAME-del before it is deleted
MAX_NAME_BYTES = 255
TOKEN_HEX = 12
# the longest target name whose staging names (".NAME" + infix + token + "-old") fit in one component
MAX_TARGET_NAME_BYTES = MAX_NAME_BYTES - 1 - len(STAGING_INFIX) - TOKEN_HEX - len("-old") - len(DELETING_SUFFIX)

_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD = -100
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
_memory_commit_lock = threading.Lock()  # memory:// stores are per process: their conditional create


def new_token() -> str:
    return secrets.token_hex(TOKEN_HEX // 2)


def staging_location(target: Location, token: str) -> Location:
    return target.sibling(f".{target.name}{STAGING_INFIX}{token}")


@dataclass(frozen=True)
class Commit:
    target: Location
    write_to: Location  # where the arrays go (staging, or the target itself)
    replacing: bool = False  # the target held a checkpoint when the save began
    identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the local staging directory begin() made

    @property
    def staged(self) -> bool:
        return self.write_to != self.target


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
    if target.is_local:
        try:
            st = os.lstat(target.path)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            return f"a symbolic link (to {os.readlink(target.path)!r})"
        if not stat.S_ISDIR(st.st_mode):
            return "a plain file" if stat.S_ISREG(st.st_mode) else "a special file (FIFO, socket or device)"
        names = os.listdir(target.path)
        if not names:
            return None
        if ROOT_KEY not in names:
            if _local_leftover(target.path):
                return None  # an uncommitted checkpoint's Zarr nodes (its root deleted first, 10.5 rule 6)
            steps = any(n.startswith("step-") for n in names)
            return (f"a directory of {len(names)} entr{'y' if len(names) == 1 else 'ies'} with no root zarr.json"
                    + (" (step-* directories: a CheckpointManager root)" if steps else ""))
        root = os.path.join(target.path, ROOT_KEY)
        if not stat.S_ISREG(os.lstat(root).st_mode):
            return "a directory whose zarr.json is not a regular file"
        with open(root, "rb") as f:
            doc = f.read(1 << 24)
        return None if _is_root(doc) else "a directory whose zarr.json is not a tensorckpt root (another Zarr store?)"
    keys = kv.list_keys(target)
    if not keys:
        return None
    if ROOT_KEY in keys:
        return None if _is_root(kv.read(target, ROOT_KEY)) else "objects whose zarr.json is not a tensorckpt root"
    # an interrupted in-place save (10.3 step 1): Zarr nodes, none of them a checkpoint root
    below = _root_below(keys, lambda k: kv.read(target, k))
    if not below and _nodes_and_chunks(keys):
        return None
    return (f"{len(keys)} object(s) that are not the leftovers of a save"
            + (" (checkpoints below it: a CheckpointManager root)" if below else ""))


def _local_leftover(path: str, limit: int = 1_000_000) -> bool:
    """Whether the directory ``path`` holds only what a save writes below a
    checkpoint's root (:func:`_nodes_and_chunks`, no checkpoint root below),
    and no links or special files: a checkpoint whose root was deleted
    first, then interrupted (10.5 rule 6)."""
    keys: list[str] = []
    for top, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            mode = os.lstat(os.path.join(top, name)).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                return False
        rel = os.path.relpath(top, path)
        keys += [name if rel == "." else f"{rel}/{name}".replace(os.sep, "/") for name in files]
        if len(keys) > limit:
            return False

    def read(key: str) -> bytes:
        with open(os.path.join(path, key), "rb") as f:
            return f.read(1 << 24)

    return _nodes_and_chunks(keys) and not _root_below(keys, read)


def _nodes_and_chunks(keys: list[str]) -> bool:
    """Every key is a Zarr node (``.../zarr.json``) or a chunk (below a ``c/``)."""
    return all(k.split("/")[-1] == ROOT_KEY or "/c/" in f"/{k}" for k in keys)


def _root_below(keys: list[str], read) -> bool:
    """Whether a ``zarr.json`` below the top is a checkpoint root (a manager
    root, another run's checkpoint): then it is not one checkpoint's leftover."""
    return any(_is_root(read(k)) for k in keys if k.endswith("/" + ROOT_KEY))


def _is_root(doc: bytes | None) -> bool:
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
    staging = staging_location(target, token)
    if target.is_local and len(os.fsencode(target.name)) > MAX_TARGET_NAME_BYTES:
        raise InvalidPathError(
            f"{target}: the checkpoint's name is {len(os.fsencode(target.name))} bytes; at most "
            f"{MAX_TARGET_NAME_BYTES} fit (its staging directory {STAGING_INFIX!r}... must fit in "
            f"{MAX_NAME_BYTES} bytes): choose a shorter name")
    exists = kv.exists(target)
    if exists:
        foreign = describe_foreign(target)
        if foreign is not None:
            raise CheckpointExistsError(
                f"{target}: this is {foreign}, not a tensorckpt checkpoint; a save replaces only a checkpoint, "
                "even with overwrite=True: choose another path, or move what is there away yourself")
        if not overwrite:
            what = "an empty directory is there" if target.is_local and not os.listdir(target.path) \
                else "a checkpoint (or the leftovers of one) already exists"
            raise CheckpointExistsError(
                f"{target}: {what}; pass overwrite=True to replace it, or choose another path")
    if not target.is_local:
        return Commit(target, staging if exists else target, replacing=exists)
    os.makedirs(os.path.dirname(target.path), exist_ok=True)
    os.mkdir(staging.path)
    st = os.lstat(staging.path)
    os.close(os.open(os.path.join(staging.path, MARKER_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
    return Commit(target, staging, replacing=exists, identity=(st.st_dev, st.st_ino))


def finish(c: Commit, root_json: bytes) -> None:
    """Make the written data durable, then commit it with ``root_json``. A
    storage error is raised as a :class:`TensorckptError` naming the target
    (and, if the old checkpoint is already gone, where the new one is whole)."""
    try:
        if c.target.is_local:
            _finish_local(c, root_json)
            return
        if not c.staged:  # a new checkpoint in place: the root only if no other save committed one
            with _memory_commit_lock:
                if kv.read(c.target, ROOT_KEY) is not None:
                    raise _raced(c)
                kv.write(c.write_to, ROOT_KEY, root_json)
            return
        kv.write(c.write_to, ROOT_KEY, root_json)
        # replace: the new checkpoint is complete at the staging prefix
        kv.delete(c.target, ROOT_KEY)  # the old one stops being valid before any of its data goes
        kv.delete_all(c.target)
        kv.copy_all(c.write_to, c.target, skip=(ROOT_KEY,))
        kv.write(c.target, ROOT_KEY, root_json)
        _discard(c.write_to)
    except TensorckptError:
        raise
    except (OSError, ValueError) as e:  # TensorStore reports storage errors as ValueError
        where = ""
        if _only_copy(c):
            where = f"; the new checkpoint is complete at {c.write_to}: move it into place to recover it (spec 10.5)"
        if isinstance(e, OSError) and not where:
            raise os_error(c.target, e, "committing the checkpoint") from e
        raise TensorckptError(f"{c.target}: committing the checkpoint failed: {e}{where}") from e


def _raced(c: Commit) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"{c.target}: another save committed a checkpoint here while this one ran (concurrent saves to one "
        "path are not supported, spec 10.1); this save was not committed and its data is discarded: "
        "the other save's checkpoint is intact. Save to another path, or again with overwrite=True")


def _vanished(c: Commit, how: str) -> TensorckptError:
    return TensorckptError(
        f"{c.target}: the save's staging directory {c.write_to.path} {how} while the save ran (removed by "
        "`tensorckpt clean --older-than` or by hand?); nothing was committed"
        + (" and the old checkpoint is untouched" if c.replacing else "")
        + ": save again, and clean only with an --older-than longer than any save takes")


def _open_staging(c: Commit, marked: bool = True) -> int:
    """Open the staging directory (never through a link) and check it is the
    one :func:`begin` made (and, if ``marked``, that it still holds its marker)."""
    try:
        fd = os.open(c.write_to.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise _vanished(c, "disappeared") from None
    except (NotADirectoryError, OSError) as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP):
            raise _vanished(c, "was replaced by something else") from None
        raise
    st = os.fstat(fd)
    if c.identity is not None and (st.st_dev, st.st_ino) != c.identity:
        os.close(fd)
        raise _vanished(c, "was removed and made again (another directory now)")
    if not marked:
        return fd
    try:
        os.stat(MARKER_NAME, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        os.close(fd)
        raise _vanished(c, "was emptied or removed and made again") from None
    return fd


def _finish_local(c: Commit, root_json: bytes) -> None:
    """Every rank has already synced its own writes (engine.save); here only
    the root zarr.json and the renames need to become durable."""
    staging, target = c.write_to.path, c.target.path
    fd = _open_staging(c)
    try:
        # the marker goes first: a complete copy left by a save killed before its rename holds only the checkpoint
        os.unlink(MARKER_NAME, dir_fd=fd)
        # written under a temporary name, then renamed: a staging directory holds a
        # root zarr.json only once it is whole (spec 10.5 takes such a leftover for
        # a complete checkpoint; a save killed mid-write must not leave half a root)
        def opener(name: str, flags: int) -> int:
            return os.open(name, flags | os.O_NOFOLLOW, 0o666, dir_fd=fd)

        with open(PARTIAL_NAME, "wb", opener=opener) as f:
            f.write(root_json)
            f.flush()
            os.fsync(f.fileno())
        os.rename(PARTIAL_NAME, ROOT_KEY, src_dir_fd=fd, dst_dir_fd=fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.close(_open_staging(c, marked=False))  # still the same directory, just before it is renamed
    parent = os.path.dirname(target)
    old = None
    if not c.replacing:
        err = renameat2(staging, target, RENAME_NOREPLACE)
        if err in (errno.EINVAL, errno.ENOSYS):  # no RENAME_NOREPLACE here: rename refuses a non-empty target
            if os.path.lexists(target):
                raise _raced(c)
            err = 0
            try:
                os.rename(staging, target)
            except OSError as e:
                err = e.errno or errno.EIO
        if err in (errno.EEXIST, errno.ENOTEMPTY):
            raise _raced(c)
        if err == errno.ENOENT:
            raise _vanished(c, "disappeared")
        if err:
            raise OSError(err, os.strerror(err), staging)
    else:
        err = renameat2(staging, target, RENAME_EXCHANGE)
        if err == 0:
            old = c.write_to  # now holds the old checkpoint
        elif err == errno.ENOENT and not os.path.lexists(staging):
            raise _vanished(c, "disappeared")
        elif err == errno.ENOENT:  # the old checkpoint was deleted meanwhile: commit as new
            err = renameat2(staging, target, RENAME_NOREPLACE)
            if err in (errno.EEXIST, errno.ENOTEMPTY):
                raise _raced(c)
            if err not in (0, errno.EINVAL, errno.ENOSYS):
                raise OSError(err, os.strerror(err), staging)
            if err:
                os.rename(staging, target)
        elif err in (errno.EINVAL, errno.ENOSYS):  # no atomic swap: move the old aside; it stays whole until deleted
            old = Location("file", f"{staging}-old")
            os.rename(target, old.path)
            os.rename(staging, target)
        else:
            raise OSError(err, os.strerror(err), target)
    kv.fsync_dir(parent)
    if old is not None:
        _discard(old)


def _discard(loc: Location) -> None:
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
    if not loc.is_local:
        if complete:
            kv.delete(loc, ROOT_KEY)
        kv.delete_all(loc)
        return None
    try:
        st = os.lstat(loc.path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link: left alone (tensorckpt never deletes through a link)"
    errors: list[str] = []
    if stat.S_ISDIR(st.st_mode) and rename_first and not loc.path.endswith(DELETING_SUFFIX):
        # out of the way first, atomically: a save still writing it (clean with too short a grace) then
        # finds its staging directory gone (a failed commit) and never one emptied half-way
        trash = f"{loc.path}{DELETING_SUFFIX}"
        err = renameat2(loc.path, trash, RENAME_NOREPLACE)
        if err in (errno.EINVAL, errno.ENOSYS):
            err = errno.EEXIST if os.path.lexists(trash) else 0
            if not err:
                try:
                    os.rename(loc.path, trash)
                except OSError as e:
                    err = e.errno or errno.EIO
        if err == errno.ENOENT:
            return None
        if err not in (0, errno.EEXIST):  # EEXIST: a NAME-del is there already; delete this one in place
            return f"removal failed: renaming it out of the way: {os.strerror(err)}"
        if not err:
            loc = Location("file", trash)
        st = os.lstat(loc.path)
    if stat.S_ISDIR(st.st_mode):
        try:
            fd = os.open(loc.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as e:
            return f"removal failed: {e.strerror or e}"
        try:
            if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) != (st.st_dev, st.st_ino):
                return "it changed while being removed: left alone"
            if complete:  # no longer a checkpoint before any of its data goes
                try:
                    os.unlink(ROOT_KEY, dir_fd=fd)
                except FileNotFoundError:
                    pass
                except IsADirectoryError:
                    pass
                except OSError as e:
                    errors.append(e.strerror or str(e))
        finally:
            os.close(fd)
        # shutil.rmtree uses the fd-based walk here: it never follows a link inside, and refuses a top that is one
        shutil.rmtree(loc.path, onerror=lambda _f, p, exc: errors.append(f"{p}: {getattr(exc[1], 'strerror', None) or exc[1]}"))
    elif stat.S_ISREG(st.st_mode):
        try:
            os.unlink(loc.path)
        except OSError as e:
            errors.append(e.strerror or str(e))
    else:
        return "a special file (not a directory): left alone"
    if not os.path.lexists(loc.path):
        return None
    return "removal failed: " + ("; ".join(errors[:3]) if errors else "it is still there") + (
        f" (what stays is at {loc.path})" if rename_first and loc.path.endswith(DELETING_SUFFIX) else "")


def abort(c: Commit) -> None:
    """Remove what an unsuccessful save wrote (never the target, unless the
    target itself was being written fresh). A complete staging copy is kept
    while the target is not committed: a replace that failed after the old
    checkpoint was deleted (10.3) has no other copy left (spec 10.5 rule 5)."""
    if _only_copy(c):
        return
    if c.target.is_local:
        try:  # only the staging directory this save made: a link or another directory there is not ours
            st = os.lstat(c.write_to.path)
        except OSError:
            return
        if c.identity is not None and (st.st_dev, st.st_ino) != c.identity:
            return
        _discard(c.write_to)
        return
    if c.staged or kv.read(c.target, ROOT_KEY) is None:
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
    """Staging locations of interrupted saves to ``target`` (local: every name
    with the staging prefix, links included; callers never follow them)."""
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
