"""A load from S3 (the moto server of the session, conftest.py) and from
memory:// holds, beyond its preallocated target, about its in-flight read
budget and one allocator arena's worth of freed reads, not one per reading
thread (storage/kvobjects.py: every read's bytes are made by one thread and
freed before the next read's are made). Measured in a fresh process, VmHWM
reset through /proc/self/clear_refs, with glibc's own malloc settings: its
dynamic mmap threshold, which kept each of the eight reading threads' freed
runs in that thread's arena, is what this checks (the first large load of a
process: 129-134 MiB of growth on s3 and 102 on memory:// for this 66 MiB
target before, 52-81 and 28-50 after, on a busy 2-core machine). About 30 s.
A load from local files (the direct reader) is checked against issue 17's
bound: peak memory within 1.2x its target."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import rss

from tensorckpt.storage import kvobjects

_TESTS = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20

_MEASURE = rss.PEAK + r"""
import json, sys
import torch, tensorckpt
url = sys.argv[1]
g = torch.Generator().manual_seed(0)
# 66 MiB: 12 tensors of 2-12 MiB, bf16 and fp32, one object each (whole runs and short last ones)
state = {f"w{i}": torch.randn(6144 // (i % 3 + 1), 512, generator=g) for i in range(12)}
state = {k: (v.bfloat16() if i % 2 else v) for i, (k, v) in enumerate(state.items())}
tensorckpt.save(state, url)
tensorckpt.save({"w": torch.ones(64, 64)}, url + "-warm")
tensorckpt.load({"w": torch.empty(64, 64)}, url + "-warm")  # one-time costs first (imports, connections)
target = {k: torch.zeros_like(v) for k, v in state.items()}
size = sum(t.numel() * t.element_size() for t in target.values())
growth = []
for _ in range(2):
    for t in target.values():
        t.zero_()
    reset_peak()
    base = status("VmRSS")
    tensorckpt.load(target, url)
    growth.append(status("VmHWM") - base)
    if not all(torch.equal(target[k], v) for k, v in state.items()):
        raise SystemExit("FAIL: the load differs")
print(json.dumps({"size": size, "growth": growth}))
"""


@pytest.fixture(params=["s3", "memory"])
def url(request, mem_url) -> str:
    return request.getfixturevalue("s3")("memory-bound") if request.param == "s3" else mem_url("memory-bound")


@pytest.mark.timeout(240)
def test_a_load_holds_its_read_budget_and_one_arena_beyond_its_target(url):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))},
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(_TESTS), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _MEASURE, url], env=env, capture_output=True,
                         text=True, timeout=200, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    size, growth = got["size"], max(got["growth"])
    print(f"load of {size / MiB:.0f} MiB from {url.split(':')[0]}: peak RSS growth "
          + ", ".join(f"{g / MiB:.1f}" for g in got["growth"]) + " MiB")
    # the budget of reads in flight, the maker thread's arena (glibc keeps a run or two of freed blocks
    # there) and, on s3, TensorStore's HTTP buffers and its threads' arenas (measured: 52-81 MiB on s3,
    # 28-50 on memory://); an arena per reading thread was 129-134 and 102
    slack = (72 if url.startswith("s3://") else 40) * MiB
    assert growth < kvobjects.IN_FLIGHT_BYTES + slack, (growth / MiB, size / MiB)


@pytest.mark.timeout(240)
def test_a_local_load_peaks_within_a_fifth_of_its_target_beyond_it(tmp_path):
    """Issue 17 item 6 on local files (the direct reader): a load's peak RSS
    beyond its preallocated target stays under 0.2x the target (load peak
    <= 1.2x the target state). What it holds: one reused buffer per reading
    thread (direct.THREADS x direct.BUFFER_BYTES, 8 MiB), made by the first
    load (measured 9.3 MiB first, 0.2-1.0 MiB after, for this 66 MiB target)."""
    from tensorckpt.storage import direct

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(_TESTS),
                                                                      os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / "memory-bound")], env=env,
                         capture_output=True, text=True, timeout=200, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    size, growth = got["size"], max(got["growth"])
    print(f"local load of {size / MiB:.0f} MiB: peak RSS growth " + ", ".join(f"{g / MiB:.1f}" for g in got["growth"]))
    assert growth < 0.2 * size, (growth / MiB, size / MiB)
    assert growth < direct.THREADS * direct.BUFFER_BYTES + 4 * MiB, (growth / MiB, direct.THREADS)
