"""zarr-python <-> TensorStore interop for bfloat16 / float8_e4m3fn / float8_e5m2.

Covers tensorckpt_zarr_dtypes: TensorStore-written arrays read bit-exactly by
zarr-python and the reverse, fill-value JSON encodings, the failure a plain
zarr-python install gives, and the ``zarr.data_type`` entry points.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import zarr

import tensorckpt_zarr_dtypes
from tensorckpt_zarr_dtypes import BFloat16, Float8E4M3FN, Float8E5M2

tensorckpt_zarr_dtypes.register()

# zarr's empty-chunk check compares chunks with a NaN fill value through np.array_equal,
# which NumPy warns about for these types; harmless.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in equal:RuntimeWarning")

# What zarr-python 3.1.6 raises when these data types are not registered. It
# fails while parsing zarr.json, before any codec or chunk is touched.
NO_DTYPE_ERROR = ValueError
NO_DTYPE_READ_MESSAGE = "No Zarr data type found that matches 'bfloat16'"  # exact str(exc)
NO_DTYPE_CREATE_MESSAGE = "No Zarr data type found that matches dtype 'dtype(bfloat16)'"

DTYPES = {
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}
ZDTYPES = {"bfloat16": BFloat16, "float8_e4m3fn": Float8E4M3FN, "float8_e5m2": Float8E5M2}
# Fill values for the bulk tests, as bit patterns: non-canonical NaN, -NaN, -inf.
BULK_FILL = {"bfloat16": 0x7FE0, "float8_e4m3fn": 0xFF, "float8_e5m2": 0xFC}
LE_BYTES = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


def _uint(name: str) -> np.dtype[Any]:
    return np.dtype(f"<u{np.dtype(DTYPES[name]).itemsize}")


def _bits(a: Any) -> np.ndarray:
    """Bit patterns of a float array, as native unsigned ints, whatever its byte order."""
    a = np.asarray(a)
    uint = np.dtype(f"u{a.dtype.itemsize}")
    order = a.dtype.byteorder if a.dtype.byteorder in "<>" else "="
    return a.view(uint.newbyteorder(order)).astype(uint)  # type: ignore[arg-type]


def _scalar_bits(name: str, value: Any) -> int:
    return int(_bits(np.array(value, dtype=DTYPES[name])))


def _all_patterns(name: str) -> np.ndarray:
    """Every bit pattern of the type (all NaN payloads, +-0, subnormals, +-inf), as 2-D."""
    n = 256 if np.dtype(DTYPES[name]).itemsize == 2 else 16
    return np.arange(n * n, dtype=_uint(name)).reshape(n, n)


def _layout(name: str) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """shape, chunk (or shard) shape, inner chunk shape: the array is wider than the
    written patterns, so the last column of chunks/shards stays at the fill value."""
    n = _all_patterns(name).shape[0]
    return (n, n + n // 4), (n // 2, n // 2), (n // 4, n // 4)


def _ts_spec(path: Path, name: str, layout: str, fill: Any) -> dict[str, Any]:
    shape, outer, inner = _layout(name)
    if layout == "sharded":
        codecs: list[Any] = [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(inner),
                    "codecs": LE_BYTES,
                    "index_codecs": LE_BYTES,
                },
            }
        ]
    elif layout == "big_endian":
        codecs = [{"name": "bytes", "configuration": {"endian": "big"}}, {"name": "crc32c"}]
    else:
        codecs = LE_BYTES
    metadata = {
        "shape": list(shape),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(outer)}},
        "data_type": name,
        "codecs": codecs,
        "fill_value": fill,
    }
    kvstore = {"driver": "file", "path": str(path)}
    return {"driver": "zarr3", "kvstore": kvstore, "metadata": metadata}


def _ts_open(path: Path, driver: str = "zarr3") -> Any:
    return ts.open({"driver": driver, "kvstore": {"driver": "file", "path": str(path)}}).result()


def _expected(name: str) -> np.ndarray:
    shape, _, _ = _layout(name)
    patterns = _all_patterns(name)
    expected = np.full(shape, BULK_FILL[name], dtype=_uint(name))
    expected[:, : patterns.shape[1]] = patterns
    return expected


@pytest.mark.parametrize("layout", ["plain", "sharded", "big_endian"])
@pytest.mark.parametrize("name", list(DTYPES))
def test_tensorstore_writes_zarr_reads_bit_exact(tmp_path: Path, name: str, layout: str) -> None:
    hex_fill = f"0x{BULK_FILL[name]:0{2 * np.dtype(DTYPES[name]).itemsize}x}"
    store = ts.open(_ts_spec(tmp_path / "a", name, layout, hex_fill), create=True).result()
    patterns = _all_patterns(name)
    store[:, : patterns.shape[1]] = patterns.view(DTYPES[name])

    arr = zarr.open_array(tmp_path / "a", mode="r")
    got = np.asarray(arr[...])
    assert got.dtype.type is DTYPES[name]
    assert isinstance(arr.metadata.dtype, ZDTYPES[name])
    assert _scalar_bits(name, arr.metadata.fill_value) == BULK_FILL[name]
    expected = _expected(name)
    assert np.array_equal(_bits(got), expected)
    little_endian_bytes = _bits(got).astype(_uint(name)).view(np.uint8)
    assert little_endian_bytes.tobytes() == expected.view(np.uint8).tobytes()
    # partial reads across chunk boundaries too
    assert np.array_equal(_bits(arr[3:-3, 5:-1]), expected[3:-3, 5:-1])


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
@pytest.mark.parametrize("name", list(DTYPES))
def test_zarr_writes_tensorstore_reads_bit_exact(tmp_path: Path, name: str, sharded: bool) -> None:
    shape, outer, inner = _layout(name)
    fill = np.array(BULK_FILL[name], dtype=_uint(name)).view(DTYPES[name])[()]
    arr = zarr.create_array(
        tmp_path / "a",
        shape=shape,
        chunks=inner if sharded else outer,
        shards=outer if sharded else None,
        dtype=DTYPES[name],
        fill_value=fill,
    )
    patterns = _all_patterns(name)
    arr[:, : patterns.shape[1]] = patterns.view(DTYPES[name])

    meta = json.loads((tmp_path / "a" / "zarr.json").read_text())
    assert meta["data_type"] == name
    fill_back = ZDTYPES[name]().from_json_scalar(meta["fill_value"], zarr_format=3)
    assert _scalar_bits(name, fill_back) == BULK_FILL[name]

    store = _ts_open(tmp_path / "a")
    assert store.dtype.name == name
    assert np.array_equal(_bits(store.read().result()), _expected(name))
    assert np.array_equal(_bits(zarr.open_array(tmp_path / "a", mode="r")[...]), _expected(name))


# A whole chunk that equals the fill value numerically but not bitwise:
# (data_type, fill bits, chunk bits).
NOT_IDENTICAL_TO_FILL = [
    ("bfloat16", 0x0000, 0x8000),  # -0.0 vs 0.0
    ("bfloat16", 0x7FC0, 0x7FE0),  # NaN payloads
    ("float8_e4m3fn", 0x00, 0x80),
    ("float8_e4m3fn", 0x7F, 0xFF),
    ("float8_e5m2", 0x00, 0x80),
    ("float8_e5m2", 0x7E, 0x7D),
]
# zarr-python 3.1.6 drops such a chunk by default (write_empty_chunks=False) for
# these cases, so it reads back as the fill value. NDBuffer.all_equal compares
# bitwise only for +-0.0 with dtype kind "f"; bfloat16 and float8_e4m3fn are kind
# "V" and float8_e5m2 is kind "f". zarr 3.1.0 has no +-0.0 special case, so it
# also drops ("float8_e5m2", 0x80). TensorStore always compares bitwise.
DROPPED_BY_DEFAULT = {("bfloat16", 0x8000), ("float8_e4m3fn", 0x80), ("float8_e5m2", 0x7D)}


@pytest.mark.parametrize(("name", "fill_bits", "chunk_bits"), NOT_IDENTICAL_TO_FILL)
def test_chunk_equal_but_not_identical_to_fill(
    tmp_path: Path, name: str, fill_bits: int, chunk_bits: int
) -> None:
    fill = np.array(fill_bits, dtype=_uint(name)).view(DTYPES[name])[()]
    data = np.full(4, chunk_bits, dtype=_uint(name)).view(DTYPES[name])
    for write_empty_chunks in (True, False):
        path = tmp_path / str(write_empty_chunks)
        arr = zarr.create_array(
            path,
            shape=(4,),
            dtype=DTYPES[name],
            fill_value=fill,
            config={"write_empty_chunks": write_empty_chunks},
        )
        arr[...] = data
        got = _bits(_ts_open(path).read().result())
        if write_empty_chunks:  # the bit-exact way to write with zarr-python
            assert np.all(got == chunk_bits)
        elif zarr.__version__ == "3.1.6":
            dropped = (name, chunk_bits) in DROPPED_BY_DEFAULT
            assert np.all(got == (fill_bits if dropped else chunk_bits))


# (data_type, fill_value given to TensorStore, fill_value TensorStore writes, bits)
FILL_CASES: list[tuple[str, Any, Any, int]] = [
    ("bfloat16", 0.0, 0.0, 0x0000),
    ("bfloat16", -0.0, -0.0, 0x8000),
    ("bfloat16", 1.5, 1.5, 0x3FC0),
    ("bfloat16", 3.3895313892515355e38, 3.3895313892515355e38, 0x7F7F),
    ("bfloat16", "NaN", "NaN", 0x7FC0),
    ("bfloat16", "0x7fc0", "NaN", 0x7FC0),
    ("bfloat16", float("nan"), "0x7fe0", 0x7FE0),  # TensorStore turns a Python nan into 0x7fe0
    ("bfloat16", "0xffc1", "0xffc1", 0xFFC1),
    ("bfloat16", "0x3F80", 1.0, 0x3F80),
    ("bfloat16", "Infinity", "Infinity", 0x7F80),
    ("bfloat16", "-Infinity", "-Infinity", 0xFF80),
    ("float8_e4m3fn", 0.0, 0.0, 0x00),
    ("float8_e4m3fn", 448.0, 448.0, 0x7E),
    ("float8_e4m3fn", "0x01", 0.001953125, 0x01),
    ("float8_e4m3fn", "NaN", "NaN", 0x7F),
    ("float8_e4m3fn", "0xff", "0xff", 0xFF),
    ("float8_e4m3fn", "Infinity", "NaN", 0x7F),  # no infinities: TensorStore stores NaN
    ("float8_e5m2", -0.0, -0.0, 0x80),
    ("float8_e5m2", 57344.0, 57344.0, 0x7B),
    ("float8_e5m2", "NaN", "NaN", 0x7E),
    ("float8_e5m2", "0x7d", "0x7d", 0x7D),
    ("float8_e5m2", "Infinity", "Infinity", 0x7C),
    ("float8_e5m2", "-Infinity", "-Infinity", 0xFC),
]


def _json_equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return bool(a == b)


@pytest.mark.parametrize(("name", "given", "written", "bits"), FILL_CASES)
def test_fill_value_encodings(
    tmp_path: Path, name: str, given: Any, written: Any, bits: int
) -> None:
    zdtype = ZDTYPES[name]()
    # TensorStore -> zarr-python
    spec = _ts_spec(tmp_path / "ts", name, "plain", given)
    spec["metadata"]["shape"] = [2]
    spec["metadata"]["chunk_grid"]["configuration"]["chunk_shape"] = [2]
    store = ts.open(spec, create=True).result()
    ts_json = json.loads((tmp_path / "ts" / "zarr.json").read_text())["fill_value"]
    assert _json_equal(ts_json, written)
    assert np.all(_bits(store.read().result()) == bits)
    arr = zarr.open_array(tmp_path / "ts", mode="r")
    assert _scalar_bits(name, arr.metadata.fill_value) == bits
    assert np.all(_bits(arr[...]) == bits)
    # zarr-python encodes the same bits exactly as TensorStore does
    assert _json_equal(zdtype.to_json_scalar(arr.metadata.fill_value, zarr_format=3), written)
    # zarr-python -> TensorStore
    fill = np.array(bits, dtype=_uint(name)).view(DTYPES[name])[()]
    zarr.create_array(tmp_path / "z", shape=(2,), dtype=DTYPES[name], fill_value=fill)
    zarr_json = json.loads((tmp_path / "z" / "zarr.json").read_text())["fill_value"]
    assert _json_equal(zarr_json, written)
    assert np.all(_bits(_ts_open(tmp_path / "z").read().result()) == bits)


def test_fill_value_json_rejects() -> None:
    with pytest.raises(TypeError, match="no infinities"):
        Float8E4M3FN().from_json_scalar("Infinity", zarr_format=3)
    with pytest.raises(TypeError, match="hex"):
        BFloat16().from_json_scalar("0x7fc00000", zarr_format=3)
    with pytest.raises(TypeError):
        Float8E5M2().from_json_scalar("banana", zarr_format=3)
    assert _scalar_bits("bfloat16", BFloat16().from_json_scalar("0x7fc0", zarr_format=3)) == 0x7FC0


@pytest.mark.parametrize("name", list(DTYPES))
def test_zarr_v2_interop(tmp_path: Path, name: str) -> None:
    """TensorStore's zarr (v2) driver writes `"dtype": "<name>"`; read it both ways too."""
    patterns = _all_patterns(name).view(DTYPES[name])
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / "ts")}}
    metadata = {"shape": list(patterns.shape), "dtype": name}
    store = ts.open({**spec, "metadata": metadata}, create=True).result()
    store[...] = patterns
    assert np.array_equal(_bits(zarr.open_array(tmp_path / "ts", mode="r")[...]), _bits(patterns))

    # zarr-python's v2 path hands the array to numcodecs, whose compressors need the
    # buffer protocol, which ml_dtypes arrays lack ("cannot include dtype 'E' in a
    # buffer"): zarr-python can write these v2 arrays only uncompressed.
    arr = zarr.create_array(
        tmp_path / "z", shape=patterns.shape, dtype=DTYPES[name], zarr_format=2, compressors=None
    )
    arr[...] = patterns
    assert json.loads((tmp_path / "z" / ".zarray").read_text())["dtype"] == name
    back = _ts_open(tmp_path / "z", driver="zarr")
    assert np.array_equal(_bits(back.read().result()), _bits(patterns))


