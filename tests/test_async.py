"""async_save in one process: what is saved is the state at the call, the
handle's contract, backpressure, failures, buffer reuse, interpreter exit,
and the per-phase statistics kept with the checkpoint."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import tensorckpt
from tests.forge import reseal
from tensorckpt.cli import main as cli_main


def _state(n: int = 64):
    torch.manual_seed(0)
    return {
        "model": {"w": torch.randn(n, n), "b": torch.randn(n).to(torch.bfloat16), "ids": torch.arange(7)},
        "step": 3,
        "cfg": {"lr": 0.1, "betas": [0.9, 0.99]},
    }


def _clone(state):
    return {k: _clone(v) if isinstance(v, dict) else (v.clone() if isinstance(v, torch.Tensor) else json.loads(json.dumps(v))) for k, v in state.items()}


def _assert_saved(path, expected):
    got = tensorckpt.open(path).to_state_dict()
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        if isinstance(v, dict):
            _assert_saved_tree(got[k], v)
        elif isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def _assert_saved_tree(got, expected):
    for k, v in expected.items():
        if isinstance(v, dict):
            _assert_saved_tree(got[k], v)
        elif isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def test_saves_the_state_as_it_was_at_the_call(tmp_path):
    state = _state()
    before = _clone(state)
    h = tensorckpt.async_save(state, tmp_path / "c")
    # the training loop goes on at once: tensors and data change in place
    state["model"]["w"].add_(1.0)
    state["model"]["b"].zero_()
    state["cfg"]["betas"].append(0.5)
    state["step"] = 4
    h.wait()
    assert h.done() and h.exception() is None
    _assert_saved(tmp_path / "c", before)


def test_handle_reports_durability_stats_and_callbacks(tmp_path):
    durable, done = [], []
    h = tensorckpt.async_save(_state(), tmp_path / "c", on_durable=durable.append)
    h.add_done_callback(done.append)
    h.wait(timeout=60)
    assert durable == [h] and done == [h]
    late = []
    h.add_done_callback(late.append)  # after the end: called at once
    assert late == [h]
    s = h.stats
    assert 0 < s.stall_seconds <= s.durable_seconds
    assert set(s.seconds) == {"plan", "stage", "write", "sync", "commit"}
    assert s.bytes_staged == s.bytes_written == 64 * 64 * 4 + 64 * 2 + 7 * 8
    assert "committed" in repr(h)


def test_wait_times_out_while_in_flight_and_on_busy_raise(tmp_path):
    release = threading.Event()
    h = tensorckpt.async_save(_state(), tmp_path / "a", on_durable=lambda _: release.wait(30))
    with pytest.raises(TimeoutError, match="still running"):
        h.wait(timeout=0.05)
    assert not h.done()
    with pytest.raises(tensorckpt.TensorckptError, match="still in flight"):
        tensorckpt.async_save(_state(), tmp_path / "b", on_busy="raise")
    assert not (tmp_path / "b").exists()
    release.set()
    h.wait()


def test_second_save_waits_for_the_first(tmp_path):
    release = threading.Event()
    first = tensorckpt.async_save(_state(), tmp_path / "a", on_durable=lambda _: release.wait(30))
    threading.Timer(0.2, release.set).start()
    second = tensorckpt.async_save(_state(), tmp_path / "b")  # blocks until the first is done
    assert first.done()
    second.wait()
    assert tensorckpt.open(tmp_path / "a").keys() == tensorckpt.open(tmp_path / "b").keys()


def test_background_failure_surfaces_on_handle_and_next_call(tmp_path):
    tensorckpt.save({"x": torch.ones(2)}, tmp_path / "c")
    h = tensorckpt.async_save(_state(), tmp_path / "c")  # exists, no overwrite: fails in the background
    while not h.done():
        concurrent.futures.wait([h.future], 0.01)  # wait without looking at the outcome
    with pytest.raises(tensorckpt.TensorckptError, match="previous async save .* failed") as info:
        tensorckpt.async_save(_state(), tmp_path / "d")
    assert isinstance(info.value.__cause__, tensorckpt.CheckpointExistsError)
    assert isinstance(h.exception(), tensorckpt.CheckpointExistsError)
    with pytest.raises(tensorckpt.CheckpointExistsError):
        h.wait()
    assert torch.equal(tensorckpt.open(tmp_path / "c").read("x"), torch.ones(2))  # previous one intact
    tensorckpt.async_save(_state(), tmp_path / "d").wait()  # reported once; the next save works


def test_observed_failure_is_not_raised_again(tmp_path):
    tensorckpt.save({"x": torch.ones(2)}, tmp_path / "c")
    h = tensorckpt.async_save(_state(), tmp_path / "c")
    with pytest.raises(tensorckpt.CheckpointExistsError):
        h.wait()
    tensorckpt.async_save(_state(), tmp_path / "d").wait()


def test_invalid_state_raises_at_the_call(tmp_path):
    with pytest.raises(tensorckpt.UnsupportedValueError, match="'bad'"):
        tensorckpt.async_save({"bad": object()}, tmp_path / "c")
    with pytest.raises(TypeError, match="unknown options"):
        tensorckpt.async_save({}, tmp_path / "c", bogus=1)
    with pytest.raises(ValueError, match="on_busy"):
        tensorckpt.async_save({}, tmp_path / "c", on_busy="never")
    assert not (tmp_path / "c").exists()


def test_staging_buffers_are_reused_across_20_saves(tmp_path):
    """The thread executor's pool: a buffer per key (the process executor's
    arena: tests/test_offload.py)."""
    state = {"w": torch.randn(512, 512), "v": torch.randn(1000)}
    allocated = []
    for i in range(20):
        state["w"].add_(1)
        h = tensorckpt.async_save(state, tmp_path / f"c{i}", executor="thread")
        h.wait()
        allocated.append(h.stats.staging_bytes_allocated)
        if i in (0, 9, 19):
            assert torch.equal(tensorckpt.open(tmp_path / f"c{i}").read("w"), state["w"])
    assert allocated[0] == (512 * 512 + 1000) * 4
    assert allocated[1:] == [0] * 19
    # a changed shape reallocates that buffer only; a dropped key frees its buffer
    state["v"] = torch.randn(10)
    h = tensorckpt.async_save(state, tmp_path / "d", executor="thread")
    h.wait()
    assert h.stats.staging_bytes_allocated == 40


def test_exit_finishes_a_save_in_flight(tmp_path):
    script = textwrap.dedent(f"""
        import torch, tensorckpt
        tensorckpt.async_save({{"w": torch.arange(100000.0)}}, {str(tmp_path / "c")!r})
        # no wait(): the interpreter exits at once
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert torch.equal(tensorckpt.open(tmp_path / "c").read("w"), torch.arange(100000.0))


