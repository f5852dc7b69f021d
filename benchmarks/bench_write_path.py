"""What a durable save costs the machine: wall time and this process's CPU
(user and kernel) of tensorckpt's save with large objects written around the
page cache (O_DIRECT, the default) and through it (TENSORCKPT_DIRECT_IO=0),
against torch DCP's save and torch.save + fsync, on the same state in one
run; and an async save's time to durable through the helper process, each
way.

    .venv/bin/python benchmarks/bench_write_path.py [--size-gib 1.0] [--reps 5] [--dir DIR] [--json PATH]

One process, no process group (DCP's ``no_dist``). The state is ``--size-gib``
of fp32 tensors of 4096 x 1024 (16 MiB each, as bench_background.py). Each
repetition runs every method in an order that rotates; the CPU is
``getrusage(RUSAGE_SELF)`` around the call (every thread of this process;
the kernel's own write-back threads are not in it). Each save is checked by
loading it back once, after the reps."""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

import tensorckpt
from common import torch_save  # type: ignore[import-not-found]


def make_state(size_bytes: int) -> dict[str, torch.Tensor]:
    n = max(1, size_bytes // (4096 * 1024 * 4))
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.rand(4096, 1024, generator=g) for i in range(n)}


def tc(direct: bool):
    def save(state, path):
        os.environ["TENSORCKPT_DIRECT_IO"] = "1" if direct else "0"
        try:
            tensorckpt.save(state, path)
        finally:
            os.environ.pop("TENSORCKPT_DIRECT_IO", None)
    return save


def tc_async(direct: bool):
    """An async save through the helper process (time to durable; the CPU
    column is this process's only, not the helper's)."""
    savers: list[tensorckpt.AsyncSaver] = []

    def save(state, path):
        if not savers:  # the helper reads TENSORCKPT_DIRECT_IO when it starts: one saver per setting
            os.environ["TENSORCKPT_DIRECT_IO"] = "1" if direct else "0"
            try:
                savers.append(tensorckpt.AsyncSaver(executor="process"))
            finally:
                os.environ.pop("TENSORCKPT_DIRECT_IO", None)
        savers[0].save(state, path).wait()
    save.savers = savers  # type: ignore[attr-defined]
    return save


def dcp(state, path):
    import torch.distributed.checkpoint as dcp_

    dcp_.save(state, checkpoint_id=path, no_dist=True)


METHODS = {"tensorckpt O_DIRECT": tc(True), "tensorckpt page cache": tc(False), "dcp": dcp, "torch.save": torch_save}
if hasattr(os, "memfd_create"):
    METHODS |= {"async O_DIRECT": tc_async(True), "async page cache": tc_async(False)}


def check(name: str, state: dict[str, torch.Tensor], path: str) -> bool:
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    if name.startswith(("tensorckpt", "async")):
        tensorckpt.load(target, path)
    elif name == "dcp":
        import torch.distributed.checkpoint as dcp_

        dcp_.load(target, checkpoint_id=path, no_dist=True)
    else:
        target = torch.load(os.path.join(path, "ckpt.pt"), weights_only=True)
    return all(torch.equal(target[k], v) for k, v in state.items())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="parent of the scratch directory (a fresh one on the disk to measure)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    state = make_state(int(args.size_gib * 2**30))
    nbytes = sum(t.nbytes for t in state.values())
    scratch = tempfile.mkdtemp(prefix="tensorckpt-bench-write-", dir=args.dir)
    names = list(METHODS)
    res: dict[str, dict[str, list[float]]] = {n: {"wall": [], "user": [], "sys": []} for n in names}
    ok = True
    print(f"state: {len(state)} fp32 tensors, {nbytes / 2**30:.3f} GiB; {args.reps} reps, order rotating", flush=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in names:  # warm-up: imports, thread pools, plans
                METHODS[name](state, os.path.join(scratch, "warm"))
                shutil.rmtree(os.path.join(scratch, "warm"))
            for rep in range(args.reps):
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    path = os.path.join(scratch, f"{name.replace(' ', '_')}_{rep}")
                    os.sync()
                    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                    METHODS[name](state, path)
                    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
                    res[name]["wall"].append(wall)
                    res[name]["user"].append(r1.ru_utime - r0.ru_utime)
                    res[name]["sys"].append(r1.ru_stime - r0.ru_stime)
                    if rep == args.reps - 1:
                        good = check(name, state, path)
                        ok &= good
                        if not good:
                            print(f"FAIL: {name} did not load back what it saved")
                    shutil.rmtree(path)
    finally:
        for m in METHODS.values():
            for saver in getattr(m, "savers", []):
                saver.close()
        shutil.rmtree(scratch, ignore_errors=True)
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in res.items()}
    print(f"\n{'method':<24}{'wall s':>8}{'GB/s':>7}{'user CPU s':>12}{'kernel CPU s':>14}   wall range, kernel range")
    for n in names:
        m, r = med[n], res[n]
        print(f"{n:<24}{m['wall']:>8.3f}{nbytes / m['wall'] / 1e9:>7.2f}{m['user']:>12.2f}{m['sys']:>14.2f}   "
              f"{min(r['wall']):.2f}-{max(r['wall']):.2f}, {min(r['sys']):.2f}-{max(r['sys']):.2f}")
    base = med["tensorckpt O_DIRECT"]
    print()
    for n in ("tensorckpt page cache", "dcp", "torch.save"):
        print(f"tensorckpt O_DIRECT / {n:<22} wall time x{base['wall'] / med[n]['wall']:.2f}, "
              f"CPU time x{(base['user'] + base['sys']) / (med[n]['user'] + med[n]['sys']):.2f} (< 1: tensorckpt less)")
    if "async O_DIRECT" in med:
        a, b = med["async O_DIRECT"]["wall"], med["async page cache"]["wall"]
        print(f"async save, time to durable: O_DIRECT / page cache x{a / b:.2f} (through the helper process)")
    print("all saves loaded back bit for bit" if ok else "FAIL")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "bench_write_path", "size_bytes": nbytes, "reps": args.reps, "results": res,
                       "medians": med}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
