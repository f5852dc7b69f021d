"""Optimizers whose parameters differ per rank, saved through tensorckpt.save
and loaded at another layout (format 1.2, training-state.md 4):

    expert parallelism   each rank its own experts ("experts.<global id>.*")
                         plus the shared parameters; EP=4 -> EP=2 -> EP=1
    pipeline parallelism each stage its own layers, numbered from 0 on every
                         stage, saved through shift_layers(module, offset);
                         PP=4 -> PP=2

with AdamW (two param groups of different hyperparameters) after two steps.
Every tensor's value and every gradient is a function of the parameter's
global name, so the state a rank must hold after loading is known without
communication: each rank compares it with a reference it computes itself.

Also here: a save whose ranks pass different values under one key fails
before it commits; objects whose state_dict()/load_state_dict() run
collectives are handled in key-path order whatever each rank's dict order.

Spawns: world 4 once (ranks 0 and 1 then also act as a world of 2, a
subgroup); the rest runs in the parent.
"""

from __future__ import annotations

import os
import sys
import zlib

import warnings

import pytest
import torch
from torch import nn

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:  # spawned workers import this module by name
    sys.path.insert(0, _TESTS)

import dist  # noqa: E402

import tensorckpt  # noqa: E402

EXPERTS, LAYERS, STEPS = 4, 4, 2


def _values(name: str, shape, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + salt)
    return torch.randn(shape, generator=g)


def _fill(module: nn.Module, names: dict[str, str]) -> None:
    """Each parameter's value from its global name (``names``: local -> global)."""
    with torch.no_grad():
        for local, p in module.named_parameters():
            p.copy_(_values(names.get(local, local), p.shape))


def _train(module: nn.Module, opt, names: dict[str, str]) -> None:
    for step in range(STEPS):
        for local, p in module.named_parameters():
            p.grad = _values(names.get(local, local), p.shape, salt=step + 1)
        opt.step()
        opt.zero_grad()


def _groups(module: nn.Module, first_lr: float = 0.01):
    """Two groups: weights (decay 0.1, lr 0.01) and biases (no decay, lr 0.02)."""
    named = list(module.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1, "lr": first_lr},
            {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0, "lr": 0.02}]


# ------------------------------------------------------------------ experts


class MoE(nn.Module):
    def __init__(self, experts) -> None:
        super().__init__()
        self.shared = nn.Linear(3, 3)
        self.experts = nn.ModuleDict({str(e): nn.Linear(3, 2) for e in experts})


def ep_experts(ep: int, rank: int) -> list[int]:
    per = EXPERTS // ep
    return list(range(rank * per, (rank + 1) * per))


def ep_setup(ep: int, rank: int, trained: bool):
    model = MoE(ep_experts(ep, rank))
    _fill(model, {})
    opt = torch.optim.AdamW(_groups(model))
    if trained:
        _train(model, opt, {})
    return model, opt


def check_against_reference(model, opt, names: dict[str, str], reference) -> list[str]:
    """What differs between (model, opt) and the reference, by global name."""
    ref_model, ref_opt, ref_names = reference
    ref_params = {ref_names.get(n, n): p for n, p in ref_model.named_parameters()}
    bad = []
    for local, p in model.named_parameters():
        name = names.get(local, local)
        q = ref_params[name]
        if not torch.equal(p, q):
            bad.append(f"{name}: parameter")
        mine, theirs = opt.state.get(p, {}), ref_opt.state.get(q, {})
        if set(mine) != set(theirs):
            bad.append(f"{name}: state {sorted(mine)} vs {sorted(theirs)}")
        for k in theirs:
            if k in mine and not torch.equal(mine[k], theirs[k]):
                bad.append(f"{name}: {k}")
    for g in opt.param_groups:
        kind = "weight" if any(n.endswith("weight") for n, p in model.named_parameters() if any(p is q for q in g["params"])) else "bias"
        want = ref_opt.param_groups[0 if kind == "weight" else 1]
        for k in ("lr", "weight_decay", "betas"):
            if g[k] != want[k]:
                bad.append(f"group of {kind}s: {k} {g[k]} vs {want[k]}")
    return bad


# ----------------------------------------------------------------- pipeline


class Stage(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(layers)])


def pp_setup(pp: int, rank: int, trained: bool):
    first = tensorckpt.stage_offset(LAYERS, pp, rank)
    count = tensorckpt.stage_offset(LAYERS, pp, rank + 1) - first if rank + 1 < pp else LAYERS - first
    stage = Stage(count)
    view = tensorckpt.shift_layers(stage, first)
    names = {n: view.rename(n) for n, _ in stage.named_parameters()}
    _fill(stage, names)
    opt = torch.optim.AdamW(_groups(stage))
    if trained:
        _train(stage, opt, names)
    return stage, view, opt, names


# ------------------------------------------------------- collectives in order


