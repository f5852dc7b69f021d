"""FSDP2 over tensor parallelism (``_StridedShard`` placements), HSDP x TP on a
3-D mesh and torch's legacy ``ShardedTensor``, over real gloo process groups.

Every parameter is ``torch.arange``-valued (all elements distinct), so a box
that holds the wrong rows cannot pass. At world 4 the same processes:

- build FSDP2 x TP (2x2, torchtitan's layout: ``parallelize_module`` on
  ``mesh["tp"]``, then ``fully_shard`` on ``mesh["dp"]``) and check, by brute
  force, that the box tensorckpt computes for every parameter holds exactly
  ``to_local()``'s values; save it; save HSDP x TP (1x2x2) too;
- load the FSDP2 x TP checkpoint as FSDP2 x TP, as TP on 4 (1x4), as
  HSDP x TP (1x2x2), and the HSDP x TP one as FSDP2 x TP: ``full_tensor()``
  equal to the originals, bit for bit;
- save and load legacy ``ShardedTensor`` s (uneven, a rank with no shard),
  loaded as another legacy split and as DTensors, and a DTensor checkpoint
  loaded as a legacy ShardedTensor;
- check the refusals: placements that are not FSDP2's (several boxes per
  rank) and a legacy ShardedTensor with two shards on one rank;
- load the FSDP2 x TP checkpoint into FSDP2 x TP and TP models built on the
  meta device (tests/test_meta_load.py's ``load_meta``);
- save model and Adam state (moments under ``_StridedShard`` too) after a
  step under FSDP2 x TP and load both under TP on 4.

At world 2 the FSDP2 x TP checkpoint is loaded as FSDP2 on 2, as
FSDP2 x TP 1x2, as FSDP1 ``SHARDED_STATE_DICT`` (legacy ShardedTensors, also
saved that way and loaded into a plain module), and into FSDP2 and TP models
built on meta (the FSDP2 one then runs forward and backward); at world 1
(this process) into a plain module. Uneven sizes throughout (11 rows over
TP 2 and then FSDP 2 give 3/3/3/2; 3 rows leave an empty FSDP shard).

Default run: one 4-process and one 2-process spawn, about 45 s on a
loaded 2-core machine. ``TENSORCKPT_FULL=1`` adds loads as HSDP x TP 2x1x2,
FSDP2 x TP 4x1 and 2x1, a save from TP on 4 loaded as FSDP2 x TP, and meta
HSDP x TP / FSDP2 x TP 1x2 targets.
"""

from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:  # spawned workers import this module by name
    sys.path.insert(0, _TESTS)

import dist  # noqa: E402

import tensorckpt  # noqa: E402
from tensorckpt.errors import UnsupportedValueError  # noqa: E402

FULL = os.environ.get("TENSORCKPT_FULL") == "1"


# ------------------------------------------------------------------ models


class Net(torch.nn.Module):
    """Column-parallel ``a`` and ``c``, row-parallel ``b``; odd sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 11)
        self.b = torch.nn.Linear(11, 7)
        self.c = torch.nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


TP_PLAN = ("a", "colwise"), ("b", "rowwise"), ("c", "colwise")


def reference() -> dict[str, torch.Tensor]:
    """The originals: arange-valued, distinct across keys."""
    out, base = {}, 0
    for key, t in Net().state_dict().items():
        out[key] = (torch.arange(t.numel(), dtype=torch.float32) + base).reshape(t.shape) * 0.5
        base += t.numel()
    return out


def build(layout: str, device: str = "cpu", values: bool = True) -> torch.nn.Module:
    """``layout``: plain, fsdp (1-D), tp (1-D), fsdp_tp (dp x tp), hsdp_tp
    (dp_replicate x dp_shard x tp); the mesh is the whole world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with torch.device(device):
        m = Net()
    if values and device != "meta":
        with torch.no_grad():
            for k, t in reference().items():
                m.get_parameter(k).copy_(t)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[s]() for name, s in TP_PLAN}
    if layout == "plain":
        return m
    if layout == "fsdp":
        fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
    elif layout == "tp":
        parallelize_module(m, init_device_mesh("cpu", (world,)), plan)
    elif layout.startswith("fsdp_tp"):  # fsdp_tp or fsdp_tp:DPxTP
        dims = tuple(int(x) for x in layout.split(":")[1].split("x")) if ":" in layout else (2, world // 2)
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("dp", "tp"))
        parallelize_module(m, mesh["tp"], plan)
        fully_shard(m, mesh=mesh["dp"])
    elif layout.startswith("hsdp_tp"):  # hsdp_tp:RxSxT
        dims = tuple(int(x) for x in layout.split(":")[1].split("x"))
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        parallelize_module(m, mesh["tp"], plan)
        fully_shard(m, mesh=mesh["dp_replicate", "dp_shard"])
    else:
        raise ValueError(layout)
    return m


