"""tensorckpt's built-in adapters through the adapter conformance suite
(adapter_suite.py), and a mutation test of the suite: deliberately broken
adapters, each of which must fail the suite test that names its mistake.

All adapters run in the same few gloo launches (``companions``)."""

from __future__ import annotations

import random
from itertools import islice

import numpy as np
import pytest
import torch

import tensorckpt

from . import adapter_checks as checks
from .adapter_run import Case
from .adapter_suite import (
    DEFAULT_MATRIX,
    FSDP3,
    FSDP_TP4,
    AdapterConformance,
    results_for,
)


class TensorckptAdapter:
    """tensorckpt's adapters: modules, optimizers, schedulers, ResumableSampler, rng_state()."""

    def build(self, objs):
        if objs.boxes is not None:
            model = {fqn: tensorckpt.ShardedTensor(local, shape, off) for fqn, (local, shape, off) in objs.boxes.items()}
        elif objs.stage_offset is not None:
            model = tensorckpt.shift_layers(objs.model, objs.stage_offset)
        else:
            model = objs.model
        if objs.dp_mesh is not None:
            data = tensorckpt.ResumableSampler(objs.num_samples, seed=objs.seed, dp_mesh=objs.dp_mesh)
        else:
            data = tensorckpt.ResumableSampler(objs.num_samples, seed=objs.seed, rank=objs.dp_rank, world=objs.dp_world)
        state = {"model": model, "data": data, "rng": tensorckpt.rng_state(), "extra": objs.extra}
        if objs.optimizer is not None:
            state |= {"optim": objs.optimizer, "sched": objs.scheduler}
        return state

    def save(self, state, path):
        tensorckpt.save(state, path)

    def load(self, state, path):
        tensorckpt.load(state, path)

    def consume(self, state, n):
        sampler = state["data"]
        out = list(sampler) if n is None else list(islice(iter(sampler), n))
        sampler.advance(len(out))
        return out


# ------------------------------------------------------------------ broken adapters (one mistake each)


class IntIds(TensorckptAdapter):
    """Optimizer state keyed by torch's integer parameter ids (opt.state_dict() as is)."""

    def save(self, state, path):
        sd = state["optim"].state_dict()
        plain = {"state": {str(i): dict(v) for i, v in sd["state"].items()}, "param_groups": sd["param_groups"]}
        tensorckpt.save({**state, "optim": plain}, path)

    def load(self, state, path):
        tensorckpt.load({k: v for k, v in state.items() if k != "optim"}, path, partial=True)


class _LocalMoments:
    def __init__(self, opt):
        self.opt = opt


class _LocalMomentsAdapter:
    """The built-in optimizer adapter, but each DTensor moment replaced by rank 0's local shard."""

    def save_state(self, obj, ctx):
        import torch.distributed as dist

        from tensorckpt.adapters.optimizer import OptimizerAdapter

        plain = OptimizerAdapter().save_state(obj.opt, ctx)
        for fqn in sorted(plain.get("state", {})):
            for name, v in sorted(plain["state"][fqn].items()):
                if hasattr(v, "to_local"):
                    box = [v.to_local().detach().clone()]
                    dist.broadcast_object_list(box, 0)
                    plain["state"][fqn][name] = box[0]
        return plain

    def load_target(self, obj, stored, ctx):
        from tensorckpt.adapters.optimizer import OptimizerAdapter

        return OptimizerAdapter().load_target(obj.opt, stored, ctx)

    def apply(self, obj, loaded, ctx):
        from tensorckpt.adapters.optimizer import OptimizerAdapter

        OptimizerAdapter().apply(obj.opt, loaded, ctx)


tensorckpt.register_adapter(_LocalMoments, _LocalMomentsAdapter())


class LocalShape(TensorckptAdapter):
    """Moments saved at the local shard's shape, not the parameter's global shape."""

    def save(self, state, path):
        tensorckpt.save({**state, "optim": _LocalMoments(state["optim"])}, path)

    def load(self, state, path):
        tensorckpt.load({k: v for k, v in state.items() if k != "optim"}, path, partial=True)


class NoScheduler(TensorckptAdapter):
    """The scheduler's state dropped."""

    def build(self, objs):
        state = super().build(objs)
        state.pop("sched", None)
        return state


class SamplerLost(TensorckptAdapter):
    """The sampler's position lost when the data-parallel size changes (the epoch restarts)."""

    def load(self, state, path):
        super().load(state, path)
        s = state["data"]
        if s._segments:  # the load closed a segment: another DP size
            s._segments, s._consumed, s._cache = [], 0, None


class RngFromRank0(TensorckptAdapter):
    """Every rank saves rank 0's generator states."""

    def save(self, state, path):
        import torch.distributed as dist

        box = [(torch.get_rng_state(), np.random.get_state(), random.getstate())]
        dist.broadcast_object_list(box, 0)
        torch.set_rng_state(box[0][0])
        np.random.set_state(box[0][1])
        random.setstate(box[0][2])
        super().save(state, path)


class Bf16Upcast(TensorckptAdapter):
    """A bfloat16 tensor upcast to float32 on save."""

    def save(self, state, path):
        extra = {**state["extra"], "ema": state["extra"]["ema"].float()}
        tensorckpt.save({**state, "extra": extra}, path)

    def load(self, state, path):
        tensorckpt.load(state, path, cast=True)


# mutant -> the suite test that names its mistake
MUTATIONS = {
    IntIds: "test_optimizer_moments_under_fqns",
    LocalShape: "test_optimizer_moments_global_shape",
    NoScheduler: "test_scheduler_state",
    SamplerLost: "test_samples_seen_exactly_once",
    RngFromRank0: "test_rng_rows_per_rank",
    Bf16Upcast: "test_tensor_dtypes",
}
MUTANT_CASE = Case(FSDP3, FSDP_TP4)  # DTensor moments, a DP change (3 -> 2), a new rank; in the default matrix
assert MUTANT_CASE in DEFAULT_MATRIX


class TestTensorckptAdapter(TensorckptAdapter, AdapterConformance):
    companions = tuple(MUTATIONS)
    companion_cases = (MUTANT_CASE,)


@pytest.fixture(scope="module")
def mutant_results(tmp_path_factory):
    return results_for(TestTensorckptAdapter, tmp_path_factory.mktemp("adapter-conformance"))


@pytest.mark.parametrize("mutant", list(MUTATIONS), ids=lambda m: m.__name__)
def test_suite_catches_mutation(mutant_results, mutant):
    name = MUTATIONS[mutant]
    res = mutant_results[mutant.__name__][MUTANT_CASE.name]
    res.saved()  # the mistake is in what was saved or loaded, not a crash
    checks.check_tensors(res)  # the model itself is right: the failure is specific
    with pytest.raises(AssertionError):
        checks.CHECKS[name](res)
    checks.CHECKS[name](mutant_results[TestTensorckptAdapter.__name__][MUTANT_CASE.name])  # tensorckpt passes it


def test_suite_does_not_import_tensorckpt():
    """The suite's modules must run for a second implementation, without tensorckpt."""
    import subprocess
    import sys

    code = ("import sys, conformance.adapter_suite, conformance.adapter_checks; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'tensorckpt'); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
