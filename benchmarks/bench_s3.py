"""Distributed save / async save / load / load with resharding on S3:
tensorckpt (TensorStore's s3 kvstore) vs torch DCP with its fsspec writer and
reader over s3fs, on the same S3-compatible server, side by side in one run.

    .venv/bin/python benchmarks/bench_s3.py [--size-mb 512] [--reps 3] [--latency-ms 0,20] [--json PATH]
        [--dcp-threads 1,4,8] [--no-dcp-best] [--no-reshard] [--d-model 1024] [--moto-buffer-mb 1024]
        [--server moto|range]

The server is moto in server mode on 127.0.0.1 (tests/s3server.py's
MotoServer), reached through tests/s3proxy.py's S3Proxy, which adds
--latency-ms to every request and counts the bytes clients fetch; both are
imported from the repository's tests/ folder (put on sys.path here), not
copied. Each latency in --latency-ms is one run with a fresh proxy. moto
answers a ranged GET by copying the whole object (S3 itself reads only the
range), so a reader of many small ranges pays per object size here; the
server keeps objects in memory (--moto-buffer-mb) so that cost is a copy,
not a file read. --server range runs benchmarks/moto_ranged.py instead:
moto patched so that a ranged GET reads only its range, as S3 does
(everything else moto's; still not S3); the default, moto, is moto as
released.

The state: a transformer-like model in bfloat16 plus its Adam moments in
float32 (exp_avg, exp_avg_sq), ~--size-mb MiB in all, as DTensors Shard(0)
over 2 gloo ranks (one process each). Values are a function of each
element's global index (bench_dist.py's), so every load is checked exactly.

World 2, each rep (the libraries' order alternates between reps):
  dcp          dcp.save / dcp.async_save / dcp.load with FsspecWriter /
               FsspecReader at their defaults (one file per rank, sync_files:
               on s3fs that is an os.sync() of this machine per file)
  dcp best     FsspecWriter(thread_count=N, single_file_per_rank=S,
               sync_files=False), N and S the fastest of --dcp-threads x
               {True, False} in one save each before the reps; cached save
               plans; async_save with the process executor and a
               DefaultStager (stall = until staging completes)
  tensorckpt   tensorckpt.save / async_save / load to s3://
  async stall  the time async_save blocks the caller (the training loop)
World 3, each rep: load the last rep's world-2 checkpoints as Shard(1)
DTensors (resharding).

For every load: the bytes the proxy sent to clients (reset before the load)
against the bytes the target needs (the target's local shards), and the peak
host memory: per rank, the RSS high-water mark during the load (reset
through /proc/self/clear_refs) above the RSS before it, plus the target,
summed over ranks, over the target's bytes (1.0 = nothing beyond the
target). A phase's time is the slowest rank's, between barriers.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.metadata
import itertools
import json
import math
import os
import platform
import re
import statistics
import sys
import threading
import time
import warnings

import torch
from bench_dist import Phases, leaves, local_bytes, nest, spawn, transformer, values, zero

import tensorckpt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from s3proxy import S3Proxy
from s3server import ACCESS_KEY, REGION, SECRET_KEY, MotoServer

BUCKET = "tensorckpt-bench"
SERVERS = {  # --server: what answers the requests, as printed
    "moto": "moto (as released: a ranged GET copies the whole object)",
    "range": "moto patched by benchmarks/moto_ranged.py (a ranged GET reads only its range; not S3)",
}
TARGETS = {  # the targets (issue 14, "Performance on object storage")
    "time": "tensorckpt >= DCP on every row",
    "reshard_20ms": "load with resharding >= 2x DCP at 20 ms",
    "bytes": "bytes fetched for the resharded load <= 1.1x needed",
    "memory": "peak host memory of a load <= 1.2x the target state",
}


# ----------------------------------------------------------------- state


def logical_keys(size_bytes: int, d: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Model parameters (bf16) and two Adam moments (fp32) of a transformer
    whose state comes to ~size_bytes (10 bytes per parameter); at least one
    layer, so a small state needs a small ``d``."""
    vocab = 30720 if size_bytes >= 2**29 else 1536  # as bench_dist's; divisible by 2 and 3
    per_layer = 12 * d * d + 4 * d
    shapes = transformer(d, vocab, max(1, round((size_bytes / 10 - vocab * d) / per_layer)))
    keys = {f"model/{k}": (v, torch.bfloat16) for k, v in shapes.items()}
    for k, v in shapes.items():
        keys[f"optim/state/{k}/exp_avg"] = (v, torch.float32)
        keys[f"optim/state/{k}/exp_avg_sq"] = (v, torch.float32)
    return keys


