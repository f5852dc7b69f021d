"""What the replica check costs: a DDP-style state (every tensor a plain,
replicated tensor) saved at world 2 by tensorckpt, whose save digests every
replicated tensor on every rank (CRC-32C) and compares the digests before
writing (spec/rng-and-data.md, the replica rule), and by torch DCP at its
defaults on the same data, in one run.

    python benchmarks/bench_replicas.py [--mib 512] [--reps 5] [--dir DIR]

Prints, per repetition and as medians with ranges: the digest pass alone (the
slowest rank's ``replicas.digest`` over its whole state), tensorckpt's save
and DCP's save (both durable, both written once across the replicas), and the
digest's share of tensorckpt's save. The order of the two saves alternates.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def state_of(mib: int) -> dict:
    g = torch.Generator().manual_seed(0)
    n = max(1, mib // 16)
    return {f"layer{i}.weight": torch.randn(2048, 2048, generator=g) for i in range(n)}  # 16 MiB each


def worker(rank: int, world: int, port: int, mib: int, reps: int, base: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp

    import tensorckpt
    from tensorckpt.engine import replicas

    state = state_of(mib)
    rows = []
    for rep in range(reps):
        row = {}
        dist.barrier()
        t = time.perf_counter()
        for v in state.values():
            replicas.digest(v)
        row["digest"] = time.perf_counter() - t
        order = ("tensorckpt", "dcp") if rep % 2 == 0 else ("dcp", "tensorckpt")
        for name in order:
            path = os.path.join(base, f"{name}-{rep}")
            dist.barrier()
            t = time.perf_counter()
            if name == "tensorckpt":
                tensorckpt.save(state, path)
            else:
                dcp.save(state, checkpoint_id=path)
                os.sync()  # DCP's FileSystemWriter fsyncs its files; make the directory entries durable too
            dist.barrier()
            row[name] = time.perf_counter() - t
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        rows.append(row)
    slowest = [None] * world
    dist.all_gather_object(slowest, rows)
    if rank == 0:
        out.put([{k: max(r[i][k] for r in slowest) for k in rows[0]} for i in range(reps)])
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="state size per rank (every rank holds all of it)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench-replicas-", dir=args.dir)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(r, 2, port, args.mib, args.reps, base, out)) for r in range(2)]
    for p in procs:
        p.start()
    rows = out.get(timeout=3600)
    for p in procs:
        p.join()
    shutil.rmtree(base, ignore_errors=True)
    print(f"replicated state: {args.mib} MiB on each of 2 ranks, {args.reps} reps (slowest rank, seconds)")
    for i, r in enumerate(rows):
        print(f"  rep {i}: digest {r['digest']:.3f}  tensorckpt save {r['tensorckpt']:.3f}  dcp save {r['dcp']:.3f}")

    def med(k: str) -> str:
        xs = [r[k] for r in rows]
        return f"{statistics.median(xs):.3f} s (range {min(xs):.3f}-{max(xs):.3f})"

    d = statistics.median(r["digest"] for r in rows)
    t = statistics.median(r["tensorckpt"] for r in rows)
    c = statistics.median(r["dcp"] for r in rows)
    print(f"digest pass:      {med('digest')}  = {d / (args.mib / 1024):.3f} s/GiB")
    print(f"tensorckpt save:  {med('tensorckpt')}")
    print(f"dcp save:         {med('dcp')}")
    print(f"digest share of tensorckpt's save: {d / t:.2f}; tensorckpt / dcp save time: {t / c:.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
