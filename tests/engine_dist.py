"""One 4-rank gloo run shared by test_collective_errors.py, test_replicas.py
and test_sampler_dp.py (spawning 4 processes costs more than what they check,
so they share one spawn: the session fixture ``engine_runs``). Each part of
the worker records its outcome; the test files assert on it."""

from __future__ import annotations

import glob
import os

import pytest
import torch

import tensorckpt
from tests import dist

WORLD = 4
N_SAMPLES = 42
BATCH = 4


class Exploding(torch.Tensor):
    """A tensor whose data cannot be read (a failing device, say)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.detach, torch.Tensor.contiguous, torch.Tensor.cpu):
            raise RuntimeError("injected: device lost")
        return super().__torch_function__(func, types, args, kwargs or {})


def corrupt(path: str, key: str) -> None:
    """Flip the first byte of every stored object of ``key`` (its chunks fail their checksum)."""
    for f in glob.glob(os.path.join(path, key, "c", "**"), recursive=True):
        if os.path.isfile(f):
            with open(f, "r+b") as fh:
                b = fh.read(1)
                fh.seek(0)
                fh.write(bytes([b[0] ^ 0xFF]))


def outcome(fn) -> tuple | None:
    """None, or (class name, class names of its MRO, message) of the TensorckptError ``fn`` raised."""
    try:
        fn()
        return None
    except tensorckpt.TensorckptError as e:
        return type(e).__name__, [c.__name__ for c in type(e).__mro__], str(e)


# ------------------------------------------------------------------ parts


def collective_errors(rank: int, base: str) -> dict:
    import torch.distributed as tdist

    out = {}
    good = {"a": torch.arange(4.0), "b": torch.ones(3), "step": 7}
    s = dict(good)  # ranks 1 and 2 fail differently in one save
    s["bad"] = object() if rank == 1 else torch.zeros(2).as_subclass(Exploding) if rank == 2 else 0
    out["save"] = outcome(lambda: tensorckpt.save(s, f"{base}/two"))
    out["save_async"] = outcome(lambda: tensorckpt.async_save(s, f"{base}/two_async").wait())

    tensorckpt.save(good, f"{base}/ok")
    tdist.barrier()
    if rank == 0:
        corrupt(f"{base}/ok", "b")  # only rank 1 reads "b"
    tdist.barrier()

    def target(with_b: bool, a_shape=(4,)) -> dict:
        return {"a": torch.zeros(a_shape), "step": 0} | ({"b": torch.zeros(3)} if with_b else {})

    out["corrupt"] = outcome(lambda: tensorckpt.load(target(rank == 1), f"{base}/ok"))
    out["shape"] = outcome(lambda: tensorckpt.load(target(False, (5,) if rank == 2 else (4,)), f"{base}/ok"))
    out["unexpected"] = outcome(lambda: tensorckpt.load(target(False), f"{base}/ok"))  # no rank wants "b"
    t = target(False)
    out["good"] = outcome(lambda: tensorckpt.load(t, f"{base}/ok", partial=True)), t["a"].tolist(), t["step"]

    mgr = tensorckpt.CheckpointManager(f"{base}/run")
    mgr.save(3, good)
    tdist.barrier()
    if rank == 0:
        corrupt(mgr.step_path(3), "b")
    tdist.barrier()
    out["restore"] = outcome(lambda: mgr.restore(target(rank == 1)))
    out["restore_step"] = outcome(lambda: mgr.restore(target(rank == 1), 3))
    return out


def replicas(rank: int, base: str) -> dict:
    out = {}
    w = torch.arange(6.0).reshape(2, 3)
    # a "replica" that differs on ranks 1 and 3
    out["tensor"] = outcome(lambda: tensorckpt.save({"w": w + (rank % 2), "x": w}, f"{base}/rep_tensor"))
    out["value"] = outcome(lambda: tensorckpt.save({"w": w, "count": rank, "same": "a"}, f"{base}/rep_value"))
    # plan cache: the second save hits it; a third with the same layout but other data still fails
    hits = []
    for i in range(2):
        st = tensorckpt.SaveStats()
        tensorckpt.save({"w": w + i, "step": i}, f"{base}/cache{i}", stats=st)
        hits.append(st.plan_cache_hit)
    st = tensorckpt.SaveStats()
    out["cache"] = hits, outcome(lambda: tensorckpt.save({"w": w + (rank == 2), "step": 2}, f"{base}/cache2", stats=st))
    out["async"] = outcome(lambda: tensorckpt.async_save({"w": w * (rank + 1)}, f"{base}/rep_async").wait())

    # per-rank data, explicitly
    state = {"seen": tensorckpt.per_rank(torch.full((2,), float(rank))),
             "info": tensorckpt.per_rank({"rank": rank, "name": f"r{rank}"}), "shared": w}
    tensorckpt.save(state, f"{base}/per_rank")
    back = {"seen": tensorckpt.per_rank(torch.zeros(2)), "info": tensorckpt.per_rank(None), "shared": torch.zeros(2, 3)}
    tensorckpt.load(back, f"{base}/per_rank")
    out["per_rank"] = back["seen"].value.tolist(), back["info"].value

    # FSDP1 flat parameters (use_orig_params=False): refused, with what to do
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)), use_orig_params=False,
                 device_id=torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    out["fsdp1_optim"] = outcome(lambda: tensorckpt.save({"model": model, "optim": opt}, f"{base}/fsdp1"))
    out["fsdp1_params"] = outcome(lambda: tensorckpt.save({"p": dict(model.named_parameters())}, f"{base}/fsdp1p"))
    out["fsdp1_raw_optim"] = outcome(lambda: tensorckpt.save({"o": opt.state_dict()["state"][0]}, f"{base}/fsdp1o"))
    return out


def sampler(rank: int, base: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.data import DataLoader

    out = {"world_default": tensorckpt.ResumableSampler(N_SAMPLES).world}  # only the world exists: its size
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    try:
        tensorckpt.ResumableSampler(N_SAMPLES)
        out["ambiguous"] = None
    except ValueError as e:
        out["ambiguous"] = str(e)
    s = tensorckpt.ResumableSampler(N_SAMPLES, seed=5, dp_mesh=mesh["dp"])
    g = tensorckpt.ResumableSampler(N_SAMPLES, seed=5, dp_group=mesh["dp"].get_group())
    out["dp"] = (s.rank, s.world), (g.rank, g.world)
    out["hsdp"] = tensorckpt.ResumableSampler(N_SAMPLES, dp_mesh=mesh).world
    loader = DataLoader(list(range(N_SAMPLES)), batch_size=BATCH, sampler=s, generator=torch.Generator())
    first = []
    for i, batch in enumerate(s.track(loader)):
        first.append(batch.tolist())
        if i == 2:
            break
    tensorckpt.save({"data": s}, f"{base}/sampler")  # TP peers write the same per-rank keys, equal
    # resume at another data-parallel size: pure DP over the 4 ranks
    s4 = tensorckpt.ResumableSampler(N_SAMPLES, seed=0, rank=rank, world=WORLD)
    tensorckpt.load({"data": s4}, f"{base}/sampler")
    loader = DataLoader(list(range(N_SAMPLES)), batch_size=BATCH, sampler=s4, generator=torch.Generator())
    out["batches"] = first, [b.tolist() for b in s4.track(loader)]
    return out


def worker(rank: int, world: int, base: str) -> dict:
    return {
        "collective_errors": collective_errors(rank, base),
        "replicas": replicas(rank, base),
        "sampler": sampler(rank, base),
    }


_RUN: list = []  # the run, once per session: each test module imports the fixture, pytest sets it up per module


@pytest.fixture(scope="session")
def engine_runs(tmp_path_factory):
    if not _RUN:
        base = tmp_path_factory.mktemp("engine_dist")
        _RUN.append((base, dist.run(WORLD, worker, str(base), timeout=240)))
    return _RUN[0]
