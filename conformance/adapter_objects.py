"""The training objects of the adapter conformance suite (``adapter_suite.py``):
the reference model, its layouts (plain, FSDP2, TP, FSDP x TP, explicit boxes,
pipeline stages), the uninterrupted reference run, and the ``Objects`` an
adapter's ``build`` hook receives.

Imports only torch and numpy (never tensorckpt): a second implementation of the
format uses it as is.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

D, H, LAYERS = 8, 12, 4  # model width, hidden width, blocks
STEPS = 3  # training steps before the save
RESUMED_STEPS = 3  # steps after the load whose losses are compared (the third sees the scheduler's next decay)
LR, GAMMA = 0.05, 0.5  # AdamW lr; StepLR(step_size=2, gamma)
NUM_SAMPLES, DATA_SEED = 30, 5  # the sampler's dataset length and seed
RNG_SEED = 100  # rank r's generators are seeded with RNG_SEED + r right before the save
BATCH = 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class TinyNet(nn.Module):
    """``layers.<i>.up`` / ``layers.<i>.down``: the names pipeline stages renumber."""

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def make_model(seed: int, layers: int = LAYERS) -> TinyNet:
    g = torch.get_rng_state()
    torch.manual_seed(seed)
    m = TinyNet(layers)
    torch.set_rng_state(g)
    return m


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)


def make_optimizer(model: nn.Module) -> torch.optim.AdamW:
    """Two param groups: weights (weight decay 0.1) and biases (none)."""
    named = list(model.named_parameters())
    return torch.optim.AdamW(
        [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
         {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}],
        lr=LR, foreach=False,
    )


def make_scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=GAMMA)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, sched, step: int) -> float:
    """One step on the whole batch (every rank the same batch: under FSDP the
    averaged gradient is the full batch's, under TP the output is replicated)."""
    x, y = batch(step)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return float(loss.item())


def extra_state(filled: bool) -> dict:
    """Extra state: a bfloat16 tensor and JSON values."""
    ema = (torch.arange(12, dtype=torch.float32).reshape(3, 4) * 0.5 - 2).to(torch.bfloat16)
    return {"ema": ema if filled else torch.zeros(3, 4, dtype=torch.bfloat16),
            "count": STEPS if filled else 0, "tag": "conformance" if filled else ""}


@dataclass
class Reference:
    """The uninterrupted run (one process, no sharding)."""

    params: dict[str, torch.Tensor]  # after STEPS steps
    moments: dict[str, dict[str, torch.Tensor]]  # fqn -> exp_avg / exp_avg_sq after STEPS steps
    sched: dict
    lrs: list[float]
    weight_decay: dict[str, float]  # fqn -> its group's
    losses: list[float]  # of steps STEPS + 1 ... STEPS + RESUMED_STEPS


def reference() -> Reference:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make_model(0)
        opt, sched = None, None
        opt = make_optimizer(model)
        sched = make_scheduler(opt)
        for s in range(1, STEPS + 1):
            train_step(model, opt, sched, s)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        moments = {n: {k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")} for n, p in model.named_parameters()}
        sd = sched.state_dict()
        lrs = [g["lr"] for g in opt.param_groups]
        wd = {n: (0.1 if n.endswith("weight") else 0.0) for n in params}
        losses = [train_step(model, opt, sched, STEPS + 1 + i) for i in range(RESUMED_STEPS)]
    return Reference(params, moments, sd, lrs, wd, losses)


# ------------------------------------------------------------------ layouts

KINDS = ("plain", "fsdp", "tp", "fsdp_tp", "boxes", "pp")


@dataclass(frozen=True)
class Layout:
    """Where the training state lives: ``kind`` (one of ``KINDS``), ``world``
    ranks; ``mesh`` (dp, tp) for ``fsdp_tp``; ``variant`` picks the irregular
    split of ``boxes`` (0: growing boxes, 1: shrinking)."""

    kind: str
    world: int
    mesh: tuple[int, ...] = ()
    variant: int = 0

    @property
    def name(self) -> str:
        mesh = "x".join(map(str, self.mesh)) if self.mesh else str(self.world)
        return f"{self.kind}{mesh}" + (f"v{self.variant}" if self.kind == "boxes" else "")

    def dp(self, rank: int) -> tuple[int, int]:
        """(data-parallel rank, size) of ``rank``."""
        if self.kind in ("fsdp", "boxes"):
            return rank, self.world
        if self.kind == "fsdp_tp":
            return rank // self.mesh[1], self.mesh[0]
        return 0, 1  # plain, tp, pp: one replica

    def stage(self, rank: int) -> tuple[int, int] | None:
        """(first layer, layers) of a pipeline stage."""
        if self.kind != "pp":
            return None
        n = LAYERS // self.world
        return rank * n, n


def split(n: int, world: int, variant: int) -> list[int]:
    """An irregular split of ``n`` rows into ``world`` non-empty boxes."""
    weights = [i + 1 for i in range(world)]
    if variant:
        weights.reverse()
    sizes = [max(1, n * w // sum(weights)) for w in weights]
    sizes[-1] = n - sum(sizes[:-1])
    assert all(s > 0 for s in sizes), (n, world, sizes)
    return sizes


@dataclass
class Objects:
    """What an adapter's ``build`` hook gets: the objects of one rank at one layout.

    ``model``/``optimizer``/``scheduler`` are None for ``boxes`` (explicit boxes
    of a framework without modules, Megatron-style); then ``boxes`` maps each FQN
    to ``(local, global_shape, global_offset)``. ``stage_offset`` is the first
    layer of a pipeline stage (its module names layers from 0: the adapter
    stores them renumbered, ``layers.<i + stage_offset>``), else None.
    ``dp_rank``/``dp_world`` (and ``dp_mesh`` when a DeviceMesh dimension is the
    data-parallel group) say which slice of the data this rank reads.
    ``extra`` is a dict of extra state (a bfloat16 tensor, JSON values) to store
    under ``extra`` as it is."""

    layout: Layout
    rank: int
    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    scheduler: object | None
    boxes: dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]] | None
    stage_offset: int | None
    dp_rank: int
    dp_world: int
    dp_mesh: object | None
    num_samples: int = NUM_SAMPLES
    seed: int = DATA_SEED
    extra: dict = field(default_factory=dict)


def _parallelize(model: TinyNet, layout: Layout):
    """Apply FSDP2 / TP as ``layout`` says; return the data-parallel mesh (or None)."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (layout.world,), mesh_dim_names=("dp",))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return mesh
    if layout.kind in ("tp", "fsdp_tp"):
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        shape, names = ((layout.world,), ("tp",)) if layout.kind == "tp" else (layout.mesh, ("dp", "tp"))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for block in model.layers:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if layout.kind == "tp":
            return None
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return mesh["dp"]
    return None


def objects(layout: Layout, rank: int, ref: Reference, saving: bool) -> Objects:
    """The objects of ``rank`` at ``layout``. Saving: the state after STEPS
    steps (module layouts train them in the layout; pipeline stages and boxes
    copy the reference's). Loading: fresh objects (another init, no optimizer
    state, a new scheduler), which the load must fill."""
    dp_rank, dp_world = layout.dp(rank)
    common: dict[str, Any] = {"layout": layout, "rank": rank, "dp_rank": dp_rank, "dp_world": dp_world, "extra": extra_state(saving)}
    if layout.kind == "boxes":
        boxes = {}
        for fqn, full in ref.params.items():
            sizes = split(full.shape[0], layout.world, layout.variant)
            start = sum(sizes[:rank])
            local = full[start:start + sizes[rank]].clone() if saving else torch.full_like(full[start:start + sizes[rank]], -7.0)
            boxes[fqn] = (local, tuple(full.shape), (start,) + (0,) * (full.dim() - 1))
        return Objects(model=None, optimizer=None, scheduler=None, boxes=boxes, stage_offset=None, dp_mesh=None, **common)
    stage = layout.stage(rank)
    model = make_model(0 if saving else 1, stage[1] if stage else LAYERS)
    dp_mesh = _parallelize(model, layout)
    opt = make_optimizer(model)
    sched = make_scheduler(opt)
    if saving and stage is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for s in range(1, STEPS + 1):
                train_step(model, opt, sched, s)
    elif saving and stage is not None:  # a pipeline stage: the reference's layers [offset, offset + n)
        with torch.no_grad():
            for name, p in model.named_parameters():
                fqn = stage_name(name, stage[0])
                p.copy_(ref.params[fqn])
                opt.state[p] = {"step": torch.tensor(float(STEPS)),
                                **{k: v.clone() for k, v in ref.moments[fqn].items()}}
        sched.load_state_dict(ref.sched)
        for g, lr in zip(opt.param_groups, ref.lrs):
            g["lr"] = lr
    return Objects(model=model, optimizer=opt, scheduler=sched, boxes=None,
                   stage_offset=stage[0] if stage else None, dp_mesh=dp_mesh, **common)


def stage_name(name: str, offset: int) -> str:
    """``layers.<i>.rest`` of a stage -> ``layers.<i + offset>.rest``."""
    head, i, rest = name.split(".", 2)
    return f"{head}.{int(i) + offset}.{rest}"


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The global value of a DTensor (a collective), else the tensor."""
    if hasattr(t, "full_tensor"):
        return t.full_tensor().detach().clone()
    return t.detach().clone()


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def draws() -> dict:
    """What each generator yields next (the RNG behavioural check)."""
    return {"torch": torch.rand(3).tolist(), "numpy": np.random.rand(2).tolist(), "python": random.random()}
