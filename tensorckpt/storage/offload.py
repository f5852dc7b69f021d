"""The background writes of an async save in a helper process
(``AsyncSaver(executor="process")``), so that they do not take the training
interpreter's GIL.

An async save's drain in a thread of the training process encodes, checksums
and writes every stored object with a little Python per inner chunk; each of
those steps takes the GIL back from a training loop that holds it most of the
time (many small torch ops), and the loop's steps slow down by x1.3-2.6 on
this project's 2-core VM although the drain's own CPU is small
(benchmarks/README.md, ``bench_background.py``). Here the same work runs in a
helper process:

- **staging** (:class:`Offload.buffers`): the saver's staging buffers are
  carved from one shared-memory arena (a ``memfd``, mapped in both
  processes; no named object to leak in ``/dev/shm``), reused while the
  state's tensors keep their keys, shapes and dtypes (a change makes a new
  arena, the old one is freed); the caller's copy into them is the stall, as
  with the thread executor;
- **writes** (:meth:`Offload.writer`): the save's local chunk writer hands
  every stored object whose elements lie in the arena to the helper: the
  object's path and geometry, and where its elements are in the arena
  (offset, shape, byte strides), as one JSON message over a Unix socket
  (``SOCK_SEQPACKET``; the arena's descriptor passed once with
  ``SCM_RIGHTS``). The helper encodes it with :func:`codec.encode`
  (the same bytes as the in-process writer), writes and fsyncs it on one of
  its ``WRITE_THREADS`` threads and answers with its digest (spec 7.1) or
  its error; anything else (objects of re-gridded chunks assembled in the
  training process, other storage) is written in-process as before;
- everything else of the save (planning, collectives on the background
  group, metadata, the commit protocol, phase stats) stays in the training
  process's background thread, which now mostly waits.

The helper (:mod:`.offload_helper`: its side and the messages) is started
with this interpreter and this copy of tensorckpt, without the package's
``__init__`` (no torch, no TensorStore: ready in ~0.2 s, tens of MiB), in a
session of its own (a Ctrl-C in the terminal reaches only the training
process), when the saver is created; the first write waits until it is ready
(another is started by the next save if it died).
It exits when its socket closes: the saver's ``close()``, or
the training process's exit or death (so it never outlives it writing). If
it dies mid-save (killed, out of memory), that save fails naming it (the
commit never happens: a failed save leaves the previous checkpoint as it
was) and the next save starts a new helper with a new arena. A forked child
of the training process (a data loader worker) closes its copy of the
socket and has no helper.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Collection, Sequence
from concurrent.futures import Future, wait
from typing import Any

import numpy as np
import torch

from ..errors import TensorckptError
from ..format.metadata import TensorEntry
from . import kv
from .arrays import chunk_key
from .direct import BUFFER_BYTES, WRITE_THREADS, LocalObjects, Writer
from .offload_helper import MESSAGE_BYTES

ALIGN = 64  # bytes: every staging buffer in the arena starts on a cache line
SYNC_BATCH = 100  # paths per sync message (each well under the socket's message size)
READY_SECONDS = 300.0  # how long the first write waits for the helper to start

Spec = tuple[str, tuple[int, ...], torch.dtype, bool]  # a staging buffer: key, shape, dtype, pinned (unused here)


class _Arena:
    """One shared-memory block (a memfd mapped here) that staging buffers are carved from."""

    ids = itertools.count()

    def __init__(self, size: int) -> None:
        self.id = next(self.ids)
        self.size = size
        self.fd: int | None = os.memfd_create(f"tensorckpt-staging-{self.id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.memory = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.whole = torch.frombuffer(self.memory, dtype=torch.uint8)
        self.base = self.whole.data_ptr()
        self.sent_to: int | None = None  # the helper generation that has it mapped

    def buffer(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.whole[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def offset_of(self, a: np.ndarray) -> int | None:
        """Where the elements of ``a`` start in the arena, if all of them lie in it."""
        if a.size == 0:
            return None
        lo = a.ctypes.data
        extent = sum((n - 1) * s for n, s in zip(a.shape, a.strides)) + a.itemsize
        if any(s < 0 for s in a.strides) or lo < self.base or lo + extent > self.base + self.size:
            return None
        return lo - self.base

    def close_fd(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


class Offload:
    """A saver's helper process and its shared staging arena (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the socket's sends, the helper's state
        self._arena: _Arena | None = None
        self._layout: list[Spec] = []
        self._buffers: dict[str, torch.Tensor] = {}
        self._helper: _Helper | None = None
        self._generation = 0
        _ALL.add(self)
        self._start()  # now: it inherits the environment and limits of the saver's creation

    # -- staging (the caller's thread)

    def buffers(self, specs: Sequence[Spec]) -> tuple[dict[str, torch.Tensor], int]:
        """Staging buffers for ``specs``, and the bytes newly allocated for
        them (0: the last call's buffers are reused)."""
        specs = list(specs)
        arena = self._arena
        with self._lock:
            h = self._helper
            mapped = arena is not None and arena.sent_to == self._generation and h is not None and h.alive
        if arena is not None and specs == self._layout and (arena.sent_to is None or mapped):
            return self._buffers, 0  # (an arena mapped by a helper that died cannot be sent to the next one)
        self.free()
        offsets, size = [], 0
        for _, shape, dtype, _ in specs:
            offsets.append(size)
            size += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
        if size == 0:
            return {key: torch.empty(shape, dtype=dtype) for key, shape, dtype, _ in specs}, 0
        arena = _Arena(size)
        self._arena, self._layout = arena, specs
        self._buffers = {key: arena.buffer(o, shape, dtype) for (key, shape, dtype, _), o in zip(specs, offsets)}
        return self._buffers, size

    def free(self) -> None:
        """Drop the arena (the helper unmaps it too)."""
        arena, self._arena, self._layout, self._buffers = self._arena, None, [], {}
        if arena is None:
            return
        arena.close_fd()
        with self._lock:
            h = self._helper
            if h is not None and arena.sent_to == self._generation and h.alive:
                h.send({"op": "unmap", "arena": arena.id})

    # -- writes (the save's background thread)

    def writer(self, inner: Writer) -> Writer | HelperWriter:
        """The save's chunk writer: ``inner`` (the in-process one) for what
        the helper cannot write, the helper for the rest."""
        if not isinstance(inner.objects, LocalObjects) or self._arena is None:
            return inner
        helper = self._ready()
        if helper is None:
            return inner
        return HelperWriter(helper, self._arena, inner, inner.objects.root)

    def _start(self) -> _Helper:
        self._generation += 1
        self._helper = _Helper()
        return self._helper

    def _ready(self) -> _Helper | None:
        """The helper, started again if it died, with the arena mapped; None
        where the arena was made for a helper that is gone (this save writes
        in-process; the next one gets a new arena)."""
        arena = self._arena
        if arena is None:
            return None
        with self._lock:
            helper = self._helper if self._helper is not None and self._helper.alive else self._start()
        helper.wait_ready()
        with self._lock:
            if arena.sent_to is None and arena.fd is not None:
                helper.send({"op": "map", "arena": arena.id, "size": arena.size}, arena.fd)
                arena.sent_to = self._generation
                arena.close_fd()
            if arena.sent_to != self._generation:
                return None
        return helper

    def close(self) -> None:
        """Stop the helper and free the arena (idempotent)."""
        self.free()
        with self._lock:
            h, self._helper = self._helper, None
        if h is not None:
            h.stop()
        _ALL.discard(self)

    def _forked(self) -> None:  # in a forked child: the parent's helper is not this process's
        h, self._helper = self._helper, None
        if h is not None:
            h.forget()
        self._arena, self._layout, self._buffers = None, [], {}

    @property
    def pid(self) -> int | None:
        """The helper process's pid (None: not running)."""
        h = self._helper
        return h.proc.pid if h is not None and h.alive else None