def zero(m: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def check_equal(m: torch.nn.Module, what: str) -> None:
    ref = reference()
    for k, v in m.state_dict().items():
        got = full(v)
        assert torch.equal(got, ref[k]), f"{what}: {k} differs:\n{got}\nvs\n{ref[k]}"


def check_boxes(m: torch.nn.Module, what: str) -> set[str]:
    """Brute force: every parameter's box holds exactly its local values.
    Returns the placements seen."""
    from tensorckpt.adapters.sharded import local_part

    ref, seen = reference(), set()
    for k, v in m.state_dict().items():
        local, shape, box = local_part(k, v)
        seen.add(str(v.placements))
        assert shape == tuple(ref[k].shape)
        assert torch.equal(ref[k][box.slices()], local), f"{what}: {k} {v.placements} box {box} holds other values"
    return seen


# ------------------------------------------------------------------ workers


def _world4(rank: int, world: int, base: str) -> dict:
    torch.manual_seed(0)
    out: dict = {}
    m = build("fsdp_tp")
    out["placements"] = check_boxes(m, "fsdp_tp 2x2")
    tensorckpt.save({"model": m}, f"{base}/fsdp_tp")
    h = build("hsdp_tp:1x2x2")
    out["placements_3d"] = check_boxes(h, "hsdp_tp 1x2x2")
    tensorckpt.save({"model": h}, f"{base}/hsdp_tp")
    layouts = ["fsdp_tp", "tp", "hsdp_tp:1x2x2"] + (["hsdp_tp:2x1x2", "fsdp_tp:4x1"] if FULL else [])
    for layout in layouts:
        for src in ("fsdp_tp", "hsdp_tp"):
            t = build(layout, values=False)
            zero(t)
            tensorckpt.load({"model": t}, f"{base}/{src}")
            check_equal(t, f"{src} -> {layout}")
            check_boxes(t, f"{src} -> {layout}")
    if FULL:
        tensorckpt.save({"model": build("tp")}, f"{base}/tp")
        t = build("fsdp_tp", values=False)
        zero(t)
        tensorckpt.load({"model": t}, f"{base}/tp")
        check_equal(t, "tp -> fsdp_tp")
    _optimizer(base)
    _legacy(rank, world, base)
    out["refusals"] = _refusals(rank, world, base)
    from test_meta_load import load_meta

    load_meta(world, f"{base}/fsdp_tp", ["fsdp_tp", "tp"] + (["hsdp_tp:1x2x2"] if FULL else []))
    return out


def _optimizer(base: str) -> None:
    """Adam's moments are laid out like their parameters (_StridedShard):
    saved with the model under FSDP2 x TP, loaded under TP on 4."""
    m = build("fsdp_tp")
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    for p in m.parameters():
        p.grad = torch.ones_like(p) * 0.5
    opt.step()
    tensorckpt.save({"model": m, "optim": opt}, f"{base}/optim")
    want = {(n, k): full(v).clone() for n, p in m.named_parameters() for k, v in opt.state[p].items()}
    t = build("tp", values=False)
    topt = torch.optim.Adam(t.parameters(), lr=0.1)
    tensorckpt.load({"model": t, "optim": topt}, f"{base}/optim")
    got = {(n, k): full(v) for n, p in t.named_parameters() for k, v in topt.state[p].items()}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), f"optimizer state {k} after fsdp_tp -> tp"
    for (n, p), q in zip(t.named_parameters(), m.parameters()):
        assert torch.equal(full(p), full(q)), f"stepped parameter {n} after fsdp_tp -> tp"


