"""Ports of DCP's FSDP / HSDP / optimizer-state tests (test_fsdp_model_state.py,
test_fsdp_optim_state.py, test_hsdp_checkpoint.py, fsdp/test_fsdp_dsd.py): modules
and optimizers go straight into the state (``{"model": model, "optim": opt}``),
saved at world 4 and loaded at world 4 under another layout, at world 2 and in
one process. Model shapes follow DCP's test models; the definitions are this
suite's own.
"""

from __future__ import annotations

import numpy as np
import torch
from _suite import (
    fsdp2,
    materialized,
    mesh,
    model_values,
    optim_values,
    path,
    same,
    scenario,
)
from torch import nn

import tensorckpt

# ------------------------------------------------ test_fsdp_model_state.py


def linear8(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(8, 8)


@scenario("w4")
def fsdp_model_state_w4(rank: int, world: int, base: str):
    # DCP builds the Linear on meta and lets FSDP materialize it; FSDP2 does that with to_empty + init
    with torch.device("meta"):
        model = nn.Linear(8, 8)
    fsdp2(model, mesh((world,)), children=False)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    model(torch.rand(8, 8)).sum().backward()
    tensorckpt.save({"model": model}, path(base, "fsdp_linear"))
    saved = model_values(model)
    out = {"saved": saved}
    # no resharding: the same layout; with resharding: FSDP2 over the even / odd ranks' subgroups
    two_d = mesh((2, world // 2), ("rep", "shard"))
    for name, m in (("same", mesh((world,))), ("subgroup", two_d["rep"])):
        model2 = fsdp2(linear8(1), m, children=False)
        differ = any(not np.array_equal(v, saved[k]) for k, v in model_values(model2).items())
        tensorckpt.load({"model": model2}, path(base, "fsdp_linear"))
        out[name] = {"differed": differ, "loaded": model_values(model2)}
    return out


@scenario("w4")
def fsdp_model_state_meta_w4(rank: int, world: int, base: str):
    with torch.device("meta"):
        model = nn.Linear(8, 8)
    fsdp2(model, mesh((world,)), children=False)
    tensorckpt.load({"model": model}, path(base, "fsdp_linear"))
    return materialized(model)


@scenario("w2")
def fsdp_model_state_w2(rank: int, world: int, base: str):
    model = fsdp2(linear8(1), mesh((world,)), children=False)
    tensorckpt.load({"model": model}, path(base, "fsdp_linear"))
    return model_values(model)


@scenario("w1_load")
def fsdp_model_state_w1(rank: int, world: int, base: str):
    model = linear8(1)
    tensorckpt.load({"model": model}, path(base, "fsdp_linear"))
    return model_values(model)


def test_fsdp_model_state_no_resharding_and_with_resharding(peer):
    """Port of test/distributed/checkpoint/test_fsdp_model_state.py::FsdpModelStateCheckpoint::test_fsdp_model_state_no_resharding
    and ::test_fsdp_model_state_with_resharding (FSDP1 as FSDP2; resharding onto FSDP over the even and odd
    ranks' subgroups), and the same checkpoint at world 2 and in one process."""
    for r in peer.all("w4", "fsdp_model_state_w4"):
        for name in ("same", "subgroup"):
            assert r[name]["differed"], name
            same(r[name]["loaded"], r["saved"], name)
    saved = peer.get("w4", "fsdp_model_state_w4")["saved"]
    for r in peer.all("w2", "fsdp_model_state_w2"):
        same(r, saved, "world 2")
    same(peer.get("w1_load", "fsdp_model_state_w1"), saved, "world 1")


def test_fsdp_model_state_into_meta_model(peer):
    """Port of test/distributed/checkpoint/test_fsdp_model_state.py::FsdpModelStateCheckpoint::_test_fsdp_model_state
    (its model is built on the meta device): loading into an FSDP2 module still on meta materializes it."""
    saved = peer.get("w4", "fsdp_model_state_w4")["saved"]
    for r in peer.all("w4", "fsdp_model_state_meta_w4"):
        assert r["devices"] == ["cpu"], r["devices"]
        same(r["loaded"], saved, "meta")


# ------------------------------------------------ test_fsdp_optim_state.py


class DummyModel(nn.Module):
    """DCP's TestDummyModel of test_fsdp_optim_state.py: widths d, 2d, 3d (d = the saving world size)."""

    def __init__(self, d: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net1 = nn.Sequential(nn.Linear(8, d), nn.ReLU())
        self.net2 = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU())
        self.net3 = nn.Sequential(nn.Linear(2 * d, 3 * d), nn.ReLU())

    def forward(self, x):
        return self.net3(self.net2(self.net1(x)))


@scenario("w4")
def fsdp_optim_state_w4(rank: int, world: int, base: str):
    model = fsdp2(DummyModel(world, 0), mesh((world,)))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    model(torch.rand(8, 8)).sum().backward()
    optim.step()
    tensorckpt.save({"model": model, "optim": optim}, path(base, "fsdp_optim"))
    model2 = fsdp2(DummyModel(world, 1), mesh((world,)))
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.1)
    empty = len(optim2.state) == 0
    tensorckpt.load({"model": model2, "optim": optim2}, path(base, "fsdp_optim"))
    return {"saved": optim_values(model, optim), "model": model_values(model), "empty": empty,
            "loaded": optim_values(model2, optim2), "loaded_model": model_values(model2),
            "layout": all(optim2.state[p]["exp_avg"].placements == p.placements for p in model2.parameters())}


@scenario("w2")
def fsdp_optim_state_w2(rank: int, world: int, base: str):
    model = fsdp2(DummyModel(4, 1), mesh((world,)))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    tensorckpt.load({"model": model, "optim": optim}, path(base, "fsdp_optim"))
    return {"optim": optim_values(model, optim), "model": model_values(model)}


@scenario("w3", full_only=True)
def fsdp_optim_state_w3(rank: int, world: int, base: str):
    return fsdp_optim_state_w2(rank, world, base)


@scenario("w1_load")
def fsdp_optim_state_w1(rank: int, world: int, base: str):
    model = DummyModel(4, 1)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    tensorckpt.load({"model": model, "optim": optim}, path(base, "fsdp_optim"))
    return {"optim": optim_values(model, optim), "model": model_values(model)}


def test_load_sharded_optimizer_state_dict(peer):
    """Port of test/distributed/checkpoint/test_fsdp_optim_state.py::FsdpOptimStateCheckpoint::test_load_sharded_optimizer_state_dict
    (FSDP1 as FSDP2): Adam's lazily created state is restored into a fresh optimizer, moments sharded like
    their parameters; the same checkpoint at world 2 and in one process."""
    ref = peer.get("w4", "fsdp_optim_state_w4")
    for r in peer.all("w4", "fsdp_optim_state_w4"):
        assert r["empty"] and r["layout"]
        same(r["loaded"], ref["saved"], "world 4")
        same(r["loaded_model"], ref["model"], "world 4 model")
    more = peer.all("w3", "fsdp_optim_state_w3") if "w3" in peer.by_phase else []
    for r in peer.all("w2", "fsdp_optim_state_w2") + [peer.get("w1_load", "fsdp_optim_state_w1")] + more:
        same(r["optim"], ref["saved"], "reload")
        same(r["model"], ref["model"], "reload model")


# ------------------------------------------------ test_hsdp_checkpoint.py


class SimpleModel(nn.Module):
    def __init__(self, uneven: bool, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        dims = (5, 10, 15, 30, 5) if uneven else (5, 8, 4, 12)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def hsdp(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=mesh((2, world // 2), ("replicate", "shard")))


@scenario("w4")
def hsdp_checkpoint_w4(rank: int, world: int, base: str):
    out = {}
    for uneven in (False, True):
        name = f"hsdp_{'uneven' if uneven else 'even'}"
        model = hsdp(SimpleModel(uneven), world)
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        before = {k: (v.placements, v.to_local().clone()) for k, v in model.state_dict().items()}
        tensorckpt.save({"model": model}, path(base, name))
        saved = model_values(model)
        model(torch.rand(4, 5)).sum().backward()
        optim.step()
        changed = all(not torch.equal(before[k][1], v.to_local()) for k, v in model.state_dict().items())
        tensorckpt.load({"model": model}, path(base, name))
        restored = all(before[k][0] == v.placements and torch.equal(before[k][1], v.to_local())
                       for k, v in model.state_dict().items())
        # test_hsdp_fsdp_checkpoint_conversion: into FSDP over a 1-D mesh of every rank
        fsdp_model = fsdp2(SimpleModel(uneven, seed=1), mesh((world,)), children=False)
        tensorckpt.load({"model": fsdp_model}, path(base, name))
        out[name] = {"saved": saved, "changed": changed, "restored": restored, "fsdp": model_values(fsdp_model)}
    return out


@scenario("w2")
def hsdp_checkpoint_w2(rank: int, world: int, base: str):
    out = {}
    for uneven in (False, True):
        name = f"hsdp_{'uneven' if uneven else 'even'}"
        model = hsdp(SimpleModel(uneven, seed=1), world)  # HSDP over (2, 1)
        tensorckpt.load({"model": model}, path(base, name))
        out[name] = model_values(model)
    return out


@scenario("w1_load")
def hsdp_checkpoint_w1(rank: int, world: int, base: str):
    out = {}
    for uneven in (False, True):
        name = f"hsdp_{'uneven' if uneven else 'even'}"
        model = SimpleModel(uneven, seed=1)
        tensorckpt.load({"model": model}, path(base, name))
        out[name] = model_values(model)
    return out


def test_hsdp_checkpoint(peer):
    """Port of test/distributed/checkpoint/test_hsdp_checkpoint.py::TestHSDPCheckpoint::test_hsdp_checkpoint
    (HYBRID_SHARD as FSDP2 over a (replicate, shard) mesh; even and uneven models)."""
    for r in peer.all("w4", "hsdp_checkpoint_w4"):
        for name, v in r.items():
            assert v["changed"] and v["restored"], name


def test_hsdp_fsdp_checkpoint_conversion(peer):
    """Port of test/distributed/checkpoint/test_hsdp_checkpoint.py::TestHSDPCheckpoint::test_hsdp_fsdp_checkpoint_conversion,
    and the HSDP checkpoint at world 2 (HSDP over (2, 1)) and in one process."""
    ref = peer.get("w4", "hsdp_checkpoint_w4")
    for r in peer.all("w4", "hsdp_checkpoint_w4"):
        for name, v in r.items():
            same(v["fsdp"], ref[name]["saved"], name)
    for r in peer.all("w2", "hsdp_checkpoint_w2") + [peer.get("w1_load", "hsdp_checkpoint_w1")]:
        for name, v in r.items():
            same(v, ref[name]["saved"], name)




# ------------------------------------------------ fsdp/test_fsdp_dsd.py


class Block(nn.Module):
    """The shape of common_fsdp.MLP: in_proj dim -> 4 dim, out_proj 4 dim -> dim."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, 4 * dim)
        self.out_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.out_proj(torch.relu(self.in_proj(x)))


def blocks(seed: int, dim: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Block(dim), Block(dim), Block(dim))


TP_PLAN = {f"{i}.{p}": None for i in range(3) for p in ("in_proj", "out_proj")}


def dsd_layout(kind: str, world: int, seed: int) -> nn.Module:
    """"plain", "tp" (1-D over every rank), "fsdp" (1-D), "fsdp_tp" (2x2 (dp, tp))."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = blocks(seed)
    plan = {k: ColwiseParallel() if k.endswith("in_proj") else RowwiseParallel() for k in TP_PLAN}
    if kind == "tp":
        parallelize_module(model, mesh((world,)), plan)
    elif kind == "fsdp":
        fsdp2(model, mesh((world,)))
    elif kind == "fsdp_tp":
        m = mesh((2, world // 2), ("dp", "tp"))
        parallelize_module(model, m["tp"], plan)
        fsdp2(model, m["dp"])
    return model


def dsd_step(model, opt) -> None:
    torch.manual_seed(4)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


DSD_SOURCES = ("plain", "tp", "fsdp", "fsdp_tp")  # "plain": saved by every rank, the same values
DSD_TARGETS = {"w4": ("tp", "fsdp", "fsdp_tp"), "w2": ("tp", "fsdp"), "w1_load": ("plain",), "w3": ("tp", "fsdp")}


@scenario("w4")
def dsd_save_w4(rank: int, world: int, base: str):
    """Every source layout takes one AdamW step on the same batch and is saved."""
    out = {}
    for kind in DSD_SOURCES:
        model = dsd_layout(kind, world, 0)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        dsd_step(model, opt)
        try:
            tensorckpt.save({"model": model, "optim": opt}, path(base, f"dsd_{kind}"))
            out[kind] = {"model": model_values(model), "optim": optim_values(model, opt)}
        except tensorckpt.TensorckptError as e:
            out[kind] = (type(e).__name__, str(e))
    return out


def _dsd_load(phase: str, world: int, base: str) -> dict:
    out = {}
    for src in DSD_SOURCES:
        for dst in DSD_TARGETS[phase]:
            model = dsd_layout(dst, world, 1)
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            try:
                tensorckpt.load({"model": model, "optim": opt}, path(base, f"dsd_{src}"))
                out[(src, dst)] = {"model": model_values(model), "optim": optim_values(model, opt)}
            except tensorckpt.TensorckptError as e:
                out[(src, dst)] = (type(e).__name__, str(e))
    return out


@scenario("w4")
def dsd_load_w4(rank: int, world: int, base: str):
    return _dsd_load("w4", world, base)


@scenario("w2")
def dsd_load_w2(rank: int, world: int, base: str):
    return _dsd_load("w2", world, base)


@scenario("w3", full_only=True)
def dsd_load_w3(rank: int, world: int, base: str):
    return _dsd_load("w3", world, base)


@scenario("w1_load")
def dsd_load_w1(rank: int, world: int, base: str):
    return _dsd_load("w1_load", world, base)


def _dsd_check(peer, pairs) -> None:
    """Every (source, target) pair's loaded model and AdamW state equal the source's saved ones
    (bit-exact); a recorded error is raised as its tensorckpt class."""
    saved = peer.get("w4", "dsd_save_w4")
    for phase in [p for p in ("w4", "w2", "w1_load", "w3") if p in peer.by_phase]:
        for r in peer.all(phase, f"dsd_load_{'w1' if phase == 'w1_load' else phase}"):
            for (src, dst), v in r.items():
                if (src, dst) not in pairs:
                    continue
                for got in (saved[src], v):
                    if isinstance(got, tuple):
                        raise getattr(tensorckpt, got[0], tensorckpt.TensorckptError)(f"{src} -> {dst}: {got[1]}")
                same(v["model"], saved[src]["model"], f"{src} -> {dst} ({phase})")
                same(v["optim"], saved[src]["optim"], f"{src} -> {dst} optim ({phase})")


ALL_PAIRS = {(s, d) for s in DSD_SOURCES for d in ("plain", "tp", "fsdp", "fsdp_tp")}


def test_dsd_without_fsdp_tp(peer):
    """Port of test/distributed/checkpoint/fsdp/test_fsdp_dsd.py (model + AdamW saved in one layout, loaded in
    another) for the layouts without FSDP2 x TP: plain, TP over 4 and FSDP2 over 4, into TP / FSDP2 at
    worlds 4 and 2 and into one process."""
    _dsd_check(peer, {(s, d) for s, d in ALL_PAIRS if "fsdp_tp" not in (s, d)})


def test_save_with_fsdp2_tp_and_load_with_tp(peer):
    """Port of test/distributed/checkpoint/fsdp/test_fsdp_dsd.py::TestFullyShardWithDistributedStateDict::test_save_with_fsdp2_tp_and_load_with_tp:
    FSDP2 x TP (2x2) saved, loaded with TP at worlds 4 and 2, FSDP2 at worlds 4 and 2, and in one process."""
    _dsd_check(peer, {("fsdp_tp", d) for d in ("plain", "tp", "fsdp")})


def test_save_with_tp_and_load_with_fsdp2_tp(peer):
    """Port of test/distributed/checkpoint/fsdp/test_fsdp_dsd.py::TestFullyShardWithDistributedStateDict::test_save_with_tp_and_load_with_fsdp2_tp
    and ::test_save_with_fsdp1_and_load_with_fsdp2_tp (FSDP1 as FSDP2; plain as the "full" state dict):
    TP, FSDP2 and plain checkpoints load into FSDP2 x TP (2x2)."""
    _dsd_check(peer, {(s, "fsdp_tp") for s in ("plain", "tp", "fsdp", "fsdp_tp")})
