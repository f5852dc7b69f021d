"""Where a same-layout load's time goes: one process loads what one rank of
bench_dist.py's world 2 loads (its half of ~--size-gib of fp32 parameters
plus Adam moments, Shard(0) boxes as plain tensors of the local shapes),
from a cold page cache, through tensorckpt.load, DCP (no process group) and
a raw read of the same bytes from one file, the variants alternated in every
repetition; medians are compared, never times across runs.

    .venv/bin/python benchmarks/bench_load_path.py [--size-gib 1.0] [--reps 5] [--procs 1] [--dir DIR]
        [--threads 1,2,4] [--buffers 1,4] [--rows] [--index-first] [--raw-objects]

``--threads`` / ``--buffers`` compare the direct reader's thread count and
buffer size (``direct.THREADS`` / ``direct.BUFFER_BYTES``); ``--rows`` adds a
checkpoint of the same state whose inner chunks are row slabs (whole trailing
dimensions, ~256 KiB: contiguous in a same-layout target) instead of the
writer's near-square ones, to weigh that writer choice; ``--index-first``
adds the same checkpoint read index first (each object's shard index, at its
end, read before its data: ``direct.Reader.file_order = False``) against the
default file order (a whole object of the reference writer's size read data
first, index last, in one sequential pass); ``--raw-objects`` adds a raw read
of tensorckpt's own stored objects, whole, with no check or copy, on each of
``--threads`` threads (what reading that many files costs on this disk, the
floor of a reader of this layout).

``--procs 2`` runs two such processes at once (each its own copy of the
files, started together, the slowest one's time counts): world 2's
contention for cores and disk without a process group.

Then one more tensorckpt load per repetition with the direct reader's time
split (summed over its threads, so it can exceed the wall time): open +
fstat + index + plan_reads, ``preadv``, CRC-32C, the copy into the target and
the rest of the Python work per inner chunk (a timed copy of
``direct.Reader._read_inner``: keep the two alike).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp
from bench_dist import logical_keys, nest, values
from common import drop_caches

import tensorckpt
from tensorckpt.layout import grid
from tensorckpt.storage import codec, direct

WAIT_S = 900  # a worker that failed (its error is on stderr) stops the run after this


def local_state(size_gib: float) -> dict:
    """Rank 0's Shard(0) boxes of bench_dist's state, as plain tensors."""
    flat = {}
    for key, shape in logical_keys(int(size_gib * 2**30)).items():
        local = (-(-shape[0] // 2), *shape[1:])
        flat[key] = values(key, shape, (0,) * len(shape), local)
    return flat


class Split:
    """Per-phase seconds of the direct reader, summed over threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.t = dict.fromkeys(("object", "preadv", "crc", "copy", "inner other"), 0.0)
        self.chunks = 0

    def add(self, **kw: float) -> None:
        with self.lock:
            for k, v in kw.items():
                self.t[k] += v


def instrument(split: Split) -> Callable[[], None]:
    """Replace Reader.read_object/_read_inner with timed copies; returns an undo."""
    orig_obj, orig_inner = direct.Reader.read_object, direct.Reader._read_inner

    def read_object(self: direct.Reader, *a: Any) -> None:
        t0 = time.perf_counter()
        self._inner_s = 0.0
        orig_obj(self, *a)
        split.add(object=time.perf_counter() - t0 - self._inner_s)

    def _read_inner(self: direct.Reader, obj: Any, reads: codec.Reads, dst: np.ndarray, digest: str | None = None) -> None:
        # a local file (direct.LocalFile); the whole-object digest check (format 1.3: a SHA-256 over
        # 4 bytes per inner chunk) is left out of this split
        t_in = time.perf_counter()
        fd = obj.fd
        g = reads.geometry
        if len(self._buf) < reads.most:
            self._buf = np.empty(reads.most, np.uint8)
        buf, addr, view = self._buf, self._buf.ctypes.data, self._buf.data
        check, src, to, encoded = reads.check, reads.src, reads.dst, g.encoded
        pr = crc = cp = 0.0
        n = 0
        for first, a, b in reads.runs:
            nbytes = (b - a) * encoded
            t = time.perf_counter()
            got = os.preadv(fd, [view[:nbytes]], first)
            pr += time.perf_counter() - t
            if got != nbytes:
                raise reads.short(got, nbytes)
            for k in range(a, b):
                at = (k - a) * encoded
                t = time.perf_counter()
                check(k, view, addr, at)
                t2 = time.perf_counter()
                dst[to[k]] = np.frombuffer(buf, g.dtype, count=g.numel, offset=at).reshape(g.inner)[src[k]]
                t3 = time.perf_counter()
                crc += t2 - t
                cp += t3 - t2
                n += 1
        total = time.perf_counter() - t_in
        self._inner_s = total
        split.add(preadv=pr, crc=crc, copy=cp, **{"inner other": total - pr - crc - cp})
        with split.lock:
            split.chunks += n

    direct.Reader.read_object, direct.Reader._read_inner = read_object, _read_inner

    def undo() -> None:
        direct.Reader.read_object, direct.Reader._read_inner = orig_obj, orig_inner

    return undo


