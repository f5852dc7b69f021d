"""Does a background save slow training? A GIL-bound foreground loop timed
per step while an async save drains: tensorckpt vs DCP's async_save with its
thread executor and with its process executor, in one run.

    .venv/bin/python benchmarks/bench_background.py [--size-gib 1.0] [--reps 3] [--dir DIR]
        [--ops 200] [--json PATH]

The foreground loop is what holds the GIL most of the time in a real job's
Python-heavy step: ``--ops`` tiny torch ops per step on one thread
(``torch.set_num_threads(1)``). Each repetition, in an order that rotates:

  baseline     the loop alone, --baseline-s (2) seconds of steps
  <saver>      the saver's async save of ~--size-gib of fp32 tensors starts,
               then the loop runs until the save is durable; the stall
               (until the call returns, DCP's process executor: until staging
               completes) is reported apart and its steps are not counted

Reported per saver: the mean step time during the drain (what training
loses: the drain's wall time over its steps) and its 90th percentile, each
over the baseline's median step, medians over the repetitions; the time
to durable; and the training time lost per save (its stall plus what its
steps took beyond the baseline's: a slow drain at a small slowdown can cost
more than a fast one at a larger). One process; a process group of one
(gloo) so every DCP mode runs as it would in a job.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

import tensorckpt


def make_state(size_bytes: int) -> dict[str, torch.Tensor]:
    rows = 4096
    n = max(1, size_bytes // (rows * 1024 * 4))
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.rand(rows, 1024, generator=g) for i in range(n)}


def step(x: torch.Tensor, ops: int) -> torch.Tensor:
    for _ in range(ops // 2):
        x = x * 1.0001
        x = x + 0.0001
    return x


def loop_until(stop, ops: int) -> list[float]:
    """Step times (s) of the foreground loop until ``stop()`` is true."""
    x = torch.ones(64)
    times = []
    while not stop():
        t = time.perf_counter()
        x = step(x, ops)
        times.append(time.perf_counter() - t)
    return times


def baseline(ops: int, seconds: float = 2.0) -> list[float]:
    end = time.perf_counter() + seconds
    return loop_until(lambda: time.perf_counter() >= end, ops)


def tensorckpt_save(executor: str):
    savers: list[tensorckpt.AsyncSaver] = []

    def start(state, path):
        if not savers:  # one saver for the run, as a training job keeps one (its helper process started once)
            savers.append(tensorckpt.AsyncSaver(executor=executor))
        t = time.perf_counter()
        h = savers[0].save(state, path)
        stall = time.perf_counter() - t
        return stall, h.done, h.wait

    start.savers = savers
    return start


def dcp_save(kind: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    def start(state, path):
        t = time.perf_counter()
        if kind == "thread":
            fut = dcp.async_save(state, checkpoint_id=path)
        else:
            from torch.distributed.checkpoint.staging import (
                DefaultStager,
                StagingOptions,
            )

            stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                  use_async_staging=True, use_non_blocking_copy=False))
            resp = dcp.async_save(state, checkpoint_id=path, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                  async_stager=stager)
            staged = getattr(resp, "staging_completion", None)
            if staged is not None:
                staged.result()
            fut = getattr(resp, "upload_completion", resp)
        stall = time.perf_counter() - t
        return stall, fut.done, fut.result

    return start


SAVERS = {"tensorckpt": tensorckpt_save("thread"), "tensorckpt process": tensorckpt_save("process"),
          "dcp thread": dcp_save("thread"), "dcp process": dcp_save("process")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ops", type=int, default=200, help="tiny torch ops per foreground step")
    ap.add_argument("--savers", type=lambda v: v.split(","), default=list(SAVERS),
                    help=f"comma-separated, of {','.join(SAVERS)}")
    ap.add_argument("--baseline-s", type=float, default=2.0, help="seconds of loop alone before each save")
    ap.add_argument("--dir", default=None, help="parent of the scratch directory (default: system temp dir)")
    ap.add_argument("--json", default=None, help="also write the results JSON here")
    ap.add_argument("--no-warmup", action="store_true",
                    help="time first saves too (default: each saver saves once, untimed, before the repetitions: "
                         "helper processes started, buffers and plans made, as in a job's steady state)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    state = make_state(int(args.size_gib * 2**30))
    nbytes = sum(t.nbytes for t in state.values())
    scratch = tempfile.mkdtemp(prefix="tensorckpt-bench-bg-", dir=args.dir)
    print(f"state: {len(state)} fp32 tensors, {nbytes / 2**30:.3f} GiB; foreground step: {args.ops} tiny ops, "
          f"1 thread; {args.reps} reps", flush=True)
    names = args.savers
    unknown = set(names) - set(SAVERS)
    if unknown:
        raise SystemExit(f"--savers: unknown {sorted(unknown)}; known: {list(SAVERS)}")
    res: dict[str, dict[str, list[float]]] = {n: {"mean": [], "p90": [], "stall": [], "durable": [], "lost": []}
                                          for n in names}
    base_all: list[float] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in [] if args.no_warmup else names:
                path = os.path.join(scratch, f"{name.replace(' ', '_')}_warmup")
                SAVERS[name](state, path)[2]()
                shutil.rmtree(path, ignore_errors=True)
            for rep in range(args.reps):
                order = names[rep % len(names):] + names[:rep % len(names)]
                for name in order:
                    base = statistics.median(baseline(args.ops, args.baseline_s))
                    base_all.append(base)
                    path = os.path.join(scratch, f"{name.replace(' ', '_')}_{rep}")
                    t = time.perf_counter()
                    stall, done, wait = SAVERS[name](state, path)
                    steps = loop_until(done, args.ops)
                    wait()
                    durable = time.perf_counter() - t
                    steps = steps or [base]
                    res[name]["mean"].append(statistics.fmean(steps) / base)
                    res[name]["p90"].append(sorted(steps)[int(0.9 * (len(steps) - 1))] / base)
                    res[name]["stall"].append(stall)
                    res[name]["durable"].append(durable)
                    # the training time the save cost: its stall, then what its steps took beyond the baseline's
                    res[name]["lost"].append(stall + sum(steps) - len(steps) * base)
                    shutil.rmtree(path, ignore_errors=True)
    finally:
        for name in names:
            for saver in getattr(SAVERS[name], "savers", []):
                saver.close()
        shutil.rmtree(scratch, ignore_errors=True)
        dist.destroy_process_group()

    print(f"\nbaseline step: median {statistics.median(base_all) * 1e3:.2f} ms "
          f"(range {min(base_all) * 1e3:.2f}-{max(base_all) * 1e3:.2f})\n")
    print(f"{'saver':<20}{'step x base (mean)':>19}{'p90 x base':>12}{'stall s':>9}{'durable s':>11}{'lost s':>8}"
          "   ranges")
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in res.items()}
    for n in names:
        m, r = med[n], res[n]
        print(f"{n:<20}{m['mean']:>19.2f}{m['p90']:>12.2f}{m['stall']:>9.3f}{m['durable']:>11.2f}{m['lost']:>8.2f}   "
              f"step {min(r['mean']):.2f}-{max(r['mean']):.2f}, durable {min(r['durable']):.2f}-"
              f"{max(r['durable']):.2f}")
    print()
    ours = [n for n in names if n.startswith("tensorckpt")]
    for what, k in (("mean step during the save", "mean"), ("training time lost per save", "lost")):
        for mine in ours:
            for peer in [n for n in names if n not in ours]:
                print(f"{what}: {mine:<18} / {peer:<12} x{med[mine][k] / med[peer][k]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "bench_background", "size_bytes": nbytes, "ops": args.ops, "reps": args.reps,
                       "baseline_s": base_all, "results": res, "medians": med}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
