"""The save-world x load-world matrix, over real gloo process groups.

The matrix is split into scenarios (:data:`SCENARIOS`: dt1d, split, rep, big,
mesh2d, megatron, subgroup, overwrite, idle, bad), each with its own module
fixture of the same name. The ``matrix`` fixture runs only the scenarios the
selected tests use, spawning each world once per phase for all of them
(process start-up dominates):

    save  at world 1, 2, 3        each scenario's saves into <base>/s<W>/<case>
    save  at world 4, then load   (the same 4 processes, after a barrier)
    load  at world 3, 2, 1        each scenario's loads from every save world

so ``pytest -k megatron`` spawns only the worlds megatron saves or loads at,
and runs only its work there. Workers check every element against
deterministic originals and return per-scenario results; the tests below
assert on them in the parent, so a failure names its case (save world, load
world, layout, key, rank), and a scenario that crashes fails only its tests.

Cases: 1-D-mesh DTensors (Shard(0), Shard(1), Replicate; uneven dims, 1-D,
0-d, bfloat16, int64 with fewer rows than ranks, a zero-size tensor) loaded
as Shard(0) / Shard(1) / Replicate DTensors, requires_grad DTensor Parameters
and plain tensors; np.array_split-style ShardedTensor layouts (rows 4,3,3 at
world 3, empty boxes, non-contiguous views, default and tiny shards / inner
chunks) loaded by columns and by other row splits; replicated plain tensors
(write spreading); a [64, 64] tensor for LoadStats; overwrite; ranks with
nothing to write; layouts every rank must reject. At world 4: 2-D and 3-D
meshes (2x2, 4x1, HSDP [Replicate, Shard(0)], nested Shard(0) twice,
2x1x2), Megatron-style TP/PP layouts (TP=2/PP=2 <-> TP=4 <-> TP=1/PP=1,
TP=1/PP=2) and saves / loads over a subgroup (process_group=...).
"""

from __future__ import annotations

import math
import os
import sys
import traceback
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:  # spawned workers import this module by name
    sys.path.insert(0, _TESTS)

import dist  # noqa: E402

import tensorckpt  # noqa: E402
from tensorckpt import ShardedTensor  # noqa: E402

SAVE_WORLDS = (1, 2, 3, 4)
LOAD_WORLDS = (1, 2, 3, 4)
SENTINEL = -3

# ---------------------------------------------------------------- originals

# 1-D-mesh matrix tensors: key -> (shape, dtype)
T1D = {
    "w": ((10, 7), torch.float32),  # 10 and 7: divisible by none of 3, 4
    "v": ((13,), torch.float32),
    "scalar": ((), torch.float64),
    "bf": ((6, 5), torch.bfloat16),
    "few": ((3, 8), torch.int64),  # fewer rows than ranks at world 4
    "empty": ((0, 4), torch.float32),
}
T2D = {"w": ((10, 7), torch.float32), "bf": ((6, 5), torch.bfloat16), "few": ((3, 8), torch.int64), "v": ((13,), torch.float32)}
HSDP = {f"h{i}": ((8, 6), torch.float32) for i in range(4)} | {"w": ((10, 7), torch.float32)}
REP = {f"p{i}": ((5, 3), torch.float32) for i in range(8)}
SPLIT = {"x": ((10, 5), torch.float32), "cube": ((4, 5, 6), torch.float32), "tiny": ((2, 3), torch.float64)}
BIG = (64, 64)


def original(key: str, shape, dtype) -> torch.Tensor:
    """Deterministic, all elements distinct (and exact in bfloat16 for < 256 elements)."""
    n = math.prod(shape)
    seed = zlib.crc32(key.encode()) % 50
    base = torch.arange(1, n + 1, dtype=torch.float64).reshape(shape)
    if dtype == torch.bfloat16:
        return base.to(dtype)
    if dtype.is_floating_point:
        return (base * 0.25 + seed).to(dtype)
    return (base + seed * 1000).to(dtype)


def values(case: str, world: int) -> dict:
    return {
        "step": 100 + world,
        "meta": {"case": case, "lrs": [0.1, 0.25], "flag": True, "none": None, "nested": {"a": [1, {"b": "c"}]}},
        "empty_dict": {},
    }


def value_slots() -> dict:
    return {"step": 0, "meta": {"case": None, "lrs": None, "flag": None, "none": 1, "nested": {"a": None}}, "empty_dict": None}


def split_sizes(n: int, parts: int) -> list[int]:
    return [len(a) for a in np.array_split(np.arange(n), parts)]


# ------------------------------------------------------------ worker helpers

_MESHES: dict = {}
_WRITES: list = []
_WRITER_DELAY = [0.0]  # seconds a rank with boxes to write waits first (to force an interleaving)


def mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(shape)
    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape)
    return _MESHES[shape]


def placement(name: str, ndim: int):
    from torch.distributed.tensor import Replicate, Shard

    if name == "S0" and ndim >= 1:
        return Shard(0)
    if name == "S1" and ndim >= 2:
        return Shard(1)
    return Replicate()


def _record_writes() -> None:
    """Record the boxes the save plan gives this rank (wraps the library's
    write step at run time; the library itself is untouched)."""
    import tensorckpt.engine.save as save_mod

    if getattr(save_mod._write_local, "_recording", False):
        return
    inner = save_mod._write_local

    def recording(state, plan, loc, rank, *rest):
        _WRITES.extend((k, b.offset, b.shape) for k, b in plan.writes_of(rank))
        if _WRITER_DELAY[0] and plan.writes_of(rank):
            import time

            time.sleep(_WRITER_DELAY[0])
        return inner(state, plan, loc, rank, *rest)

    recording._recording = True
    save_mod._write_local = recording


def dsave(orig: torch.Tensor, m, placements):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(orig, m, list(placements))


