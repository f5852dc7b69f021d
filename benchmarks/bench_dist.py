"""Distributed save / async save / load / load with resharding: tensorckpt vs
torch DCP vs the raw limit of this machine, side by side in one run.

    .venv/bin/python benchmarks/bench_dist.py [--size-gib 1.0] [--reps 3] [--dir DIR] [--json PATH]
        [--dcp-threads 1,2,4]

The state: a transformer-like fp32 model plus its Adam moments (exp_avg,
exp_avg_sq), ~--size-gib in all, as DTensors sharded Shard(0) over a world
of 2 gloo ranks (one process each, on 127.0.0.1). Values are a deterministic
function of each element's global index, so every load is checked exactly.

World 2, each rep, round-robin:
  raw          each rank writes its local bytes to one file, fsync (the write
               limit); then reads them back from a dropped page cache
  raw objects  the same bytes as tensorckpt stores them: one file per tensor
               per rank in a directory of its own (KEY/c/RANK), written on 4
               threads, each file and directory fsync'd; read back cold on 4
               threads (the floor of any format with an object per tensor
               and writer: no encoding, no checksum, no copy)
  copy         each rank copies its local state into preallocated memory
               (the floor for a training stall)
  dcp          dcp.save; dcp.async_save (stall = until it returns; durable =
               until its future resolves); dcp.load into the same layout
  dcp best     the same at the settings a careful user picks in torch 2.13:
               FileSystemWriter(thread_count=N), N the fastest of
               --dcp-threads in one save each before the reps; cached save
               plans; async_save with the process executor and a
               DefaultStager (shared memory, pinned with CUDA; stall = until
               staging completes)
  tensorckpt   tensorckpt.save; tensorckpt.async_save (same measures);
               tensorckpt.load into the same layout
  async saves run twice per rep: the first (setup included in rep 1) and the
  second (steady state, as a training loop sees it) are reported apart; the
  sync save runs before them in even reps and after them in odd ones.
World 3, each rep: load the world-2 checkpoints as Shard(1) DTensors (the
resharding a user hits after a failure), page cache dropped before each load;
and a raw read of the whole state by 3 processes (the world-2 raw objects, a
third of the files each, cold): the read limit with 3 readers on this machine.

A phase's time is the slowest rank's, between barriers. GB/s are 1e9 bytes of
tensor data (the whole state) per second. Saves are durable before the clock
stops (DCP: FileSystemWriter's fsync per file; tensorckpt: each rank syncs its
writes before the commit).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import shutil
import socket
import statistics
import tempfile
import time
import warnings

import torch
import torch.multiprocessing as mp

import tensorckpt
from common import drop_caches, fsync_path

D_MODEL = 1024
VOCAB = 30720  # divisible by 2 and 3 (so is the small runs' 1536)


def shapes(size_bytes: int) -> dict[str, tuple[int, ...]]:
    """Parameter shapes whose params + two Adam moments come to ~size_bytes."""
    d = D_MODEL
    vocab = VOCAB if size_bytes >= 2**29 else 1536  # small runs (tests): a small embedding
    per_layer = 12 * d * d + 4 * d
    params = size_bytes // 4 // 3
    return transformer(d, vocab, max(1, round((params - vocab * d) / per_layer)))


def transformer(d: int, vocab: int, layers: int) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a transformer of ``layers`` layers, width ``d`` (bench_s3 uses it too)."""
    out = {"embed.weight": (vocab, d)}
    for i in range(layers):
        p = f"layers.{i}."
        out |= {p + n: (d, d) for n in ("attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight")}
        out |= {p + "mlp.up.weight": (4 * d, d), p + "mlp.down.weight": (d, 4 * d)}
        out |= {p + n: (d,) for n in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias")}
    out["norm.weight"] = (d,)
    return out


def logical_keys(size_bytes: int) -> dict[str, tuple[int, ...]]:
    s = shapes(size_bytes)
    keys = {f"model/{k}": v for k, v in s.items()}
    for k, v in s.items():
        keys[f"optim/state/{k}/exp_avg"] = v
        keys[f"optim/state/{k}/exp_avg_sq"] = v
    return keys


def values(key: str, shape, offset, local_shape) -> torch.Tensor:
    """The elements [offset, offset + local_shape) of the logical tensor ``key``:
    a deterministic function of the global index (layout-independent)."""
    seed = (sum(map(ord, key)) * 7919) % 1000
    idx = torch.zeros(local_shape, dtype=torch.float64)
    stride = 1
    for dim in reversed(range(len(shape))):
        r = torch.arange(offset[dim], offset[dim] + local_shape[dim], dtype=torch.float64) * stride
        idx += r.reshape([-1 if i == dim else 1 for i in range(len(shape))])
        stride *= shape[dim]
    return ((idx + seed) * 0.6180339887498949 % 1.0).float()


def nest(flat: dict) -> dict:
    out: dict = {}
    for key, v in flat.items():
        node = out
        *parents, last = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = v
    return out


def leaves(tree: dict, prefix: str = ""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from leaves(v, f"{prefix}{k}/")
        else:
            yield prefix + k, v


def dstate(keys, mesh, dim: int, fill: bool) -> dict:
    """DTensors Shard(dim) on ``mesh``: deterministic values, or zeros."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    flat = {}
    for key, shape in keys.items():
        d = min(dim, len(shape) - 1)
        lshape, offset = compute_local_shape_and_global_offset(shape, mesh, [Shard(d)])
        local = values(key, shape, offset, lshape) if fill else torch.zeros(lshape)
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        flat[key] = DTensor.from_local(local, mesh, [Shard(d)], shape=torch.Size(shape), stride=stride, run_check=False)
    tree = nest(flat)
    tree["step"] = 1000
    return tree


def check(tree: dict, keys, what: str) -> None:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for key, t in leaves(tree):
        if key == "step":
            if t != 1000:
                raise SystemExit(f"FAIL {what}: step is {t!r}")
            continue
        lshape, offset = compute_local_shape_and_global_offset(keys[key], t.device_mesh, t.placements)
        if not torch.equal(t.to_local(), values(key, keys[key], offset, lshape)):
            raise SystemExit(f"FAIL {what}: {key} differs after load")


def zero(tree: dict) -> None:
    for key, t in leaves(tree):
        if key != "step":
            t.to_local().zero_()
    tree["step"] = 0


def local_bytes(tree: dict) -> int:
    return sum(t.to_local().nbytes for k, t in leaves(tree) if k != "step")


# ----------------------------------------------------------------- timing


class Phases:
    """Times of phases run by every rank between barriers; the slowest rank's."""

    def __init__(self, rank: int, settle_s: float = 0.0) -> None:
        self.rank, self.times, self.extra, self.settle_s = rank, {}, {}, settle_s

    def run(self, name: str, fn, *, cold: bool = False, settle: bool = False):
        import torch.distributed as dist

        if cold and self.rank == 0:
            self.extra["drop_caches_error"] = drop_caches()
        if settle and self.settle_s:
            time.sleep(self.settle_s)  # the disk finishes what earlier phases left it
        dist.barrier()
        t = time.perf_counter()
        out = fn()
        mine = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        self.times.setdefault(name, []).append(mine.item())
        return out


def raw_objects_write(root: str, rank: int, tensors: list) -> None:
    """One file per tensor, ROOT/k{i}/c/RANK, like tensorckpt's stored objects;
    every file and every directory that gained an entry fsync'd."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> list[str]:
        d = os.path.join(root, f"k{i}", "c")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, str(rank)), "wb") as f:
            f.write(memoryview(tensors[i].numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        return [d, os.path.dirname(d)]

    with ThreadPoolExecutor(4) as pool:
        dirs = {d for ds in pool.map(one, range(len(tensors))) for d in ds}
        list(pool.map(fsync_path, [*dirs, root]))


def raw_objects_read(paths: list[str], bufs: list) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> None:
        with open(paths[i], "rb", buffering=0) as f:
            f.readinto(memoryview(bufs[i].numpy()).cast("B"))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(len(paths))))


def dcp_async(state, path, timings):
    import torch.distributed.checkpoint as dcp

    t = time.perf_counter()
    fut = dcp.async_save(state, checkpoint_id=path)
    timings.append(time.perf_counter() - t)
    fut.result()


def dcp_best_writer(path: str, threads: int):
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    return {"storage_writer": FileSystemWriter(path, thread_count=threads),
            "planner": DefaultSavePlanner(enable_plan_caching=True)}


def dcp_best_save(state, path, threads: int) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path, **dcp_best_writer(path, threads))


def dcp_best_async(state, path, timings, threads: int) -> None:
    """DCP's async save as a careful user sets it up in torch 2.13: a
    separate process does the writes (AsyncCheckpointerType.PROCESS), a
    DefaultStager stages into shared memory (pinned where CUDA exists), the
    save plan is cached, FileSystemWriter uses the tuned thread count. The
    stall is until staging completes (the caller may change the state only
    then), not only until async_save returns."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    cuda = torch.cuda.is_available()
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True,
                                          use_non_blocking_copy=cuda))
    t = time.perf_counter()
    resp = dcp.async_save(state, checkpoint_id=path, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                          async_stager=stager, **dcp_best_writer(path, threads))
    staged = getattr(resp, "staging_completion", None)
    if staged is not None:
        staged.result()
    timings.append(time.perf_counter() - t)
    getattr(resp, "upload_completion", resp).result()
    stager.close()


