"""Ports of DCP's test_state_dict.py scenarios through tensorckpt's object
adapters (tensorckpt has no get_state_dict / set_state_dict: the module and the
optimizer go into the state): FSDP2, DDP, strict key checks, tied weights,
param groups, frozen parameters, wrappers' key prefixes, meta-device targets.
CompositeParamModel's structure with width 32 (DCP: 100).
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import pytest
import torch
from _suite import (
    FULL,
    full,
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

# ------------------------------------------------ test_state_dict.py

D = 32  # CompositeParamModel's width (DCP: 100)


class Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(D, D)
        self.seq = nn.Sequential(nn.ReLU(), nn.Linear(D, D), nn.ReLU())
        self.l2 = nn.Linear(D, D)

    def forward(self, x):
        return self.l2(self.seq(self.l1(x)))


class Composite(nn.Module):
    """The structure of DCP's CompositeParamModel (common_dist_composable.py)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.l = nn.Linear(D, D)
        self.u1 = Unit()
        self.u2 = Unit()
        self.p = nn.Parameter(torch.randn(D, D))
        self.register_buffer("buffer", torch.randn(D, D), persistent=True)
        self.register_buffer("dont_save_me", torch.randn(D), persistent=False)

    def forward(self, x):
        return torch.mm(self.u2(self.u1(self.l(x))), self.p)


def batches(n: int):
    g = torch.Generator().manual_seed(7)
    return [torch.rand(8, D, generator=g) for _ in range(n)]


def train(model, optims, xs) -> list[float]:
    losses = []
    for x in xs:
        for o in optims:
            o.zero_grad()
        loss = model(x).sum()
        loss.backward()
        losses.append(loss.item())
        for o in optims:
            o.step()
    for o in optims:
        o.zero_grad()
    return losses


OPTIMS = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-4), "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4),
          "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9)}
FSDP2_CASES = [("adamw", True)] + ([("adam", False), ("sgd", True)] if FULL else [])  # (optimizer, reshard_after_forward)


def wrapped(kind: str, world: int, seed: int = 0, frozen: bool = False, reshard: bool = True) -> nn.Module:
    model = Composite(seed)
    if frozen:
        for p in chain(model.u1.parameters(), model.u2.parameters()):
            p.requires_grad_(False)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for unit in (model.u1, model.u2):
            fully_shard(unit, mesh=mesh((world,)), reshard_after_forward=reshard)
        return fully_shard(model, mesh=mesh((world,)), reshard_after_forward=reshard)
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    return model


def trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


@scenario("w4")
def state_dict_fsdp2_w4(rank: int, world: int, base: str):
    out = {}
    for opt_name, reshard in FSDP2_CASES:
        name = f"sd_fsdp2_{opt_name}_{reshard}"
        model = wrapped("fsdp2", world, reshard=reshard)
        opt = OPTIMS[opt_name](model.parameters())
        losses = train(model, [opt], batches(10))
        tensorckpt.save({"model": model, "optim": opt}, path(base, name))
        ref_next = train(model, [opt], batches(12)[10:])
        model2 = wrapped("fsdp2", world, seed=1, reshard=reshard)
        opt2 = OPTIMS[opt_name](model2.parameters())
        tensorckpt.load({"model": model2, "optim": opt2}, path(base, name))
        loaded = {"model": model_values(model2), "optim": optim_values(model2, opt2)}
        out[name] = {"losses": losses, "ref_next": ref_next, "resumed_next": train(model2, [opt2], batches(12)[10:]),
                     "loaded": loaded}
    return out


@scenario("w1_load")
def state_dict_fsdp2_w1(rank: int, world: int, base: str):
    """The uninterrupted single-process run (DCP's orig_model) and the FSDP2 checkpoint loaded into it."""
    out = {}
    for opt_name, reshard in FSDP2_CASES:
        name = f"sd_fsdp2_{opt_name}_{reshard}"
        model = Composite()
        opt = OPTIMS[opt_name](model.parameters())
        losses = train(model, [opt], batches(10))
        model2 = Composite(seed=1)
        opt2 = OPTIMS[opt_name](model2.parameters())
        tensorckpt.load({"model": model2, "optim": opt2}, path(base, name))
        loaded = {"model": model_values(model2), "optim": optim_values(model2, opt2)}
        out[name] = {"losses": losses, "orig": {"model": model_values(model), "optim": optim_values(model, opt)},
                     "loaded": loaded, "resumed_next": train(model2, [opt2], batches(12)[10:])}
    return out


