"""The JSON documents tensorckpt writes conform to the format spec (spec/format-v1.md)
and its JSON Schemas (spec/schema/*.schema.json), and the schemas reject broken ones."""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import random
import re
import struct
from pathlib import Path

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
from jsonschema import Draft202012Validator  # noqa: E402

import tensorckpt  # noqa: E402
from tensorckpt.errors import CorruptCheckpointError  # noqa: E402
from tensorckpt.format.keys import escape, flat_key, split_flat_key  # noqa: E402

SPEC = Path(__file__).resolve().parent.parent / "spec"
ROOT_SCHEMA = json.loads((SPEC / "schema" / "root-v1.schema.json").read_text())
ARRAY_SCHEMA = json.loads((SPEC / "schema" / "array-v1.schema.json").read_text())
ROOT = Draft202012Validator(ROOT_SCHEMA)
ARRAY = Draft202012Validator(ARRAY_SCHEMA)
PLAIN_GROUP = {"zarr_format": 3, "node_type": "group", "attributes": {}}

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    model = {}
    for dt in DTYPES:
        x = torch.randn(5, 3, generator=g) * 4
        model[f"t_{str(dt).removeprefix('torch.')}"] = x > 0 if dt == torch.bool else x.to(dt)
    return {
        "model": model,
        "big": torch.arange(300 * 7, dtype=torch.float32).reshape(300, 7),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 3),
        "zeros": torch.zeros(16, 4, dtype=torch.bfloat16),  # equal to the fill value: still stored
        "": {".": torch.ones(1), "..": {"__x": torch.ones(2)}, "a/b": torch.ones(1), "50%": 3},
        "opt": {"lr": 0.1, "betas": [0.9, 0.999], "nothing": {}, "name": None, "tag": "ü"},
        "step": 3,
    }


OPTIONS = {
    "default": {},
    "many_chunks": {"shard_bytes": 256, "inner_chunk_bytes": 64},
}


