"""tensorckpt.rng_state(): every rank's generators saved as rows of logical
tensors; restored exactly at the same world, derived for new ranks.

The gloo chain spawns each world once: save at 2 -> load at 3, save, load
again at 3 -> load at 2. After a restore, torch.rand / np.random.rand /
random.random (and the cached Gaussians) give what the saving process would
have drawn next.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys

import numpy as np
import pytest
import torch

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:  # spawned workers import this module by name
    sys.path.insert(0, _TESTS)

import dist  # noqa: E402

import tensorckpt  # noqa: E402
from tensorckpt.adapters import rng  # noqa: E402


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    random.gauss(0, 1), np.random.standard_normal()  # both cache a second Gaussian: that is state too


def draws() -> tuple:
    """What the generators give next."""
    return (
        torch.rand(3).tolist(),
        np.random.rand(3).tolist(),
        [random.random() for _ in range(3)],
        random.gauss(0, 1),
        float(np.random.standard_normal()),
        torch.randint(0, 2**31, (2,)).tolist(),
    )


@pytest.fixture
def own_rng():
    """Leave this process's generators as the test found them."""
    saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
    yield
    torch.set_rng_state(saved[0]), np.random.set_state(saved[1]), random.setstate(saved[2])


# --------------------------------------------------------- one process


def test_restore_is_exact_and_stored_as_integer_rows(mem_url, own_rng):
    url = mem_url()
    seed_all(7)
    tensorckpt.save({"rng": tensorckpt.rng_state(), "step": 1}, url)
    expected = draws()
    seed_all(8)
    tensorckpt.load({"rng": tensorckpt.rng_state(), "step": 0}, url)
    assert draws() == expected
    ck = tensorckpt.open(url)
    shapes = {k: (ck.info(k).shape, ck.info(k).dtype) for k in ck.keys() if k.startswith("rng/")}
    assert shapes == {
        "rng/torch": ((1, 5056), torch.uint8),
        "rng/numpy": ((1, rng.NP_WIDTH), torch.int64),
        "rng/python": ((1, rng.PY_WIDTH), torch.int64),
    }


def test_encodings_round_trip(own_rng):
    seed_all(3)
    for encode, decode, state in (
        (rng.encode_python, rng.decode_python, random.getstate()),
        (rng.encode_numpy, rng.decode_numpy, np.random.get_state()),
    ):
        back = decode(encode(state).tolist())
        assert [np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(back, state)] == [True] * len(state)
    assert rng.decode_python(rng.encode_python(random.getstate()).tolist())[2] is not None  # the cached Gaussian


def test_derived_seed_is_the_specified_hash():
    row = bytes(range(256)) * 3
    digest = hashlib.sha256(b"tensorckpt/rng/v1\x00" + row + (5).to_bytes(8, "little")).digest()
    assert rng.derive_seed(row, 5) == int.from_bytes(digest[:8], "little")
    assert rng.derive_seed(row, 5) != rng.derive_seed(row, 6)


def test_missing_rng_state_is_reported_or_skipped(mem_url, own_rng):
    url = mem_url()
    tensorckpt.save({"step": 1}, url)
    with pytest.raises(tensorckpt.IncompatibleStateError, match="train/rng/torch"):
        tensorckpt.load({"step": 0, "train": {"rng": tensorckpt.rng_state()}}, url)
    seed_all(4)
    expected = draws()
    seed_all(4)
    with pytest.warns(UserWarning, match="rng/torch"):
        tensorckpt.load({"step": 0, "rng": tensorckpt.rng_state()}, url, strict=False)
    assert draws() == expected  # generators unchanged


def test_corrupt_row_is_an_error_naming_the_key(mem_url, own_rng):
    url = mem_url()
    rows = rng.capture()
    rows["python"] = torch.zeros(rng.PY_WIDTH, dtype=torch.int64)  # version 0
    tensorckpt.save({"train": {"rng": {k: v.reshape(1, -1) for k, v in rows.items()}}}, url)
    with pytest.raises(tensorckpt.CorruptCheckpointError, match="'train/rng/python'.*row 0"):
        tensorckpt.load({"train": {"rng": tensorckpt.rng_state()}}, url)


def test_wrong_dims_is_an_error(mem_url):
    url = mem_url()
    tensorckpt.save({"rng": {"torch": torch.zeros(5056, dtype=torch.uint8), "numpy": torch.zeros(1), "python": torch.zeros(1)}}, url)
    with pytest.raises(tensorckpt.CorruptCheckpointError, match="'rng/torch' is stored as \\[5056\\]"):
        tensorckpt.load({"rng": tensorckpt.rng_state()}, url)


# ------------------------------------------------------------ over gloo


def _load(path: str) -> tuple[tuple, int]:
    seed_all(999)  # whatever the process had: the load replaces it
    stats = tensorckpt.LoadStats()
    tensorckpt.load({"rng": tensorckpt.rng_state()}, path, stats=stats)
    return draws(), stats.bytes_needed


def save_at_2(rank: int, world: int, base: str) -> tuple:
    seed_all(100 + rank)
    tensorckpt.save({"rng": tensorckpt.rng_state()}, f"{base}/a")
    return draws()


def at_3(rank: int, world: int, base: str) -> dict:
    out = {}
    out["from2"], out["bytes"] = _load(f"{base}/a")
    seed_all(200 + rank)
    tensorckpt.save({"rng": tensorckpt.rng_state()}, f"{base}/b")
    out["saved"] = draws()
    out["same_world"], _ = _load(f"{base}/b")
    return out


def load_at_2(rank: int, world: int, base: str) -> tuple:
    return _load(f"{base}/b")[0]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("rng"))
    two = dist.run(2, save_at_2, base)
    three = dist.run(3, at_3, base)
    back = dist.run(2, load_at_2, base)
    return base, two, three, back


def spec_derived_draws(rank0_torch_row: bytes, rank: int) -> tuple:
    """Rank ``rank`` has no saved row: the spec's rule, written out."""
    digest = hashlib.sha256(b"tensorckpt/rng/v1\x00" + rank0_torch_row + rank.to_bytes(8, "little")).digest()
    seed = int.from_bytes(digest[:8], "little")
    saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        torch.manual_seed(seed), np.random.seed(seed % 2**32), random.seed(seed)
        return draws()
    finally:
        torch.set_rng_state(saved[0]), np.random.set_state(saved[1]), random.setstate(saved[2])


def test_world_2_to_3_restores_old_ranks_and_derives_the_new_one(chain):
    base, two, three, _ = chain
    assert [three[r]["from2"] for r in (0, 1)] == two
    row0 = tensorckpt.open(f"{base}/a").read("rng/torch")[0].numpy().tobytes()
    assert three[2]["from2"] == spec_derived_draws(row0, 2)
    assert three[2]["from2"] not in two


def test_world_change_reads_only_the_rows_needed(chain):
    _, _, three, _ = chain
    own = 5056 + rng.NP_WIDTH * 8 + rng.PY_WIDTH * 8
    assert [three[r]["bytes"] for r in range(3)] == [own, own, 5056]  # rank 2: rank 0's torch row only


def test_same_world_restore_is_exact(chain):
    _, _, three, _ = chain
    assert [t["same_world"] for t in three] == [t["saved"] for t in three]


def test_world_3_to_2_restores_the_remaining_ranks(chain):
    _, _, three, back = chain
    assert back == [three[r]["saved"] for r in (0, 1)]
