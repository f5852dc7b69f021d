"""Modules, optimizers and LR schedulers saved and loaded as objects (one
process): ``save({"model": m, "optim": o, "sched": s, "step": n})`` and the
same dict given to ``load`` restore every object in place, bit-exact, and
training resumed from the checkpoint matches training never interrupted.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import tensorckpt
from tensorckpt.adapters import registry

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")


class Net(nn.Module):
    """Linear + BatchNorm (float and int64 buffers) + a 0-d parameter + JSON extra state."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc2(torch.relu(self.bn(self.fc1(x)))) * self.scale

    def get_extra_state(self):
        return {"calls": self.calls}

    def set_extra_state(self, state):
        self.calls = state["calls"]


def make_optim(name: str, model: nn.Module):
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    if name == "adamw":  # two groups, amsgrad (a third moment)
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=0.01, amsgrad=True)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    raise ValueError(name)


def make_sched(name: str, opt):
    S = torch.optim.lr_scheduler
    return {
        "step": lambda: S.StepLR(opt, step_size=2, gamma=0.5),
        "onecycle": lambda: S.OneCycleLR(opt, max_lr=0.05, total_steps=20),  # also moves betas in param_groups
        "lambda": lambda: S.LambdaLR(opt, lambda epoch: 0.9**epoch),  # the lambda is not stored
        "plateau": lambda: S.ReduceLROnPlateau(opt, patience=0),  # best = inf is not JSON
    }[name]()


def setup(opt_name: str, sched_name: str, seed: int):
    torch.manual_seed(seed)
    model = Net()
    opt = make_optim(opt_name, model)
    return model, opt, make_sched(sched_name, opt)


def train(model, opt, sched, steps, data_seed: int = 0) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(1000 * data_seed + i)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        sched.step(loss.item()) if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau) else sched.step()
        opt.zero_grad()


def assert_same(a, b, where: str = "") -> None:
    """Equal structure, types, dtypes and bits."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: {a} vs {b}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def snapshot(model, opt, sched) -> dict:
    clone = lambda t: t.clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
    osd = opt.state_dict()
    return {
        "model": {k: clone(v) for k, v in model.state_dict().items()},
        "optim": {"state": {i: {k: clone(v) for k, v in s.items()} for i, s in osd["state"].items()},
                  "param_groups": [dict(g) for g in osd["param_groups"]]},
        "sched": dict(sched.state_dict()),
    }


CASES = [("adam", "step"), ("adamw", "onecycle"), ("sgd", "lambda"), ("adam", "plateau")]


@pytest.mark.parametrize("target", ["fresh", "trained"])
@pytest.mark.parametrize("opt_name,sched_name", CASES, ids=[f"{o}-{s}" for o, s in CASES])
def test_resume_matches_uninterrupted_training(mem_url, opt_name, sched_name, target):
    model, opt, sched = setup(opt_name, sched_name, seed=0)
    train(model, opt, sched, range(3))
    url = mem_url()
    tensorckpt.save({"model": model, "optim": opt, "sched": sched, "step": 3}, url)
    saved = snapshot(model, opt, sched)
    train(model, opt, sched, range(3, 7))  # the run never interrupted

    model2, opt2, sched2 = setup(opt_name, sched_name, seed=1)  # other weights; no optimizer state yet
    if target == "trained":  # state already there: loaded in place
        train(model2, opt2, sched2, range(2), data_seed=9)
    state = {"model": model2, "optim": opt2, "sched": sched2, "step": 0}
    assert tensorckpt.load(state, url) is state
    assert state["step"] == 3 and state["model"] is model2
    assert_same(snapshot(model2, opt2, sched2), saved)
    assert model2.calls == 3  # extra state

    train(model2, opt2, sched2, range(3, 7))
    assert_same(snapshot(model2, opt2, sched2), snapshot(model, opt, sched))


def test_key_layout(mem_url):
    model, opt, sched = setup("adam", "step", seed=0)
    train(model, opt, sched, range(2))
    url = mem_url()
    tensorckpt.save({"model": model, "optim": opt, "sched": sched}, url)
    ck = tensorckpt.open(url)
    keys = set(ck.keys())
    names = [n for n, _ in model.named_parameters()]
    for n in names:
        assert f"model/{n}" in keys
        assert {f"optim/state/{n}/exp_avg", f"optim/state/{n}/exp_avg_sq", f"optim/state/{n}/step"} <= keys
        assert ck.info(f"optim/state/{n}/exp_avg").shape == tuple(model.get_parameter(n).shape)
    assert not any(k.startswith("optim/state/0") for k in keys)  # never integer ids
    assert ck.read("optim/state/fc1.weight/step") == 2.0  # a 0-d step is a JSON number ...
    assert ck.info("optim/state/scale/exp_avg").shape == ()  # ... but the moment of a 0-d parameter a tensor
    gid = ck.read(f"optim/group_of/{names[0]}")  # format 1.2: per-parameter group ids, one copy per group
    assert [ck.read(f"optim/group_of/{n}") for n in names] == [gid] * len(names)
    assert ck.read(f"optim/groups/{gid}/lr") == 0.005 and ck.read(f"optim/groups/{gid}/betas") == [0.9, 0.999]
    assert not any(k.startswith("optim/groups/") and not k.startswith(f"optim/groups/{gid}/") for k in keys)
    assert ck.read("optim/class") == type(opt).__name__ and ck.read("sched/class") == type(sched).__name__
    assert ck.read("model/_extra_state/calls") == 2
    assert ck.read("model/bn.num_batches_tracked").dtype == torch.int64
    assert ck.read("sched/last_epoch") == 2 and ck.read("sched/base_lrs") == [0.01]


def test_fresh_optimizer_is_not_stepped(mem_url):
    """Loading creates the optimizer's state without an optimizer step: the
    parameters are the checkpoint's and the gradients stay as they were."""
    model, opt, sched = setup("adamw", "step", seed=0)
    train(model, opt, sched, range(2))
    url = mem_url()
    tensorckpt.save({"model": model, "optim": opt}, url)
    model2, opt2, _ = setup("adamw", "step", seed=1)
    model2.fc1.weight.grad = torch.ones_like(model2.fc1.weight)
    tensorckpt.load({"model": model2, "optim": opt2}, url)
    assert_same(dict(model2.named_parameters()), dict(model.named_parameters()))
    assert torch.equal(model2.fc1.weight.grad, torch.ones_like(model2.fc1.weight))
    assert_same(opt2.state_dict()["state"], opt.state_dict()["state"])


