"""Async saves whose stored objects a helper process writes
(``executor="process"``, storage/offload.py): the same bytes as the thread
executor's, staging that the caller may overwrite at once, the shared arena
reused, and every way the helper can fail: killed mid-save, killed between
saves, a write error in it, the training process dying under it."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import tensorckpt

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create (Linux)")


def _state(step: int = 0) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(700, 500, generator=g),  # edge inner chunks in both dimensions
        "bf": torch.randn(512, 640, generator=g).to(torch.bfloat16),
        "h": torch.randn(300, 300, generator=g).to(torch.float16),
        "i": torch.randint(-(2**40), 2**40, (400, 100), generator=g),
        "c": torch.randn(200, 300, generator=g, dtype=torch.complex128),
        "b": torch.rand(1000, 700, generator=g) > 0.5,
        "f8": torch.randn(800, 500, generator=g).to(torch.float8_e4m3fn),
        "small": torch.arange(10) + step,
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(2.5 + step),
        "step": step,
    }


def _chunk_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "/c/" in str(p.relative_to(root)) + "/"}


def _equal(a: dict, b: dict) -> bool:
    """Bit for bit (float8 and bfloat16 compared as bytes)."""
    for k, v in a.items():
        if not isinstance(v, torch.Tensor):
            if v != b[k]:
                return False
            continue
        x, y = v, b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.numel() and x.dim():
            x, y = x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)
        if not torch.equal(x, y):
            return False
    return True


def test_same_bytes_as_the_thread_executor_and_bit_exact(tmp_path):
    state = _state()
    tensorckpt.save(state, tmp_path / "sync")
    with tensorckpt.AsyncSaver(executor="process") as saver:
        h = saver.save(state, tmp_path / "proc")
        h.wait()
    assert h.stats.bytes_offloaded > 4 << 20  # the large tensors went to the helper
    assert h.stats.bytes_offloaded < h.stats.bytes_written  # the small ones did not
    assert _chunk_files(tmp_path / "proc") == _chunk_files(tmp_path / "sync")
    assert tensorckpt.verify(tmp_path / "proc").ok  # digests (spec 7.1) the helper computed included
    assert _equal(state, tensorckpt.open(tmp_path / "proc").to_state_dict())


def test_the_caller_may_change_its_tensors_at_once_and_buffers_are_reused(tmp_path):
    state = _state(1)
    want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    with tensorckpt.AsyncSaver(executor="process") as saver:
        h1 = saver.save(state, tmp_path / "a")
        state["w"].fill_(-1)  # before the helper has written it
        state["i"].zero_()
        h2 = saver.save(state, tmp_path / "b")  # waits for the first: the same arena, reused
        h2.wait()
        state["extra"] = torch.ones(600, 600)  # another layout: a new arena
        h3 = saver.save(state, tmp_path / "c")
        h3.wait()
    assert _equal(want, tensorckpt.open(tmp_path / "a").to_state_dict())
    assert torch.equal(tensorckpt.open(tmp_path / "b").read("w"), torch.full((700, 500), -1.0))
    assert torch.equal(tensorckpt.open(tmp_path / "c").read("extra"), torch.ones(600, 600))
    assert h1.stats.staging_bytes_allocated > 0 and h2.stats.staging_bytes_allocated == 0
    assert h3.stats.staging_bytes_allocated > h1.stats.staging_bytes_allocated
    assert h2.stats.bytes_offloaded > 0 and h3.stats.bytes_offloaded > h2.stats.bytes_offloaded


def test_the_executor_argument_and_its_environment_variable(tmp_path, monkeypatch):
    state = {"w": torch.randn(600, 600)}
    monkeypatch.delenv("TENSORCKPT_ASYNC_EXECUTOR", raising=False)
    h = tensorckpt.async_save(state, tmp_path / "x")  # the default on Linux: the helper writes it
    h.wait()
    assert h.stats.bytes_offloaded == 600 * 600 * 4
    h = tensorckpt.async_save(state, tmp_path / "y", executor="thread")  # the thread executor's default saver
    h.wait()
    assert h.stats.bytes_offloaded == 0
    monkeypatch.setenv("TENSORCKPT_ASYNC_EXECUTOR", "thread")
    with tensorckpt.AsyncSaver() as saver:
        assert saver.executor == "thread"
        h = saver.save(state, tmp_path / "z")
    assert h.stats.bytes_offloaded == 0
    monkeypatch.setenv("TENSORCKPT_ASYNC_EXECUTOR", "threads")
    with pytest.raises(ValueError, match="TENSORCKPT_ASYNC_EXECUTOR"):
        tensorckpt.async_save(state, tmp_path / "w")
    with pytest.raises(ValueError, match="executor"):
        tensorckpt.async_save(state, tmp_path / "w", executor="processes")
    with pytest.raises(ValueError, match="executor"):
        tensorckpt.AsyncSaver(executor="gpu")
    assert not (tmp_path / "w").exists()


def test_a_helper_killed_mid_save_fails_that_save_only(tmp_path):
    state = {"w": torch.randn(1024, 1024), "v": torch.randn(512, 1024)}
    with tensorckpt.AsyncSaver(executor="process") as saver:
        saver.save(state, tmp_path / "ckpt").wait()
        pid = saver._offload.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # it takes the next save's writes and does none of them
        try:
            h = saver.save({k: v + 1 for k, v in state.items()}, tmp_path / "ckpt", overwrite=True)
            time.sleep(0.3)
        finally:
            os.kill(pid, signal.SIGKILL)
        err = h.exception(timeout=60)
        assert isinstance(err, tensorckpt.TensorckptError)
        assert "helper process" in str(err) and str(pid) in str(err) and "signal 9" in str(err)
        assert torch.equal(tensorckpt.open(tmp_path / "ckpt").read("w"), state["w"])  # the old one, whole
        h = saver.save(state, tmp_path / "next")  # a new helper, a new arena
        h.wait()
        assert saver._offload.pid not in (None, pid)
        assert h.stats.bytes_offloaded == (1024 + 512) * 1024 * 4
    assert torch.equal(tensorckpt.open(tmp_path / "next").read("v"), state["v"])


def test_a_helper_killed_between_saves_is_replaced(tmp_path):
    state = {"w": torch.randn(800, 800)}
    with tensorckpt.AsyncSaver(executor="process") as saver:
        saver.save(state, tmp_path / "a").wait()
        pid = saver._offload.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while saver._offload.pid == pid and time.monotonic() < deadline:
            time.sleep(0.05)  # its end is noticed by the thread reading its answers
        h = saver.save(state, tmp_path / "b")
        h.wait()
        assert h.stats.bytes_offloaded == 800 * 800 * 4 and h.stats.staging_bytes_allocated > 0
    assert torch.equal(tensorckpt.open(tmp_path / "b").read("w"), state["w"])


def test_a_write_error_in_the_helper_is_raised_with_its_path(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # the helper inherits it: files of 1 MiB at most
    try:
        saver = tensorckpt.AsyncSaver(executor="process")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    with saver:
        h = saver.save({"w": torch.randn(1024, 1024)}, tmp_path / "big")  # one 4 MiB object
        err = h.exception(timeout=60)
        assert isinstance(err, tensorckpt.TensorckptError)
        assert "'w'" in str(err) and "File too large" in str(err) and "w/c/0/0" in str(err)
        assert not (tmp_path / "big").exists()
        h = saver.save({"w": torch.randn(400, 400)}, tmp_path / "fits")  # the helper lives on
        h.wait()
        assert h.stats.bytes_offloaded == 400 * 400 * 4


def test_the_helper_exits_with_the_training_process(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys, time, torch, tensorckpt
        saver = tensorckpt.AsyncSaver(executor="process")
        saver.save({{"w": torch.randn(600, 600)}}, {str(tmp_path / "x")!r}).wait()
        print(saver._offload.pid, flush=True)
        time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        helper = int(p.stdout.readline())
        os.kill(helper, 0)  # running
        p.kill()
        p.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(helper, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(helper, signal.SIGKILL)
            pytest.fail("the helper outlived the training process")
    finally:
        p.kill()
        p.wait()


def test_a_forked_child_has_no_helper_and_the_parents_lives_on(tmp_path):
    """A data loader worker forked from the training process: its copy of
    the saver has no helper (it closed its copy of the socket), and the
    parent's helper keeps writing for the parent after the child exits."""
    state = {"w": torch.randn(600, 600)}
    with tensorckpt.AsyncSaver(executor="process") as saver:
        saver.save(state, tmp_path / "before").wait()
        helper = saver._offload.pid
        pid = os.fork()
        if pid == 0:
            os._exit(0 if saver._offload.pid is None else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        h = saver.save(state, tmp_path / "after")
        h.wait()
        assert saver._offload.pid == helper and h.stats.bytes_offloaded == 600 * 600 * 4
    assert torch.equal(tensorckpt.open(tmp_path / "after").read("w"), state["w"])


def test_a_path_saved_again_after_it_was_deleted(tmp_path):
    import shutil

    state = {"w": torch.randn(600, 600)}
    with tensorckpt.AsyncSaver(executor="process") as saver:
        for step in range(2):  # the helper keeps no directories of an earlier save
            state["w"].add_(step)
            saver.save(state, tmp_path / "x").wait()
            assert torch.equal(tensorckpt.open(tmp_path / "x").read("w"), state["w"])
            shutil.rmtree(tmp_path / "x")
