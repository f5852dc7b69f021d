"""Faults and bad input on S3, through the public API, against the moto
server of the session (conftest.py) behind the fault and latency proxy
(tests/s3proxy.py): the server killed in the middle of a save (sync, async,
under a CheckpointManager; distributed: tests/test_s3_dist.py), transient
and persistent 503 / 500 / dropped / cut responses, wrong credentials, a
missing bucket, a malformed URL and an endpoint that does not answer, and
hostile objects on S3. Every test is bounded in time; a failed save never
commits anything, and a load under faults is bit-exact or fails clearly."""

from __future__ import annotations

import os
import sys
import threading
import time
import types

import pytest
import torch

import tensorckpt
from tensorckpt import TensorckptError

sys.path.insert(0, os.path.dirname(__file__))
from s3proxy import Faults, S3Proxy
from s3server import BUCKET

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")
# TENSORCKPT_S3_TIMEOUT in these tests: a request to a dead server fails after this, or after the retries
# (location.S3_RETRIES, ~7 s), whichever comes first
TIMEOUT_S = "2"


def _keys(moto, url: str) -> list[str]:
    """Every object under ``url``, listed with boto3 (not through tensorckpt)."""
    prefix = url.removeprefix(f"s3://{BUCKET}/") + "/"
    pages = moto.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"][len(prefix):] for p in pages for o in p.get("Contents", []))


def _state(k: float = 1.0, n: int = 24) -> dict:
    """Many small tensors (many PUTs: a kill lands in the middle), bfloat16 among them."""
    g = torch.Generator().manual_seed(int(k * 1000))
    sd: dict = {f"t{i}": torch.randn(64, 48, generator=g) * k for i in range(n)}
    sd["h"] = (torch.randn(40, 30, generator=g) * k).to(torch.bfloat16)
    sd["step"] = int(k)
    return sd