def _fsdp1(base: str) -> None:
    """FSDP1's SHARDED_STATE_DICT (legacy ShardedTensors): saved, and loaded
    from the FSDP2 x TP checkpoint."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    f = FSDP(build("plain"), device_id=torch.device("cpu"), use_orig_params=True)
    with FSDP.state_dict_type(f, StateDictType.SHARDED_STATE_DICT):
        assert type(f.state_dict()["a.weight"]).__name__ == "ShardedTensor"
        tensorckpt.save({"model": f}, f"{base}/fsdp1")
    g = FSDP(build("plain", values=False), device_id=torch.device("cpu"), use_orig_params=True)
    with FSDP.state_dict_type(g, StateDictType.SHARDED_STATE_DICT):
        tensorckpt.load({"model": g}, f"{base}/fsdp_tp")
    with FSDP.state_dict_type(g, StateDictType.FULL_STATE_DICT):
        full_sd = g.state_dict()
    for k, v in reference().items():
        assert torch.equal(full_sd[k], v), f"fsdp_tp -> FSDP1 sharded: {k}"


def _world2(rank: int, world: int, base: str) -> None:
    for layout in ("fsdp", "fsdp_tp:1x2") + (("fsdp_tp:2x1",) if FULL else ()):
        t = build(layout, values=False)
        zero(t)
        tensorckpt.load({"model": t}, f"{base}/fsdp_tp")
        check_equal(t, f"fsdp_tp -> {layout} at world 2")
    _fsdp1(base)
    from test_meta_load import load_meta

    load_meta(world, f"{base}/fsdp_tp", ["fsdp", "tp"] + (["fsdp_tp:1x2"] if FULL else []))


def legacy_tensor(shape, dim: int, world: int, values: torch.Tensor | None):
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    st = empty(ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(world)]), *shape)
    for s in st.local_shards():
        box = tuple(slice(o, o + n) for o, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))
        s.tensor.copy_(values[box] if values is not None else torch.zeros(s.tensor.shape))
    return st


def _legacy(rank: int, world: int, base: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    ref = {"x": torch.arange(30.0).reshape(10, 3), "few": torch.arange(6.0).reshape(3, 2) + 100}
    # 10 rows over 4: 3/3/3/1; 3 rows over 4: rank 3 holds no shard
    tensorckpt.save({k: legacy_tensor(v.shape, 0, world, v) for k, v in ref.items()}, f"{base}/legacy")
    by_cols = {"x": legacy_tensor((10, 3), 1, world, None), "few": legacy_tensor((3, 2), 1, world, None)}
    tensorckpt.load(by_cols, f"{base}/legacy")
    for k, st in by_cols.items():
        for s in st.local_shards():
            box = tuple(slice(o, o + n) for o, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))
            assert torch.equal(s.tensor, ref[k][box]), f"legacy -> legacy by columns: {k}"
    mesh = init_device_mesh("cpu", (world,))
    as_dt = {k: distribute_tensor(torch.zeros(v.shape), mesh, [Shard(1)]) for k, v in ref.items()}
    tensorckpt.load(as_dt, f"{base}/legacy")
    for k, v in as_dt.items():
        assert torch.equal(v.full_tensor(), ref[k]), f"legacy -> DTensor: {k}"
    tensorckpt.save({k: distribute_tensor(v, mesh, [Shard(1)]) for k, v in ref.items()}, f"{base}/dt")
    back = {k: legacy_tensor(v.shape, 0, world, None) for k, v in ref.items()}
    tensorckpt.load(back, f"{base}/dt")
    for k, st in back.items():
        for s in st.local_shards():
            box = tuple(slice(o, o + n) for o, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))
            assert torch.equal(s.tensor, ref[k][box]), f"DTensor -> legacy: {k}"


def _refusals(rank: int, world: int, base: str) -> list[str]:
    from torch.distributed._shard.sharded_tensor import Shard as LegacyShard
    from torch.distributed._shard.sharded_tensor import ShardedTensor as LegacyShardedTensor
    from torch.distributed._shard.sharded_tensor import ShardMetadata
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    msgs = []
    mesh = init_device_mesh("cpu", (2, 2))
    # (_StridedShard(0, 2), Replicate()): rank (i, j) holds rows chunks i and i + 2 of 4: two boxes
    i = mesh.get_coordinate()[0]
    local = torch.tensor([[i], [i + 2.0]])  # rows i and i + 2 of 4
    tensorckpt.save({"odd": torch.zeros(4, 1)}, f"{base}/odd_src")
    odd = DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=2), Replicate()], run_check=False, shape=(4, 1), stride=(1, 1))
    for call in (lambda: tensorckpt.save({"odd": odd}, f"{base}/odd"), lambda: tensorckpt.load({"odd": odd}, f"{base}/odd_src")):
        with pytest.raises(UnsupportedValueError, match="'odd'.*redistribute"):
            call()
    msgs.append("strided")
    # two shards of one tensor on one rank
    shards = [
        LegacyShard(torch.zeros(1, 2), ShardMetadata([2 * rank, 0], [1, 2], f"rank:{rank}/cpu")),
        LegacyShard(torch.zeros(1, 2), ShardMetadata([2 * rank + 1, 0], [1, 2], f"rank:{rank}/cpu")),
    ]
    two = LegacyShardedTensor._init_from_local_shards(shards, 2 * world, 2)
    with pytest.raises(UnsupportedValueError, match="'two'.*2 shards.*DTensor"):
        tensorckpt.save({"two": two}, f"{base}/two")
    msgs.append("legacy")
    return msgs


# ------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("strided"))
    results = dist.run(4, _world4, base, timeout=300)
    return base, results


def test_fsdp2_over_tp_placements_are_strided_and_boxes_exact(saved):
    _, results = saved
    for r in results:
        assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in r["placements"]
        assert "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))" in r["placements_3d"]


def test_refusals_name_the_key(saved):
    _, results = saved
    assert all(r["refusals"] == ["strided", "legacy"] for r in results)


def test_load_at_world_2(saved):
    base, _ = saved
    dist.run(2, _world2, base, timeout=240)
    m = Net()
    zero(m)
    tensorckpt.load({"model": m}, f"{base}/fsdp1")
    check_equal(m, "FSDP1 sharded -> plain")


def test_load_into_plain_module(saved):
    base, _ = saved
    for src in ("fsdp_tp", "hsdp_tp"):
        m = Net()
        zero(m)
        tensorckpt.load({"model": m}, f"{base}/{src}")
        check_equal(m, f"{src} -> plain")
    legacy = {"x": torch.zeros(10, 3), "few": torch.zeros(3, 2)}
    tensorckpt.load(legacy, f"{base}/legacy")
    assert torch.equal(legacy["x"], torch.arange(30.0).reshape(10, 3))
    assert torch.equal(legacy["few"], torch.arange(6.0).reshape(3, 2) + 100)


# ------------------------------------------------------- pure box arithmetic


def _chunk(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """FSDP2's and DTensor's Shard split: ``torch.chunk``, empty past the last piece."""
    pieces = torch.chunk(t, n) if len(t) else ()
    return pieces[r] if r < len(pieces) else t[:0]


def test_mesh_box_is_fsdp2s_nested_chunking():
    """TP chunks first, FSDP chunks the TP-local tensor (what fully_shard
    stores), for 2-D and 3-D meshes, even and uneven, empty shards included."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from tensorckpt.adapters.sharded import mesh_box

    cases = 0
    for dp, tp, n in itertools.product(range(2, 6), range(2, 5), range(27)):
        rows = torch.arange(n)
        for i, j in itertools.product(range(dp), range(tp)):
            want = _chunk(_chunk(rows, tp, j), dp, i)
            for mesh, coord, pl in (
                ((dp, tp), (i, j), (_StridedShard(0, split_factor=tp), Shard(0))),
                ((2, dp, tp), (1, i, j), (Replicate(), _StridedShard(0, split_factor=tp), Shard(0))),
            ):
                box = mesh_box("k", (n, 3), mesh, coord, pl)
                got = rows[box.offset[0] : box.offset[0] + box.shape[0]]
                assert torch.equal(got, want), (dp, tp, n, i, j, box)
                assert box.shape[1] == 3 and box.offset[1] == 0
                cases += 1
    # EP x TP under FSDP: (_StridedShard(0, sf=ep*tp), Shard(0), Shard(0)) and another dim sharded too
    for n, (a, b, c) in itertools.product(range(20), [(2, 2, 2), (3, 2, 2)]):
        for x, y, z in itertools.product(range(a), range(b), range(c)):
            pl = (_StridedShard(0, split_factor=b * c), Shard(0), Shard(0))
            want = _chunk(_chunk(_chunk(torch.arange(n), b, y), c, z), a, x)
            box = mesh_box("k", (n,), (a, b, c), (x, y, z), pl)
            assert torch.equal(torch.arange(n)[box.slices()], want)
            box = mesh_box("k", (n, 5), (a, b, c), (x, y, z), (_StridedShard(0, split_factor=c), Shard(1), Shard(0)))
            assert torch.equal(torch.arange(n)[box.slices()[:1]], _chunk(_chunk(torch.arange(n), c, z), a, x))
            assert box.shape[1] == _chunk(torch.arange(5), b, y).numel()
    assert cases > 1000