def test_exit_reports_a_failure_nobody_saw(tmp_path):
    tensorckpt.save({"x": torch.ones(2)}, tmp_path / "c")
    script = textwrap.dedent(f"""
        import torch, tensorckpt
        tensorckpt.async_save({{"w": torch.ones(3)}}, {str(tmp_path / "c")!r})
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "async save to" in r.stderr and "failed" in r.stderr and "exists" in r.stderr


def test_save_stats_are_kept_with_the_checkpoint(tmp_path):
    stats = tensorckpt.SaveStats()
    tensorckpt.save(_state(), tmp_path / "c", stats=stats)
    doc = json.loads((tmp_path / "c" / "zarr.json").read_bytes())["attributes"]["tensorckpt"]["save_stats"]
    assert doc["bytes_written"] == [stats.bytes_written]
    for phase in ("plan", "stage", "write", "sync"):
        assert doc["seconds"][phase] == [pytest.approx(stats.seconds[phase], abs=1e-5)]
    meta = tensorckpt.open(tmp_path / "c").metadata
    assert meta.save_stats["bytes_written"] == [stats.bytes_written]


def test_load_stats_phases(tmp_path):
    tensorckpt.save(_state(), tmp_path / "c")
    stats = tensorckpt.LoadStats()
    target = _state()
    target["model"]["w"] = torch.zeros(64, 64, requires_grad=True)  # cannot be read into directly: copied
    tensorckpt.load(target, tmp_path / "c", stats=stats)
    assert set(stats.seconds) == {"plan", "read", "copy"} and min(stats.seconds.values()) >= 0
    assert stats.bytes_needed == 64 * 64 * 4 + 64 * 2 + 7 * 8


@pytest.mark.parametrize(
    "bad",
    [[], {"seconds": {"write": [1.0, 2.0]}}, {"seconds": {"write": [-1]}}, {"bytes_written": ["x"]}, {"seconds": []}],
)
def test_malformed_save_stats_is_corrupt(tmp_path, bad):
    tensorckpt.save({"w": torch.ones(2)}, tmp_path / "c")
    p = tmp_path / "c" / "zarr.json"
    doc = json.loads(p.read_bytes())
    doc["attributes"]["tensorckpt"]["save_stats"] = bad
    p.write_text(json.dumps(doc))
    with pytest.raises(tensorckpt.CorruptCheckpointError, match="save_stats"):
        tensorckpt.open(tmp_path / "c")


def test_unknown_phases_are_ignored(tmp_path):
    tensorckpt.save({"w": torch.ones(2)}, tmp_path / "c")
    p = tmp_path / "c" / "zarr.json"
    doc = json.loads(p.read_bytes())
    doc["attributes"]["tensorckpt"]["save_stats"]["seconds"]["future_phase"] = [0.5]
    doc["attributes"]["tensorckpt"]["save_stats"]["future_member"] = {"x": 1}
    reseal(tmp_path / "c", doc)  # a later writer's root, sealed (format 1.3)
    assert torch.equal(tensorckpt.open(tmp_path / "c").read("w"), torch.ones(2))


def test_load_with_a_small_read_window(tmp_path, monkeypatch):
    """Reads are issued ahead only up to IN_FLIGHT_BYTES; buffered targets are
    copied as their reads finish. A tiny window must give the same result."""
    import tensorckpt.engine.load as load_mod

    torch.manual_seed(1)
    state = {f"t{i}": torch.randn(64, 33) for i in range(12)}
    tensorckpt.save(state, tmp_path / "c")
    monkeypatch.setattr(load_mod, "IN_FLIGHT_BYTES", 1000)
    target = {k: torch.zeros(64, 33, requires_grad=(i % 3 == 0)) for i, k in enumerate(state)}
    stats = tensorckpt.LoadStats()
    tensorckpt.load(target, tmp_path / "c", stats=stats)
    for k, v in state.items():
        assert torch.equal(target[k].detach(), v), k
    assert stats.seconds["copy"] > 0


def test_async_saver_owns_its_staging_pool_and_plan_cache(tmp_path):
    state = {"w": torch.randn(32, 32), "step": 1}
    with tensorckpt.AsyncSaver() as saver:
        first = saver.save(state, tmp_path / "a")
        second = saver.save(state, tmp_path / "b")  # waits for the first (one in flight per saver)
        saver.wait()
        assert first.done() and second.done()
        assert first.stats.staging_bytes_allocated == 32 * 32 * 4 and second.stats.staging_bytes_allocated == 0
        assert not first.stats.plan_cache_hit and second.stats.plan_cache_hit
        with tensorckpt.AsyncSaver() as other:  # a saver of its own: its own buffers and cache
            third = other.save(state, tmp_path / "c")
            third.wait()
        assert third.stats.staging_bytes_allocated == 32 * 32 * 4 and not third.stats.plan_cache_hit
    with pytest.raises(tensorckpt.TensorckptError, match="closed"):
        saver.save(state, tmp_path / "d")
    saver.close()  # again: nothing to do
    for name in "abc":
        assert torch.equal(tensorckpt.open(tmp_path / name).read("w"), state["w"])


def test_closing_an_async_saver_finishes_the_save_and_raises_a_failure_nobody_saw(tmp_path):
    saver = tensorckpt.AsyncSaver()
    saver.save({"w": torch.arange(100000.0)}, tmp_path / "a")
    saver.close()  # no wait(): close finishes it
    assert torch.equal(tensorckpt.open(tmp_path / "a").read("w"), torch.arange(100000.0))

    saver = tensorckpt.AsyncSaver()
    saver.save({"x": torch.ones(2)}, tmp_path / "a")  # exists, no overwrite: fails in the background
    with pytest.raises(tensorckpt.TensorckptError, match="async save to .* failed") as info:
        saver.close()
    assert isinstance(info.value.__cause__, tensorckpt.CheckpointExistsError)

    saver = tensorckpt.AsyncSaver()
    h = saver.save({"x": torch.ones(2)}, tmp_path / "a")
    with pytest.raises(tensorckpt.CheckpointExistsError):
        saver.wait()
    assert isinstance(h.exception(), tensorckpt.CheckpointExistsError)
    saver.close()  # already seen: not raised again


def test_a_with_block_leaving_on_an_exception_keeps_it_and_prints_the_save_failure(tmp_path, capsys):
    tensorckpt.save({"x": torch.ones(2)}, tmp_path / "a")
    with pytest.raises(KeyError, match="training failed"):
        with tensorckpt.AsyncSaver() as saver:
            saver.save({"x": torch.ones(2)}, tmp_path / "a")
            raise KeyError("training failed")
    err = capsys.readouterr().err
    assert "async save to" in err and "failed" in err and "exists" in err


def test_handle_future_is_a_concurrent_future(tmp_path):
    release = threading.Event()
    h = tensorckpt.async_save(_state(), tmp_path / "a", on_durable=lambda _: release.wait(30))
    assert not h.future.cancel()  # running from the start
    done, _ = concurrent.futures.wait([h.future], timeout=0.05)
    assert not done
    release.set()
    done, _ = concurrent.futures.wait([h.future], timeout=60)
    assert done == {h.future} and h.future.result() is None and h.done()
    h.wait()