def _empty(n: int = 24) -> dict:
    return {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in _state(1.0, n).items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@pytest.fixture
def proxied(moto, s3, monkeypatch):
    """(proxy, s3 URL factory): every S3 request of the test goes through the proxy."""
    with S3Proxy(moto.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        monkeypatch.setenv("TENSORCKPT_S3_TIMEOUT", TIMEOUT_S)
        yield proxy, s3


@pytest.fixture
def fast_retries(monkeypatch):
    """The retries of location.S3_RETRIES, 8x faster (~1 s in all), for the
    tests of what happens once they are spent; test_endpoint_refusing_connections
    keeps the real bound."""
    from tensorckpt.storage import location

    monkeypatch.setattr(location, "S3_RETRIES", {"max_retries": 5, "initial_delay": "0.025s", "max_delay": "0.5s"})


def kill_after(proxy: S3Proxy, puts: int) -> threading.Thread:
    """Kill the server (the proxy) once ``puts`` more PUT requests have passed."""
    start = proxy.requests["PUT"]

    def watch() -> None:
        deadline = time.monotonic() + 60
        while proxy.requests["PUT"] < start + puts and time.monotonic() < deadline:
            time.sleep(0.001)
        proxy.kill()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _uncommitted(moto, url: str) -> None:
    """Nothing was committed at ``url``: no root zarr.json (listed with boto3)."""
    assert "zarr.json" not in _keys(moto, url)


# ---------------------------------------------------------------- the server killed mid-save


@pytest.mark.timeout(60)
def test_server_killed_mid_save(proxied, moto):  # real retries, outlasting the timeout: pending writes cancelled
    proxy, s3 = proxied
    url = s3()
    kill_after(proxy, 8)
    t = time.monotonic()
    with pytest.raises(TensorckptError) as e:
        tensorckpt.save(_state(), url)
    assert time.monotonic() - t < 30
    assert url in str(e.value) and "writ" in str(e.value)  # the URL and the operation
    proxy.revive()
    left = _keys(moto, url)
    time.sleep(4)  # within the retries of its writes still pending when it failed: they were cancelled
    assert _keys(moto, url) == left  # ... so none lands later (in a checkpoint saved there since)
    _uncommitted(moto, url)
    with pytest.raises(tensorckpt.IncompleteCheckpointError):
        tensorckpt.open(url)
    _clean_removes_leftovers(moto, url)
    tensorckpt.save(_state(2.0), url)  # the location is usable again
    assert _equal(tensorckpt.load(_empty(), url), _state(2.0))


OLDER_THAN = 2.0  # seconds: the small grace of these tests


def _clean_removes_leftovers(moto, url: str) -> None:
    """S3 keeps no modification times tensorckpt can read, but the save
    stamped its claim (or staging marker) with its time: the leftovers are
    kept while younger than ``older_than``, saying so, and go once older."""
    if not _keys(moto, url) and not tensorckpt.clean(url).leftovers:
        return  # the save's own abort removed everything
    report = tensorckpt.clean(url)  # the default grace (an hour)
    assert report.leftovers and not any(x.removed for x in report.leftovers)
    assert all(x.age is not None and "a save may still be writing it" in x.reason for x in report.leftovers)
    youngest = min(x.age for x in report.leftovers if x.age is not None)
    report = tensorckpt.clean(url, older_than=youngest + 30)  # a small grace, not yet passed
    assert not any(x.removed for x in report.leftovers) and _keys(moto, url)
    time.sleep(max(0.0, OLDER_THAN - youngest) + 0.2)
    report = tensorckpt.clean(url, older_than=OLDER_THAN)
    assert report.leftovers and all(x.removed for x in report.leftovers), report.leftovers
    assert _keys(moto, url) == [] and not tensorckpt.clean(url, older_than=0).leftovers


def _later(monkeypatch, seconds: float) -> None:
    """The clock the save stamps and clean reads (tensorckpt.storage.commit_kv)
    moved ``seconds`` ahead, as if that much time had passed."""
    from tensorckpt.storage import commit_kv

    real = time.time
    monkeypatch.setattr(commit_kv, "time", types.SimpleNamespace(time=lambda: real() + seconds))


@pytest.mark.timeout(60)
def test_server_killed_mid_async_save(proxied, moto, fast_retries):
    proxy, s3 = proxied
    url = s3()
    kill_after(proxy, 8)
    h = tensorckpt.async_save(_state(), url)
    with pytest.raises(TensorckptError) as e:
        h.wait(40)
    assert url in str(e.value) and "writ" in str(e.value)
    proxy.revive()
    _uncommitted(moto, url)
    _clean_removes_leftovers(moto, url)


@pytest.mark.timeout(60)
def test_server_killed_mid_replace(proxied, moto, monkeypatch, fast_retries):
    """A replace cut off: the old checkpoint loads as it was; the staging
    prefix the replace left carries its stamp, so clean keeps it while young
    and removes it once older than the grace, leaving the old one intact."""
    proxy, s3 = proxied
    url = s3()
    tensorckpt.save(_state(1.0), url)
    kill_after(proxy, 8)
    with pytest.raises(TensorckptError) as e:
        tensorckpt.save(_state(2.0), url, overwrite=True)
    assert ".ckpt.tensorckpt-staging-" in str(e.value)  # where it was writing (the staging prefix)
    proxy.revive()
    assert _equal(tensorckpt.load(_empty(), url), _state(1.0))
    (x,) = tensorckpt.clean(url, older_than=OLDER_THAN + 30).leftovers
    assert ".tensorckpt-staging-" in x.path and not x.removed and x.age is not None
    assert "a save may still be writing it" in x.reason
    _later(monkeypatch, OLDER_THAN + 30)
    (x,) = tensorckpt.clean(url, older_than=OLDER_THAN + 30).leftovers
    assert x.removed and not tensorckpt.clean(url, older_than=0).leftovers
    assert _equal(tensorckpt.load(_empty(), url), _state(1.0))


@pytest.mark.timeout(90)
def test_server_killed_mid_save_under_a_manager(proxied, moto, monkeypatch, fast_retries):
    proxy, s3 = proxied
    root = s3("run")
    grace = 60.0
    mgr = tensorckpt.CheckpointManager(root, keep_last=1, reader_grace=0, grace=grace)
    mgr.save(1, _state(1.0))
    kill_after(proxy, 8)
    with pytest.raises(TensorckptError) as e:
        mgr.save(2, _state(2.0))
    assert mgr.step_path(2) in str(e.value)
    proxy.revive()
    _uncommitted(moto, mgr.step_path(2))
    again = tensorckpt.CheckpointManager(root, keep_last=1, reader_grace=0, grace=grace)  # a restarted job
    assert again.latest() == 1
    out = _empty()
    assert again.restore(out) == 1 and _equal(out, _state(1.0))  # the previous step, bit-exact
    again.save(3, _state(3.0))  # retires step 1; step 2's leftovers are younger than the grace: kept
    names = {k.split("/", 1)[0] for k in _keys(moto, root)}
    assert names == {"step-00000002", "step-00000003"}, names
    _later(monkeypatch, grace)  # the grace passes
    again.save(4, _state(4.0))  # its retention now removes step 2's leftovers and retires step 3
    names = {k.split("/", 1)[0] for k in _keys(moto, root)}
    assert names == {"step-00000004"}, names
    assert _equal(tensorckpt.load(_empty(), again.step_path(4)), _state(4.0))


@pytest.mark.timeout(60)
def test_a_save_in_progress_is_kept_by_its_refreshed_stamp(proxied, moto, monkeypatch):
    """A save held up mid-way (the writes of one tensor answered 503 SlowDown
    four times: retried with backoff, about 3 s) runs for longer than the
    grace of a concurrent clean: its stamp, refreshed while it runs, keeps it
    young, so clean never removes any of it, and it commits whole."""
    from tensorckpt.storage import commit_kv

    proxy, s3 = proxied
    grace = 1.0
    monkeypatch.setenv("TENSORCKPT_S3_TIMEOUT", "20")
    monkeypatch.setattr(commit_kv, "REFRESH_SECONDS", 0.1)
    proxy.faults = Faults(rate=1.0, kinds=("503",), methods=("PUT",), path="/t3/", limit=4)
    url, sd = s3(), _state(n=8)
    failed: list[BaseException] = []

    def save() -> None:
        try:
            tensorckpt.save(sd, url)
        except BaseException as e:  # reported below
            failed.append(e)

    saver = threading.Thread(target=save)
    saver.start()
    seen = []  # (monotonic time, the ages clean found)
    while saver.is_alive():
        report = tensorckpt.clean(url, older_than=grace)
        seen.append((time.monotonic(), [x.age for x in report.leftovers]))
        assert not any(x.removed for x in report.leftovers), report.leftovers
        time.sleep(0.05)
    saver.join()
    assert not failed, failed
    young = [t for t, ages in seen if ages and all(a is not None for a in ages)]
    assert young and young[-1] - young[0] > grace + 1, seen  # clean ran on it for longer than the grace
    assert proxy.faults.injected["503"] == 4
    assert _equal(tensorckpt.load(_empty(8), url), sd)


# ---------------------------------------------------------------- slow and failing responses

TRANSIENT = ("503", "500", "drop", "cut")  # "cut": half a response body, then the connection closes


@pytest.mark.timeout(60)
def test_transient_faults_and_latency_are_retried(proxied, moto):
    """A fraction of the requests fail (each kind, on writes and reads) and
    every request is slowed down: retried within location.S3_RETRIES, the
    save commits and the load is bit-exact."""
    proxy, s3 = proxied
    url, sd = s3(), _state(n=12)
    proxy.latency_s = 0.01
    proxy.faults = Faults(rate=0.3, kinds=TRANSIENT[:3], methods=("PUT",), limit=6, seed=3)  # a PUT has no body to cut
    tensorckpt.save(sd, url)
    assert sum(proxy.faults.injected.values()) >= 3
    proxy.faults = Faults(rate=0.3, kinds=TRANSIENT, methods=("GET",), limit=6, seed=4)
    assert _equal(tensorckpt.load(_empty(12), url), sd)
    assert sum(proxy.faults.injected.values()) >= 3
    assert tensorckpt.verify(url).ok


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,path", [("503", "/t5/"), ("500", "ckpt/zarr.json")], ids=["a-tensor", "the-root"])
def test_persistent_write_faults_fail_the_save_and_commit_nothing(proxied, moto, monkeypatch, fast_retries, kind,
                                                                   path):
    """Every write of one tensor (or of the root zarr.json: the commit) fails:
    the save ends in a clear error once the retries are spent, commits
    nothing, and its abort removes what it wrote."""
    proxy, s3 = proxied
    monkeypatch.setenv("TENSORCKPT_S3_TIMEOUT", "20")  # longer than the retries: their error is the one seen
    url = s3()
    proxy.faults = Faults(rate=1.0, kinds=(kind,), methods=("PUT",), path=path)
    t = time.monotonic()
    with pytest.raises(TensorckptError) as e:
        tensorckpt.save(_state(n=12), url)
    assert time.monotonic() - t < 30
    assert url in str(e.value) and ("SlowDown" if kind == "503" else "InternalError") in str(e.value)
    assert "retry attempts failed" in str(e.value)
    assert _keys(moto, url) == []  # no partial commit, and nothing left behind
    proxy.faults = Faults()
    tensorckpt.save(_state(2.0, n=12), url)
    assert _equal(tensorckpt.load(_empty(12), url), _state(2.0, n=12))


@pytest.mark.timeout(60)
def test_persistent_read_faults_fail_the_load_clearly(proxied, monkeypatch, fast_retries):
    proxy, s3 = proxied
    monkeypatch.setenv("TENSORCKPT_S3_TIMEOUT", "20")
    url = s3()
    tensorckpt.save(_state(n=12), url)
    proxy.faults = Faults(rate=1.0, kinds=("cut",), methods=("GET",), path="/t7/c")
    target = _empty(12)
    t = time.monotonic()
    with pytest.raises(TensorckptError) as e:
        tensorckpt.load(target, url)
    assert time.monotonic() - t < 30
    assert url in str(e.value) and "t7" in str(e.value) and "partial" in str(e.value)
    proxy.faults = Faults()
    assert _equal(tensorckpt.load(target, url), _state(n=12))  # the same target, bit-exact once it heals


# ---------------------------------------------------------------- bad input, before any data is written

_ALLOW_ALL = '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}'


@pytest.fixture(scope="module")
def authed():
    """A moto server of its own that checks signatures (moto's
    INITIAL_NO_AUTH_ACTION_COUNT: the first requests, which make an IAM user
    with an allow-all policy and its key, are the only unauthenticated
    ones); yields (server, access key id, secret, boto3 S3 client)."""
    import boto3
    from s3server import MotoServer

    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "4"  # read by the server process at its start
    try:
        server = MotoServer().start()
    finally:
        del os.environ["INITIAL_NO_AUTH_ACTION_COUNT"]
    try:
        iam = boto3.client("iam", endpoint_url=server.endpoint, region_name="us-east-1",
                           aws_access_key_id="x", aws_secret_access_key="x")
        iam.create_user(UserName="ckpt")
        iam.put_user_policy(UserName="ckpt", PolicyName="all", PolicyDocument=_ALLOW_ALL)
        key = iam.create_access_key(UserName="ckpt")["AccessKey"]
        client = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                              aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"])
        client.create_bucket(Bucket=BUCKET)
        yield server, key["AccessKeyId"], key["SecretAccessKey"], client
    finally:
        server.stop()


_WRONG_KEY_CALLS = """
import json, sys, torch, tensorckpt
good, bad, out = sys.argv[1:4]
calls = [lambda: tensorckpt.save({"w": torch.ones(3)}, bad), lambda: tensorckpt.open(good),
         lambda: tensorckpt.load({"w": torch.zeros(3)}, good)]
msgs = []
for call in calls:
    try:
        call()
        msgs.append("no error")
    except tensorckpt.TensorckptError as e:
        msgs.append(str(e))
json.dump(msgs, open(out, "w"))
"""


@pytest.mark.timeout(60)
def test_wrong_credentials(authed, s3, monkeypatch, tmp_path):
    """A server that checks signatures refuses a wrong secret and an unknown
    key id (403): a clear error naming the URL, the endpoint and what to set,
    and nothing written. The wrong keys are used in processes of their own
    (both at once): TensorStore keeps the credentials it read in its
    context, for the process (a process that changes its keys midway is
    not covered)."""
    import json
    import subprocess

    server, key_id, secret, client = authed
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    good, bad = s3("good"), s3("bad")
    tensorckpt.save({"w": torch.ones(3)}, good)  # the right key works: the server really checks them
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    wrong = {"secret": {**env, "AWS_SECRET_ACCESS_KEY": "not-" + secret},
             "key id": {**env, "AWS_ACCESS_KEY_ID": "AKIANOSUCHKEY0000000"}}
    procs = {w: subprocess.Popen([sys.executable, "-c", _WRONG_KEY_CALLS, good, bad, str(tmp_path / w)], env=e)
             for w, e in wrong.items()}
    for w, p in procs.items():
        assert p.wait(50) == 0, w
        for msg, url in zip(json.loads((tmp_path / w).read_text()), (bad, good, good)):
            assert url in msg and "access denied" in msg and server.endpoint in msg and "AWS_SECRET_ACCESS_KEY" in msg, (w, msg)
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=bad.removeprefix(f"s3://{BUCKET}/"))
    assert listed.get("KeyCount", 0) == 0  # nothing was written


@pytest.mark.timeout(30)
def test_missing_bucket_writes_nothing(proxied, moto):
    proxy, _ = proxied
    url = f"s3://no-such-bucket-{os.getpid()}/run/ckpt"
    with pytest.raises(TensorckptError) as e:
        tensorckpt.save(_state(n=2), url)
    msg = str(e.value)
    assert url in msg and "does not exist" in msg and proxy.endpoint in msg and "create it" in msg
    assert proxy.requests["PUT"] == 0  # refused at its first request, a listing: no object, no bucket made
    assert f"no-such-bucket-{os.getpid()}" not in {b["Name"] for b in moto.client().list_buckets()["Buckets"]}


@pytest.mark.timeout(30)
def test_malformed_urls_send_nothing(proxied):
    proxy, _ = proxied
    for url in ("s3://", "s3://Bad_Bucket/c", "s3://bkt", "s3://bkt/a/../b", "s3://bkt/c?versionId=1"):
        for call in (lambda: tensorckpt.save({"w": torch.ones(3)}, url), lambda: tensorckpt.open(url),
                     lambda: tensorckpt.CheckpointManager(url), lambda: tensorckpt.clean(url)):
            with pytest.raises(tensorckpt.InvalidPathError, match="s3://bucket/prefix/name"):
                call()
    assert sum(proxy.requests.values()) == 0  # refused before any request


@pytest.mark.timeout(30)
def test_endpoint_refusing_connections(s3, monkeypatch):
    from s3server import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    url = s3()
    t = time.monotonic()
    with pytest.raises(TensorckptError) as e:
        tensorckpt.save(_state(n=2), url)
    assert time.monotonic() - t < 20  # the retries' bound (~7 s), not the timeout
    msg = str(e.value)
    assert url in msg and "cannot connect" in msg and endpoint in msg and "AWS_ENDPOINT_URL_S3" in msg, msg


# ---------------------------------------------------------------- hostile objects on S3

_HOSTILE_READS = """
import sys, torch, tensorckpt
from tensorckpt.errors import CorruptCheckpointError
for url, key, n in ((sys.argv[1], "w", 8), (sys.argv[2], "big", 64 * 64)):
    for name, f in [("read", lambda: tensorckpt.open(url).read(key)),
                    ("load", lambda: tensorckpt.load({key: torch.zeros(n)}, url)),
                    ("to_state_dict", lambda: tensorckpt.open(url).to_state_dict())]:
        try:
            f()
            print(name, "ACCEPTED")
        except CorruptCheckpointError as e:
            print(name, "refused", "a reader accepts (spec 12)" in str(e) or "more than its inner chunks" in str(e))
    print("verify", tensorckpt.verify(url).ok)
"""


def _forge_s3(moto, url: str, key: str, entry, scratch) -> None:
    """Make the root index and the array zarr.json on S3 agree on ``entry``
    (tests/test_hostile.py's _forge, resealed as format 1.3 requires: the
    checkpoint is copied to ``scratch``, forged there and its documents put back)."""
    import json

    from forge import reseal

    from tensorckpt.storage import arrays

    client, prefix = moto.client(), url.removeprefix(f"s3://{BUCKET}/")
    for k in _keys(moto, url):
        (scratch / k).parent.mkdir(parents=True, exist_ok=True)
        (scratch / k).write_bytes(client.get_object(Bucket=BUCKET, Key=f"{prefix}/{k}")["Body"].read())
    root = json.loads((scratch / "zarr.json").read_bytes())
    root["attributes"]["tensorckpt"]["tensors"][key] = entry.to_json()
    (scratch / key / "zarr.json").write_bytes(arrays.zarr_json(entry))
    reseal(scratch, root)
    for k in ("zarr.json", f"{key}/zarr.json"):
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{k}", Body=(scratch / k).read_bytes())


@pytest.mark.timeout(90)
def test_hostile_objects_are_refused_before_they_are_fetched(proxied, moto, tmp_path):
    """A forged 1 TiB inner chunk (root and array metadata agree) and a chunk
    object far larger than its index allows: read, load, to_state_dict and
    verify refuse both by the sizes S3 gives, without fetching the object or
    allocating what the metadata claims (run in a child process: an abort in
    TensorStore must fail this test, not end the test run)."""
    import subprocess

    from tensorckpt.format.metadata import TensorEntry

    proxy, s3 = proxied
    forged, planted = s3("forged"), s3("planted")
    tensorckpt.save({"w": torch.ones(8)}, forged)
    _forge_s3(moto, forged, "w", TensorEntry("float32", (8,), (2**38,), (2**38,)), tmp_path)
    tensorckpt.save({"big": torch.randn(64 * 64)}, planted)
    (chunk,) = [k for k in _keys(moto, planted) if k.startswith("big/c/")]
    moto.client().put_object(Bucket=BUCKET, Key=f"{planted.removeprefix(f's3://{BUCKET}/')}/{chunk}",
                             Body=os.urandom(8 << 20))  # 8 MiB where at most ~16 KiB can be
    proxy.reset_counts()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", _HOSTILE_READS, forged, planted], env=env, capture_output=True,
                       text=True, timeout=80, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["read", "refused", "True", "load", "refused", "True", "to_state_dict", "refused",
                                "True", "verify", "False"] * 2, r.stdout
    assert proxy.bytes_out < 1 << 20  # the 8 MiB object was never fetched (verify included)
