"""Durable saves with and without another process dirtying the page cache:
torch.save + fsync vs tensorckpt (fsync of exactly what it wrote) vs
tensorckpt as before (one syncfs of the whole file system) vs torch DCP.

    .venv/bin/python benchmarks/bench_durable.py [--small-kib 16] [--large-mib 512] [--reps 5]
        [--large-reps 3] [--many 2000] [--noise-mib 1024] [--noise-warmup-s 3] [--dir DIR] [--json PATH]
        [--no-world2]

Rows: a small state (--small-kib of fp32 in 4 tensors, world 1) and a large
one (--large-mib in 8 tensors, world 1 and world 2: Shard(0) DTensors over
two gloo ranks) and many small tensors (--many of 64 fp32 each, world 1:
two files and two directories each, where one syncfs costs least on a quiet
machine), each without and with a *noisy neighbour*: a separate
process writing --noise-mib to a file on the same file system over and over,
never syncing, so the page cache holds that much dirty data whenever a save
ends. Every save is durable before the clock stops:

  torch.save   torch.save of the rank's tensors into one file, fsync of the
               file and of its directory
  tensorckpt   tensorckpt.save: each stored object fsynced (as it is written,
               or in one threaded pass), then every directory that gained an
               entry, then the atomic rename (spec 10.2)
  syncfs       the same save, made durable the way it was before issue 17
               item 4: one syncfs of the file system (kv.sync_tree)
  dcp          torch.distributed.checkpoint.save (FileSystemWriter's fsync per file)

Each rep runs the methods in a rotated order (rep r starts with method r);
medians and [min, max] over the reps, and each method's median against
torch.save's. The neighbour is started before a row and stopped after it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

import tensorckpt
from common import fsync_path
from tensorckpt.storage import kv

METHODS = ("torch.save", "tensorckpt", "syncfs", "dcp")
NOISE = """
import os, sys
path, size = sys.argv[1], int(sys.argv[2]) << 20
block = os.urandom(8 << 20)
fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
while True:
    for off in range(0, size, len(block)):
        os.pwrite(fd, block, off)
