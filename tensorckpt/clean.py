"""``tensorckpt.clean(path)``: remove what interrupted saves to ``path`` left
behind, by the rule of spec section 10.5:

- a committed checkpoint is never touched, so its readers are never raced;
- a leftover is removed only once nothing under it has changed for
  ``older_than`` seconds, so a save still writing it is never cut short
  (object stores keep no modification times: there the age is the time
  since the save last stamped its marker, which it does every
  ``commit_kv.REFRESH_SECONDS`` while it runs; a leftover with no stamp, as
  older versions left them, has no age and goes only with ``older_than=0``);
- a leftover that is a complete checkpoint is kept while the target is not
  committed: it is then the only copy of that checkpoint (not a version a
  replace swapped out and kept for its readers, ``.NAME.tensorckpt-replaced-*``:
  that one goes once replaced longer than ``older_than`` ago, spec 10.2);
- a complete leftover is uncommitted (its root ``zarr.json`` deleted) before
  the rest of it goes, as in section 10.3;
- a symbolic link (or any other non-directory special file) named like a
  leftover is not one: it is left alone, and nothing is ever deleted
  through a link (spec 10.5 rule 7). ``removed`` reports what really happened: a
  removal that failed is reported as kept, with the error.

The pieces of the rule are public for ``CheckpointManager``, which applies it
to step directories: :func:`has_root` (is a location a whole checkpoint),
:func:`age_of` (seconds since anything under it changed) and
:func:`too_young` (why a leftover of that age must stay).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .storage import commit, kv, location
from .storage.backend import backend_for

DEFAULT_OLDER_THAN = 3600.0  # seconds


@dataclass(frozen=True)
class Leftover:
    path: str
    age: float | None  # seconds since anything under it changed (or its save's last stamp); None: unknown
    complete: bool  # holds its own root zarr.json: a whole checkpoint
    removed: bool  # removed (or, with dry_run, would be)
    reason: str


@dataclass
class CleanReport:
    path: str
    committed: bool  # a committed checkpoint is at ``path`` (left alone)
    dry_run: bool
    leftovers: list[Leftover] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "path": self.path, "committed": self.committed, "dry_run": self.dry_run,
            "leftovers": [vars(x) for x in self.leftovers],
        }


def clean(path: location.PathArg, *, older_than: float = DEFAULT_OLDER_THAN, dry_run: bool = False,
          storage_options: Mapping[str, Any] | None = None) -> CleanReport:
    """Find the leftovers of interrupted saves to ``path`` and remove those the
    rule allows (see the module docstring); with ``dry_run`` remove nothing.
    ``storage_options`` as in :func:`tensorckpt.save`."""
    if not older_than >= 0:
        raise ValueError(f"older_than must be a number of seconds >= 0, got {older_than!r}")
    target = location.parse(path, storage_options)
    try:
        return _clean(target, older_than, dry_run)
    except OSError as e:
        raise commit.os_error(target, e, "cleaning the leftovers of interrupted saves") from e


def _clean(target: location.Location, older_than: float, dry_run: bool) -> CleanReport:
    committed = has_root(target)
    report = CleanReport(target.url, committed, dry_run)
    staging = commit.leftovers(target)
    foreign = {s: _foreign(s) for s in staging}
    ages = {s: age_of(s) for s in staging if foreign[s] is None}
    keep: str | None  # why a leftover stays (None: it goes)
    for s in staging:
        why = foreign[s]
        if why is not None:
            report.leftovers.append(Leftover(s.url, None, False, False, why))
            continue
        complete = has_root(s)
        if commit.is_replaced(s):  # an older version, kept for its readers (spec 10.2): never the only copy of the newest
            keep = too_young(ages[s], older_than, "replaced")
            gone = "the version a finished replace swapped out (kept for the readers that had opened it)"
            _settle(report, s, ages[s], complete, keep, gone)
            continue
        if complete and not committed:
            keep = "a complete checkpoint, and the only one: move it into place to recover it (spec 10.5)"
        else:
            keep = too_young(ages[s], older_than)
        gone = "the old checkpoint of a finished replace" if complete else "the data of an interrupted save"
        _settle(report, s, ages[s], complete, keep, gone)
    if not committed and kv.exists(target):
        age = age_of(target)
        if backend_for(target).supports_rename:
            keep = "not left by a save (local saves write only under staging names): delete it yourself if unwanted"
        elif any(too_young(a, older_than) for a in ages.values()):
            keep = "a save may be replacing it: one of its staging locations is recent or of unknown age"
        else:
            keep = too_young(age, older_than)
        _settle(report, target, age, False, keep, "an object-store save interrupted before its commit", target=True)
    return report


def too_young(age: float | None, older_than: float, what: str = "written") -> str | None:
    """Why a leftover of this age must stay (None: it may go); ``what``:
    "replaced" for a version a replace kept for its readers."""
    if age is None and older_than > 0:
        return ("its age is unknown (no modification times, and no save's time stamp in it); "
                "pass older_than=0 once no save to this path runs")
    if age is not None and age < older_than:
        if what == "replaced":
            return f"replaced {age:.0f} s ago, less than {older_than:g} s: a reader may still be reading it"
        return f"changed {age:.0f} s ago, less than {older_than:g} s: a save may still be writing it"
    return None


def _settle(report: CleanReport, loc: location.Location, age: float | None, complete: bool, keep: str | None,
            gone: str, target: bool = False) -> None:
    """Remove ``loc`` unless there is a reason to ``keep`` it, and report it."""
    if keep is None and not report.dry_run:
        if target and has_root(loc):
            keep = "committed while clean ran"
        else:
            keep = _remove(loc, complete)
    report.leftovers.append(Leftover(loc.url, age, complete, keep is None, keep or gone))


def _foreign(loc: location.Location) -> str | None:
    """Why a local name with a staging prefix is not a leftover of a save (a
    symbolic link, a special file), or None. Saves make only directories."""
    if not backend_for(loc).supports_rename:  # an object store holds only objects
        return None
    try:
        st = os.lstat(loc.path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link, not left by a save: left alone (tensorckpt never follows or deletes links)"
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return "a special file, not left by a save: left alone"
    return None


def has_root(loc: location.Location) -> bool:
    """Whether ``loc`` holds a root zarr.json (spec 10.4), without reading it
    (locally: and without following a link at ``loc``)."""
    if backend_for(loc).supports_rename:
        try:
            if stat.S_ISLNK(os.lstat(loc.path).st_mode):
                return False
        except OSError:
            return False
        return os.path.lexists(os.path.join(loc.path, commit.ROOT_KEY))
    return kv.read(loc, commit.ROOT_KEY) is not None


def age_of(loc: location.Location) -> float | None:
    """Seconds since anything under ``loc`` last changed (modified, created,
    renamed: the later of mtime and ctime; object stores: since its save
    last stamped its marker), or None where unknown."""
    return backend_for(loc).age(loc)


def _remove(loc: location.Location, complete: bool) -> str | None:
    """Remove a leftover, root zarr.json first, never through a link. None
    once it is gone, else why it stayed."""
    try:
        return commit.remove(loc, complete, rename_first=True)
    except OSError as e:
        return f"removal failed: {e.strerror or e}" + (": permission denied" if e.errno == errno.EACCES else "")
