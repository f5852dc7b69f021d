"""Planning at scale, on paper: the save and load planning of a simulated job
(default 8,960 ranks, the largest ByteCheckpoint reports, and 1,000+ tensors)
in one process, no I/O. Prints, per world size, the time of each planning
step on the critical path, the bytes the collectives carry and the root
metadata size, to show that they grow linearly; and, for format 1.3's
digests (spec 9.8), the largest array ``zarr.json`` (one digest per chunk)
and the bytes of one rank's digests in the result gather (at 8,960 ranks:
root 239 KiB, largest array document 569 KiB, all array documents 582 MB,
34 KB of digests per rank).

    python benchmarks/bench_plan_scale.py [--ranks 1120 2240 4480 8960] [--layers 80]

Layout: FSDP-style Shard(0) of every parameter over all ranks (torch.chunk
split: ceil(n/world) rows each, the last ranks possibly empty), a transformer
of --layers layers (13 tensors each) plus embeddings.

Save, as in ``tensorckpt.engine.save``:

- local: one rank builds its LocalPlan from LocalItem objects and pickles it
  (every rank does this at once; the other ranks' plans are built with the
  vectorized ``LocalItems.from_arrays``, checked equal for the timed rank, to
  keep the simulation short: that part is not planning, not in the total);
- rank 0: unpickles every rank's plan (the gather), builds the global plan
  and the root metadata, pickles the plan for the broadcast;
- receive: one rank unpickles the plan and picks its writes.

Load: every rank plans reading its Shard(1) box at a world size 3/4 of the
save's: parse the root metadata and compute its boxes and the bytes it will
fetch (TensorStore maps a box to stored chunks itself; the number of stored
objects each rank touches is printed too).

``total`` is local + rank 0 + receive + load: the planning on the critical
path of one save and one load.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import pickle
import resource
import time

import numpy as np

from tensorckpt.checkpoint import parse_root_bytes
from tensorckpt.format.arrays import array_json, chunk_count
from tensorckpt.format.metadata import RootMetadata, new_checkpoint_id, root_group_json
from tensorckpt.layout.boxes import Box, bytes_fetched, read_plan
from tensorckpt.layout.plan import LocalItem, LocalItems, LocalPlan, build_save_plan
from tensorckpt.storage.location import parse

DTYPE = "bfloat16"


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


class Shard0Plans:
    """Every rank's Shard(0) local plan, built with numpy: a template of
    offsets (zeros) and sizes (the global shapes), then each rank's rows
    along dimension 0 filled in."""

    def __init__(self, shapes: dict, world: int) -> None:
        self.specs = [(k, DTYPE, s) for k, s in shapes.items()]
        self.world = world
        self.template = np.concatenate([[0] * len(s) + list(s) for s in shapes.values()]).astype(np.int64)
        starts = np.cumsum([0] + [2 * len(s) for s in shapes.values()])[:-1]
        self.offset_at = starts
        self.size_at = starts + np.array([len(s) for s in shapes.values()])
        self.rows = np.array([s[0] for s in shapes.values()], np.int64)
        self.step = -(-self.rows // world)

    def of(self, rank: int) -> LocalPlan:
        lo = np.minimum(rank * self.step, self.rows)
        hi = np.minimum((rank + 1) * self.step, self.rows)
        flat = self.template.copy()
        flat[self.offset_at] = lo
        flat[self.size_at] = hi - lo
        return LocalPlan(rank, LocalItems.from_arrays(self.specs, flat))


def _chunks_overlapped(chunk, box: Box) -> int:
    n = 1
    for o, e, c in zip(box.offset, box.end, chunk):
        n *= ((e - 1) // c - o // c + 1) if e > o else 0
    return n


def timed(step, *args):
    """(seconds, result) of one rank's step, started with a clean heap: in a
    real job each rank holds only its own objects."""
    gc.collect()
    t0 = time.perf_counter()
    out = step(*args)
    return time.perf_counter() - t0, out


def local_step(world: int, shapes: dict, rank: int) -> bytes:
    """What every rank does first: its LocalPlan (the engine's way, one
    LocalItem per tensor), pickled for the gather."""
    items = tuple(LocalItem(k, DTYPE, s, chunk_box(s, 0, world, rank)) for k, s in shapes.items())
    return pickle.dumps((LocalPlan(rank, items), False, None))


def rank0_step(sent: list[bytes], world: int) -> tuple[bytes, bytes]:
    """Rank 0: the gathered local plans -> the plan to broadcast and the root
    metadata (format 1.3: sealed, one digest per array zarr.json)."""
    plans = [pickle.loads(b)[0] for b in sent]
    plan = build_save_plan(plans)
    ident = new_checkpoint_id()
    sums = {k: hashlib.sha256(array_doc(e, ident)).hexdigest() for k, e in plan.entries.items()}
    root = root_group_json(RootMetadata(plan.entries, {}, world_size=world, checkpoint_id=ident, array_digests=sums))
    return pickle.dumps(plan), root


def array_doc(e, ident: str) -> bytes:
    """An array zarr.json of format 1.3 with one (dummy) digest per chunk."""
    return array_json(e, ident, ["0" * 64] * chunk_count(e))


def digest_sizes(broadcast: bytes, me: int) -> tuple[int, int, int]:
    """The largest array zarr.json of the plan, all of them together, and the
    bytes of one rank's digests as collective 3 gathers them."""
    plan = pickle.loads(broadcast)
    sizes = [len(array_doc(e, "0" * 32)) for e in plan.entries.values()]
    mine: dict = {}
    for key, box in plan.writes_of(me):
        e = plan.entries[key]
        for p in read_plan(e.shape, e.chunk_shape, box):
            mine.setdefault(key, {})[p.chunk] = "0" * 64
    return max(sizes), sum(sizes), len(pickle.dumps(mine))