"""


def state(total_bytes: int, parts: int) -> dict[str, torch.Tensor]:
    n = max(1, total_bytes // 4 // parts)
    cols = 1024 if n >= 1024 * 16 else 1
    return {f"layer{i}.w": torch.randn(max(2, n // cols), cols) for i in range(parts)}


def torch_save(tensors: dict, path: str, rank: int, barrier) -> None:
    if rank == 0:
        os.makedirs(path)
    barrier()
    with open(os.path.join(path, f"rank{rank}.pt"), "wb") as f:
        torch.save({k: v.to_local() if hasattr(v, "to_local") else v for k, v in tensors.items()}, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(path)
    if rank == 0:
        fsync_path(os.path.dirname(path))


def tc_syncfs(tensors: dict, path: str) -> None:
    inner = kv.sync_files
    kv.sync_files = lambda root, keys, fsynced=(): kv.sync_tree(root)  # type: ignore[assignment]
    try:
        tensorckpt.save(tensors, path)
    finally:
        kv.sync_files = inner  # type: ignore[assignment]


def dcp_save(tensors: dict, path: str, world: int) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"torch\.distributed is disabled")
        dcp.save(tensors, checkpoint_id=path, no_dist=world == 1)


def measure(rank: int, world: int, tensors: dict, base: str, reps: int) -> dict[str, list[float]]:
    """Seconds of each method's save in each rep (rank 0's clock, between barriers)."""
    if world > 1:
        import torch.distributed as dist

        barrier = dist.barrier
    else:
        def barrier() -> None:
            return None

    run = {
        "torch.save": lambda p: torch_save(tensors, p, rank, barrier),
        "tensorckpt": lambda p: tensorckpt.save(tensors, p),
        "syncfs": lambda p: tc_syncfs(tensors, p),
        "dcp": lambda p: dcp_save(tensors, p, world),
    }
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for m in METHODS:  # one unmeasured save each: imports, plans, first-touch allocations
        path = os.path.join(base, f"warm-{m}")
        run[m](path)
        barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    for r in range(reps):
        for m in METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]:
            path = os.path.join(base, f"{m}-{r}")
            barrier()
            t = time.perf_counter()
            run[m](path)
            barrier()
            times[m].append(time.perf_counter() - t)
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    return times


def worker(rank: int, world: int, args: dict, scratch: str) -> dict[str, list[float]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(rank)
    local = state(args["bytes"] // world, args["parts"])
    tensors = {k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False) for k, v in local.items()}
    return measure(rank, world, tensors, scratch, args["reps"])


class Neighbour:
    """A process that keeps ``mib`` MiB of page cache dirty on the file system of ``where``."""

    def __init__(self, where: str, mib: int, warmup_s: float) -> None:
        self.path = os.path.join(where, "neighbour.bin")
        self.proc = subprocess.Popen([sys.executable, "-c", NOISE, self.path, str(mib)])
        time.sleep(warmup_s)  # let the dirty data build up

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.unlink(self.path)
        os.sync()


def summary(times: dict[str, list[float]]) -> dict[str, dict]:
    ref = statistics.median(times["torch.save"])
    return {
        m: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v),
            "vs_torch_save": statistics.median(v) / ref}
        for m, v in times.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small-kib", type=float, default=16)
    ap.add_argument("--large-mib", type=float, default=512)
    ap.add_argument("--reps", type=int, default=5, help="reps of the small rows")
    ap.add_argument("--large-reps", type=int, default=3)
    ap.add_argument("--many", type=int, default=2000, help="tensors of the many-small row (0: no such row)")
    ap.add_argument("--noise-mib", type=int, default=1024)
    ap.add_argument("--noise-warmup-s", type=float, default=3.0, help="how long the neighbour writes before a row")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-world2", action="store_true", help="skip the world-2 rows")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_dist import spawn

    scratch = tempfile.mkdtemp(prefix="bench-durable-", dir=args.dir)
    rows = [("small", 1, int(args.small_kib * 1024), 4, args.reps), ("large", 1, int(args.large_mib * 2**20), 8, args.large_reps)]
    if not args.no_world2:
        rows.append(("large", 2, int(args.large_mib * 2**20), 8, args.large_reps))
    if args.many:
        rows.append(("many", 1, args.many * 256, args.many, args.large_reps))
    results = []
    try:
        for noisy in (False, True):
            for name, world, nbytes, parts, reps in rows:
                neighbour = Neighbour(scratch, args.noise_mib, args.noise_warmup_s) if noisy else None
                try:
                    base = tempfile.mkdtemp(dir=scratch)
                    cfg = {"bytes": nbytes, "parts": parts, "reps": reps}
                    if world == 1:
                        times = measure(0, 1, state(nbytes, parts), base, reps)
                    else:
                        times = spawn(world, worker, cfg, base)[0]
                finally:
                    if neighbour is not None:
                        neighbour.stop()
                row = {"size": name, "bytes": nbytes, "world": world, "neighbour_mib": args.noise_mib if noisy else 0,
                       "reps": reps, "methods": summary(times)}
                results.append(row)
                label = f"{name} ({nbytes / 2**20:.3g} MiB), world {world}, " + (
                    f"neighbour dirtying {args.noise_mib} MiB" if noisy else "quiet")
                print(label)
                for m, s in row["methods"].items():
                    print(f"  {m:11s} {s['median_s'] * 1e3:9.1f} ms  [{s['min_s'] * 1e3:.1f}, {s['max_s'] * 1e3:.1f}]"
                          f"  x{s['vs_torch_save']:.2f} torch.save")
                sys.stdout.flush()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": results, "argv": sys.argv[1:]}, f, indent=1)


if __name__ == "__main__":
    main()
