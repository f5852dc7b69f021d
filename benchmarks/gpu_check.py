"""The CUDA path of save / async_save / load, checked where a GPU exists.

    .venv/bin/python benchmarks/gpu_check.py [--size-mib 512] [--saves 20] [--dir DIR]

On a machine with CUDA (one process, device 0):

1. bit-exact round trips of CUDA tensors (fp32, bf16, fp16, int64, a
   non-contiguous view) through ``save`` / ``async_save`` / ``load`` into
   CUDA targets;
2. parameters mutated right after ``async_save`` returns do not change what
   was saved (the device-to-host copies are finished before it returns);
3. the pinned staging pool is reused: over ``--saves`` async saves of the
   same state, no staging bytes are allocated after the first and host RSS
   does not grow by more than one state's size;
4. figures: tensorckpt's async stall (its device-to-host staging) against a
   plain ``tensor.to("cpu", non_blocking=True)`` into pinned buffers, and
   against ``torch.distributed.checkpoint.async_save`` on the same state.

Without CUDA it prints that it skipped and exits 0; ``--cpu`` runs the same
checks on CPU tensors (tests/test_benchmarks.py runs it both ways, so the
script does not rot). Any failed check prints FAIL and exits 1.
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

import tensorckpt


def rss_bytes() -> int:
    """This process's resident set size (Linux), 0 where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def make_state(size_bytes: int, dev: torch.device) -> dict[str, torch.Tensor]:
    """~size_bytes of fp32 weights plus small tensors of other dtypes, all on dev."""
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = max(1, size_bytes // (4 * 4096 * 8))
    state = {f"layer{i}.weight": torch.randn(rows, 4096, generator=g).to(dev) for i in range(8)}
    state["bf16"] = torch.randn(257, 33, generator=g).to(torch.bfloat16).to(dev)
    state["fp16"] = torch.randn(1000, generator=g).to(torch.float16).to(dev)
    state["steps"] = torch.arange(17, dtype=torch.int64).to(dev)
    state["view"] = torch.randn(64, 96, generator=g).to(dev).t()  # non-contiguous
    return state


def like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, 7) if v.dtype.is_floating_point else torch.zeros_like(v) for k, v in state.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ bitwise, or that are not on a's device in b."""
    bad = []
    for k, v in a.items():
        w = b[k]
        if w.device != v.device or v.dtype != w.dtype or v.shape != w.shape:
            bad.append(f"{k} (device {w.device}, {w.dtype}, {tuple(w.shape)})")
        elif not torch.equal(bits(v), bits(w)):
            bad.append(k)
    return bad


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def check(ok: bool, what: str, failures: list[str]) -> None:
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def run(size_bytes: int, saves: int, where: str, dev: torch.device) -> int:
    failures: list[str] = []
    state = make_state(size_bytes, dev)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    print(f"state: {len(state)} tensors, {nbytes / 2**20:.1f} MiB on {name}")

    # 1. round trips into CUDA targets
    tensorckpt.save(state, os.path.join(where, "sync"))
    out = like(state)
    tensorckpt.load(out, os.path.join(where, "sync"))
    bad = same(state, out)
    check(not bad, f"save -> load into {dev.type} targets is bit-exact" + (f": {bad}" if bad else ""), failures)

    # 2. async_save, then mutate at once: the saved bytes are those at the call
    expected = {k: v.clone() for k, v in state.items()}
    h = tensorckpt.async_save(state, os.path.join(where, "async"))
    for v in state.values():
        v.add_(1)
    h.wait()
    out = like(state)
    tensorckpt.load(out, os.path.join(where, "async"))
    bad = same(expected, out)
    check(not bad, "async_save then mutating the parameters: what was saved is what was passed"
          + (f": {bad}" if bad else ""), failures)

    # 3. the pinned pool is reused over many saves
    stalls, allocated, rss = [], [], []
    for i in range(saves):
        path = os.path.join(where, f"pool{i % 2}")
        shutil.rmtree(path, ignore_errors=True)
        h = tensorckpt.async_save(state, path)
        stalls.append(h.stats.stall_seconds)
        allocated.append(h.stats.staging_bytes_allocated)
        h.wait()
        rss.append(rss_bytes())
    check(all(a == 0 for a in allocated[1:]), f"staging buffers reused: bytes allocated per save {allocated[:3]}...", failures)
    growth = rss[-1] - rss[1] if len(rss) > 1 else 0
    check(growth <= nbytes, f"host RSS growth over saves 2..{saves}: {growth / 2**20:.1f} MiB "
          f"(bound: one state, {nbytes / 2**20:.1f} MiB)", failures)

    # 4. figures: plain D2H into pinned buffers; DCP's async_save stall
    cuda = dev.type == "cuda"
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=cuda) for k, v in state.items()}
    d2h = []
    for _ in range(5):
        sync(cuda)
        t = time.perf_counter()
        for k, v in state.items():
            pinned[k].copy_(v, non_blocking=cuda)
        sync(cuda)
        d2h.append(time.perf_counter() - t)
    steady = statistics.median(stalls[2:]) if len(stalls) > 2 else stalls[-1]
    print(f"plain D2H into pinned: {statistics.median(d2h) * 1e3:.1f} ms "
          f"({nbytes / statistics.median(d2h) / 1e9:.2f} GB/s)")
    print(f"tensorckpt async stall (steady, median of {len(stalls) - 2}): {steady * 1e3:.1f} ms "
          f"(x{steady / statistics.median(d2h):.2f} plain D2H)")
    try:
        import torch.distributed.checkpoint as dcp

        dstalls = []
        for i in range(5):
            path = os.path.join(where, f"dcp{i % 2}")
            shutil.rmtree(path, ignore_errors=True)
            t = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=path)
            dstalls.append(time.perf_counter() - t)
            fut.result()
        ds = statistics.median(dstalls[1:])
        print(f"DCP async_save stall (median of 4 after the first): {ds * 1e3:.1f} ms "
              f"(tensorckpt x{steady / ds:.2f} of it)")
    except Exception as e:  # noqa: BLE001 - a figure, not a check
        print(f"DCP async_save not measured: {type(e).__name__}: {e}")
    print("FAIL: " + "; ".join(failures) if failures else "all checks passed")
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=float, default=512, help="size of the CUDA state")
    ap.add_argument("--saves", type=int, default=20, help="async saves in the pool-reuse check")
    ap.add_argument("--dir", default=None, help="parent of the scratch directory (default: system temp dir)")
    ap.add_argument("--cpu", action="store_true",
                    help="run the same checks on CPU tensors (tests the script itself; no CUDA figures)")
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: skipped: no CUDA device here (torch.cuda.is_available() is False)")
        return 0
    dev = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    where = tempfile.mkdtemp(prefix="tensorckpt-gpu-", dir=args.dir)
    try:
        return run(int(args.size_mib * 2**20), args.saves, where, dev)
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
