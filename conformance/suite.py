"""A reusable pytest conformance suite for tensorckpt-format writers/readers.

An adapter (a framework integration built on tensorckpt) or a second
implementation of the format subclasses :class:`ConformanceSuite`, names the
subclass ``Test...`` so pytest collects it, and implements two hooks::

    from conformance.suite import ConformanceSuite

    class TestMyAdapter(ConformanceSuite):
        def save(self, state, path):
            my_adapter.save(state, path)

        def load(self, state, path):
            return my_adapter.load(state, path)   # fills ``state`` in place, returns it

Every test method then round-trips representative states through the hooks
(all dtypes bit-exact, 0-d / zero-size / 1-D / 3-D / non-contiguous tensors,
nested dicts, JSON values, escaped keys) and loads every committed golden
checkpoint under ``conformance/golden/`` through ``load``.

Optional hooks: ``make_path(tmp_path, name)`` (where a round trip writes; e.g.
return a URL), ``golden_path(directory)`` (how to address a golden, e.g. after
copying it to another store), and the ``dtypes`` attribute (narrow it only if
the implementation documents the missing dtypes as unsupported).

This module imports only torch, numpy and pytest, never tensorckpt, so a
second implementation can use it as is. The helpers (``golden_names``,
``load_expected``, ``expected_tensor``, ``target_from_expected``,
``check_against_expected``, ``assert_bit_equal``) are public too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

GOLDEN_ROOT = Path(__file__).resolve().parent / "golden"

ALL_DTYPES = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)


# ----------------------------------------------------------------- goldens


def golden_names(major: int = 1) -> list[str]:
    """Names of the committed goldens of format major version ``major``."""
    d = GOLDEN_ROOT / f"v{major}"
    return sorted(p.name for p in d.iterdir() if (p / "expected.json").is_file()) if d.is_dir() else []


def golden_dir(name: str, major: int = 1) -> Path:
    return GOLDEN_ROOT / f"v{major}" / name


def load_expected(name: str, major: int = 1) -> dict:
    return json.loads((golden_dir(name, major) / "expected.json").read_text(encoding="utf-8"))


def checkpoint_dir(name: str, major: int = 1) -> Path:
    return golden_dir(name, major) / load_expected(name, major)["checkpoint"]


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def expected_tensor(entry: dict) -> torch.Tensor:
    """The tensor an ``expected.json`` entry describes (see README.md)."""
    dtype = torch_dtype(entry["dtype"])
    shape = tuple(entry["shape"])
    if entry["encoding"] == "bits":
        size = torch.empty((), dtype=dtype).element_size()
        raw = np.array(entry["data"], dtype=f"<u{size}").view(f"<i{size}" if size > 1 else "<u1")
        t = torch.from_numpy(raw.copy()).view(dtype)
    elif entry["encoding"] == "values":
        data = entry["data"]
        if dtype.is_complex:
            data = [complex(re, im) for re, im in data]
        t = torch.tensor(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
    else:
        raise ValueError(f"unknown encoding {entry['encoding']!r}")
    assert t.numel() == math.prod(shape), entry
    return t.reshape(shape)


def _set(state: dict, path, value) -> None:
    node = state
    for p in path[:-1]:
        node = node.setdefault(p, {})
    node[path[-1]] = value


def _get(state: dict, path):
    node = state
    for p in path:
        node = node[p]
    return node


def target_from_expected(expected: dict, fill: bool = True) -> dict:
    """A state to load a golden into: a fresh tensor of the stored shape and
    dtype per tensor key (filled with a byte pattern, so unwritten elements
    show), None per value key."""
    state: dict = {}
    for entry in expected["tensors"].values():
        dtype, shape = torch_dtype(entry["dtype"]), tuple(entry["shape"])
        t = torch.empty(shape, dtype=dtype)
        if fill and t.numel():
            t.reshape(-1).view(torch.uint8).fill_(1 if dtype == torch.bool else 0xA5)
        _set(state, entry["path"], t)
    for entry in expected["values"].values():
        _set(state, entry["path"], None)
    return state


def check_against_expected(state: dict, expected: dict) -> None:
    """Assert that a loaded state holds exactly what ``expected`` describes."""
    for key, entry in expected["tensors"].items():
        got = _get(state, entry["path"])
        assert isinstance(got, torch.Tensor), key
        assert_bit_equal(got, expected_tensor(entry), key)
    for key, entry in expected["values"].items():
        got = _get(state, entry["path"])
        assert _json_equal(got, entry["value"]), (key, got, entry["value"])


def _json_equal(a, b) -> bool:
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in b)
    if isinstance(b, list):
        return isinstance(a, list) and len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(b, float):
        return isinstance(a, float) and a == b and math.copysign(1, a) == math.copysign(1, b)
    return type(a) is type(b) and a == b


# ----------------------------------------------------------------- tensors


def bits(t: torch.Tensor) -> torch.Tensor:
    # clone(contiguous_format): a 1-element view with a non-unit stride stays "contiguous" but cannot be viewed as bytes
    return t.detach().reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor, where: str = "") -> None:
    assert actual.dtype == expected.dtype, (where, actual.dtype, expected.dtype)
    assert tuple(actual.shape) == tuple(expected.shape), (where, tuple(actual.shape), tuple(expected.shape))
    assert torch.equal(bits(actual), bits(expected)), f"{where}: tensors differ bitwise"


def sample(dtype: torch.dtype, shape, salt: int = 0) -> torch.Tensor:
    """Deterministic tensor with varied bit patterns (NaN payloads included for
    floating dtypes): an arange over the raw bytes, scrambled."""
    shape = tuple(shape)
    n = math.prod(shape)
    if dtype == torch.bool:
        return ((torch.arange(n) * 7 + salt) % 3 == 0).reshape(shape)
    size = torch.empty((), dtype=dtype).element_size()
    raw = ((torch.arange(n * size, dtype=torch.int64) * 73 + salt * 31 + 11) % 251).to(torch.uint8)
    return raw.view(dtype).reshape(shape)


def blank_like(state):
    """Same structure, fresh tensors (byte pattern 0xA5 / True), values None."""
    if isinstance(state, torch.Tensor):
        t = torch.empty(state.shape, dtype=state.dtype)
        if t.numel():
            t.reshape(-1).view(torch.uint8).fill_(1 if t.dtype == torch.bool else 0xA5)
        return t
    if isinstance(state, dict) and state:
        return {k: blank_like(v) for k, v in state.items()}
    return None


def assert_state_equal(actual, expected, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert_bit_equal(actual, expected, where)
    elif isinstance(expected, dict) and expected:
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), (where, actual)
        for k in expected:
            assert_state_equal(actual[k], expected[k], f"{where}/{k}")
    else:
        want = json.loads(json.dumps(expected))  # tuples -> lists
        assert _json_equal(actual, want), (where, actual, want)


# ----------------------------------------------------------------- the suite


class ConformanceSuite:
    """Subclass as ``Test<Name>`` and implement :meth:`save` and :meth:`load`."""

    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES

    # -- hooks
    def save(self, state: dict, path) -> None:
        raise NotImplementedError("implement save(state, path)")

    def load(self, state: dict, path) -> dict:
        """Fill ``state`` in place from the checkpoint at ``path``; return it."""
        raise NotImplementedError("implement load(state, path)")

    def make_path(self, tmp_path: Path, name: str):
        return tmp_path / name

    def golden_path(self, directory: Path):
        return directory

    # -- helpers
    def roundtrip(self, state: dict, tmp_path: Path, name: str = "ckpt") -> dict:
        path = self.make_path(tmp_path, name)
        self.save(state, path)
        target = blank_like(state)
        out = self.load(target, path)
        assert out is target, "load must fill the given state in place and return it"
        assert_state_equal(target, state)
        return target

    # -- round trips
    def test_every_dtype(self, tmp_path):
        state = {str(dt).removeprefix("torch."): sample(dt, (3, 5), i) for i, dt in enumerate(self.dtypes)}
        self.roundtrip(state, tmp_path)

    @pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (1,), (17,), (2, 3, 4), (1, 1, 1, 1)], ids=str)
    def test_shapes(self, tmp_path, shape):
        state = {str(dt).removeprefix("torch."): sample(dt, shape, i) for i, dt in enumerate(self.dtypes)}
        self.roundtrip(state, tmp_path)

    def test_special_float_bit_patterns(self, tmp_path):
        patterns = {
            torch.float32: (torch.int32, [0x7FC00001, 0x7F800001, -0x3FEDCC, -(2**31), 0x7F800000, 1]),
            torch.float64: (torch.int64, [0x7FF8000000000123, 0x7FF0000000000001, -(2**63), 0x7FF0000000000000, 1, 2]),
            torch.float16: (torch.int16, [0x7E01, 0x7C01, -(2**15), 0x7C00, -0x400, 1]),
            torch.bfloat16: (torch.int16, [0x7FC1, 0x7F81, -(2**15), 0x7F80, -0x80, 1]),
            torch.float8_e4m3fn: (torch.uint8, [0x7F, 0xFF, 0x80, 0x7E, 0xFE, 0x01]),
            torch.float8_e5m2: (torch.uint8, [0x7F, 0x7D, 0xFE, 0x7C, 0xFC, 0x01]),
        }
        state = {str(dt).removeprefix("torch."): torch.tensor(p, dtype=i).view(dt)
                 for dt, (i, p) in patterns.items() if dt in self.dtypes}
        self.roundtrip(state, tmp_path)

    def test_non_contiguous_sources(self, tmp_path):
        base = sample(torch.float32, (6, 8), 1)
        state = {
            "transposed": base.t(),
            "stepped": base[1::2, ::3],
            "permuted": sample(torch.int16, (2, 3, 4), 2).permute(2, 0, 1),
            "offset": base[2],
            "expanded": torch.arange(3.0).expand(4, 3),
        }
        self.roundtrip(state, tmp_path)

    def test_non_contiguous_targets(self, tmp_path):
        state = {"w": sample(torch.float32, (4, 6), 3), "v": sample(torch.bfloat16, (5,), 4)}
        path = self.make_path(tmp_path, "ckpt")
        self.save(state, path)
        wbase, vbase = blank_like(torch.empty(6, 4)), blank_like(torch.empty(5, 2, dtype=torch.bfloat16))
        target = {"w": wbase.t(), "v": vbase[:, 1]}
        self.load(target, path)
        assert_state_equal(target, state)
        assert_bit_equal(vbase[:, 0], blank_like(torch.empty(5, dtype=torch.bfloat16)), "untouched half")

    def test_nested_dicts_and_values(self, tmp_path):
        state = {
            "model": {"enc": {"l0": {"weight": sample(torch.float32, (3, 2)), "bias": sample(torch.float32, (3,), 1)}}},
            "optim": {"state": {"0": {"step": 10, "exp_avg": sample(torch.float32, (3, 2), 2)}}, "lr": 0.001},
            "step": 7, "big": 2**64 - 1, "neg": -(2**63), "ratio": -0.0, "name": "é🙂", "none": None,
            "flag": False, "hist": [1, 2.5, [None, "x"]], "pair": (1, 2), "cfg": {"a": {"b": []}}, "empty": {},
        }
        self.roundtrip(state, tmp_path)

    def test_escaped_keys(self, tmp_path):
        names = ["", ".", "..", "...", "__x", "_x", "a/b", "50%", "%2F", "%", "é🙂", " ", "layers.0.weight"]
        state = {n: {n: sample(torch.int32, (2,), i), "v": i} if i % 2 else sample(torch.float32, (i + 1,), i)
                 for i, n in enumerate(names)}
        self.roundtrip(state, tmp_path)

    def test_larger_tensors(self, tmp_path):
        state = {"big": sample(torch.float32, (300, 257), 5), "ints": sample(torch.int64, (1000, 3), 6)}
        self.roundtrip(state, tmp_path)

    def test_load_fills_existing_tensors(self, tmp_path):
        state = {"w": sample(torch.float32, (2, 3)), "n": 1}
        path = self.make_path(tmp_path, "ckpt")
        self.save(state, path)
        w = torch.zeros(2, 3)
        p = torch.nn.Parameter(torch.zeros(2, 3))
        for t in (w, p):
            target = {"w": t, "n": None}
            out = self.load(target, path)
            assert out is target and target["w"] is t
            assert_bit_equal(t.detach(), state["w"])
            assert target["n"] == 1
        assert p.requires_grad

    # -- goldens
    @pytest.mark.parametrize("golden", golden_names(1))
    def test_golden_v1(self, golden):
        expected = load_expected(golden)
        target = target_from_expected(expected)
        out = self.load(target, self.golden_path(checkpoint_dir(golden)))
        assert out is target
        check_against_expected(target, expected)
