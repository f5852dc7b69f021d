"""Ports of DCP's DTensor resharding and tensor-parallel tests.

DCP keeps the world size (4) and changes placements or the mesh; these ports
do the same at world 4 and ALSO load every checkpoint at world 2 (1-D
placements), in one process (plain tensors) and, with
``TENSORCKPT_PEER_FULL=1``, at world 3 (uneven shards). A checkpoint saved by
one process as plain tensors is loaded into every 4-rank layout too.
"""

from __future__ import annotations

import numpy as np
import torch
from _suite import full, mesh, model_values, path, scenario
from torch import nn

import tensorckpt

# DCP's layouts (test_dtensor_resharding.py ONE_D_PLACEMENTS / TWO_D_PLACEMENTS), by name
ONE_D = ("S0", "R")
TWO_D = ("RR", "RS0", "S0R", "S0S0")
LAYOUTS = ONE_D + TWO_D + ("S1", "S0S1")  # S1, S0S1 (FSDP x TP-like) are additions
W2_LAYOUTS = ("S0", "R", "S1")


def placements(name: str):
    from torch.distributed.tensor import Replicate, Shard

    out, i = [], 0
    while i < len(name):
        if name[i] == "R":
            out.append(Replicate())
            i += 1
        else:
            out.append(Shard(int(name[i + 1])))
            i += 2
    return out


