"""The checkpoint index in code: frozen dataclasses <-> JSON (spec section
"Root metadata"). Everything here is pure: no I/O, no torch.distributed.

The root metadata lives in the ``attributes.tensorckpt`` member of the
checkpoint's root ``zarr.json``; writing that file is the commit. Readers of
each format version are modules of :mod:`.versions`, chosen by sniffing
``format_version`` (see :func:`parse_root`), never by version checks
scattered through the code. ``FORMAT_VERSION`` is the version writers write:
the newest reader's (``versions.NEWEST``).

The records (the shape of zarr-python's ``ArrayV3Metadata``): a
:class:`TensorEntry` per tensor (its ``dtype`` the JSON's name, the dtype
record resolved once as ``dtype_info``), :class:`CheckpointMetadata` (what a
checkpoint says about itself; ``Checkpoint.metadata``), :class:`RootMetadata`
(that plus the index) and :class:`SaveStatsRecord` (spec 9.7). Each has an
explicit ``to_json``; the TypedDicts (``TensorEntryJSON``, ``RootJSON``,
``SaveStatsJSON``) document the JSON it gives.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn, TypedDict, cast

import torch

from ..errors import CorruptCheckpointError, UnsupportedValueError
from . import dtypes as _dtypes
from .keys import split_flat_key

FORMAT_MAJOR = 1
FORMAT_MINOR = 3
FORMAT_VERSION = f"{FORMAT_MAJOR}.{FORMAT_MINOR}"
ATTRIBUTE = "tensorckpt"  # member of the root group's attributes
KNOWN_EXTENSIONS: frozenset[str] = frozenset()  # extensions this reader implements
MAX_INT = 2**64 - 1
MIN_INT = -(2**63)
MAX_ELEMENTS = 2**62  # no real tensor is larger; rejects hostile shapes early
MAX_DEPTH = 256  # deepest JSON nesting, and most components of a flat key, a reader accepts (spec 12)
MAX_ROOT_JSON_BYTES = 256 << 20  # the largest root zarr.json a reader parses (spec 12)
MAX_NODE_JSON_BYTES = 16 << 20  # the largest array or group zarr.json a reader parses (spec 12)
MAX_INNER_CHUNK_BYTES = 256 << 20  # the largest encoded inner chunk (elements + CRC-32C) of an entry (spec 12)
MAX_SHARD_INDEX_BYTES = 64 << 20  # the largest shard index (16 bytes per inner chunk + CRC-32C) of an entry (spec 12)


# ------------------------------------------------------------- JSON forms
# What the documents look like (spec 9.3, 9.4, 9.7), for readers of the code;
# the dataclasses below are what the library passes around.


class TensorEntryJSON(TypedDict):
    """An entry of the index's ``tensors`` (spec 9.4)."""

    dtype: str
    data_type: str
    shape: list[int]
    chunk_shape: list[int]
    inner_chunk_shape: list[int]


class SaveStatsJSON(TypedDict, total=False):
    """The optional root member ``save_stats`` (spec 9.7): one entry per rank."""

    seconds: dict[str, list[float]]
    bytes_written: list[int]


class RootJSON(TypedDict, total=False):
    """``attributes.tensorckpt`` of the root ``zarr.json`` (spec 9.3)."""

    format_version: str
    must_understand: list[str]
    library_version: str
    created: str
    world_size: int
    user_metadata: dict
    tensors: dict[str, TensorEntryJSON]
    values: dict[str, object]
    save_stats: SaveStatsJSON
    checkpoint_id: str  # since 1.3 (spec 9.8)
    array_digests: dict[str, str]
    checksum: str