class Collective:
    """An object whose state_dict() and load_state_dict() all-reduce its id:
    ranks that call them in different orders pair different objects."""

    def __init__(self, ident: int, group) -> None:
        self.ident, self.group, self.seen = ident, group, []

    def _reduce(self) -> None:
        import torch.distributed as tdist

        t = torch.tensor([float(self.ident)])
        tdist.all_reduce(t, group=self.group)
        self.seen.append(t.item() / tdist.get_world_size(self.group))

    def state_dict(self) -> dict:
        self._reduce()
        return {"ident": self.ident}

    def load_state_dict(self, state) -> None:
        self._reduce()


# ------------------------------------------------------------------ workers


def worker(rank: int, world: int, base: str) -> dict:
    """World 4 saves EP=4 and PP=4; ranks 0 and 1 then act as a world of 2
    (a subgroup: one spawn for both worlds)."""
    import torch.distributed as tdist

    model, opt = ep_setup(4, rank, trained=True)
    tensorckpt.save({"model": model, "optim": opt}, f"{base}/ep4")
    _, view, sopt, _ = pp_setup(4, rank, trained=True)
    tensorckpt.save({"model": view, "optim": sopt}, f"{base}/pp4")
    pair = tdist.new_group([0, 1])
    out = world2(rank, pair, base) if rank < 2 else {}
    tdist.barrier()
    return out


def world2(rank: int, pg, base: str) -> dict:
    out: dict = {}
    # EP=4 -> EP=2: fresh objects (other values, no optimizer state)
    model, opt = ep_setup(2, rank, trained=False)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    tensorckpt.load({"model": model, "optim": opt}, f"{base}/ep4", process_group=pg)
    ref_model, ref_opt = ep_setup(1, 0, trained=True)
    out["ep4->2"] = check_against_reference(model, opt, {}, (ref_model, ref_opt, {}))
    # EP=2 save (for the parent's EP=1 load)
    model, opt = ep_setup(2, rank, trained=True)
    tensorckpt.save({"model": model, "optim": opt}, f"{base}/ep2", process_group=pg)
    # PP=4 -> PP=2
    stage, view, sopt, names = pp_setup(2, rank, trained=False)
    tensorckpt.load({"model": view, "optim": sopt}, f"{base}/pp4", process_group=pg)
    ref_stage, _, ref_opt, ref_names = pp_setup(1, 0, trained=True)
    out["pp4->2"] = check_against_reference(stage, sopt, names, (ref_stage, ref_opt, ref_names))
    # a save that would lose a value fails before it commits, on every rank
    model, opt = ep_setup(2, rank, trained=True)
    for g in opt.param_groups:
        g["lr"] *= 1 + rank  # the shared parameters' hyperparameters now differ per rank
    try:
        tensorckpt.save({"model": model, "optim": opt}, f"{base}/lossy", process_group=pg)
        out["lossy"] = None
    except tensorckpt.IncompatibleStateError as e:
        out["lossy"] = str(e)
    out["lossy_exists"] = os.path.exists(f"{base}/lossy")
    # objects with collectives, in dicts of different orders on the two ranks
    objs = {name: Collective(i + 1, pg) for i, name in enumerate(["a", "b", "c"])}
    order = ["a", "b", "c"] if rank == 0 else ["c", "a", "b"]
    state = {"z": {n: objs[n] for n in order}, "step": 1} if rank == 0 else {"step": 1, "z": {n: objs[n] for n in order}}
    tensorckpt.save(state, f"{base}/order", process_group=pg)
    tensorckpt.load(state, f"{base}/order", process_group=pg)
    out["order"] = {n: o.seen for n, o in objs.items()}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("layouts"))
    return base, dist.run(4, worker, base, timeout=180)[:2]


def test_expert_parallel_4_to_2(runs):
    _, results = runs
    for rank, r in enumerate(results):
        assert r["ep4->2"] == [], f"rank {rank}: {r['ep4->2']}"


def test_expert_parallel_2_to_1_and_keys(runs):
    base, _ = runs
    ck = tensorckpt.open(f"{base}/ep2")
    names = [n for n, _ in MoE(range(EXPERTS)).named_parameters()]
    assert sorted(k.split("/")[2] for k in ck.keys() if k.startswith("optim/group_of/")) == sorted(names)
    assert len({ck.read(f"optim/group_of/{n}") for n in names}) == 2  # two groups, stored once each
    model, opt = ep_setup(1, 0, trained=False)
    tensorckpt.load({"model": model, "optim": opt}, f"{base}/ep2")
    ref_model, ref_opt = ep_setup(1, 0, trained=True)
    assert check_against_reference(model, opt, {}, (ref_model, ref_opt, {})) == []


def test_pipeline_4_to_2(runs):
    base, results = runs
    for rank, r in enumerate(results):
        assert r["pp4->2"] == [], f"rank {rank}: {r['pp4->2']}"
    keys = tensorckpt.open(f"{base}/pp4").keys()
    assert {f"optim/state/layers.{i}.weight/exp_avg" for i in range(LAYERS)} <= set(keys)
    assert {f"model/layers.{i}.bias" for i in range(LAYERS)} <= set(keys)