def layout_mesh(name: str, world: int):
    n = len(placements(name))
    return mesh((world,)) if n == 1 else mesh((2, world // 2))


def globals_() -> dict[str, torch.Tensor]:
    """DCP's 4x4 arange, and an uneven 7x5 (shards of 2, 2, 2, 1 rows at world 4)."""
    return {"dtensor": torch.arange(16, dtype=torch.float).view(4, 4),
            "uneven": torch.arange(35, dtype=torch.float).view(7, 5) * 0.5 - 3}


def distributed(name: str, world: int, value=None) -> dict:
    from torch.distributed.tensor import distribute_tensor, zeros

    m = layout_mesh(name, world)
    out = {}
    for key, g in globals_().items():
        out[key] = (distribute_tensor(g, m, placements(name)) if value is None
                    else zeros(list(g.shape), device_mesh=m, placements=placements(name)))
    return out


def mismatches(loaded: dict, name: str, world: int) -> list[str]:
    """Keys whose placements or local shard differ from what DTensor itself holds for
    that layout: the global value's region at the shard's offset (no collectives)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    bad = []
    for key, t in loaded.items():
        g = globals_()[key]
        shape, offset = compute_local_shape_and_global_offset(g.shape, t.device_mesh, placements(name))
        expected = g[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        if list(t.placements) != placements(name) or not torch.equal(t.to_local(), expected):
            bad.append(f"{key} as {name}")
    return bad


# ------------------------------------------------------------------ save
# One checkpoint holds every layout (key ``<layout>/<tensor>``): DCP's tests save
# one checkpoint per layout; one save and one load per target layout cover the
# same pairs in fewer collectives.


@scenario("w1_save")
def dtensor_plain_save(rank: int, world: int, base: str):
    tensorckpt.save({src: globals_() for src in LAYOUTS}, path(base, "dt_plain"))


@scenario("w4")
def dtensor_save_all_layouts(rank: int, world: int, base: str):
    """Port of test/distributed/checkpoint/test_dtensor_resharding.py (the save half of every test)."""
    tensorckpt.save({src: distributed(src, world) for src in LAYOUTS}, path(base, "dt_all"))


def reshard(base: str, world: int, targets, ckpt: str = "dt_all") -> dict:
    """Load every stored layout into each target layout; the mismatches by (source, target)."""
    bad = {}
    for dst in targets:
        state = {src: distributed(dst, world, value=0) for src in LAYOUTS}
        tensorckpt.load(state, path(base, ckpt))
        for src in LAYOUTS:
            bad[(src if ckpt == "dt_all" else f"plain:{src}", dst)] = mismatches(state[src], dst, world)
    return bad


# ------------------------------------------------------------------ load


@scenario("w4")
def dtensor_reshard_w4(rank: int, world: int, base: str):
    """Every saved layout into every layout (same world): placement changes
    (1-D -> 1-D, 2-D -> 2-D) and mesh changes (1-D <-> 2-D); the plain
    single-process checkpoint into every layout."""
    return {**reshard(base, world, LAYOUTS), **reshard(base, world, LAYOUTS, "dt_plain")}


@scenario("w2")
def dtensor_reshard_w2(rank: int, world: int, base: str):
    return reshard(base, world, W2_LAYOUTS)


@scenario("w3", full_only=True)
def dtensor_reshard_w3(rank: int, world: int, base: str):
    return reshard(base, world, ("S0", "S1", "R"))


@scenario("w1_load")
def dtensor_reshard_w1(rank: int, world: int, base: str):
    state = {src: {k: torch.zeros_like(v) for k, v in globals_().items()} for src in LAYOUTS}
    tensorckpt.load(state, path(base, "dt_all"))
    return {src: {k: full(v) for k, v in values.items()} for src, values in state.items()}


def _assert_no_mismatch(bad: dict) -> None:
    wrong = {k: v for k, v in bad.items() if v}
    assert not wrong, wrong


def test_1d_2d_placement_and_mesh_changes_at_world4(peer):
    """Port of test/distributed/checkpoint/test_dtensor_resharding.py::TestDTensorReshardPlacementChange::test_1d_to_1d_reshard_placement_change,
    ::test_2d_to_2d_reshard_placement_change, ::TestDTensorReshardMeshChange::test_1d_to_2d_reshard_mesh_change
    and ::test_2d_to_1d_reshard_mesh_change (all pairs of DCP's layouts plus S1 and S0S1, at world 4)."""
    for rank, bad in enumerate(peer.all("w4", "dtensor_reshard_w4")):
        assert len(bad) == 2 * len(LAYOUTS) ** 2
        _assert_no_mismatch(bad)


def test_dtensor_checkpoints_load_at_world2(peer):
    """Port of test/distributed/checkpoint/test_dtensor_resharding.py (its TODO: "dtensor resharding test
    when world size changes"): every 4-rank layout loads on 2 ranks."""
    for bad in peer.all("w2", "dtensor_reshard_w2"):
        _assert_no_mismatch(bad)


def test_dtensor_checkpoints_load_in_one_process(peer):
    """Port of test/distributed/checkpoint/test_dtensor_resharding.py: every 4-rank layout loads into plain tensors."""
    out = peer.get("w1_load", "dtensor_reshard_w1")
    for src, values in out.items():
        for key, g in globals_().items():
            assert np.array_equal(values[key], g.numpy()), (src, key)


def test_dtensor_checkpoints_load_at_world3(peer):
    """Port of test/distributed/checkpoint/test_dtensor_resharding.py at world 3 (uneven shards; FULL only)."""
    import pytest

    if "w3" not in peer.by_phase:
        pytest.skip("TENSORCKPT_PEER_FULL=1 runs world 3")
    for bad in peer.all("w3", "dtensor_reshard_w3"):
        _assert_no_mismatch(bad)


# ------------------------------------------------------------------ tensor parallel


class MLP(nn.Module):
    """The shape of DCP's MLPModule (common_dtensor.py): 10 -> 16 -> 10."""

    def __init__(self, seed: int = 5) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net1 = nn.Linear(10, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 10)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def tp_mlp(world: int, seed: int = 5) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    return parallelize_module(MLP(seed), mesh((world,)), {"net1": ColwiseParallel(), "net2": RowwiseParallel()})


@scenario("w4")
def tp_checkpoint_w4(rank: int, world: int, base: str):
    model = tp_mlp(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    saved = model_values(model)
    saved_local = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    tensorckpt.save({"model": model}, path(base, "tp_mlp"))
    torch.manual_seed(0)
    model(torch.rand(20, 10)).sum().backward()
    opt.step()
    changed = all(not torch.equal(saved_local[k], v.to_local()) for k, v in model.state_dict().items())
    tensorckpt.load({"model": model}, path(base, "tp_mlp"))
    same_local = all(torch.equal(saved_local[k], v.to_local()) for k, v in model.state_dict().items())
    return {"saved": saved, "changed": changed, "same_local": same_local, "loaded": model_values(model)}


@scenario("w2")
def tp_checkpoint_w2(rank: int, world: int, base: str):
    model = tp_mlp(world, seed=1)
    tensorckpt.load({"model": model}, path(base, "tp_mlp"))
    return model_values(model)


@scenario("w3", full_only=True)
def tp_checkpoint_w3(rank: int, world: int, base: str):
    model = tp_mlp(world, seed=1)  # 16 rows over 3 ranks: 6, 6, 4
    tensorckpt.load({"model": model}, path(base, "tp_mlp"))
    return model_values(model)


@scenario("w1_load")
def tp_checkpoint_w1(rank: int, world: int, base: str):
    model = MLP(seed=1)
    tensorckpt.load({"model": model}, path(base, "tp_mlp"))
    return model_values(model)


def _same(a: dict, b: dict, where: str = "") -> None:
    assert a.keys() == b.keys(), (where, sorted(a), sorted(b))
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{where}: {k}"


def test_tp_checkpoint(peer):
    """Port of test/distributed/checkpoint/test_tp_checkpoint.py::TestTpCheckpoint::test_tp_checkpoint
    (PairwiseParallel, since removed from torch, as ColwiseParallel/RowwiseParallel): save at TP=4, an SGD
    step changes every shard, loading restores every local shard bit for bit."""
    for r in peer.all("w4", "tp_checkpoint_w4"):
        assert r["changed"] and r["same_local"]
        _same(r["loaded"], r["saved"])


def test_tp_checkpoint_loads_at_tp2_and_plain(peer):
    """Port of test/distributed/checkpoint/test_tp_checkpoint.py::TestTpCheckpoint::test_tp_checkpoint,
    loaded at TP=2 and into a plain module."""
    saved = peer.get("w4", "tp_checkpoint_w4")["saved"]
    for r in peer.all("w2", "tp_checkpoint_w2"):
        _same(r, saved, "tp2")
    _same(peer.get("w1_load", "tp_checkpoint_w1"), saved, "plain")
    if "w3" in peer.by_phase:
        for r in peer.all("w3", "tp_checkpoint_w3"):
            _same(r, saved, "tp3")
