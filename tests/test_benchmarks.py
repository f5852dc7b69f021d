"""The benchmark scripts run (tiny sizes): figures quoted in notes come from
them, so they must not rot. This checks they work and verify their loads, not
their speed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    "bench_single": ["--size-gib", "0.01", "--reps", "1", "--d-model", "64"],
    "bench_small": ["--tensors", "50", "--numel", "64", "--reps", "1", "--load-mib", "8"],
    "bench_dist": ["--size-gib", "0.03", "--reps", "1", "--no-dcp-best", "--settle-s", "0.05"],
    "bench_background": ["--size-gib", "0.01", "--reps", "1", "--baseline-s", "0.3", "--savers", "tensorckpt,dcp thread"],
    "bench_plan_scale": ["--ranks", "64", "128", "--layers", "2"],
    "bench_write_path": ["--size-gib", "0.02", "--reps", "1"],
    "bench_load_path": ["--size-gib", "0.02", "--reps", "1", "--procs", "2", "--rows"],
    "bench_durable": ["--small-kib", "4", "--large-mib", "2", "--reps", "1", "--large-reps", "1", "--many", "20", "--noise-mib", "16",
                      "--noise-warmup-s", "0.2"],
}

ROWS = {  # rows a script must print: the bounds notes quote
    "bench_dist": ["raw objects save", "raw objects load world 3", "(the object-count bound)",
                   "reshard bound: raw read world 3 / raw cold read"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_runs(name, tmp_path):
    args = [sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"), *CASES[name]]
    if name != "bench_plan_scale":
        args += ["--dir", str(tmp_path)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "FAIL" not in r.stdout
    for row in ROWS.get(name, []):
        assert row in r.stdout, (row, r.stdout[-3000:])


def test_bench_s3_runs_and_checks_its_loads(tmp_path):
    """bench_s3 (a moto server of its own, the proxy, DCP over s3fs and
    tensorckpt on s3://) prints every row, and each load reproduced the
    saved values bit for bit (the script exits non-zero otherwise)."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (the test extra)")
    pytest.importorskip("s3fs", reason="s3fs is not installed (the test extra)")
    out = tmp_path / "s3.json"
    args = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_s3.py"), "--size-mb", "1", "--d-model", "64",
            "--reps", "1", "--latency-ms", "0", "--no-dcp-best", "--json", str(out)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "FAIL" not in r.stdout
    for row in ("save world 2", "async stall", "load world 2", "load world 3 reshard", "bytes fetched / needed, world 3",
                "peak memory / target, world 3", "all 4 loads reproduced the saved values bit for bit"):
        assert row in r.stdout, (row, r.stdout[-3000:])
    import json

    run = json.loads(out.read_text())["runs"][0]
    assert set(run["rows"]["load world 3 reshard"]) == {"dcp", "tensorckpt"}
    assert run["fetched_over_needed"]["world 3"]["tensorckpt"] > 0


SCRIPT = os.path.join(ROOT, "benchmarks", "throttled_disk.sh")


@pytest.mark.skipif(os.environ.get("TENSORCKPT_FULL") != "1", reason="TENSORCKPT_FULL=1 (DCP's process executor: ~25 s)")
def test_bench_dist_with_dcp_best_settings(tmp_path):
    """bench_dist's DCP-at-its-best rows (tuned FileSystemWriter, cached
    plans, process executor + DefaultStager) run and check their loads."""
    args = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_dist.py"), "--size-gib", "0.03", "--reps", "1",
            "--dcp-threads", "1,2", "--dir", str(tmp_path)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "FAIL" not in r.stdout and "tensorckpt / dcp best" in r.stdout, r.stdout[-2000:]


def test_throttled_disk_usage():
    r = subprocess.run(["bash", SCRIPT], capture_output=True, text=True)
    assert r.returncode == 2 and "usage:" in r.stderr


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/sys/fs/cgroup/blkio/blkio.throttle.write_bps_device")
    or not os.path.exists("/dev/loop-control"),
    reason="needs root, loop devices and cgroup v1 blkio throttling",
)
def test_throttled_disk_limits_writes(tmp_path):
    """The emulated disk-bound machine really is bound: 64 MiB written and
    fsynced at a 100 MB/s limit take at least 0.5 s; ``down`` removes it."""
    import time

    where = str(tmp_path / "slow")
    up = subprocess.run(["bash", SCRIPT, "up", where, "1000", "100"], capture_output=True, text=True, timeout=120)
    try:
        if up.returncode != 0 and "losetup" in up.stderr:
            pytest.skip(f"no loop device here: {up.stderr.strip()[-200:]}")
        assert up.returncode == 0, up.stderr
        t = time.perf_counter()
        with open(os.path.join(where, "f"), "wb") as f:
            f.write(os.urandom(64 << 20))
            f.flush()
            os.fsync(f.fileno())
        assert time.perf_counter() - t > 0.5
    finally:
        down = subprocess.run(["bash", SCRIPT, "down", where], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not os.path.ismount(where)


def test_gpu_check_skips_without_cuda_and_its_checks_run_on_cpu(tmp_path):
    """benchmarks/gpu_check.py exits 0 saying it skipped where there is no
    CUDA, and its checks (round trips, mutation after async_save, pool reuse)
    pass when run on CPU tensors, so the script works the day a GPU runs it."""
    import torch

    script = os.path.join(ROOT, "benchmarks", "gpu_check.py")
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 0 and "skipped: no CUDA device" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, script, "--cpu", "--size-mib", "4", "--saves", "4", "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "FAIL" not in r.stdout and r.stdout.count("ok   ") == 4, r.stdout