def test_two_modules_one_optimizer(mem_url):
    """Parameters from several modules of the state are named with the
    module's key as prefix."""
    torch.manual_seed(0)
    gen, disc = nn.Linear(3, 4), nn.Linear(4, 1)
    opt = torch.optim.Adam(itertools.chain(gen.parameters(), disc.parameters()), lr=0.1)
    disc(gen(torch.randn(2, 3))).sum().backward()
    opt.step()
    url = mem_url()
    tensorckpt.save({"nets": {"gen": gen, "disc": disc}, "optim": opt}, url)
    stored = sorted(k.split("/")[2] for k in tensorckpt.open(url).keys() if k.startswith("optim/group_of/"))
    assert stored == sorted(["nets.gen.weight", "nets.gen.bias", "nets.disc.weight", "nets.disc.bias"])
    gen2, disc2 = nn.Linear(3, 4), nn.Linear(4, 1)
    opt2 = torch.optim.Adam(itertools.chain(gen2.parameters(), disc2.parameters()), lr=0.5)
    tensorckpt.load({"nets": {"gen": gen2, "disc": disc2}, "optim": opt2}, url)
    assert_same(opt2.state_dict(), opt.state_dict())


SCHEDULERS = {
    "multistep": lambda o, S: S.MultiStepLR(o, [2, 4]),  # milestones: a Counter with int keys
    "constant": lambda o, S: S.ConstantLR(o),
    "linear": lambda o, S: S.LinearLR(o),
    "exponential": lambda o, S: S.ExponentialLR(o, 0.9),
    "polynomial": lambda o, S: S.PolynomialLR(o, 10),
    "cosine": lambda o, S: S.CosineAnnealingLR(o, 10),
    "warm_restarts": lambda o, S: S.CosineAnnealingWarmRestarts(o, 3),
    "cyclic": lambda o, S: S.CyclicLR(o, 0.01, 0.1, step_size_up=2, scale_fn=lambda x: 0.5**x),
    "multiplicative": lambda o, S: S.MultiplicativeLR(o, lambda e: 0.95),
    "sequential": lambda o, S: S.SequentialLR(o, [S.LinearLR(o), S.ExponentialLR(o, 0.9)], milestones=[2]),
    "chained": lambda o, S: S.ChainedScheduler([S.ConstantLR(o), S.ExponentialLR(o, 0.9)]),
}


