"""Interoperability with zarr-python, both directions.

(a) tensorckpt writes, zarr-python reads it in a fresh process that never
    imports tensorckpt (bfloat16 / float8 through the ``zarr.data_type`` entry
    points of the stand-alone module ``tensorckpt_zarr_dtypes``).
(b) zarr-python alone writes a checkpoint by the format rules (root group whose
    attributes.tensorckpt index is written last; sharding_indexed arrays with
    [bytes, crc32c] codecs and index codecs; every chunk stored), and tensorckpt
    reads it bit-exactly.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import tensorckpt
from tensorckpt.format.keys import escape

pytestmark = pytest.mark.usefixtures("fresh_plan_cache")

CORE = [torch.float64, torch.float32, torch.float16, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.uint8, torch.bool, torch.complex64, torch.complex128]
EXTENDED = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
NUMPY_NAME = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16", torch.int8: "int8",
              torch.int16: "int16", torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8",
              torch.bool: "bool", torch.complex64: "complex64", torch.complex128: "complex128",
              torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


def _sample(dtype, shape, seed):
    n = math.prod(shape)
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _state_for(dtypes):
    """Nested state with escaped-name groups, several shape classes, per dtype."""
    state = {"model": {}, "": {}, "a/b": {}, "__x": {}, "..": {}}
    for i, dt in enumerate(dtypes):
        name = NUMPY_NAME[dt]
        state["model"][name] = _sample(dt, (7, 5), i)
        state["model"][name + ".T"] = _sample(dt, (4, 3), 100 + i).t()  # non-contiguous source
        state[""][name] = _sample(dt, (), 200 + i)
        state["a/b"][name] = _sample(dt, (0, 3), 300 + i)
        state["__x"][name] = _sample(dt, (2, 3, 4), 400 + i)
        state[".."][name] = torch.zeros(6, dtype=dt)  # equal to the fill value: stored anyway
    state["step"] = 7
    return state


def _leaves(state, prefix=()):
    for k, v in state.items():
        if isinstance(v, dict):
            yield from _leaves(v, prefix + (k,))
        else:
            yield prefix + (k,), v


READER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import zarr

    root_dir, manifest_path, extended = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    if extended:
        # zarr-python 3.1 collects the zarr.data_type entry points but loads them lazily
        from zarr.dtype import data_type_registry
        data_type_registry._lazy_load()
        assert "bfloat16" in data_type_registry.contents, sorted(data_type_registry.contents)
    manifest = json.load(open(manifest_path))
    root = zarr.open_group(root_dir, mode="r", zarr_format=3)
    index = root.attrs["tensorckpt"]
    assert index["format_version"] == manifest["format_version"], index["format_version"]
    assert index["format_version"].split(".")[0] == "1"
    assert index["values"] == manifest["values"], index["values"]
    for item in manifest["tensors"]:
        node = root
        for name in item["path"][:-1]:
            node = node[name]
            assert isinstance(node, zarr.Group), item["path"]
        arr = node[item["path"][-1]]
        assert isinstance(arr, zarr.Array), item["path"]
        assert arr.shape == tuple(item["shape"]), (item["path"], arr.shape)
        assert arr.dtype == np.dtype(item["numpy"]) if not extended else str(arr.dtype) == item["numpy"], arr.dtype
        assert arr.attrs["tensorckpt"]["dtype"] == item["dtype"]
        assert index["tensors"][item["flat_key"]]["shape"] == item["shape"]
        data = arr[...]
        got = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        want = np.load(item["raw"])
        assert got.tobytes() == want.tobytes(), ("bytes differ", item["path"])
        if len(item["shape"]) >= 1 and item["shape"][0] > 2:  # partial read
            part = np.ascontiguousarray(arr[1:3]).reshape(-1).view(np.uint8)
            assert part.tobytes() == np.ascontiguousarray(data[1:3]).reshape(-1).view(np.uint8).tobytes()
    assert "tensorckpt" not in sys.modules, "the reader imported tensorckpt"
    assert not any(m.startswith("tensorckpt.") for m in sys.modules)
    print("READ", len(manifest["tensors"]))
    """
)