def test_save_that_would_lose_a_value_fails_before_commit(runs):
    _, results = runs
    for r in results:
        assert r["lossy"] is not None and "optim/groups/" not in r["lossy"]
        assert "rank 0 has" in r["lossy"] and "rank 1 has" in r["lossy"] and "'optim/group_of/shared." in r["lossy"]
        assert not r["lossy_exists"]


def test_objects_run_in_key_path_order(runs):
    """Both ranks all-reduce each object's id in the same order (sorted by key
    path), once in the save and once in the load: every reduction pairs an
    object with itself."""
    _, results = runs
    for r in results:
        assert r["order"] == {"a": [1.0] * 3, "b": [2.0] * 3, "c": [3.0] * 3}  # save; load: target, apply


# ------------------------------------------- strict, partial, classes (1 process)


class Net(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(layers)])


def net(layers: int, seed: int, step: bool, without_grad: tuple = ()):
    torch.manual_seed(seed)
    model = Net(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    if step:
        for name, p in model.named_parameters():
            p.grad = None if any(name.startswith(f"layers.{i}.") for i in without_grad) else torch.randn_like(p)
        opt.step()
    return model, opt


def test_strict_refuses_to_drop_state_the_checkpoint_lacks(tmp_path):
    model, opt = net(2, 0, step=True, without_grad=(1,))  # layers.1 has no state in the checkpoint
    tensorckpt.save({"model": model, "optim": opt}, tmp_path / "c")
    target, topt = net(2, 1, step=True)  # has state for every parameter
    with pytest.raises(tensorckpt.IncompatibleStateError, match=r"state for \['layers.1.bias', 'layers.1.weight'\].*none"):
        tensorckpt.load({"model": target, "optim": topt}, tmp_path / "c")
    kept = topt.state[target.layers[1].weight]["exp_avg"].clone()
    with pytest.warns(UserWarning, match="layers.1"):  # strict=False reports what it skipped
        tensorckpt.load({"model": target, "optim": topt}, tmp_path / "c", strict=False)
    assert torch.equal(topt.state[target.layers[0].weight]["exp_avg"], opt.state[model.layers[0].weight]["exp_avg"])
    assert torch.equal(topt.state[target.layers[1].weight]["exp_avg"], kept)  # strict=False: kept


def test_relaxed_load_of_a_smaller_model_and_its_optimizer(tmp_path):
    model, opt = net(3, 0, step=True)
    tensorckpt.save({"model": model, "optim": opt}, tmp_path / "c")
    bigger, bopt = net(4, 1, step=True)
    with pytest.raises(tensorckpt.IncompatibleStateError, match=r"only in the optimizer: \['layers.3.bias', 'layers.3.weight'\]"):
        tensorckpt.load({"model": bigger, "optim": bopt}, tmp_path / "c")
    own = bopt.state[bigger.layers[3].weight]["exp_avg"].clone(), bigger.layers[3].weight.detach().clone()
    with pytest.warns(UserWarning, match="layers.3"):
        tensorckpt.load({"model": bigger, "optim": bopt}, tmp_path / "c", strict=False)
    for i in range(3):
        assert torch.equal(bigger.layers[i].weight, model.layers[i].weight)
        assert torch.equal(bopt.state[bigger.layers[i].weight]["exp_avg"], opt.state[model.layers[i].weight]["exp_avg"])
    assert torch.equal(bopt.state[bigger.layers[3].weight]["exp_avg"], own[0])
    assert torch.equal(bigger.layers[3].weight, own[1])
    smaller, sopt = net(2, 2, step=False)  # partial: the checkpoint holds more than the state names
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # partial: what the state does not name is ignored silently
        tensorckpt.load({"model": smaller, "optim": sopt}, tmp_path / "c", strict=True, partial=True)
    assert torch.equal(sopt.state[smaller.layers[1].bias]["exp_avg_sq"], opt.state[model.layers[1].bias]["exp_avg_sq"])
    assert sopt.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("saved, loaded", [("SGD", "AdamW"), ("AdamW", "SGD")])
def test_other_optimizer_class_is_a_clear_error(tmp_path, saved, loaded):
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    make = {"SGD": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
            "AdamW": lambda m: torch.optim.AdamW(m.parameters())}
    opt = make[saved](model)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    tensorckpt.save({"model": model, "optim": opt}, tmp_path / "c")
    with pytest.raises(tensorckpt.IncompatibleStateError, match=f"optimizer class '{saved}' there, but the state's optimizer is of class '{loaded}'"):
        tensorckpt.load({"model": model, "optim": make[loaded](model)}, tmp_path / "c")


def test_other_scheduler_class_is_a_clear_error(tmp_path):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tensorckpt.save({"sched": torch.optim.lr_scheduler.StepLR(opt, 2)}, tmp_path / "c")
    with pytest.raises(tensorckpt.IncompatibleStateError, match="LR scheduler class 'StepLR' there, but the state's LR scheduler is of class 'ExponentialLR'"):
        tensorckpt.load({"sched": torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)}, tmp_path / "c")