@pytest.fixture(scope="module", params=sorted(OPTIONS))
def ckpt(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("schema") / "ckpt"
    tensorckpt.save(_state(), path, metadata={"run": "schema-test", "n": [1, 2]}, **OPTIONS[request.param])
    return path


def _documents(root: Path) -> dict[str, dict]:
    """Every zarr.json under ``root`` by its node's path ('' for the root)."""
    docs = {}
    for dirpath, _, files in os.walk(root):
        if "zarr.json" in files:
            rel = os.path.relpath(dirpath, root)
            docs["" if rel == "." else rel.replace(os.sep, "/")] = json.loads(Path(dirpath, "zarr.json").read_bytes())
    return docs


def _errors(validator, doc) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


# ----------------------------------------------------------------- conformance


def test_schemas_are_valid_draft_2020_12():
    Draft202012Validator.check_schema(ROOT_SCHEMA)
    Draft202012Validator.check_schema(ARRAY_SCHEMA)


def test_every_document_conforms(ckpt):
    docs = _documents(ckpt)
    assert _errors(ROOT, docs.pop("")) == []
    arrays = 0
    for node, doc in docs.items():
        if doc.get("node_type") == "array":
            assert _errors(ARRAY, doc) == [], node
            arrays += 1
        else:
            assert doc == PLAIN_GROUP, node
    assert arrays == len(json.loads((ckpt / "zarr.json").read_bytes())["attributes"]["tensorckpt"]["tensors"])


def test_writer_writes_every_root_member(ckpt):
    meta = json.loads((ckpt / "zarr.json").read_bytes())["attributes"]["tensorckpt"]
    assert set(meta) == {
        "format_version", "must_understand", "library_version", "created", "world_size", "user_metadata", "tensors", "values",
        "save_stats", "checkpoint_id", "array_digests", "checksum",  # the last three since 1.3 (spec 9.8)
    }
    assert set(meta["array_digests"]) == set(meta["tensors"])
    world = meta["world_size"]
    assert set(meta["save_stats"]["seconds"]) == {"plan", "stage", "write", "sync"}
    assert all(len(v) == world and min(v) >= 0 for v in meta["save_stats"]["seconds"].values())
    assert len(meta["save_stats"]["bytes_written"]) == world
    assert meta["format_version"] == tensorckpt.FORMAT_VERSION
    assert meta["must_understand"] == []
    assert meta["world_size"] == 1
    assert meta["user_metadata"] == {"run": "schema-test", "n": [1, 2]}
    assert meta["values"]["opt/nothing"] == {}  # an empty dict is a value
    assert meta["values"]["%/50%25"] == 3


def test_index_agrees_with_the_tree(ckpt):
    """The rules of spec section 9.5 that a JSON Schema cannot express."""
    docs = _documents(ckpt)
    meta = docs.pop("")["attributes"]["tensorckpt"]
    tensors, values = meta["tensors"], meta["values"]
    assert not set(tensors) & set(values)
    keys = [*tensors, *values]
    for key in keys:
        assert flat_key(split_flat_key(key)) == key  # canonical
    for a, b in itertools.permutations(keys, 2):
        assert not b.startswith(a + "/"), f"{a!r} is a prefix of {b!r}"
    prefixes = {k.rsplit("/", i)[0] for k in keys for i in range(1, k.count("/") + 1)}
    assert {n for n, d in docs.items() if d["node_type"] == "group"} == prefixes
    assert {n for n, d in docs.items() if d["node_type"] == "array"} == set(tensors)

    for key, e in tensors.items():
        a = docs[key]
        shard = a["codecs"][0]["configuration"]
        assert e["data_type"] == e["dtype"] == a["data_type"] == a["attributes"]["tensorckpt"]["dtype"]
        assert a["shape"] == e["shape"]
        assert a["chunk_grid"]["configuration"]["chunk_shape"] == e["chunk_shape"]
        assert shard["chunk_shape"] == e["inner_chunk_shape"]
        assert len(e["shape"]) == len(e["chunk_shape"]) == len(e["inner_chunk_shape"])
        assert all(c % i == 0 for c, i in zip(e["chunk_shape"], e["inner_chunk_shape"]))
        # every chunk of the grid is stored, and nothing else
        grid = [range(math.ceil(s / c)) for s, c in zip(e["shape"], e["chunk_shape"])]
        want = {"/".join(["c", *map(str, idx)]) for idx in itertools.product(*grid)}
        base = ckpt / key
        have = {
            os.path.relpath(os.path.join(d, f), base).replace(os.sep, "/")
            for d, _, fs in os.walk(base) for f in fs if f != "zarr.json"
        }
        assert have == want, key
        # ... and every inner chunk of every shard: no "empty" index entries, index at the end
        # (those lying wholly outside the array, in an edge chunk, excepted)
        per = [c // i for c, i in zip(e["chunk_shape"], e["inner_chunk_shape"])]
        n = math.prod(per)
        for rel in have:
            data = (base / rel).read_bytes()
            index = struct.unpack(f"<{2 * n}Q", data[-(16 * n + 4):-4])
            origin = [int(x) * c for x, c in zip(rel.split("/")[1:], e["chunk_shape"])]
            for j, pos in enumerate(itertools.product(*map(range, per))):  # C order
                off, size = index[2 * j], index[2 * j + 1]
                inside = all(o + p * i < s for o, p, i, s in zip(origin, pos, e["inner_chunk_shape"], e["shape"]))
                if not inside:  # not part of the array: may be absent (TensorStore marks it empty)
                    continue
                assert (off, size) != (2**64 - 1, 2**64 - 1), f"{key}/{rel}: inner chunk {pos} missing"
                assert size > 4 and off + size <= len(data) - (16 * n + 4), f"{key}/{rel}: bad index entry"


def test_spec_examples_conform():
    """JSON blocks in format-v1.md marked <!-- schema: root|array --> are valid examples."""
    text = (SPEC / "format-v1.md").read_text()
    blocks = re.findall(r"<!-- schema: (root|array) -->\s*```json\n(.*?)```", text, re.S)
    assert {kind for kind, _ in blocks} == {"root", "array"}
    for kind, body in blocks:
        assert _errors(ROOT if kind == "root" else ARRAY, json.loads(body)) == []


def test_spec_example_is_what_save_writes(tmp_path):
    """format-v1.md section 14's listing and root document are what the reference writer writes for
    the example state: the same objects, of the stated sizes (the root's within the few bytes that
    save_stats' timing digits vary by), and a root with the same members."""
    text = (SPEC / "format-v1.md").read_text()
    section = text[text.index("## 14. Example"):]
    listing = re.search(r"```\n(zarr\.json .*?)```", section, re.S).group(1)
    stated = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\S+)\s+(\d+) bytes", listing, re.M)}
    path = tmp_path / "example"
    tensorckpt.save({"model": {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}, "step": 3}, path)
    written = {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*") if p.is_file()}
    assert set(written) == set(stated), (written, stated)
    for name, size in stated.items():
        assert abs(written[name] - size) <= (12 if name == "zarr.json" else 0), (name, written[name], size)
    example = json.loads(re.findall(r"<!-- schema: root -->\s*```json\n(.*?)```", section, re.S)[0])
    real = json.loads((path / "zarr.json").read_bytes())
    assert set(example["attributes"]["tensorckpt"]) == set(real["attributes"]["tensorckpt"])
    assert example["attributes"]["tensorckpt"]["tensors"] == real["attributes"]["tensorckpt"]["tensors"]


def test_flat_key_pattern_is_the_reference_canonical_form():
    pattern = re.compile(ROOT_SCHEMA["$defs"]["flatKey"]["pattern"])
    rnd = random.Random(1)
    alphabet = ["%", "2", "5", "F", "E", "f", "e", ".", "_", "/", "a", "ü", "4", "x", "\x01", "%01", "%7F", "zarr.json", "zarr%2Ejson", "\\", "%5C", ".__lock", "%2E__lock"]
    for _ in range(20000):
        s = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 9)))
        try:
            split_flat_key(s)
            canonical = True
        except CorruptCheckpointError:
            canonical = False
        assert canonical == bool(pattern.search(s)), s
        if "/" not in s:
            assert pattern.search(escape(s)), s
    for name, escaped in [("", "%"), (".", "%2E"), ("..", "%2E%2E"), ("__x", "%5F_x"), ("a/b", "a%2Fb"), ("50%", "50%25"),
                          ("zarr.json", "zarr%2Ejson"), ("a\tb", "a%09b"), ("a\\b", "a%5Cb"), ("x.__lock", "x%2E__lock")]:
        assert escape(name) == escaped  # the spec's examples table
    assert pattern.search("x" * 255) and not pattern.search("x" * 256)