def test_mesh_box_agrees_with_torch_when_even():
    """Where every split is even, torch's compute_local_shape_and_global_offset
    (what DCP's planner uses) gives the same boxes."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    from tensorckpt.adapters.sharded import mesh_box

    for dp, tp, k in itertools.product(range(2, 5), range(2, 5), range(1, 3)):
        n = dp * tp * k
        pl = (_StridedShard(0, split_factor=tp), Shard(0))
        for coord in itertools.product(range(dp), range(tp)):
            shape, offset = _compute_local_shape_and_global_offset((n, 2), (dp, tp), list(coord), pl)
            box = mesh_box("k", (n, 2), (dp, tp), coord, pl)
            assert (box.offset, box.shape) == (tuple(offset), tuple(shape))
    pl = (_StridedShard(0, split_factor=2), Shard(0))
    assert _compute_local_shape_and_global_offset((13,), (3, 2), [2, 0], pl) == ((2,), (6,))
    assert mesh_box("k", (13,), (3, 2), (2, 0), pl).to_json() == [[6], [1]]
    assert mesh_box("k", (13,), (3, 2), (2, 1), pl).to_json() == [[11], [2]]


def test_unmatched_strided_shard_refused():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from tensorckpt.adapters.sharded import mesh_box

    for pl in ((_StridedShard(0, split_factor=2), Replicate()), (_StridedShard(0, split_factor=2), Shard(1)),
               (_StridedShard(0, split_factor=4), Shard(0))):
        with pytest.raises(UnsupportedValueError, match="'w'.*several"):
            mesh_box("w", (8, 4), (2, 2), (0, 0), pl)


def test_mesh_box_matches_torch_for_shard_placements():
    """Shard/Replicate placements on 1- to 3-D meshes, even, uneven and
    empty shards: the same boxes as torch's compute_local_shape_and_global_offset."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from tensorckpt.adapters.sharded import mesh_box

    kinds = (Shard(0), Shard(1), Replicate())
    cases = 0
    for mesh in ((3,), (4,), (2, 2), (2, 3), (3, 1), (2, 1, 2), (2, 2, 2)):
        for pl in itertools.product(kinds, repeat=len(mesh)):
            for shape in ((10, 7), (3, 5), (0, 4), (1, 1), (8, 6)):
                for coord in itertools.product(*(range(m) for m in mesh)):
                    lshape, offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), pl)
                    box = mesh_box("k", shape, mesh, coord, pl)
                    assert box.shape == tuple(lshape), (mesh, pl, shape, coord)
                    if 0 not in lshape:
                        assert box.offset == tuple(offset), (mesh, pl, shape, coord)
                    cases += 1
    assert cases > 2000