def dtarget(shape, dtype, m, placements):
    """An empty (sentinel-filled) DTensor of the given layout."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    lshape, _ = compute_local_shape_and_global_offset(shape, m, list(placements))
    local = torch.full(tuple(lshape), SENTINEL, dtype=dtype)
    return DTensor.from_local(
        local, m, list(placements), run_check=False, shape=torch.Size(shape), stride=torch.empty(shape).stride()
    )


def sharded(orig: torch.Tensor, dim: int, sizes: list[int], index: int, fill: bool = False) -> ShardedTensor:
    """This rank's box of an array_split-style layout. The local tensor is a
    view (non-contiguous when ``dim`` > 0): of ``orig``, or with ``fill`` of a
    sentinel buffer the size of the whole tensor (so a load that writes
    outside its box shows up in the buffer)."""
    off = sum(sizes[:index])
    src = torch.full_like(orig, SENTINEL) if fill else orig
    local = src.narrow(dim, off, sizes[index])
    offset = [0] * orig.dim()
    offset[dim] = off
    return ShardedTensor(local, tuple(orig.shape), tuple(offset))


def outside_box_untouched(st: ShardedTensor) -> str | None:
    """The sentinel buffer behind a loaded ShardedTensor view is untouched outside its box."""
    base = st.local._base if st.local._base is not None else st.local
    mask = torch.ones(base.shape, dtype=torch.bool)
    mask[tuple(slice(o, o + n) for o, n in zip(st.global_offset, st.local.shape))] = False
    wrote = (base[mask] != SENTINEL).sum().item()
    return f"{wrote} elements written outside the box" if wrote else None


def diff(got: torch.Tensor, exp: torch.Tensor) -> str | None:
    if tuple(got.shape) != tuple(exp.shape) or got.dtype != exp.dtype:
        return f"got {list(got.shape)} {got.dtype}, expected {list(exp.shape)} {exp.dtype}"
    if torch.equal(got, exp):
        return None
    bad = (got != exp).nonzero()
    at = tuple(bad[0].tolist())
    return f"{len(bad)} of {exp.numel()} elements differ; first at {list(at)}: got {got[at].item()}, expected {exp[at].item()}"


class Checks:
    """Per-case results of one rank: (group, case, error or None)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str | None]] = []

    def add(self, group: str, case: str, err: str | None) -> None:
        self.rows.append((group, case, err))

    def load(self, group: str, case: str, state: dict, path: str, **kw) -> None:
        """Load, recording (not raising) an error so every rank keeps in step."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tensorckpt.load(state, path, **kw)
            err = None
        except Exception as e:  # noqa: BLE001 - reported per case
            err = f"load raised {type(e).__name__}: {e}"
        self.add(group, f"{case}: load", err)

    def dtensor(self, group: str, case: str, got, orig: torch.Tensor) -> None:
        """A loaded DTensor: its local shard, and (collective) its full value."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        lshape, off = compute_local_shape_and_global_offset(orig.shape, got.device_mesh, got.placements)
        exp = orig[tuple(slice(o, o + s) for o, s in zip(off, lshape))]
        self.add(group, f"{case} local", diff(got.to_local(), exp))
        self.add(group, f"{case} full_tensor", diff(got.full_tensor(), orig))

    def tensor(self, group: str, case: str, got: torch.Tensor, exp: torch.Tensor) -> None:
        self.add(group, case, diff(got, exp))

    def values(self, group: str, case: str, state: dict, expected: dict) -> None:
        got = {k: state[k] for k in expected}
        self.add(group, f"{case} values", None if got == expected else f"values {got!r} != {expected!r}")


# ---------------------------------------------------------------- save side


def dt1d_state(world: int) -> dict:
    m = mesh((world,))
    state = {}
    for g, pname in (("s0", "S0"), ("s1", "S1"), ("rep", "R")):
        state[g] = {k: dsave(original(f"{g}/{k}", s, dt), m, [placement(pname, len(s))]) for k, (s, dt) in T1D.items()}
    return state | values("dt1d", world)


def split_state(rank: int, world: int) -> dict:
    dims = {"x": 0, "cube": 2, "tiny": 0}
    state = {k: sharded(original(k, s, dt), dims[k], split_sizes(s[dims[k]], world), rank) for k, (s, dt) in SPLIT.items()}
    return {"model": state} | values("split", world)


def rep_state(world: int) -> dict:
    return {"rep": {k: original(k, s, dt) for k, (s, dt) in REP.items()}} | values("rep", world)


def big_state(world: int) -> dict:
    from torch.distributed.tensor import Shard

    return {"big": dsave(original("big", BIG, torch.float32), mesh((world,)), [Shard(0)])}


