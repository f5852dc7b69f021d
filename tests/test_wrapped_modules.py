"""Wrapped and compiled modules are stored under canonical FQNs, for modules
and optimizers alike (training-state.md 3.1), and load into the wrapped or
the unwrapped model either way: activation checkpointing
(``_checkpoint_wrapped_module.``) and ``torch.compile`` (``_orig_mod.``) in
this process; DDP (``module.``) and FSDP1 (``_fsdp_wrapped_module.``) on a
1-rank gloo group (one spawn, a few seconds)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:  # spawned workers import this module by name
    sys.path.insert(0, _TESTS)

import dist  # noqa: E402

import tensorckpt  # noqa: E402

CANONICAL = ["0.weight", "0.bias", "2.block.weight", "2.block.bias", "3.module.weight"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(3, 3)

    def forward(self, x):
        return self.block(x)


class Head(nn.Module):
    """A user's own submodule named ``module``: its name is kept."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(3, 1, bias=False)

    def forward(self, x):
        return self.module(x)


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 3), nn.ReLU(), Block(), Head())


def checkpointed(model: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, (Block, nn.Linear)) and not isinstance(m, Head))
    return model


def trained(wrapped: nn.Module, inner: nn.Module):
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.05)
    for i in range(2):
        x = torch.arange(8, dtype=torch.float32).reshape(4, 2) / (i + 3)
        wrapped(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def assert_same(model_a, opt_a, model_b, opt_b) -> None:
    pa, pb = dict(model_a.named_parameters()), dict(model_b.named_parameters())
    for (na, a), (nb, b) in zip(sorted(pa.items(), key=lambda kv: _plain(kv[0])), sorted(pb.items(), key=lambda kv: _plain(kv[0]))):
        assert _plain(na) == _plain(nb) and torch.equal(a, b), (na, nb)
        sa, sb = opt_a.state[a], opt_b.state[b]
        assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa), na
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]


def _plain(name: str) -> str:
    for prefix in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name.removeprefix("module.")  # DDP's; Head's own "3.module." stays


def stored_names(path) -> tuple[list[str], list[str]]:
    keys = tensorckpt.open(path).keys()
    model = sorted(k.split("/", 1)[1] for k in keys if k.startswith("model/"))
    optim = sorted(k.split("/")[2] for k in keys if k.startswith("optim/group_of/"))
    return model, optim


def roundtrip(wrap, tmp_path, tag: str) -> None:
    """wrapped -> unwrapped and unwrapped -> wrapped, through save/load."""
    inner = build(0)
    wrapped = wrap(inner)
    opt = trained(wrapped, inner)
    tensorckpt.save({"model": wrapped, "optim": opt}, tmp_path / f"{tag}_wrapped")
    assert stored_names(tmp_path / f"{tag}_wrapped") == (sorted(CANONICAL), sorted(CANONICAL))
    plain = build(1)
    popt = torch.optim.AdamW(plain.parameters(), lr=0.5)
    tensorckpt.load({"model": plain, "optim": popt}, tmp_path / f"{tag}_wrapped")
    assert_same(wrapped, opt, plain, popt)

    plain = build(2)
    popt = trained(plain, plain)
    tensorckpt.save({"model": plain, "optim": popt}, tmp_path / f"{tag}_plain")
    inner = build(3)
    wrapped = wrap(inner)
    wopt = torch.optim.AdamW(wrapped.parameters(), lr=0.5)
    tensorckpt.load({"model": wrapped, "optim": wopt}, tmp_path / f"{tag}_plain")
    assert_same(plain, popt, wrapped, wopt)


def test_activation_checkpointing(tmp_path):
    model = checkpointed(build(0))
    names = [n for n, _ in model.named_parameters()]
    assert any("_checkpoint_wrapped_module." in n for n in names)  # what the optimizer sees
    assert not any("_checkpoint_wrapped_module." in k for k in model.state_dict())  # what state_dict() says
    roundtrip(checkpointed, tmp_path, "ac")


def test_torch_compile(tmp_path):
    compiled = torch.compile(build(0), backend="eager")
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    roundtrip(lambda m: torch.compile(m, backend="eager"), tmp_path, "compile")


def test_old_checkpoint_with_wrapper_prefixes_still_loads(tmp_path):
    """Before 1.2 a compiled model's keys kept ``_orig_mod.``: such keys
    still load into the compiled model (its own names)."""
    compiled = torch.compile(build(0), backend="eager")
    tensorckpt.save({"model": compiled.state_dict()}, tmp_path / "old")  # plain dict: its keys as they are
    target = torch.compile(build(1), backend="eager")
    tensorckpt.load({"model": target}, tmp_path / "old")
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), compiled.parameters()))


def ddp(model: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(model)


def fsdp1(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))


def _distributed(rank: int, world: int, base: str) -> str:
    import pathlib
    import warnings

    warnings.filterwarnings("ignore", message=".*NO_SHARD.*")
    for tag, wrap in (("ddp", ddp), ("fsdp1", fsdp1)):
        roundtrip(wrap, pathlib.Path(base), tag)
        assert any(n.startswith(("module.", "_fsdp_wrapped_module.")) for n, _ in wrap(build(0)).named_parameters())
    # sharded FSDP1 (at world 1 FSDP1 falls back to NO_SHARD: set the strategy a larger world has)
    from torch.distributed.fsdp import ShardingStrategy

    model = fsdp1(build(0))
    model.sharding_strategy = ShardingStrategy.FULL_SHARD
    try:
        tensorckpt.save({"model": model, "optim": torch.optim.AdamW(model.parameters())}, f"{base}/sharded")
        return "saved a sharded FSDP1 optimizer"
    except tensorckpt.UnsupportedValueError as e:
        if "is FSDP1 (FullyShardedDataParallel) sharding its parameters" not in str(e) or os.path.exists(f"{base}/sharded"):
            return str(e)
    return "ok"


def test_ddp_and_fsdp1(tmp_path):
    assert dist.run(1, _distributed, str(tmp_path), timeout=180) == ["ok"]


def test_two_names_for_one_canonical_name_are_an_error(tmp_path):
    inner = nn.Module()
    inner.register_parameter("x", nn.Parameter(torch.zeros(1)))
    outer = nn.Module()
    outer.add_module("a", torch.compile(inner, backend="eager"))
    outer.register_parameter("a_x", nn.Parameter(torch.zeros(1)))
    tensorckpt.save({"model": outer}, tmp_path / "ok")
    assert tensorckpt.open(tmp_path / "ok").keys() == ["model/a.x", "model/a_x"]

    clash = nn.Module()
    clash.add_module("_checkpoint_wrapped_module", nn.Linear(1, 1))
    clash.weight = nn.Parameter(torch.zeros(1, 1))
    with pytest.raises(tensorckpt.IncompatibleStateError, match="keys 'weight' and '_checkpoint_wrapped_module.weight' both have the canonical name 'weight'"):
        tensorckpt.save({"model": clash}, tmp_path / "clash")
