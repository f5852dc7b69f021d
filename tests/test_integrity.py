"""Position- and version-bound integrity (format 1.3, spec/format-v1.md 7.1 and
9.8): every stored object is intact by its CRC-32Cs in each case below, yet in
the wrong place or from another checkpoint, so before 1.3 it loaded wrong data
and ``verify`` said OK. Now ``verify`` names the tensor and the chunk, ``load``
(which reads whole objects in the same layout) fails, and a flipped bit
anywhere in the root document fails ``open``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import tensorckpt
from tensorckpt.errors import CorruptCheckpointError
from tensorckpt.storage import codec

SHAPE = (64, 40)
OPTIONS = {"shard_bytes": 16 * 40 * 4, "inner_chunk_bytes": 4 * 40 * 4}  # 4 chunks per tensor, 4 inner chunks each


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"a": torch.randn(SHAPE, generator=g), "b": torch.randn(SHAPE, generator=g)},
        "optim": {"lr": 0.001, "step": 1234},
        "sampler": {"epoch": 3, "position": 987654},
    }


def _target() -> dict:
    return {"model": {"a": torch.empty(SHAPE), "b": torch.empty(SHAPE)},
            "optim": {"lr": 0.0, "step": 0}, "sampler": {"epoch": 0, "position": 0}}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    tensorckpt.save(_state(0), path, **OPTIONS)
    assert tensorckpt.verify(path).ok
    return path


def _swap(x: Path, y: Path) -> None:
    a, b = x.read_bytes(), y.read_bytes()
    x.write_bytes(b)
    y.write_bytes(a)


def _fails(path: Path, *where: tuple[str, tuple[int, ...]]) -> None:
    """verify reports exactly these (tensor, chunk) places; load fails naming one of them."""
    report = tensorckpt.verify(path)
    assert report.status == "corrupt"
    named = sorted(p.where for p in report.problems)
    assert named == sorted(f"{path}/{k}/c/{'/'.join(map(str, pos))}" for k, pos in where), report.problems
    for p in report.problems:
        assert "does not have the digest its array records" in p.message and "tensor '" in p.message
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'model/[ab]', chunk \(\d, 0\), does not have the digest"):
        tensorckpt.load(_target(), path)


def test_chunks_swapped_between_two_tensors_of_one_shape(ckpt):
    _swap(ckpt / "model/a/c/1/0", ckpt / "model/b/c/1/0")
    _fails(ckpt, ("model/a", (1, 0)), ("model/b", (1, 0)))


def test_two_chunks_of_one_tensor_swapped(ckpt):
    _swap(ckpt / "model/a/c/0/0", ckpt / "model/a/c/3/0")
    _fails(ckpt, ("model/a", (0, 0)), ("model/a", (3, 0)))


def test_two_inner_chunks_of_one_shard_swapped(ckpt):
    obj = ckpt / "model/b/c/2/0"
    data = bytearray(obj.read_bytes())
    n = 4 * 40 * 4 + 4  # one encoded inner chunk: its elements, then its CRC-32C
    data[0:n], data[2 * n:3 * n] = data[2 * n:3 * n], data[0:n]  # every CRC-32C, and the index's, still intact
    obj.write_bytes(bytes(data))
    _fails(ckpt, ("model/b", (2, 0)))


def test_a_chunk_replayed_from_an_older_checkpoint_of_the_run(tmp_path, ckpt):
    older = tmp_path / "older"
    tensorckpt.save(_state(1), older, **OPTIONS)  # an earlier step: same layout, other data
    shutil.copyfile(older / "model/a/c/2/0", ckpt / "model/a/c/2/0")
    _fails(ckpt, ("model/a", (2, 0)))


def test_a_replayed_chunk_with_the_same_data_is_harmless(tmp_path, ckpt):
    again = tmp_path / "again"
    tensorckpt.save(_state(0), again, **OPTIONS)
    shutil.copyfile(again / "model/a/c/2/0", ckpt / "model/a/c/2/0")
    assert tensorckpt.verify(ckpt).ok  # the digest is of the content: equal data, equal digest


def test_two_whole_array_directories_swapped(ckpt):
    tmp = ckpt / "model/tmp"
    (ckpt / "model/a").rename(tmp)
    (ckpt / "model/b").rename(ckpt / "model/a")
    tmp.rename(ckpt / "model/b")
    report = tensorckpt.verify(ckpt)
    assert sorted(p.where for p in report.problems) == [f"{ckpt}/model/a/zarr.json", f"{ckpt}/model/b/zarr.json"]
    assert all("not the one this checkpoint's root records" in p.message for p in report.problems)
    with pytest.raises(CorruptCheckpointError, match=r"model/a/zarr.json: tensor 'model/a': its array metadata is not"):
        tensorckpt.load(_target(), ckpt)
    with pytest.raises(CorruptCheckpointError, match="not the one this checkpoint's root records"):
        tensorckpt.open(ckpt).read("model/b", (slice(0, 1),))


def test_an_array_directory_from_another_checkpoint(tmp_path, ckpt):
    other = tmp_path / "other"
    tensorckpt.save(_state(0), other, **OPTIONS)  # the same data: only the checkpoint differs
    shutil.rmtree(ckpt / "model/a")
    shutil.copytree(other / "model/a", ckpt / "model/a")
    report = tensorckpt.verify(ckpt)
    assert [p.where for p in report.problems] == [f"{ckpt}/model/a/zarr.json"]


def _flips(raw: bytes, lo: int, hi: int) -> list[bytes]:
    return [raw[:i] + bytes([raw[i] ^ (1 << b)]) + raw[i + 1:] for i in range(lo, hi) for b in range(8)]


def test_every_single_bit_flip_in_the_root_values_fails_open(ckpt):
    """Before 1.3, 102 of 552 such flips silently changed a value (lr 0.001 -> 1.001)."""
    raw = (ckpt / "zarr.json").read_bytes()
    lo = raw.index(b'"values": {')
    hi = raw.index(b"}", raw.index(b'"sampler/position"')) + 1
    good = raw
    opened = 0
    for flipped in _flips(raw, lo, hi):
        (ckpt / "zarr.json").write_bytes(flipped)
        try:
            tensorckpt.open(ckpt).close()
        except CorruptCheckpointError:
            continue
        opened += 1
    assert opened == 0
    (ckpt / "zarr.json").write_bytes(good)
    assert tensorckpt.open(ckpt).read("optim/lr") == 0.001


def test_every_single_bit_flip_anywhere_in_the_root_is_refused(ckpt):
    """Each flip of the whole root document (envelope, index, version, the
    checksum itself) makes it unreadable or fails its checksum: none parses
    as a checkpoint with other content."""
    from tensorckpt.checkpoint import parse_root_bytes
    from tensorckpt.storage import location

    loc = location.parse(ckpt)
    raw = (ckpt / "zarr.json").read_bytes()
    accepted = []
    for i, flipped in enumerate(_flips(raw, 0, len(raw))):
        try:
            parse_root_bytes(loc, flipped)
        except tensorckpt.TensorckptError:
            continue
        accepted.append(i)
    assert accepted == []


def test_a_flip_that_lowers_the_format_version_is_still_caught(ckpt):
    raw = (ckpt / "zarr.json").read_bytes()
    (ckpt / "zarr.json").write_bytes(raw.replace(b'"format_version": "1.3"', b'"format_version": "1.2"'))
    with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
        tensorckpt.open(ckpt)


def test_a_partial_read_relies_on_the_inner_chunk_crc(ckpt):
    """A read of part of an object does not see all of it, so it cannot check
    its digest (spec 7.1): the CRC-32C of each inner chunk read is its check."""
    _swap(ckpt / "model/a/c/1/0", ckpt / "model/b/c/1/0")
    part = tensorckpt.open(ckpt).read("model/a", (slice(16, 20),))
    assert torch.equal(part, _state(0)["model"]["b"][16:20])  # in the wrong place, intact
    with pytest.raises(CorruptCheckpointError, match="does not have the digest"):
        tensorckpt.open(ckpt).read("model/a", (slice(16, 32),))  # the whole object


def test_digests_of_objects_tensorstore_writes_are_the_direct_writers(tmp_path):
    """memory:// is written through TensorStore, which encodes itself; the
    digests computed from the same elements (codec.chunk_digest) agree with
    the local writer's, and verify there catches a swap too."""
    state = _state(0)
    local = tmp_path / "local"
    tensorckpt.save(state, local, **OPTIONS)
    url = "memory://integrity/ck"
    tensorckpt.save(state, url, **OPTIONS)
    ck = tensorckpt.open(url)
    for key in ("model/a", "model/b"):
        assert ck.chunk_digests(key) == tensorckpt.open(local).chunk_digests(key)
    assert tensorckpt.verify(url).ok
    from tensorckpt.storage import kv, location

    loc = location.parse(url)
    a, b = kv.read(loc, "model/a/c/0/0"), kv.read(loc, "model/a/c/1/0")
    kv.write(loc, "model/a/c/0/0", b)
    kv.write(loc, "model/a/c/1/0", a)
    report = tensorckpt.verify(url)
    assert sorted(p.where for p in report.problems) == [f"{url}/model/a/c/0/0", f"{url}/model/a/c/1/0"]


