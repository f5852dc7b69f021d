"""A failure on any rank is raised on every rank, as the same error naming
every failing rank and its exception: save, async_save, load and
CheckpointManager.restore (part of the shared 4-rank run, tests/engine_dist.py)."""

from __future__ import annotations

import pytest
import torch

import tensorckpt
from tests.engine_dist import Exploding, engine_runs  # noqa: F401  (the session fixture)


@pytest.fixture(scope="module")
def res(engine_runs):  # noqa: F811
    base, runs = engine_runs
    return base, [r["collective_errors"] for r in runs]


def test_save_names_every_failing_rank(res):
    base, res = res
    for case in ("save", "save_async"):
        errs = [r[case] for r in res]
        assert all(e is not None for e in errs), errs
        assert len({e[2] for e in errs}) == 1, f"{case}: ranks raised different messages: {errs}"
        name, _, msg = errs[0]
        assert name == "UnsupportedValueError", errs[0]  # the first failing rank's class, on every rank
        assert "ranks [1, 2] of 4" in msg, msg
        assert "rank 1: UnsupportedValueError" in msg and "'bad'" in msg, msg
        assert "rank 2: RuntimeError: injected: device lost" in msg, msg
    assert not (base / "two").exists() and not (base / "two_async").exists()


def test_corrupt_chunk_read_by_one_rank_fails_every_rank(res):
    _, res = res
    for r, out in enumerate(res):
        name, _, msg = out["corrupt"]
        assert name == "CorruptCheckpointError", (r, out["corrupt"])
        assert "rank 1 of 4: CorruptCheckpointError" in msg and "b" in msg, msg
    assert len({out["corrupt"][2] for out in res}) == 1


def test_bad_target_shape_on_one_rank_fails_every_rank(res):
    _, res = res
    for out in res:
        name, mro, msg = out["shape"]
        assert name == "IncompatibleStateError" and "ValueError" in mro, out["shape"]
        assert "rank 2 of 4" in msg and "'a'" in msg and "[5]" in msg, msg


def test_partial_load_and_its_hint(res):
    _, res = res
    for out in res:
        name, _, msg = out["unexpected"]
        assert name == "IncompatibleStateError" and "'b'" in msg and "partial=True" in msg, out["unexpected"]
        assert out["good"] == (None, [0.0, 1.0, 2.0, 3.0], 7)


def test_restore_fails_every_rank(res):
    _, res = res
    for case in ("restore", "restore_step"):
        for out in res:
            name, _, msg = out[case]
            assert name == "CorruptCheckpointError" and "rank 1 of 4" in msg, (case, out[case])


def test_single_process_errors_are_the_original_ones(tmp_path):
    """Without a process group nothing is wrapped: the exception raised is the one that happened."""
    with pytest.raises(tensorckpt.UnsupportedValueError, match="'bad'") as e:
        tensorckpt.save({"bad": object()}, tmp_path / "x")
    assert "rank" not in str(e.value)
    with pytest.raises(RuntimeError, match="injected: device lost"):
        tensorckpt.save({"x": torch.zeros(2).as_subclass(Exploding)}, tmp_path / "y")
    assert not (tmp_path / "y").exists()
