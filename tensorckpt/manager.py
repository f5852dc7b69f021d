"""``tensorckpt.CheckpointManager``: one checkpoint per training step under a
root, the newest one found again after a restart, and old ones retired by a
retention policy (normative rules: ``spec/manager.md``).

    mgr = tensorckpt.CheckpointManager("runs/a", keep_last=3, keep_every=1000)
    step = mgr.restore(state) or 0          # newest committed step, or None
    for step in range(step + 1, steps + 1):
        train_step()
        if step % 100 == 0:
            mgr.async_save(step, state)     # runs retention once committed
    mgr.wait()

Layout: ``ROOT/step-00000100`` (``step-`` and the step in decimal, at least 8
digits). Each step directory is an ordinary checkpoint, written with the
commit protocol of spec/format-v1.md section 10, so ``tensorckpt.open``,
``load``, ``verify`` and ``clean`` work on it directly.

In a distributed job every rank creates the manager and calls ``save``,
``async_save``, ``latest`` and ``restore`` together (they are collectives).
Rank 0 alone lists the root and deletes, and broadcasts what ranks must agree
on. Retention runs after each successful commit, on rank 0, before the save
counts as finished (``save`` returns, an async handle completes), so it never
overlaps a save of this manager. It:

- keeps the newest ``keep_last`` committed steps and every step that is a
  multiple of ``keep_every``; never the newest committed step;
- deletes a superseded step only once the step that superseded it has been
  committed for ``reader_grace`` seconds, so a reader that resolved the newest
  step less than that long ago still finds it whole;
- retires a step atomically (local: renamed out of the way first; object
  stores: root ``zarr.json`` deleted first), so a reader never sees half of
  one;
- removes the leftovers of interrupted saves by the grace-period rule of
  spec 10.5 (``grace`` seconds, like ``tensorckpt clean --older-than``), never
  those of a save in flight; a complete copy left at a staging name (a save
  killed just before its rename) is moved into place instead of lost;
- treats symbolic links (and special files) under the root as foreign: a
  link named like a step, a staging or a retired location is never listed,
  adopted, renamed or deleted, and nothing is deleted through one.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import stat
import threading
import time
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from .checkpoint import read_root
from .clean import DEFAULT_OLDER_THAN, age_of, has_root, too_young
from .clean import clean as _clean_leftovers
from .engine.async_save import SaveHandle
from .engine.async_save import async_save as _async_save
from .engine.group import Group
from .engine.load import LoadStats
from .engine.load import load as _load
from .engine.save import save as _save
from .errors import CheckpointChangedError, CheckpointExistsError, TensorckptError
from .storage import commit, kv, location
from .storage.backend import backend_for

STEP_PREFIX = "step-"
STEP_DIGITS = 8
RETIRED_INFIX = ".tensorckpt-retired-"
DEFAULT_READER_GRACE = 60.0  # seconds a superseded step stays readable
RESTORE_ATTEMPTS = 5

_STEP_NAME = re.compile(r"step-([0-9]{8,})")


def step_name(step: int) -> str:
    """The directory name of ``step``: ``step-`` and at least 8 decimal digits."""
    return f"{STEP_PREFIX}{_check_step(step):0{STEP_DIGITS}d}"


def parse_step_name(name: str) -> int | None:
    """The step of a step directory name, or None if ``name`` is not one (only
    the canonical spelling counts: ``step-00000100``, not ``step-100``)."""
    m = _STEP_NAME.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_name(step) == name else None


def _check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a step must be an int >= 0, got {step!r}")
    return step


@dataclass(frozen=True)
class StepInfo:
    """One step found under the root (:meth:`CheckpointManager.steps`)."""

    step: int
    path: str  # the step directory's path or URL
    status: str  # "committed" or "incomplete" (never committed: in progress, interrupted, or not made by a save)
    bytes: int  # stored bytes: the step directory, plus its leftovers when incomplete
    leftovers: tuple[str, ...] = ()  # staging locations of saves to this step (spec 10.2)

    @property
    def committed(self) -> bool:
        return self.status == "committed"

    def to_json(self) -> dict:
        return {"step": self.step, "path": self.path, "status": self.status, "bytes": self.bytes,
                "leftovers": list(self.leftovers)}


@dataclass
class _Entry:
    target: bool = False  # the step directory (or object prefix) exists
    committed: bool = False
    leftovers: tuple[location.Location, ...] = ()


class CheckpointManager:
    """Checkpoints of a training run, one per step, under ``root`` (a local
    path, ``file://`` URL, or ``memory://`` in a single process).

    ``keep_last``: how many of the newest committed steps to keep (None: all).
    ``keep_every``: also keep every step that is a multiple of it (None: none).
    ``reader_grace``: seconds a superseded step stays after the step that
    superseded it was committed (readers of the newest step finish within it).
    ``grace``: age after which the leftovers of an interrupted save are
    deleted (spec 10.5; like ``tensorckpt clean --older-than``).
    ``process_group``: the group whose ranks save together (default: the
    default group when torch.distributed is initialized).
    ``storage_options``: of an ``s3://`` or fsspec root, as in
    :func:`tensorckpt.save`; every step saved, loaded and removed uses them.
    """

    def __init__(
        self,
        root: location.PathArg,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        reader_grace: float = DEFAULT_READER_GRACE,
        grace: float = DEFAULT_OLDER_THAN,
        process_group: Any = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        for name, v in (("keep_last", keep_last), ("keep_every", keep_every)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"CheckpointManager({name}=...) must be None or an int >= 1, got {v!r}")
        for name, seconds in (("reader_grace", reader_grace), ("grace", grace)):
            if not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds >= 0):
                raise ValueError(f"CheckpointManager({name}=...) must be a number of seconds >= 0, got {seconds!r}")
        self.root = location.parse(root, storage_options)
        self._options = self.root.storage_options or None  # passed on with each step's path
        self._fs = backend_for(self.root).supports_rename  # a file system: directories, renames, times
        if self._fs:
            _check_root(self.root)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.reader_grace, self.grace = float(reader_grace), float(grace)
        self.process_group = process_group
        self._g = Group(process_group)
        if self._g.distributed and not backend_for(self.root).shared:
            raise TensorckptError(f"{self.root}: memory:// stores are per process; a distributed job needs a shared file path")
        self._lock = threading.RLock()  # retention and listing on rank 0
        self._seen: dict[int, float] = {}  # step -> when this manager saw it committed (stores without times)
        self._pending: SaveHandle | None = None  # the last async save of this manager
        self._in_flight: dict[int, SaveHandle | None] = {}  # steps being saved: their handle (None: a sync save)
        self._newest_started: int | None = None  # the largest step this manager started saving

    # ------------------------------------------------------------ paths

    @property
    def path(self) -> str:
        return self.root.url

    def step_path(self, step: int) -> str:
        """Where ``step`` is (or would be) saved."""
        return self._loc(step).url

    def _loc(self, step: int) -> location.Location:
        return self._child(step_name(step))

    def _child(self, name: str) -> location.Location:
        return self.root.child(name)

    def __repr__(self) -> str:
        return f"CheckpointManager({self.path!r}, keep_last={self.keep_last}, keep_every={self.keep_every})"

    # ------------------------------------------------------------ saving

    def save(self, step: int, state: Mapping, **options: Any) -> None:
        """Save ``state`` as ``step`` (a collective, like :func:`tensorckpt.save`;
        ``options`` are passed on to it), then apply retention. ``step`` must
        not be older than the newest committed step; saving that step again
        needs ``overwrite=True``."""
        _check_step(step)
        self.wait(raise_error=False)
        self._agree_on_step(step, options.get("overwrite", False))
        self._in_flight[step] = None
        try:
            _save(state, self.step_path(step), process_group=self.process_group, storage_options=self._options, **options)
        finally:
            del self._in_flight[step]
        self._committed(step)

    def async_save(self, step: int, state: Mapping, *, on_durable: Callable[[SaveHandle], None] | None = None,
                   **options: Any) -> SaveHandle:
        """Like :meth:`save`, returning once the tensors are copied to host
        memory (:func:`tensorckpt.async_save`). Retention runs in the
        background once the step is committed, before the handle completes;
        then ``on_durable(handle)``, if given."""
        _check_step(step)
        self._agree_on_step(step, options.get("overwrite", False))

        def durable(handle: SaveHandle) -> None:
            self._committed(step)
            if on_durable is not None:
                on_durable(handle)

        self._in_flight = {s: h for s, h in self._in_flight.items() if h is None or not h.done()}
        self._in_flight[step] = None
        try:
            handle = _async_save(state, self.step_path(step), process_group=self.process_group,
                                 on_durable=durable, storage_options=self._options, **options)
        finally:
            del self._in_flight[step]
        self._in_flight[step] = handle  # in flight until the handle is done
        self._pending = handle
        return handle

    def wait(self, timeout: float | None = None, *, raise_error: bool = True) -> None:
        """Wait for this manager's async save in flight (and its retention);
        raise its error, if it failed."""
        h = self._pending
        if h is None:
            return
        if raise_error:
            h.wait(timeout)
        else:
            concurrent.futures.wait([h.future], timeout)  # not looking at the outcome: a failure is still reported

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait(raise_error=exc[0] is None)

    def _agree_on_step(self, step: int, overwrite: bool) -> None:
        """Rank 0 checks that ``step`` is not older than the newest committed
        (or started) step; every rank raises the same error if it is."""
        self._g.collective(None, lambda _: self._check_new_step(step, overwrite), what=f"save of step {step} in {self.path}")
        self._newest_started = max(step, self._newest_started if self._newest_started is not None else step)

    def _check_new_step(self, step: int, overwrite: bool) -> None:
        newest = self._latest_local()
        started = self._newest_started
        if started is not None and step < started:
            raise TensorckptError(f"{self.path}: step {step} is older than step {started}, already saved by this manager")
        if newest is not None and step < newest:
            raise TensorckptError(
                f"{self.path}: step {step} is older than the newest committed step {newest}; steps must not go "
                "back (retention and latest() follow the step number): delete the newer steps first "
                "(CheckpointManager.delete), or save into another root"
            )
        if newest == step and not overwrite:
            raise CheckpointExistsError(f"{self.step_path(step)}: step {step} is already committed; pass overwrite=True to replace it")

    def _committed(self, step: int) -> None:
        """After ``step`` committed: note when, and apply retention (rank 0).
        A retention failure is a warning: the step is committed, and every
        rank must go on alike."""
        with self._lock:
            self._seen[step] = time.time()
        if self._g.rank != 0:
            return
        try:
            self.prune()
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"tensorckpt: retention in {self.path} after step {step} failed: {e!r}", stacklevel=2)

    # ------------------------------------------------------------ finding

    def latest(self) -> int | None:
        """The newest committed step, or None (a collective in a distributed job:
        rank 0 looks, every rank gets its answer)."""
        return self._g.collective(None, lambda _: self._latest_local(), what=f"latest() in {self.path}")

    def _latest_local(self) -> int | None:
        committed = [s for s, e in self._scan().items() if e.committed]
        return max(committed) if committed else None

    def steps(self) -> list[StepInfo]:
        """Every step under the root, oldest first: committed ones and
        incomplete ones (a save in progress or interrupted). Not a collective:
        any rank may call it."""
        out = []
        for step, e in sorted(self._scan().items()):
            loc = self._loc(step)
            size = _stored_bytes(loc) if e.target else 0
            if not e.committed:
                size += sum(_stored_bytes(x) for x in e.leftovers)
            out.append(StepInfo(step, loc.url, "committed" if e.committed else "incomplete", size,
                                tuple(x.url for x in e.leftovers)))
        return out

    def restore(self, state: MutableMapping, step: int | None = None, *, strict: bool = True, partial: bool = False,
                cast: bool = False, stats: LoadStats | None = None) -> int | None:
        """Load ``step`` (default: the newest committed one) into ``state`` in
        place, like :func:`tensorckpt.load` (``strict``, ``partial``, ``cast``
        as there), and return the step loaded; None (state untouched) when
        ``step`` is None and nothing is committed. If the newest step is
        retired by another process while it is being read, the load is
        retried with the then newest one. A failure on any rank raises on
        every rank (load is collective about its errors)."""
        g = self._g
        for attempt in range(RESTORE_ATTEMPTS):
            s = self.latest() if step is None else _check_step(step)
            if s is None:
                return None
            try:
                _load(state, self.step_path(s), process_group=self.process_group, strict=strict, partial=partial,
                      cast=cast, stats=stats, storage_options=self._options)
                return s
            except CheckpointChangedError:  # replaced or retired while read (spec 10.7): read again
                if attempt == RESTORE_ATTEMPTS - 1:
                    raise
                continue
            except Exception:  # raised on every rank alike (load's errors are collective)
                if step is not None or attempt == RESTORE_ATTEMPTS - 1:
                    raise
                gone = g.collective(None, lambda _: self._uncommitted(s),  # noqa: B023 - runs now, in this iteration
                                    what=f"restore in {self.path}")
                if not gone:
                    raise  # still committed: a real problem with the step, not a race with retention
        raise TensorckptError(f"{self.path}: restore gave up after {RESTORE_ATTEMPTS} attempts")  # pragma: no cover

    def _uncommitted(self, step: int) -> bool:
        return not self._scan().get(step, _Entry()).committed

    # ------------------------------------------------------------ retention

    def prune(self) -> list[int]:
        """Apply retention now (rank 0; other ranks do nothing). Returns the
        committed steps it retired. Called after every commit."""
        if self._g.rank != 0:
            return []
        with self._lock:
            try:
                return self._prune()
            except OSError as e:
                raise commit.os_error(self.root, e, "retention") from e

    def delete(self, step: int) -> None:
        """Retire committed ``step`` whatever the policy (rank 0; waits for this
        manager's async save first). Readers of it may fail: it is the user's
        call."""
        _check_step(step)
        self.wait(raise_error=False)
        if self._g.rank != 0:
            return
        with self._lock:
            try:
                e = self._scan().get(step)
                if e is None or not e.committed:
                    raise TensorckptError(f"{self.step_path(step)}: step {step} is not committed")
                self._retire(step)
            except OSError as e:
                raise commit.os_error(self.step_path(step), e, f"deleting step {step}") from e

    def _prune(self) -> list[int]:
        now = time.time()
        busy = self._busy()
        entries = self._scan()
        recovered = [s for s, e in entries.items() if not e.committed and s not in busy and self._recover(s, e)]
        if recovered:
            entries = self._scan()
        committed = sorted(s for s, e in entries.items() if e.committed)
        keep = set(committed[-self.keep_last:]) if self.keep_last else set(committed)
        if self.keep_every:
            keep |= {s for s in committed if s % self.keep_every == 0}
        if committed:
            keep.add(committed[-1])  # never the newest committed step
        retired = []
        for i, s in enumerate(committed):
            if s in keep or s in busy:
                continue
            superseded = self._commit_time(committed[i + 1])
            if superseded is None or now - superseded < self.reader_grace:
                continue  # a reader may have resolved it as the newest step moments ago
            if entries[s].leftovers:  # a stale or running replace of it: its leftovers first
                report = _clean_leftovers(self.step_path(s), older_than=self.grace, storage_options=self._options)
                if not all(x.removed for x in report.leftovers):
                    continue
            self._retire(s)
            retired.append(s)
        for s, e in entries.items():
            if s in busy or s in retired or not (e.leftovers or (e.target and not e.committed)):
                continue
            # spec 10.5: the grace-period rule; for a kept committed step too (a stale replace's leftovers)
            _clean_leftovers(self.step_path(s), older_than=self.grace, storage_options=self._options)
        for loc in self._retired():
            _remove(loc)  # interrupted retirements: no reader can reach them
        return retired

    def _recover(self, step: int, e: _Entry) -> bool:
        """Commit a complete copy of an uncommitted step left at a staging name
        (spec 10.5: a save killed after writing its root ``zarr.json`` and
        before the rename, or between the two renames of the fallback), once
        it is older than ``grace``: it is a whole checkpoint, and may be the
        only copy. The copy not named ``-old`` (the newer one) wins."""
        staged = [x for x in e.leftovers if not commit.is_replaced(x)]  # a replaced version is never recovered
        whole = [x for x in staged if has_root(x) and _valid_root(x)]
        if not whole or any(too_young(age_of(x), self.grace) for x in staged):
            return False
        best = sorted(whole, key=lambda x: (x.name.endswith("-old"), x.name))[0]
        return commit.promote(best, self._loc(step))

    def _busy(self) -> set[int]:
        """Steps this manager is saving now (never cleaned up under them)."""
        return {s for s, h in list(self._in_flight.items()) if h is None or not h.done()}

    def _retire(self, step: int) -> None:
        """Delete a committed step so that no reader ever sees part of it:
        locally, rename it out of the way (readers then find no step), then
        delete it, root ``zarr.json`` first; on object stores, delete the root
        ``zarr.json`` first (the step is then uncommitted), then the rest."""
        loc = self._loc(step)
        commit.retire(loc, self._child(f".{loc.name}{RETIRED_INFIX}{commit.new_token()}"))
        self._seen.pop(step, None)

    def _commit_time(self, step: int) -> float | None:
        """When ``step`` was committed (an upper bound), or None if unknown. Local:
        the latest mtime/ctime of its root ``zarr.json`` and directory; other
        stores keep no times: when this manager first saw it committed."""
        loc = self._loc(step)
        backend = backend_for(loc)
        return backend.committed_at(loc) if backend.records_times else self._seen.get(step)

    # ------------------------------------------------------------ listing

    def _names(self) -> set[str]:
        """Names directly under the root (locally: only directories and plain
        files; links and special files are foreign, never ours)."""
        if self._fs:
            _check_root(self.root)
            try:
                with os.scandir(self.root.path) as it:
                    return {e.name for e in it if not e.is_symlink() and (e.is_dir(follow_symlinks=False)
                                                                         or e.is_file(follow_symlinks=False))}
            except FileNotFoundError:
                return set()
            except OSError as e:
                raise commit.os_error(self.root, e, "listing the manager root") from e
        return {k.split("/", 1)[0] for k in kv.list_keys(self.root)}

    def _scan(self) -> dict[int, _Entry]:
        entries: dict[int, _Entry] = {}
        now = time.time()
        for name in sorted(self._names()):
            infix = next((i for i in (commit.STAGING_INFIX, commit.REPLACED_INFIX) if i in name), None)
            if name.startswith(".") and infix is not None:
                step = parse_step_name(name[1 : name.index(infix)])
                if step is not None:
                    e = entries.setdefault(step, _Entry())
                    e.leftovers = (*e.leftovers, self._child(name))
                continue
            step = parse_step_name(name)
            if step is None:
                continue
            e = entries.setdefault(step, _Entry())
            e.target = True
            e.committed = has_root(self._loc(step))
            if e.committed:
                with self._lock:
                    self._seen.setdefault(step, now)
        return entries

    def _retired(self) -> list[location.Location]:
        return [self._child(n) for n in sorted(self._names())
                if n.startswith(".") and RETIRED_INFIX in n and parse_step_name(n[1 : n.index(RETIRED_INFIX)]) is not None]

    list = steps  # defined last: in the class body, `list` then names this method, not the builtin


def _valid_root(loc: location.Location) -> bool:
    """Whether the root zarr.json at ``loc`` parses and validates (spec 9): a
    copy is committed by the retention only then."""
    try:
        read_root(loc)
        return True
    except TensorckptError:
        return False


def _remove(loc: location.Location) -> None:
    """Delete a checkpoint location, its root ``zarr.json`` first, never through a link."""
    commit.remove(loc)


def _check_root(root: location.Location) -> None:
    """A local manager root must be a directory (a link to one is fine: the
    user named it) or not exist yet; anything else is a clear error."""
    try:
        st = os.stat(root.path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise commit.os_error(root, e, "opening the manager root") from e
    if stat.S_ISDIR(st.st_mode):
        if os.path.lexists(os.path.join(root.path, commit.ROOT_KEY)):
            raise TensorckptError(
                f"{root}: this is a checkpoint, not a CheckpointManager root (it holds a root zarr.json): "
                "open it with tensorckpt.open / `tensorckpt inspect`, or give the manager another directory")
        return
    kind = "a file" if stat.S_ISREG(st.st_mode) else "a special file (FIFO, socket or device)"
    raise TensorckptError(f"{root}: the manager root is {kind}, not a directory: give the manager a directory")


def _stored_bytes(loc: location.Location) -> int:
    return sum(size or 0 for _, size in backend_for(loc).sizes(loc, ""))
