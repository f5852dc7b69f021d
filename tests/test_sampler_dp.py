"""ResumableSampler over the data-parallel group of a dp=2 x tp=2 job: TP
peers get identical batches, the default refuses to guess once subgroups
exist, and a resume at another DP size sees every sample once (the
distributed part is in the shared 4-rank run, tests/engine_dist.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import tensorckpt
from tests.engine_dist import BATCH, N_SAMPLES, WORLD, engine_runs  # noqa: F401  (the session fixture)


@pytest.fixture(scope="module")
def res(engine_runs):  # noqa: F811
    base, runs = engine_runs
    return base, [r["sampler"] for r in runs]


def _flat(batches: list) -> list[int]:
    return [i for b in batches for i in b]


def test_default_is_the_world_only_while_no_subgroup_exists(res):
    _, res = res
    for r in res:
        assert r["world_default"] == WORLD
        assert r["ambiguous"] is not None and "dp_mesh=mesh['dp']" in r["ambiguous"] and "dp_group" in r["ambiguous"]


def test_dp_rank_from_mesh_or_group(res):
    _, res = res
    assert [r["dp"] for r in res] == [((0, 2), (0, 2)), ((0, 2), (0, 2)), ((1, 2), (1, 2)), ((1, 2), (1, 2))]
    assert [r["hsdp"] for r in res] == [WORLD] * WORLD  # a 2-D DP mesh: its coordinates, row-major


def test_tp_peers_get_identical_batches(res):
    _, res = res
    first = [r["batches"][0] for r in res]
    assert first[0] == first[1] and first[2] == first[3]
    assert not set(_flat(first[0])) & set(_flat(first[2]))
    assert len(_flat(first[0])) == 3 * BATCH


def test_resume_at_another_dp_size_sees_every_sample_once(res):
    _, res = res
    before = _flat(res[0]["batches"][0]) + _flat(res[2]["batches"][0])  # one per DP rank
    after = [i for r in res for i in _flat(r["batches"][1])]
    assert sorted(before + after) == list(range(N_SAMPLES))


def test_resume_in_one_process(res):
    base, res = res
    s = tensorckpt.ResumableSampler(N_SAMPLES)
    tensorckpt.load({"data": s}, base / "sampler")
    rest = _flat(b.tolist() for b in s.track(DataLoader(list(range(N_SAMPLES)), batch_size=BATCH, sampler=s,
                                                        generator=torch.Generator())))
    before = _flat(res[0]["batches"][0]) + _flat(res[2]["batches"][0])
    assert sorted(before + rest) == list(range(N_SAMPLES))


def test_explicit_arguments_checked():
    with pytest.raises(ValueError, match="one of"):
        tensorckpt.ResumableSampler(10, rank=0, world=1, dp_group=object())
    with pytest.raises(ValueError, match="go together"):
        tensorckpt.ResumableSampler(10, rank=0)
