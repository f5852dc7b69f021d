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

One save per process group is in flight at a time: the next call waits for
it (``on_busy="wait"``, bounded host memory: one staged copy) or raises
(``on_busy="raise"``). Staging buffers are reused across saves while a
key's shape and dtype stay the same. At interpreter exit, saves in flight
are finished; a failure nobody looked at is printed to stderr.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from ..adapters import registry
from ..adapters.sharded import ShardedTensor, saved_part
from ..adapters.state import flatten, unflatten
from ..errors import TensorckptError
from ..storage import location
from .group import Group
from .replicas import is_plain
from .save import SaveOptions, SaveStats, check_tensor, run

ON_BUSY = ("wait", "raise")


class SaveHandle:
    """The future of an :func:`async_save`.

    ``wait(timeout=None)`` blocks until the checkpoint is committed and
    raises the save's error if it failed (``TimeoutError`` if ``timeout``
    seconds pass first); ``done()``; ``exception(timeout=None)``;
    ``add_done_callback(fn)`` calls ``fn(handle)`` once the save ends, either
    way. ``stats`` is this rank's :class:`SaveStats` (``stall_seconds``,
    ``durable_seconds``, per-phase ``seconds``). ``path`` is where it saves.
    """

    def __init__(self, path: str, stats: SaveStats, on_durable: Callable | None) -> None:
        self.path = path
        self.stats = stats
        self._on_durable = on_durable
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._observed = False  # someone saw the outcome (wait/exception/callback)
        self._callbacks: list[Callable] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        error = self.exception(timeout)
        if error is not None:
            raise error

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"the async save to {self.path} is still running after {timeout} s")
        self._observed = True
        return self._error

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        self._observed = True  # fn sees the outcome
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "committed")
        return f"SaveHandle({self.path!r}, {state})"

    def _finish(self, error: BaseException | None) -> None:
        if error is None and self._on_durable is not None:
            try:
                self._on_durable(self)
            except Exception as e:  # a failing callback must not hide that the save is durable
                print(f"tensorckpt: on_durable callback for {self.path} raised {e!r}", file=sys.stderr)
        self._error = error
        with self._lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)


# Per process group: the save in flight, the staging pool, the background group.
_IN_FLIGHT: dict[object, SaveHandle] = {}
_POOLS: dict[object, dict[str, torch.Tensor]] = {}
_GROUPS: dict[object, Group] = {}


def async_save(
    state: Mapping,
    path,
    *,
    process_group=None,
    overwrite: bool = False,
    on_busy: str = "wait",
    on_durable: Callable[[SaveHandle], None] | None = None,
    background_group=None,
    **options,
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
    """
    t_call = time.perf_counter()
    opts = SaveOptions.of(options)
    if on_busy not in ON_BUSY:
        raise ValueError(f"async_save(on_busy=...) must be one of {ON_BUSY}, got {on_busy!r}")
    loc = location.parse(path)
    g = Group(process_group)
    slot = _slot(process_group)
    previous = _IN_FLIGHT.get(slot)
    if previous is not None:
        if not previous.done() and on_busy == "raise":
            raise TensorckptError(
                f"an async save to {previous.path} is still in flight; wait on its handle first, "
                "or pass on_busy='wait'"
            )
        seen = previous._observed
        previous._done.wait()  # backpressure
        if previous._error is not None and not seen:
            previous._observed = True
            raise TensorckptError(f"the previous async save to {previous.path} failed: {previous._error}") from previous._error
    bg = _background_group(slot, g, background_group)

    stats = SaveStats()
    staged, failed = None, None
    t0 = time.perf_counter()
    try:
        plain = registry.for_save(state, registry.Context(state, g.rank, g.size))
        staged = _stage(plain, _POOLS.setdefault(slot, {}), stats, g.distributed)
    except Exception as e:
        if not g.distributed:
            raise
        failed = e  # the others learn it through the save's first collective
    stats.seconds["stage"] = time.perf_counter() - t0
    handle = SaveHandle(str(loc), stats, on_durable)
    _IN_FLIGHT[slot] = handle

    def work() -> None:
        error = None
        try:
            run(staged or {}, loc, bg, overwrite, opts, stats, failed)
        except BaseException as e:  # noqa: BLE001 - surfaced on the handle
            error = e
        stats.durable_seconds = time.perf_counter() - t_call
        handle._finish(error)

    threading.Thread(target=work, name=f"tensorckpt-async-save {loc}", daemon=True).start()
    stats.stall_seconds = time.perf_counter() - t_call
    if failed is not None:  # raise what every other rank's handle raises: the error naming every failing rank
        handle._observed = True
        handle._done.wait()
        if handle._error is not None:
            raise handle._error from failed
        raise failed
    return handle


def _stage(state: Mapping, pool: dict[str, torch.Tensor], stats: SaveStats, distributed: bool) -> dict:
    """A copy of ``state`` whose tensors live in the pool's host buffers, as
    ShardedTensors that keep each leaf's global shape and box (plain tensors
    stay plain tensors: the save digests them as replicas)."""
    leaves, used, cuda = {}, set(), False
    for key, leaf in flatten(state).items():
        if not leaf.is_tensor:
            leaves[leaf.path] = leaf.value  # flatten validated it and made a copy
            continue
        plain = is_plain(leaf.value)  # stays plain: the save checks that its replicas agree
        t, shape, box = saved_part(key, leaf.value, distributed)  # a meta tensor: an empty box, held by other ranks
        check_tensor(key, t)
        plain = plain and tuple(t.shape) == shape
        t = t.detach()
        buf = pool.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            pool[key] = buf
            stats.staging_bytes_allocated += buf.numel() * buf.element_size()
        buf.copy_(t, non_blocking=t.is_cuda)
        cuda = cuda or t.is_cuda
        used.add(key)
        stats.bytes_staged += buf.numel() * buf.element_size()
        leaves[leaf.path] = buf if plain else ShardedTensor(buf, shape, box.offset if box.numel else (0,) * len(shape))
    for key in set(pool) - used:  # tensors gone from the state: free their buffers
        del pool[key]
    if cuda:
        torch.cuda.synchronize()
    return unflatten(leaves)


def _slot(process_group) -> object:
    return process_group if process_group is not None else "default"


def _background_group(slot, g: Group, given) -> Group:
    """A gloo group over the same ranks, for the background thread's
    collectives, so they never interleave with training's on ``g``. Over the
    whole world it is created here, once, by every process (``new_group``'s
    rule); for a subgroup the caller passes one (``background_group``):
    creating it with ``use_local_synchronization`` hangs in torch 2.13 once
    other groups exist."""
    if not g.distributed:
        return g
    bg = _GROUPS.get(slot)
    if bg is not None and (given is None or bg.pg is given):
        return bg
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
    _GROUPS[slot] = bg
    return bg


@atexit.register
def _finish_in_flight() -> None:
    """At exit: finish saves in flight; report failures nobody looked at."""
    for handle in list(_IN_FLIGHT.values()):
        if not handle._observed:
            handle._done.wait()
            if handle._error is not None:
                print(f"tensorckpt: the async save to {handle.path} failed: {handle._error}", file=sys.stderr)
