"""The golden ``training_state_w2``: a training state saved by 2 gloo ranks at
a sharded layout, with what loads at world 1 and at world 3 must give, so that
an implementation can check resharding without running torch.distributed.

Saved at world 2 (``make_golden.py training_state_w2`` launches the ranks):

    model   nn.Sequential(Linear(3, 5), Tanh(), Linear(5, 3)) under FSDP2
            (``fully_shard`` per Linear and on the whole, mesh of 2): every
            parameter a DTensor Shard(0), rows split as torch.chunk does
            (5 rows: 3 + 2; 3 rows: 2 + 1)
    optim   AdamW after 2 steps: the moments are DTensors laid out like
            their parameters (stored as logical tensors, resharded at load)
    data    ResumableSampler(10, seed=3) at world 2, 2 batches of 1 consumed
            on each rank
    rng     rng_state(): rank r writes row r of rng/torch, rng/numpy,
            rng/python (ShardedTensor boxes of [2, width] tensors)
    step    2

Files next to the checkpoint:

- ``expected.json``: every tensor's full value and every value (the format
  of README.md), which a load at world 1 (or ``open``) must give.
- ``expected_ranks.json``: for world 1 and world 3, per rank: ``boxes`` (each
  model parameter and AdamW moment's box under FSDP2 at that world,
  ``offset`` and ``shape`` with the data of that box), ``sampler_next`` (the
  sample indices the loaded sampler yields next, spec rng-and-data.md 3.4)
  and ``rng`` (``row`` r when r < 2, else the ``derived_seed`` of 2.3, and
  the generators' next draws: ``torch_rand`` = torch.rand(3), ``numpy_random``
  = numpy.random.random(2), ``python_random`` = random.random()).

Module-level functions, so that spawned ranks import them by name.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import struct
from pathlib import Path

import numpy as np
import torch
from torch import nn

import tensorckpt

NAME = "training_state_w2"
SAVED_WORLD = 2
LOAD_WORLDS = (1, 3)
NUM_SAMPLES, SAMPLER_SEED, BATCH, STEPS = 10, 3, 1, 2
PARAMS = ("0.weight", "0.bias", "2.weight", "2.bias")
MOMENTS = ("exp_avg", "exp_avg_sq")


def build_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_((torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) - 3) * 0.125 + i * 0.25)
    return model


def shard(model: nn.Module, world: int) -> nn.Module:
    """FSDP2 over a 1-D mesh of ``world`` CPU ranks (plain at world 1 without
    torch.distributed)."""
    if world == 1 and not torch.distributed.is_initialized():
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def objects(rank: int, world: int) -> dict:
    """The training state of rank ``rank`` after 2 steps (deterministic: the
    weights are arange-based, the data fixed, the generators seeded)."""
    torch.manual_seed(10 + rank)
    np.random.seed(10 + rank)
    random.seed(10 + rank)
    model = shard(build_model(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.25, weight_decay=0.5)
    sampler = tensorckpt.ResumableSampler(NUM_SAMPLES, seed=SAMPLER_SEED, rank=rank, world=world)
    x = torch.arange(NUM_SAMPLES * 3, dtype=torch.float32).reshape(NUM_SAMPLES, 3) / 8 - 1
    y = torch.arange(NUM_SAMPLES * 3, dtype=torch.float32).reshape(NUM_SAMPLES, 3) / 16
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, sampler=sampler,
                                         generator=torch.Generator())
    batches = sampler.track(loader)
    for _ in range(STEPS):
        xb, yb = next(batches)
        xb = xb * (torch.rand(1, 3) > 0.25)  # the loop draws from the generators it saves
        np.random.random(), random.random()
        ((model(xb) - yb) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model, "optim": opt, "data": sampler, "rng": tensorckpt.rng_state(), "step": STEPS}


def next_draws() -> dict:
    """What the generators give next (consumes them)."""
    return {"torch_rand": torch.rand(3).tolist(), "numpy_random": np.random.random(2).tolist(),
            "python_random": random.random()}


def _plain(node):
    """The stored state with DTensors made whole (collective) and
    ShardedTensor boxes as (offset, local, global shape), all numpy."""
    from tensorckpt.adapters.sharded import ShardedTensor

    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, ShardedTensor):
        return ("box", node.global_offset, node.local.numpy().copy(), node.global_shape)
    if isinstance(node, torch.Tensor):
        t = node.full_tensor() if hasattr(node, "full_tensor") else node
        return t.detach().numpy().copy()
    return node


def save_rank(rank: int, world: int, path: str) -> dict:
    """One saving rank (world 2): build, save, and report the full plain state
    (every rank), rank 0's torch generator row and the draws after the save."""
    from tensorckpt.adapters import registry

    obj = objects(rank, world)
    plain = _plain(registry.for_save(obj, registry.Context(obj, rank, world)))
    torch_row = torch.get_rng_state().numpy().copy()
    tensorckpt.save(obj, path, metadata={"golden": NAME})
    return {"plain": plain, "torch_row": torch_row, "draws": next_draws()}


