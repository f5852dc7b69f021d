"""Run one *phase* of the peer suite on N gloo ranks (worker processes on
127.0.0.1, started from the fork server of tests/dist.py), or in this process
for world 1.

A phase runs every scenario registered for it (``_suite.scenario``) in
registration order, each rank calling ``fn(rank, world, base)``; a scenario
that raises is recorded as an error (class name, message, traceback) and the
phase goes on, so one failing scenario costs one test, not the launch. The
process group gets a short timeout (``PG_TIMEOUT``) so that a rank left
waiting by a peer that raised fails instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
PG_TIMEOUT = float(os.environ.get("TENSORCKPT_PEER_PG_TIMEOUT", "60"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, phase: str, base: str, queue) -> None:
    if _HERE not in sys.path:
        sys.path.insert(0, _HERE)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        import logging
        import warnings

        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        for text in ("DTensor random operators", "FSDP2-wrapped module", "Please use DTensor instead"):
            warnings.filterwarnings("ignore", message=text)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT),
        )
        try:
            import _suite

            queue.put((rank, True, _suite.run_phase(phase, rank, world, base)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def run(world: int, phase: str, base: str, timeout: float = 300.0) -> list[dict]:
    """Each rank's ``{scenario: result}`` for ``phase``, by rank."""
    if world == 1:
        import _suite

        return [_suite.run_phase(phase, 0, 1, base)]
    import dist  # tests/dist.py (tests/ is on sys.path: tests/conftest.py)

    ctx = dist.context()
    queue = ctx.Queue()
    port = _free_port()
    procs = [dist.process(ctx, _worker, (r, world, port, phase, base, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    try:
        for _ in range(world):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"phase {phase!r}: rank {rank} of {world} failed outside any scenario:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
