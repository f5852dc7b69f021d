"""Reads on S3 (the moto server of the session, conftest.py) and memory://
go through tensorckpt's own codec (storage/kvobjects.py over direct.py), so
what tests/test_integrity.py and tests/test_hostile_readers.py check locally
holds there too: a format 1.3 chunk swapped with another of the same shape or
replayed from an older checkpoint (every CRC-32C intact) fails its digest,
overlapping shard-index entries are refused, a forged 1 TiB inner chunk is
refused without allocating; each by ``load`` and ``open().read()``, naming
tensor and chunk. A same-layout load asks no object's size first (fewer
requests, counted by tests/s3proxy.py)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap

import google_crc32c
import numpy as np
import pytest
import torch

import tensorckpt
from tensorckpt.errors import CorruptCheckpointError
from tensorckpt.storage import kv, location

sys.path.insert(0, os.path.dirname(__file__))
from s3proxy import S3Proxy

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")

SHAPE = (64, 40)
OPTIONS = {"shard_bytes": 16 * 40 * 4, "inner_chunk_bytes": 4 * 40 * 4}  # 4 chunks per tensor, 4 inner chunks each
N, ENCODED = 4, 4 * 40 * 4 + 4  # inner chunks per object, bytes of one encoded inner chunk


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"a": torch.randn(SHAPE, generator=g), "b": torch.randn(SHAPE, generator=g)}, "step": seed}


def _target() -> dict:
    return {"model": {"a": torch.empty(SHAPE), "b": torch.empty(SHAPE)}, "step": 0}


@pytest.fixture(params=["s3", "memory"])
def store(request, mem_url):
    """A factory of fresh URLs on S3 or memory://."""
    return request.getfixturevalue("s3") if request.param == "s3" else mem_url


def _get(url: str, key: str) -> bytes:
    data = kv.read(location.parse(url), key)
    assert data is not None, key
    return data


def _put(url: str, key: str, data: bytes) -> None:
    kv.write(location.parse(url), key, data)


def _refused(url: str, match: str) -> None:
    """load and open().read() (whole, and the damaged chunk's rows) refuse it, naming tensor and chunk."""
    readers = [
        ("load", lambda: tensorckpt.load(_target(), url)),
        ("read", lambda: tensorckpt.open(url).read("model/a")),
        ("read rows", lambda: tensorckpt.open(url).read("model/a", (slice(16, 32),))),
    ]
    for name, f in readers:
        with pytest.raises(CorruptCheckpointError, match=match):
            f()
            pytest.fail(f"{name} accepted it")


@pytest.fixture
def ckpt(store) -> str:
    url = store("ck")
    tensorckpt.save(_state(0), url, **OPTIONS)
    assert tensorckpt.open(url).index.tensors["model/a"].chunk_shape == (16, 40)
    return url


def test_chunks_swapped_between_two_tensors_fail_their_digest(ckpt):
    a, b = _get(ckpt, "model/a/c/1/0"), _get(ckpt, "model/b/c/1/0")
    _put(ckpt, "model/a/c/1/0", b)
    _put(ckpt, "model/b/c/1/0", a)
    _refused(ckpt, r"model/a/c/1/0: tensor 'model/a', chunk \(1, 0\), does not have the digest its array records")


def test_a_chunk_replayed_from_an_older_checkpoint_fails_its_digest(store, ckpt):
    older = store("older")
    tensorckpt.save(_state(1), older, **OPTIONS)  # an earlier step: same layout, other data
    _put(ckpt, "model/a/c/1/0", _get(older, "model/a/c/1/0"))
    _refused(ckpt, r"tensor 'model/a', chunk \(1, 0\), does not have the digest its array records")


def test_a_chunk_replayed_with_the_same_data_is_read(store, ckpt):
    again = store("again")
    tensorckpt.save(_state(0), again, **OPTIONS)  # the same data again: the same digest, harmless
    _put(ckpt, "model/a/c/1/0", _get(again, "model/a/c/1/0"))
    assert torch.equal(tensorckpt.load(_target(), ckpt)["model"]["a"], _state(0)["model"]["a"])


@pytest.mark.parametrize("kind", ["same bytes", "half overlapping"])
def test_overlapping_index_entries_are_refused(ckpt, kind):
    data = _get(ckpt, "model/a/c/1/0")
    entries = np.frombuffer(data[-(16 * N + 4):-4], "<u8").reshape(N, 2).copy()
    if kind == "same bytes":
        entries[1] = entries[0]
    else:
        entries[1, 0] = entries[0, 0] + ENCODED // 2
    raw = entries.astype("<u8").tobytes()
    _put(ckpt, "model/a/c/1/0", data[:-(16 * N + 4)] + raw + struct.pack("<I", google_crc32c.value(raw)))
    _refused(ckpt, r"model/a/c/1/0: tensor 'model/a', chunk \(1, 0\), inner chunks \(\d, \d\) and \(\d, \d\), "
                   r"are malformed \(damaged or forged\): their index entries .* overlap")


@pytest.mark.parametrize("order", [[3, 2, 1, 0], [1, 0, 3, 2]])
def test_an_object_laid_out_by_another_writer_is_read(ckpt, order):
    """Another writer may order an object's inner chunks otherwise (its
    index says where each is): the one-request read at the reference
    writer's size gives way to the index, and the data is exact."""
    data = _get(ckpt, "model/a/c/1/0")
    entries = np.frombuffer(data[-(16 * N + 4):-4], "<u8").reshape(N, 2).copy()
    chunks = [data[int(o):int(o) + ENCODED] for o, _ in entries]
    body = b"".join(chunks[k] for k in order)  # inner chunk order[j] stored j-th
    for j, k in enumerate(order):
        entries[k, 0] = j * ENCODED
    raw = entries.astype("<u8").tobytes()
    _put(ckpt, "model/a/c/1/0", body + raw + struct.pack("<I", google_crc32c.value(raw)))
    assert torch.equal(tensorckpt.load(_target(), ckpt)["model"]["a"], _state(0)["model"]["a"])
    assert torch.equal(tensorckpt.open(ckpt).read("model/a"), _state(0)["model"]["a"])


