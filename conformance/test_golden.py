"""Every committed golden checkpoint reads back exactly as its expected.json
says, through tensorckpt.open and tensorckpt.load.

These goldens are the compatibility promise of format v1: this test must keep
passing in every later tensorckpt version. Never regenerate a golden to make
it pass; a failure here means a reader broke compatibility.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

import tensorckpt

from .suite import (
    assert_bit_equal,
    check_against_expected,
    checkpoint_dir,
    expected_tensor,
    golden_names,
    load_expected,
    target_from_expected,
)

GOLDENS = golden_names(1)


def test_goldens_exist():
    assert {"basic", "dtypes", "escaped_keys", "sharded"} <= set(GOLDENS)


def _tree_digest(root):
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(params=GOLDENS)
def golden(request):
    name = request.param
    root = checkpoint_dir(name)
    before = _tree_digest(root)
    yield name, root, load_expected(name)
    assert _tree_digest(root) == before, "reading a golden must not modify it"


def test_open(golden):
    name, root, expected = golden
    ckpt = tensorckpt.open(root)
    assert ckpt.keys() == expected["keys"]
    meta = ckpt.metadata
    assert meta.format_version == expected["format_version"]
    assert meta.format_version.split(".")[0] == "1"
    assert meta.user_metadata == expected["user_metadata"]
    assert meta.world_size == expected.get("world_size", 1)  # training_state_w2 was saved by 2 ranks
    for key, entry in expected["tensors"].items():
        info = ckpt.info(key)
        assert info.shape == tuple(entry["shape"])
        assert info.dtype == getattr(torch, entry["dtype"])
        assert info.chunk_shape == tuple(entry["chunk_shape"])
        assert info.inner_chunk_shape == tuple(entry["inner_chunk_shape"])
        want = expected_tensor(entry)
        assert_bit_equal(ckpt.read(key), want, key)
        assert_bit_equal(ckpt.read(tuple(entry["path"])), want, key)
        if want.dim() >= 1 and want.shape[0] >= 2:
            assert_bit_equal(ckpt.read(key, (slice(1, None),)), want[1:], key)
            assert_bit_equal(ckpt.read(key, 0), want[0], key)
    for key, entry in expected["values"].items():
        assert json.dumps(ckpt.read(key)) == json.dumps(entry["value"])


def test_to_state_dict(golden):
    _, root, expected = golden
    state = tensorckpt.open(root).to_state_dict()
    check_against_expected(state, expected)


@pytest.mark.parametrize("file_url", [False, True], ids=["path", "file_url"])
def test_load(golden, file_url):
    _, root, expected = golden
    target = target_from_expected(expected)
    out = tensorckpt.load(target, f"file://{root}" if file_url else root)
    assert out is target
    check_against_expected(target, expected)


def test_load_into_strided_targets(golden):
    _, root, expected = golden
    target = target_from_expected(expected)
    bases = {}
    for key, entry in expected["tensors"].items():
        t = expected_tensor(entry)
        base = torch.zeros(tuple(t.shape) + (2,), dtype=t.dtype)
        bases[key] = base
        node = target
        for p in entry["path"][:-1]:
            node = node[p]
        node[entry["path"][-1]] = base[..., 1]
    tensorckpt.load(target, root)
    check_against_expected(target, expected)
    for key, base in bases.items():
        assert not base[..., 0].contiguous().reshape(-1).view(torch.uint8).any(), key


def test_expected_json_is_self_consistent(golden):
    _, _, expected = golden
    assert sorted([*expected["tensors"], *expected["values"]]) == expected["keys"]
    for entry in expected["tensors"].values():
        t = expected_tensor(entry)
        assert list(t.shape) == entry["shape"]