class _Helper:
    """The training process's end of one helper process."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this tensorckpt, not another
        code = ("import sys, types; m = types.ModuleType('tensorckpt'); "  # its __init__ (torch, TensorStore) not run
                f"m.__path__ = [{package!r}]; sys.modules['tensorckpt'] = m; "
                "from tensorckpt.storage.offload_helper import serve; "
                f"serve({theirs.fileno()}, {WRITE_THREADS}, {BUFFER_BYTES})")
        try:
            self.proc = subprocess.Popen(  # noqa: S603 - this interpreter, a fixed command
                [sys.executable, "-c", code], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            theirs.close()
        self.sock = ours
        self.alive = True
        self._ready = threading.Event()
        self._send_lock = threading.Lock()
        self._pending: dict[int, tuple[Future[str], str]] = {}
        self._plock = threading.Lock()
        self._ids = itertools.count()
        self._ended: str | None = None  # why the helper is gone
        threading.Thread(target=self._receive, name="tensorckpt-offload-replies", daemon=True).start()

    def wait_ready(self) -> None:
        if not self._ready.wait(READY_SECONDS) or not self.alive:
            raise TensorckptError(f"the async save's helper process (pid {self.proc.pid}) did not start: "
                                  f"{self._ended or f'no answer in {READY_SECONDS:.0f} s'}")

    def send(self, message: dict[str, Any], fd: int | None = None) -> None:
        data = json.dumps(message).encode()
        with self._send_lock:
            if fd is None:
                self.sock.send(data)
            else:
                socket.send_fds(self.sock, [data], [fd])

    def submit(self, message: dict[str, Any], path: str) -> Future[str]:
        future: Future[str] = Future()
        with self._plock:
            job = next(self._ids)
            self._pending[job] = (future, path)
        if not self.alive:
            self._fail_pending()
            return future
        try:
            self.send({"op": "write", **message, "id": job})
        except OSError:
            self._fail_pending()
        return future

    def _receive(self) -> None:
        try:
            while True:
                data = self.sock.recv(MESSAGE_BYTES)
                if not data:
                    break
                reply = json.loads(data)
                if reply.get("ready"):
                    self._ready.set()
                    continue
                with self._plock:
                    future, path = self._pending.pop(reply["id"])
                if "digest" in reply:
                    future.set_result(reply["digest"])
                elif reply.get("errno") is not None:
                    future.set_exception(OSError(reply["errno"], reply["error"], path))
                else:
                    future.set_exception(TensorckptError(f"the async save's helper process failed writing {path}: "
                                                         f"{reply['error']}"))
        except (OSError, ValueError, KeyError, TypeError):  # gone, or a reply that makes no sense: stop it
            pass
        self.alive = False
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._ended = self._ended or (f"it exited with code {code}" if code >= 0 else
                                      f"it was killed by signal {-code}")
        self._ready.set()
        self._fail_pending()

    def _fail_pending(self) -> None:
        with self._plock:
            failed, self._pending = list(self._pending.values()), {}
        for future, path in failed:
            future.set_exception(TensorckptError(
                f"the async save's helper process (pid {self.proc.pid}) ended before writing {path} "
                f"({self._ended or 'its socket closed'}); the save is not committed, the next one starts a new helper"))

    def stop(self) -> None:
        """Close the socket: the helper exits (it has nothing in flight: the saver waited for its save)."""
        self._ended = self._ended or "the saver was closed"
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def forget(self) -> None:
        self.alive = False
        self.sock.close()


class HelperWriter:
    """A save's chunk writer (:class:`.direct.Writer`'s ``write`` / ``close``)
    that sends objects whose elements lie in the arena to the helper."""

    def __init__(self, helper: _Helper, arena: _Arena, inner: Writer, root: str) -> None:
        self.helper, self.arena, self.inner, self.root = helper, arena, inner, root
        self._started: list[Future[str]] = []
        self.offloaded = 0  # bytes of tensor data sent to the helper

    def write(self, key: str, entry: TensorEntry, pos: tuple[int, ...], data: np.ndarray) -> Future[str]:
        offset = self.arena.offset_of(data)
        if offset is None:
            return self.inner.write(key, entry, pos, data)
        rel = f"{key}/{chunk_key(pos)}"
        future = self.helper.submit({
            "root": self.root, "rel": rel, "dtype": wire_dtype(entry.dtype_info.numpy), "shape": list(entry.shape),
            "chunk": list(entry.chunk_shape), "inner": list(entry.inner_chunk_shape), "arena": self.arena.id,
            "offset": offset, "elements": list(data.shape), "strides": list(data.strides),
        }, os.path.join(self.root, rel))
        self._started.append(future)
        self.offloaded += data.nbytes
        return future

    def close(self) -> None:
        wait(self._started)
        self._started = []
        self.inner.close()

    def sync(self, keys: Collection[str], fsynced: Collection[str]) -> None:
        """Make the objects ``keys`` written under the root durable, as
        :func:`.kv.sync_files` does, the fsyncs done by the helper (on its
        threads, in a few batches: their Python is not this process's)."""
        paths = kv.sync_paths(self.root, keys, fsynced)
        if len(paths) > kv.SYNCFS_ABOVE:
            kv.sync_tree(self.root)  # one syncfs, here, as sync_files does past that count
            return
        batch = max(1, min(SYNC_BATCH, -(-len(paths) // WRITE_THREADS)))
        futures = [self.helper.submit({"op": "sync", "paths": paths[i:i + batch]}, self.root)
                   for i in range(0, len(paths), batch)]
        wait(futures)
        for f in futures:
            f.result()  # raises the first failure


def wire_dtype(d: np.dtype) -> str:
    """The numpy dtype the helper copies ``d``'s elements as: ``d`` itself,
    or an unsigned integer of its size for the ml_dtypes types (bfloat16,
    float8), which the helper does not import: encoding only copies bytes."""
    return d.str if d.kind in "biufc" else f"<u{d.itemsize}"


_ALL: weakref.WeakSet[Offload] = weakref.WeakSet()


def _after_fork() -> None:
    for o in list(_ALL):
        o._forked()


os.register_at_fork(after_in_child=_after_fork)
