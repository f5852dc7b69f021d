"""Single-process save/load throughput: tensorckpt vs torch.save vs torch DCP.

    .venv/bin/python benchmarks/bench_single.py [--size-gib 1.0] [--reps 3] [--dir DIR] [--json PATH]

One deterministic fp32 transformer-like state dict is saved and loaded by each
method, --reps times, round-robin. Every save is durable before the clock
stops (tensorckpt: fsync of its files and directories before its atomic rename; torch.save: fsync of the
file and its directory; DCP: FileSystemWriter's default sync_files=True, an
fsync per file). Every load fills the same preallocated target (zeroed
beforehand), is checked with torch.equal, and starts from a dropped page cache
when the script may drop it (root). GB/s are 1e9 bytes of tensor data per second.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

import tensorckpt
from common import drop_caches, torch_save

DCP_NO_PG_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"


def build_state(size_bytes: int, d: int, seed: int) -> dict:
    """Embedding [vocab, d], then layers of q/k/v/o [d, d], mlp up [4d, d] and
    down [d, 4d], two layernorms (weight, bias [d]) until ~size_bytes; final norm."""
    g = torch.Generator().manual_seed(seed)
    per_layer = (4 * d * d + 8 * d * d + 4 * d) * 4
    vocab = min(32000, max(256, size_bytes // 8 // (d * 4)))
    layers = max(1, round((size_bytes - vocab * d * 4) / per_layer))
    model = {"embed.weight": torch.randn(vocab, d, generator=g)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes = {"attn.q.weight": (d, d), "attn.k.weight": (d, d), "attn.v.weight": (d, d),
                  "attn.o.weight": (d, d), "mlp.up.weight": (4 * d, d), "mlp.down.weight": (d, 4 * d),
                  "ln1.weight": (d,), "ln1.bias": (d,), "ln2.weight": (d,), "ln2.bias": (d,)}
        model.update({p + k: torch.randn(s, generator=g) for k, s in shapes.items()})
    model["norm.weight"] = torch.randn(d, generator=g)
    return {"model": model, "step": 1000}


def tensors(state: dict, prefix: str = ""):
    for k, v in state.items():
        if isinstance(v, dict):
            yield from tensors(v, f"{prefix}{k}/")
        elif isinstance(v, torch.Tensor):
            yield prefix + k, v


def empty_like_state(state: dict) -> dict:
    return {k: empty_like_state(v) if isinstance(v, dict) else
            torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def copy_into(dst: dict, src: dict) -> None:
    for k, v in dst.items():
        if isinstance(v, dict):
            copy_into(v, src[k])
        elif isinstance(v, torch.Tensor):
            v.copy_(src[k])
        else:
            dst[k] = src[k]


def check_equal(got: dict, want: dict, method: str, prefix: str = "") -> None:
    if set(got) != set(want):
        sys.exit(f"FAIL {method}: keys differ at {prefix or '/'}: {sorted(set(got) ^ set(want))}")
    for k, w in want.items():
        g = got[k]
        if isinstance(w, dict):
            check_equal(g, w, method, f"{prefix}{k}/")
        elif isinstance(w, torch.Tensor):
            if not (isinstance(g, torch.Tensor) and g.dtype == w.dtype and torch.equal(g, w)):
                sys.exit(f"FAIL {method}: tensor {prefix}{k} differs from the original after load")
        elif g != w:
            sys.exit(f"FAIL {method}: value {prefix}{k} is {g!r}, expected {w!r}")


# --- the three methods: save(state, dir), load(target, dir) -------------------

def tc_save(state, path):
    tensorckpt.save(state, path)


def tc_load(target, path):
    tensorckpt.load(target, path)


def torch_load(target, path):
    loaded = torch.load(os.path.join(path, "ckpt.pt"), mmap=True, weights_only=True)
    copy_into(target, loaded)


def dcp_save(state, path):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", DCP_NO_PG_WARNING)
        dcp.save(state, checkpoint_id=path, no_dist=True)


def dcp_load(target, path):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", DCP_NO_PG_WARNING)
        dcp.load(target, checkpoint_id=path, no_dist=True)


METHODS = {"tensorckpt": (tc_save, tc_load), "torch.save": (torch_save, torch_load), "dcp": (dcp_save, dcp_load)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="state size in GiB (default 1.0)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per method (default 3)")
    ap.add_argument("--dir", default=None, help="parent of the scratch directory (default: the system temp dir)")
    ap.add_argument("--d-model", type=int, default=1024, help="hidden size (default 1024)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results JSON to this path")
    args = ap.parse_args()

    t0 = time.perf_counter()
    state = build_state(int(args.size_gib * 2**30), args.d_model, args.seed)
    nbytes = sum(t.nbytes for _, t in tensors(state))
    ntensors = sum(1 for _ in tensors(state))
    print(f"state: {ntensors} fp32 tensors, {nbytes / 2**30:.3f} GiB ({nbytes / 1e9:.3f} GB), "
          f"d_model={args.d_model}, built in {time.perf_counter() - t0:.1f}s")
    target = empty_like_state(state)
    scratch = tempfile.mkdtemp(prefix="tensorckpt-bench-", dir=args.dir)
    print(f"scratch dir: {scratch}")

    times = {m: {"save_s": [], "load_s": []} for m in METHODS}
    cold_failure = "not attempted"
    try:
        for rep in range(args.reps):
            for name, (save, load) in METHODS.items():
                path = os.path.join(scratch, "ckpt")
                shutil.rmtree(path, ignore_errors=True)
                os.sync()  # earlier writeback / deletes are not charged to this save
                t = time.perf_counter()
                save(state, path)
                times[name]["save_s"].append(time.perf_counter() - t)

                for _, tt in tensors(target):
                    tt.zero_()
                target["step"] = None
                cold_failure = drop_caches()
                t = time.perf_counter()
                load(target, path)
                times[name]["load_s"].append(time.perf_counter() - t)
                check_equal(target, state, name)
                print(f"  rep {rep + 1}/{args.reps} {name:<10} save {times[name]['save_s'][-1]:6.2f}s  "
                      f"load {times[name]['load_s'][-1]:6.2f}s  (verified)", flush=True)
                shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    results = {}
    for name, t in times.items():
        results[name] = {**t, "save_GBps": nbytes / 1e9 / statistics.median(t["save_s"]),
                         "load_GBps": nbytes / 1e9 / statistics.median(t["load_s"])}
    ratios = {f"tensorckpt/{other}": {op: results["tensorckpt"][op] / results[other][op] for op in ("save_GBps", "load_GBps")}
              for other in ("dcp", "torch.save")}

    loads = "cold (page cache dropped before each load)" if cold_failure is None else f"WARM (could not drop page cache: {cold_failure})"
    print(f"\nloads: {loads}; saves: durable (fsync) before the clock stops; DCP FileSystemWriter sync_files=True (default)")
    print(f"medians over {args.reps} reps, {nbytes / 1e9:.3f} GB of tensor data\n")
    fmt = lambda xs: " ".join(f"{x:5.2f}" for x in xs)  # noqa: E731
    w = max(len("save s (each rep)"), 6 * args.reps) + 2
    print(f"{'method':<12}{'save GB/s':>11}{'load GB/s':>11}   {'save s (each rep)':<{w}}{'load s (each rep)'}")
    for name, r in results.items():
        print(f"{name:<12}{r['save_GBps']:>11.3f}{r['load_GBps']:>11.3f}   {fmt(r['save_s']):<{w}}{fmt(r['load_s'])}")
    print()
    for k, r in ratios.items():
        print(f"{k:<22} save x{r['save_GBps']:.2f}   load x{r['load_GBps']:.2f}   (>1: tensorckpt faster)")

    report = {
        "benchmark": "bench_single", "size_bytes": nbytes, "num_tensors": ntensors, "dtype": "float32",
        "d_model": args.d_model, "seed": args.seed, "reps": args.reps, "scratch_parent": os.path.dirname(scratch),
        "cold_loads": cold_failure is None, "drop_caches_error": cold_failure,
        "durability": {"tensorckpt": "fsync of each file + dir written, then atomic rename commit", "torch.save": "fsync file + dir",
                       "dcp": "FileSystemWriter sync_files=True (fsync per file + .metadata)"},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "tensorstore": importlib.metadata.version("tensorstore"),
                     "tensorckpt": tensorckpt.__version__, "cpus": os.cpu_count()},
        "results": results, "ratios": ratios,
    }
    print("\n" + json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
