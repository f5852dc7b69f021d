"""The file-system commit strategy (spec 10.2): everything, root
``zarr.json`` included, is written into a staging directory beside the
target (``.NAME.tensorckpt-staging-TOKEN``), made by :meth:`begin` (its
identity is checked again at the commit: a staging directory removed or
replaced meanwhile fails the save), synced, then renamed onto the target.
A new target is committed with a no-replace rename
(``renameat2(RENAME_NOREPLACE)``): of two saves racing to create it, the
second fails. Replacing a checkpoint swaps the two directories atomically
(``renameat2(RENAME_EXCHANGE)``); the old one is then renamed to
``.NAME.tensorckpt-replaced-TOKEN`` and kept whole, so a reader that had
opened it (spec 10.7) finishes instead of failing, until the next replace
of NAME begins (it deletes every such older version first, so a save never
holds more than today's two copies at once) or ``clean`` removes it after
its grace. Nothing is ever followed or deleted through a symbolic link.

Like Orbax's ``AtomicRenameTemporaryPath``; the object-store strategy is
:mod:`.commit_kv`, the rules both share :mod:`.commit`. Used by the local
backend (:mod:`.local`).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat

from ..errors import InvalidPathError, TensorckptError
from . import kv
from .commit import (
    DELETING_SUFFIX,
    MARKER_NAME,
    MAX_NAME_BYTES,
    PARTIAL_NAME,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    REPLACED_INFIX,
    ROOT_KEY,
    STAGING_INFIX,
    TOKEN_HEX,
    Commit,
    discard,
    is_root,
    new_token,
    nodes_and_chunks,
    raced,
    renameat2,
    replaced_location,
    root_below,
)
from .location import Location

# the longest target name whose staging and replaced names (".NAME" + infix + token + "-old" + "-del") fit in one component
MAX_TARGET_NAME_BYTES = (MAX_NAME_BYTES - 1 - max(len(STAGING_INFIX) + len("-old"), len(REPLACED_INFIX)) - TOKEN_HEX
                         - len(DELETING_SUFFIX))


class AtomicRenameCommit:
    """Spec 10.2: stage in a directory beside the target, then rename it into place."""

    def describe_foreign(self, target: Location) -> str | None:
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
        return None if is_root(doc) else "a directory whose zarr.json is not a tensorckpt root (another Zarr store?)"

    def check_name(self, target: Location) -> None:
        if len(os.fsencode(target.name)) > MAX_TARGET_NAME_BYTES:
            raise InvalidPathError(
                f"{target}: the checkpoint's name is {len(os.fsencode(target.name))} bytes; at most "
                f"{MAX_TARGET_NAME_BYTES} fit (its staging directory {STAGING_INFIX!r}... must fit in "
                f"{MAX_NAME_BYTES} bytes): choose a shorter name")

    def occupied(self, target: Location) -> str | None:
        """What the overwrite refusal says is at ``target``, where not the default."""
        return "an empty directory is there" if not os.listdir(target.path) else None

    def begin(self, target: Location, staging: Location, exists: bool) -> Commit:
        if exists:  # a replace: the versions earlier replaces kept go first (spec 10.2), never more than two copies
            for old in _replaced(target):
                discard(old)
        os.makedirs(os.path.dirname(target.path), exist_ok=True)
        os.mkdir(staging.path)
        st = os.lstat(staging.path)
        os.close(os.open(os.path.join(staging.path, MARKER_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
        return Commit(target, staging, replacing=exists, identity=(st.st_dev, st.st_ino))

    def finish(self, c: Commit, root_json: bytes) -> None:
        _finish_local(c, root_json)

    def only_copy(self, c: Commit) -> bool:
        return False  # the old checkpoint is never deleted before the new one is in place (10.2)

    def abort(self, c: Commit) -> None:
        try:  # only the staging directory this save made: a link or another directory there is not ours
            st = os.lstat(c.write_to.path)
        except OSError:
            return
        if c.identity is not None and (st.st_dev, st.st_ino) != c.identity:
            return
        discard(c.write_to)

    def remove(self, loc: Location, complete: bool = True, rename_first: bool = False) -> str | None:
        return _remove(loc, complete, rename_first)

    def promote(self, copy: Location, target: Location) -> bool:
        if os.path.lexists(target.path) or not _is_dir(copy.path):
            return False  # not made by a save (spec 10.5 rule 1), or no longer a directory: left alone
        if renameat2(copy.path, target.path, RENAME_NOREPLACE) in (errno.EINVAL, errno.ENOSYS):
            os.rename(copy.path, target.path)
        kv.fsync_dir(os.path.dirname(target.path))
        return True

    def retire(self, loc: Location, trash: Location) -> None:
        if not _is_dir(loc.path):
            raise TensorckptError(f"{loc}: not a directory (a link?): left alone")
        os.rename(loc.path, trash.path)
        kv.fsync_dir(os.path.dirname(loc.path))
        _remove(trash)

    def leftovers(self, target: Location) -> list[Location]:
        return _siblings(target, STAGING_INFIX) + _replaced(target)


def _siblings(target: Location, infix: str) -> list[Location]:
    prefix = f".{target.name}{infix}"
    try:
        names = os.listdir(target.sibling("").path or "/")
    except FileNotFoundError:
        return []
    return [target.sibling(n) for n in sorted(names) if n.startswith(prefix)]


def _replaced(target: Location) -> list[Location]:
    """The versions of ``target`` earlier replaces kept (links and files named so included: removal leaves them)."""
    return _siblings(target, REPLACED_INFIX)


def _keep_replaced(old: Location, target: Location) -> Location | None:
    """Rename the version a replace swapped out to its replaced name (spec 10.2),
    aged from now; None if that failed (it is then deleted as before)."""
    kept = replaced_location(target, new_token())
    try:
        os.rename(old.path, kept.path)
        os.utime(kept.path)  # its age (clean's grace) counts from the replace, not from when it was written
    except OSError:
        return None
    return kept


def _is_dir(path: str) -> bool:
    """A real directory (not a link to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _local_leftover(path: str, limit: int = 1_000_000) -> bool:
    """Whether the directory ``path`` holds only what a save writes below a
    checkpoint's root (:func:`nodes_and_chunks`, no checkpoint root below),
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

    return nodes_and_chunks(keys) and not root_below(keys, read)


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
                raise raced(c)
            err = 0
            try:
                os.rename(staging, target)
            except OSError as e:
                err = e.errno or errno.EIO
        if err in (errno.EEXIST, errno.ENOTEMPTY):
            raise raced(c)
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
                raise raced(c)
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
    kept = _keep_replaced(old, c.target) if old is not None else None
    kv.fsync_dir(parent)
    if old is not None and kept is None:
        discard(old)


def _remove(loc: Location, complete: bool = True, rename_first: bool = False) -> str | None:
    """Delete a checkpoint location, root ``zarr.json`` first, never following
    a symbolic link (a link is left alone: it is not ours). ``rename_first``:
    locally, rename it to ``NAME-del`` first. Returns None once nothing is
    left at ``loc``, else why something stayed."""
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