def test_fsdp2(peer):
    """Port of test/distributed/checkpoint/test_state_dict.py::TestStateDict::test_fsdp2 (and ::test_single_gpu;
    reshard_after_forward False and Adam / SGD in FULL):
    10 steps of FSDP2 and of a plain model on the same batches; the FSDP2 checkpoint loads into a fresh
    FSDP2 model (bit-exact) and into one process; the next two steps' losses match the uninterrupted run's
    to 1e-5 relative (FSDP2's gradient averaging rounds differently from one process)."""
    w4 = peer.get("w4", "state_dict_fsdp2_w4")
    w1 = peer.get("w1_load", "state_dict_fsdp2_w1")
    for name, ref in w4.items():
        for r in peer.all("w4", "state_dict_fsdp2_w4"):
            assert r[name]["resumed_next"] == ref["ref_next"], name
        np.testing.assert_allclose(ref["losses"], w1[name]["losses"], rtol=1e-5)
        same(w1[name]["loaded"]["model"], ref["loaded"]["model"], f"{name} world 1")
        same(w1[name]["loaded"]["optim"], ref["loaded"]["optim"], f"{name} world 1 optim")
        np.testing.assert_allclose(w1[name]["resumed_next"], ref["ref_next"], rtol=1e-5)
        for k, v in w1[name]["orig"]["model"].items():
            np.testing.assert_allclose(ref["loaded"]["model"][k], v, rtol=1e-4, atol=1e-6, err_msg=k)


@scenario("w4")
def state_dict_ddp_w4(rank: int, world: int, base: str):
    model = wrapped("ddp", world)
    opt = OPTIMS["adamw"](model.parameters())
    train(model, [opt], batches(3))
    tensorckpt.save({"model": model, "optim": opt}, path(base, "sd_ddp"))
    return {"keys": tensorckpt.open(path(base, "sd_ddp")).keys(), "model": model_values(model.module),
            "optim": optim_values(model.module, opt)}


@scenario("w2")
def state_dict_ddp_w2(rank: int, world: int, base: str):
    model = wrapped("ddp", world, seed=1)
    opt = OPTIMS["adamw"](model.parameters())
    tensorckpt.load({"model": model, "optim": opt}, path(base, "sd_ddp"))
    return {"model": model_values(model.module), "optim": optim_values(model.module, opt)}


@scenario("w1_load")
def state_dict_ddp_w1(rank: int, world: int, base: str):
    model = Composite(seed=1)
    opt = OPTIMS["adamw"](model.parameters())
    tensorckpt.load({"model": model, "optim": opt}, path(base, "sd_ddp"))
    return {"model": model_values(model), "optim": optim_values(model, opt)}


def test_ddp_loads_into_ddp(peer):
    """Port of test/distributed/checkpoint/test_state_dict.py::TestStateDict::test_ddp: a DDP model and AdamW
    saved at world 4 load into DDP at world 2."""
    ref = peer.get("w4", "state_dict_ddp_w4")
    for r in peer.all("w2", "state_dict_ddp_w2"):
        same(r["model"], ref["model"])
        same(r["optim"], ref["optim"])


def test_ddp_checkpoint_loads_into_plain_model(peer):
    """Port of test/distributed/checkpoint/test_state_dict.py::TestStateDict::test_ddp (DCP's state dicts drop
    DDP's ``module.`` prefix): the DDP checkpoint loads into the unwrapped model."""
    ref = peer.get("w4", "state_dict_ddp_w4")
    r = peer.get("w1_load", "state_dict_ddp_w1")
    same(r["model"], ref["model"])
    same(r["optim"], ref["optim"])


def test_ddp_keys_are_the_plain_models(peer):
    """Port of test/distributed/checkpoint/test_state_dict.py::TestStateDict::test_activation_ckpt_fqns_ddp (the key half):
    a DDP model's checkpoint keys are the plain model's."""
    keys = {k for k in peer.get("w4", "state_dict_ddp_w4")["keys"] if _named(k)}
    assert keys == _plain_keys(), sorted(keys ^ _plain_keys())[:6]