def test_register_is_idempotent() -> None:
    tensorckpt_zarr_dtypes.register()
    tensorckpt_zarr_dtypes.register()
    for name, cls in ZDTYPES.items():
        assert zarr.dtype.data_type_registry.get(name) is cls
        assert zarr.dtype.data_type_registry.match_json(name, zarr_format=3) == cls()


def _bf16_store(path: Path) -> None:
    store = ts.open(_ts_spec(path, "bfloat16", "plain", 0.0), create=True).result()
    store[...] = np.full(store.shape, 1.5, dtype=ml_dtypes.bfloat16)


def _run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )


def test_without_extension_zarr_fails(tmp_path: Path) -> None:
    """A zarr-python without these data types (entry point filtered out, flushed or
    not) cannot open the array or create one."""
    _bf16_store(tmp_path / "a")
    result = _run(
        f"""
        import importlib.metadata as im, sys
        _orig = im.entry_points
        def _filtered(**kw):
            eps = _orig(**kw)
            if isinstance(eps, dict):  # Python < 3.12 without arguments: SelectableGroups
                eps = [e for group in eps.values() for e in group]
            return im.EntryPoints(e for e in eps if not (
                e.group == "zarr.data_type" and e.value.startswith("tensorckpt_zarr_dtypes:")))
        im.entry_points = _filtered
        import ml_dtypes, zarr
        from zarr.dtype import data_type_registry
        getattr(data_type_registry, "_lazy_load", lambda: None)()
        assert "tensorckpt_zarr_dtypes" not in sys.modules
        for call in (
            lambda: zarr.open_array({str(tmp_path / "a")!r}, mode="r"),
            lambda: zarr.create_array(
                {str(tmp_path / "b")!r}, shape=(2,), dtype=ml_dtypes.bfloat16
            ),
        ):
            try:
                call()
            except Exception as e:
                print(type(e).__name__, str(e), sep="|")
            else:
                print("no error")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"{NO_DTYPE_ERROR.__name__}|{NO_DTYPE_READ_MESSAGE}",
        f"{NO_DTYPE_ERROR.__name__}|{NO_DTYPE_CREATE_MESSAGE}",
    ]


def test_entry_points_declared() -> None:
    eps = {e.name: e.value for e in importlib.metadata.entry_points(group="zarr.data_type")}
    assert eps == {
        "bfloat16": "tensorckpt_zarr_dtypes:BFloat16",
        "float8_e4m3fn": "tensorckpt_zarr_dtypes:Float8E4M3FN",
        "float8_e5m2": "tensorckpt_zarr_dtypes:Float8E5M2",
    }


def test_entry_point_loads_module_in_fresh_process(tmp_path: Path) -> None:
    """zarr collects the entry points at import; loading them (zarr's own
    `_lazy_load`) imports this module and the array opens, with no explicit
    import of tensorckpt_zarr_dtypes. zarr-python 3.1.x never calls
    `_lazy_load()` for data types itself (see the last test), so this test
    flushes the list when zarr has not already loaded the types."""
    _bf16_store(tmp_path / "a")
    result = _run(
        f"""
        import sys
        import numpy as np, zarr
        from zarr.dtype import data_type_registry
        assert "tensorckpt_zarr_dtypes" not in sys.modules
        pending = [e.name for e in getattr(data_type_registry, "_lazy_load_list", [])]
        if "bfloat16" not in data_type_registry.contents:
            assert {{"bfloat16", "float8_e4m3fn", "float8_e5m2"}} <= set(pending), pending
            data_type_registry._lazy_load()
        assert "tensorckpt_zarr_dtypes" in sys.modules
        a = zarr.open_array({str(tmp_path / "a")!r}, mode="r")[...]
        assert a.dtype.name == "bfloat16" and (a.astype(np.float32) == 1.5).all()
        """
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(not zarr.__version__.startswith("3.1."), reason="pins zarr 3.1.x behaviour")
def test_zarr_31_does_not_load_data_type_entry_points_itself(tmp_path: Path) -> None:
    """zarr-python 3.1.x collects `zarr.data_type` entry points but never loads
    them, so without `import tensorckpt_zarr_dtypes` (or `register()`, or a manual
    `_lazy_load()`), opening fails even though the entry point is installed."""
    _bf16_store(tmp_path / "a")
    result = _run(
        f"""
        import sys, zarr
        try:
            zarr.open_array({str(tmp_path / "a")!r}, mode="r")
        except ValueError as e:
            print(str(e))
        assert "tensorckpt_zarr_dtypes" not in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == NO_DTYPE_READ_MESSAGE