def assemble(results: list[dict]) -> dict:
    """The full plain state from every rank's report: boxes put together."""

    def merge(nodes):
        first = nodes[0]
        if isinstance(first, dict):
            keys = dict.fromkeys(k for n in nodes for k in n)  # per-rank values: each rank its own key
            return {k: merge([n[k] for n in nodes if k in n]) for k in keys}
        if isinstance(first, tuple) and first[0] == "box":
            whole = np.zeros(first[3], dtype=first[2].dtype)
            for _, offset, local, _ in nodes:
                whole[tuple(slice(o, o + s) for o, s in zip(offset, local.shape))] = local
            return torch.from_numpy(whole)
        if isinstance(first, np.ndarray):
            return torch.from_numpy(first)
        return first

    return merge([r["plain"] for r in results])


def derive_seed(torch_row0: bytes, rank: int) -> int:
    """spec/rng-and-data.md 2.3, written out from the spec."""
    digest = hashlib.sha256(b"tensorckpt/rng/v1\x00" + torch_row0 + struct.pack("<Q", rank)).digest()
    return int.from_bytes(digest[:8], "little")


def draws_from_seed(seed: int) -> dict:
    state = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
        return next_draws()
    finally:
        torch.set_rng_state(state[0])
        np.random.set_state(state[1])
        random.setstate(state[2])


def chunk_box(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [lo, hi) of rank ``rank`` when ``n`` rows are split as torch.chunk
    (FSDP2's Shard(0)): ceil(n / world) each, the last ones shorter or empty."""
    size = math.ceil(n / world)
    return min(rank * size, n), min((rank + 1) * size, n)


def expected_ranks(full: dict, results: list[dict]) -> dict:
    """``expected_ranks.json``: what each rank of a load at world 1 and 3 gets."""
    from tensorckpt.data import epoch_order, remaining

    from .make_golden import tensor_expected

    sampler = full["data"]
    saved_counts = [sampler["rank"][str(r)]["consumed"] for r in range(SAVED_WORLD)]
    order = epoch_order(NUM_SAMPLES, SAMPLER_SEED, 0, True)
    rest = remaining(order, [*sampler["segments"], [SAVED_WORLD, saved_counts]])  # another world: segment closed
    row0 = results[0]["torch_row"].tobytes()
    worlds = {}
    for world in LOAD_WORLDS:
        ranks = []
        for r in range(world):
            boxes = {}
            for fqn in PARAMS:
                for key, t in [(f"model/{fqn}", full["model"][fqn]),
                               *[(f"optim/state/{fqn}/{m}", full["optim"]["state"][fqn][m]) for m in MOMENTS]]:
                    lo, hi = chunk_box(t.shape[0], r, world)
                    boxes[key] = {"offset": [lo] + [0] * (t.dim() - 1), **tensor_expected(t[lo:hi])}
            if r < SAVED_WORLD:
                rng = {"row": r, **results[r]["draws"]}
            else:
                seed = derive_seed(row0, r)
                rng = {"derived_seed": seed, **draws_from_seed(seed)}
            ranks.append({"boxes": boxes, "sampler_next": [int(i) for i in rest[r::world]], "rng": rng})
        worlds[str(world)] = {"layout": "FSDP2 fully_shard per Linear and on the whole model, 1-D mesh, Shard(0)",
                              "ranks": ranks}
    return {"saved_world": SAVED_WORLD, "worlds": worlds}


def write(out: Path) -> None:
    """Write ``out/checkpoint`` (2 gloo ranks), ``expected.json`` and
    ``expected_ranks.json``."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import dist

    from .make_golden import expected_for

    results = dist.run(SAVED_WORLD, save_rank, str(out / "checkpoint"), timeout=240)
    full = assemble(results)
    expected = expected_for(full, {"golden": NAME}, tensorckpt.open(out / "checkpoint"))
    expected["world_size"] = SAVED_WORLD
    for name, doc in (("expected.json", expected), ("expected_ranks.json", expected_ranks(full, results))):
        (out / name).write_text(json.dumps(doc, indent=1, ensure_ascii=False, allow_nan=False) + "\n", encoding="utf-8")


# ------------------------------------------------------------------ loading


def load_rank(rank: int, world: int, path: str) -> dict:
    """One loading rank: fresh objects (no optimizer state, a sampler of this
    world), load, and report what it got, as expected_ranks.json describes."""
    model = shard(build_model(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sampler = tensorckpt.ResumableSampler(NUM_SAMPLES, rank=rank, world=world)
    state = {"model": model, "optim": opt, "data": sampler, "rng": tensorckpt.rng_state(), "step": None}
    tensorckpt.load(state, path)
    draws = next_draws()
    boxes = {}
    named = dict(model.named_parameters())
    for fqn in PARAMS:
        p = named[fqn]
        for key, t in [(f"model/{fqn}", p), *[(f"optim/state/{fqn}/{m}", opt.state[p][m]) for m in MOMENTS]]:
            local = t.to_local() if hasattr(t, "to_local") else t
            boxes[key] = local.detach().numpy().copy()
    steps = {fqn: float(opt.state[named[fqn]]["step"]) for fqn in PARAMS}
    return {"boxes": boxes, "sampler_next": list(sampler), "draws": draws, "step": state["step"], "steps": steps,
            "hparams": {k: v for k, v in opt.param_groups[0].items() if k not in ("params", "param_names")}}
