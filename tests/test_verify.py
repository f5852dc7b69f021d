"""Integrity: every flipped bit in a stored chunk is detected by every reader
(``read``, ``to_state_dict``, ``load``, ``verify``) and reported as a
CorruptCheckpointError naming the tensor and the chunk; ``tensorckpt.verify``
checks all metadata and every chunk in bounded memory."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch

import tensorckpt
from tensorckpt import CorruptCheckpointError
from tests.forge import reseal

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")

STATE = {
    "model": {
        "w": torch.arange(60, dtype=torch.float32).reshape(6, 10),  # edge chunks and edge inner chunks
        "b": torch.arange(7).to(torch.bfloat16),
        "z": torch.zeros(3, 4, dtype=torch.complex64),  # all fill value, stored anyway
    },
    "flags": torch.tensor([True, False, True, True, False]),
    "s": torch.tensor(-5, dtype=torch.int64),  # 0-d: its one chunk is "s/c"
    "step": 9,
}
TENSORS = {"model/w": STATE["model"]["w"], "model/b": STATE["model"]["b"], "model/z": STATE["model"]["z"],
           "flags": STATE["flags"], "s": STATE["s"]}
REGIONS = ["data", "chunk crc", "index", "index crc"]
BIT_FLIP_TRIALS = 60


def _save(path: Path) -> Path:
    tensorckpt.save(STATE, path, shard_bytes=48, inner_chunk_bytes=16)  # several chunks and inner chunks each
    return path


def _target() -> dict:
    return {"model": {k: torch.empty_like(v) for k, v in STATE["model"].items()},
            "flags": torch.empty(5, dtype=torch.bool), "s": torch.empty((), dtype=torch.int64), "step": None}


def _chunk_files(path: Path) -> list[tuple[str, Path]]:
    """(tensor key, chunk file) of every stored chunk."""
    out = []
    for key in TENSORS:
        top = path / key
        out += [(key, f) for f in sorted(top.rglob("*")) if f.is_file() and f.relative_to(top).parts[0] == "c"]
    return out


def _regions(data: bytes, n_inner: int) -> dict[str, list[int]]:
    """Byte positions of a shard by what they hold (spec section 7): inner
    chunk data and their CRC-32C, then the index and its CRC-32C."""
    index_at = len(data) - 16 * n_inner - 4
    out = {r: [] for r in REGIONS}
    out["index"] = list(range(index_at, len(data) - 4))
    out["index crc"] = list(range(len(data) - 4, len(data)))
    for i in range(n_inner):
        offset, nbytes = struct.unpack_from("<QQ", data, index_at + 16 * i)
        if offset != 2**64 - 1:  # not an empty (outside the array) inner chunk
            out["data"] += range(offset, offset + nbytes - 4)
            out["chunk crc"] += range(offset + nbytes - 4, offset + nbytes)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("verify") / "ckpt")


# ----------------------------------------------------------------- bit flips


def test_every_flipped_bit_is_detected(saved, tmp_path):
    """Random single-bit flips, equally often in chunk data, a chunk's CRC, the
    shard index and the index's CRC, in random chunks of every tensor: each one
    is reported by read, to_state_dict, load and verify, naming the chunk."""
    p = tmp_path / "ckpt"
    shutil.copytree(saved, p)
    index = tensorckpt.open(p).index.tensors
    files = _chunk_files(p)
    rng = random.Random(20261129)
    detected = {r: 0 for r in REGIONS}
    for trial in range(BIT_FLIP_TRIALS):
        region = REGIONS[trial % len(REGIONS)]
        key, f = rng.choice(files)
        e = index[key]
        original = f.read_bytes()
        at = rng.choice(_regions(original, math.prod(c // i for c, i in zip(e.chunk_shape, e.inner_chunk_shape)))[region])
        damaged = bytearray(original)
        damaged[at] ^= 1 << rng.randrange(8)
        f.write_bytes(bytes(damaged))
        checks = [lambda: tensorckpt.open(p).read(key), lambda: tensorckpt.open(p).to_state_dict(),
                  lambda: tensorckpt.load(_target(), p)]
        for check in checks:
            with pytest.raises(CorruptCheckpointError) as ei:
                check()
            assert repr(key) in str(ei.value) and str(f) in str(ei.value), (region, str(ei.value))
        problems = tensorckpt.verify(p).problems
        assert [x.where for x in problems] == [str(f)], (region, problems)
        detected[region] += 1
        f.write_bytes(original)
    assert sum(detected.values()) == BIT_FLIP_TRIALS and min(detected.values()) >= BIT_FLIP_TRIALS // 4
    assert tensorckpt.verify(p).ok  # everything restored


def test_error_names_chunk_position_and_inner_chunk(tmp_path):
    p = _save(tmp_path / "ckpt")
    f = p / "model" / "w" / "c" / "1" / "0"
    data = bytearray(f.read_bytes())
    data[0] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError) as ei:
        tensorckpt.open(p).read("model/w")
    msg = str(ei.value)
    assert msg.startswith(f"{f}: tensor 'model/w', chunk (1, 0), inner chunk (0, 0), fails its CRC-32C checksum")


@pytest.mark.regression(reason="fixed bug: checkpoint.py wait() reported a chunk shorter than its shard index "
                        "(TensorStore FAILED_PRECONDITION) as 'the array metadata does not match the checkpoint index'")
def test_truncated_chunk_is_named(tmp_path):
    p = _save(tmp_path / "ckpt")
    f = p / "model" / "w" / "c" / "0" / "0"
    f.write_bytes(f.read_bytes()[:3])
    with pytest.raises(CorruptCheckpointError) as ei:
        tensorckpt.open(p).read("model/w")
    assert str(ei.value).startswith(f"{f}: tensor 'model/w', chunk (0, 0)") and "zarr.json" not in str(ei.value)
    (problem,) = tensorckpt.verify(p).problems
    assert problem.where == str(f) and "truncated" in problem.message  # found by its size, without reading it


# ----------------------------------------------------------------- verify


def test_verify_good_checkpoint(saved):
    seen = []
    report = tensorckpt.verify(saved, progress=lambda done, total: seen.append((done, total)))
    assert report.ok and report.status == "ok" and report.problems == []
    assert report.tensors == len(TENSORS)
    assert report.chunks == len(_chunk_files(saved))
    total = sum(t.numel() * t.element_size() for t in TENSORS.values())
    assert report.bytes == total
    assert seen[-1] == (total, total) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert json.loads(json.dumps(report.to_json()))["ok"] is True


def test_verify_memory_url(mem_url):
    url = mem_url()
    _save(url)
    assert tensorckpt.verify(url).ok


def test_verify_reads_in_bounded_blocks(tmp_path):
    """A 16 MiB tensor in one chunk is read back in blocks of at most
    ``block_bytes``, a few at a time, never whole."""
    p = tmp_path / "big"
    t = torch.arange(4 << 20, dtype=torch.float32)
    tensorckpt.save({"t": t}, p, shard_bytes=32 << 20, inner_chunk_bytes=256 << 10)
    assert tensorckpt.open(p).info("t").chunk_shape == (4 << 20,)
    tracemalloc.start()
    try:
        report = tensorckpt.verify(p, block_bytes=512 << 10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.ok and report.bytes == 16 << 20 and report.chunks == 1
    assert peak < 4 << 20


def test_verify_missing_chunks(tmp_path):
    p = _save(tmp_path / "ckpt")
    for pos in ("1/0", "2/0"):
        (p / "model" / "w" / "c" / pos).unlink()
    (problem,) = tensorckpt.verify(p).problems
    assert problem.kind == "corrupt" and problem.where == str(p / "model" / "w" / "c" / "1" / "0")
    assert "2 of 6 chunks are missing: c/1/0, c/2/0" in problem.message


def test_verify_array_metadata_against_index(tmp_path):
    p = _save(tmp_path / "ckpt")
    f = p / "model" / "b" / "zarr.json"
    doc = json.loads(f.read_text())
    doc["codecs"][0]["configuration"]["codecs"] = doc["codecs"][0]["configuration"]["codecs"][:1]  # no crc32c
    f.write_text(json.dumps(doc))
    report = tensorckpt.verify(p)
    (problem,) = report.problems
    assert problem.where == str(f) and "codecs" in problem.message
    assert report.tensors == len(TENSORS) - 1  # its chunks were not read: they cannot be interpreted


def test_verify_accepts_what_zarr_lets_writers_omit(tmp_path):
    p = _save(tmp_path / "ckpt")
    f = p / "flags" / "zarr.json"  # 1-byte data type: the inner bytes codec needs no endian
    doc = json.loads(f.read_text())
    del doc["chunk_key_encoding"]["configuration"]
    cfg = doc["codecs"][0]["configuration"]
    del cfg["index_location"]
    cfg["codecs"][0] = {"name": "bytes"}
    doc["dimension_names"] = ["n"]
    doc["some_extension"] = {"must_understand": False, "x": 1}
    doc["attributes"]["other"] = 1
    f.write_text(json.dumps(doc))
    reseal(p)  # another writer's valid document: the root records its digest (format 1.3)
    assert tensorckpt.verify(p).ok
    assert torch.equal(tensorckpt.open(p).read("flags"), STATE["flags"])


@pytest.mark.parametrize("member", ["some_extension", "storage_transformers"])
def test_verify_rejects_what_must_be_understood(tmp_path, member):
    p = _save(tmp_path / "ckpt")
    f = p / "s" / "zarr.json"
    doc = json.loads(f.read_text())
    doc[member] = {"must_understand": True} if member == "some_extension" else [{"name": "x"}]
    f.write_text(json.dumps(doc))
    assert [x.where for x in tensorckpt.verify(p).problems] == [str(f)]
    with pytest.raises(CorruptCheckpointError, match=member):
        tensorckpt.open(p).read("s")


def test_verify_missing_group(tmp_path):
    p = _save(tmp_path / "ckpt")
    (p / "model" / "zarr.json").unlink()
    (problem,) = tensorckpt.verify(p).problems
    assert problem.where == str(p / "model" / "zarr.json") and "group" in problem.message


def test_verify_incomplete_and_corrupt_root(tmp_path):
    p = _save(tmp_path / "ckpt")
    root = (p / "zarr.json").read_bytes()
    (p / "zarr.json").write_bytes(root[:-5])
    report = tensorckpt.verify(p)
    assert report.status == "corrupt" and report.problems[0].where == str(p / "zarr.json")
    (p / "zarr.json").unlink()
    report = tensorckpt.verify(p)
    assert report.status == "incomplete" and "never committed" in report.problems[0].message


def test_verify_raises_when_nothing_to_verify(tmp_path):
    with pytest.raises(tensorckpt.CheckpointNotFoundError):
        tensorckpt.verify(tmp_path / "nope")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to switch to an unprivileged user")
def test_unreadable_chunk_is_permission_not_corruption():
    """A chunk this process may not read (EACCES) is reported as such by verify
    (kind "permission", status "unreadable") and raised as CheckpointPermissionError
    (a PermissionError) by load and read: not called corrupt."""
    import multiprocessing as mp

    import tempfile

    base = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's tmp_path is below a 0700 directory of root's
    try:
        _unreadable_chunk(base)
    finally:
        shutil.rmtree(base)


def _unreadable_chunk(base: Path) -> None:
    import multiprocessing as mp

    os.chmod(base, 0o755)
    p = base / "c"
    tensorckpt.save({"w": torch.randn(64, 64)}, p)
    for d in [*[x for x in p.rglob("*") if x.is_dir()], p]:
        os.chmod(d, 0o755)
    for f in (x for x in p.rglob("*") if x.is_file()):
        os.chmod(f, 0o644)
    os.chmod(p / "w" / "c" / "0" / "0", 0o000)
    q = mp.get_context("fork").Queue()
    proc = mp.get_context("fork").Process(target=_as_nobody, args=(str(p), q))
    proc.start()
    proc.join(60)
    got = q.get(timeout=5)
    assert got["verify"] == ("unreadable", ["permission"]), got
    assert got["load"][0] == "CheckpointPermissionError" and "permission denied" in got["load"][1], got
    assert got["read"][0] == "CheckpointPermissionError", got


def _as_nobody(path: str, q) -> None:
    os.setegid(65534)
    os.seteuid(65534)
    out = {}
    r = tensorckpt.verify(path)
    out["verify"] = (r.status, [x.kind for x in r.problems])
    for name, fn in (("load", lambda: tensorckpt.load({"w": torch.zeros(64, 64)}, path)),
                     ("read", lambda: tensorckpt.open(path).read("w"))):
        try:
            fn()
            out[name] = ("ok", "")
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = (type(e).__name__, str(e))
    q.put(out)
