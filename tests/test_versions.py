"""Per-version root readers (tensorckpt/format/versions, spec/README.md
"Support promise"): one module per format version, chosen by sniffing
``format_version``; every golden read by its own version's reader; the newest
minor version's goldens read by the previous reader module; a future minor
version read by this release's newest reader (unknown members ignored) unless
``must_understand`` names what it lacks; another major version refused."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

import tensorckpt
from conformance.suite import (
    check_against_expected,
    checkpoint_dir,
    golden_names,
    load_expected,
)
from tensorckpt.errors import CorruptCheckpointError, UnsupportedVersionError
from tensorckpt.format import versions
from tensorckpt.format.metadata import ATTRIBUTE, FORMAT_VERSION
from tensorckpt.format.versions import v1_0, v1_1, v1_2, v1_3
from tests.forge import reseal

GOLDENS = golden_names(1)


def _text(version: tuple[int, int]) -> str:
    return ".".join(map(str, version))


def _root(name: str) -> dict:
    return json.loads((checkpoint_dir(name) / "zarr.json").read_text(encoding="utf-8"))


def _by_version() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in GOLDENS:
        out.setdefault(load_expected(name)["format_version"], []).append(name)
    return out


def test_one_reader_per_version_and_the_newest_is_what_writers_write():
    assert [r.VERSION for r in versions.READERS] == [(1, 0), (1, 1), (1, 2), (1, 3)]
    assert _text(versions.NEWEST) == FORMAT_VERSION == tensorckpt.FORMAT_VERSION


@pytest.mark.parametrize(("version", "reader"), [("1.0", v1_0), ("1.1", v1_1), ("1.2", v1_2), ("1.3", v1_3),
                                                 ("1.4", v1_3), ("1.99999", v1_3)])
def test_reader_for_sniffs_the_version(version, reader):
    assert versions.reader_for(version) is reader


@pytest.mark.parametrize("version", ["2.0", "0.9", "3.1"])
def test_another_major_version_is_unsupported(version):
    with pytest.raises(UnsupportedVersionError, match=rf"format version {version} is not supported.*1\.x.*upgrade"):
        versions.reader_for(version, "ck/zarr.json")


@pytest.mark.parametrize("version", ["01.0", "1", "1.0.0", "1.100000", 1.0, None])
def test_a_malformed_version_is_corrupt(version):
    with pytest.raises(CorruptCheckpointError, match="ck/zarr.json: .*format_version"):
        versions.reader_for(version, "ck/zarr.json")


def test_goldens_cover_every_version():
    assert set(_by_version()) == {_text(r.VERSION) for r in versions.READERS}


@pytest.mark.parametrize("name", GOLDENS)
def test_each_golden_is_read_by_its_own_versions_reader(name):
    """The chosen reader is the golden's version's, and reading through it is
    reading through tensorckpt.open (which test_golden.py checks in full)."""
    expected = load_expected(name)
    reader = versions.reader_for(expected["format_version"])
    assert _text(reader.VERSION) == expected["format_version"]
    meta = reader.read(_root(name)["attributes"][ATTRIBUTE], name)
    assert sorted([*meta.tensors, *meta.values]) == expected["keys"]
    ckpt = tensorckpt.open(checkpoint_dir(name))
    public = ckpt.metadata
    assert (meta.format_version, meta.library_version, meta.created, meta.world_size, meta.user_metadata,
            meta.save_stats) == (public.format_version, public.library_version, public.created, public.world_size,
                                 public.user_metadata, public.save_stats)
    for key, entry in meta.tensors.items():
        info = ckpt.info(key)
        assert (info.shape, info.chunk_shape, info.inner_chunk_shape) == (entry.shape, entry.chunk_shape,
                                                                          entry.inner_chunk_shape)
    assert (meta.save_stats is not None) == (reader.VERSION >= (1, 1))


@pytest.mark.parametrize("name", _by_version()[_text(versions.NEWEST)])
def test_newest_minor_goldens_read_by_the_previous_reader(name):
    """A checkpoint of the newest minor version (1.3) read by the previous
    reader module (1.2's): the same index, every key, tensor entry and value;
    what 1.3 added (checkpoint_id, array_digests, checksum; the arrays'
    chunk_digests) are members it ignores."""
    previous = versions.READERS[-2]
    assert previous.VERSION == (1, 2)
    doc = _root(name)["attributes"][ATTRIBUTE]
    old, new = previous.read(doc, name), versions.reader_for(doc["format_version"]).read(doc, name)
    assert (old.tensors, old.values, old.header()) == (new.tensors, new.values, dataclasses.replace(
        new.header(), checkpoint_id=""))
    assert new.checkpoint_id == doc["checkpoint_id"] and new.array_digests == doc["array_digests"]
    expected = load_expected(name)
    meta = previous.read(doc, name)
    assert {k: meta.values[k] for k in expected["values"]} == {k: v["value"] for k, v in expected["values"].items()}
    assert {k: (list(e.shape), e.dtype) for k, e in meta.tensors.items()} == {
        k: (v["shape"], v["dtype"]) for k, v in expected["tensors"].items()}


def test_1_1_golden_read_by_the_1_0_reader_ignores_save_stats():
    doc = _root("save_stats_1_1")["attributes"][ATTRIBUTE]
    old, new = v1_0.read(doc, "x"), v1_1.read(doc, "x")
    assert old.save_stats is None and new.save_stats == doc["save_stats"]
    assert (old.tensors, old.values) == (new.tensors, new.values)


def _future_copy(tmp_path: Path, name: str, **members) -> Path:
    """A golden rewritten as a future minor version 1.4 of a later writer:
    unknown optional members in the root, the index and a tensor entry; what
    1.3 requires (checkpoint id, digests, the checksum) made to agree."""
    ck = tmp_path / name
    shutil.copytree(checkpoint_dir(name), ck)
    doc = json.loads((ck / "zarr.json").read_text(encoding="utf-8"))
    meta = doc["attributes"][ATTRIBUTE]
    meta.update(format_version="1.4", future_member={"anything": [1, 2]}, **members)
    meta.setdefault("checkpoint_id", "5" * 32)
    meta["checksum"] = ""  # resealed below
    next(iter(meta["tensors"].values()))["future_entry_member"] = "ignored"
    reseal(ck, doc)
    return ck


@pytest.mark.parametrize("name", ["basic", "training_state_1_2", "integrity_1_3"])
def test_a_future_minor_version_is_read_ignoring_what_it_adds(tmp_path, name):
    ck = _future_copy(tmp_path, name)
    expected = load_expected(name)
    ckpt = tensorckpt.open(ck)
    assert ckpt.metadata.format_version == "1.4"
    check_against_expected(ckpt.to_state_dict(), expected)


@pytest.mark.parametrize("call", ["open", "load"])
def test_a_future_minor_version_needing_an_extension_is_refused(tmp_path, call):
    ck = _future_copy(tmp_path, "basic", must_understand=["quantized-v7"])
    with pytest.raises(UnsupportedVersionError, match=f"{ck}.*quantized-v7.*upgrade tensorckpt"):
        tensorckpt.open(ck) if call == "open" else tensorckpt.load({"ids": torch.empty(0)}, ck)


def test_another_major_version_is_refused_by_open_and_load(tmp_path):
    ck = tmp_path / "v2"
    shutil.copytree(checkpoint_dir("basic"), ck)
    doc = json.loads((ck / "zarr.json").read_text(encoding="utf-8"))
    doc["attributes"][ATTRIBUTE]["format_version"] = "2.0"
    (ck / "zarr.json").write_text(json.dumps(doc), encoding="utf-8")
    for fn in (lambda: tensorckpt.open(ck), lambda: tensorckpt.load({}, ck)):
        with pytest.raises(UnsupportedVersionError, match="format version 2.0 is not supported"):
            fn()