def tune_dcp_threads(ph, state, base: str, choices) -> int:
    """FileSystemWriter's thread_count with the fastest save here (one save
    each, before the timed repetitions): DCP at its best, not its default."""
    import torch.distributed as dist

    best = None
    for n in choices:
        ph.run(f"(tuning) dcp save threads={n}", lambda n=n: dcp_best_save(state, f"{base}/tune{n}", n))
        t = ph.times.pop(f"(tuning) dcp save threads={n}")[0]
        if best is None or t < best[0]:
            best = (t, n)
    dist.barrier()
    return best[1]


def tc_async(state, path, timings):
    t = time.perf_counter()
    h = tensorckpt.async_save(state, path)
    timings.append(time.perf_counter() - t)
    h.wait()


def saves_then_async(rep: int, sync_save, async_save, stalls: list) -> None:
    """The sync save and the two async saves, in an order that alternates
    between repetitions: a save that follows others on this VM is slower
    (the disk is still busy with the earlier ones), and neither kind should
    always pay for it."""

    def asyncs():
        for i in range(2):
            timings = []
            async_save(i, timings)
            stalls.append((i, timings[0]))

    if rep % 2 == 0:
        sync_save()
        asyncs()
    else:
        asyncs()
        sync_save()


def worker_save(rank: int, world: int, args, scratch: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # two ranks share two cores
    mesh = init_device_mesh("cpu", (world,))
    keys = logical_keys(int(args.size_gib * 2**30))
    state = dstate(keys, mesh, 0, fill=True)
    target = dstate(keys, mesh, 0, fill=False)
    nbytes = local_bytes(state)
    ph = Phases(rank, args.settle_s)
    flat_local = [t.to_local() for k, t in leaves(state) if k != "step"]
    pre = [torch.empty_like(t) for t in flat_local]
    raw_buf = torch.empty(nbytes // 4)
    stalls: dict[str, list] = {"dcp": [], "dcp best": [], "tensorckpt": []}
    amplification = []
    threads = 0
    if args.dcp_best:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            threads = tune_dcp_threads(ph, state, os.path.join(scratch, "tune"), args.dcp_threads)
        if rank == 0:
            shutil.rmtree(os.path.join(scratch, "tune"), ignore_errors=True)
    ph.extra["dcp_best_threads"] = threads
    for rep in range(args.reps):
        base = os.path.join(scratch, f"r{rep}")
        raw = os.path.join(scratch, f"raw{rank}")

        def raw_write():
            with open(raw, "wb") as f:
                for t in flat_local:
                    f.write(memoryview(t.numpy()).cast("B"))
                f.flush()
                os.fsync(f.fileno())

        def raw_read():
            with open(raw, "rb", buffering=0) as f:
                f.readinto(memoryview(raw_buf.numpy()).cast("B"))

        ph.run("raw save", raw_write, settle=True)
        ph.run("raw load", raw_read, cold=True)
        os.remove(raw)
        objects = os.path.join(scratch, f"objects{rep}")
        if rank == 0:
            os.makedirs(objects)
        dist.barrier()
        ph.run("raw objects save", lambda: raw_objects_write(objects, rank, flat_local), settle=True)
        paths = [os.path.join(objects, f"k{i}", "c", str(rank)) for i in range(len(flat_local))]
        ph.run("raw objects load", lambda: raw_objects_read(paths, pre), cold=True)
        dist.barrier()
        if rank == 0 and rep > 0:
            shutil.rmtree(os.path.join(scratch, f"objects{rep - 1}"), ignore_errors=True)
        ph.run("copy (stall floor)", lambda: [p.copy_(t) for p, t in zip(pre, flat_local)])

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            saves_then_async(rep, lambda: ph.run("dcp save", lambda: dcp.save(state, checkpoint_id=f"{base}/dcp"),
                                                               settle=True),
                             lambda i, timings: ph.run(f"dcp async durable #{i + 1}",
                                                       lambda: dcp_async(state, f"{base}/dcp_a{i}", timings), settle=True),
                             stalls["dcp"])
            if args.dcp_best:
                saves_then_async(rep, lambda: ph.run("dcp best save",
                                                     lambda: dcp_best_save(state, f"{base}/dcpb", threads), settle=True),
                                 lambda i, timings: ph.run(f"dcp best async durable #{i + 1}",
                                                           lambda: dcp_best_async(state, f"{base}/dcpb_a{i}", timings,
                                                                                  threads), settle=True),
                                 stalls["dcp best"])
            zero(target)
            ph.run("dcp load", lambda: dcp.load(target, checkpoint_id=f"{base}/dcp"), cold=True)
            check(target, keys, "dcp load")
            if args.dcp_best:
                zero(target)
                ph.run("dcp best load", lambda: dcp.load(target, checkpoint_id=f"{base}/dcpb"), cold=True)
                check(target, keys, "dcp best load")

        saves_then_async(rep, lambda: ph.run("tensorckpt save", lambda: tensorckpt.save(state, f"{base}/tc"), settle=True),
                         lambda i, timings: ph.run(f"tensorckpt async durable #{i + 1}",
                                                   lambda: tc_async(state, f"{base}/tc_a{i}", timings), settle=True),
                         stalls["tensorckpt"])
        zero(target)
        stats = tensorckpt.LoadStats()
        ph.run("tensorckpt load", lambda: tensorckpt.load(target, f"{base}/tc", stats=stats), cold=True)
        check(target, keys, "tensorckpt load")
        amplification.append(stats.read_amplification)
        dist.barrier()
        if rank == 0:
            for name in ("dcp_a0", "dcp_a1", "dcpb_a0", "dcpb_a1", "tc_a0", "tc_a1"):
                shutil.rmtree(f"{base}/{name}", ignore_errors=True)
            if rep > 0:
                shutil.rmtree(os.path.join(scratch, f"r{rep - 1}"), ignore_errors=True)
        dist.barrier()
    return {"times": ph.times, "stalls": stalls, "local_bytes": nbytes, "extra": ph.extra,
            "amplification": amplification, "keys": len(keys)}


def worker_load(rank: int, world: int, args, scratch: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    keys = logical_keys(int(args.size_gib * 2**30))
    target = dstate(keys, mesh, 1, fill=False)
    ph = Phases(rank)
    base = os.path.join(scratch, f"r{args.reps - 1}")
    amplification = []
    # the world-2 raw objects of the last rep, a third of the files to each rank
    objects = os.path.join(scratch, f"objects{args.reps - 1}")
    files = sorted(os.path.join(objects, k, "c", r) for k in os.listdir(objects)
                   for r in os.listdir(os.path.join(objects, k, "c")))[rank::world]
    bufs = [torch.empty(os.path.getsize(f) // 4) for f in files]
    for _ in range(args.reps):
        ph.run("raw objects load world 3", lambda: raw_objects_read(files, bufs), cold=True)
        zero(target)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ph.run("dcp load reshard", lambda: dcp.load(target, checkpoint_id=f"{base}/dcp"), cold=True)
        check(target, keys, "dcp load reshard")
        if args.dcp_best:
            zero(target)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ph.run("dcp best load reshard", lambda: dcp.load(target, checkpoint_id=f"{base}/dcpb"), cold=True)
            check(target, keys, "dcp best load reshard")
        zero(target)
        stats = tensorckpt.LoadStats()
        ph.run("tensorckpt load reshard", lambda: tensorckpt.load(target, f"{base}/tc", stats=stats), cold=True)
        check(target, keys, "tensorckpt load reshard")
        amplification.append(stats.read_amplification)
    return {"times": ph.times, "amplification": amplification, "extra": ph.extra}


# ----------------------------------------------------------------- launcher


def _entry(rank, world, port, fn, args, scratch, queue):
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        queue.put((rank, fn(rank, world, args, scratch)))
    finally:
        dist.destroy_process_group()


def spawn(world: int, fn, args, scratch: str) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, scratch, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    for _ in range(world):
        rank, res = queue.get(timeout=3600)
        out[rank] = res
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a worker of world {world} failed (exit code {p.exitcode})")
    return [out[r] for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="whole state (params + Adam moments), GiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="parent of the scratch directory (default: system temp dir)")
    ap.add_argument("--json", default=None, help="also write the results JSON here")
    ap.add_argument("--dcp-threads", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 4],
                    help="FileSystemWriter thread counts tried for DCP's best row (the fastest is used)")
    ap.add_argument("--no-dcp-best", dest="dcp_best", action="store_false",
                    help="skip DCP's best-settings rows (quicker; the test suite's default case)")
    ap.add_argument("--settle-s", type=float, default=0.0,
                    help="idle seconds before every timed save (default 0: back to back; a training job's saves "
                         "are minutes apart, while on a VM a save that follows another pays for its write-back)")
    args = ap.parse_args()

    keys = logical_keys(int(args.size_gib * 2**30))
    nbytes = sum(math.prod(s) * 4 for s in keys.values())
    print(f"state: {len(keys)} fp32 tensors (model + Adam moments), {nbytes / 2**30:.3f} GiB; "
          f"save world 2 Shard(0), reshard load world 3 Shard(1); {args.reps} reps; "
          f"{args.settle_s:g} s idle before each save", flush=True)
    scratch = tempfile.mkdtemp(prefix="tensorckpt-bench-dist-", dir=args.dir)
    try:
        t = time.perf_counter()
        saved = spawn(2, worker_save, args, scratch)
        loaded = spawn(3, worker_load, args, scratch)
        print(f"ran in {time.perf_counter() - t:.0f} s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    times = {**saved[0]["times"], **loaded[0]["times"]}
    med = {k: statistics.median(v) for k, v in times.items()}
    modes = ("dcp", "dcp best", "tensorckpt") if args.dcp_best else ("dcp", "tensorckpt")
    stall = {m: {i: statistics.median(max(r["stalls"][m][j][1] for r in saved) for j in range(len(saved[0]["stalls"][m]))
                                      if saved[0]["stalls"][m][j][0] == i) for i in (0, 1)}
             for m in modes}
    drop = saved[0]["extra"].get("drop_caches_error")
    if args.dcp_best:
        print(f"dcp best: FileSystemWriter(thread_count={saved[0]['extra']['dcp_best_threads']}) (fastest of "
              f"{args.dcp_threads}), cached plans; async: process executor, DefaultStager (shared memory)")
    print(f"\nloads: {'cold (page cache dropped)' if drop is None else 'WARM: ' + str(drop)}; "
          f"times are the slowest rank's, medians of {args.reps}\n")
    print(f"{'phase':<34}{'median s':>9}{'GB/s':>8}   each rep")
    for k, v in times.items():
        print(f"{k:<34}{med[k]:>9.3f}{nbytes / 1e9 / med[k]:>8.2f}   " + " ".join(f"{x:.3f}" for x in v))
    for m in modes:
        print(f"{m + ' async stall #1 (first)':<34}{stall[m][0]:>9.3f}")
        print(f"{m + ' async stall #2 (steady)':<34}{stall[m][1]:>9.3f}")
    amp_same = statistics.median(max(r["amplification"][i] for r in saved) for i in range(args.reps))
    amp_reshard = statistics.median(max(r["amplification"][i] for r in loaded) for i in range(args.reps))
    print(f"tensorckpt read amplification: same layout x{amp_same:.3f}, reshard x{amp_reshard:.3f} (worst rank)")

    ratios = {
        "save: tensorckpt / dcp (throughput)": med["dcp save"] / med["tensorckpt save"],
        "save: tensorckpt / raw write limit": med["raw save"] / med["tensorckpt save"],
        "load: tensorckpt / dcp (throughput)": med["dcp load"] / med["tensorckpt load"],
        "reshard load: tensorckpt / dcp (throughput)": med["dcp load reshard"] / med["tensorckpt load reshard"],
        "reshard load: tensorckpt / raw cold read": med["raw load"] / med["tensorckpt load reshard"],
        "load: tensorckpt / raw cold read": med["raw load"] / med["tensorckpt load"],
        "save: tensorckpt / raw objects write": med["raw objects save"] / med["tensorckpt save"],
        "load: tensorckpt / raw objects read": med["raw objects load"] / med["tensorckpt load"],
        "load: raw objects read / dcp (the object-count bound)": med["dcp load"] / med["raw objects load"],
        "save: raw objects write / raw write (the object-count bound)": med["raw save"] / med["raw objects save"],
        "reshard load: tensorckpt / raw read world 3":
            med["raw objects load world 3"] / med["tensorckpt load reshard"],
        "reshard bound: raw read world 3 / raw cold read": med["raw load"] / med["raw objects load world 3"],
        "steady stall: tensorckpt / dcp": stall["tensorckpt"][1] / stall["dcp"][1],
        "steady stall: tensorckpt / copy floor": stall["tensorckpt"][1] / med["copy (stall floor)"],
        "first stall: tensorckpt / dcp": stall["tensorckpt"][0] / stall["dcp"][0],
        "async durable: tensorckpt / its sync save (time)": med["tensorckpt async durable #2"] / med["tensorckpt save"],
    }
    if args.dcp_best:
        ratios |= {
            "save: tensorckpt / dcp best (throughput)": med["dcp best save"] / med["tensorckpt save"],
            "load: tensorckpt / dcp best (throughput)": med["dcp best load"] / med["tensorckpt load"],
            "reshard load: tensorckpt / dcp best (throughput)":
                med["dcp best load reshard"] / med["tensorckpt load reshard"],
            "steady stall: tensorckpt / dcp best": stall["tensorckpt"][1] / stall["dcp best"][1],
        }
    print()
    for k, v in ratios.items():
        print(f"{k:<66} x{v:.2f}")
    report = {
        "benchmark": "bench_dist", "size_bytes": nbytes, "tensors": len(keys), "reps": args.reps, "settle_s": args.settle_s,
        "cold_loads": drop is None, "dcp_best_threads": saved[0]["extra"]["dcp_best_threads"], "times_s": times, "medians_s": med, "stalls_s": stall,
        "read_amplification": {"same_layout": amp_same, "reshard": amp_reshard}, "ratios": ratios,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "tensorstore": importlib.metadata.version("tensorstore"), "tensorckpt": tensorckpt.__version__,
                     "cpus": os.cpu_count()},
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