def row_slabs(shard: tuple[int, ...], itemsize: int, target_bytes: int = grid.DEFAULT_INNER_BYTES) -> tuple[int, ...]:
    """Inner chunks of whole trailing dimensions (contiguous in a C-order
    target of the shard's box): the first dimension halved (or cut by its
    smallest factor) until one holds at most ``target_bytes``."""
    inner = list(shard)
    while inner and math.prod(inner) * itemsize > target_bytes and inner[0] > 1:
        f = grid._smallest_prime_factor(inner[0])
        if f > 16:
            break
        inner[0] //= f
    return tuple(inner)


def crc_and_copy_floor(nbytes: int) -> dict[str, float]:
    """One thread: hardware CRC-32C and a numpy copy of ``nbytes`` (warm)."""
    a = np.ones(nbytes, np.uint8)
    b = np.empty_like(a)
    t = time.perf_counter()
    codec.crc32c_at(0, a.ctypes.data, nbytes)
    c = time.perf_counter() - t
    t = time.perf_counter()
    np.copyto(b, a)
    return {"crc GB/s": nbytes / c / 1e9, "copy GB/s": nbytes / (time.perf_counter() - t) / 1e9}


def worker(rank: int, args: argparse.Namespace, scratch: str, barrier: Any, out: Any) -> None:
    """Save this rank's state three ways, then run every variant in the
    order the parent names, each between barriers (the parent drops the page
    cache before each), sending back (name, wall s, CPU s, reader split)."""
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    flat = local_state(args.size_gib)
    nbytes = sum(t.nbytes for t in flat.values())
    base = f"{scratch}/rank{rank}"
    tensorckpt.save(nest(flat), f"{base}/tc")
    if args.rows:
        default = grid.inner_chunks
        grid.inner_chunks = row_slabs
        tensorckpt.save(nest(flat), f"{base}/rows")
        grid.inner_chunks = default
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(nest(flat), checkpoint_id=f"{base}/dcp", no_dist=True)
    with open(f"{base}/raw", "wb") as f:
        for t in flat.values():
            f.write(t.numpy().tobytes())
    target = nest({k: torch.zeros_like(v) for k, v in flat.items()})
    raw_buf = np.empty(nbytes, np.uint8)
    if rank == 0:
        out.put(("info", len(flat), nbytes))

    def raw_read() -> None:
        with open(f"{base}/raw", "rb", buffering=0) as f:
            f.readinto(memoryview(raw_buf))

    objects = sorted(os.path.join(d, f) for d, _, fs in os.walk(f"{base}/tc") for f in fs if "zarr.json" not in f)

    def raw_objects(threads: int) -> None:
        """Read every stored object of the tensorckpt checkpoint whole into one buffer (no checks, no copy)."""
        view = memoryview(raw_buf)

        def one(job: tuple[int, str]) -> None:
            at, path = job
            with open(path, "rb", buffering=0) as f:
                f.readinto(view[at:at + os.fstat(f.fileno()).st_size])

        jobs, at = [], 0
        for path in objects:
            size = os.path.getsize(path)
            if at + size > len(raw_buf):
                break
            jobs.append((at, path))
            at += size
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, jobs))

    def dcp_load() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, checkpoint_id=f"{base}/dcp", no_dist=True)

    def tc_load(kind: str) -> None:
        direct.Reader.file_order = kind != "index-first"
        tensorckpt.load(target, f"{base}/{'tc' if kind == 'index-first' else kind}")

    for name in iter(lambda: barrier_and_get(barrier, args.order), None):
        kind, threads, mib, timed = name
        direct.THREADS, direct.BUFFER_BYTES = threads, mib << 20
        split = Split()
        undo = instrument(split) if timed else (lambda: None)
        barrier.wait()
        t, c = time.perf_counter(), time.process_time()
        if kind == "raw objects":
            raw_objects(threads)
        else:
            {"raw": raw_read, "dcp": dcp_load}.get(kind, lambda k=kind: tc_load(k))()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        undo()
        out.put((name, wall, cpu, split.t if timed else None, split.chunks))
        if kind not in ("raw", "raw objects", "dcp"):
            for k, v in flat.items():
                got = target
                for part in k.split("/"):
                    got = got[part]
                if not torch.equal(got, v):
                    raise SystemExit(f"FAIL: {k} differs after load")


