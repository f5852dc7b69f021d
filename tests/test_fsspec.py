"""The fsspec backend (``fsspec+PROTO://...``, and any protocol TensorStore has
no driver for) on two real fsspec file systems: fsspec's local file system
(``fsspec+file://``) and s3fs against a moto server on 127.0.0.1
(tests/s3server.py), configured only through ``storage_options``. Through
the public API: save -> load bit-exact, a slice read by byte range (the
ranges counted), a resharded load, verify, clean, CheckpointManager,
overwrite; the same bytes as the TensorStore backends (written by one, read
by the other); and the errors of a missing bucket, an unknown protocol and a
missing implementation package."""

from __future__ import annotations

import itertools
import os
import sys

import fsspec
import pytest
import torch

import tensorckpt
from tensorckpt import CheckpointExistsError, InvalidPathError, TensorckptError
from tensorckpt.storage import commit, kv, location
from tensorckpt.storage import fsspec as fsspec_backend

sys.path.insert(0, os.path.dirname(__file__))
from s3server import ACCESS_KEY, REGION, SECRET_KEY, MotoServer  # noqa: E402
from test_s3 import _empty, _equal, _state  # noqa: E402  (one test state for every S3 / fsspec test)

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")
BUCKET = "tensorckpt-fsspec"
_n = itertools.count()


@pytest.fixture(scope="module")
def moto():
    pytest.importorskip("moto.server", reason="moto[server] is not installed (the test extra)")
    pytest.importorskip("s3fs", reason="s3fs is not installed (the test extra)")
    with MotoServer() as server:
        server.make_bucket(BUCKET)
        yield server


def s3fs_options(moto) -> dict:
    return {"endpoint_url": moto.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY,
            "client_kwargs": {"region_name": REGION}}


class Where:
    """Fresh checkpoint URLs on one file system, with its storage options."""

    def __init__(self, kind: str, base: str, options: dict) -> None:
        self.kind, self.base, self.options = kind, base, options
        self.run = f"t{os.getpid()}-{next(_n)}"

    def __call__(self, name: str = "ckpt") -> str:
        return f"{self.base}/{self.run}/{name}"

    def fs(self):  # noqa: ANN201 - an fsspec file system of the kind the backend uses
        return fsspec.filesystem(self.kind, **self.options)

    def loc(self, url: str) -> location.Location:
        return location.parse(url, self.options)


@pytest.fixture(params=["file", "s3"])
def where(request, tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)  # s3fs is configured by storage_options alone
    if request.param == "file":
        return Where("file", f"fsspec+file://{tmp_path}", {})
    moto = request.getfixturevalue("moto")
    return Where("s3", f"fsspec+s3://{BUCKET}", s3fs_options(moto))


def test_fsspec_urls_parse():
    assert location.parse("fsspec+file:///tmp/a/b") == location.Location("fsspec", "fsspec+file:///tmp/a/b")
    assert location.parse("fsspec+s3://bucket/x/").url == "fsspec+s3://bucket/x"
    assert location.parse("hdfs://namenode/ckpt").scheme == "fsspec"  # no TensorStore driver: fsspec
    assert location.parse("s3://bucket/x").scheme == "s3"  # TensorStore's driver where it has one


def test_save_load_bit_exact(where):
    url = where()
    tensorckpt.save(_state(), url, storage_options=where.options)
    assert _equal(tensorckpt.load(_empty(), url, storage_options=where.options), _state())
    keys = kv.list_keys(where.loc(url))
    assert "zarr.json" in keys and "h/c/0/0" in keys and commit.MARKER_NAME not in keys  # the claim is gone