def dstate(keys: dict, mesh: object, dim: int, fill: bool) -> dict:
    """DTensors Shard(dim) on ``mesh``: deterministic values, or zeros."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    flat = {}
    for key, (shape, dtype) in keys.items():
        place = [Shard(min(dim, len(shape) - 1))]
        lshape, offset = compute_local_shape_and_global_offset(shape, mesh, place)
        local = values(key, shape, offset, lshape).to(dtype) if fill else torch.zeros(lshape, dtype=dtype)
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        flat[key] = DTensor.from_local(local, mesh, place, shape=torch.Size(shape), stride=stride, run_check=False)
    tree = nest(flat)
    tree["step"] = 1000
    return tree


def check(tree: dict, keys: dict, what: str) -> None:
    """Exit with FAIL unless every tensor holds exactly the saved values."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for key, t in leaves(tree):
        if key == "step":
            if t != 1000:
                raise SystemExit(f"FAIL {what}: step is {t!r}")
            continue
        shape, dtype = keys[key]
        lshape, offset = compute_local_shape_and_global_offset(shape, t.device_mesh, t.placements)
        if not torch.equal(t.to_local(), values(key, shape, offset, lshape).to(dtype)):
            raise SystemExit(f"FAIL {what}: {key} differs after load")


# ----------------------------------------------------------------- memory


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) if m else 0


def reset_peak() -> int | None:
    """Free what can be freed, reset this process's RSS high-water mark;
    the RSS now (bytes), or None where the peak cannot be reset."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status_kib("VmRSS") * 1024


def peak_since(rss_before: int | None) -> int:
    """Bytes the RSS rose above ``rss_before`` at its highest since reset_peak; -1 if unknown."""
    return -1 if rss_before is None else max(0, _status_kib("VmHWM") * 1024 - rss_before)


# ----------------------------------------------------------------- libraries


def storage_options(args: argparse.Namespace) -> dict:
    """s3fs's options for the proxy's endpoint (DCP's fsspec writer and reader)."""
    return {"endpoint_url": args.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY,
            "client_kwargs": {"region_name": REGION}}


def dcp_writer(url: str, args: argparse.Namespace, best: tuple[int, bool] | None):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    if best is None:
        return FsspecWriter(url, **storage_options(args))
    threads, single = best
    return FsspecWriter(url, thread_count=threads, single_file_per_rank=single, sync_files=False,
                        **storage_options(args))


def dcp_save(state: dict, url: str, args: argparse.Namespace, best: tuple[int, bool] | None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    planner = DefaultSavePlanner(enable_plan_caching=True) if best else None
    dcp.save(state, storage_writer=dcp_writer(url, args, best), planner=planner)


def dcp_async(state: dict, url: str, args: argparse.Namespace, best: tuple[int, bool] | None) -> float:
    """DCP's async_save; the stall (until it returns, or for the best
    settings until staging completes), after waiting until durable."""
    import torch.distributed.checkpoint as dcp

    if best is None:
        t = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=dcp_writer(url, args, None))
        stall = time.perf_counter() - t
        fut.result()
        return stall
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    cuda = torch.cuda.is_available()
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=True,
                                          use_non_blocking_copy=cuda))
    t = time.perf_counter()
    resp = dcp.async_save(state, storage_writer=dcp_writer(url, args, best),
                          planner=DefaultSavePlanner(enable_plan_caching=True),
                          async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)
    staged = getattr(resp, "staging_completion", None)
    if staged is not None:
        staged.result()
    stall = time.perf_counter() - t
    getattr(resp, "upload_completion", resp).result()
    stager.close()
    return stall


def dcp_load(target: dict, url: str, args: argparse.Namespace) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    dcp.load(target, storage_reader=FsspecReader(url, **storage_options(args)))