# ----------------------------------------------------------------- negatives


@pytest.fixture(scope="module")
def good_docs(tmp_path_factory) -> tuple[dict, dict, dict]:
    path = tmp_path_factory.mktemp("neg") / "ckpt"
    tensorckpt.save({"m": {"w": torch.ones(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}, "step": 1}, path)
    docs = _documents(path)
    return docs[""], docs["m/w"], docs["m/b"]


def _meta(d):
    return d["attributes"]["tensorckpt"]


def _shard(d):
    return d["codecs"][0]["configuration"]


BROKEN_ROOT = {
    "missing format_version": lambda d: _meta(d).pop("format_version"),
    "format_version 2.0": lambda d: _meta(d).update(format_version="2.0"),
    "format_version not a string": lambda d: _meta(d).update(format_version=1.0),
    "missing tensors": lambda d: _meta(d).pop("tensors"),
    "no tensorckpt attribute": lambda d: d["attributes"].pop("tensorckpt"),
    "node_type array": lambda d: d.update(node_type="array"),
    "zarr_format 2": lambda d: d.update(zarr_format=2),
    "unknown top-level member": lambda d: d.update(consolidated_metadata={"kind": "inline"}),
    "data_type does not match dtype": lambda d: _meta(d)["tensors"]["m/w"].update(data_type="int32"),
    "unknown dtype": lambda d: _meta(d)["tensors"]["m/w"].update(dtype="float4", data_type="float4"),
    "key not canonical (__)": lambda d: _meta(d)["tensors"].update({"__x": _meta(d)["tensors"]["m/w"]}),
    "key not canonical (..)": lambda d: _meta(d)["values"].update({"m/../x": 1}),
    "key with empty component": lambda d: _meta(d)["values"].update({"a//b": 1}),
    "tensor key names zarr.json": lambda d: _meta(d)["tensors"].update({"m/zarr.json": _meta(d)["tensors"]["m/w"]}),
    "zero chunk dimension": lambda d: _meta(d)["tensors"]["m/w"].update(chunk_shape=[0, 3]),
    "33 dimensions": lambda d: _meta(d)["tensors"]["m/w"].update(shape=[1] * 33),
    "negative dimension": lambda d: _meta(d)["tensors"]["m/w"].update(shape=[-1, 3]),
    "world_size 0": lambda d: _meta(d).update(world_size=0),
    "must_understand not strings": lambda d: _meta(d).update(must_understand=[1]),
    "user_metadata not an object": lambda d: _meta(d).update(user_metadata=[]),
}

BROKEN_ARRAY = {
    "gzip instead of crc32c": lambda d: _shard(d)["codecs"].__setitem__(1, {"name": "gzip", "configuration": {"level": 1}}),
    "no crc32c": lambda d: _shard(d)["codecs"].pop(1),
    "index without crc32c": lambda d: _shard(d)["index_codecs"].pop(1),
    "extra compressor": lambda d: _shard(d)["codecs"].append({"name": "zstd", "configuration": {"level": 0}}),
    "no sharding": lambda d: d.update(codecs=[{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]),
    "two codecs": lambda d: d["codecs"].append({"name": "crc32c"}),
    "index at start": lambda d: _shard(d).update(index_location="start"),
    "big endian": lambda d: _shard(d)["codecs"][0].update(configuration={"endian": "big"}),
    "endian omitted for float32": lambda d: _shard(d)["codecs"][0].pop("configuration"),
    "fill value 1": lambda d: d.update(fill_value=1.0),
    "fill value NaN": lambda d: d.update(fill_value="NaN"),
    "dtype attribute mismatch": lambda d: _meta(d).update(dtype="int32"),
    "no tensorckpt attribute": lambda d: d["attributes"].pop("tensorckpt"),
    "v2 chunk keys": lambda d: d.update(chunk_key_encoding={"name": "v2", "configuration": {"separator": "."}}),
    "dot separator": lambda d: d.update(chunk_key_encoding={"name": "default", "configuration": {"separator": "."}}),
    "rectilinear grid": lambda d: d["chunk_grid"].update(name="rectilinear"),
    "storage transformer": lambda d: d.update(storage_transformers=[{"name": "x"}]),
    "unknown member": lambda d: d.update(extra=1),
    "group node": lambda d: d.update(node_type="group"),
}


@pytest.mark.parametrize("name", sorted(BROKEN_ROOT))
def test_broken_root_documents_fail(good_docs, name):
    doc = copy.deepcopy(good_docs[0])
    assert _errors(ROOT, doc) == []
    BROKEN_ROOT[name](doc)
    assert _errors(ROOT, doc), f"{name}: accepted"


@pytest.mark.parametrize("name", sorted(BROKEN_ARRAY))
def test_broken_array_documents_fail(good_docs, name):
    doc = copy.deepcopy(good_docs[1])
    assert _errors(ARRAY, doc) == []
    BROKEN_ARRAY[name](doc)
    assert _errors(ARRAY, doc), f"{name}: accepted"


def test_equivalent_zarr_defaults_are_accepted(good_docs):
    """Omitting members equal to their Zarr default (as TensorStore does when it
    writes zarr.json itself) is allowed, but only where the default is right."""
    doc = copy.deepcopy(good_docs[1])
    doc["chunk_key_encoding"] = {"name": "default"}
    _shard(doc).pop("index_location")
    doc["dimension_names"] = [None, None]
    doc["x_extension"] = {"must_understand": False}
    assert _errors(ARRAY, doc) == []
    one_byte = copy.deepcopy(good_docs[1])
    one_byte.update(data_type="uint8", fill_value=0)
    _meta(one_byte)["dtype"] = "uint8"
    _shard(one_byte)["codecs"][0].pop("configuration")
    assert _errors(ARRAY, one_byte) == []
    bf16 = copy.deepcopy(good_docs[2])
    assert bf16["data_type"] == "bfloat16" and _errors(ARRAY, bf16) == []
    _shard(bf16)["codecs"][0].pop("configuration")
    assert _errors(ARRAY, bf16)


# ------------------------------------------- training state (training-state.md, rng-and-data.md)

TS_SCHEMA = json.loads((SPEC / "schema" / "training-state-v1.schema.json").read_text())
GOLDEN_TS = SPEC.parent / "conformance" / "golden" / "v1" / "training_state" / "checkpoint" / "zarr.json"


def _ts(name: str) -> Draft202012Validator:
    """A validator for ``$defs/<name>`` of the training-state schema."""
    return Draft202012Validator({**TS_SCHEMA, "$ref": f"#/$defs/{name}"})


def _under(meta: dict, key: str, kind: str) -> dict:
    """``meta[kind]`` ("values" or "tensors") under object key ``key``, by the rest of the flat key."""
    return {k[len(key) + 1:]: v for k, v in meta[kind].items() if k.startswith(key + "/")}


def _check_training_state(meta: dict, pairs=(), non_finite=()) -> None:
    """optim/, data/ and rng/ of a root index, and the scheduler members ``pairs`` (values)
    and ``non_finite`` (tensors), conform to their $defs."""
    parts = {
        "optimizerValues": _under(meta, "optim", "values"),
        "optimizerTensors": _under(meta, "optim", "tensors"),
        "samplerValues": _under(meta, "data", "values"),
        "rngTensors": _under(meta, "rng", "tensors"),
    }
    checks = [*parts.items(), *(("schedulerPairs", meta["values"][k]) for k in pairs),
              *(("schedulerNonFiniteFloat", meta["tensors"][k]) for k in non_finite)]
    for name, doc in checks:
        assert _errors(_ts(name), doc) == [], name
    assert parts["optimizerTensors"] and not _under(meta, "data", "tensors") and not _under(meta, "rng", "values")


def test_training_state_schema_is_valid_draft_2020_12():
    Draft202012Validator.check_schema(TS_SCHEMA)


def test_training_state_golden_conforms():
    doc = json.loads(GOLDEN_TS.read_bytes())
    assert _errors(ROOT, doc) == []
    meta = doc["attributes"]["tensorckpt"]
    assert not _under(meta, "sched", "tensors")  # MultiStepLR: nothing that is not finite
    _check_training_state(meta, pairs=["sched/milestones"])


def test_fresh_training_state_conforms(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)  # best = inf: a 0-d float64 tensor
    sampler = tensorckpt.ResumableSampler(10, seed=5)
    sampler.advance(3)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    sched.step()
    state = {"model": model, "optim": opt, "sched": sched, "plateau": plateau, "data": sampler, "rng": tensorckpt.rng_state()}
    tensorckpt.save(state, tmp_path / "ckpt")
    doc = json.loads((tmp_path / "ckpt" / "zarr.json").read_bytes())
    assert _errors(ROOT, doc) == []
    meta = doc["attributes"]["tensorckpt"]
    assert not _under(meta, "sched", "tensors") and sorted(_under(meta, "plateau", "tensors")) == ["best", "mode_worse"]
    assert meta["values"]["data/rank/0/consumed"] == 3 and meta["values"]["optim/state/0.weight/step"] == 1.0
    _check_training_state(meta, non_finite=["plateau/best", "plateau/mode_worse"])


def _golden_ts_parts() -> dict:
    meta = json.loads(GOLDEN_TS.read_bytes())["attributes"]["tensorckpt"]
    return {
        "optimizerValues": _under(meta, "optim", "values"),
        "samplerValues": _under(meta, "data", "values"),
        "rngTensors": _under(meta, "rng", "tensors"),
        "schedulerPairs": meta["values"]["sched/milestones"],
        "schedulerNonFiniteFloat": {"dtype": "float64", "data_type": "float64", "shape": [], "chunk_shape": [], "inner_chunk_shape": []},
    }


def _group(v):
    return v["param_groups"][0]


BROKEN_TRAINING_STATE = {
    "param_groups with integer params ids": ("optimizerValues", lambda v: _group(v).update(params=[0, 1, 2, 3])),
    "param_groups stores param_names": ("optimizerValues", lambda v: _group(v).update(param_names=_group(v)["params"])),
    "param group without params": ("optimizerValues", lambda v: _group(v).pop("params")),
    "no param_groups": ("optimizerValues", lambda v: v.pop("param_groups")),
    "state/<fqn> value not {}": ("optimizerValues", lambda v: v.update({"state/0.bias": {"step": 2.0}})),
    "optimizer key outside the table": ("optimizerValues", lambda v: v.update({"defaults": {}})),
    "sampler with negative epoch": ("samplerValues", lambda v: v.update(epoch=-1)),
    "consumed not an integer": ("samplerValues", lambda v: v.update({"rank/0/consumed": 4.5})),
    "consumed a string": ("samplerValues", lambda v: v.update({"rank/0/consumed": "4"})),
    "no count for rank 0": ("samplerValues", lambda v: v.pop("rank/0/consumed")),
    "sampler version 2": ("samplerValues", lambda v: v.update(version=2)),
    "seed 2^64": ("samplerValues", lambda v: v.update(seed=2**64)),
    "shuffle not a boolean": ("samplerValues", lambda v: v.update(shuffle=1)),
    "world 0": ("samplerValues", lambda v: v.update(world=0)),
    "segment without counts": ("samplerValues", lambda v: v.update(segments=[[2]])),
    "segment with a negative count": ("samplerValues", lambda v: v.update(segments=[[2, [1, -1]]])),
    "rng torch as int64": ("rngTensors", lambda t: t["torch"].update(dtype="int64", data_type="int64")),
    "rng numpy 624 wide": ("rngTensors", lambda t: t["numpy"].update(shape=[1, 624])),
    "rng python without the rank dimension": ("rngTensors", lambda t: t["python"].update(shape=[628])),
    "rng without python": ("rngTensors", lambda t: t.pop("python")),
    "rng member outside the table": ("rngTensors", lambda t: t.update(mps=t["torch"])),
    "milestones with string keys": ("schedulerPairs", lambda v: v.__setitem__(slice(None), [["2", 1], ["4", 1]])),
    "milestones pair of 3": ("schedulerPairs", lambda v: v[0].append(0)),
    "non-finite float as float32": ("schedulerNonFiniteFloat", lambda e: e.update(dtype="float32", data_type="float32")),
    "non-finite float 1-D": ("schedulerNonFiniteFloat", lambda e: e.update(shape=[1], chunk_shape=[1], inner_chunk_shape=[1])),
}


@pytest.mark.parametrize("name", sorted(BROKEN_TRAINING_STATE))
def test_broken_training_state_fails(name):
    kind, mutate = BROKEN_TRAINING_STATE[name]
    doc = _golden_ts_parts()[kind]
    assert _errors(_ts(kind), doc) == []
    mutate(doc)
    assert _errors(_ts(kind), doc), f"{name}: accepted"


# ----------------------------------------- the 1.2 training-state layout (training-state.md 3.3, 4.2, 5)

GOLDEN_TS_1_2 = SPEC.parent / "conformance" / "golden" / "v1" / "training_state_1_2" / "checkpoint" / "zarr.json"


def _golden_1_2_optimizer() -> dict:
    return _under(json.loads(GOLDEN_TS_1_2.read_bytes())["attributes"]["tensorckpt"], "optim", "values")


def test_training_state_1_2_golden_conforms():
    doc = json.loads(GOLDEN_TS_1_2.read_bytes())
    assert _errors(ROOT, doc) == []
    meta = doc["attributes"]["tensorckpt"]
    assert meta["format_version"] == "1.2"
    opt = _under(meta, "optim", "values")
    assert _errors(_ts("optimizerValues12"), opt) == [] and _errors(_ts("optimizerValues"), opt) == []
    assert _errors(_ts("optimizerTensors"), _under(meta, "optim", "tensors")) == []
    assert _errors(_ts("schedulerClass"), meta["values"]["sched/class"]) == []
    assert _errors(_ts("tiedTo"), meta["values"]["tied/head.weight/tied_to"]) == []
    assert "tied/head.weight" not in meta["tensors"]


def _first_group_key(v: dict) -> str:
    return next(k for k in sorted(v) if k.startswith("groups/"))


BROKEN_OPTIMIZER_1_2 = {
    "neither class nor group_of": lambda v: [v.pop(k) for k in [k for k in v if k == "class" or k.startswith("group_of/")]],
    "group id not hex": lambda v: v.update({"group_of/0.bias": "G1"}),
    "group id an integer": lambda v: v.update({"group_of/0.bias": 0}),
    "param_groups next to the 1.2 keys": lambda v: v.update(param_groups=[{"params": ["0.bias"]}]),
    "groups/<id> value not {}": lambda v: v.update({_first_group_key(v).rsplit("/", 1)[0]: {"lr": 1}}),
    "hyperparameter nested below its name": lambda v: v.update({_first_group_key(v) + "/x": 1}),
}


def test_optimizer_1_2_without_class_is_valid():
    """K/class may be absent (a checkpoint converted from DCP, which records no class; training-state.md 4.2)."""
    doc = _golden_1_2_optimizer()
    doc.pop("class")
    assert _errors(_ts("optimizerValues12"), doc) == [] and _errors(_ts("optimizerValues"), doc) == []


@pytest.mark.parametrize("name", sorted(BROKEN_OPTIMIZER_1_2))
def test_broken_optimizer_1_2_fails(name):
    doc = _golden_1_2_optimizer()
    assert _errors(_ts("optimizerValues"), doc) == []
    BROKEN_OPTIMIZER_1_2[name](doc)
    assert _errors(_ts("optimizerValues"), doc), f"{name}: accepted"
