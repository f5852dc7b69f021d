"""Running the adapter conformance matrix: gloo process groups on 127.0.0.1
(worker processes forked from a fork server), as few as the matrix allows.

A *job* is one adapter saving one case (at the case's save layout) or loading
it (at its load layout). Jobs are grouped by world size; a launch of ``w``
ranks runs every job of world ``w`` that is ready (a load is ready once its
save ran in an earlier launch), loads first. A job that raises is recorded (its
traceback) and the launch goes on. Imports torch and numpy, never tensorckpt.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import adapter_objects as ao

PG_TIMEOUT = float(os.environ.get("TENSORCKPT_CONFORMANCE_PG_TIMEOUT", "60"))
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "numpy"]  # what the fork server imports


@dataclass(frozen=True)
class Case:
    """Save at ``save``, load at ``load``."""

    save: ao.Layout
    load: ao.Layout

    @property
    def name(self) -> str:
        return f"{self.save.name}-to-{self.load.name}"


@dataclass(frozen=True)
class Job:
    adapter: type
    case: Case
    phase: str  # "save" | "load"

    @property
    def world(self) -> int:
        return (self.case.save if self.phase == "save" else self.case.load).world


def checkpoint_path(base: Path, adapter: type, case: Case) -> Path:
    return Path(base) / adapter.__name__ / case.name


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return t.view(torch.int16).numpy().copy() if t.dtype == torch.bfloat16 else t.numpy().copy()


# --------------------------------------------------------------- one job, one rank


def _save_job(adapter, case: Case, rank: int, ref: ao.Reference, path: Path) -> dict:
    objs = ao.objects(case.save, rank, ref, saving=True)
    state = adapter.build(objs)
    before = adapter.consume(state, 3 + 2 * objs.dp_rank)
    ao.seed_all(ao.RNG_SEED + rank)
    adapter.save(state, str(path))
    return {"dp_rank": objs.dp_rank, "consumed": [int(i) for i in before]}


def _load_job(adapter, case: Case, rank: int, ref: ao.Reference, path: Path) -> dict:
    import torch.distributed as dist

    objs = ao.objects(case.load, rank, ref, saving=False)
    state = adapter.build(objs)
    ao.seed_all(7777 + rank)  # junk: a load that restores nothing shows
    adapter.load(state, str(path))
    out: dict = {"draws": ao.draws(), "dp_rank": objs.dp_rank}
    if objs.boxes is not None or objs.model is None or objs.optimizer is None:
        out["boxes"] = {fqn: (_np(local), off) for fqn, (local, _, off) in (objs.boxes or {}).items()}
    else:
        params, moments = {}, {}
        off = objs.stage_offset or 0
        for name, p in objs.model.named_parameters():
            fqn = ao.stage_name(name, off) if objs.stage_offset is not None else name
            params[fqn] = _np(ao.full_tensor(p))
            st = objs.optimizer.state.get(p, {})
            moments[fqn] = {k: _np(ao.full_tensor(st[k])) for k in ("exp_avg", "exp_avg_sq") if k in st}
        if objs.stage_offset is not None or rank == 0:
            out["params"], out["moments"] = params, moments
        out["lrs"] = [float(g["lr"]) for g in objs.optimizer.param_groups]
        out["last_epoch"] = int(getattr(objs.scheduler, "last_epoch", -1))
    out["extra"] = {k: (_np(v) if isinstance(v, torch.Tensor) else v) for k, v in objs.extra.items()}
    out["extra_dtype"] = str(objs.extra["ema"].dtype).removeprefix("torch.")
    out["consumed"] = [int(i) for i in adapter.consume(state, None)]
    if objs.model is not None and objs.optimizer is not None and objs.stage_offset is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out["losses"] = [ao.train_step(objs.model, objs.optimizer, objs.scheduler, ao.STEPS + 1 + i)
                             for i in range(ao.RESUMED_STEPS)]
    if dist.is_initialized():
        dist.barrier()
    return out


def run_jobs(rank: int, jobs: list[Job], base: str, ref: ao.Reference) -> dict:
    """Every job on this rank, in order; each one's result or traceback, and timings."""
    import time

    results: dict = {}
    timing = []
    adapters: dict[type, object] = {}
    for job in jobs:
        adapter = adapters.setdefault(job.adapter, job.adapter())
        path = checkpoint_path(Path(base), job.adapter, job.case)
        fn = _save_job if job.phase == "save" else _load_job
        t0 = time.perf_counter()
        try:
            results[(job.adapter.__name__, job.case.name, job.phase)] = ("ok", fn(adapter, job.case, rank, ref, path))
        except Exception:  # noqa: BLE001 - recorded: the job's tests fail, the launch goes on
            results[(job.adapter.__name__, job.case.name, job.phase)] = ("error", traceback.format_exc())
        timing.append((f"{job.adapter.__name__} {job.case.name} {job.phase}", round(time.perf_counter() - t0, 2)))
    results["timing"] = timing
    return results