def _wrapper_keys(kind: str) -> set[str]:
    """The keys of a checkpoint of a wrapped Composite and its AdamW state (one step, no forward)."""
    import tempfile

    model = Composite()
    if kind == "checkpoint":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Unit))
    elif kind == "compile":
        model = torch.compile(model)  # never run: no compiler needed
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with tempfile.TemporaryDirectory() as d:
        tensorckpt.save({"model": model, "optim": opt}, f"{d}/c")
        return {k for k in tensorckpt.open(f"{d}/c").keys() if _named(k)}


def _named(key: str) -> bool:
    """Keys named by module and parameter FQNs (the optimizer's group ids and class are not)."""
    return key.startswith(("model/", "optim/state/", "optim/group_of/"))


def _plain_keys() -> set[str]:
    keys = {f"model/{k}" for k in Composite().state_dict()}
    names = [n for n, _ in Composite().named_parameters()]
    return keys | {f"optim/state/{n}/{s}" for n in names for s in ("exp_avg", "exp_avg_sq", "step")} | {
        f"optim/group_of/{n}" for n in names}


@pytest.mark.parametrize("kind", ["checkpoint", "compile"])
def test_wrapper_prefixes_are_removed(kind):
    """Port of test/distributed/checkpoint/test_state_dict.py::TestStateDict::test_activation_ckpt_fqns_fsdp1
    and ::test_fsdp2 with compile_model=True: with activation-checkpoint or torch.compile wrappers, the model's
    and the optimizer's keys are the plain model's."""
    got = _wrapper_keys(kind)
    assert got == _plain_keys(), sorted(got ^ _plain_keys())[:6]


def test_non_persistent_buffers_and_extra_state(tmp_path):
    """Port of test/distributed/checkpoint/test_state_dict.py::TestStateDict::test_non_persistent_buffers and ::test_extra_state:
    a non-persistent buffer is not saved (nor wanted at load); get_extra_state's value round-trips to set_extra_state."""

    class WithExtra(Composite):
        def get_extra_state(self):
            return "MyState"

        def set_extra_state(self, state):
            self.got = state

    model = WithExtra()
    tensorckpt.save({"model": model}, str(tmp_path / "c"))
    keys = set(tensorckpt.open(str(tmp_path / "c")).keys())
    assert "model/dont_save_me" not in keys and "model/buffer" in keys
    model2 = WithExtra(seed=1)
    tensorckpt.load({"model": model2}, str(tmp_path / "c"))
    assert model2.got == "MyState"
    same(model_values(model2), model_values(model))


@scenario("w4")
def state_dict_strict_w4(rank: int, world: int, base: str):
    model = wrapped("fsdp2", world)
    tensorckpt.save({"model": model}, path(base, "sd_strict"))
    out = {}
    sd = model.state_dict()
    sd["abc"] = torch.zeros(10)
    try:
        tensorckpt.load({"model": sd}, path(base, "sd_strict"))
        out["unexpected"] = None
    except tensorckpt.IncompatibleStateError as e:
        out["unexpected"] = str(e)
    sd = model.state_dict()
    sd.pop("l.bias")
    try:
        tensorckpt.load({"model": sd}, path(base, "sd_strict"))
        out["missing"] = None
    except tensorckpt.IncompatibleStateError as e:
        out["missing"] = str(e)
    import warnings

    sd = wrapped("fsdp2", world, seed=1).state_dict()
    sd.pop("l.bias")
    sd["abc"] = torch.zeros(10)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tensorckpt.load({"model": sd}, path(base, "sd_strict"), strict=False)
    out["warned"] = [str(x.message) for x in w]
    out["loaded"] = {k: full(v) for k, v in sd.items()}
    out["saved"] = model_values(model)
    return out


def test_strict(peer):
    """Port of test/distributed/checkpoint/test_state_dict.py::TestStateDict::test_strict (fully_shard):
    an unexpected and a missing key are errors naming the key; strict=False loads the rest and reports both."""
    for r in peer.all("w4", "state_dict_strict_w4"):
        assert r["unexpected"] and "abc" in r["unexpected"]
        assert r["missing"] and "l.bias" in r["missing"]
        assert any("abc" in m and "l.bias" in m for m in r["warned"]), r["warned"]
        assert np.array_equal(r["loaded"]["abc"], np.zeros(10, np.float32))
        for k, v in r["saved"].items():
            if k != "l.bias":
                assert np.array_equal(r["loaded"][k], v), k


