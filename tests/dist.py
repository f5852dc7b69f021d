"""Run a function on N gloo ranks on 127.0.0.1 (worker processes), for tests.

``run(world, fn, *args)`` starts ``world`` processes, each of which initializes
torch.distributed (gloo), calls ``fn(rank, world, *args)`` and sends back its
return value; the parent gets the list of return values by rank, or the first
worker traceback as an exception. ``fn`` must be importable (module level).

Workers start from a fork server (:func:`context`) that imported torch,
torch.distributed and tensorckpt once, so a worker costs a fork, not the ~4 s
of CPU of a fresh interpreter's imports (the suite starts a few hundred).
Each worker is a fresh fork of that server: no state of the parent or of
another worker reaches it, as with the ``spawn`` start method, and
:func:`process` hands it the parent's environment as it is at the start
(which ``spawn`` did by itself; a fork server has its own). The other
launchers of the suite (tests/peer/_launch.py, conformance/adapter_run.py,
the racing processes of test_s3.py and test_never_lose.py) start theirs the
same way.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# Imported once by the fork server: what nearly every worker needs (a module that fails to import is skipped).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "numpy", "tensorstore", "tensorckpt",
           "transformers.models.llama.modeling_llama"]  # the peer suite's and test_hf_load_dist's Llama: ~2.5 s a worker


def context() -> Any:
    """The multiprocessing context workers start from (a fork server with :data:`PRELOAD` imported)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _with_environ(environ: dict[str, str], target: Callable[..., object], args: tuple) -> object:
    os.environ.clear()
    os.environ.update(environ)
    return target(*args)


def process(ctx: Any, target: Callable[..., object], args: tuple = (), daemon: bool | None = None) -> Any:
    """``ctx.Process(target=target, args=args)`` that runs under this process's current environment."""
    return ctx.Process(target=_with_environ, args=(dict(os.environ), target, args), daemon=daemon)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable[..., object], args: tuple, queue: Any) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            queue.put((rank, True, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def run(world: int, fn: Callable[..., object], *args: object, timeout: float = 240.0) -> list:
    ctx = context()
    queue = ctx.Queue()
    port = _free_port()
    procs = [process(ctx, _worker, (r, world, port, fn, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} of {world} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