def receive_step(broadcast: bytes, rank: int) -> tuple:
    return pickle.loads(broadcast).writes_of(rank)


def load_step(root: bytes, world: int) -> int:
    """One loading rank at 3/4 of the save's world size: parse the root
    metadata, then its Shard(1) boxes, the stored objects they touch and the
    bytes it will fetch. Returns the number of stored objects."""
    meta = parse_root_bytes(parse("/sim"), root)
    load_world = max(1, world * 3 // 4)
    pieces = fetched = 0
    for e in meta.tensors.values():
        want = chunk_box(e.shape, 1 if len(e.shape) > 1 else 0, load_world, load_world // 2)
        pieces += _chunks_overlapped(e.chunk_shape, want)
        fetched += bytes_fetched(e.shape, e.inner_chunk_shape, want, 2)
    return pieces


def run(world: int, shapes: dict) -> dict:
    me = world // 2  # the rank whose own steps are timed
    t_local, mine = timed(local_step, world, shapes, me)
    t0 = time.perf_counter()
    sim = Shard0Plans(shapes, world)
    sent = [pickle.dumps((sim.of(r), False, None)) for r in range(world)]  # what each rank sends
    t_sim = time.perf_counter() - t0
    assert pickle.loads(sent[me]) == pickle.loads(mine)
    t_rank0, (broadcast, root) = timed(rank0_step, sent, world)
    gathered = sum(len(b) for b in sent)
    del sent
    t_receive, writes = timed(receive_step, broadcast, me)
    assert len(writes) == sum(chunk_box(s, 0, world, me).numel > 0 for s in shapes.values())
    t_load, pieces = timed(load_step, root, world)
    largest, all_arrays, digests = digest_sizes(broadcast, me)
    return {
        "ranks": world,
        "tensors": len(shapes),
        "local_plan_s": t_local,
        "rank0_s": t_rank0,
        "receive_s": t_receive,
        "load_plan_s": t_load,
        "total_s": t_local + t_rank0 + t_receive + t_load,
        "simulation_s": t_sim,
        "gathered_bytes": gathered,
        "broadcast_bytes": len(broadcast),
        "root_metadata_bytes": len(root),
        "largest_array_json_bytes": largest,
        "array_json_bytes": all_arrays,
        "digests_per_rank_bytes": digests,
        "read_pieces_per_rank": pieces,
    }


COLUMNS = [  # header, key, format
    ("ranks", "ranks", "{:>6}"),
    ("tensors", "tensors", "{:>7}"),
    ("local/rank", "local_plan_s", "{:>9.3f}s"),
    ("rank 0", "rank0_s", "{:>8.2f}s"),
    ("receive", "receive_s", "{:>7.3f}s"),
    ("load/rank", "load_plan_s", "{:>8.3f}s"),
    ("total", "total_s", "{:>7.2f}s"),
    ("gathered", "gathered_mib", "{:>6.1f}MiB"),
    ("/rank", "gathered_per_rank", "{:>5.0f}B"),
    ("broadcast", "broadcast_mib", "{:>6.1f}MiB"),
    ("metadata", "metadata_kib", "{:>5.0f}KiB"),
    ("largest array", "largest_array_kib", "{:>10.1f}KiB"),
    ("digests/rank", "digests_per_rank_bytes", "{:>11}B"),
    ("objects read/rank", "read_pieces_per_rank", "{:>17}"),
    ("ns/(rank*tensor)", "ns_per_item", "{:>16.0f}"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[1120, 2240, 4480, 8960])
    ap.add_argument("--layers", type=int, default=80)
    args = ap.parse_args()
    shapes = model_shapes(args.layers)
    widths = [len(fmt.format(0)) for _, _, fmt in COLUMNS]
    print(" ".join(h.rjust(w) for (h, _, _), w in zip(COLUMNS, widths)))
    for w in args.ranks:
        r = run(w, shapes)
        r |= {
            "gathered_mib": r["gathered_bytes"] / 2**20,
            "gathered_per_rank": r["gathered_bytes"] / w,
            "broadcast_mib": r["broadcast_bytes"] / 2**20,
            "metadata_kib": r["root_metadata_bytes"] / 1024,
            "largest_array_kib": r["largest_array_json_bytes"] / 1024,
            "ns_per_item": r["rank0_s"] / (w * r["tensors"]) * 1e9,
        }
        row = " ".join(fmt.format(r[k]) for _, k, fmt in COLUMNS)
        print(f"{row}   (simulating the other ranks: {r['simulation_s']:.1f}s)")
    print(f"peak memory of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
