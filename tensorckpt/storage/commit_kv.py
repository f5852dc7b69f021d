"""The object-store commit strategy (spec 10.3; ``memory://`` here): there
is no rename, so a new checkpoint is written in place and its root
``zarr.json`` is written last, only if none exists (a conditional create).
Replacing one writes and commits the new checkpoint at the staging prefix
first, then deletes the old, copies the new in and writes its root
``zarr.json`` last; until then the complete new checkpoint stays at the
staging prefix, and ``identify`` / ``clean`` name it.

Like Orbax's ``CommitFileTemporaryPath``; the file-system strategy is
:mod:`.commit_local`, the rules both share :mod:`.commit`. Used by the
TensorStore kvstore backends (:mod:`.tskv`).

With ``claim`` (S3: other processes write the same bucket), a save to a new
location first creates a claim object ``__tensorckpt-staging`` there
conditionally (``If-None-Match: *``): a second save to it is refused before
it writes anything, so the first one's objects are never overwritten; the
claim is deleted once the root is committed. The root itself is always a
conditional create.

Object stores keep no modification times tensorckpt can read, so a save
stamps its own: the marker object ``__tensorckpt-staging`` at the place it
writes (the claim of a new location; one made at the staging prefix of a
replace; ``memory://`` makes no claim, so a save in place there has none) holds the writer's wall-clock time as JSON, written when the save
begins and again every :data:`REFRESH_SECONDS` from a timer thread until
it commits or fails. :func:`stamped_age` reads it back: the age that
``clean`` and the manager's grace go by (spec 10.5 rule 3). A marker without
a stamp (empty, as older versions made it) gives no age.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable

from ..errors import CheckpointExistsError, TensorckptError
from . import kv
from .commit import (
    MARKER_NAME,
    ROOT_KEY,
    STAGING_INFIX,
    Commit,
    discard,
    is_root,
    nodes_and_chunks,
    raced,
    root_below,
)
from .location import Location

_commit_lock = threading.Lock()  # memory:// stores are per process: their conditional create
REFRESH_SECONDS = 10.0  # a running save re-stamps its marker at least this often (spec 10.5 rule 3)
STAMP_LIMIT = 4096  # bytes of a marker read for its stamp: a larger one is not a save's (no age)
STAMP_KEY = "tensorckpt_save_alive_at"  # the marker's JSON: {STAMP_KEY: seconds since the epoch}


def stamp() -> bytes:
    """The marker's content: this host's wall-clock time, now."""
    return json.dumps({STAMP_KEY: time.time()}).encode()


def stamped_age(loc: Location) -> float | None:
    """Seconds since the save writing ``loc`` last stamped its marker (0 for a
    stamp from a clock ahead of this one); None where there is no marker, an
    unstamped one, or it cannot be read: the age is unknown."""
    try:
        data = kv.read_range(loc, MARKER_NAME, 0, STAMP_LIMIT + 1)
    except (OSError, ValueError, TensorckptError):
        return None
    try:
        doc = json.loads(data or b"") if data is not None and len(data) <= STAMP_LIMIT else None
    except ValueError:
        return None
    t = doc.get(STAMP_KEY) if isinstance(doc, dict) else None
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
        return None
    return max(0.0, time.time() - t)


class _Refresher:
    """Re-stamps the marker at ``loc`` every :data:`REFRESH_SECONDS` from a
    daemon thread, until :meth:`stop` (which waits for a write under way, so
    none lands after it)."""

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tensorckpt-save-stamp", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(REFRESH_SECONDS):
            try:
                kv.write(self.loc, MARKER_NAME, stamp())
            except (OSError, ValueError, TensorckptError):
                pass  # the store is down: the save fails by its own writes, and the stamp ages

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


class RootLastCommit:
    """Spec 10.3: every object first, the root ``zarr.json`` last; ``claim``:
    a new location is claimed first (module docstring)."""

    def __init__(self, claim: bool = False,
                 error: Callable[[Location, ValueError, str], TensorckptError] | None = None) -> None:
        self.claim = claim
        self.error = error  # the backend's storage error as what to fix (S3: tskv.s3_error)
        self._refreshers: dict[str, _Refresher] = {}  # write_to URL -> the timer of the save writing there
        self._lock = threading.Lock()

    def describe_foreign(self, target: Location) -> str | None:
        keys = [k for k in kv.list_keys(target) if k != MARKER_NAME]
        if not keys:
            return None
        if ROOT_KEY in keys:
            return None if is_root(kv.read(target, ROOT_KEY)) else "objects whose zarr.json is not a tensorckpt root"
        # an interrupted in-place save (10.3 step 1): Zarr nodes, none of them a checkpoint root
        below = root_below(keys, lambda k: kv.read(target, k))
        if not below and nodes_and_chunks(keys):
            return None
        return (f"{len(keys)} object(s) that are not the leftovers of a save"
                + (" (checkpoints below it: a CheckpointManager root)" if below else ""))

    def check_name(self, target: Location) -> None:
        return None  # keys have no length limit of a directory entry

    def occupied(self, target: Location) -> str | None:
        return None

    def begin(self, target: Location, staging: Location, exists: bool) -> Commit:
        if self.claim and not exists and not self._claim(target):
            raise CheckpointExistsError(
                f"{target}: another save is writing a checkpoint here (concurrent saves to one path are not "
                "supported, spec 10.1); this save wrote nothing. Save to another path, or again with overwrite=True")
        c = Commit(target, staging if exists else target, replacing=exists)
        if exists:  # in place, the claim holds the first stamp
            self._mark(c.write_to, "marking the staging prefix (the save's first write)")
        elif not self.claim:
            return c  # memory:// in place: no claim, so no stamp (such a leftover is of unknown age)
        with self._lock:  # one timer per place (two saves in place to one memory:// location: unsupported, 10.1)
            if c.write_to.url not in self._refreshers:
                self._refreshers[c.write_to.url] = _Refresher(c.write_to)
        return c

    def _stop(self, c: Commit) -> None:
        """The save is over (committed or failed): its marker is stamped no
        more. Idempotent: each way a save ends calls it."""
        with self._lock:
            r = self._refreshers.pop(c.write_to.url, None)
        if r is not None:
            r.stop()

    def _claim(self, target: Location) -> bool:
        return self._mark(target, "claiming the location (the save's first write)", create=True)

    def _mark(self, loc: Location, doing: str, create: bool = False) -> bool:
        """Write the stamped marker at ``loc`` (``create``: only if none is
        there; False if one was). A refusal (403, ...) is reported as what to fix."""
        try:
            if create:
                return kv.create(loc, MARKER_NAME, stamp())
            kv.write(loc, MARKER_NAME, stamp())
            return True
        except ValueError as e:
            if self.error is None:
                raise
            raise self.error(loc, e, doing) from e

    def finish(self, c: Commit, root_json: bytes) -> None:
        try:  # stamped until the target is committed: the copy of a replace may take long
            if not c.staged:  # a new checkpoint in place: the root only if no other save committed one
                with _commit_lock:
                    if not kv.create(c.write_to, ROOT_KEY, root_json):
                        raise raced(c)
            else:
                kv.write(c.write_to, ROOT_KEY, root_json)
                # replace: the new checkpoint is complete at the staging prefix
                kv.delete(c.target, ROOT_KEY)  # the old one stops being valid before any of its data goes
                kv.delete_all(c.target)
                kv.copy_all(c.write_to, c.target, skip=(ROOT_KEY, MARKER_NAME))
                kv.write(c.target, ROOT_KEY, root_json)
        finally:
            self._stop(c)
        if c.staged:
            discard(c.write_to)
        elif self.claim:
            kv.delete(c.target, MARKER_NAME)

    def only_copy(self, c: Commit) -> bool:
        """Whether a replace got past deleting the old checkpoint: the target
        is not committed and the staging prefix holds the whole new one. When
        unsure, True: keeping a copy is the safe side. Asked only of a
        failed save: its marker is stamped no more."""
        self._stop(c)
        if not c.staged:
            return False
        try:
            return kv.read(c.target, ROOT_KEY) is None and kv.read(c.write_to, ROOT_KEY) is not None
        except (OSError, ValueError, TensorckptError):  # the store is unreachable (a timeout): keep the copy
            return True

    def abort(self, c: Commit) -> None:
        """Best effort, as the local strategy's: the save fails with its own
        error either way; what stays (the store went down) is a leftover that
        ``clean`` removes once its stamp is older than the grace (spec 10.5)."""
        self._stop(c)
        try:
            if c.staged or kv.read(c.target, ROOT_KEY) is None:
                kv.delete_all(c.write_to)
        except (OSError, ValueError, TensorckptError):
            pass

    def remove(self, loc: Location, complete: bool = True, rename_first: bool = False) -> str | None:
        if complete:
            kv.delete(loc, ROOT_KEY)
        kv.delete_all(loc)
        return None

    def promote(self, copy: Location, target: Location) -> bool:
        root = kv.read(copy, ROOT_KEY)  # as a replace commits (10.3): the root zarr.json last
        if root is None:
            return False  # gone since it was checked (removed by another process): nothing to recover
        kv.delete_all(target)
        kv.copy_all(copy, target, skip=(ROOT_KEY, MARKER_NAME))
        kv.write(target, ROOT_KEY, root)
        self.remove(copy)
        return True

    def retire(self, loc: Location, trash: Location) -> None:
        self.remove(loc)  # root zarr.json first: uncommitted before any of its data goes

    def leftovers(self, target: Location) -> list[Location]:
        prefix = f".{target.name}{STAGING_INFIX}"
        names = {k.split("/", 1)[0] for k in kv.list_keys(target.sibling("")) if k.startswith(prefix)}
        return [target.sibling(n) for n in sorted(names)]