def test_a_slice_reads_only_its_byte_ranges(where, monkeypatch):
    url = where()
    big = torch.arange(1024 * 512, dtype=torch.float32).reshape(1024, 512)
    tensorckpt.save({"big": big}, url, storage_options=where.options, inner_chunk_bytes=64 << 10)
    fetched: list[int] = []
    real = fsspec_backend.file_system

    class Counting:  # the backend's file system, counting the bytes of the ranges it fetches
        def __init__(self, fs) -> None:
            self._fs = fs

        def __getattr__(self, name: str):  # noqa: ANN204 - delegation
            return getattr(self._fs, name)

        def cat_ranges(self, paths, starts, ends, **kw):  # noqa: ANN201
            out = self._fs.cat_ranges(paths, starts, ends, **kw)
            fetched.extend(len(b) for b in out)
            return out

    monkeypatch.setattr(fsspec_backend, "file_system", lambda loc: (Counting(real(loc)[0]), real(loc)[1]))
    ckpt = tensorckpt.open(url, storage_options=where.options)
    assert torch.equal(ckpt.read("big", (slice(0, 4),)), big[:4])
    rows, cols = ckpt.info("big").inner_chunk_shape
    need = -(-512 // cols)  # the inner chunks across the first rows: each with its CRC, nothing more
    assert rows >= 4 and sum(fetched) == need * (rows * cols * 4 + 4) < big.numel() * 4 // 4, fetched  # of 2 MiB


def test_async_save(where):
    url = where()
    tensorckpt.async_save(_state(), url, storage_options=where.options).wait()
    assert _equal(tensorckpt.load(_empty(), url, storage_options=where.options), _state())


def test_resharded_load(where):
    url = where()
    full = _state()
    tensorckpt.save(full, url, storage_options=where.options)
    part = tensorckpt.ShardedTensor(torch.zeros(100, 50), (300, 200), (100, 150))
    tensorckpt.load({"w": part}, url, storage_options=where.options, partial=True)
    assert torch.equal(part.local, full["w"][100:200, 150:200])


def test_verify_finds_damage(where):
    url = where()
    tensorckpt.save(_state(), url, storage_options=where.options)
    assert tensorckpt.verify(url, storage_options=where.options).ok
    loc = where.loc(url)
    data = bytearray(kv.read(loc, "w/c/0/0"))
    data[100] ^= 0xFF
    kv.write(loc, "w/c/0/0", bytes(data))
    report = tensorckpt.verify(url, storage_options=where.options)
    assert not report.ok and "CRC-32C" in report.problems[0].message


def test_an_oversized_object_is_refused_before_it_is_fetched(where):
    url = where()
    tensorckpt.save(_state(), url, storage_options=where.options)
    loc = where.loc(url)
    kv.write(loc, "w/c/0/0", kv.read(loc, "w/c/0/0") + bytes(1 << 20))
    with pytest.raises(tensorckpt.CorruptCheckpointError, match="more than its inner chunks and index can take"):
        tensorckpt.load(_empty(), url, storage_options=where.options)
    assert tensorckpt.verify(url, storage_options=where.options).problems[0].kind == "corrupt"


def test_clean_removes_an_interrupted_save(where):
    url = where()
    tensorckpt.save(_state(), url, storage_options=where.options)
    target = where.loc(url)
    assert kv.create(target, commit.MARKER_NAME, b"") and not kv.create(target, commit.MARKER_NAME, b"")
    kv.delete(target, commit.ROOT_KEY)  # a new save that died before its commit: a claim and no root
    with pytest.raises(tensorckpt.IncompleteCheckpointError, match="never committed"):
        tensorckpt.open(url, storage_options=where.options)
    with pytest.raises(CheckpointExistsError, match="leftovers"):
        tensorckpt.save(_state(2.0), url, storage_options=where.options)
    (x,) = tensorckpt.clean(url, older_than=0, storage_options=where.options).leftovers
    assert x.removed and kv.list_keys(target) == []
    tensorckpt.save(_state(2.0), url, storage_options=where.options)
    assert _equal(tensorckpt.load(_empty(), url, storage_options=where.options), _state(2.0))


def test_manager_and_overwrite(where):
    root = where("run")
    mgr = tensorckpt.CheckpointManager(root, keep_last=2, reader_grace=0, storage_options=where.options)
    for step in (1, 2, 3):
        mgr.save(step, _state(float(step)))
    assert mgr.latest() == 3 and [s.step for s in mgr.steps()] == [2, 3]
    out = _empty()
    assert mgr.restore(out) == 3 and _equal(out, _state(3.0))
    url = mgr.step_path(3)
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        tensorckpt.save(_state(4.0), url, storage_options=where.options)
    tensorckpt.save(_state(4.0), url, overwrite=True, storage_options=where.options)
    assert _equal(tensorckpt.load(_empty(), url, storage_options=where.options), _state(4.0))
    assert not tensorckpt.clean(url, older_than=0, storage_options=where.options).leftovers


def test_same_bytes_as_the_tensorstore_backends(where, moto, monkeypatch):
    """Written through fsspec, read through TensorStore's backend of the same
    storage, and the other way round: one format."""
    url = where()
    native = url.removeprefix("fsspec+").removeprefix("file://")  # s3://bucket/... or /abs/path
    opts = {"endpoint_url": moto.endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY} if where.kind == "s3" else None
    tensorckpt.save(_state(), url, storage_options=where.options)
    assert _equal(tensorckpt.load(_empty(), native, storage_options=opts), _state())
    tensorckpt.save(_state(2.0), native, overwrite=True, storage_options=opts)
    assert _equal(tensorckpt.load(_empty(), url, storage_options=where.options), _state(2.0))
    assert tensorckpt.verify(url, storage_options=where.options).ok


def test_missing_bucket(moto, monkeypatch):
    url = "fsspec+s3://no-such-bucket-here/x/ckpt"
    with pytest.raises(TensorckptError, match="no-such-bucket-here/x/ckpt.*does not exist"):
        tensorckpt.save(_state(), url, storage_options=s3fs_options(moto))
    assert not moto.client().list_buckets()["Buckets"][1:]  # no bucket was made on the way


@pytest.mark.parametrize("url, message", [
    ("fsspec+nosuchfs://x/y", "fsspec knows no file system for protocol 'nosuchfs'"),
    ("nosuchfs://x/y", "unsupported scheme 'nosuchfs'"),
    ("fsspec+file://relative/path", "absolute path"),
    ("fsspec+memory://x/../y", "'..'"),
])
def test_bad_urls(url, message):
    with pytest.raises(InvalidPathError, match=message):
        tensorckpt.save(_state(), url)


def test_a_missing_implementation_names_the_package():
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed")
    with pytest.raises(InvalidPathError, match="gcsfs"):
        tensorckpt.open("gs://bucket/ckpt")


def test_what_the_codec_cannot_take_is_refused(tmp_path):
    """Nothing falls back to a TensorStore kvstore that does not exist."""
    with pytest.raises(TensorckptError, match="no driver for this fsspec location"):
        location.parse(f"fsspec+file://{tmp_path}/x").kvstore()


# distributed save at world 2, resharded load at world 3 over fsspec+file://: test_s3.test_distributed_save_2_load_3