@dataclass(frozen=True)
class TensorEntry:
    """One logical tensor: a Zarr v3 array at ``key`` (the flat key)."""

    dtype: str  # torch dtype name, e.g. "bfloat16": the JSON's ``dtype``
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]  # Zarr chunk = shard = one writer's box
    inner_chunk_shape: tuple[int, ...]  # sharding_indexed inner chunk

    @property
    def dtype_info(self) -> _dtypes.DType:
        """The dtype record of ``dtype`` (itemsize, Zarr name, numpy dtype)."""
        return _dtypes.BY_TORCH[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        return _dtypes.torch_dtype(self.dtype_info)

    @property
    def zarr_data_type(self) -> str:
        return self.dtype_info.zarr_name

    @property
    def itemsize(self) -> int:
        return self.dtype_info.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype_info.itemsize

    def to_json(self) -> TensorEntryJSON:
        return {
            "dtype": self.dtype,
            "data_type": self.zarr_data_type,
            "shape": list(self.shape),
            "chunk_shape": list(self.chunk_shape),
            "inner_chunk_shape": list(self.inner_chunk_shape),
        }


@dataclass(frozen=True, eq=False)
class SaveStatsRecord(Mapping[str, object]):
    """The root's ``save_stats`` (spec 9.7): how the save that wrote the
    checkpoint went on each rank. ``seconds`` maps each phase to one time per
    rank, ``bytes_written`` has one count per rank; either is None where the
    document lacks it (both are optional). Phases and members a later writer
    added are kept (``other``) and ignored.

    It is also a read-only mapping over its JSON form (``stats["seconds"]``,
    ``stats == doc``), which is what ``Checkpoint.metadata.save_stats`` was
    before it was typed."""

    seconds: Mapping[str, tuple[float, ...]] | None = None
    bytes_written: tuple[int, ...] | None = None
    other: Mapping[str, object] = field(default_factory=dict)  # members this version does not know, as read

    @classmethod
    def of_ranks(cls, seconds: Sequence[Mapping[str, float]], bytes_written: Sequence[int],
                 phases: Sequence[str]) -> SaveStatsRecord:
        """From each rank's phase times and bytes (rank order), as a save writes it."""
        return cls({p: tuple(s[p] for s in seconds) for p in phases}, tuple(bytes_written))

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> SaveStatsRecord:
        """From a document of the form of 9.7, already validated (a reader's
        :func:`.versions.v1_1.save_stats`) or written by this library."""
        seconds, written = doc.get("seconds"), doc.get("bytes_written")
        return cls(
            None if seconds is None else {p: tuple(t) for p, t in seconds.items()},
            None if written is None else tuple(written),
            {k: v for k, v in doc.items() if k not in ("seconds", "bytes_written")},
        )

    def to_json(self) -> SaveStatsJSON:
        return cast(SaveStatsJSON, self._doc())

    def _doc(self) -> dict[str, object]:
        doc: dict[str, object] = {}
        if self.seconds is not None:
            doc["seconds"] = {p: list(t) for p, t in self.seconds.items()}
        if self.bytes_written is not None:
            doc["bytes_written"] = list(self.bytes_written)
        doc.update(self.other)
        return doc

    # the mapping view over the JSON form
    def __getitem__(self, name: str) -> object:
        return self._doc()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._doc())

    def __len__(self) -> int:
        return len(self._doc())

    def __repr__(self) -> str:
        return f"SaveStatsRecord({self.to_json()!r})"


@dataclass(frozen=True, kw_only=True)
class CheckpointMetadata:
    """What a checkpoint says about itself (``tensorckpt.open(path).metadata``):
    the root metadata without the index. :class:`RootMetadata` extends it, so
    each field is declared once."""

    format_version: str = FORMAT_VERSION
    library_version: str = ""
    created: str = ""
    world_size: int = 1
    user_metadata: dict = field(default_factory=dict)
    save_stats: SaveStatsRecord | None = None  # per-rank phase times and bytes (spec 9.7); None before format 1.1
    checkpoint_id: str = ""  # random, one per save (spec 9.8); "" before format 1.3

    def __post_init__(self) -> None:
        if self.save_stats is not None and not isinstance(self.save_stats, SaveStatsRecord):
            object.__setattr__(self, "save_stats", SaveStatsRecord.from_json(self.save_stats))  # given as JSON

    def header(self) -> CheckpointMetadata:
        """These fields alone, as a :class:`CheckpointMetadata` (of a
        :class:`RootMetadata`: without its index)."""
        return CheckpointMetadata(**{f.name: getattr(self, f.name) for f in fields(CheckpointMetadata)})


