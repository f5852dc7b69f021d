"""Many small tensors, and peak host memory of a load: tensorckpt vs torch.save.

    .venv/bin/python benchmarks/bench_small.py [--tensors 5000] [--numel 4096] [--reps 3] [--dir DIR]

Save: a state of --tensors float32 tensors of --numel elements each (default
5,000 x 16 KiB, like the many small parameters of a real model: norms, biases,
embeddings of small vocabularies), saved durably by tensorckpt.save and by
torch.save (+ fsync of the file and its directory); medians of --reps.

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

import torch

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=5000)
    ap.add_argument("--numel", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--load-mib", type=int, default=1024, help="size of the load-memory checkpoint (default 1024)")
    args = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="tensorckpt-bench-small-", dir=args.dir)
    try:
        g = torch.Generator().manual_seed(0)
        state = {f"t{i}": torch.randn(args.numel, generator=g) for i in range(args.tensors)}
        nbytes = sum(t.nbytes for t in state.values())
        print(f"{args.tensors} float32 tensors x {args.numel} elements = {nbytes / 1e6:.1f} MB")
        times = {"tensorckpt": [], "torch.save": []}
        for _ in range(args.reps):
            for name, fn in (("tensorckpt", tensorckpt.save), ("torch.save", torch_save)):
                path = os.path.join(scratch, name)
                shutil.rmtree(path, ignore_errors=True)
                os.sync()
                t = time.perf_counter()
                fn(state, path)
                times[name].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in times.items():
            print(f"save {k:<11} median {med[k]:.3f} s   each: " + " ".join(f"{x:.3f}" for x in v))
        print(f"save time tensorckpt / torch.save: x{med['tensorckpt'] / med['torch.save']:.2f} (target <= 2)")

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