@pytest.mark.parametrize("name", SCHEDULERS)
def test_every_torch_scheduler_round_trips(mem_url, name):
    def build():
        model = nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt, SCHEDULERS[name](opt, torch.optim.lr_scheduler)

    model, opt, sched = build()
    for _ in range(3):
        opt.step()
        sched.step()
    url = mem_url()
    tensorckpt.save({"model": model, "optim": opt, "sched": sched}, url)
    model2, opt2, sched2 = build()
    tensorckpt.load({"model": model2, "optim": opt2, "sched": sched2}, url)
    assert_same(sched2.state_dict(), sched.state_dict())
    assert_same(opt2.state_dict()["param_groups"], opt.state_dict()["param_groups"])


# ------------------------------------------------------------------ errors


def test_parameter_name_mismatch_lists_the_names(mem_url):
    model, opt, sched = setup("adam", "step", seed=0)
    train(model, opt, sched, range(1))
    url = mem_url()
    tensorckpt.save({"model": model, "optim": opt}, url)
    other = nn.ModuleDict({"fc1": nn.Linear(6, 8), "head": nn.Linear(8, 3)})
    with pytest.raises(tensorckpt.IncompatibleStateError) as e:
        tensorckpt.load({"model": other, "optim": torch.optim.Adam(other.parameters())}, url)
    msg = str(e.value)
    assert "'optim'" in msg
    assert "only in the checkpoint: ['bn.bias', 'bn.weight', 'fc2.bias', 'fc2.weight', 'scale']" in msg
    assert "only in the optimizer: ['head.bias', 'head.weight']" in msg


def test_parameter_grouping_mismatch(mem_url):
    """Groups are matched per parameter (format 1.2): a group takes the
    hyperparameters stored for its parameters, which must agree."""
    model, opt, sched = setup("adam", "step", seed=0)  # one group
    url = mem_url()
    tensorckpt.save({"model": model, "optim": opt}, url)
    with pytest.raises(tensorckpt.IncompatibleStateError, match="optimizer class 'Adam' there, but the state's optimizer is of class 'AdamW'"):
        tensorckpt.load({"model": model, "optim": make_optim("adamw", model)}, url)
    names = [n for n, _ in model.named_parameters()]
    regrouped = torch.optim.Adam([{"params": [model.get_parameter(n) for n in names[:3]], "lr": 0.5},
                                  {"params": [model.get_parameter(n) for n in names[3:]], "lr": 0.7}])
    tensorckpt.load({"model": model, "optim": regrouped}, url)
    assert [g["lr"] for g in regrouped.param_groups] == [0.01, 0.01]
    tensorckpt.save({"model": model, "optim": make_optim("adamw", model)}, url, overwrite=True)
    swapped = torch.optim.AdamW([{"params": [model.scale, model.fc1.weight, model.fc2.weight, model.bn.weight]},
                                 {"params": [model.fc1.bias, model.bn.bias, model.fc2.bias]}])
    msg = r"param group 0 of the optimizer holds 'scale' and 'fc1.weight', whose stored hyperparameters differ \('weight_decay'\)"
    with pytest.raises(tensorckpt.IncompatibleStateError, match=msg):
        tensorckpt.load({"model": model, "optim": swapped}, url)


def test_optimizer_without_its_model_is_an_error(mem_url):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tensorckpt.UnsupportedValueError, match=r"put the model \(the nn.Module itself.*'opt': opt"):
        tensorckpt.save({"opt": opt}, mem_url())


class Opaque(nn.Module):
    def __init__(self, extra) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.extra = extra

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.extra = state


