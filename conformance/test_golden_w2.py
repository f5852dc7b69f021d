"""The golden training_state_w2 (saved by 2 gloo ranks, FSDP2 + AdamW +
sampler + rng; see golden_w2.py) loads into objects at world 1 (in this
process) and at world 3 (one gloo launch) exactly as expected_ranks.json says:
each rank's parameter and moment boxes bit for bit, the sampler's next
samples, the generators' next draws (own row, or the derived seed), the
optimizer's steps and hyperparameters. test_golden.py and test_validate.py
read its full values through open, load and the validator like every golden.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from . import golden_w2
from .suite import assert_bit_equal, expected_tensor, load_expected

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden" / "v1" / golden_w2.NAME
EXPECTED = json.loads((GOLDEN / "expected_ranks.json").read_text(encoding="utf-8"))


def _check_rank(got: dict, want: dict, world: int, rank: int) -> None:
    where = f"world {world} rank {rank}"
    assert set(got["boxes"]) == set(want["boxes"]), where
    for key, box in want["boxes"].items():
        assert_bit_equal(torch.from_numpy(got["boxes"][key]), expected_tensor(box), f"{where}: {key}")
    assert got["sampler_next"] == want["sampler_next"], where
    assert got["draws"] == {k: want["rng"][k] for k in ("torch_rand", "numpy_random", "python_random")}, where
    values = load_expected(golden_w2.NAME)["values"]
    assert got["step"] == values["step"]["value"]
    assert got["steps"] == {f: values[f"optim/state/{f}/step"]["value"] for f in golden_w2.PARAMS}, where
    gid = values["optim/group_of/0.weight"]["value"]
    hp = {k.rsplit("/", 1)[1]: v["value"] for k, v in values.items() if k.startswith(f"optim/groups/{gid}/")}
    assert json.loads(json.dumps(got["hparams"])) == hp, where


def test_expected_ranks_describe_the_loads():
    assert EXPECTED["saved_world"] == 2 and set(EXPECTED["worlds"]) == {"1", "3"}
    full = load_expected(golden_w2.NAME)["tensors"]
    for world, doc in EXPECTED["worlds"].items():
        assert len(doc["ranks"]) == int(world)
        for key, entry in full.items():
            if key.startswith("rng/"):
                continue
            whole = expected_tensor(entry)
            parts = [expected_tensor(r["boxes"][key]) for r in doc["ranks"]]
            assert_bit_equal(torch.cat(parts), whole, key)  # the boxes tile the full value
    w1, w3 = EXPECTED["worlds"]["1"]["ranks"], EXPECTED["worlds"]["3"]["ranks"]
    assert sorted(w1[0]["sampler_next"]) == sorted(i for r in w3 for i in r["sampler_next"])  # same rest of the epoch
    assert [r["rng"].get("row") for r in w3] == [0, 1, None] and "derived_seed" in w3[2]["rng"]


def test_loads_at_world_1():
    saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        got = golden_w2.load_rank(0, 1, str(GOLDEN / "checkpoint"))
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])
    _check_rank(got, EXPECTED["worlds"]["1"]["ranks"][0], 1, 0)


def test_loads_at_world_3():
    """One launch of 3 gloo ranks (about 10 s on a loaded 2-core machine)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    import dist

    results = dist.run(3, golden_w2.load_rank, str(GOLDEN / "checkpoint"), timeout=180)
    for rank, got in enumerate(results):
        _check_rank(got, EXPECTED["worlds"]["3"]["ranks"][rank], 3, rank)


@pytest.mark.parametrize("world", [1, 3])
def test_derived_seed_is_the_specs(world):
    row0 = expected_tensor(load_expected(golden_w2.NAME)["tensors"]["rng/torch"])[0].numpy().tobytes()
    for rank, r in enumerate(EXPECTED["worlds"][str(world)]["ranks"]):
        if "derived_seed" in r["rng"]:
            assert r["rng"]["derived_seed"] == golden_w2.derive_seed(row0, rank)
            from tensorckpt.adapters.rng import derive_seed

            assert derive_seed(row0, rank) == r["rng"]["derived_seed"]