def _in_process(jobs: list[Job], base: str, ref: ao.Reference) -> dict:
    """World 1 without a process group, in this process (its generators restored after)."""
    import random

    keep = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return run_jobs(0, jobs, base, ref)
    finally:
        torch.set_rng_state(keep[0])
        np.random.set_state(keep[1])
        random.setstate(keep[2])


def _with_environ(env: dict[str, str], *args) -> None:
    os.environ.clear()
    os.environ.update(env)
    _worker(*args)


def _worker(rank: int, world: int, port: int, jobs: list[Job], base: str, ref: ao.Reference, queue) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results: dict = {}
    try:
        import logging

        import torch.distributed as dist

        torch.set_num_threads(1)
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT))
        try:
            results = run_jobs(rank, jobs, base, ref)
            queue.put((rank, True, results))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - sent to the parent, which raises it
        queue.put((rank, False, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, jobs: list[Job], base: Path, ref: ao.Reference, timeout: float = 300.0) -> list[dict]:
    """Run ``jobs`` on ``world`` spawned gloo ranks (world 1 of plain layouts: in
    this process, without a process group); each rank's results."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if world == 1 and all(j.case.save.kind == "plain" if j.phase == "save" else j.case.load.kind == "plain" for j in jobs) \
            and not dist.is_initialized():
        return [_in_process(jobs, str(base), ref)]

    ctx = mp.get_context("forkserver")  # workers fork from a server that imported torch once (not ~4 s each)
    ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.Queue()
    port = _free_port()
    env = dict(os.environ)  # a forked worker does not get this process's environment by itself
    procs = [ctx.Process(target=_with_environ, args=(env, r, world, port, jobs, str(base), ref, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, dict] = {}
    try:
        for _ in range(world):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"conformance launch of {world} ranks: rank {rank} failed outside any job:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]


def schedule(plan_in: list[tuple[type, list[Case]]]) -> list[tuple[int, list[Job]]]:
    """The launches for ``[(adapter, its cases)]``: (world, jobs), in order. The
    shortest sequence of world sizes that runs every job (a launch runs all the
    jobs of its world that are ready: every save, and each load whose save ran
    in an earlier launch), found by breadth-first search."""
    jobs = [Job(a, c, ph) for a, cases in plan_in for c in cases for ph in ("save", "load")]
    worlds = sorted({j.world for j in jobs}, reverse=True)

    def step(done: frozenset, w: int) -> frozenset:
        saved = {(j.adapter, j.case) for j in done if j.phase == "save"}
        return done | {j for j in jobs if j.world == w and (j.phase == "save" or (j.adapter, j.case) in saved)}

    frontier: list[tuple[frozenset, tuple[int, ...]]] = [(frozenset(), ())]
    seen: set[frozenset] = {frozenset()}
    while frontier:
        nxt = []
        for done, seq in frontier:
            if len(done) == len(jobs):
                out: list[tuple[int, list[Job]]] = []
                d: frozenset = frozenset()
                for w in seq:
                    d2 = step(d, w)
                    out.append((w, sorted(d2 - d, key=lambda j: j.phase != "load")))
                    d = d2
                return out
            for w in worlds:
                d2 = step(done, w)
                if d2 not in seen:
                    seen.add(d2)
                    nxt.append((d2, seq + (w,)))
        frontier = nxt
    return []


def run(plan_in: list[tuple[type, list[Case]]], base: Path) -> dict:
    """Run each adapter over its cases: ``{(adapter name, case name, phase):
    [("ok", result) | ("error", traceback)] by rank}``."""
    import time

    results: dict = {}
    timings: list = []
    ref = ao.reference()
    run.timings = timings  # type: ignore[attr-defined]
    for world, jobs in schedule(plan_in):
        t0 = time.perf_counter()
        launched = launch(world, jobs, base, ref)
        timings.append((world, round(time.perf_counter() - t0, 1), launched[0].pop("timing")))
        for rank, res in enumerate(launched):
            res.pop("timing", None)
            for key, value in res.items():
                results.setdefault(key, [None] * world)[rank] = value
    return results
