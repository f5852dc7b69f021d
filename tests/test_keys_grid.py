"""Key escaping (format/keys.py) and chunk-grid math (layout/grid.py):
examples plus hypothesis properties, and keys through save() / open()."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import tensorckpt
from tensorckpt.errors import CorruptCheckpointError, UnsupportedValueError
from tensorckpt.format import keys
from tensorckpt.layout import grid

FAST = settings(max_examples=200, deadline=None)
SAVES = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# ----------------------------------------------------------------- escaping

EXAMPLES = [
    ("", "%"),
    (".", "%2E"),
    ("..", "%2E%2E"),
    ("...", "%2E%2E%2E"),
    ("__x", "%5F_x"),
    ("__", "%5F_"),
    ("___", "%5F__"),
    ("_x", "_x"),
    ("x__", "x__"),
    ("a/b", "a%2Fb"),
    ("/", "%2F"),
    ("50%", "50%25"),
    ("%", "%25"),
    ("%2F", "%252F"),
    ("%25", "%2525"),
    ("./", ".%2F"),
    ("a.b", "a.b"),
    (".hidden", ".hidden"),
    ("weight", "weight"),
    ("layers.0.weight", "layers.0.weight"),
    ("é🙂漢字", "é🙂漢字"),
    (" ", " "),
]


@pytest.mark.parametrize("name,escaped", EXAMPLES)
def test_escape_examples(name, escaped):
    assert keys.escape(name) == escaped
    assert keys.unescape(escaped) == name


def _check_escaped(node: str) -> None:
    assert node != ""
    assert "/" not in node
    assert not node.startswith("__")
    assert node not in (".", "..")
    assert set(node) != {"."}


@FAST
@given(st.text())
@example("")
@example("..")
@example("__%2F")
@example("%5F_x")
def test_escape_round_trips_any_text(name):
    try:
        node = keys.escape(name)
    except UnsupportedValueError:
        assert _escaped_len(name) > keys.MAX_NAME_BYTES
        return
    _check_escaped(node)
    assert keys.unescape(node) == name
    assert len(node.encode("utf-8")) <= keys.MAX_NAME_BYTES


def _escaped_len(name: str) -> int:
    """Length in bytes of the escaped name, computed independently."""
    out = name.replace("%", "%25").replace("/", "%2F")
    if out and set(out) == {"."}:
        return 3 * len(out)
    return len(out.encode("utf-8")) + (2 if out.startswith("__") else 0)


@FAST
@given(st.text(alphabet=st.sampled_from("._/%_aA2F5E"), max_size=12))
def test_escape_round_trips_tricky_alphabet(name):
    node = keys.escape(name)
    _check_escaped(node)
    assert keys.unescape(node) == name


@pytest.mark.parametrize(
    "node",
    ["", ".", "..", "__x", "a/b", "/", "%2f", "%2e", "%41", "%%", "%2", "%ZZ", "50%", "%5Fx", "%2E.", ".%2E",
     "%5F%5Fx", "%2Ea", "%00%", "a%2fb", "%2525%"],
)
def test_unescape_rejects_non_canonical_names(node):
    with pytest.raises(CorruptCheckpointError, match="invalid escaped key"):
        keys.unescape(node)


@FAST
@given(st.text(alphabet=st.sampled_from("._/%aA2F5E0x"), max_size=10) | st.text(max_size=10))
def test_unescape_accepts_exactly_the_canonical_names(node):
    try:
        name = keys.unescape(node)
    except CorruptCheckpointError:
        return
    assert keys.escape(name) == node


@FAST
@given(st.lists(st.text(max_size=20), min_size=1, max_size=5))
def test_flat_key_round_trips(path):
    path = tuple(path)
    flat = keys.flat_key(path)
    assert keys.split_flat_key(flat) == path
    assert flat.count("/") == len(path) - 1


@pytest.mark.parametrize("flat", ["", "/a", "a//b", "a/", "a/__x", "a/..", "b/%2f"])
def test_split_flat_key_rejects_invalid(flat):
    with pytest.raises(CorruptCheckpointError):
        keys.split_flat_key(flat)


def test_escape_rejects_non_str_and_overlong():
    with pytest.raises(UnsupportedValueError, match="keys must be str"):
        keys.escape(3)
    keys.escape("a" * keys.MAX_NAME_BYTES)
    with pytest.raises(UnsupportedValueError, match="255 bytes"):
        keys.escape("a" * (keys.MAX_NAME_BYTES + 1))
    with pytest.raises(UnsupportedValueError, match="255 bytes"):
        keys.escape("%" * 100)  # 300 bytes once escaped
    with pytest.raises(UnsupportedValueError):
        keys.escape("é" * 128)  # 256 UTF-8 bytes


# Names a local file system (through TensorStore's file kvstore) cannot hold
# as written, though escape() passes them through unchanged.
@pytest.mark.xfail(strict=True, reason="BUG: format/keys.py escape() lets through names the file layout cannot "
                   "store: 'zarr.json' (collides with the group/array metadata file), names ending in '.__lock' "
                   "(rejected by TensorStore's file kvstore), NUL (invalid in file names)")
@pytest.mark.parametrize("name", ["zarr.json", "x.__lock", ".__lock", "a\x00b"], ids=repr)
def test_escaped_names_are_storable_on_a_file_system(name):
    node = keys.escape(name)
    assert node != "zarr.json"
    assert not node.endswith(".__lock")
    assert "\x00" not in node
    assert keys.unescape(node) == name


# ----------------------------------------------------------------- keys through save()

SAVE_KEYS = ["", ".", "..", "...", "__x", "_x", "a/b", "50%", "%2F", "%", "é🙂漢字", " ", "\n", "c", "0",
             "layers.0.weight", "a" * 200]


def _state_with_keys(names):
    state = {}
    for i, n in enumerate(names):
        state[n] = {n: torch.arange(i + 1, dtype=torch.int32), "v": i} if i % 2 else torch.full((2,), float(i))
    return state


def _assert_same(a, b):
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(b, dict) and b:
        assert isinstance(a, dict) and set(a) == set(b)
        for k in b:
            _assert_same(a[k], b[k])
    else:
        assert a == b


@pytest.mark.parametrize("where", ["file", "memory"])
def test_special_keys_through_save(where, tmp_path, mem_url):
    path = tmp_path / "ckpt" if where == "file" else mem_url()
    state = _state_with_keys(SAVE_KEYS)
    tensorckpt.save(state, path)
    ckpt = tensorckpt.open(path)
    _assert_same(ckpt.to_state_dict(), state)
    assert keys.flat_key(("a/b",)) in ckpt.keys()
    # and load fills a state with the same keys
    target = {k: ({kk: torch.zeros_like(vv) if isinstance(vv, torch.Tensor) else None for kk, vv in v.items()}
                  if isinstance(v, dict) else torch.zeros_like(v)) for k, v in state.items()}
    tensorckpt.load(target, path)
    _assert_same(target, state)
    if where == "file":  # every on-disk name is the escaped key
        names = {p.name for p in (tmp_path / "ckpt").iterdir()}
        assert names == {keys.escape(k) for k in SAVE_KEYS} | {"zarr.json"}


@pytest.mark.xfail(strict=True, reason="BUG: keys 'zarr.json', '*.__lock' and ones containing NUL fail on a local "
                   "path with raw OSError/ValueError (see format/keys.py escape)")
@pytest.mark.parametrize("name", ["zarr.json", "x.__lock", "a\x00b"], ids=repr)
def test_file_system_hostile_keys_through_save(name, tmp_path):
    state = {name: torch.arange(3), "g": {name: torch.arange(2), "o": 1}}
    tensorckpt.save(state, tmp_path / "ckpt")
    _assert_same(tensorckpt.open(tmp_path / "ckpt").to_state_dict(), state)


@pytest.mark.xfail(strict=True, reason="BUG: lone surrogates: format/keys.py escape() and metadata.dumps() raise "
                   "UnicodeEncodeError instead of UnsupportedValueError naming the key")
@pytest.mark.parametrize("state", [{"\ud800": 1}, {"v": "\udcff"}, {"t": torch.ones(1), "m": ["ok", "\ud83d"]}], ids=repr)
def test_lone_surrogates_are_unsupported_values(state, mem_url):
    with pytest.raises(UnsupportedValueError):
        tensorckpt.save(state, mem_url())


_text_key = st.text(max_size=12)
_leaf = st.one_of(
    st.integers(min_value=-5, max_value=5).map(lambda n: torch.arange(abs(n) + 1, dtype=torch.int64) * n),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.text(max_size=5),
    st.none(),
)
_states = st.recursive(_leaf, lambda children: st.dictionaries(_text_key, children, min_size=1, max_size=4), max_leaves=8)


@SAVES
@given(st.dictionaries(_text_key, _states, max_size=4))
def test_any_text_keys_round_trip_through_memory(mem_url, state):
    url = mem_url()
    tensorckpt.save(state, url)
    _assert_same(tensorckpt.open(url).to_state_dict(), state)


# The local-file variant excludes NUL and the '.__lock' suffix (see the xfail
# above); remove the filter once escape() handles them.
_fs_key = st.text(alphabet=st.characters(blacklist_characters="\x00"), max_size=12).filter(
    lambda s: not s.endswith(".__lock") and s != "zarr.json")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(_fs_key, st.dictionaries(_fs_key, _leaf, min_size=1, max_size=3) | _leaf, max_size=4))
def test_any_text_keys_round_trip_through_files(tmp_path_factory, state):
    path = tmp_path_factory.mktemp("k") / "ckpt"
    tensorckpt.save(state, path)
    _assert_same(tensorckpt.open(path).to_state_dict(), state)


# ----------------------------------------------------------------- grid

SMALL_PRIMES = (2, 3, 5, 7, 11, 13)


def _splittable(n: int) -> bool:
    return any(n % p == 0 for p in SMALL_PRIMES)


_dims = st.lists(st.integers(min_value=1, max_value=5000), max_size=4)
_itemsize = st.sampled_from([1, 2, 4, 8, 16])


@FAST
@given(_dims, _itemsize, st.integers(min_value=1, max_value=1 << 24))
@example([4096, 4096], 2, 2 << 20)
@example([17, 19, 23], 8, 1)
@example([1], 1, 1)
@example([], 4, 1)
@example([2**12 * 17], 4, 64)
def test_inner_chunks_divide_the_shard_and_fit_the_target(shard, itemsize, target):
    shard = tuple(shard)
    inner = grid.inner_chunks(shard, itemsize, target)
    assert isinstance(inner, tuple) and len(inner) == len(shard)
    for s, i in zip(shard, inner):
        assert 1 <= i <= s and s % i == 0
    if math.prod(inner) * itemsize > target:
        assert not any(_splittable(i) for i in inner), (shard, inner)


@FAST
@given(_dims, _itemsize)
def test_inner_chunks_keep_a_shard_that_already_fits(shard, itemsize):
    shard = tuple(shard)
    assume(math.prod(shard) * itemsize <= grid.DEFAULT_INNER_BYTES)
    assert grid.inner_chunks(shard, itemsize) == shard


@FAST
@given(st.lists(st.integers(min_value=0, max_value=10000), max_size=4), _itemsize,
       st.integers(min_value=1, max_value=1 << 26))
@example([0], 4, 1)
@example([0, 0, 5], 2, 3)
@example([100, 3], 4, 4 * 3 * 128)
@example([65, 1], 1, 100)
def test_single_writer_chunks(shape, itemsize, shard_bytes):
    shape = tuple(shape)
    chunk = grid.single_writer_chunks(shape, itemsize, shard_bytes)
    assert isinstance(chunk, tuple) and len(chunk) == len(shape)
    assert all(c >= 1 for c in chunk)
    if shape:
        assert chunk[1:] == tuple(max(1, s) for s in shape[1:])  # whole trailing dims
        row = math.prod(chunk[1:]) * itemsize
        assert chunk[0] == 1 or chunk[0] * row <= shard_bytes  # one row is the floor
    else:
        assert chunk == ()


@FAST
@given(st.lists(st.integers(min_value=0, max_value=3000), min_size=1, max_size=3), _itemsize,
       st.integers(min_value=64, max_value=1 << 20), st.integers(min_value=1, max_value=1 << 16))
def test_planned_layout_is_valid_for_the_format(shape, itemsize, shard_bytes, inner_bytes):
    """What save() plans: the inner chunk divides the shard."""
    chunk = grid.single_writer_chunks(tuple(shape), itemsize, shard_bytes)
    inner = grid.inner_chunks(chunk, itemsize, inner_bytes)
    assert all(c % i == 0 for c, i in zip(chunk, inner))