def tc_async(state: dict, url: str) -> float:
    t = time.perf_counter()
    h = tensorckpt.async_save(state, url)
    stall = time.perf_counter() - t
    h.wait()
    return stall


def tune_dcp(ph: Phases, state: dict, base: str, args: argparse.Namespace) -> tuple[int, bool]:
    """DCP's best writer settings here: the fastest save of thread counts x
    single_file_per_rank (one save each, before the timed repetitions)."""
    import torch.distributed as dist

    best = None
    for threads, single in itertools.product(args.dcp_threads, (True, False)):
        name = f"(tuning) {threads} {single}"
        best_of = (threads, single)
        ph.run(name, lambda b=best_of: dcp_save(state, f"{base}/tune-{b[0]}-{b[1]}", args, b))
        t = ph.times.pop(name)[0]
        if best is None or t < best[0]:
            best = (t, threads, single)
    dist.barrier()
    return best[1], best[2]


def delete_prefix(args: argparse.Namespace, prefix: str) -> None:
    """Delete every object under ``prefix`` straight on the server (not counted by the proxy)."""
    import boto3

    client = boto3.client("s3", endpoint_url=args.server, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix.rstrip("/") + "/"):
        objs = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objs:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": objs})


# ----------------------------------------------------------------- workers


class Loads:
    """Times, bytes fetched and peak memory of the loads of one world."""

    def __init__(self, ph: Phases, args: argparse.Namespace, target: dict, keys: dict) -> None:
        self.ph, self.args, self.target, self.keys = ph, args, target, keys
        self.fetched: dict[str, list[int]] = {}
        self.requests: dict[str, list[int]] = {}
        self.memory: dict[str, list[float]] = {}

    def run(self, name: str, fn) -> None:
        import torch.distributed as dist

        zero(self.target)
        if self.ph.rank == 0:
            self.args.ctl.put("reset")
            self.args.reply.get()
        rss = reset_peak()
        self.ph.run(name, fn)
        extra = peak_since(rss)  # before check(), which allocates
        if self.ph.rank == 0:
            self.args.ctl.put("read")
            fetched, requests = self.args.reply.get()
            self.fetched.setdefault(name, []).append(fetched)
            self.requests.setdefault(name, []).append(requests)
        check(self.target, self.keys, name)
        mine = local_bytes(self.target)
        both = torch.tensor([float(mine), float(extra if extra >= 0 else math.nan)], dtype=torch.float64)
        dist.all_reduce(both)
        self.memory.setdefault(name, []).append((both[0] + both[1]).item() / both[0].item())

    def result(self) -> dict:
        import torch.distributed as dist

        needed = torch.tensor([float(local_bytes(self.target))], dtype=torch.float64)
        dist.all_reduce(needed)
        return {"times": self.ph.times, "fetched": self.fetched, "requests": self.requests, "memory": self.memory, "needed": int(needed.item())}


def modes(args: argparse.Namespace, rep: int) -> list[str]:
    out = ["dcp", "dcp best", "tensorckpt"] if args.dcp_best else ["dcp", "tensorckpt"]
    return out if rep % 2 == 0 else out[::-1]


