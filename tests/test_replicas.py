"""Replicas that are not replicas fail the save before anything is written;
per-rank data has an explicit form; FSDP1 flat parameters are refused (the
distributed part is in the shared 4-rank run, tests/engine_dist.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

import tensorckpt
from tests.engine_dist import WORLD, engine_runs  # noqa: F401  (the session fixture)


@pytest.fixture(scope="module")
def res(engine_runs):  # noqa: F811
    base, runs = engine_runs
    return base, [r["replicas"] for r in runs]


def _same_everywhere(outs: list) -> tuple:
    assert all(o is not None for o in outs), outs
    assert len({o[2] for o in outs}) == 1, outs
    return outs[0]


def test_plain_tensor_differing_across_ranks_fails(res):
    base, res = res
    name, _, msg = _same_everywhere([r["tensor"] for r in res])
    assert name == "IncompatibleStateError"
    assert "'w': ranks [0, 2] vs ranks [1, 3]" in msg and "'x'" not in msg, msg
    assert "DTensor" in msg and "ShardedTensor" in msg and "per_rank" in msg
    assert not (base / "rep_tensor").exists()


def test_value_differing_across_ranks_fails(res):
    base, res = res
    name, _, msg = _same_everywhere([r["value"] for r in res])
    assert name == "IncompatibleStateError"
    assert "'count': rank 0 has 0, rank 1 has 1" in msg and "'same'" not in msg, msg
    assert "per_rank" in msg
    assert not (base / "rep_value").exists()


def test_digests_are_checked_on_plan_cache_hits(res):
    base, res = res
    for r in res:
        assert r["cache"][0] == [False, True]  # the second save reused the plan
    name, _, msg = _same_everywhere([r["cache"][1] for r in res])
    assert name == "IncompatibleStateError" and "'w': ranks [0, 1, 3] vs rank 2" in msg, msg
    assert not (base / "cache2").exists()
    assert torch.equal(tensorckpt.open(base / "cache1").read("w"), torch.arange(6.0).reshape(2, 3) + 1)


def test_async_save_checks_replicas(res):
    base, res = res
    name, _, msg = _same_everywhere([r["async"] for r in res])
    assert name == "IncompatibleStateError" and "'w'" in msg
    assert not (base / "rep_async").exists()


def test_fsdp1_flat_parameters_refused(res):
    _, res = res
    # the optimizer of an FSDP1 model: refused by its adapter (training-state.md 4.1 item 4)
    name, _, msg = _same_everywhere([r["fsdp1_optim"] for r in res])
    assert name == "UnsupportedValueError" and "'optim'" in msg and "FSDP1" in msg, msg
    assert "FSDP2" in msg and "optim_state_dict" in msg, msg
    # flat parameters themselves (a state dict holding them): refused by the save
    name, _, msg = _same_everywhere([r["fsdp1_params"] for r in res])
    assert name == "UnsupportedValueError" and repr("p/_fsdp_wrapped_module._flat_param") in msg, msg
    assert "use_orig_params=True" in msg and "FSDP2" in msg and "SHARDED_STATE_DICT" in msg
    # the moments of a raw optimizer state dict: caught as replicas that differ
    name, _, msg = _same_everywhere([r["fsdp1_raw_optim"] for r in res])
    assert name == "IncompatibleStateError" and "'o/exp_avg'" in msg


def test_per_rank_round_trip_and_world_change(res):
    base, res = res
    for rank, r in enumerate(res):
        assert r["per_rank"] == ([float(rank)] * 2, {"rank": rank, "name": f"r{rank}"})
    c = tensorckpt.open(base / "per_rank")
    assert c.info("seen/rows").shape == (WORLD, 2)
    assert torch.equal(c.read("seen/rows"), torch.arange(float(WORLD)).repeat_interleave(2).reshape(WORLD, 2))
    assert c.to_state_dict()["info"] == {str(r): {"rank": r, "name": f"r{r}"} for r in range(WORLD)}
    # one process loads a 4-rank save: refused when strict, rank 0's row otherwise
    for member in ("seen", "info"):
        target = {"seen": tensorckpt.per_rank(torch.zeros(2)), "info": tensorckpt.per_rank(None),
                  "shared": torch.zeros(2, 3)}
        with pytest.raises(tensorckpt.IncompatibleStateError, match=f"'{member}': per-rank data saved by 4 ranks, loaded by 1"):
            tensorckpt.load({member: target[member], "shared": target["shared"]}, base / "per_rank", partial=True)
    target = {"seen": tensorckpt.per_rank(torch.zeros(2)), "info": tensorckpt.per_rank(None), "shared": torch.zeros(2, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensorckpt.load(target, base / "per_rank", strict=False)
    assert target["seen"].value.tolist() == [0.0, 0.0] and target["info"].value == {"rank": 0, "name": "r0"}


def test_per_rank_single_process(tmp_path):
    t = torch.arange(3, dtype=torch.int32)
    tensorckpt.save({"c": tensorckpt.per_rank(t), "v": tensorckpt.per_rank([1, "a"])}, tmp_path / "p")
    assert tensorckpt.open(tmp_path / "p").keys() == ["c/rows", "v/0"]
    back = {"c": tensorckpt.per_rank(torch.zeros(3, dtype=torch.int32)), "v": tensorckpt.per_rank(None)}
    tensorckpt.load(back, tmp_path / "p")
    assert torch.equal(back["c"].value, t) and back["v"].value == [1, "a"]
    with pytest.raises(tensorckpt.UnsupportedValueError, match="plain tensor"):
        tensorckpt.per_rank(tensorckpt.ShardedTensor(t, (3,), (0,)))
