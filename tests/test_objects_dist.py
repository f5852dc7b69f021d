"""FSDP2 (``fully_shard`` over gloo on CPU) models and their AdamW state saved
as objects at world 2 and loaded at worlds 1, 2 and 3: parameters and
optimizer moments are DTensors, stored as logical tensors and resharded at
load time. Workers return full tensors (``full_tensor()``); the tests compare
them in the parent. Each world is spawned once:

    world 2   train 3 steps, save; train on (the reference); fresh model and
              optimizer, load, train on (must match the reference bit for bit)
    parent    (world 1) load into a plain model and optimizer; save a plain
              checkpoint of its own
    world 3   load both checkpoints into FSDP2 models with no optimizer state
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from torch import nn

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:  # spawned workers import this module by name
    sys.path.insert(0, _TESTS)

import dist  # noqa: E402

import tensorckpt  # noqa: E402

MOMENTS = ("exp_avg", "exp_avg_sq")


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # 7, 5, 3 rows: uneven shards at worlds 2 and 3
    return nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))


def setup(seed: int, world: int | None):
    """Model (FSDP2 over ``world`` ranks, plain when None), AdamW, StepLR."""
    model = build(seed)
    if world is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train(model, opt, sched, steps, rank: int) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(100 * i + rank)  # each rank its own batch
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def full(t: torch.Tensor) -> np.ndarray:
    """The whole tensor, as numpy (tensors sent back by workers would travel
    as shared memory that dies with the worker)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy().copy()


def snapshot(model, opt, sched) -> dict:
    """Full parameters, moments and steps by parameter name (numpy); the LR state."""
    out = {"lr": opt.param_groups[0]["lr"], "last_epoch": sched.last_epoch}
    for name, p in model.named_parameters():
        out[name] = full(p)
        state = opt.state.get(p, {})
        for m in MOMENTS:
            if m in state:
                out[f"{name}/{m}"] = full(state[m])
        if "step" in state:
            out[f"{name}/step"] = full(state["step"])
    return out


def layout_errors(model, opt) -> list[str]:
    """Every moment must be a DTensor laid out like its parameter."""
    bad = []
    for name, p in model.named_parameters():
        for m in MOMENTS:
            t = opt.state[p][m]
            if not hasattr(t, "placements") or t.placements != p.placements or t.to_local().shape != p.to_local().shape:
                bad.append(f"{name}/{m}: {type(t).__name__} {getattr(t, 'placements', None)} vs {p.placements}")
    return bad


def save_world2(rank: int, world: int, base: str) -> dict:
    model, opt, sched = setup(0, world)
    train(model, opt, sched, range(3), rank)
    tensorckpt.save({"model": model, "optim": opt, "sched": sched, "step": 3}, f"{base}/fsdp2")
    saved = snapshot(model, opt, sched)
    train(model, opt, sched, range(3, 6), rank)
    reference = snapshot(model, opt, sched)

    model2, opt2, sched2 = setup(1, world)
    state = {"model": model2, "optim": opt2, "sched": sched2, "step": 0}
    tensorckpt.load(state, f"{base}/fsdp2")
    loaded, layout = snapshot(model2, opt2, sched2), layout_errors(model2, opt2)
    train(model2, opt2, sched2, range(3, 6), rank)
    return {"saved": saved, "reference": reference, "loaded": loaded, "layout": layout,
            "resumed": snapshot(model2, opt2, sched2), "step": state["step"]}


def load_world3(rank: int, world: int, base: str) -> dict:
    out = {}
    for name in ("fsdp2", "plain"):
        model, opt, sched = setup(1, world)
        state = {"model": model, "optim": opt, "sched": sched, "step": 0}
        tensorckpt.load(state, f"{base}/{name}")
        out[name] = {"loaded": snapshot(model, opt, sched), "layout": layout_errors(model, opt), "step": state["step"]}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("objects"))
    w2 = dist.run(2, save_world2, base)

    model, opt, sched = setup(1, None)  # world 1: plain tensors, no process group
    state = {"model": model, "optim": opt, "sched": sched, "step": 0}
    tensorckpt.load(state, f"{base}/fsdp2")
    w1 = {"loaded": snapshot(model, opt, sched), "step": state["step"]}
    train(model, opt, sched, range(3, 5), rank=0)
    tensorckpt.save({"model": model, "optim": opt, "sched": sched, "step": 5}, f"{base}/plain")
    plain = snapshot(model, opt, sched)

    w3 = dist.run(3, load_world3, base)
    return {"base": base, "w2": w2, "w1": w1, "plain": plain, "w3": w3}


def assert_same(got: dict, expected: dict, where: str) -> None:
    assert got.keys() == expected.keys(), where
    for k, v in expected.items():
        if isinstance(v, np.ndarray):
            assert got[k].dtype == v.dtype and np.array_equal(got[k], v), f"{where}: {k}"
        else:
            assert got[k] == v, f"{where}: {k}: {got[k]!r} vs {v!r}"


def test_saved_at_world2_as_logical_tensors(runs):
    ck = tensorckpt.open(f"{runs['base']}/fsdp2")
    assert ck.metadata.world_size == 2
    saved = runs["w2"][0]["saved"]
    for name in ("0.weight", "2.bias", "4.weight"):
        assert np.array_equal(ck.read(f"model/{name}").numpy(), saved[name])
        for m in MOMENTS:
            assert np.array_equal(ck.read(f"optim/state/{name}/{m}").numpy(), saved[f"{name}/{m}"])
        assert ck.read(f"optim/state/{name}/step") == 3.0


def test_resume_at_same_world_matches_uninterrupted(runs):
    for rank, r in enumerate(runs["w2"]):
        assert r["step"] == 3 and not r["layout"], r["layout"]
        assert_same(r["loaded"], r["saved"], f"rank {rank} after load")
        assert_same(r["resumed"], r["reference"], f"rank {rank} after resuming")


def test_load_at_world1_into_plain_model(runs):
    assert runs["w1"]["step"] == 3
    assert_same(runs["w1"]["loaded"], runs["w2"][0]["saved"], "world 1")


def test_load_at_world3_reshards_moments(runs):
    for rank, r in enumerate(runs["w3"]):
        assert r["fsdp2"]["step"] == 3 and not r["fsdp2"]["layout"], r["fsdp2"]["layout"]
        assert_same(r["fsdp2"]["loaded"], runs["w2"][0]["saved"], f"rank {rank} of 3")


def test_plain_checkpoint_loads_into_fsdp2_at_world3(runs):
    for rank, r in enumerate(runs["w3"]):
        assert r["plain"]["step"] == 5 and not r["plain"]["layout"], r["plain"]["layout"]
        assert_same(r["plain"]["loaded"], runs["plain"], f"rank {rank} of 3")
