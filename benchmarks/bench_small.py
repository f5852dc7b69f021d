"""Many small tensors (save and load, tensorckpt vs torch DCP vs torch.save),
and peak host memory of a load.

    .venv/bin/python benchmarks/bench_small.py [--tensors 5000] [--numel 4096] [--reps 3] [--dir DIR]
        [--load-mib 1024] [--dcp-threads 4]

Many small tensors: a state of --tensors float32 tensors of --numel elements
each (default 5,000 x 16 KiB, like the many small parameters of a real model:
norms, biases, embeddings of small vocabularies), saved durably by
tensorckpt.save, by torch DCP (``no_dist``; its defaults, and
``FileSystemWriter(thread_count=--dcp-threads)``) and by torch.save (+ fsync of
the file and its directory), then loaded into a preallocated zeroed target by
each (torch.save's with torch.load(mmap=True) + copy_), cold (page cache
dropped first where permitted) and warm, every load checked with
torch.equal. The methods' order rotates between --reps repetitions; medians
[min-max] and tensorckpt's time against each peer's (above 1: tensorckpt is
faster).

Load memory: a fresh process allocates the target state, then loads a ~1 GiB
checkpoint into it (page cache dropped first where permitted). Printed: the
peak RSS during the load (Linux VmHWM, reset just before it) above the
process's RSS before the target existed, relative to the target's size (1.0 =
no memory beyond the target), for tensorckpt.load and for
torch.load(mmap=True) + copy_ (mapped file pages count as RSS).
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
from common import drop_caches, torch_save


MEMORY_PROBE = r"""
import json, os, sys, time, torch, tensorckpt

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

method, path, n, numel = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
base = rss("VmRSS:")  # after imports, before the target exists
target = {f"t{i}": torch.zeros(numel) for i in range(n)}
size = sum(t.nbytes for t in target.values())
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
t = time.perf_counter()
if method == "tensorckpt":
    tensorckpt.load(target, path)
else:
    loaded = torch.load(os.path.join(path, "ckpt.pt"), mmap=True, weights_only=True)
    for k, v in target.items():
        v.copy_(loaded[k])
    del loaded
dt = time.perf_counter() - t
peak = rss("VmHWM:")
print(json.dumps({"size": size, "peak_over_base": peak - base, "seconds": dt}))
"""


def _dcp_save(threads: int | None):
    def save(state, path):
        writer = dcp.FileSystemWriter(path) if threads is None else dcp.FileSystemWriter(path, thread_count=threads)
        dcp.save(state, storage_writer=writer, no_dist=True)
    return save


def _torch_load(target, path) -> None:
    loaded = torch.load(os.path.join(path, "ckpt.pt"), mmap=True, weights_only=True)
    for k, v in target.items():
        v.copy_(loaded[k])


SAVES = {
    "tensorckpt": tensorckpt.save,
    "dcp": _dcp_save(None),
    "dcp threads": None,  # set in many(): thread_count=--dcp-threads
    "torch.save": torch_save,
}
LOADS = {
    "tensorckpt": tensorckpt.load,
    "dcp": lambda target, path: dcp.load(target, checkpoint_id=path, no_dist=True),
    "dcp threads": lambda target, path: dcp.load(target, checkpoint_id=path, no_dist=True),
    "torch.save": _torch_load,
}


def _summary(times: dict[str, list[float]], what: str) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"  {what} {k:<12} median {med[k]:.3f} s  [{min(v):.3f}-{max(v):.3f}]")
    print(f"  {what}: tensorckpt vs " + ", ".join(
        f"{k} x{med[k] / med['tensorckpt']:.2f}" for k in times if k != "tensorckpt") + " (time ratio: > 1 = tensorckpt faster)")


def many(state: dict, scratch: str, reps: int, dcp_threads: int) -> None:
    """Save and load ``state`` with every method, rotated per rep; print medians and ratios."""
    saves = {**SAVES, "dcp threads": _dcp_save(dcp_threads)}
    names = list(saves)
    save_t: dict[str, list[float]] = {k: [] for k in names}
    load_t: dict[str, dict[str, list[float]]] = {"cold": {k: [] for k in names}, "warm": {k: [] for k in names}}
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    cold = drop_caches() is None
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            path = os.path.join(scratch, name.replace(" ", "-"))
            shutil.rmtree(path, ignore_errors=True)
            os.sync()
            t = time.perf_counter()
            saves[name](state, path)
            save_t[name].append(time.perf_counter() - t)
            for how in ("cold", "warm"):
                for v in target.values():
                    v.zero_()
                if how == "cold":
                    drop_caches()
                t = time.perf_counter()
                LOADS[name](target, path)
                load_t[how][name].append(time.perf_counter() - t)
                bad = [k for k in state if not torch.equal(target[k], state[k])]
                if bad:
                    sys.exit(f"FAIL: {name} loaded {bad[0]!r} wrong")
            shutil.rmtree(path, ignore_errors=True)
    print(f"{reps} reps, methods rotated; loads {'cold (page cache dropped)' if cold else 'WARM only (cannot drop caches)'}, "
          "then warm; every load checked")
    _summary(save_t, "save")
    _summary(load_t["cold"], "load cold" if cold else "load (1st)")
    _summary(load_t["warm"], "load warm")


def main() -> None:
    warnings.filterwarnings("ignore", r"torch\.distributed is disabled")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=5000)
    ap.add_argument("--numel", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--load-mib", type=int, default=1024, help="size of the load-memory checkpoint (default 1024)")
    ap.add_argument("--dcp-threads", type=int, default=4, help="FileSystemWriter(thread_count=) of the 'dcp threads' rows")
    args = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="tensorckpt-bench-small-", dir=args.dir)
    try:
        g = torch.Generator().manual_seed(0)
        state = {f"t{i}": torch.randn(args.numel, generator=g) for i in range(args.tensors)}
        nbytes = sum(t.nbytes for t in state.values())
        print(f"{args.tensors} float32 tensors x {args.numel} elements = {nbytes / 1e6:.1f} MB")
        many(state, scratch, args.reps, args.dcp_threads)

        # peak memory of a load: --load-mib in tensors of 4 MiB
        n, numel = max(1, args.load_mib // 4), 1 << 20
        big = {f"t{i}": torch.full((numel,), float(i)) for i in range(n)}
        for name, fn in (("tensorckpt", tensorckpt.save), ("torch.save", torch_save)):
            fn(big, os.path.join(scratch, f"big-{name}"))
        del big
        for name in ("tensorckpt", "torch.save"):
            drop_caches()
            r = subprocess.run([sys.executable, "-c", MEMORY_PROBE, name, os.path.join(scratch, f"big-{name}"), str(n), str(numel)],
                               capture_output=True, text=True, check=True)
            m = json.loads(r.stdout)
            print(f"load {name:<11} {m['seconds']:.2f} s; peak host memory (RSS above the process before the "
                  f"target existed) {m['peak_over_base'] / m['size']:.2f}x the target ({m['size'] / 2**30:.2f} GiB)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