def test_the_digest_is_over_the_stored_crcs_in_inner_grid_order(ckpt):
    """spec 7.1's definition, from the bytes alone."""
    e = tensorckpt.open(ckpt).index.tensors["model/a"]
    g = codec.geometry(e)
    raw = (ckpt / "model/a/c/0/0").read_bytes()
    n = g.encoded
    crcs = b"".join(raw[k * n + n - 4:(k + 1) * n] for k in range(g.count))  # the reference writer's order
    import hashlib

    assert tensorckpt.open(ckpt).chunk_digests("model/a")[0] == hashlib.sha256(crcs).hexdigest()
    doc = json.loads((ckpt / "model/a/zarr.json").read_bytes())
    root = json.loads((ckpt / "zarr.json").read_bytes())["attributes"]["tensorckpt"]
    assert doc["attributes"]["tensorckpt"]["checkpoint_id"] == root["checkpoint_id"]
    assert root["array_digests"]["model/a"] == hashlib.sha256((ckpt / "model/a/zarr.json").read_bytes()).hexdigest()


def test_the_1_3_golden_is_read_and_its_digests_bind_its_chunks(tmp_path):
    from conformance.suite import check_against_expected, checkpoint_dir, load_expected

    golden = checkpoint_dir("integrity_1_3")
    ck = tensorckpt.open(golden)
    assert ck.metadata.format_version == "1.3" and len(ck.metadata.checkpoint_id) == 32
    assert [len(ck.chunk_digests(k) or []) for k in ("a", "b")] == [2, 2]
    check_against_expected(ck.to_state_dict(), load_expected("integrity_1_3"))
    assert tensorckpt.verify(golden).ok
    zarr = pytest.importorskip("zarr")  # plain zarr-python reads every array (it ignores the new attributes)
    assert zarr.open_array(str(golden / "a"), mode="r")[:].tolist() == torch.arange(32.0).reshape(8, 4).tolist()
    copy = tmp_path / "golden"
    shutil.copytree(golden, copy)
    _swap(copy / "a/c/0/0", copy / "b/c/0/0")
    assert sorted(p.where for p in tensorckpt.verify(copy).problems) == [f"{copy}/a/c/0/0", f"{copy}/b/c/0/0"]


@pytest.mark.parametrize("variant", ["swapped_chunks_1_3", "swapped_inner_chunks_1_3", "swapped_arrays_1_3",
                                     "flipped_root_value_1_3"])
def test_the_broken_1_3_variants_are_refused(variant):
    """conformance/golden/broken/*_1_3 (the validator reports each, test_validate.py): verify fails, and so
    does a load in the saved layout."""
    ck = Path(__file__).resolve().parents[1] / "conformance" / "golden" / "broken" / variant / "checkpoint"
    assert not tensorckpt.verify(ck).ok
    target = {"a": torch.empty(8, 4), "b": torch.empty(8, 4), "optim": {"lr": 0.0, "step": 0},
              "sampler": {"epoch": 0, "position": 0}}
    with pytest.raises(CorruptCheckpointError):
        tensorckpt.load(target, ck)
