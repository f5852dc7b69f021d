"""Conversion cost against the cheapest thing that moves the same bytes.

    import   torch DCP directory -> tensorckpt (tensorckpt.convert)
             vs  cp -r of the DCP directory + sync (the floor: read and write every byte once)
    export   tensorckpt -> safetensors (tensorckpt.convert(..., to_format="safetensors"))
             vs  safetensors.torch.save_file of the same tensors, already in memory, + fsync
             and vs  reading the checkpoint whole (tensorckpt.open().read) + save_file + fsync,
                 the same work done by materialising the state (export streams in bounded memory)

The state is a transformer-like dict of float32 tensors (about ``--size-gib``),
written once by ``torch.distributed.checkpoint.save`` (one process). Each
pair runs ``--reps`` times in alternating order (A B, B A, ...) and the
medians are compared; every result is checked (the converted checkpoint's
tensors equal the source's, the export's too). The page cache is dropped
before each run when the script runs as root; otherwise reads may be cached
(said in the output).

    python benchmarks/bench_convert.py [--size-gib 1.0] [--reps 3] [--dir PARENT]
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import drop_caches

import tensorckpt


def make_state(size_gib: float, d: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per_layer = 12 * d * d * 4
    layers = max(1, int(size_gib * 2**30 // per_layer))
    sd = {}
    for i in range(layers):
        sd[f"layers.{i}.attn.qkv.weight"] = torch.randn(3 * d, d, generator=g)
        sd[f"layers.{i}.attn.out.weight"] = torch.randn(d, d, generator=g)
        sd[f"layers.{i}.mlp.up.weight"] = torch.randn(4 * d, d, generator=g)
        sd[f"layers.{i}.mlp.down.weight"] = torch.randn(d, 4 * d, generator=g)
        sd[f"layers.{i}.norm.weight"] = torch.randn(d, generator=g)
    return sd


def timed(fn) -> float:
    drop_caches()  # a no-op without root (reported once at the start)
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cp_sync(src: str, dst: str) -> None:
    subprocess.run(["cp", "-r", src, dst], check=True)
    os.sync()


def save_file_sync(sd: dict, dst: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(dst)
    path = os.path.join(dst, "model.safetensors")
    save_file(sd, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_save(ck: str, dst: str) -> None:
    c = tensorckpt.open(ck)
    save_file_sync({k: c.read(k) for k in c.keys()}, dst)  # noqa: SIM118 (a Checkpoint, not a dict)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    root = tempfile.mkdtemp(prefix="bench-convert-", dir=args.dir)
    try:
        sd = make_state(args.size_gib, args.d_model, args.seed)
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        src = os.path.join(root, "dcp")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, checkpoint_id=src)
        cache = drop_caches()
        print(f"state: {len(sd)} tensors, {nbytes / 2**30:.2f} GiB; page cache "
              f"{'dropped before each run' if cache is None else 'NOT dropped (' + cache + ')'}")
        times: dict[str, list[float]] = {"convert": [], "cp": [], "export": [], "save_file": [], "read+save_file": []}
        ok = True
        for rep in range(args.reps):
            pair = [("convert", lambda r=rep: tensorckpt.convert(src, os.path.join(root, f"ck{r}"), progress=False)),
                    ("cp", lambda r=rep: cp_sync(src, os.path.join(root, f"cp{r}")))]
            for name, fn in pair if rep % 2 == 0 else pair[::-1]:
                times[name].append(timed(fn))
            ck = os.path.join(root, f"ck{rep}")
            pair = [("export", lambda r=rep: tensorckpt.convert(os.path.join(root, f"ck{r}"), os.path.join(root, f"st{r}"),
                                                                 to_format="safetensors", progress=False)),
                    ("save_file", lambda r=rep: save_file_sync(sd, os.path.join(root, f"sf{r}"))),
                    ("read+save_file", lambda r=rep: read_save(os.path.join(root, f"ck{r}"), os.path.join(root, f"rs{r}")))]
            for name, fn in pair if rep % 2 == 0 else pair[::-1]:
                times[name].append(timed(fn))
            c = tensorckpt.open(ck)
            back = load_file(os.path.join(root, f"st{rep}", "model.safetensors"))
            for k, v in sd.items():
                if not (torch.equal(c.read(k), v) and torch.equal(back[k], v)):
                    ok = False
                    print(f"FAIL: {k} differs after conversion")
            for name in ("cp", "sf", "st", "ck", "rs"):
                shutil.rmtree(os.path.join(root, f"{name}{rep}"), ignore_errors=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        gib = nbytes / 2**30
        for a, b in (("convert", "cp"), ("export", "save_file"), ("export", "read+save_file")):
            ratio = med[a] / med[b]
            print(f"{a:<8} {med[a]:7.2f} s ({gib / med[a]:5.2f} GiB/s)   {b:<14} {med[b]:7.2f} s "
                  f"({gib / med[b]:5.2f} GiB/s)   ratio {ratio:4.2f}x   runs {[round(x, 2) for x in times[a]]} vs "
                  f"{[round(x, 2) for x in times[b]]}")
        print("OK" if ok else "FAIL")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bytes": nbytes, "seconds": times, "median": med}, f, indent=1)
        if not ok:
            sys.exit(1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