def test_extra_state_that_needs_pickle_is_an_error(mem_url):
    model = nn.Sequential(Opaque({"ok": 1, "bad": {1, 2}}))
    with pytest.raises(tensorckpt.UnsupportedValueError) as e:
        tensorckpt.save({"model": model}, mem_url())
    msg = str(e.value)
    assert "'model/0._extra_state/bad'" in msg and "get_extra_state" in msg and "uint8 tensor" in msg


def test_extra_state_tensors_and_data_round_trip(mem_url):
    blob = torch.frombuffer(bytearray(b"any bytes"), dtype=torch.uint8)
    model = nn.Sequential(Opaque({"blob": blob, "n": 3}))
    url = mem_url()
    tensorckpt.save({"model": model}, url)
    model2 = nn.Sequential(Opaque({"blob": torch.zeros(9, dtype=torch.uint8), "n": 0}))
    tensorckpt.load({"model": model2}, url)
    assert_same(model2[0].extra, {"blob": blob, "n": 3})


def test_scheduler_functions_skipped_other_objects_rejected(mem_url):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    sched.hook = lambda: None  # code: left out, the loading scheduler keeps its own
    url = mem_url()
    tensorckpt.save({"sched": sched}, url)
    assert "sched/hook" not in tensorckpt.open(url).keys()
    sched.thing = object()
    with pytest.raises(tensorckpt.UnsupportedValueError, match=r"'sched/thing'.*StepLR scheduler.*override"):
        tensorckpt.save({"sched": sched}, mem_url())


def test_missing_object_in_checkpoint(mem_url):
    model = nn.Linear(2, 2)
    url = mem_url()
    tensorckpt.save({"model": model}, url)
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(tensorckpt.IncompatibleStateError, match="missing in checkpoint: 'optim/class'"):
        tensorckpt.load({"model": model, "optim": opt}, url)
    with pytest.warns(UserWarning, match="optim/group_of/weight"):
        tensorckpt.load({"model": model, "optim": opt}, url, strict=False)


def test_register_adapter_is_public():
    assert tensorckpt.register_adapter is registry.register


def test_builtin_adapters_in_one_order_and_user_ones_first(mem_url):
    """The built-ins come from registry.BUILTINS, in that order; a registered
    adapter overrides them; a load leaves nothing on the objects (what apply
    needs comes back from load_target as a Target)."""
    from tensorckpt.data import ResumableSampler

    kinds = [t for t, _ in registry.BUILTINS]
    assert kinds.index(ResumableSampler) < kinds.index((nn.Module, tensorckpt.adapters.names.Renamed))
    rng, sampler, pr = tensorckpt.rng_state(), ResumableSampler(10), tensorckpt.per_rank({"n": 1})
    url = mem_url()
    tensorckpt.save({"rng": rng, "data": sampler, "pr": pr}, url)
    before = [set(vars(o)) for o in (rng, sampler, pr)]
    tensorckpt.load({"rng": rng, "data": sampler, "pr": pr}, url)
    assert [set(vars(o)) for o in (rng, sampler, pr)] == before

    class Marker(nn.Linear):
        pass

    seen = []

    class MarkerAdapter:
        def save_state(self, obj, ctx):
            return {"w": obj.weight.detach()}

        def load_target(self, obj, stored, ctx):
            return registry.Target({"w": torch.empty(2, 2)}, memo=sorted(stored.tensors))

        def apply(self, obj, loaded, ctx, memo):
            seen.append(memo)
            with torch.no_grad():
                obj.weight.copy_(loaded["w"])

    saved_user = list(registry._USER)
    try:
        tensorckpt.register_adapter(Marker, MarkerAdapter())
        m = Marker(2, 2)
        url = mem_url()
        tensorckpt.save({"m": m}, url)
        assert tensorckpt.open(url).keys() == ["m/w"]
        fresh = Marker(2, 2)
        tensorckpt.load({"m": fresh}, url)
        assert seen == [["w"]] and torch.equal(fresh.weight, m.weight)
    finally:
        registry._USER[:] = saved_user


def test_optimizer_state_entry_holding_tensors_is_refused(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model.weight]["extra"] = {"a": 1, "b": torch.tensor(2.0)}
    with pytest.raises(tensorckpt.UnsupportedValueError, match="weight.*extra.*dict holding tensors"):
        tensorckpt.save({"model": model, "optim": opt}, tmp_path / "c")
    assert not (tmp_path / "c").exists()
