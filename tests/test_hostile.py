"""Hostile input (spec section 12): a checkpoint from an untrusted source must
never run code, crash the process, write outside the checkpoint, or make a
reader allocate out of proportion to its real size.

Hypothesis mutates the root ``zarr.json`` and every array ``zarr.json`` of a
small checkpoint (wrong types, missing or extra members, negative or enormous
shapes, keys with ``../`` or absolute paths, unknown dtypes, codecs, versions
and extensions, truncated, non-UTF-8 or deeply nested JSON, chunkings that
disagree with the index) and runs every reader on the result: ``open``,
``read`` of every key, ``to_state_dict``, ``load``, ``inspect`` and
``verify``. Each either works, reading the original data, or raises a
:class:`TensorckptError` naming the damaged file; never another exception.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import tempfile
import tracemalloc
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorckpt
from tensorckpt import CorruptCheckpointError, TensorckptError
from tensorckpt.cli import inspect
from tensorckpt.format.metadata import TensorEntry
from tensorckpt.storage import arrays
from tests.forge import reseal

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")

STATE = {
    "model": {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6), "b": torch.arange(5).to(torch.bfloat16)},
    "s": torch.tensor(7, dtype=torch.int64),
    "step": 3,
    "cfg": {"lr": 0.5, "names": ["a", "b"]},
}
TENSORS = {"model/w": STATE["model"]["w"], "model/b": STATE["model"]["b"], "s": STATE["s"]}
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("hostile") / "ckpt"
    tensorckpt.save(STATE, p, shard_bytes=32, inner_chunk_bytes=16)  # several chunks and inner chunks
    return p


def _target() -> dict:
    return {"model": {"w": torch.empty(4, 6), "b": torch.empty(5, dtype=torch.bfloat16)},
            "s": torch.empty((), dtype=torch.int64), "step": None, "cfg": {"lr": None, "names": None}}


# ----------------------------------------------------------------- strategies

NAMES = ["", ".", "..", "../x", "/etc/passwd", "a/../b", "a//b", "%2E%2E", "zarr.json", "c/0", "__x", "\x00", "é",
         "x" * 300, "model", "model/w", "model/x", "tensors", "values", "shape", "chunk_shape", "dtype", "data_type",
         "codecs", "configuration", "name", "must_understand", "format_version", "attributes", "tensorckpt"]
STRINGS = NAMES + ["1.0", "1.1", "2.0", "0.1", "1.999999", "01.0", "float32", "float99", "bfloat16", "int4",
                   "float8_e4m3", "bytes", "crc32c", "gzip", "sharding_indexed", "regular", "default", "big",
                   "little", "quantized-v7", "group", "array", "NaN", "start", "end"]
INTS = [0, 1, 2, 3, 4, 5, 6, -1, 2**31, 2**40, 2**62, 2**62 + 1, 2**63, 2**64, -(2**63), 10**30]
leaf = st.one_of(st.none(), st.booleans(), st.sampled_from(INTS), st.integers(), st.sampled_from(STRINGS),
                 st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6))
shape = st.lists(st.sampled_from(INTS), max_size=34)
json_value = st.recursive(
    st.one_of(leaf, shape),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(NAMES), inner, max_size=3),
    max_leaves=8,
)
_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
# members the readers interpret -> values chosen to break them
FIELDS = {
    "format_version": ["2.0", "0.1", "1.99", "1.100000", "01.0", "1.0.0", 1, None],
    "must_understand": [["quantized-v7"], ["quantized-v7", 3], "x", []],
    "world_size": [0, -1, 10**15, True, 1.5, "1"],
    "save_stats": [{"seconds": {}}, {"seconds": {"plan": [1, 2]}}, {"bytes_written": [-1]}, {"seconds": {"x": [1e999]}}, []],
    "seconds": [{"plan": "x"}, {"plan": [True]}, {"plan": [-1.0]}, []],
    "bytes_written": [[2**64], [1, 2], "x", None],
    "user_metadata": ["x", [], {"a": [[[]]]}],
    "values": [[], {"../x": 1}, {"/etc/passwd": 1}, {"a/b/c": 1, "a/b": 2}],
    "tensors": [[], {}, {"../w": None}],
    "shape": [[-1], [2**62, 2**62], [2**63], [0] * 33, [4.0, 6], [7, 6], [], [True]],
    "chunk_shape": [[0, 6], [2**62, 1], [3, 6], [1], [1, 2**62]],
    "inner_chunk_shape": [[1, 4], [1, 1], [5, 6], [1, 2**62]],
    "dtype": ["float99", "int4", "float8_e4m3", "int32", 3, None],
    "data_type": ["int32", "float8_e4m3", "bfloat16", "r16", None],
    "node_type": ["array", "group", None],
    "zarr_format": [2, "3", 3.0],
    "codecs": [[], [{"name": "gzip"}], _CODECS[:1], [_CODECS[0], _CODECS[1], {"name": "gzip"}], "crc32c"],
    "index_codecs": [_CODECS[:1], []],
    "index_location": ["start", "middle"],
    "endian": ["big", None],
    "separator": [".", "//"],
    "fill_value": ["NaN", 1, False, [0.0], None],
    "storage_transformers": [[{"name": "x"}], []],
    "dimension_names": [["a", "b"], None, 5],
}
RAW = [b"", b"{", b"\xff\xfe\x00", b"[" * 100_000, b"{\"a\":" * 50_000, b"null", b"[]", b"NaN", b"1e999",
       b'{"zarr_format": 3, "node_type": "group", "attributes": {"tensorckpt": {"format_version": "1.0", '
       b'"tensors": {}, "values": {"x": ' + b"[" * 900 + b"]" * 900 + b"}}}}"]


def _paths(doc, prefix=()):
    """Every (path, node) in a JSON document."""
    yield prefix, doc
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        yield from _paths(v, prefix + (k,))


def _mutate(data: st.DataObject, doc: bytes) -> bytes:
    """One to three mutations of a JSON document, or raw damage to its bytes."""
    if data.draw(st.integers(0, 9), label="raw?") == 0:
        kind = data.draw(st.sampled_from(["truncate", "byte", "replace"]), label="raw")
        if kind == "truncate":
            return doc[: data.draw(st.integers(0, len(doc) - 1), label="at")]
        if kind == "byte":
            at = data.draw(st.integers(0, len(doc) - 1), label="at")
            return doc[:at] + bytes([data.draw(st.integers(0, 255), label="byte")]) + doc[at + 1:]
        return data.draw(st.sampled_from(RAW), label="content")
    tree = json.loads(doc)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        paths = list(_paths(tree))
        path, node = data.draw(st.sampled_from(paths), label="path")
        op = data.draw(st.sampled_from(["set", "field", "delete", "add", "rename"]), label="op")
        fields = [(p, n) for p, n in paths if p and p[-1] in FIELDS]
        if op == "field" and fields:  # a member the readers interpret, set to a value chosen to break it
            path, node = data.draw(st.sampled_from(fields), label="path")
            op = "set"
        if not path:
            tree = data.draw(json_value, label="value") if op == "set" else tree
            continue
        parent = tree
        for k in path[:-1]:
            parent = parent[k]
        last = path[-1]
        if op == "set":
            hostile = st.sampled_from(FIELDS[last]) if last in FIELDS else st.nothing()
            parent[last] = data.draw(st.one_of(hostile, leaf, json_value), label="value")
        elif op == "delete":
            del parent[last]
        elif op == "add" and isinstance(node, dict):
            node[data.draw(st.sampled_from(NAMES), label="member")] = data.draw(json_value, label="value")
        elif op == "rename" and isinstance(parent, dict):
            parent[data.draw(st.sampled_from(NAMES), label="new name")] = parent.pop(last)
    return json.dumps(tree).encode()


# ----------------------------------------------------------------- running every reader


def _snapshot(root: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def _readers(path: Path):
    """(name, call) for every reader entry point."""

    def read_all():
        ckpt = tensorckpt.open(path)
        for k in ckpt.keys():
            got = ckpt.read(k)
            if k in TENSORS:  # if a damaged checkpoint reads at all, it reads the original data
                assert torch.equal(got.reshape(-1).view(torch.uint8), TENSORS[k].reshape(-1).view(torch.uint8)), k

    def load():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = tensorckpt.load(_target(), path, strict=False)
        stored = tensorckpt.open(path).keys()
        if "model/w" in stored:
            assert torch.equal(out["model"]["w"], STATE["model"]["w"])

    def verify():
        report = tensorckpt.verify(path)
        for p in report.problems:
            assert str(path) in p.message and str(path) in p.where, p

    return [
        ("open", lambda: tensorckpt.open(path)),
        ("read", read_all),
        ("to_state_dict", lambda: tensorckpt.open(path).to_state_dict()),
        ("load", load),
        ("inspect", lambda: inspect(str(path), out=io.StringIO())),
        ("inspect --json", lambda: inspect(str(path), as_json=True, out=io.StringIO())),
        ("verify", verify),
    ]


def _check_every_reader(base: Path, damaged: str, content: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        shutil.copytree(base, path)
        (path / damaged).write_bytes(content)
        before = _snapshot(Path(tmp))
        for name, call in _readers(path):
            try:
                call()
            except TensorckptError as e:
                assert str(path) in str(e), (name, str(e))
                if damaged == "zarr.json" and name == "open":
                    assert str(path / "zarr.json") in str(e), (name, str(e))
                if damaged != "zarr.json" and name == "read":
                    assert str(path / damaged) in str(e), (name, str(e))
        assert _snapshot(Path(tmp)) == before  # nothing written, inside the checkpoint or beside it


@FUZZ
@given(data=st.data())
def test_hostile_root_metadata(base, data):
    _check_every_reader(base, "zarr.json", _mutate(data, (base / "zarr.json").read_bytes()))


@FUZZ
@given(data=st.data(), key=st.sampled_from(sorted(TENSORS)))
def test_hostile_array_metadata(base, data, key):
    damaged = f"{key}/zarr.json"
    _check_every_reader(base, damaged, _mutate(data, (base / damaged).read_bytes()))


# ----------------------------------------------------------------- targeted cases

_DEEP = json.loads("[" * 900 + "]" * 900)
_ROOT_HOLES = {  # edit of the root index -> what the error must say (None: it must read fine)
    "huge_world_size_and_save_stats": (lambda m: m.update(world_size=10**15, save_stats={"seconds": {}}), None),
    "six_digit_version": (lambda m: m.update(format_version="1.100000"), "format_version"),
    "deep_value": (lambda m: m["values"].update(step=_DEEP), "nested"),
    "deep_user_metadata": (lambda m: m.update(user_metadata={"a": _DEEP}), "nested"),
    "key_of_30000_components": (lambda m: m["values"].update({"/".join(["a"] * 30000): 1}), "components"),
}
_HOLES = {
    "huge_world_size_and_save_stats": "fixed bug: format/metadata.py _save_stats built [0] * world_size before "
                                      "checking anything: MemoryError for world_size 10**15",
    "six_digit_version": "fixed bug: format_version parts of 6 digits were accepted; the spec allows 1 to 5",
    "deep_value": "fixed bug: JSON depth was bounded only by the recursion limit, so a value that json.loads "
                  "accepted could raise RecursionError in inspect's json.dumps, depending on the stack",
    "deep_user_metadata": "fixed bug: as deep_value, through user_metadata",
    "key_of_30000_components": "fixed bug: the prefix-free check was quadratic in a key's components: "
                               "3.5 s for one 60 KB key, hours for a 2 MB root zarr.json",
}


@pytest.mark.parametrize("hole", [pytest.param(k, marks=pytest.mark.regression(reason=_HOLES[k])) for k in _ROOT_HOLES])
def test_root_holes_found_in_review(tmp_path, hole):
    edit, error = _ROOT_HOLES[hole]
    p = tmp_path / "c"
    tensorckpt.save(STATE, p)
    root = json.loads((p / "zarr.json").read_text())
    edit(root["attributes"]["tensorckpt"])
    reseal(p, root)  # as a forger would: the checks behind the checksum are what is tested
    if error is None:
        assert tensorckpt.open(p).read("step") == 3
        assert inspect(str(p), out=io.StringIO()) == 0 and tensorckpt.verify(p).ok
        return
    for call in (lambda: tensorckpt.open(p), lambda: tensorckpt.load(_target(), p)):
        with pytest.raises(CorruptCheckpointError, match=error) as ei:
            call()
        assert str(p / "zarr.json") in str(ei.value)


@pytest.mark.parametrize("content", [b"[" * 100_000, b'{"a":' * 100_000], ids=["list", "object"])
def test_deeply_nested_array_metadata_does_not_crash(tmp_path, content):
    """TensorStore's JSON parser overflows the stack (SIGSEGV) on this; it must
    never see it."""
    tensorckpt.save(STATE, tmp_path / "c")
    (tmp_path / "c" / "model" / "w" / "zarr.json").write_bytes(content)
    with pytest.raises(CorruptCheckpointError, match="model/w/zarr.json"):
        tensorckpt.open(tmp_path / "c").read("model/w")
    assert not tensorckpt.verify(tmp_path / "c").ok


def _forge(path: Path, key: str, entry: TensorEntry) -> None:
    """Make the root index and the array zarr.json agree on ``entry``."""
    root = json.loads((path / "zarr.json").read_text())
    root["attributes"]["tensorckpt"]["tensors"][key] = entry.to_json()
    (path / key / "zarr.json").write_bytes(arrays.zarr_json(entry))
    reseal(path, root)  # the digests and checksum of format 1.3 agree with the forgery too


@pytest.mark.parametrize("shape,chunk,inner", [((2**33,), (2**33,), (2**20,)), ((2**31, 2**31), (1, 2**31), (1, 2**20)),
                                               ((2**20,), (2**10,), (2**10,))],
                         ids=["one_chunk", "rows", "many_chunks"])
def test_forged_shape_does_not_allocate(tmp_path, shape, chunk, inner):
    """The index and the array agree on an enormous tensor whose data is not
    there: reading and verifying it fail without allocating its size. (Its
    inner chunks are within the caps of spec 12: past them the entry is
    refused at open, tests/test_caps.py.)"""
    p = tmp_path / "c"
    tensorckpt.save(STATE, p)
    _forge(p, "model/w", TensorEntry("float32", shape, chunk, inner))
    assert tensorckpt.open(p).info("model/w").shape == shape  # metadata alone is fine
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="model/w"):
            tensorckpt.open(p).read("model/w")
        with pytest.raises(CorruptCheckpointError, match="model/w"):
            tensorckpt.open(p).to_state_dict()
        report = tensorckpt.verify(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20
    assert not report.ok and any("model/w" in x.message for x in report.problems)
    assert inspect(str(p), out=io.StringIO()) == 0


def test_fifo_is_not_opened(tmp_path):
    """A FIFO planted as a zarr.json or a chunk would block a reader forever."""
    p = tmp_path / "c"
    tensorckpt.save(STATE, p)
    (p / "model" / "w" / "zarr.json").unlink()
    os.mkfifo(p / "model" / "w" / "zarr.json")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        tensorckpt.open(p).read("model/w")
    chunk = next(f for f in sorted((p / "model" / "b" / "c").rglob("*")) if f.is_file())
    chunk.unlink()
    os.mkfifo(chunk)
    messages = [x.message for x in tensorckpt.verify(p).problems]
    assert any("model/w/zarr.json" in m for m in messages)
    assert any(str(chunk) in m and "not a regular file" in m for m in messages)
    (p / "zarr.json").unlink()
    os.mkfifo(p / "zarr.json")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        tensorckpt.open(p)


def test_chunk_linked_outside_is_reported(tmp_path):
    p = tmp_path / "c"
    tensorckpt.save(STATE, p)
    outside = tmp_path / "secret"
    chunk = next(f for f in sorted((p / "model" / "w" / "c").rglob("*")) if f.is_file())
    outside.write_bytes(chunk.read_bytes())
    chunk.unlink()
    chunk.symlink_to(outside)
    problems = tensorckpt.verify(p).problems
    assert [x.where for x in problems] == [str(chunk)]
    assert "not a regular file" in problems[0].message


@pytest.mark.parametrize("path", ["file", "file/below", "loop"])
def test_odd_locations(tmp_path, path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(TensorckptError, match=str(tmp_path / path)):
        tensorckpt.open(tmp_path / path)
    with pytest.raises(TensorckptError):
        tensorckpt.load({}, tmp_path / path)


# ----------------------------------------------------------------- no pickle


def test_nothing_is_unpickled(tmp_path, monkeypatch):
    """Opening, reading, loading, inspecting and verifying never unpickle."""
    p = tmp_path / "c"
    tensorckpt.save(STATE, p)

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling on the load path")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(pickle, "_Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    ckpt = tensorckpt.open(p)
    assert torch.equal(ckpt.read("model/w"), STATE["model"]["w"])
    assert ckpt.to_state_dict()["step"] == 3
    out = tensorckpt.load(_target(), p)
    assert torch.equal(out["model"]["b"], STATE["model"]["b"])
    assert inspect(str(p), out=io.StringIO()) == 0
    assert tensorckpt.verify(p).ok


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plant", ["fifo", "link-outside", "linked-dir"])
def test_read_and_load_refuse_planted_chunk_objects(tmp_path, plant):
    """read(), to_state_dict() and load() check the stored objects they will
    open: a FIFO would block TensorStore forever, a link leads out of the
    checkpoint (a file or a whole chunk directory elsewhere)."""
    p = tmp_path / "c"
    tensorckpt.save(STATE, p)
    cdir = p / "model" / "w" / "c"
    chunk = next(f for f in sorted(cdir.rglob("*")) if f.is_file())
    if plant == "fifo":
        chunk.unlink()
        os.mkfifo(chunk)
    elif plant == "link-outside":
        outside = tmp_path / "secret"
        outside.write_bytes(chunk.read_bytes())
        chunk.unlink()
        chunk.symlink_to(outside)
    else:
        moved = tmp_path / "elsewhere"
        cdir.rename(moved)
        cdir.symlink_to(moved, target_is_directory=True)
    with pytest.raises(CorruptCheckpointError, match=r"model/w.*not a (regular file|directory)"):
        tensorckpt.open(p).read("model/w")
    with pytest.raises(CorruptCheckpointError, match="model/w"):
        tensorckpt.open(p).to_state_dict()
    with pytest.raises(CorruptCheckpointError, match="model/w"):
        tensorckpt.load(_zeros_like_state(STATE), p)


def _zeros_like_state(state):
    return {k: _zeros_like_state(v) if isinstance(v, dict) else (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v)
            for k, v in state.items()}
