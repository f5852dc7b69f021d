"""The peer suite's scenario registry and the helpers scenarios share.

A scenario is ``fn(rank, world, base) -> picklable`` registered for a phase
with ``@scenario("w4")``; ``base`` is a directory every rank (and the parent)
sees. Phases run in ``PHASES`` order, so a scenario may load what a scenario of
an earlier phase saved under ``base``. Scenarios return numpy arrays and plain
values; the tests in the parent compare them.
"""

from __future__ import annotations

import builtins
import importlib
import os
import time
import traceback
from collections.abc import Callable

import numpy as np

FULL = os.environ.get("TENSORCKPT_PEER_FULL") == "1"

# (phase, world): the default run launches 4 ranks once and 2 ranks once
PHASES: list[tuple[str, int]] = [("w1_save", 1), ("w4", 4), ("w2", 2), ("w1_load", 1)] + ([("w3", 3)] if FULL else [])
_HERE = os.path.dirname(os.path.abspath(__file__))
MODULES = tuple(sorted(f[:-3] for f in os.listdir(_HERE) if f.startswith("test_peer_") and f.endswith(".py")))

SECONDS = "__seconds__"  # run_phase's entry of per-scenario wall seconds
_REGISTRY: dict[str, dict[str, Callable]] = {}


def scenario(phase: str, full_only: bool = False):
    """Register ``fn`` to run in ``phase`` (under its function name)."""

    def deco(fn: Callable) -> Callable:
        if not full_only or FULL:
            _REGISTRY.setdefault(phase, {})[fn.__name__] = fn
        return fn

    return deco


def _import_all() -> None:
    for name in MODULES:
        importlib.import_module(name)


def run_phase(phase: str, rank: int, world: int, base: str) -> dict:
    """Every scenario of ``phase`` on this rank: ``{name: ("ok", value)}`` or
    ``{name: ("error", class name, message, traceback)}``."""
    _import_all()
    import torch
    import torch.distributed as dist

    out: dict = {}
    seconds: dict[str, float] = {}
    only = os.environ.get("TENSORCKPT_PEER_ONLY")  # a substring of scenario names, for working on a few
    for name, fn in _REGISTRY.get(phase, {}).items():
        if only and only not in name:
            continue
        torch.manual_seed(0)
        t = time.perf_counter()
        try:
            out[name] = ("ok", fn(rank, world, base))
        except Exception as e:  # recorded; the test that reads it re-raises it
            out[name] = ("error", type(e).__name__, str(e), traceback.format_exc())
        if dist.is_initialized():
            dist.barrier()
        seconds[name] = round(time.perf_counter() - t, 3)
    out[SECONDS] = seconds
    return out


def reraise(name: str, record: tuple, rank: int) -> None:
    """Raise a recorded scenario error in the parent, as its own class where
    that is a tensorckpt error or a builtin (so ``xfail(raises=...)`` checks
    the kind of failure)."""
    from tensorckpt import errors

    _, cls_name, msg, tb = record
    cls = getattr(errors, cls_name, None) or getattr(builtins, cls_name, None)
    text = f"scenario {name!r} on rank {rank}: {cls_name}: {msg}\n{tb}"
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            raise cls(text)
        except TypeError:  # a class with another constructor
            pass
    raise RuntimeError(text)


# ------------------------------------------------------------------ helpers


def full(t) -> np.ndarray:
    """The whole value of a tensor or DTensor as a numpy array (a copy)."""
    import torch

    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.cpu().numpy().copy()


def model_values(model) -> dict[str, np.ndarray]:
    """The module's state_dict, full tensors, by key."""
    return {k: full(v) for k, v in model.state_dict().items() if hasattr(v, "shape")}


def optim_values(model, opt) -> dict[str, object]:
    """The optimizer's per-parameter state by ``<fqn>/<name>`` (full tensors),
    and each group's hyperparameters by ``group<i>/<name>``."""
    import torch

    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, object] = {}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"{names[id(p)]}/{k}"] = full(v) if isinstance(v, torch.Tensor) else v
    for i, group in enumerate(opt.param_groups):
        for k, v in group.items():
            if k == "params":
                out[f"group{i}/params"] = sorted(names[id(p)] for p in v)
            elif isinstance(v, (int, float, bool, str, type(None))):
                out[f"group{i}/{k}"] = v
    return out


def fsdp2(model, m, children: bool = True, **kw):
    from torch.distributed.fsdp import fully_shard

    if children:
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=m, **kw)
    fully_shard(model, mesh=m, **kw)
    return model


def same(a: dict, b: dict, where: str = "") -> None:
    assert sorted(a) == sorted(b), (where, sorted(set(a) ^ set(b)))
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), f"{where}: {k}"
        else:
            assert a[k] == b[k], f"{where}: {k}: {a[k]!r} != {b[k]!r}"


def materialized(model) -> dict:
    """The devices of the model's parameters, and its values once none is on meta."""
    devices = sorted({p.device.type for p in model.parameters()})
    return {"devices": devices, "loaded": model_values(model) if "meta" not in devices else {}}


def path(base: str, name: str) -> str:
    return os.path.join(base, name)


_MESHES: dict = {}


def mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None):
    """A CPU DeviceMesh, one per (shape, names) in this process: creating one
    creates process groups (collectives), so scenarios share them."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (tuple(shape), names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)
    return _MESHES[key]