def mesh2d_state(case: str, world: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard

    if case == "hsdp":
        m, pls, specs = mesh((2, 2)), [Replicate(), Shard(0)], HSDP
    elif case == "nested":
        m, pls, specs = mesh((2, 2)), [Shard(0), Shard(0)], {"w": T2D["w"]}
    elif case == "m3d":
        m, pls, specs = mesh((2, 1, 2)), [Shard(1), Replicate(), Shard(0)], T2D
    else:
        m = mesh((2, 2) if case == "m2x2" else (4, 1))
        pls, specs = [Shard(0), Shard(1)], T2D
    state = {}
    for k, (s, dt) in specs.items():
        p = pls if len(s) >= 2 else [Shard(0)] + [Replicate()] * (len(pls) - 1)
        state[k] = dsave(original(f"{case}/{k}", s, dt), m, p)
    return {"model": state} | values(case, world)


MESH_CASES = ("m2x2", "m4x1", "hsdp", "nested", "m3d")

# Megatron-style TP/PP: key -> (shape, dtype, TP split dim or None, layer)
MEG = {"embedding.weight": ((12, 6), torch.float32, 0, "first")}
for _i in range(4):
    MEG[f"layers.{_i}.weight"] = ((8, 6), torch.bfloat16, 0, _i)  # column-parallel
    MEG[f"layers.{_i}.proj"] = ((6, 8), torch.float32, 1, _i)  # row-parallel
    MEG[f"layers.{_i}.norm"] = ((6,), torch.float32, None, _i)  # replicated over TP
MEG["final_norm.weight"] = ((6,), torch.float32, None, "last")


def meg_stage(layer, pp: int) -> int:
    if layer == "first":
        return 0
    if layer == "last":
        return pp - 1
    return layer // (4 // pp)


def meg_state(rank: int, tp: int, pp: int, fill: bool) -> dict:
    """Rank -> (pp stage, tp rank) = divmod(rank, tp). Plain tensors when TP=1."""
    p, t = divmod(rank, tp)
    model = {}
    for key, (shape, dt, dim, layer) in MEG.items():
        if meg_stage(layer, pp) != p:
            continue
        orig = original(f"meg/{key}", shape, dt)
        if dim is None or tp == 1:
            model[key] = torch.full(shape, SENTINEL, dtype=dt) if fill else orig.clone()
        else:
            model[key] = sharded(orig, dim, [shape[dim] // tp] * tp, t, fill)
    v = {"iteration": 1000, "args": {"hidden": 6, "layers": 4}}
    return {"model": model} | (value_meg_slots() if fill else v)


def value_meg_slots() -> dict:
    return {"iteration": 0, "args": {"hidden": None, "layers": None}}


SAVE_CASES = {  # scenario -> its checkpoints (one save each, at every save world of the scenario)
    "dt1d": ("dt1d",),
    "split": ("split", "split_small"),
    "rep": ("rep",),
    "big": ("big", "big_small"),
    "mesh2d": MESH_CASES,
    "megatron": ("tp2pp2", "tp4"),
}
SAVE_OPTIONS = {"split_small": {"shard_bytes": 24, "inner_chunk_bytes": 8}, "big_small": {"inner_chunk_bytes": 1024}}


def case_state(case: str, rank: int, world: int) -> dict:
    """The state saved as checkpoint ``case`` (a name of :data:`SAVE_CASES`)."""
    if case == "dt1d":
        return dt1d_state(world)
    if case in ("split", "split_small"):
        return split_state(rank, world)
    if case == "rep":
        return rep_state(world)
    if case in ("big", "big_small"):
        return big_state(world)
    if case in MESH_CASES:
        return mesh2d_state(case, world)
    tp, pp = {"tp2pp2": (2, 2), "tp4": (4, 1)}[case]
    return meg_state(rank, tp, pp, False)


def save_cases(scenario: str):
    """The save of a scenario of :data:`SAVE_CASES`: each of its checkpoints,
    with the boxes each rank wrote (errors reported per case)."""

    def save(rank: int, world: int, base: str) -> dict:
        out: dict = {"errors": {}, "writes": {}}
        for name in SAVE_CASES[scenario]:
            _WRITES.clear()
            try:
                tensorckpt.save(case_state(name, rank, world), f"{base}/s{world}/{name}", **SAVE_OPTIONS.get(name, {}))
            except Exception as e:  # noqa: BLE001 - reported per case
                out["errors"][name] = f"{type(e).__name__}: {e}"
            out["writes"][name] = list(_WRITES)
        return out

    return save


def bad_cases(rank: int, world: int) -> list:
    """Layouts every rank must reject together (world >= 2)."""
    t = torch.zeros(4, 3)
    return [
        ("bad_overlap", {"bad": {"w": ShardedTensor(t, (4 + world - 1, 3), (rank, 0))}}),  # rows overlap
        ("bad_shape", {"bad": {"w": ShardedTensor(torch.zeros(1, 3), (world + rank, 3), (rank, 0))}}),
    ]


SUB = {"x": ((10, 7), torch.float32), "b": ((7,), torch.bfloat16)}


def subgroup_state(index: int | None, fill: bool, parts: int = 2, dim: int = 0) -> dict:
    """``index`` of ``parts`` along ``dim`` of x (None: all of it); b is plain."""
    x = original("sub/x", *SUB["x"])
    b = original("sub/b", *SUB["b"])
    xs = x if index is None else sharded(x, dim, split_sizes(x.shape[dim], parts), index, fill)
    if fill:
        b = torch.full_like(b, SENTINEL)
        xs = torch.full_like(x, SENTINEL) if index is None else xs
    return {"x": xs, "b": b} | (value_slots() if fill else values("subgroup", 2))


def overwrite_cases(rank: int, world: int, path: str) -> dict:
    """Save, save again without overwrite (refused on every rank), then with overwrite."""
    x = original("ow/x", (10, 3), torch.float32)

    def state(gen):
        return {"x": sharded(x + gen, 0, split_sizes(10, world), rank), "gen": gen}

    out = {}
    tensorckpt.save(state(1), path)
    try:
        tensorckpt.save(state(2), path)
        out["again"] = None
    except Exception as e:  # noqa: BLE001
        out["again"] = type(e).__name__
    tensorckpt.save(state(3), path, overwrite=True)
    return out


def idle_cases(world: int, base: str) -> dict:
    """Saves in which some ranks have nothing to write: one small plain tensor
    replicated on every rank (DDP style) has one writer; the others are idle.
    In the second case the writer is slow (as with a large tensor)."""
    out = {}
    for name, delay in (("idle_plain", 0.0), ("idle_slow_writer", 0.3)):
        _WRITER_DELAY[0] = delay
        try:
            tensorckpt.save({"t": original("idle/t", (3,), torch.float32)}, f"{base}/s{world}/{name}")
            out[name] = None
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
        finally:
            _WRITER_DELAY[0] = 0.0
    return out


def save_subgroup(rank: int, world: int, base: str) -> dict:
    """A save over a subgroup: global ranks 2 and 3 only (world 4)."""
    import torch.distributed as tdist

    out: dict = {"errors": {}}
    pg = tdist.new_group([2, 3])
    if rank in (2, 3):
        try:
            tensorckpt.save(subgroup_state(rank - 2, fill=False), f"{base}/s4/subgroup", process_group=pg)
        except Exception as e:  # noqa: BLE001
            out["errors"]["subgroup"] = f"{type(e).__name__}: {e}"
    return out


def save_bad(rank: int, world: int, base: str) -> dict:
    out = {}
    for name, state in bad_cases(rank, world):
        try:
            tensorckpt.save(state, f"{base}/s{world}/{name}")
            out[name] = None
        except Exception as e:  # noqa: BLE001
            out[name] = (type(e).__name__, str(e))
    return out


# ---------------------------------------------------------------- load side

LOAD_VARIANTS = ("S0", "S1", "R", "plain", "S1param")


def load_dt1d(c: Checks, base: str, S: int, world: int) -> None:
    m = mesh((world,))
    group = f"dt1d/s{S}-l{world}"
    for variant in LOAD_VARIANTS:
        state = {}
        for g in ("s0", "s1", "rep"):
            state[g] = {}
            for k, (s, dt) in T1D.items():
                if variant == "plain":
                    state[g][k] = torch.full(s, SENTINEL, dtype=dt)
                else:
                    state[g][k] = dtarget(s, dt, m, [placement(variant.removesuffix("param"), len(s))])
                    if variant.endswith("param") and dt.is_floating_point:  # FSDP2-style parameter
                        state[g][k] = torch.nn.Parameter(state[g][k])
        state |= value_slots()
        c.load(group, variant, state, f"{base}/s{S}/dt1d")
        for g in ("s0", "s1", "rep"):
            for k, (s, dt) in T1D.items():
                orig = original(f"{g}/{k}", s, dt)
                case = f"{variant} <- {g}/{k}{list(s)}"
                if variant == "plain":
                    c.tensor(group, case, state[g][k], orig)
                else:
                    c.dtensor(group, case, state[g][k].detach(), orig)
        c.values(group, variant, state, values("dt1d", S))


def load_split(c: Checks, rank: int, base: str, S: int, world: int) -> None:
    group = f"split/s{S}-l{world}"
    for variant, src in (("cols", "split"), ("rows", "split"), ("cols", "split_small"), ("rows", "split_small")):
        state, expect = {}, {}
        for k, (s, dt) in SPLIT.items():
            orig = original(k, s, dt)
            if variant == "cols":
                dim = 1 if k != "cube" else 0
                sizes = split_sizes(s[dim], world)
            else:
                dim = 0 if k != "cube" else 1
                sizes = [7, 3] if (k == "x" and world == 2) else split_sizes(s[dim], world)[::-1]
            state[k] = sharded(orig, dim, sizes, rank, fill=True)
            expect[k] = sharded(orig, dim, sizes, rank).local
        state = {"model": state} | value_slots()
        case = f"{src} {variant}"
        c.load(group, case, state, f"{base}/s{S}/{src}")
        for k in SPLIT:
            st = state["model"][k]
            name = f"{case} {k} box {list(st.global_offset)}+{list(st.local.shape)}"
            c.tensor(group, name, st.local, expect[k])
            c.add(group, f"{name} outside", outside_box_untouched(st))
        c.values(group, case, state, values("split", S))


def load_rep(c: Checks, base: str, S: int, world: int) -> None:
    group = f"rep/s{S}-l{world}"
    state = {"rep": {k: torch.full(s, SENTINEL, dtype=dt) for k, (s, dt) in REP.items()}} | value_slots()
    c.load(group, "plain", state, f"{base}/s{S}/rep")
    for k, (s, dt) in REP.items():
        c.tensor(group, f"plain {k}", state["rep"][k], original(k, s, dt))
    c.values(group, "plain", state, values("rep", S))


def load_big(c: Checks, base: str, S: int, world: int) -> dict:
    from torch.distributed.tensor import Shard

    group = f"big/s{S}-l{world}"
    out = {}
    for src in ("big", "big_small"):
        for variant, pl in (("S0", Shard(0)), ("S1", Shard(1))):
            state = {"big": dtarget(BIG, torch.float32, mesh((world,)), [pl])}
            stats = tensorckpt.LoadStats()
            c.load(group, f"{src} {variant}", state, f"{base}/s{S}/{src}", stats=stats)
            c.dtensor(group, f"{src} {variant} big", state["big"], original("big", BIG, torch.float32))
            out[src, variant] = (stats.bytes_needed, stats.bytes_read, stats.read_amplification)
    return out


def load_mesh2d(c: Checks, base: str, world: int) -> None:
    from torch.distributed.tensor import Replicate, Shard

    targets = {  # case -> [(variant, mesh shape, placements for 2-D tensors)]
        "m2x2": [("1x4 [R,S1]", (1, 4), [Replicate(), Shard(1)]), ("2x2 [S1,S0]", (2, 2), [Shard(1), Shard(0)])],
        "m4x1": [("2x2 [S1,S0]", (2, 2), [Shard(1), Shard(0)])],
        "hsdp": [("2x2 [S0,R]", (2, 2), [Shard(0), Replicate()])],
        "nested": [("2x2 [S1,S0]", (2, 2), [Shard(1), Shard(0)])],
        "m3d": [("2x2 [S1,S0]", (2, 2), [Shard(1), Shard(0)]), ("1x2x2 [R,S0,S1]", (1, 2, 2), [Replicate(), Shard(0), Shard(1)])],
    }
    specs = {"m2x2": T2D, "m4x1": T2D, "hsdp": HSDP, "nested": {"w": T2D["w"]}, "m3d": T2D}
    for case, tlist in targets.items():
        group = f"mesh2d/{case}-l{world}"
        variants = [("1-D S1", (world,), None)] + (tlist if world == 4 else [])
        for variant, mshape, pls in variants:
            m = mesh(mshape)
            state = {}
            for k, (s, dt) in specs[case].items():
                if pls is None:
                    p = [placement("S1", len(s))]
                else:
                    p = pls if len(s) >= 2 else [Replicate()] * (len(pls) - 1) + [Shard(0)]
                state[k] = dtarget(s, dt, m, p)
            state = {"model": state} | value_slots()
            c.load(group, variant, state, f"{base}/s4/{case}")
            for k, (s, dt) in specs[case].items():
                c.dtensor(group, f"{variant} <- {k}{list(s)}", state["model"][k], original(f"{case}/{k}", s, dt))
            c.values(group, variant, state, values(case, 4))


MEG_LOADS = {  # load world -> [(source case, tp, pp)]
    1: [("tp2pp2", 1, 1), ("tp4", 1, 1)],
    2: [("tp2pp2", 1, 2), ("tp4", 1, 2)],
    4: [("tp2pp2", 4, 1), ("tp4", 2, 2), ("tp2pp2", 2, 2)],
}


def load_megatron(c: Checks, rank: int, base: str, world: int) -> None:
    for src, tp, pp in MEG_LOADS.get(world, []):
        group = f"megatron/{src}->tp{tp}pp{pp}"
        state = meg_state(rank, tp, pp, fill=True)
        c.load(group, "load", state, f"{base}/s4/{src}", strict=pp == 1)
        want = meg_state(rank, tp, pp, fill=False)
        if set(state["model"]) != set(want["model"]):
            c.add(group, "keys", f"{sorted(state['model'])} != {sorted(want['model'])}")
        for key, exp in want["model"].items():
            got = state["model"][key]
            if isinstance(exp, ShardedTensor):
                c.tensor(group, f"{key} box {list(exp.global_offset)}+{list(exp.local.shape)}", got.local, exp.local)
            else:
                c.tensor(group, f"{key} full", got, exp)
        c.values(group, "load", state, {"iteration": 1000, "args": {"hidden": 6, "layers": 4}})


def load_subgroup(c: Checks, rank: int, base: str, world: int) -> None:
    """Load the subgroup-saved checkpoint: at world 4 over a subgroup of
    global ranks 1 and 3 (by columns), elsewhere as whole tensors."""
    group = f"subgroup-l{world}"
    path = f"{base}/s4/subgroup"
    if world == 4:
        import torch.distributed as tdist

        pg = tdist.new_group([1, 3])
        if rank not in (1, 3):
            return
        i = (1, 3).index(rank)
        state = subgroup_state(i, fill=True, dim=1)
        c.load(group, "subgroup [1, 3] cols", state, path, process_group=pg)
        want = subgroup_state(i, fill=False, dim=1)
        c.tensor(group, "x cols", state["x"].local, want["x"].local)
        c.add(group, "x outside", outside_box_untouched(state["x"]))
    else:
        state = subgroup_state(None, fill=True)
        c.load(group, "whole", state, path)
        want = subgroup_state(None, fill=False)
        c.tensor(group, "x whole", state["x"], want["x"])
    c.tensor(group, "b", state["b"], want["b"])
    c.values(group, "load", state, values("subgroup", 2))


def each_save_world(load_one):
    """A scenario's load: ``load_one`` from the checkpoint of every save world;
    its results (if any) by save world."""

    def load(c: Checks, rank: int, base: str, world: int) -> dict:
        return {S: load_one(c, rank, base, S, world) for S in SAVE_WORLDS}

    return load


# ------------------------------------------------------------------ scenarios


@dataclass(frozen=True)
class Scenario:
    """One part of the matrix: ``save(rank, world, base)`` at each save world
    (its result per rank), then ``load(checks, rank, base, world)`` at each
    load world (the checks and its result per rank)."""

    save_worlds: tuple[int, ...]
    save: Callable[[int, int, str], object]
    load_worlds: tuple[int, ...] = ()
    load: Callable[[Checks, int, str, int], object] | None = None


SCENARIOS = {  # in the order every rank runs them
    "dt1d": Scenario(SAVE_WORLDS, save_cases("dt1d"), LOAD_WORLDS,
                     each_save_world(lambda c, rank, base, S, world: load_dt1d(c, base, S, world))),
    "split": Scenario(SAVE_WORLDS, save_cases("split"), LOAD_WORLDS, each_save_world(load_split)),
    "rep": Scenario(SAVE_WORLDS, save_cases("rep"), LOAD_WORLDS,
                    each_save_world(lambda c, rank, base, S, world: load_rep(c, base, S, world))),
    "big": Scenario(SAVE_WORLDS, save_cases("big"), LOAD_WORLDS,
                    each_save_world(lambda c, rank, base, S, world: load_big(c, base, S, world))),
    "mesh2d": Scenario((4,), save_cases("mesh2d"), LOAD_WORLDS, lambda c, rank, base, world: load_mesh2d(c, base, world)),
    "megatron": Scenario((4,), save_cases("megatron"), tuple(MEG_LOADS), load_megatron),
    "subgroup": Scenario((4,), save_subgroup, LOAD_WORLDS, load_subgroup),
    "overwrite": Scenario((2, 3, 4), lambda rank, world, base: overwrite_cases(rank, world, f"{base}/s{world}/ow")),
    "idle": Scenario((2, 3, 4), lambda rank, world, base: idle_cases(world, base)),
    "bad": Scenario((2, 3, 4), save_bad),
}


def run_world(rank: int, world: int, base: str, names: list[str], phases: tuple[str, ...]) -> dict:
    """One spawned world: the ``save`` and/or ``load`` phase (a barrier between)
    of the scenarios ``names``. A scenario that raises is reported as crashed
    ({"crashed": traceback}); the others still run."""
    import torch.distributed as tdist

    _record_writes()
    out: dict = {name: {} for name in names}
    for phase in phases:
        if phase == "load" and "save" in phases:
            tdist.barrier()
        for name in names:
            sc = SCENARIOS[name]
            if world not in (sc.save_worlds if phase == "save" else sc.load_worlds):
                continue
            try:
                if phase == "save":
                    out[name]["save"] = sc.save(rank, world, base)
                else:
                    c = Checks()
                    extra = sc.load(c, rank, base, world)
                    out[name]["load"] = {"checks": c.rows, "extra": extra}
            except Exception:  # noqa: BLE001 - reported as this scenario's failure
                out[name][phase] = {"crashed": traceback.format_exc()}
    tdist.barrier()  # no rank exits (taking rank 0's store with it) while another still sets up a subgroup
    return out


# ------------------------------------------------------------------ parent


@dataclass
class Runs:
    """One scenario's results: per save world, per rank, what its save
    returned; per load world, per rank, its checks and load result."""

    name: str
    base: str
    saves: dict[int, list] = field(default_factory=dict)
    loads: dict[int, list] = field(default_factory=dict)
    crashes: list[str] = field(default_factory=list)


def needed(item) -> set[str]:
    """The scenarios a test uses: fixtures named after one, or a ``scenario`` parameter."""
    names = {f for f in getattr(item, "fixturenames", ()) if f in SCENARIOS}
    if "scenario" in getattr(item, "fixturenames", ()):
        names.add(item.callspec.params["scenario"])
    return names


@pytest.fixture(scope="module")
def matrix(request, tmp_path_factory) -> dict[str, Runs]:
    """The scenarios the selected tests of this module use, each world spawned
    at most once per phase (process start-up dominates):

        save at world 1, 2, 3;  save then load at world 4;  load at world 3, 2, 1
    """
    items = [i for i in request.session.items if getattr(i, "module", None) is request.module]
    names = [n for n in SCENARIOS if any(n in needed(i) for i in items)]
    base = str(tmp_path_factory.mktemp("matrix"))
    runs = {name: Runs(name, base) for name in names}
    steps = [(w, ("save",)) for w in (1, 2, 3)] + [(4, ("save", "load"))] + [(w, ("load",)) for w in (3, 2, 1)]
    for world, phases in steps:
        here = [n for n in names if any(world in (SCENARIOS[n].save_worlds if p == "save" else SCENARIOS[n].load_worlds)
                                         for p in phases)]
        if not here:
            continue
        try:
            results = dist.run(world, run_world, base, here, phases)
        except Exception as e:  # noqa: BLE001 - a worker died or hung: every scenario of this run fails
            for n in here:
                runs[n].crashes.append(f"world {world} {'+'.join(phases)}: {e}")
            continue
        for n in here:
            for phase, into in (("save", runs[n].saves), ("load", runs[n].loads)):
                per_rank = [res[n].get(phase) for res in results]
                if per_rank[0] is None:
                    continue
                crashed = [f"rank {r} of {world}, {phase}:\n{x['crashed']}" for r, x in enumerate(per_rank)
                           if isinstance(x, dict) and "crashed" in x]
                runs[n].crashes += crashed
                into[world] = per_rank
    return runs


def scenario_runs(matrix: dict[str, Runs], name: str) -> Runs:
    runs = matrix[name]
    if runs.crashes:
        pytest.fail(f"scenario {name!r} crashed:\n" + "\n".join(runs.crashes), pytrace=False)
    return runs


def _scenario_fixture(name: str):
    @pytest.fixture(scope="module", name=name)
    def fixture(matrix: dict[str, Runs]) -> Runs:
        return scenario_runs(matrix, name)

    return fixture


for _name in SCENARIOS:  # one module fixture per scenario, named after it (dt1d, split, ...)
    globals()[f"_fixture_{_name}"] = _scenario_fixture(_name)


@pytest.fixture(scope="module")
def scenario(request, matrix: dict[str, Runs]) -> Runs:
    """The scenario named by an indirect ``scenario`` parameter."""
    return scenario_runs(matrix, request.param)


def group_results(loads: dict[int, list], world: int, group: str) -> tuple[int, list[str]]:
    n, bad = 0, []
    for rank, res in enumerate(loads[world]):
        for g, case, err in res["checks"]:
            if g == group:
                n += 1
                if err is not None:
                    bad.append(f"rank {rank}/{world}: {case}: {err}")
    return n, bad


def assert_group(runs: Runs, world: int, group: str) -> None:
    n, bad = group_results(runs.loads, world, group)
    assert n, f"{group}: no checks ran"
    assert not bad, f"{group}: {len(bad)} of {n} checks failed:\n  " + "\n  ".join(bad[:40])


MATRIX = [(s, l) for s in SAVE_WORLDS for l in LOAD_WORLDS]
MATRIX_IDS = [f"save{s}-load{l}" for s, l in MATRIX]


SAVED = [(name, S) for name in SAVE_CASES for S in SCENARIOS[name].save_worlds]  # (scenario, save world)
SAVED_IDS = [f"{name}-save{S}" for name, S in SAVED]


@pytest.mark.parametrize("scenario,S", SAVED, ids=SAVED_IDS, indirect=["scenario"])
def test_saves_commit(scenario, S):
    saves = scenario.saves
    errors = [f"rank {r}: {case}: {e}" for r, res in enumerate(saves[S]) for case, e in res["errors"].items()]
    assert not errors, "\n".join(errors)
    assert set(saves[S][0]["writes"]) == set(SAVE_CASES[scenario.name])
    for case in saves[S][0]["writes"]:
        ck = tensorckpt.open(f"{scenario.base}/s{S}/{case}")
        assert ck.metadata.world_size == S


@pytest.mark.parametrize("S", [2, 3, 4], ids=lambda s: f"save{s}")
def test_overwrite(overwrite, S):
    base, saves = overwrite.base, overwrite.saves
    assert [res["again"] for res in saves[S]] == ["CheckpointExistsError"] * S
    ck = tensorckpt.open(f"{base}/s{S}/ow")
    assert torch.equal(ck.read("x"), original("ow/x", (10, 3), torch.float32) + 3)
    assert ck.read("gen") == 3
    leftovers = [n for n in os.listdir(f"{base}/s{S}") if n.startswith(".")]
    # no staging left; the replaced version kept for its readers (spec 10.2 step 4), whole: generation 1
    assert len(leftovers) == 1 and leftovers[0].startswith(".ow.tensorckpt-replaced-"), leftovers
    kept = tensorckpt.open(f"{base}/s{S}/{leftovers[0]}")
    assert torch.equal(kept.read("x"), original("ow/x", (10, 3), torch.float32) + 1) and kept.read("gen") == 1


@pytest.mark.parametrize("S", [2, 3, 4], ids=lambda s: f"save{s}")
def test_rank_with_nothing_to_write_can_save(idle, S):
    """Regression: every rank used to sync the staging directory, which only
    exists once some rank's write created it; an idle rank got there first
    (FileNotFoundError) whenever the writer was slower."""
    base, saves = idle.base, idle.saves
    errors = [f"rank {r}: {case}: {e}" for r, res in enumerate(saves[S]) for case, e in res.items() if e]
    assert not errors, "\n".join(errors)
    assert len(saves[S][0]) == 2
    for case in saves[S][0]:
        assert torch.equal(tensorckpt.open(f"{base}/s{S}/{case}").read("t"), original("idle/t", (3,), torch.float32))


@pytest.mark.parametrize("scenario,S", SAVED, ids=SAVED_IDS, indirect=["scenario"])
def test_every_stored_object_has_one_writer(scenario, S):
    """Across ranks, each (key, box) is written once, and the written boxes
    of every tensor tile it (checked against the index's chunk grid)."""
    base, saves = scenario.base, scenario.saves
    for case in SAVE_CASES[scenario.name]:
        writes = [(k, tuple(o), tuple(s), r) for r, res in enumerate(saves[S]) for k, o, s in res["writes"][case]]
        seen = {}
        for k, o, s, r in writes:
            assert (k, o, s) not in seen, f"{case}: {k} box {o}+{s} written by ranks {seen[(k, o, s)]} and {r}"
            seen[(k, o, s)] = r
        ck = tensorckpt.open(f"{base}/s{S}/{case}")
        for key, e in ck.index.tensors.items():
            counts = np.zeros(e.shape, dtype=np.int64)
            for k, o, s, _ in writes:
                if k == key:
                    counts[tuple(slice(a, a + b) for a, b in zip(o, s))] += 1
            assert np.all(counts == 1), f"{case}/{key}: written boxes do not tile {list(e.shape)}"
            for k, o, s, _ in writes:
                if k == key:  # every writer's box starts on a chunk boundary
                    assert all(a % c == 0 for a, c in zip(o, e.chunk_shape)), (case, key, o, e.chunk_shape)


@pytest.mark.parametrize("S", [2, 3, 4], ids=lambda s: f"save{s}")
def test_bad_layouts_rejected_on_every_rank(bad, S):
    base, saves = bad.base, bad.saves
    for case in ("bad_overlap", "bad_shape"):
        got = [res[case] for res in saves[S]]
        for r, err in enumerate(got):
            assert err is not None, f"{case}: rank {r} of {S} saved an invalid layout"
            assert err[0] == "IncompatibleStateError", f"{case}: rank {r}: {err}"
            assert "'bad/w'" in err[1], f"{case}: rank {r}: error does not name the key: {err[1]}"
        with pytest.raises(tensorckpt.CheckpointNotFoundError):
            tensorckpt.open(f"{base}/s{S}/{case}")


@pytest.mark.parametrize("S", SAVE_WORLDS, ids=lambda s: f"save{s}")
def test_save_options_honored(split, big, S):
    """split_small / big_small repeat a layout just saved, with other
    shard_bytes / inner_chunk_bytes: their chunking follows the options."""
    base = split.base

    def entries(case):
        return tensorckpt.open(f"{base}/s{S}/{case}").index.tensors

    for key, e in entries("split_small").items():
        itemsize = torch.empty((), dtype=getattr(torch, e.dtype)).element_size()
        # at most shard_bytes, except a single writer's chunk, which keeps at least one whole row
        assert math.prod(e.chunk_shape) * itemsize <= 24 or e.chunk_shape[0] == 1, (key, e)
        assert math.prod(e.inner_chunk_shape) * itemsize <= 8, (key, e)
    big, small = entries("big")["big"], entries("big_small")["big"]
    assert big.chunk_shape == small.chunk_shape == (-(-BIG[0] // S), BIG[1])
    assert big.inner_chunk_shape == big.chunk_shape
    assert math.prod(small.inner_chunk_shape) * 4 <= 1024, small


@pytest.mark.parametrize("S,L", MATRIX, ids=MATRIX_IDS)
def test_dtensor_1d_matrix(dt1d, S, L):
    assert_group(dt1d, L, f"dt1d/s{S}-l{L}")


@pytest.mark.parametrize("S,L", MATRIX, ids=MATRIX_IDS)
def test_sharded_irregular_matrix(split, S, L):
    """np.array_split-style ShardedTensor boxes (rows 4,3,3 at world 3), loaded
    by columns and by a different row split (7,3 at world 2)."""
    if S == 3:  # boxes at rows 0, 4, 7: the gcd grid would be 1 row (10 objects); chunks of
        # the largest box, 4 rows, instead (3 objects), row 7 sent to the writer of rows 4-7
        assert tensorckpt.open(f"{split.base}/s3/split").info("model/x").chunk_shape == (4, 5)
    assert_group(split, L, f"split/s{S}-l{L}")


@pytest.mark.parametrize("S,L", MATRIX, ids=MATRIX_IDS)
def test_replicated_plain_matrix(rep, S, L):
    assert_group(rep, L, f"rep/s{S}-l{L}")


@pytest.mark.parametrize("S,L", MATRIX, ids=MATRIX_IDS)
def test_big_matrix(big, S, L):
    assert_group(big, L, f"big/s{S}-l{L}")


@pytest.mark.parametrize("case", MESH_CASES)
@pytest.mark.parametrize("L", LOAD_WORLDS, ids=lambda l: f"load{l}")
def test_mesh_2d(mesh2d, case, L):
    assert_group(mesh2d, L, f"mesh2d/{case}-l{L}")


MEG_CASES = [(L, src, tp, pp) for L, lst in MEG_LOADS.items() for src, tp, pp in lst]


@pytest.mark.parametrize("L,src,tp,pp", MEG_CASES, ids=[f"{s}->tp{t}pp{p}" for _, s, t, p in MEG_CASES])
def test_megatron_tp_pp(megatron, L, src, tp, pp):
    assert_group(megatron, L, f"megatron/{src}->tp{tp}pp{pp}")


@pytest.mark.parametrize("L", LOAD_WORLDS, ids=lambda l: f"load{l}")
def test_subgroup_save_and_load(subgroup, L):
    """save(process_group=new_group([2, 3])) at world 4; load over
    new_group([1, 3]) at world 4 and without a group elsewhere."""
    base, saves = subgroup.base, subgroup.saves
    errors = [e for res in saves[4] for case, e in res["errors"].items() if case == "subgroup"]
    assert not errors, errors
    assert tensorckpt.open(f"{base}/s4/subgroup").metadata.world_size == 2
    assert_group(subgroup, L, f"subgroup-l{L}")


@pytest.mark.parametrize("S", SAVE_WORLDS, ids=lambda s: f"save{s}")
def test_replicated_writes_spread(rep, S):
    """8 equal plain tensors replicated on S ranks: at most ceil(8/S) per rank."""
    saves = rep.saves
    per_rank = [len(res["writes"]["rep"]) for res in saves[S]]
    assert sum(per_rank) == len(REP)
    assert max(per_rank) <= -(-len(REP) // S), per_rank


def test_hsdp_writes_spread(mesh2d):
    """[Replicate(), Shard(0)] on 2x2: each row half has 2 replicas; 4 equal
    tensors -> 8 boxes, 2 per rank (every rank writes)."""
    saves = mesh2d.saves
    per_rank = [sum(1 for k, _, _ in res["writes"]["hsdp"] if k.startswith("model/h")) for res in saves[4]]
    assert per_rank == [2, 2, 2, 2], per_rank


@pytest.mark.parametrize("L", LOAD_WORLDS, ids=lambda l: f"load{l}")
def test_values_returned_to_every_rank(dt1d, split, rep, mesh2d, megatron, subgroup, L):
    loaded = [runs.loads[L] for runs in (dt1d, split, rep, mesh2d, megatron, subgroup) if L in runs.loads]
    for rank in range(L):
        rows = [(g, c, e) for per_rank in loaded for g, c, e in per_rank[rank]["checks"] if c.endswith(" values")]
        assert len(rows) >= 4 * len(SAVE_WORLDS), f"rank {rank}: only {len(rows)} value checks"
        bad = [f"{g}: {c}: {e}" for g, c, e in rows if e]
        assert not bad, f"rank {rank} of {L}:\n" + "\n".join(bad)


def _edge_padded_amplification(S: int, rank: int) -> float:
    """What a Shard(0) reader at the saving world reads: its own box, plus the
    zero padding of the array's last chunk (stored at full chunk size)."""
    rows = -(-BIG[0] // S)
    start = rank * rows
    need = max(0, min(BIG[0], start + rows) - start)
    return rows / need if need else 1.0


@pytest.mark.parametrize("S", SAVE_WORLDS, ids=lambda s: f"save{s}")
def test_load_stats_same_world(big, S):
    for rank, res in enumerate(big.loads[S]):
        need, got, amp = res["extra"][S]["big", "S0"]
        rows = -(-BIG[0] // S)
        assert need == max(0, min(BIG[0], (rank + 1) * rows) - rank * rows) * BIG[1] * 4, (rank, need)
        assert amp == pytest.approx(_edge_padded_amplification(S, rank)), (rank, need, got, amp)
        if BIG[0] % S == 0:
            assert amp == 1.0
        assert res["extra"][S]["big_small", "S0"][2] == amp  # inner chunks split the box evenly


def test_load_stats_reshard_report(big):
    """Report (loosely bound) the read amplification of every reshard."""
    loads = big.loads
    lines = [
        "read amplification loading a [64, 64] float32 Shard(0) checkpoint (max over ranks), "
        "default inner chunks | inner_chunk_bytes=1024:"
    ]
    for S in SAVE_WORLDS:
        rows = -(-BIG[0] // S)
        stored = -(-BIG[0] // rows) * rows * BIG[1] * 4  # the whole array, edge chunk padded
        for L in LOAD_WORLDS:
            cells = []
            for variant in ("S0", "S1"):
                amps = {}
                for src in ("big", "big_small"):
                    per_rank = [res["extra"][S][src, variant] for res in loads[L]]
                    for need, got, amp in per_rank:
                        assert need <= got <= stored and amp >= 1.0, (S, L, src, variant, per_rank)
                    amps[src] = max(a for _, _, a in per_rank)
                assert amps["big_small"] <= amps["big"] + 1e-9, (S, L, variant, amps)
                cells.append(f"{variant} {amps['big']:.3f} | {amps['big_small']:.3f}")
            lines.append(f"  save {S} -> load {L}: " + ";  ".join(cells))
    print("\n".join(lines))  # shown with -s or -rP


@pytest.mark.parametrize("S", SAVE_WORLDS, ids=lambda s: f"save{s}")
def test_open_reads_slices(dt1d, split, S):
    """tensorckpt.open() on a distributed checkpoint in this single process."""
    base = dt1d.base
    rng = np.random.default_rng(S)
    ck = tensorckpt.open(f"{base}/s{S}/dt1d")
    assert ck.read("step") == 100 + S
    for g in ("s0", "s1", "rep"):
        for k, (s, dt) in T1D.items():
            orig = original(f"{g}/{k}", s, dt)
            assert torch.equal(ck.read(f"{g}/{k}"), orig), (g, k)
            for _ in range(6 if s else 0):
                idx = []
                for n in s:
                    if n and rng.random() < 0.2:
                        idx.append(int(rng.integers(0, n)))
                    else:
                        a = int(rng.integers(0, n + 1))
                        b = int(rng.integers(a, n + 1))
                        idx.append(slice(a, b, int(rng.integers(1, 4))))
                got = ck.read(f"{g}/{k}", index=tuple(idx))
                exp = orig[tuple(idx)]
                assert torch.equal(got, exp), f"{g}/{k}{list(s)}[{idx}]: {got} != {exp}"
    whole = tensorckpt.open(f"{base}/s{S}/split").to_state_dict()
    for k, (s, dt) in SPLIT.items():
        assert torch.equal(whole["model"][k], original(k, s, dt)), k


def test_open_reads_megatron_whole(megatron):
    """tensorckpt.open() of the TP=2/PP=2 checkpoint: every tensor whole."""
    whole = tensorckpt.open(f"{megatron.base}/s4/tp2pp2").to_state_dict()
    for key, (s, dt, _, _) in MEG.items():
        assert torch.equal(whole["model"][key], original(f"meg/{key}", s, dt)), key
    assert whole["iteration"] == 1000
