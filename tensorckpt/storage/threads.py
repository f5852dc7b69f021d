"""Thread pools lent for one save's or one load's work and kept afterwards,
so that a save does not start and join its threads every time (a small save
started and joined about sixteen, most of its CPU time: benchmarks/README.md,
``bench_durable.py``). A borrowed pool is the borrower's alone until it is given
back (no save queues behind another's work); given back, its threads wait
idle for the next borrower of the same kind. A forked child starts with no
pools (its parent's threads do not exist there). Used by
:func:`.kv.sync_files` and :class:`.direct.Writer` / :class:`.direct.Pool`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

KEPT = 4  # idle pools kept per kind (more at once: concurrent saves; those past it are shut down)

_idle: dict[tuple[str, int], list[ThreadPoolExecutor]] = {}
_lock = threading.Lock()


def _forget() -> None:  # in a forked child: the parent's pools have no threads here
    global _lock
    _idle.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget)


def borrow(name: str, threads: int) -> ThreadPoolExecutor:
    """A pool of ``threads`` threads named ``tensorckpt-<name>``, this caller's until :func:`give_back`."""
    with _lock:
        free = _idle.get((name, threads))
        if free:
            return free.pop()
    return ThreadPoolExecutor(threads, thread_name_prefix=f"tensorckpt-{name}")


def give_back(pool: ThreadPoolExecutor, name: str, threads: int) -> None:
    """Return a pool from :func:`borrow` once all the work the borrower gave it is done."""
    with _lock:
        free = _idle.setdefault((name, threads), [])
        if len(free) < KEPT:
            free.append(pool)
            return
    pool.shutdown(wait=False)


@contextmanager
def borrowed(name: str, threads: int) -> Iterator[ThreadPoolExecutor]:
    """:func:`borrow` for a ``with`` block whose work is done by its end."""
    pool = borrow(name, threads)
    try:
        yield pool
    finally:
        give_back(pool, name, threads)