class Tied(nn.Module):
    def __init__(self, vocab: int = 100, dim: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = nn.Embedding(vocab, dim)
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.embedding.weight

    def forward(self, x):
        return self.decoder(self.embedding(x))


@scenario("w4")
def shared_weight_w4(rank: int, world: int, base: str):
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(Tied(), mesh=mesh((world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.arange(12).view(3, 4) * 7 % 100
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    tensorckpt.save({"model": model, "optim": opt}, path(base, "tied"))
    model2 = fully_shard(Tied(seed=1), mesh=mesh((world,)))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    tensorckpt.load({"model": model2, "optim": opt2}, path(base, "tied"))
    return {"saved": model_values(model), "osaved": optim_values(model, opt), "loaded": model_values(model2),
            "oloaded": optim_values(model2, opt2), "tied": model2.decoder.weight is model2.embedding.weight}


@scenario("w1_load")
def shared_weight_w1(rank: int, world: int, base: str):
    model = Tied(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tensorckpt.load({"model": model, "optim": opt}, path(base, "tied"))
    return {"loaded": model_values(model), "oloaded": optim_values(model, opt),
            "tied": model.decoder.weight is model.embedding.weight}


def test_shared_weight(peer):
    """Port of test/distributed/checkpoint/test_state_dict.py::TestStateDict::test_shared_weight (FSDP2, tied
    embedding/decoder): the tie survives loading at world 4 and in one process; values and AdamW state bit-exact."""
    ref = peer.get("w4", "shared_weight_w4")
    for r in peer.all("w4", "shared_weight_w4") + [peer.get("w1_load", "shared_weight_w1")]:
        assert r["tied"]
        same(r["loaded"], ref["saved"])
        same(r["oloaded"], ref["osaved"])


def tp_pair(world: int, seed: int) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(seed)
    model = nn.Sequential()
    model.fc = nn.Linear(16, 16)
    model.fc1 = nn.Linear(16, 16)
    if world > 1:
        parallelize_module(model, mesh((world,)), {"fc": ColwiseParallel(use_local_output=False),
                                                  "fc1": RowwiseParallel(use_local_output=False)})
    return model


def multi_groups(model, empty: bool):
    if empty:
        return torch.optim.AdamW([{"params": [model.fc.weight, model.fc1.weight]}, {"params": [], "lr": 0.2}], lr=0.1)
    return torch.optim.AdamW([{"params": [model.fc.weight]}, {"params": [model.fc1.weight], "lr": 0.2}], lr=0.1)


@scenario("w4")
def multi_param_groups_w4(rank: int, world: int, base: str):
    out = {}
    for empty in (False, True):
        model = tp_pair(world, 0)
        opt = multi_groups(model, empty)
        torch.manual_seed(3)
        model(torch.randn(16, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        tensorckpt.save({"model": model, "optim": opt}, path(base, f"groups_{empty}"))
        model2 = tp_pair(world, 1)
        opt2 = multi_groups(model2, empty)
        tensorckpt.load({"model": model2, "optim": opt2}, path(base, f"groups_{empty}"))
        out[empty] = {"saved": optim_values(model, opt), "loaded": optim_values(model2, opt2)}
    return out


@scenario("w1_load")
def multi_param_groups_w1(rank: int, world: int, base: str):
    out = {}
    for empty in (False, True):
        model = tp_pair(1, 1)
        opt = multi_groups(model, empty)
        tensorckpt.load({"model": model, "optim": opt}, path(base, f"groups_{empty}"))
        out[empty] = optim_values(model, opt)
    return out


def test_multi_param_groups(peer):
    """Port of test/distributed/checkpoint/test_state_dict.py::TestStateDict::test_multi_param_groups (TP with
    two param groups, one of them empty in the second case): groups and state restored at TP=4 and in one process."""
    ref = peer.get("w4", "multi_param_groups_w4")
    for r in peer.all("w4", "multi_param_groups_w4"):
        for empty, v in r.items():
            same(v["loaded"], v["saved"], f"empty={empty}")
    for empty, v in peer.get("w1_load", "multi_param_groups_w1").items():
        same(v, ref[empty]["saved"], f"world 1 empty={empty}")


@scenario("w4")
def param_matching_frozen_w4(rank: int, world: int, base: str):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
    for layer in model:
        fully_shard(layer, mesh=mesh((world,)))
    fully_shard(model, mesh=mesh((world,)))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda=[lambda epoch: 0.95**epoch])
    tensorckpt.save({"model": model, "optim": optim}, path(base, "initial_lr"))
    optim2 = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = "initial_lr" in optim2.param_groups[0]
    tensorckpt.load({"model": model, "optim": optim2}, path(base, "initial_lr"))
    out = {"before": before, "after": optim2.param_groups[0].get("initial_lr")}
    # frozen parameters (test_fsdp_ddp's test_frozen): saved and loaded, without optimizer state
    fmodel = wrapped("fsdp2", world, frozen=True)
    fopt = OPTIMS["adamw"](trainable(fmodel))
    train(fmodel, [fopt], batches(2))
    tensorckpt.save({"model": fmodel, "optim": fopt}, path(base, "frozen"))
    fmodel2 = wrapped("fsdp2", world, seed=1, frozen=True)
    fopt2 = OPTIMS["adamw"](trainable(fmodel2))
    tensorckpt.load({"model": fmodel2, "optim": fopt2}, path(base, "frozen"))
    out["frozen"] = {"saved": model_values(fmodel), "osaved": optim_values(fmodel, fopt),
                     "loaded": model_values(fmodel2), "oloaded": optim_values(fmodel2, fopt2)}
    return out


@scenario("w1_load")
def param_matching_frozen_w1(rank: int, world: int, base: str):
    torch.manual_seed(5)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    tensorckpt.load({"model": model, "optim": optim}, path(base, "initial_lr"))
    fmodel = wrapped("plain", 1, seed=1, frozen=True)
    fopt = OPTIMS["adamw"](trainable(fmodel))
    tensorckpt.load({"model": fmodel, "optim": fopt}, path(base, "frozen"))
    return {"after": optim.param_groups[0].get("initial_lr"),
            "frozen": {"loaded": model_values(fmodel), "oloaded": optim_values(fmodel, fopt)}}


def test_optim_state_dict_param_matching(peer):
    """Port of test/distributed/checkpoint/test_state_dict.py::TestStateDict::test_optim_state_dict_param_matching:
    LambdaLR's ``initial_lr`` reaches a fresh optimizer through the checkpoint (FSDP2 at world 4, and a
    plain model in one process)."""
    for r in peer.all("w4", "param_matching_frozen_w4"):
        assert not r["before"] and r["after"] == 1e-2
    assert peer.get("w1_load", "param_matching_frozen_w1")["after"] == 1e-2


def test_frozen_parameters(peer):
    """Port of test/distributed/checkpoint/test_state_dict.py::TestStateDict::test_fsdp_ddp (test_frozen=True,
    DDP+FSDP1 as FSDP2): frozen parameters are saved and loaded (FSDP2 at world 4, plain in one process); the
    optimizer state covers the trainable ones."""
    for r in peer.all("w4", "param_matching_frozen_w4"):
        f = r["frozen"]
        same(f["loaded"], f["saved"])
        same(f["oloaded"], f["osaved"])
        assert not any(k.startswith("u1.") for k in f["oloaded"] if not k.startswith("group"))
    one = peer.get("w1_load", "param_matching_frozen_w1")["frozen"]
    saved = peer.get("w4", "param_matching_frozen_w4")["frozen"]
    same(one["loaded"], saved["saved"], "world 1")
    same(one["oloaded"], saved["osaved"], "world 1 optim")


@scenario("w1_save")
def meta_model_source(rank: int, world: int, base: str):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
    tensorckpt.save({"model": model}, path(base, "meta_src"))
    return model_values(model)


@scenario("w4")
def meta_model_w4(rank: int, world: int, base: str):
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
        for layer in model:
            fully_shard(layer, mesh=mesh((world,)))
        fully_shard(model, mesh=mesh((world,)))
    tensorckpt.load({"model": model}, path(base, "meta_src"))
    return materialized(model)


def test_setting_meta_device_model(peer):
    """Port of test/distributed/checkpoint/test_state_dict.py::TestStateDict::test_setting_meta_device_model:
    a plain checkpoint loads into an FSDP2 model built on the meta device (materialized on the CPU)."""
    src = peer.get("w1_save", "meta_model_source")
    for r in peer.all("w4", "meta_model_w4"):
        assert r["devices"] == ["cpu"], r["devices"]
        same(r["loaded"], src)


