"""Ports of DCP's e2e/test_fsdp_ep.py and e2e/test_pipeline.py: state that
differs per rank (expert layers on some ranks, one pipeline stage per rank),
saved at world 4, loaded into other layouts.
"""

from __future__ import annotations

import numpy as np
import torch
from _suite import (
    fsdp2,
    full,
    mesh,
    model_values,
    optim_values,
    path,
    same,
    scenario,
)
from torch import nn

import tensorckpt

# ------------------------------------------------ e2e/test_fsdp_ep.py


class EP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.net2 = nn.Sequential(nn.Linear(16, 16), nn.ReLU())


class Top(nn.Module):
    """DCP's TopModel: shared layers on every rank, expert layer ``i`` only on the ranks that hold it
    (``ep_layers`` has ``n`` slots; a rank holds ``mine``)."""

    def __init__(self, n: int, mine: set[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.second = nn.Module()
        self.second.net = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        experts = []
        for i in range(n):
            torch.manual_seed(100 + i)  # every holder of expert i builds the same values
            experts.append(EP() if i in mine else nn.Identity())
        self.second.ep_layers = nn.ModuleList(experts)
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(16, 16), nn.ReLU())


def ep_step(model, opt) -> None:
    """One optimizer step with each parameter's gradient set to its value (no forward: the
    DCP test runs none either, and parameters live on different meshes)."""
    for p in model.parameters():
        p.grad = p.detach().clone()
    opt.step()
    opt.zero_grad()


@scenario("w4")
def fsdp_ep_w4(rank: int, world: int, base: str):
    from torch.distributed.fsdp import fully_shard

    two_d = mesh((2, world // 2), ("dp", "ep"))
    layer = rank % (world // 2)  # expert `layer` lives on the dp pair (layer, layer + world // 2)
    model = Top(world // 2, {layer})
    fully_shard(model.second.ep_layers[layer], mesh=two_d["dp"])
    fully_shard(model.second.net, mesh=mesh((world,)))
    fully_shard(model, mesh=mesh((world,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    ep_step(model, opt)
    tensorckpt.save({"model": model, "optim": opt}, path(base, "fsdp_ep"))
    keys = tensorckpt.open(path(base, "fsdp_ep")).keys()
    return {"keys": keys, "model": model_values(model), "optim": optim_values(model, opt)}


@scenario("w2")
def fsdp_ep_model_w2(rank: int, world: int, base: str):
    """Each of 2 ranks holds one expert (no FSDP on it); the model only (strict=False: the optimizer is left out)."""
    import warnings

    model = Top(2, {rank})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensorckpt.load({"model": model}, path(base, "fsdp_ep"), strict=False)
    return model_values(model)


@scenario("w2")
def fsdp_ep_optim_w2(rank: int, world: int, base: str):
    model = Top(2, {rank})
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    tensorckpt.load({"model": model, "optim": opt}, path(base, "fsdp_ep"))
    return {"model": model_values(model), "optim": optim_values(model, opt)}


@scenario("w1_load")
def fsdp_ep_w1(rank: int, world: int, base: str):
    model = Top(2, {0, 1})
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    tensorckpt.load({"model": model, "optim": opt}, path(base, "fsdp_ep"))
    return {"model": model_values(model), "optim": optim_values(model, opt)}


def _expert_keys(values: dict, i: int) -> dict:
    return {k: v for k, v in values.items() if f"ep_layers.{i}." in k}


def test_fsdp_ep_save_and_model_reload(peer):
    """Port of test/distributed/checkpoint/e2e/test_fsdp_ep.py::TestFSDPWithEP::test_e2e: shared layers FSDP2
    over 4 ranks, each expert FSDP2 over its own pair of ranks; every expert's parameters and moments are
    stored under its FQN; the model reloads at world 2 with one expert per rank."""
    w4 = peer.all("w4", "fsdp_ep_w4")
    keys = set(w4[0]["keys"])
    for i in range(2):
        for leaf in ("net1.0.weight", "net2.0.bias"):
            assert f"model/second.ep_layers.{i}.{leaf}" in keys
            assert f"optim/state/second.ep_layers.{i}.{leaf}/exp_avg" in keys
    for rank, r in enumerate(peer.all("w2", "fsdp_ep_model_w2")):
        same(_expert_keys(r, rank), _expert_keys(w4[rank]["model"], rank), f"expert {rank}")
        assert np.array_equal(r["net.0.weight"], w4[0]["model"]["net.0.weight"])


def test_fsdp_ep_optimizer_reload(peer):
    """Port of test/distributed/checkpoint/e2e/test_fsdp_ep.py::TestFSDPWithEP::test_e2e (optimizer half):
    the per-rank optimizers' state reloads at world 2 (one expert per rank) and in one process (both experts)."""
    w4 = peer.all("w4", "fsdp_ep_w4")
    for rank, r in enumerate(peer.all("w2", "fsdp_ep_optim_w2")):
        same(_expert_keys(r["optim"], rank), _expert_keys(w4[rank]["optim"], rank), f"expert {rank}")
    one = peer.get("w1_load", "fsdp_ep_w1")
    for i in range(2):
        same(_expert_keys(one["optim"], i), _expert_keys(w4[i]["optim"], i), f"expert {i}")


# ------------------------------------------------ e2e/test_pipeline.py

DIM = 16  # DCP: 500


class Pipeline(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for i in range(1, 5):
            setattr(self, f"layer{i}", nn.Linear(DIM, DIM))


@scenario("w4")
def pipeline_save_w4(rank: int, world: int, base: str):
    """Each rank materializes one stage (its layer) of a meta-device model, as DCP's test does."""
    with torch.device("meta"):
        model = Pipeline()
    stage = getattr(model, f"layer{rank + 1}")
    stage.to_empty(device="cpu")
    torch.manual_seed(10 + rank)
    stage.reset_parameters()
    optim = torch.optim.Adam(stage.parameters(), lr=1e-3)
    ep_step(stage, optim)
    tensorckpt.save({"model": model, "optim": optim}, path(base, "pipeline_meta"))
    return {k: full(v) for k, v in stage.state_dict().items()}


@scenario("w4")
def pipeline_stage_modules_w4(rank: int, world: int, base: str):
    """The same pipeline with each rank passing only its stage (a module holding just its layer)."""
    model = Pipeline()
    for i in range(1, 5):
        if i != rank + 1:
            delattr(model, f"layer{i}")
    stage = getattr(model, f"layer{rank + 1}")
    torch.manual_seed(10 + rank)
    stage.reset_parameters()
    optim = torch.optim.Adam(stage.parameters(), lr=1e-3)
    ep_step(stage, optim)
    tensorckpt.save({"model": model, "optim": optim}, path(base, "pipeline_stages"))
    return {"model": model_values(model), "optim": optim_values(model, optim)}


def _fsdp_pipeline(world: int):

    torch.manual_seed(99)
    model = fsdp2(Pipeline(), mesh((world,)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


@scenario("w4")
def pipeline_load_fsdp_w4(rank: int, world: int, base: str):
    """Load into FSDP on all 4 ranks (DCP's load_with_fsdp): the model alone."""
    import warnings

    model, _ = _fsdp_pipeline(world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensorckpt.load({"model": model}, path(base, "pipeline_stages"), strict=False)
    return model_values(model)


@scenario("w4")
def pipeline_load_fsdp_optim_w4(rank: int, world: int, base: str):
    model, optim = _fsdp_pipeline(world)
    tensorckpt.load({"model": model, "optim": optim}, path(base, "pipeline_stages"))
    return {"model": model_values(model), "optim": optim_values(model, optim)}


@scenario("w4")
def pipeline_load_meta_fsdp_w4(rank: int, world: int, base: str):
    model, optim = _fsdp_pipeline(world)
    tensorckpt.load({"model": model, "optim": optim}, path(base, "pipeline_meta"))
    return {"model": model_values(model), "optim": optim_values(model, optim)}


def _stage_of(values: dict, rank: int) -> dict:
    return {k: v for k, v in values.items() if k.startswith(f"layer{rank + 1}.")}


def test_pipeline_stages_load_into_fsdp_model(peer):
    """Port of test/distributed/checkpoint/e2e/test_pipeline.py::TestPipeline::test_pipeline (model half; each
    rank saves only its stage module): the 4 stages load into one FSDP2 model over 4 ranks."""
    stages = peer.all("w4", "pipeline_stage_modules_w4")
    for r in peer.all("w4", "pipeline_load_fsdp_w4"):
        for rank, s in enumerate(stages):
            same(_stage_of(r, rank), s["model"], f"stage {rank}")


def test_pipeline_stage_optimizers_load_into_fsdp(peer):
    """Port of test/distributed/checkpoint/e2e/test_pipeline.py::TestPipeline::test_pipeline: the 4 stage
    optimizers' state loads into the FSDP2 model's one optimizer."""
    stages = peer.all("w4", "pipeline_stage_modules_w4")
    for r in peer.all("w4", "pipeline_load_fsdp_optim_w4"):
        for rank, s in enumerate(stages):
            same({k: v for k, v in r["optim"].items() if k.startswith(f"layer{rank + 1}.")},
                 {k: v for k, v in s["optim"].items() if not k.startswith("group")}, f"stage {rank}")


def test_pipeline_meta_model(peer):
    """Port of test/distributed/checkpoint/e2e/test_pipeline.py::TestPipeline::test_pipeline as written: each
    rank saves the whole meta-device model with only its stage materialized (a tensor on meta holds no data
    on that rank: spec format-v1.md 8.4); the FSDP2 model loads every stage."""
    stages = peer.all("w4", "pipeline_save_w4")
    for r in peer.all("w4", "pipeline_load_meta_fsdp_w4"):
        for rank, s in enumerate(stages):
            same(_stage_of(r["model"], rank), {f"layer{rank + 1}.{k}": v for k, v in s.items()}, f"stage {rank}")
