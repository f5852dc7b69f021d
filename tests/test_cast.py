"""load(cast=True) converts stored dtypes to the target's through bounded
buffers; the default refuses and says cast=True; load(partial=True) ignores
what the state does not name (single process, ~2 s)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import tensorckpt
from tensorckpt.engine import load as load_mod


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    state = {
        "f32": torch.randn(37, 5),
        "bf16": torch.randn(4, 3).to(torch.bfloat16),
        "i32": torch.arange(-5, 5, dtype=torch.int32),
        "f16": torch.randn(6).half(),
        "step": 3,
    }
    tensorckpt.save(state, tmp_path / "c", inner_chunk_bytes=64)
    return tmp_path / "c", state


def _target(**dtypes) -> dict:
    shapes = {"f32": (37, 5), "bf16": (4, 3), "i32": (10,), "f16": (6,)}
    base = {"f32": torch.float32, "bf16": torch.bfloat16, "i32": torch.int32, "f16": torch.float16}
    return {k: torch.zeros(shapes[k], dtype=dtypes.get(k, base[k])) for k in shapes} | {"step": 0}


def test_default_refuses_a_dtype_change_and_names_cast(saved):
    path, _ = saved
    with pytest.raises(tensorckpt.IncompatibleStateError, match=r"'f32'.*float32.*bfloat16.*cast=True"):
        tensorckpt.load(_target(f32=torch.bfloat16), path)


def test_cast_converts(saved):
    path, state = saved
    t = _target(f32=torch.bfloat16, bf16=torch.float32, i32=torch.int64, f16=torch.float64)
    tensorckpt.load(t, path, cast=True)
    assert t["f32"].dtype == torch.bfloat16 and torch.equal(t["f32"], state["f32"].to(torch.bfloat16))
    assert torch.equal(t["bf16"], state["bf16"].float())  # widening: exact
    assert t["i32"].dtype == torch.int64 and torch.equal(t["i32"], state["i32"].long())
    assert torch.equal(t["f16"], state["f16"].double())
    assert t["step"] == 3


def test_cast_refuses_a_change_of_kind(saved):
    path, _ = saved
    with pytest.raises(tensorckpt.IncompatibleStateError, match=r"'f32'.*not float32 to int64"):
        tensorckpt.load(_target(f32=torch.int64), path, cast=True)


def test_cast_into_a_box_through_small_buffers(saved, monkeypatch):
    """A ShardedTensor box read with casting in slabs of at most SLAB_BYTES of
    the stored dtype: the values are those of the stored box, converted."""
    path, state = saved
    monkeypatch.setattr(load_mod, "SLAB_BYTES", 3 * 5 * 4)  # 3 rows of float32
    sizes = []
    real_empty = np.empty

    def spy(shape, dtype=float, *a, **k):
        if isinstance(shape, tuple) and len(shape) == 2 and shape[1] == 5:  # the load's buffers for "f32"
            sizes.append((shape[0], np.dtype(dtype)))
        return real_empty(shape, dtype, *a, **k)

    monkeypatch.setattr(load_mod.np, "empty", spy)
    box = torch.zeros(30, 5, dtype=torch.float64)
    tensorckpt.load({"f32": tensorckpt.ShardedTensor(box, (37, 5), (4, 0))}, path, cast=True, partial=True)
    monkeypatch.undo()
    assert torch.equal(box, state["f32"][4:34].double())
    assert sum(rows for rows, _ in sizes) == 30 and max(rows for rows, _ in sizes) <= 3, sizes  # bounded
    assert {d for _, d in sizes} == {np.dtype(np.float32)}  # of the stored dtype


def test_partial_ignores_what_the_state_does_not_name(saved):
    path, state = saved
    t = {"bf16": torch.zeros(4, 3, dtype=torch.bfloat16)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either
        tensorckpt.load(t, path, partial=True)
    assert torch.equal(t["bf16"], state["bf16"])
    with pytest.raises(tensorckpt.IncompatibleStateError, match="partial=True"):
        tensorckpt.load({"bf16": torch.zeros(4, 3, dtype=torch.bfloat16)}, path)
    # a key the state names but the checkpoint lacks still fails when strict
    with pytest.raises(tensorckpt.IncompatibleStateError, match="missing in checkpoint: 'nope'"):
        tensorckpt.load({"bf16": torch.zeros(4, 3, dtype=torch.bfloat16), "nope": 1}, path, partial=True)
    with pytest.warns(UserWarning, match="'nope'"):
        tensorckpt.load({"nope": 1}, path, partial=True, strict=False)


def test_nested_tensors_and_bytes_in_lists_say_where(tmp_path):
    cases = [
        ({"k": [1, [torch.ones(1)]]}, r"'k': a tensor at k\[1\]\[0\]"),
        ({"k": [[b"x"]]}, r"'k': bytes at k\[0\]\[0\]"),
        ({"k": {"a": [0, {"b": [torch.ones(1)]}]}}, r"'k/a': a tensor at k/a\[1\]\.b\[0\]"),
        ({"k": (torch.ones(1),)}, r"'k': a tensor at k\[0\] \(inside a tuple\)"),
    ]
    for state, match in cases:
        with pytest.raises(tensorckpt.UnsupportedValueError, match=match):
            tensorckpt.save(state, tmp_path / "x")