def save_one(ph: Phases, mode: str, state: dict, url: str, args: argparse.Namespace, best, stalls: dict) -> None:
    """One sync save and one async save (its stall) of ``mode``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "tensorckpt":
            ph.run(f"{mode} save", lambda: tensorckpt.save(state, url))
            out = ph.run(f"{mode} async durable", lambda: tc_async(state, url + "-async"))
        else:
            b = best if mode == "dcp best" else None
            ph.run(f"{mode} save", lambda: dcp_save(state, url, args, b))
            out = ph.run(f"{mode} async durable", lambda: dcp_async(state, url + "-async", args, b))
    stalls.setdefault(mode, []).append(out)


def load_one(loads: Loads, mode: str, url: str, args: argparse.Namespace, suffix: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "tensorckpt":
            loads.run(f"{mode} load{suffix}", lambda: tensorckpt.load(loads.target, url))
        else:
            loads.run(f"{mode} load{suffix}", lambda: dcp_load(loads.target, url, args))


def url_of(args: argparse.Namespace, rep: int, mode: str) -> str:
    return f"s3://{BUCKET}/{args.run}/r{rep}/{mode.replace(' ', '-')}"


def warm_up(args: argparse.Namespace, mesh: object, world: int) -> None:
    """One small save and load per library before anything is measured, so
    no timed row pays for imports, connection pools or thread pools, and no
    peak memory counts them."""
    import torch.distributed as dist

    keys = {"warm/w": ((96, 64), torch.float32)}
    state, target = dstate(keys, mesh, 0, fill=True), dstate(keys, mesh, 0, fill=False)
    base = f"s3://{BUCKET}/{args.run}/warm{world}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mode in modes(args, 0):
            url = f"{base}/{mode.replace(' ', '-')}"
            if mode == "tensorckpt":
                tensorckpt.save(state, url)
                tensorckpt.load(target, url)
            else:
                dcp_save(state, url, args, None)
                dcp_load(target, url, args)
            check(target, keys, f"{mode} warm-up load")
    dist.barrier()
    if dist.get_rank() == 0:
        delete_prefix(args, base.removeprefix(f"s3://{BUCKET}/"))


def worker_save(rank: int, world: int, args: argparse.Namespace, _scratch: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # two ranks share two cores
    mesh = init_device_mesh("cpu", (world,))
    keys = logical_keys(args.size_mb << 20, args.d_model)
    state = dstate(keys, mesh, 0, fill=True)
    ph = Phases(rank)
    loads = Loads(ph, args, dstate(keys, mesh, 0, fill=False), keys)
    stalls: dict[str, list[float]] = {}
    warm_up(args, mesh, world)
    best = None
    if args.dcp_best:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            best = tune_dcp(ph, state, f"s3://{BUCKET}/{args.run}/tune", args)
        if rank == 0:
            delete_prefix(args, f"{args.run}/tune")
    for rep in range(args.reps):
        for mode in modes(args, rep):
            save_one(ph, mode, state, url_of(args, rep, mode), args, best, stalls)
        for mode in modes(args, rep):
            load_one(loads, mode, url_of(args, rep, mode), args, "")
        dist.barrier()
        if rank == 0:
            for mode in modes(args, rep):
                delete_prefix(args, url_of(args, rep, mode).removeprefix(f"s3://{BUCKET}/") + "-async")
            if rep > 0:
                delete_prefix(args, f"{args.run}/r{rep - 1}")
        dist.barrier()
    stall_max = {}
    for mode, mine in stalls.items():
        t = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        stall_max[mode] = t.tolist()
    return {**loads.result(), "stalls": stall_max, "best": best, "tensors": len(keys)}


def worker_load(rank: int, world: int, args: argparse.Namespace, _scratch: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    keys = logical_keys(args.size_mb << 20, args.d_model)
    loads = Loads(Phases(rank), args, dstate(keys, mesh, 1, fill=False), keys)
    warm_up(args, mesh, world)
    for rep in range(args.reps):
        for mode in modes(args, rep):
            load_one(loads, mode, url_of(args, args.reps - 1, mode), args, " reshard")
    return loads.result()


# ----------------------------------------------------------------- one run


def serve_counts(proxy: S3Proxy, args: argparse.Namespace) -> None:
    """Rank 0's requests: "reset" the proxy's counts, "read" its bytes sent."""
    for cmd in iter(args.ctl.get, None):
        if cmd == "reset":
            proxy.reset_counts()
            args.reply.put(0)
        else:
            args.reply.put((proxy.bytes_out, sum(proxy.requests.values())))


def one_run(server: MotoServer, latency_ms: float, args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with S3Proxy(server.endpoint, latency_ms / 1000) as proxy:
        os.environ.update({**server.env(), "AWS_ENDPOINT_URL_S3": proxy.endpoint})
        os.environ.pop("AWS_ENDPOINT_URL", None)
        args.endpoint, args.server, args.run = proxy.endpoint, server.endpoint, f"run-{latency_ms:g}ms"
        args.ctl, args.reply = ctx.Queue(), ctx.Queue()
        counter = threading.Thread(target=serve_counts, args=(proxy, args), daemon=True)
        counter.start()
        t = time.perf_counter()
        try:
            saved = spawn(2, worker_save, args, "")[0]
            loaded = spawn(3, worker_load, args, "")[0] if args.reshard else None
        finally:
            args.ctl.put(None)
            delete_prefix(args, args.run)
        print(f"latency {latency_ms:g} ms: ran in {time.perf_counter() - t:.0f} s", flush=True)
    return summarize(latency_ms, saved, loaded, args)


def spread(v: list[float]) -> dict:
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "each": v}


def summarize(latency_ms: float, saved: dict, loaded: dict | None, args: argparse.Namespace) -> dict:
    rows: dict[str, dict] = {}
    libs = ["dcp", "dcp best", "tensorckpt"] if args.dcp_best else ["dcp", "tensorckpt"]
    for lib in libs:
        rows.setdefault("save world 2", {})[lib] = spread(saved["times"][f"{lib} save"])
        rows.setdefault("async durable", {})[lib] = spread(saved["times"][f"{lib} async durable"])
        rows.setdefault("async stall", {})[lib] = spread(saved["stalls"][lib])
        rows.setdefault("load world 2", {})[lib] = spread(saved["times"][f"{lib} load"])
        if loaded:
            rows.setdefault("load world 3 reshard", {})[lib] = spread(loaded["times"][f"{lib} load reshard"])
    fetched, memory, requests, each = {}, {}, {}, {}
    for world, res, suffix in ((2, saved, ""), (3, loaded, " reshard")):
        if res is None:
            continue
        for lib in libs:
            name = f"{lib} load{suffix}"
            fetched.setdefault(f"world {world}", {})[lib] = statistics.median(res["fetched"][name]) / res["needed"]
            memory.setdefault(f"world {world}", {})[lib] = statistics.median(res["memory"][name])
            each.setdefault(f"world {world}", {})[lib] = {"fetched_bytes": res["fetched"][name],
                                                          "peak_memory_over_target": res["memory"][name]}
            requests.setdefault(f"world {world}", {})[lib] = statistics.median(res["requests"][name])
        fetched[f"world {world}"]["needed_bytes"] = res["needed"]
    checked = sum(len(v) for res in (saved, loaded) if res for v in res["fetched"].values())
    return {"latency_ms": latency_ms, "loads_checked": checked, "rows": rows, "fetched_over_needed": fetched, "peak_memory_over_target": memory,
            "load_requests": requests, "loads_each_rep": each,
            "dcp_best": {"thread_count": saved["best"][0], "single_file_per_rank": saved["best"][1]}
            if saved["best"] else None}


def report(run: dict, args: argparse.Namespace) -> dict:
    """Print one run's table and ratios; the targets met or missed."""
    rows, libs = run["rows"], list(next(iter(run["rows"].values())))
    print(f"\n=== latency {run['latency_ms']:g} ms per request, server {args.server_kind}; slowest rank, "
          f"median [min-max] of {args.reps} ===")
    if run["dcp_best"]:
        print(f"dcp best: FsspecWriter(thread_count={run['dcp_best']['thread_count']}, single_file_per_rank="
              f"{run['dcp_best']['single_file_per_rank']}, sync_files=False), cached plans; async: process executor")
    print(f"{'row':<22}" + "".join(f"{lib:>24}" for lib in libs))
    for row, by in rows.items():
        cells = (f"{v['median']:.3f} [{v['min']:.3f}-{v['max']:.3f}]" for v in by.values())
        print(f"{row:<22}" + "".join(f"{c:>24}" for c in cells))
    for what, table in (("bytes fetched / needed", run["fetched_over_needed"]),
                        ("peak memory / target", run["peak_memory_over_target"]),
                        ("requests to the server", run["load_requests"])):
        for world, by in table.items():
            print(f"{what + ', ' + world:<34}" + "".join(f"  {lib} {by[lib]:.4g}" for lib in libs))
    print(f"all {run['loads_checked']} loads reproduced the saved values bit for bit ({', '.join(libs)})")
    ratios: dict[str, float] = {}
    checks: dict[str, bool] = {}
    for row, by in rows.items():
        if row == "async durable":
            continue
        for dcp in [lib for lib in libs if lib != "tensorckpt"]:
            r = by[dcp]["median"] / by["tensorckpt"]["median"]
            ratios[f"{row}: {dcp} / tensorckpt (time)"] = r
            checks[f"{row} vs {dcp}: {TARGETS['time']}"] = r >= 1.0
            if row == "load world 3 reshard" and run["latency_ms"] >= 20:
                checks[f"{row} vs {dcp}: {TARGETS['reshard_20ms']}"] = r >= 2.0
    for world, by in run["fetched_over_needed"].items():
        for lib in libs:
            ratios[f"bytes fetched / needed, {world}: {lib}"] = by[lib]
        if world == "world 3":
            checks[f"tensorckpt {TARGETS['bytes']}"] = by["tensorckpt"] <= 1.1
    for world, by in run["peak_memory_over_target"].items():
        checks[f"tensorckpt {world}: {TARGETS['memory']}"] = by["tensorckpt"] <= 1.2
    print("\nratios (time: DCP / tensorckpt, above 1 = tensorckpt faster)")
    for k, v in ratios.items():
        print(f"  {k:<58} x{v:.2f}")
    print("targets")
    for k, ok in checks.items():
        print(f"  {'met   ' if ok else 'MISSED'} {k}")
    return {**run, "ratios": ratios, "targets": checks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=512, help="whole state (bf16 params + fp32 Adam moments), MiB")
    ap.add_argument("--d-model", type=int, default=1024, help="model width (small for quick runs)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--latency-ms", type=lambda v: [float(x) for x in v.split(",")], default=[0.0, 20.0],
                    help="delay the proxy adds per request; one run each (default 0,20)")
    ap.add_argument("--dcp-threads", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4, 8],
                    help="FsspecWriter thread counts tried for DCP's best rows (x single_file_per_rank)")
    ap.add_argument("--no-dcp-best", dest="dcp_best", action="store_false", help="skip DCP's best-settings rows")
    ap.add_argument("--no-reshard", dest="reshard", action="store_false", help="skip the world-3 loads")
    ap.add_argument("--json", default=None, help="also write every figure here")
    ap.add_argument("--moto-buffer-mb", type=int, default=1024,
                    help="objects moto keeps in memory up to this size (MOTO_S3_DEFAULT_KEY_BUFFER_SIZE; moto's own "
                         "default, ~5 MiB, spools larger objects to temporary files and reads the whole file for every "
                         "ranged GET); 0: moto's default")
    ap.add_argument("--server", dest="server_kind", choices=SERVERS, default="moto",
                    help="moto: moto's server as released (a ranged GET copies the whole object); range: "
                         "benchmarks/moto_ranged.py, moto patched so a ranged GET reads only its range (not S3)")
    args = ap.parse_args()
    if args.moto_buffer_mb:
        os.environ["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(args.moto_buffer_mb << 20)  # the server inherits it

    keys = logical_keys(args.size_mb << 20, args.d_model)
    nbytes = sum(math.prod(s) * torch.tensor([], dtype=dt).element_size() for s, dt in keys.values())
    print(f"state: {len(keys)} tensors (bf16 model + fp32 Adam moments), {nbytes / 2**20:.1f} MiB; save world 2 "
          f"Shard(0){', reshard load world 3 Shard(1)' if args.reshard else ''}; {args.reps} reps; "
          f"server: {SERVERS[args.server_kind]}", flush=True)
    runs = []
    server = MotoServer()
    if args.server_kind == "range":
        server.command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "moto_ranged.py")]
    with server:
        server.make_bucket(BUCKET)
        for latency in args.latency_ms:
            runs.append(report(one_run(server, latency, args), args))
    out = {"benchmark": "bench_s3", "server": SERVERS[args.server_kind], "size_bytes": nbytes, "tensors": len(keys),
           "reps": args.reps, "runs": runs,
           "versions": {"python": platform.python_version(), "torch": torch.__version__,
                        "tensorstore": importlib.metadata.version("tensorstore"),
                        "s3fs": importlib.metadata.version("s3fs"), "moto": importlib.metadata.version("moto"),
                        "tensorckpt": tensorckpt.__version__, "cpus": os.cpu_count()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