def test_a_truncated_chunk_and_a_missing_one_are_named(ckpt):
    data = _get(ckpt, "model/a/c/1/0")
    _put(ckpt, "model/a/c/1/0", data[ENCODED:])  # the index intact, the data it points at cut short
    _refused(ckpt, r"tensor 'model/a', chunk \(1, 0\), (inner chunk \(\d, \d\), fails its CRC-32C|is malformed)")
    kv.delete(location.parse(ckpt), "model/a/c/1/0")
    _refused(ckpt, r"model/a/c/1/0: tensor 'model/a', chunk \(1, 0\), is missing")


_FORGED = textwrap.dedent("""
    import json, sys, torch, tensorckpt
    sys.path.insert(0, sys.argv[2])
    from forge import reseal
    from tensorckpt.errors import CorruptCheckpointError
    from tensorckpt.format.metadata import TensorEntry
    from tensorckpt.storage import arrays, kv, location
    from pathlib import Path
    url, scratch = sys.argv[1], Path(sys.argv[3])
    tensorckpt.save({"w": torch.ones(8)}, url)
    loc = location.parse(url)
    for k in kv.list_keys(loc):  # forged where forge.py can: a local copy, resealed, its documents put back
        (scratch / k).parent.mkdir(parents=True, exist_ok=True)
        (scratch / k).write_bytes(kv.read(loc, k))
    entry = TensorEntry("float32", (8,), (2**38,), (2**38,))  # a 1 TiB inner chunk; root and array agree
    root = json.loads((scratch / "zarr.json").read_bytes())
    root["attributes"]["tensorckpt"]["tensors"]["w"] = entry.to_json()
    (scratch / "w/zarr.json").write_bytes(arrays.zarr_json(entry))
    reseal(scratch, root)
    for k in ("zarr.json", "w/zarr.json"):
        kv.write(loc, k, (scratch / k).read_bytes())
    for name, f in [("load", lambda: tensorckpt.load({"w": torch.zeros(8)}, url)),
                    ("read", lambda: tensorckpt.open(url).read("w"))]:
        try:
            f()
            print(name, "ACCEPTED")
        except CorruptCheckpointError as e:
            print(name, "refused", "'w'" in str(e) and "a reader accepts (spec 12)" in str(e))  # refused at the root
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["s3", "memory"])
def test_a_forged_huge_inner_chunk_is_refused(where, request, tmp_path):
    """Refused when the root is validated (spec 12's caps), before any chunk
    I/O. In a child process: an abort in TensorStore must fail this test,
    not end the run."""
    url = request.getfixturevalue("s3")("forged") if where == "s3" else "memory://forged/ck"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", _FORGED, url, os.path.dirname(__file__), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=100, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["load", "refused", "True", "read", "refused", "True"], r.stdout + r.stderr[-2000:]


@pytest.mark.timeout(120)
def test_a_same_layout_load_asks_no_sizes(moto, s3, monkeypatch):
    """Per chunk object of at most WHOLE_READ_BYTES that the load needs
    whole: one request for its data and index (at the size the writer gave
    it); no size probe before (as TensorStore's reads needed: one request
    more per object); a part of one: its index (a suffix range), then its
    data; bit-exact."""
    with S3Proxy(moto.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        url = s3()
        g = torch.Generator().manual_seed(0)
        state = {f"t{i}": torch.randn(256, 64, generator=g) for i in range(12)}
        tensorckpt.save(state, url)
        target = {k: torch.empty_like(v) for k, v in state.items()}
        proxy.reset_counts()
        tensorckpt.load(target, url)
        assert all(torch.equal(target[k], v) for k, v in state.items())
        objects = len(state)  # one chunk object each
        # the root (read, then compared after the reads), each array's zarr.json, one per chunk object
        # (index first: two per object; through TensorStore, with a listing and a size probe per object first: 52)
        assert dict(proxy.requests) == {"GET": 2 + objects + objects}, proxy.requests
        proxy.reset_counts()
        c = tensorckpt.open(url)
        assert torch.equal(c.read("t3", (slice(100, 200),)), state["t3"][100:200])
        assert dict(proxy.requests) == {"GET": 1 + 1 + 2 + 1}, proxy.requests  # root, zarr.json, index + data, root


@pytest.mark.timeout(60)
def test_damage_in_every_object_fails_without_holding_the_read_budget(mem_url, monkeypatch):
    """Reads that stop at a refused inner chunk give back their share of the
    reader's in-flight budget at once: with room for one read in flight in
    all, a load of many damaged objects fails (it hung when a failed read's
    share stayed with its traceback)."""
    from tensorckpt.storage import kvobjects

    monkeypatch.setattr(kvobjects, "IN_FLIGHT_BYTES", 1)  # one read in flight, all threads together
    url = mem_url()
    state = {f"t{i}": torch.full((32, 16), float(i)) for i in range(16)}
    tensorckpt.save(state, url)
    for k in state:
        data = bytearray(_get(url, f"{k}/c/0/0"))
        data[10] ^= 1  # an element of the first inner chunk: its CRC-32C fails
        _put(url, f"{k}/c/0/0", bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"tensor 't\d+', chunk \(0, 0\), inner chunk .* fails its CRC-32C"):
        tensorckpt.load({k: torch.empty_like(v) for k, v in state.items()}, url)