@dataclass(frozen=True)
class RootMetadata(CheckpointMetadata):
    """The whole ``attributes.tensorckpt`` document (spec 9.3): the
    checkpoint's own fields (keywords), the index of tensors and values."""

    tensors: dict[str, TensorEntry]
    values: dict[str, object]
    must_understand: tuple[str, ...] = ()
    array_digests: dict[str, str] = field(default_factory=dict)  # flat key -> digest of its array zarr.json (9.8)

    def to_json(self) -> RootJSON:
        """The ``attributes.tensorckpt`` document."""
        return cast(RootJSON, self._members({k: e.to_json() for k, e in sorted(self.tensors.items())}))

    def _members(self, tensors: object) -> dict[str, object]:
        """The document's members in order, with ``tensors`` as given."""
        doc: dict[str, object] = {
            "format_version": self.format_version,
            "must_understand": list(self.must_understand),
            "library_version": self.library_version,
            "created": self.created,
            "world_size": self.world_size,
            "user_metadata": self.user_metadata,
            "tensors": tensors,
            "values": dict(sorted(self.values.items())),
        }
        if self.save_stats is not None:
            doc["save_stats"] = self.save_stats.to_json()
        if self.checkpoint_id:
            doc["checkpoint_id"] = self.checkpoint_id
            doc["array_digests"] = dict(sorted(self.array_digests.items()))
        return doc


def root_group_json(meta: RootMetadata) -> bytes:
    """The bytes of the root ``zarr.json`` that commits a checkpoint: exactly
    ``dumps`` of ``{"zarr_format": 3, "node_type": "group", "attributes":
    {ATTRIBUTE: meta.to_json()}}``, but each tensor entry's text is cached
    (a plan reused by the next save has the same entries) and spliced in as
    text: building thousands of dicts per save set off full garbage
    collections that cost more than the rest of a small-tensor commit."""
    doc = meta._members(None)
    tensors = "{" + ", ".join(f"{_text(k)}: {entry_json(meta.tensors[k])}" for k in sorted(meta.tensors)) + "}"
    members = [f"{_text(k)}: {tensors if k == 'tensors' else _text(v)}" for k, v in doc.items()]
    if meta.checkpoint_id:  # since 1.3: sealed by a checksum over the document's bytes (spec 9.8)
        members.append(f'"checksum": "{_UNSEALED}"')
    attrs = "{" + ", ".join(members) + "}"
    text = f'{{"zarr_format": 3, "node_type": "group", "attributes": {{{_text(ATTRIBUTE)}: {attrs}}}}}'.encode()
    return seal(text) if meta.checkpoint_id else text


# ----------------------------------------------------------- integrity (1.3)
# spec 9.8: a root of format 1.3 ends with its checksum member; the checksum
# is the SHA-256 of the document's bytes with its own 64 hex digits written
# as zeros, so any flipped bit of the root fails the open.

_UNSEALED = "0" * 64
_SEALED_END = re.compile(rb'"checksum": "([0-9a-f]{64})"\}\}\}\Z')
DIGEST_HEX = re.compile(r"[0-9a-f]{64}")
CHECKPOINT_ID = re.compile(r"[0-9a-f]{32}")


def new_checkpoint_id() -> str:
    """A fresh checkpoint identity: 128 random bits as 32 hex digits (9.8)."""
    return secrets.token_hex(16)


def seal(text: bytes) -> bytes:
    """A root document ending in ``"checksum": "000...0"}}}`` with the zeros
    replaced by the document's checksum."""
    if not text.endswith(f'"checksum": "{_UNSEALED}"}}}}}}'.encode()):
        raise ValueError("not an unsealed root document")
    return text[:-68] + hashlib.sha256(text).hexdigest().encode() + text[-4:]


def check_seal(raw: bytes, stored: object, where: str) -> None:
    """Check the root document's checksum (9.8): ``raw`` must end with the
    checksum member, whose value (``stored``, as parsed) is the SHA-256 of
    ``raw`` with those 64 digits written as zeros."""
    m = _SEALED_END.search(raw)
    if m is None or m.group(1).decode() != stored:
        raise CorruptCheckpointError(
            f"{where}: the root metadata's checksum member is malformed or not the document's last member "
            "(the root zarr.json is damaged, or was rewritten by a tool that does not reseal it)"
        )
    unsealed = raw[:m.start(1)] + _UNSEALED.encode() + raw[m.end(1):]
    if hashlib.sha256(unsealed).hexdigest() != stored:
        raise CorruptCheckpointError(
            f"{where}: the root metadata fails its checksum: the root zarr.json is corrupt "
            "(a value such as a step, learning rate or sampler position may have changed); do not use it"
        )


