"""Asynchronous save: the caller is blocked only while its tensors are copied
into host memory; planning, encoding, checksums, writes and the commit run in
a background thread.

    caller thread     adapters -> plain state; copy every tensor this rank
                      holds into the staging pool (reused buffers; pinned,
                      non-blocking device-to-host copies for CUDA tensors);
                      return a SaveHandle
    background        engine.save.run over a process group of its own (so its
                      collectives never interleave with training's), exactly
                      as a synchronous save of the staged copies
    helper process    with ``executor="process"`` (the default on Linux): the
                      encoding, checksums, writes and fsyncs of the stored
                      objects of local checkpoints (storage/offload.py:
                      shared-memory staging, so a GIL-bound training loop
                      is not slowed by them)

An :class:`AsyncSaver` holds everything one process group's async saves
share: the staging pool (buffers reused while a key's shape and dtype stay
the same), the background group, the save in flight and the plan cache of
its saves (engine/plan_cache.py). :func:`async_save` uses one default saver
per process group, created on its first call for that group and kept for
the life of the process; a user may create savers of their own.

Lifetime of a saver: creating one is local (no collective); its first save
over a group spanning every process creates the background gloo group (every
process takes part, ``new_group``'s rule). One save per saver is in flight at
a time: the next call waits for it (``on_busy="wait"``, bounded host memory:
one staged copy) or raises (``on_busy="raise"``); a failure nobody looked at
is raised by the next call. ``close()`` (or leaving a ``with`` block) finishes
the save in flight, raises its failure if nobody looked at it (printed to
stderr when a ``with`` block exits on an exception), and frees the staging
buffers and the plan cache; the background group stays with torch.distributed
(``destroy_process_group`` is the caller's). At interpreter exit, the saves
in flight of savers not closed (the default ones included) whose outcome
nobody is looking at are finished; such a failure is printed to stderr.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from ..adapters import registry
from ..adapters.sharded import ShardedTensor, saved_part
from ..adapters.state import flatten, unflatten
from ..errors import TensorckptError
from ..storage import location
from ..storage.offload import Offload, Spec
from .group import Group, group_key
from .plan_cache import PlanCache
from .replicas import is_plain
from .save import SaveOptions, SaveStats, check_tensor, run

ON_BUSY = ("wait", "raise")
EXECUTORS = ("thread", "process")
DEFAULT_EXECUTOR = "process" if hasattr(os, "memfd_create") else "thread"  # Linux: a helper process (offload.py)


class SaveHandle:
    """The future of an :func:`async_save` (or :meth:`AsyncSaver.save`).

    ``wait(timeout=None)`` blocks until the checkpoint is committed and
    raises the save's error if it failed (``TimeoutError`` if ``timeout``
    seconds pass first); ``done()``; ``exception(timeout=None)``;
    ``add_done_callback(fn)`` calls ``fn(handle)`` once the save ends, either
    way. ``stats`` is this rank's :class:`SaveStats` (``stall_seconds``,
    ``durable_seconds``, per-phase ``seconds``). ``path`` is where it saves.

    ``future`` is the :class:`concurrent.futures.Future` behind the handle
    (result None, or the save's exception), for ``concurrent.futures.wait``
    and ``as_completed``. Waiting on it does not count as looking at the
    outcome: a failure seen only through ``future`` is still raised by the
    saver's next call and printed at exit; the handle's own methods (and
    callbacks) count.
    """

    def __init__(self, path: str, stats: SaveStats, on_durable: Callable[[SaveHandle], None] | None) -> None:
        self.path = path
        self.stats = stats
        self._on_durable = on_durable
        self._future: Future[None] = Future()
        self._future.set_running_or_notify_cancel()  # running from the start: it cannot be cancelled
        self._observed = False  # someone saw the outcome (wait/exception/callback)

    @property
    def future(self) -> Future[None]:
        return self._future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        error = self.exception(timeout)
        if error is not None:
            raise error

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            error = self._future.exception(timeout)
        except TimeoutError:
            raise TimeoutError(f"the async save to {self.path} is still running after {timeout} s") from None
        self._observed = True
        return error

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        self._observed = True  # fn sees the outcome
        self._future.add_done_callback(lambda _: fn(self))

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._future.exception() else "committed")
        return f"SaveHandle({self.path!r}, {state})"

    def _finish(self, error: BaseException | None) -> None:
        if error is None and self._on_durable is not None:
            try:
                self._on_durable(self)
            except Exception as e:  # noqa: BLE001 - a failing callback must not hide that the save is durable
                print(f"tensorckpt: on_durable callback for {self.path} raised {e!r}", file=sys.stderr)
        if error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(error)

    def _unobserved_error(self) -> BaseException | None:
        """Wait for the end; the save's error if nobody looked at it (then it
        counts as seen)."""
        seen = self._observed
        error = self._future.exception()
        if error is None or seen:
            return None
        self._observed = True
        return error


class AsyncSaver:
    """Asynchronous saves over one process group (module docstring: what it
    holds, its lifetime).

        with tensorckpt.AsyncSaver() as saver:       # process_group=None: the default group
            for step in ...:
                saver.save(state, f"ckpt/step-{step}")  # like tensorckpt.async_save
        # leaving the block: the last save is finished, its buffers freed

    ``background_group``: as for :func:`async_save`, a gloo group over the
    same ranks, needed over a subgroup. ``executor``: where the stored
    objects are encoded and written, ``"thread"`` (a background thread of
    this process) or ``"process"`` (a helper process this saver starts now
    and stops on ``close()``, reading staging
    buffers in shared memory, so a Python-bound training loop keeps its
    speed; storage/offload.py);
    None: ``TENSORCKPT_ASYNC_EXECUTOR`` if set, else ``"process"`` where
    the OS has ``memfd_create`` (Linux), ``"thread"`` elsewhere. CUDA
    tensors are staged in pinned memory and written in-process either way. ``save`` takes the options of
    :func:`async_save` (``overwrite``, ``on_busy``, ``on_durable``, save
    options) and returns its :class:`SaveHandle`; ``wait(timeout=None)``
    waits for the save in flight and raises its error; ``close()`` finishes
    and releases (a closed saver refuses to save).
    """

    def __init__(self, process_group: Any = None, background_group: Any = None, *, executor: str | None = None) -> None:
        executor = _executor("AsyncSaver", executor)
        self.process_group = process_group
        self.executor = executor
        self._g = Group(process_group)
        self._bg: Group | None = None  # created by the first save (a collective)
        if background_group is not None and self._g.distributed:  # checked now, not at the first save
            self._bg = _background_group(self._g, background_group)
        self._pool: dict[str, torch.Tensor] = {}  # staging buffers by key (the thread executor's)
        self._offload = Offload() if executor == "process" else None  # the helper and its shared staging
        self._plans = PlanCache()  # the plan cache of saves over the background group
        self._handle: SaveHandle | None = None  # the last save
        self._closed = False
        _OPEN.add(self)

    def save(self, state: Mapping, path: Any, *, overwrite: bool = False, on_busy: str = "wait",
             on_durable: Callable[[SaveHandle], None] | None = None, storage_options: Mapping[str, Any] | None = None,
             **options: Any) -> SaveHandle:
        """Save ``state`` like :func:`async_save` (a collective over this
        saver's group: every rank calls it). ``storage_options`` belong to
        each call's path, as in :func:`tensorckpt.save`."""
        loc = location.parse(path, storage_options)
        return self._save(state, loc, overwrite, on_busy, on_durable, None, options)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the save in flight, if any; raise its error if it failed."""
        if self._handle is not None:
            self._handle.wait(timeout)

    def close(self) -> None:
        """Finish the save in flight; raise its failure if nobody looked at
        it; free the staging buffers and forget the plan cache. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        if _DEFAULT.get((group_key(self.process_group), self.executor)) is self:
            del _DEFAULT[group_key(self.process_group), self.executor]
        handle, self._handle = self._handle, None
        try:
            error = handle._unobserved_error() if handle is not None else None  # waits for it
        finally:
            self._pool.clear()
            self._plans.clear()
            if self._offload is not None:
                self._offload.close()
        if handle is not None and error is not None:
            raise TensorckptError(f"the async save to {handle.path} failed: {error}") from error

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is on its way out: do not replace it
            self.close()
        except TensorckptError as e:
            print(f"tensorckpt: {e}", file=sys.stderr)

    def __repr__(self) -> str:
        state = "closed" if self._closed else repr(self._handle)
        return f"AsyncSaver(process_group={self.process_group!r}, executor={self.executor!r}, {state})"

    def _save(self, state: Mapping, path: Any, overwrite: bool, on_busy: str,
              on_durable: Callable[[SaveHandle], None] | None, background_group: Any,
              options: Mapping[str, Any]) -> SaveHandle:
        t_call = time.perf_counter()
        opts = _check_call(on_busy, options)
        if self._closed:
            raise TensorckptError(f"{self!r} is closed; create another AsyncSaver")
        loc = location.parse(path)
        g = self._g
        previous = self._handle
        if previous is not None:
            if not previous.done() and on_busy == "raise":
                raise TensorckptError(
                    f"an async save to {previous.path} is still in flight; wait on its handle first, "
                    "or pass on_busy='wait'"
                )
            error = previous._unobserved_error()  # backpressure: waits for it
            if error is not None:
                raise TensorckptError(f"the previous async save to {previous.path} failed: {error}") from error
        bg = self._background(background_group)
        plans = self._plans

        stats = SaveStats()
        staged, failed = None, None
        t0 = time.perf_counter()
        try:
            plain = registry.for_save(state, registry.Context(state, g.rank, g.size))
            staged = _stage(plain, self._buffers, stats, g.distributed)
        except Exception as e:
            if not g.distributed:
                raise
            failed = e  # the others learn it through the save's first collective
        stats.seconds["stage"] = time.perf_counter() - t0
        handle = SaveHandle(str(loc), stats, on_durable)
        self._handle = handle

        def work() -> None:
            error = None
            try:
                run(staged or {}, loc, bg, overwrite, opts, stats, failed, plans, self._offload)
            except BaseException as e:  # noqa: BLE001 - surfaced on the handle
                error = e
            stats.durable_seconds = time.perf_counter() - t_call
            handle._finish(error)

        threading.Thread(target=work, name=f"tensorckpt-async-save {loc}", daemon=True).start()
        stats.stall_seconds = time.perf_counter() - t_call
        if failed is not None:  # raise what every other rank's handle raises: the error naming every failing rank
            error = handle.exception()
            if error is not None:
                raise error from failed
            raise failed
        return handle

    def _buffers(self, specs: list[Spec]) -> tuple[dict[str, torch.Tensor], int]:
        """Staging buffers: pinned host buffers for CUDA tensors (written
        in-process), the helper's shared arena for the rest (``"process"``)."""
        if self._offload is None:
            return _host_buffers(self._pool, specs)
        pinned, bytes_pinned = _host_buffers(self._pool, [s for s in specs if s[3]])
        shared, bytes_shared = self._offload.buffers([s for s in specs if not s[3]])
        return {**pinned, **shared}, bytes_pinned + bytes_shared

    def _background(self, given: Any) -> Group:
        """The group of the background collectives: the one made or given
        before, unless ``given`` is another one (then it replaces it, with a
        plan cache of its own)."""
        if not self._g.distributed:
            return self._g
        if self._bg is None or (given is not None and self._bg.pg is not given):
            self._bg = _background_group(self._g, given)
            self._plans = PlanCache()
        return self._bg


def async_save(
    state: Mapping,
    path: Any,
    *,
    process_group: Any = None,
    overwrite: bool = False,
    on_busy: str = "wait",
    on_durable: Callable[[SaveHandle], None] | None = None,
    background_group: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    executor: str | None = None,
    **options: Any,
) -> SaveHandle:
    """Save ``state`` like :func:`tensorckpt.save`, returning as soon as its
    tensors are copied to host memory; the caller may then change them.

    A collective over ``process_group`` like ``save`` (every rank calls it).
    The background work uses its own process group (gloo), created on the
    first call for each ``process_group``. If a previous async save on the
    same group is still running, this call waits for it (``on_busy="wait"``)
    or raises (``on_busy="raise"``); if it failed and its handle was never
    waited on, this call raises that failure. ``on_durable(handle)`` runs in
    the background once the checkpoint is committed.

    Over a subgroup (``process_group`` not spanning every process), pass
    ``background_group``: a gloo group over the same ranks, created once by
    every process (``torch.distributed.new_group(ranks, backend="gloo")``).
    torch cannot create one for a subgroup without every process taking part.

    ``executor``: ``"thread"`` or ``"process"`` (the objects are encoded
    and written by a helper process: :class:`AsyncSaver`); None:
    ``TENSORCKPT_ASYNC_EXECUTOR`` if set, else ``"process"`` on Linux.

    The work is done by the default :class:`AsyncSaver` of ``process_group``
    and ``executor``, created on the first call and kept until exit.
    """
    _check_call(on_busy, options)
    executor = _executor("async_save", executor)
    key = (group_key(process_group), executor)
    saver = _DEFAULT.get(key)
    if saver is None:
        saver = _DEFAULT[key] = AsyncSaver(process_group, executor=executor)
    loc = location.parse(path, storage_options)
    return saver._save(state, loc, overwrite, on_busy, on_durable, background_group, options)


def _executor(caller: str, given: str | None) -> str:
    """``given``, or ``TENSORCKPT_ASYNC_EXECUTOR``, or :data:`DEFAULT_EXECUTOR`; checked."""
    if given is None:
        env = os.environ.get("TENSORCKPT_ASYNC_EXECUTOR")
        if env and env not in EXECUTORS:
            raise ValueError(f"TENSORCKPT_ASYNC_EXECUTOR must be one of {EXECUTORS}, got {env!r} "
                             f"(unset it for the default, {DEFAULT_EXECUTOR!r})")
        return env or DEFAULT_EXECUTOR
    if given not in EXECUTORS:
        raise ValueError(f"{caller}(executor=...) must be one of {EXECUTORS}, got {given!r}")
    return given


def _check_call(on_busy: str, options: Mapping[str, Any]) -> SaveOptions:
    opts = SaveOptions.of(options)
    if on_busy not in ON_BUSY:
        raise ValueError(f"async_save(on_busy=...) must be one of {ON_BUSY}, got {on_busy!r}")
    return opts


Buffers = Callable[[list[Spec]], tuple[dict[str, torch.Tensor], int]]  # specs -> (buffers by key, bytes allocated)


def _stage(state: Mapping, buffers: Buffers, stats: SaveStats, distributed: bool) -> dict:
    """A copy of ``state`` whose tensors live in staging buffers (of
    ``buffers``: the saver's pool), as ShardedTensors that keep each leaf's
    global shape and box (plain tensors stay plain tensors: the save digests
    them as replicas)."""
    leaves, parts = {}, []
    for key, leaf in flatten(state).items():
        if not leaf.is_tensor:
            leaves[leaf.path] = leaf.value  # flatten validated it and made a copy
            continue
        plain = is_plain(leaf.value)  # stays plain: the save checks that its replicas agree
        t, shape, box = saved_part(key, leaf.value, distributed)  # a meta tensor: an empty box, held by other ranks
        check_tensor(key, t)
        parts.append((key, leaf.path, t.detach(), plain and tuple(t.shape) == shape, shape, box))
    bufs, stats.staging_bytes_allocated = buffers([(key, tuple(t.shape), t.dtype, t.is_cuda) for key, _, t, *_ in parts])
    cuda = False
    for key, path, t, plain, shape, box in parts:
        buf = bufs[key]
        buf.copy_(t, non_blocking=t.is_cuda)
        cuda = cuda or t.is_cuda
        stats.bytes_staged += buf.numel() * buf.element_size()
        leaves[path] = buf if plain else ShardedTensor(buf, shape, box.offset if box.numel else (0,) * len(shape))
    if cuda:
        torch.cuda.synchronize()
    return unflatten(leaves)


def _host_buffers(pool: dict[str, torch.Tensor], specs: list[Spec]) -> tuple[dict[str, torch.Tensor], int]:
    """The thread executor's staging (and CUDA tensors' with either): a
    buffer of ``pool`` per key, reused while its shape and dtype stay the
    same (pinned for CUDA tensors); buffers of keys not in ``specs`` are
    freed. Returns the buffers and the bytes newly allocated."""
    out, allocated = {}, 0
    for key, shape, dtype, pinned in specs:
        buf = pool.get(key)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype:
            buf = pool[key] = torch.empty(shape, dtype=dtype, pin_memory=pinned)
            allocated += buf.numel() * buf.element_size()
        out[key] = buf
    for key in set(pool) - set(out):
        del pool[key]
    return out, allocated


def _background_group(g: Group, given: Any) -> Group:
    """A gloo group over the same ranks, for the background thread's
    collectives, so they never interleave with training's on ``g``. Over the
    whole world it is created here by every process, once per saver (``new_group``'s
    rule); for a subgroup the caller passes one (``background_group``):
    creating it with ``use_local_synchronization`` hangs in torch 2.13 once
    other groups exist."""
    world = dist.get_world_size()
    ranks = dist.get_process_group_ranks(g.pg) if g.pg is not None else list(range(world))
    if given is not None:
        if given is g.pg or dist.get_process_group_ranks(given) != ranks:
            raise TensorckptError(
                f"async_save(background_group=...) must be a group of its own over the same ranks as "
                f"process_group ({ranks}), got one over {dist.get_process_group_ranks(given)}"
                + (" (the same group)" if given is g.pg else "")
            )
        bg = Group(given)
    elif len(ranks) == world:  # every process calls: the plain collective form
        bg = Group(dist.new_group(backend="gloo"))
    else:
        raise TensorckptError(
            f"async_save over a subgroup (ranks {ranks}) needs a process group of its own for its background "
            "collectives: create one once on every process, bg = torch.distributed.new_group(ranks, "
            "backend='gloo'), and pass background_group=bg (or use save())"
        )
    return bg


# The process's savers: async_save's default one per process group and
# executor (keyed by the group object, engine/group.group_key, and the
# executor's name), and every saver not closed yet,
# whose save in flight is finished at exit.
_DEFAULT: dict[object, AsyncSaver] = {}
_OPEN: set[AsyncSaver] = set()


@atexit.register
def _finish_in_flight() -> None:
    """At exit: finish saves in flight; report failures nobody looked at."""
    for saver in list(_OPEN):
        handle = saver._handle
        if handle is None or handle._observed:  # its holder waits for it
            continue
        error = handle._unobserved_error()
        if error is not None:
            print(f"tensorckpt: the async save to {handle.path} failed: {error}", file=sys.stderr)
