"""Planning at scale, on paper: the save and load planning of a simulated job
(default 8,960 ranks, the largest ByteCheckpoint reports, and 1,000+ tensors)
in one process, no I/O. Prints planning time and metadata bytes per world
size, to show they grow linearly.

    python benchmarks/bench_plan_scale.py [--ranks 1120 2240 4480 8960] [--layers 80]

Layout: FSDP-style Shard(0) of every parameter over all ranks (torch.chunk
split: ceil(n/world) rows each, the last ranks possibly empty), a transformer
of --layers layers (13 tensors each) plus embeddings. Load: every rank plans
reading its Shard(1) box at a world size 3/4 of the save's: parse the root
metadata and compute its boxes and the bytes it will fetch (TensorStore maps a
box to stored chunks itself; the number of stored objects each rank touches is
printed too).
"""

from __future__ import annotations

import argparse
import time

from tensorckpt.checkpoint import parse_root_bytes
from tensorckpt.format.metadata import RootMetadata, root_group_json
from tensorckpt.layout.boxes import Box, bytes_fetched
from tensorckpt.layout.plan import LocalItem, LocalPlan, build_save_plan
from tensorckpt.storage.location import parse


def model_shapes(layers: int, d: int = 8192, vocab: int = 128256) -> dict[str, tuple[int, ...]]:
    shapes = {"embed.weight": (vocab, d), "lm_head.weight": (vocab, d), "norm.weight": (d,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {p + n: (d, d) for n in ("q.weight", "k.weight", "v.weight", "o.weight")}
        shapes |= {p + n: (4 * d, d) for n in ("up.weight", "gate.weight")}
        shapes[p + "down.weight"] = (d, 4 * d)
        shapes |= {p + n: (d,) for n in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "q.bias", "o.bias")}
    return shapes


def chunk_box(shape, dim, world, rank) -> Box:
    n = shape[dim]
    size = -(-n // world)
    lo, hi = min(rank * size, n), min((rank + 1) * size, n)
    off = [0] * len(shape)
    off[dim] = lo
    sh = list(shape)
    sh[dim] = hi - lo
    return Box(tuple(off), tuple(sh))


def _chunks_overlapped(chunk, box: Box) -> int:
    n = 1
    for o, e, c in zip(box.offset, box.end, chunk):
        n *= ((e - 1) // c - o // c + 1) if e > o else 0
    return n


def run(world: int, shapes: dict) -> dict:
    t0 = time.perf_counter()
    plans = [
        LocalPlan(r, tuple(LocalItem(k, "bfloat16", s, chunk_box(s, 0, world, r)) for k, s in shapes.items()))
        for r in range(world)
    ]
    t1 = time.perf_counter()
    plan = build_save_plan(plans)
    root = root_group_json(RootMetadata(plan.entries, {}, world_size=world))
    t2 = time.perf_counter()
    meta = parse_root_bytes(parse("/sim"), root)  # what every loading rank does
    load_world = max(1, world * 3 // 4)
    pieces = fetched = 0
    for k, e in meta.tensors.items():  # one loading rank's plan (all ranks do this in parallel)
        want = chunk_box(e.shape, 1 if len(e.shape) > 1 else 0, load_world, load_world // 2)
        pieces += _chunks_overlapped(e.chunk_shape, want)
        fetched += bytes_fetched(e.shape, e.inner_chunk_shape, want, 2)
    t3 = time.perf_counter()
    return {
        "ranks": world,
        "tensors": len(shapes),
        "local_plans_s": t1 - t0,
        "save_plan_s": t2 - t1,
        "load_plan_s_per_rank": t3 - t2,
        "root_metadata_bytes": len(root),
        "read_pieces_per_rank": pieces,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[1120, 2240, 4480, 8960])
    ap.add_argument("--layers", type=int, default=80)
    args = ap.parse_args()
    shapes = model_shapes(args.layers)
    print(f"{'ranks':>6} {'tensors':>8} {'build local plans':>18} {'save plan':>10} {'load plan/rank':>15} {'metadata':>10} {'objects read/rank':>18}")
    for w in args.ranks:
        r = run(w, shapes)
        print(
            f"{r['ranks']:>6} {r['tensors']:>8} {r['local_plans_s']:>17.2f}s {r['save_plan_s']:>9.2f}s "
            f"{r['load_plan_s_per_rank']:>14.3f}s {r['root_metadata_bytes'] / 1024:>8.0f}KiB {r['read_pieces_per_rank']:>18}"
        )


if __name__ == "__main__":
    main()