@functools.lru_cache(maxsize=1 << 16)
def entry_json(entry: TensorEntry) -> str:
    """``entry.to_json()`` as JSON text (cached: entries are immutable)."""
    return _text(entry.to_json())


def _text(doc: object) -> str:
    return json.dumps(doc, allow_nan=False, ensure_ascii=False)


def dumps(doc: object) -> bytes:
    return json.dumps(doc, allow_nan=False, ensure_ascii=False).encode("utf-8")


# ----------------------------------------------------------------- values


def check_value(value: object, key: str, _level: int = 1) -> object:
    """Validate a non-tensor leaf and return its JSON form (tuples -> lists).

    Raises :class:`UnsupportedValueError` naming ``key`` for anything that is not
    None, bool, int, finite float, str, or lists/dicts of these, or that is
    nested deeper than a reader accepts (the root document wraps a value in
    four more levels).
    """
    if _level > MAX_DEPTH - 4:
        raise UnsupportedValueError(f"{key[:80]!r}: nested more than {MAX_DEPTH - 4} levels deep; readers refuse that")
    if isinstance(value, str):
        _check_text(value, key)
        return value
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not MIN_INT <= value <= MAX_INT:
            raise UnsupportedValueError(f"{key!r}: integer {value} is outside [-2**63, 2**64)")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UnsupportedValueError(
                f"{key!r}: {value} is not representable in JSON; store it as a 0-d tensor "
                "(torch.tensor(value)) instead"
            )
        return float(value)
    if isinstance(value, (list, tuple)):
        return [check_value(v, f"{key}[{i}]", _level + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise UnsupportedValueError(f"{key!r}: dict key {k!r} is not a str (JSON needs str keys)")
            _check_text(k, key)
            out[k] = check_value(v, f"{key}.{k}", _level + 1)
        return out
    raise UnsupportedValueError(
        f"{key!r}: a {type(value).__module__}.{type(value).__qualname__} is neither a tensor nor "
        "JSON-able data (None, bool, int, float, str, list, dict); tensorckpt never pickles. "
        "Convert it, e.g. to a uint8 tensor (torch.frombuffer(bytearray(data), dtype=torch.uint8)) "
        "or to plain data"
    )


def _check_text(s: str, key: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsupportedValueError(f"{key!r}: string {s[:40]!r} is not valid Unicode text (lone surrogate)") from None


# ----------------------------------------------------------------- parsing


def parse_root(doc: object, where: str, raw: bytes | None = None) -> RootMetadata:
    """Parse an untrusted root ``zarr.json`` document (``raw``: its bytes, for
    the checksum of 1.3) by the reader that its ``format_version`` selects
    (:func:`.versions.read_root`); every problem raises a tensorckpt error
    naming ``where``."""
    from .versions import read_root  # the readers build on this module

    return read_root(doc, where, raw)


def _check_key(key: str, where: str) -> None:
    if key.count("/") >= MAX_DEPTH:
        raise CorruptCheckpointError(f"{where}: key {key[:80]!r}... has more than {MAX_DEPTH} components")
    try:
        split_flat_key(key)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from None


def _check_tree(keys: list[str], where: str) -> None:
    """The flat keys form a tree: no leaf is also a prefix of another (spec
    section 4). A trie of components keeps this linear in the keys' length."""
    root: dict = {}
    for key in keys:
        node, parts = root, key.split("/")
        for i, part in enumerate(parts):
            if None in node:  # None marks a leaf; components are strings
                raise CorruptCheckpointError(f"{where}: key {'/'.join(parts[:i])!r} is a leaf but also a prefix of {key!r}")
            node = node.setdefault(part, {})
        if node:
            raise CorruptCheckpointError(f"{where}: key {key!r} is a leaf but also a prefix of another key")
        node[None] = True


def parse_tensor_entry(entry: object, where: str) -> TensorEntry:
    entry = _obj(entry, where)
    dtype = _dtypes.for_name(entry.get("dtype"), where)
    if entry.get("data_type") != dtype.zarr_name:
        raise CorruptCheckpointError(
            f"{where}: data_type {entry.get('data_type')!r} does not match dtype {dtype.torch_name!r}"
        )
    shape = _shape(entry.get("shape"), f"{where}.shape", allow_zero=True)
    chunk = _shape(entry.get("chunk_shape"), f"{where}.chunk_shape", allow_zero=False)
    inner = _shape(entry.get("inner_chunk_shape"), f"{where}.inner_chunk_shape", allow_zero=False)
    if not len(shape) == len(chunk) == len(inner):
        raise CorruptCheckpointError(f"{where}: shape, chunk_shape and inner_chunk_shape differ in rank")
    if any(c % i for c, i in zip(chunk, inner)):
        raise CorruptCheckpointError(f"{where}: inner_chunk_shape {inner} does not divide chunk_shape {chunk}")
    if math.prod(shape) > MAX_ELEMENTS or math.prod(chunk) > MAX_ELEMENTS:
        raise CorruptCheckpointError(f"{where}: shape {shape} is implausibly large")
    e = TensorEntry(dtype.torch_name, shape, chunk, inner)
    over = past_caps(e)
    if over:
        raise CorruptCheckpointError(f"{where}: {over}; writers must not write such an entry (it is damaged or forged)")
    return e


def encoded_inner_bytes(e: TensorEntry) -> int:
    """One stored inner chunk of ``e``: its elements and their CRC-32C."""
    return math.prod(e.inner_chunk_shape) * e.itemsize + 4


def past_caps(e: TensorEntry) -> str:
    """What of ``e``'s stored objects is larger than spec 12 allows (its
    encoded inner chunk, its shard index), or "" if nothing: readers refuse
    such an entry when they validate the root, writers never plan one."""
    inner = encoded_inner_bytes(e)
    if inner > MAX_INNER_CHUNK_BYTES:
        return (f"its inner chunk {list(e.inner_chunk_shape)} of {e.dtype} is {inner} bytes encoded, more than the "
                f"{MAX_INNER_CHUNK_BYTES} ({MAX_INNER_CHUNK_BYTES >> 20} MiB) a reader accepts (spec 12)")
    index = 16 * math.prod(c // i for c, i in zip(e.chunk_shape, e.inner_chunk_shape)) + 4
    if index > MAX_SHARD_INDEX_BYTES:
        return (f"its chunk {list(e.chunk_shape)} holds {(index - 4) // 16} inner chunks {list(e.inner_chunk_shape)}, "
                f"a shard index of {index} bytes, more than the {MAX_SHARD_INDEX_BYTES} "
                f"({MAX_SHARD_INDEX_BYTES >> 20} MiB) a reader accepts (spec 12)")
    return ""


def _shape(v: object, where: str, allow_zero: bool) -> tuple[int, ...]:
    lo = 0 if allow_zero else 1
    if not isinstance(v, list) or len(v) > 32 or not all(
        isinstance(x, int) and not isinstance(x, bool) and lo <= x <= MAX_ELEMENTS for x in v
    ):
        raise CorruptCheckpointError(f"{where}: expected a list of at most 32 integers >= {lo}, got {repr(v)[:200]}")
    return tuple(v)


def _obj(v: object, where: str) -> dict:
    if not isinstance(v, dict):
        raise CorruptCheckpointError(f"{where}: expected a JSON object, got {type(v).__name__}")
    return v


def loads(data: bytes, where: str) -> object:
    """Decode untrusted JSON bytes, nested at most ``MAX_DEPTH`` deep (so
    whatever later walks the document recursively cannot run out of stack);
    raises CorruptCheckpointError naming ``where``."""
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not valid UTF-8 JSON ({e})") from None
    if data.count(b"[") + data.count(b"{") >= MAX_DEPTH and _depth(doc) > MAX_DEPTH:  # each level opens one
        raise CorruptCheckpointError(f"{where}: JSON nested more than {MAX_DEPTH} levels deep")
    return doc


def _depth(doc: object) -> int:
    """Nesting depth of a JSON document, without recursion."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return deepest


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text} overflows a float")
    return v