def barrier_and_get(barrier: Any, order: Any) -> Any:
    barrier.wait()  # the parent has put the next variant in ``order`` and dropped the cache
    return order.get()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--procs", type=int, default=1, help="processes loading at once (2: like world 2)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--threads", default="4")
    ap.add_argument("--buffers", default="1", help="direct reader buffer sizes to compare, MiB")
    ap.add_argument("--rows", action="store_true", help="also a checkpoint with row-slab inner chunks")
    ap.add_argument("--raw-objects", action="store_true",
                    help="also a raw read of tensorckpt's own object files, whole, on --threads threads (the cost of many files)")
    ap.add_argument("--index-first", action="store_true",
                    help="also tensorckpt reading every object's index before its data (the reader before file order)")
    args = ap.parse_args()
    ctx = mp.get_context("fork")
    scratch = tempfile.mkdtemp(prefix="bench-load-path-", dir=args.dir)
    barrier, out = ctx.Barrier(args.procs + 1), ctx.Queue()
    queues = [ctx.Queue() for _ in range(args.procs)]
    procs = []
    for r in range(args.procs):
        a = argparse.Namespace(**vars(args), order=queues[r])
        procs.append(ctx.Process(target=worker, args=(r, a, scratch, barrier, out)))
        procs[-1].start()
    try:
        _, tensors, nbytes = out.get(timeout=WAIT_S)
        print(
            f"{args.procs} process(es), each {tensors} tensors, {nbytes / 2**20:.0f} MiB (one rank of world 2); "
            f"one-thread floors: {crc_and_copy_floor(64 << 20)}",
            flush=True,
        )
        variants = [("raw", 1, 1, False), ("dcp", 1, 1, False)]
        if args.raw_objects:
            variants += [("raw objects", int(n), 1, False) for n in args.threads.split(",")]
        kinds = ["tc"] + (["rows"] if args.rows else []) + (["index-first"] if args.index_first else [])
        variants += [
            (k, int(n), int(m), False) for k in kinds for n in args.threads.split(",") for m in args.buffers.split(",")
        ]
        label = {v: (v[0] if v[0] in ("raw", "dcp") else f"raw objects threads={v[1]}" if v[0] == "raw objects"
                     else f"{v[0]} threads={v[1]} buffer={v[2]}MiB") for v in variants}
        times: dict = {v: [] for v in variants}
        cpu: dict = {v: [] for v in variants}
        splits = []
        for rep in range(args.reps):
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]  # rotated each rep
            last = variants[-1]
            for v in [*order, (*last[:3], True)]:
                for q in queues:
                    q.put(v)
                drop_caches()
                barrier.wait(WAIT_S)  # workers take v
                barrier.wait(WAIT_S)  # and start together
                got = [out.get(timeout=WAIT_S) for _ in procs]
                if v[3]:
                    splits.append((max(g[1] for g in got), got[0][3], got[0][4]))
                else:
                    times[v].append(max(g[1] for g in got))
                    cpu[v].append(sum(g[2] for g in got))
        for q in queues:
            q.put(None)
        barrier.wait(WAIT_S)
        dcp_t = times[variants[1]]
        print(
            f"\nmedians of {args.reps} alternating cold loads (s, slowest process; range), the median of the "
            "per-rep ratio to dcp (> 1: faster), CPU seconds of all processes:"
        )
        for v, ts in times.items():
            paired = statistics.median(d / x for d, x in zip(dcp_t, ts))
            print(
                f"  {label[v]:34s} {statistics.median(ts):.3f}  ({min(ts):.3f}-{max(ts):.3f})  x{paired:.2f} dcp  "
                f"cpu {statistics.median(cpu[v]):.3f}"
            )
        print(
            f"\ninstrumented {label[variants[-1]]}, median wall {statistics.median(w for w, _, _ in splits):.3f} s; "
            f"reader split of process 0 (s summed over its threads), {splits[0][2]} inner chunks:"
        )
        for key in splits[0][1]:
            print(f"  {key:12s} {statistics.median(s[key] for _, s, _ in splits):.3f}")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
