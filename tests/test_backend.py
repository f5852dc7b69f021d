"""The storage interface (tensorckpt/storage/backend.py): each backend
satisfies the one protocol the rest of the library uses, and the two
behave alike where the protocol says they do."""

import os

import pytest
import torch

import tensorckpt
from tensorckpt.storage import commit_kv, commit_local, location
from tensorckpt.storage.backend import backend_for


@pytest.fixture(params=["file", "memory"])
def loc(request, tmp_path, mem_url):
    return location.parse(str(tmp_path / "c") if request.param == "file" else mem_url("c"))


def test_flags_and_strategies(tmp_path, mem_url):
    local, memory = backend_for(location.parse(str(tmp_path))), backend_for(location.parse(mem_url("x")))
    assert (local.supports_rename, local.records_times, local.shared) == (True, True, True)
    assert (memory.supports_rename, memory.records_times, memory.shared, memory.fast_chunks) == (False, False, False, False)
    assert isinstance(local.commit, commit_local.AtomicRenameCommit)
    assert isinstance(memory.commit, commit_kv.RootLastCommit)
    assert backend_for(location.parse(str(tmp_path / "y"))) is local  # one instance per scheme


def test_objects_alike(loc):
    b = backend_for(loc)
    assert not b.exists(loc) and b.list(loc) == []
    b.prepare(loc)
    b.write(loc, "a/x", b"0123456789")
    b.write(loc, "b", b"xy")
    assert b.exists(loc) and b.list(loc) == ["a/x", "b"] and b.names(loc) == {"a", "b"}
    assert b.read(loc, "a/x", 100, "where")[1] == b"0123456789" and b.read(loc, "nope", 100, "where")[1] is None
    assert b.read_range(loc, "a/x", 3, 4) == b"3456" and b.read_range(loc, "a/x", 8, 10) == b"89"
    assert sorted(b.sizes(loc, "a")) == [("x", 10)]
    assert (b.age(loc) is not None) == b.records_times
    b.sync(loc)
    b.delete(loc, "b")
    assert b.list(loc) == ["a/x"]
    b.delete_all(loc)
    assert b.list(loc) == []


def test_a_save_goes_through_the_backend(loc):
    tensorckpt.save({"w": torch.arange(6.0)}, loc.url)
    b = backend_for(loc)
    assert "zarr.json" in b.list(loc) and b.commit.leftovers(loc) == []
    assert torch.equal(tensorckpt.open(loc.url).read("w"), torch.arange(6.0))


def test_no_scheme_tests_outside_the_backends():
    root = os.path.dirname(tensorckpt.__file__)
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    assert "is_local" not in f.read(), name