def _write_and_read_with_zarr(tmp_path, dtypes, extended: bool):
    state = _state_for(dtypes)
    ckpt = tmp_path / "ckpt"
    # small shards so zarr-python also reads multi-shard, multi-inner-chunk arrays
    tensorckpt.save(state, ckpt, shard_bytes=64, inner_chunk_bytes=16)
    items = []
    for i, (path, v) in enumerate(_leaves(state)):
        if not isinstance(v, torch.Tensor):
            continue
        raw = tmp_path / f"raw{i}.npy"
        np.save(raw, _raw(v))
        items.append({
            "path": [escape(p) for p in path],
            "flat_key": "/".join(escape(p) for p in path),
            "shape": list(v.shape),
            "dtype": NUMPY_NAME[v.dtype],
            "numpy": NUMPY_NAME[v.dtype],
            "raw": str(raw),
        })
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"format_version": tensorckpt.FORMAT_VERSION, "tensors": items,
                                    "values": {"step": 7}}))
    proc = subprocess.run([sys.executable, "-c", READER, str(ckpt), str(manifest), "1" if extended else "0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"READ {len(items)}"
    assert len(items) == 6 * len(dtypes)


def test_zarr_python_reads_tensorckpt_core_dtypes(tmp_path):
    _write_and_read_with_zarr(tmp_path, CORE, extended=False)


def test_zarr_python_reads_tensorckpt_bfloat16_float8(tmp_path):
    pytest.importorskip("tensorckpt_zarr_dtypes")
    _write_and_read_with_zarr(tmp_path, EXTENDED, extended=True)


# ----------------------------------------------------------------- (b) zarr-python writes


def _zarr_write_checkpoint(root_dir, state, inner_of, shard_of, user_metadata):
    """Write ``state`` as a tensorckpt v1 checkpoint using only zarr-python and
    json, following the format rules; return the index it committed."""
    import zarr
    from zarr.codecs import BytesCodec, Crc32cCodec

    root = zarr.open_group(str(root_dir), mode="w", zarr_format=3)  # attributes come last
    tensors, values = {}, {}
    for path, v in _leaves(state):
        flat = "/".join(escape(p) for p in path)
        if not isinstance(v, torch.Tensor):
            values[flat] = v
            continue
        group = root
        for name in path[:-1]:
            group = group.require_group(escape(name))
        dtype = NUMPY_NAME[v.dtype]
        npy = v.detach().contiguous()
        if v.dtype in EXTENDED:
            import ml_dtypes
            data = npy.view(torch.uint8 if v.element_size() == 1 else torch.int16).numpy().view(getattr(ml_dtypes, dtype))
        else:
            data = npy.numpy()
        shard, inner = shard_of(v), inner_of(v)
        fill = 0j if v.is_complex() else (False if v.dtype == torch.bool else 0)
        arr = group.create_array(
            escape(path[-1]),
            shape=tuple(v.shape),
            dtype=data.dtype,
            chunks=inner,
            shards=shard,
            serializer=BytesCodec(endian="little"),
            compressors=[Crc32cCodec()],
            filters=[],
            fill_value=fill,
            attributes={"tensorckpt": {"dtype": dtype}},
            config={"write_empty_chunks": True},  # format rule: every chunk is stored
        )
        if v.numel():
            arr[...] = data
        tensors[flat] = {"dtype": dtype, "data_type": dtype, "shape": list(v.shape),
                         "chunk_shape": list(shard), "inner_chunk_shape": list(inner)}
    index = {
        "format_version": "1.0",
        "must_understand": [],
        "library_version": "zarr-python " + zarr.__version__,
        "created": "2025-01-01T00:00:00+00:00",
        "world_size": 1,
        "user_metadata": user_metadata,
        "tensors": tensors,
        "values": values,
    }
    # the commit: the root zarr.json with the index, written last, by hand
    doc = {"zarr_format": 3, "node_type": "group", "attributes": {"tensorckpt": index}}
    (root_dir / "zarr.json").write_text(json.dumps(doc))
    return index


def _layout(t):
    if t.dim() == 0:
        return (), ()
    shard = (min(max(t.shape[0], 1), 4),) + tuple(max(1, s) for s in t.shape[1:])
    inner = (min(shard[0], 2),) + shard[1:]
    if shard[0] % inner[0]:
        inner = shard
    return shard, inner


def _zarr_state(dtypes):
    state = {"enc": {"layers.0": {}}, "": {}, "a/b": {}, "step": 5, "cfg": {"lr": 0.5, "betas": [0.9, 0.99]}}
    for i, dt in enumerate(dtypes):
        name = NUMPY_NAME[dt]
        state["enc"]["layers.0"][name] = _sample(dt, (7, 5), i)  # 7 rows: a partial edge shard
        # (no 0-d tensors here: zarr-python 3.1.6 cannot write a 0-d sharded
        # array, IndexError in the sharding codec; it reads them, see (a))
        state[""][name] = _sample(dt, (3,), 50 + i)
        state["a/b"][name] = _sample(dt, (3, 0), 60 + i)
        state["a/b"][name + "_zeros"] = torch.zeros(5, 2, dtype=dt)
    return state


def _check_tensorckpt_reads(root_dir, state, user_metadata):
    ckpt = tensorckpt.open(root_dir)
    assert ckpt.metadata.user_metadata == user_metadata
    back = ckpt.to_state_dict()
    target = {}
    for path, v in _leaves(state):
        node_b, node_t = back, target
        for p in path[:-1]:
            node_b = node_b[p]
            node_t = node_t.setdefault(p, {})
        got = node_b[path[-1]]
        if isinstance(v, torch.Tensor):
            assert got.dtype == v.dtype and got.shape == v.shape, path
            assert torch.equal(_raw_t(got), _raw_t(v)), path
            node_t[path[-1]] = torch.empty(v.shape, dtype=v.dtype).t().contiguous().t() if v.dim() == 2 else \
                torch.empty(v.shape, dtype=v.dtype)
        else:
            assert got == v, path
            node_t[path[-1]] = None
    out = tensorckpt.load(target, root_dir)
    for path, v in _leaves(state):
        node = out
        for p in path[:-1]:
            node = node[p]
        if isinstance(v, torch.Tensor):
            assert torch.equal(_raw_t(node[path[-1]]), _raw_t(v)), path
        else:
            assert node[path[-1]] == v
    # partial read across the zarr-python shard boundary
    name = NUMPY_NAME[next(v.dtype for p, v in _leaves(state) if isinstance(v, torch.Tensor))]
    full = state["enc"]["layers.0"][name]
    assert torch.equal(_raw_t(ckpt.read(("enc", "layers.0", name), (slice(3, 6),))), _raw_t(full[3:6]))


def _raw_t(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def test_tensorckpt_reads_zarr_python_checkpoint_core_dtypes(tmp_path):
    state = _zarr_state(CORE)
    root_dir = tmp_path / "zp"
    meta = {"writer": "zarr-python", "n": 1}
    _zarr_write_checkpoint(root_dir, state, lambda t: _layout(t)[1], lambda t: _layout(t)[0], meta)
    _check_tensorckpt_reads(root_dir, state, meta)


def test_tensorckpt_reads_zarr_python_checkpoint_bfloat16_float8(tmp_path):
    mod = pytest.importorskip("tensorckpt_zarr_dtypes")
    mod.register()
    state = _zarr_state(EXTENDED)
    root_dir = tmp_path / "zp"
    _zarr_write_checkpoint(root_dir, state, lambda t: _layout(t)[1], lambda t: _layout(t)[0], {})
    _check_tensorckpt_reads(root_dir, state, {})


def test_zarr_python_array_metadata_matches_tensorckpt(tmp_path):
    """The zarr.json zarr-python writes by the rules equals, on every field
    tensorckpt writes, what tensorckpt itself writes for the same tensor."""
    t = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    tensorckpt.save({"w": t}, tmp_path / "tc", shard_bytes=48, inner_chunk_bytes=16)
    info = tensorckpt.open(tmp_path / "tc").info("w")
    _zarr_write_checkpoint(tmp_path / "zp", {"w": t}, lambda _: info.inner_chunk_shape,
                           lambda _: info.chunk_shape, {})
    ours = json.loads((tmp_path / "tc" / "w" / "zarr.json").read_text())
    theirs = json.loads((tmp_path / "zp" / "w" / "zarr.json").read_text())

    def norm(doc):
        doc = dict(doc)
        doc.pop("storage_transformers", None)
        doc.pop("dimension_names", None)
        doc["chunk_key_encoding"] = {"name": "default", "configuration": {"separator": "/"}}
        cfg = doc["codecs"][0]["configuration"]
        cfg.setdefault("index_location", "end")
        for member in ("checkpoint_id", "chunk_digests"):  # format 1.3's (spec 7.1); the hand-written one is 1.0
            doc["attributes"]["tensorckpt"].pop(member, None)
        return doc

    assert norm(ours) == norm(theirs)
    assert ours["codecs"][0]["name"] == "sharding_indexed"
    assert ours["codecs"][0]["configuration"]["codecs"] == [
        {"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
    assert ours["codecs"][0]["configuration"]["index_codecs"] == ours["codecs"][0]["configuration"]["codecs"]
    # the same stored objects (byte layout inside a shard may differ: the
    # order of inner chunks is the writer's choice), and the same content
    a = sorted(p.relative_to(tmp_path / "tc") for p in (tmp_path / "tc" / "w" / "c").rglob("*") if p.is_file())
    b = sorted(p.relative_to(tmp_path / "zp") for p in (tmp_path / "zp" / "w" / "c").rglob("*") if p.is_file())
    assert a == b and len(a) > 1
    for rel in a:
        assert len((tmp_path / "tc" / rel).read_bytes()) == len((tmp_path / "zp" / rel).read_bytes()), rel
    assert torch.equal(tensorckpt.open(tmp_path / "zp").read("w"), t)
