"""Bad input to ``tensorckpt.convert``: malformed safetensors (truncated,
bad JSON, a header beyond the 100 MB cap, overlapping or out-of-file
offsets, dtypes tensorckpt cannot store: uint16/32, float8 e8m0 and the
fnuz variants, float4, complex32, in safetensors, DCP and torch.save sources,
or asked for with ``dtype=``), a broken or incomplete
``model.safetensors.index.json`` (also for ``load_safetensors``), DCP
directories with missing or truncated ``.distcp`` files, an existing
destination. Each is a
TensorckptError naming the file and the tensor, raised before anything is
committed: no destination appears and no staging directory is left. ~2 s.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import warnings

import pytest
import torch

import tensorckpt
from tensorckpt.interchange import safetensors as st


def _raw(path, header: dict, data: bytes = b"", size_override: int | None = None) -> None:
    raw = json.dumps(header).encode()
    n = len(raw) if size_override is None else size_override
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + raw + data)


def _nothing_committed(tmp_path, dst="ck") -> None:
    assert not (tmp_path / dst).exists()
    assert not [n for n in os.listdir(tmp_path) if "tensorckpt-" in n]


GOOD = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "I64", "shape": [1], "data_offsets": [16, 24]}}


def test_well_formed_hand_written_file_converts(tmp_path):
    data = struct.pack("<4f", 1, 2, 3, 4) + struct.pack("<q", 7)
    _raw(tmp_path / "m.safetensors", GOOD, data)
    tensorckpt.convert(tmp_path / "m.safetensors", tmp_path / "ck", progress=False)
    ck = tensorckpt.open(tmp_path / "ck")
    assert ck.read("a").tolist() == [[1, 2], [3, 4]] and ck.read("b").tolist() == [7]


@pytest.mark.parametrize("case, header, data, size, match", [
    ("short", None, b"", None, "too short"),
    ("header past end", GOOD, b"", 10_000, "runs past the end"),
    ("over cap", GOOD, b"", st.MAX_HEADER_BYTES + 1, "exceeds the cap of 100000000"),
    ("not json", None, b"", None, "not valid JSON"),
    ("data cut", GOOD, b"\0" * 20, None, r"'b'.*run past the end"),
    ("overlap", {"a": GOOD["a"], "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, b"\0" * 16, None,
     "overlap"),
    ("size mismatch", {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None,
     r"'a'.*hold 8 bytes.*needs 12"),
    ("reversed offsets", {"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, b"\0" * 8, None,
     r"'a'.*begin <= end"),
    ("bad shape", {"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", None, "non-negative"),
    ("unknown dtype", {"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}, b"\0", None, "unknown dtype 'Q7'"),
    ("uint16", {"a": {"dtype": "U16", "shape": [1], "data_offsets": [0, 2]}}, b"\0\0", None,
     r"'a' has dtype U16, which tensorckpt cannot store"),
    ("float8 e8m0", {"a": {"dtype": "F8_E8M0", "shape": [1], "data_offsets": [0, 1]}}, b"\0", None,
     r"'a' has dtype F8_E8M0, which tensorckpt cannot store.*F8_E4M3, F8_E5M2"),
    ("float4", {"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0", None,
     r"'a' has dtype F4, which tensorckpt cannot store"),
    ("extra member", {"a": {**GOOD["a"], "x": 1}}, b"\0" * 16, None, "exactly"),
    ("bad metadata", {"__metadata__": {"k": 1}}, b"", None, "__metadata__"),
])
def test_malformed_safetensors_is_refused_before_commit(tmp_path, case, header, data, size, match):
    path = tmp_path / "m.safetensors"
    if case == "short":
        path.write_bytes(b"\x01\x02")
    elif case == "not json":
        path.write_bytes(struct.pack("<Q", 5) + b"{nope")
    else:
        _raw(path, header, data, size)
    with pytest.raises(tensorckpt.TensorckptError, match=match) as info:
        tensorckpt.convert(path, tmp_path / "ck", src_format="safetensors", progress=False)
    assert str(path) in str(info.value)
    _nothing_committed(tmp_path)


def _dcp(tmp_path, state, name="dcp"):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / name))
    return tmp_path / name


def test_dcp_missing_or_truncated_distcp(tmp_path):
    path = _dcp(tmp_path, {"w": torch.randn(64, 64), "v": torch.ones(3)})
    (data,) = [n for n in os.listdir(path) if n.endswith(".distcp")]
    blob = (path / data).read_bytes()
    (path / data).write_bytes(blob[: len(blob) // 2])
    with pytest.raises(tensorckpt.CorruptCheckpointError, match="runs past the end.*truncated"):
        tensorckpt.convert(path, tmp_path / "ck", progress=False)
    _nothing_committed(tmp_path)
    (path / data).unlink()
    with pytest.raises(tensorckpt.CorruptCheckpointError, match=f"data file '{data}'.*missing"):
        tensorckpt.convert(path, tmp_path / "ck", progress=False)
    _nothing_committed(tmp_path)
    (path / data).write_bytes(blob)
    (path / ".metadata").unlink()
    with pytest.raises(tensorckpt.TensorckptError, match="without its .metadata"):
        tensorckpt.convert(path, tmp_path / "ck", progress=False)


def test_dcp_chunk_garbage_aborts_the_staged_checkpoint(tmp_path):
    """Damage found only while reading data (after the commit began): the
    staging directory is removed and nothing is committed."""
    path = _dcp(tmp_path, {"a": torch.ones(4), "w": torch.randn(8, 8)})
    md = pickle.loads((path / ".metadata").read_bytes())
    (info,) = [s for i, s in md.storage_data.items() if i.fqn == "w"]
    with open(path / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\xff" * info.length)
    with pytest.raises(tensorckpt.TensorckptError, match="'w'"):
        tensorckpt.convert(path, tmp_path / "ck", progress=False)
    _nothing_committed(tmp_path)


def test_dcp_unstorable_dtype_and_bad_file_names(tmp_path):
    path = _dcp(tmp_path, {"u": torch.arange(4).to(torch.uint16)})
    with pytest.raises(tensorckpt.UnsupportedValueError, match=r"'u' has dtype torch.uint16.*cannot store"):
        tensorckpt.convert(path, tmp_path / "ck", progress=False)
    path = _dcp(tmp_path, {"w": torch.ones(2)}, "dcp2")
    md = pickle.loads((path / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(tensorckpt.CorruptCheckpointError, match="not a plain file name"):
        tensorckpt.convert(path, tmp_path / "ck", progress=False)
    _nothing_committed(tmp_path)


@pytest.mark.parametrize("to", ["tensorckpt", "safetensors", "dcp", "torch"])
def test_existing_destination_is_refused(tmp_path, to):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(tmp_path / "m.safetensors"))
    tensorckpt.convert(tmp_path / "m.safetensors", tmp_path / "src", progress=False)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("mine")
    with pytest.raises(tensorckpt.CheckpointExistsError, match="already exists"):
        tensorckpt.convert(tmp_path / "src", tmp_path / "out", to_format=to, progress=False)
    assert os.listdir(tmp_path / "out") == ["keep"]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.uint16,
                                   torch.uint32, torch.complex32])
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_torch_save_and_dcp_with_unstorable_dtypes(tmp_path, dtype):
    w = torch.zeros(4, dtype=dtype) if dtype == torch.complex32 else torch.zeros(4).to(dtype)
    torch.save({"m": {"w": w}}, tmp_path / "t.pt")
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(tensorckpt.UnsupportedValueError, match=rf"t.pt: tensor 'm/w' has dtype torch.{name}, which "
                                                               "tensorckpt cannot store.*only=/rename="):
        tensorckpt.convert(tmp_path / "t.pt", tmp_path / "ck", progress=False)
    _nothing_committed(tmp_path)
    if dtype in (torch.float8_e4m3fnuz, torch.float8_e8m0fnu):
        path = _dcp(tmp_path, {"w": w})
        with pytest.raises(tensorckpt.UnsupportedValueError, match=rf"'w' has dtype torch.{name}.*cannot store"):
            tensorckpt.convert(path, tmp_path / "ck", progress=False)
        _nothing_committed(tmp_path)


def test_cast_to_an_unstorable_dtype(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(4)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(tensorckpt.UnsupportedValueError, match=r"dtype=torch.float8_e4m3fnuz.*'w'.*cannot be stored"):
        tensorckpt.convert(tmp_path / "m.safetensors", tmp_path / "ck", dtype=torch.float8_e4m3fnuz, progress=False)
    with pytest.raises(tensorckpt.UnsupportedValueError, match=r"'w'.*float8_e8m0fnu \(dtype=.*was asked for\)"):
        tensorckpt.convert(tmp_path / "m.safetensors", tmp_path / "ck", to_format="safetensors",
                           dtype=torch.float8_e8m0fnu, progress=False)
    _nothing_committed(tmp_path)


def test_broken_or_incomplete_index(tmp_path):
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.ones(4)}, str(hf / "a.safetensors"))
    index = hf / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"w": "a.safetensors", "v": "b.safetensors"}}))
    for run in (lambda: tensorckpt.convert(hf, tmp_path / "ck", progress=False),
                lambda: tensorckpt.load_safetensors({"w": torch.zeros(4)}, hf)):
        with pytest.raises(tensorckpt.CorruptCheckpointError, match="index.json: shard 'b.safetensors' is missing"):
            run()
    index.write_text("{nope")
    for run in (lambda: tensorckpt.convert(hf, tmp_path / "ck", progress=False),
                lambda: tensorckpt.load_safetensors({"w": torch.zeros(4)}, hf)):
        with pytest.raises(tensorckpt.CorruptCheckpointError, match="index.json: not a readable JSON index"):
            run()
    _nothing_committed(tmp_path)
    # load_safetensors checks headers as convert does: nothing is written into the state
    _raw(tmp_path / "bad.safetensors", {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    target = torch.full((4,), 7.0)
    with pytest.raises(tensorckpt.CorruptCheckpointError, match=r"bad.safetensors.*'w'.*run past the end"):
        tensorckpt.load_safetensors({"w": target}, tmp_path / "bad.safetensors")
    assert torch.equal(target, torch.full((4,), 7.0))
