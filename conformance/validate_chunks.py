"""The validator's checks of stored nodes and chunks (format-v1.md sections 4, 6, 7).

- every tensor of the index has an array ``zarr.json`` that agrees with its entry,
  every prefix of a tensor's key is a group, and nothing else is stored (no
  unindexed array, no stray object);
- every chunk of the grid is stored; each chunk object's size lies within the
  bounds of section 7; its shard index has a correct CRC-32C, entries of the
  right length whose ranges lie before the index, no empty marker for an inner
  chunk that intersects the array, and ranges that fill the object exactly;
  every inner chunk that intersects the array has a correct CRC-32C; bool
  elements are 0 or 1.

Reads are bounded: a chunk's size is checked before anything of it is read,
its index is read alone, and inner chunks are read one at a time (or a whole
object of at most ``BLOCK`` bytes at once). ``add(rule, where, message)``
receives every violation.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

try:
    from . import validate_base as base
except ImportError:  # run as a script
    import validate_base as base  # type: ignore[no-redef,import-not-found]

Add = Callable[[str, str, str], None]
INDEX_CAP = 64 << 20  # largest shard index read (4M inner chunks per chunk)
BLOCK = 16 << 20  # largest read at once
READ_CAP = 16 << 20  # largest tensor TensorReader assembles (RNG rows, scheduler tensors)
EMPTY = 2**64 - 1
SHOWN_MISSING = 5
BYTES_LE = {"name": "bytes", "configuration": {"endian": "little"}}
_CHUNK_PART = re.compile(r"0|[1-9][0-9]*")
NUMPY = {"float64": "<f8", "float32": "<f4", "float16": "<f2", "int8": "i1", "int16": "<i2", "int32": "<i4",
         "int64": "<i8", "uint8": "u1", "bool": "u1", "complex64": "<c8", "complex128": "<c16"}


def _same_ints(a: Any, b: list[int]) -> bool:
    return isinstance(a, list) and len(a) == len(b) and all(base.is_int(x) and x == y for x, y in zip(a, b))


def _bytes_codec(c: Any, itemsize: int) -> bool:
    return c == BYTES_LE or (itemsize == 1 and c in ({"name": "bytes"}, {"name": "bytes", "configuration": {}}))


def array_problems(doc: Any, e: dict) -> tuple[list[str], list[str]]:
    """(problems with the document itself, disagreements with entry ``e``)."""
    if not isinstance(doc, dict):
        return ["is not a JSON object"], []
    meta: list[str] = []
    dtype = e["dtype"]
    data_type, itemsize, _ = base.DTYPES[dtype]
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
        meta.append("zarr_format must be 3 and node_type \"array\"")
    codecs = doc.get("codecs")
    shard: dict = codecs[0] if isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict) else {}
    cfg: dict = shard["configuration"] if isinstance(shard.get("configuration"), dict) else {}
    inner_codecs = cfg.get("codecs")
    inner_ok = isinstance(inner_codecs, list) and len(inner_codecs) == 2 and \
        _bytes_codec(inner_codecs[0], itemsize) and inner_codecs[1] == {"name": "crc32c"}
    index_ok = cfg.get("index_codecs") == [BYTES_LE, {"name": "crc32c"}]
    if shard.get("name") != "sharding_indexed" or cfg.get("index_location", "end") != "end" or not inner_ok \
            or not index_ok:
        meta.append("codecs must be exactly one sharding_indexed codec with bytes (little-endian) + crc32c "
                    "for the inner chunks and the index, index at the end")
    if doc.get("storage_transformers", []) != []:
        meta.append("storage_transformers must be absent or []")
    if doc.get("chunk_key_encoding") not in ({"name": "default", "configuration": {"separator": "/"}},
                                             {"name": "default"}, {"name": "default", "configuration": {}}):
        meta.append('chunk_key_encoding must be {"name": "default", "configuration": {"separator": "/"}}')
    index: list[str] = []
    if not _same_ints(doc.get("shape"), e["shape"]):
        index.append(f"shape {base.short(doc.get('shape'))} differs from the index's {e['shape']}")
    if doc.get("data_type") != data_type:
        index.append(f"data_type {doc.get('data_type')!r} differs from {data_type!r} (dtype {dtype})")
    grid = doc.get("chunk_grid")
    chunk = grid.get("configuration", {}).get("chunk_shape") if isinstance(grid, dict) and \
        isinstance(grid.get("configuration"), dict) else None
    if not isinstance(grid, dict) or grid.get("name") != "regular" or not _same_ints(chunk, e["chunk_shape"]):
        index.append(f"chunk_grid {base.short(grid)} is not regular with the index's chunk_shape {e['chunk_shape']}")
    if not _same_ints(cfg.get("chunk_shape"), e["inner_chunk_shape"]):
        index.append(f"inner chunk_shape {base.short(cfg.get('chunk_shape'))} differs from the index's {e['inner_chunk_shape']}")
    attrs = doc.get("attributes")
    tc = attrs.get("tensorckpt") if isinstance(attrs, dict) else None
    if not isinstance(tc, dict) or tc.get("dtype") != dtype:
        index.append(f"attributes.tensorckpt must be {{\"dtype\": {dtype!r}}}")
    return meta, index


def check_nodes(root: str, listing: base.Listing, tensors: dict, values: dict, good: dict[str, dict],
                add: Add) -> tuple[set[str], dict[str, dict]]:
    """Arrays, groups and unexpected objects (sections 4, 7). Returns the keys of
    ``good`` whose array agrees with its entry, and each tensor's stored chunks
    (grid position -> size, None for a file that is not regular)."""
    usable: set[str] = set()
    for key, e in sorted(good.items()):
        rel = f"{key}/zarr.json"
        if rel not in listing.files:
            if rel not in listing.special:
                add("array-missing", key, f"tensor {key!r} has no array: {rel} is missing")
            continue
        try:
            doc = base.read_json(root, rel, base.NODE_JSON_CAP)
        except ValueError as err:
            add("array-metadata", rel, f"{rel} {err}")
            continue
        meta, index = array_problems(doc, e)
        for problem in base.schema_errors("array-v1.schema.json", doc):
            meta.append(f"array schema: {problem.message} (at /{'/'.join(map(str, problem.absolute_path))})")
        if meta:
            add("array-metadata", rel, f"{rel}: {'; '.join(meta)}")
        if index:
            add("array-index", rel, f"{rel} disagrees with tensor {key!r} of the root index: {'; '.join(index)}")
        if not meta and not index:
            usable.add(key)
    tensor_keys = set(tensors)
    canonical = [k for k in (*tensors, *values) if base.key_problem(k) is None]  # others are reported already
    required = {p for k in canonical if k in tensor_keys for p in base.prefixes(k)}
    allowed = {p for k in canonical for p in base.prefixes(k)}
    for p in sorted(required):
        if f"{p}/zarr.json" not in listing.files and f"{p}/zarr.json" not in listing.special:
            add("group-missing", p, f"{p}/zarr.json is missing: every prefix of a tensor's key must be a group")
    stored: dict[str, dict] = {k: {} for k in tensors}
    stray_arrays: list[str] = []
    for rel in sorted(listing.files):
        node = rel[: -len("/zarr.json")] if rel.endswith("/zarr.json") else None
        if node is None or node in tensor_keys or node in allowed or any(node.startswith(a + "/") for a in stray_arrays):
            continue
        try:
            doc = base.read_json(root, rel, base.NODE_JSON_CAP)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("node_type") == "array":
            stray_arrays.append(node)
            add("unindexed-array", node, f"{node} is an array that the root index does not list as a tensor")
    entries = sorted([*((p, s) for p, s in listing.files.items()), *((p, None) for p in listing.special)])
    for rel, size in entries:
        if rel == "zarr.json":
            continue
        node = rel[: -len("/zarr.json")] if rel.endswith("/zarr.json") else None
        if node is not None and node in tensor_keys:
            continue  # checked above
        if node is not None and node in allowed:
            if size is not None:
                try:
                    doc = base.read_json(root, rel, base.NODE_JSON_CAP)
                    ok = isinstance(doc, dict) and doc.get("zarr_format") == 3 and doc.get("node_type") == "group"
                    why = "is not a Zarr v3 group (zarr_format 3, node_type \"group\")"
                except ValueError as err:
                    ok, why = False, str(err)
                if not ok:
                    add("group-metadata", rel, f"{rel} {why}")
            continue
        if any(rel.startswith(a + "/") for a in stray_arrays):
            continue  # part of an unindexed array, reported once
        owner = next((p for p in base.prefixes(rel) if p in tensor_keys), None)
        if owner is not None:
            pos = _chunk_position(rel[len(owner) + 1:], tensors[owner], owner in good)
            if pos is not None:
                stored[owner][pos] = size
                continue
            if owner not in good:
                continue  # an invalid entry: its objects cannot be interpreted, the entry is reported
        if size is not None:  # special files are reported once, as special-file
            add("unexpected-object", rel, f"{rel} is not an object of the checkpoint (section 4 names no such object)")
    return usable, stored


def _chunk_position(rest: str, e: Any, valid: bool) -> tuple[int, ...] | None:
    """The grid position of the chunk object ``rest`` (relative to its array), or None."""
    if not valid:
        return () if rest == "c" or rest.startswith("c/") else None
    parts = rest.split("/")
    if parts[0] != "c" or len(parts) - 1 != len(e["shape"]):
        return None
    if not all(_CHUNK_PART.fullmatch(p) for p in parts[1:]):
        return None
    pos = tuple(int(p) for p in parts[1:])
    grid = [-(-s // c) for s, c in zip(e["shape"], e["chunk_shape"])]
    if any(i >= g for i, g in zip(pos, grid)) or math.prod(grid) == 0:
        return None
    return pos


def chunk_name(pos: tuple[int, ...]) -> str:
    return "/".join(("c", *map(str, pos)))


def _positions(grid: list[int]) -> Iterator[tuple[int, ...]]:
    """Grid positions in C order, lazily (a forged grid may have 2^62)."""
    pos = [0] * len(grid)
    while True:
        yield tuple(pos)
        d = len(grid) - 1
        while d >= 0 and pos[d] == grid[d] - 1:
            pos[d] = 0
            d -= 1
        if d < 0:
            return
        pos[d] += 1


class Geometry:
    """The layout of one chunk object of tensor entry ``e`` at grid position ``pos``."""

    def __init__(self, e: dict, pos: tuple[int, ...]) -> None:
        shape, chunk, inner = e["shape"], e["chunk_shape"], e["inner_chunk_shape"]
        self.itemsize = base.DTYPES[e["dtype"]][1]
        self.lo = [i * c for i, c in zip(pos, chunk)]
        self.per = [c // i for c, i in zip(chunk, inner)]
        self.n = math.prod(self.per)
        self.inner = inner
        self.e = math.prod(inner) * self.itemsize + 4
        self.inside = [-(-(min(lo + c, s) - lo) // i) for lo, c, s, i in zip(self.lo, chunk, shape, inner)]
        self.k = math.prod(self.inside)
        self.index_len = 16 * self.n + 4
        self.bounds = (self.k * self.e + self.index_len, self.n * self.e + self.index_len)
        self.shape = shape

    def mask(self) -> np.ndarray:
        """Which inner chunks (C order) intersect the array."""
        if not self.per:
            return np.ones(1, dtype=bool)
        m = np.ones(self.per, dtype=bool)
        for d, (p, k) in enumerate(zip(self.per, self.inside)):
            sl = [slice(None)] * len(self.per)
            sl[d] = slice(k, p)
            m[tuple(sl)] = False
        return m.ravel()

    def extent(self, j: int) -> tuple[tuple[int, ...], tuple[slice, ...]]:
        """Inner chunk ``j``'s origin in the array and the part of it inside the array."""
        idx = np.unravel_index(j, self.per) if self.per else ()
        origin = tuple(lo + int(i) * s for lo, i, s in zip(self.lo, idx, self.inner))
        return origin, tuple(slice(0, min(s, n - o)) for s, n, o in zip(self.inner, self.shape, origin))


def check_chunks(root: str, key: str, e: dict, stored: dict[tuple[int, ...], int | None], add: Add,
                 notes: list[str] | None = None) -> int:
    """Every chunk of tensor ``key``; returns how many chunk objects were checked.
    What the validator's limits leave unchecked is appended to ``notes``."""
    grid = [-(-s // c) for s, c in zip(e["shape"], e["chunk_shape"])]
    total = math.prod(grid)
    missing = total - len(stored)
    if missing > 0:
        shown = []
        for pos in _positions(grid):
            if pos not in stored:
                shown.append(chunk_name(pos))
                if len(shown) == SHOWN_MISSING:
                    break
        more = f" and {missing - len(shown)} more" if missing > len(shown) else ""
        add("chunk-missing", f"{key}/{shown[0]}",
            f"tensor {key!r}: {missing} of {total} chunks are missing: {', '.join(shown)}{more}")
    checked = 0
    for pos in sorted(stored):
        size = stored[pos]
        if size is None:
            continue  # not a regular file: reported as special-file, never opened
        checked += 1
        rel = f"{key}/{chunk_name(pos)}"
        try:
            _check_object(root, rel, e, pos, size, add, notes if notes is not None else [])
        except OSError as err:
            add("chunk-size", rel, f"{rel} cannot be read ({err.strerror})")
    return checked


def _check_object(root: str, rel: str, e: dict, pos: tuple[int, ...], size: int, add: Add, notes: list[str]) -> None:
    g = Geometry(e, pos)
    need, most = g.bounds
    if not need <= size <= most:
        what = f"is {size} bytes, less than its {g.k} inner chunks and index need ({need}): it is truncated" \
            if size < need else f"is {size} bytes, more than its {g.n} inner chunks and index can take ({most})"
        add("chunk-size", rel, f"{rel} {what}")
        return
    if g.index_len > INDEX_CAP:
        notes.append(f"{rel}: its shard index of {g.index_len} bytes is larger than the validator reads ({INDEX_CAP}); "
                     "its index and inner chunks were not checked")
        return
    fd = base.open_file(root, rel)
    try:
        data_end = size - g.index_len
        raw = base.pread(fd, g.index_len, data_end)
        if base.crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
            add("index-crc", rel, f"{rel}: the CRC-32C of the shard index does not match")
            return
        entries = np.frombuffer(raw, dtype="<u8", count=2 * g.n).reshape(g.n, 2)
        off, nb = entries[:, 0], entries[:, 1]
        empty = (off == EMPTY) & (nb == EMPTY)
        inside = g.mask()
        bad = np.flatnonzero(empty & inside)
        if bad.size:
            add("index-empty", rel, f"{rel}: inner chunk {int(bad[0])} intersects the array but its index entry is the "
                f"empty marker ({bad.size} such entries); a missing inner chunk is corruption, never fill_value")
            return
        used = ~empty
        end = np.uint64(data_end)
        bad_len = np.flatnonzero(used & (nb != np.uint64(g.e)))
        bad_range = np.flatnonzero(used & ((nb > end) | (off > end - np.minimum(nb, end))))
        if bad_len.size or bad_range.size:
            j = int((bad_len if bad_len.size else bad_range)[0])
            add("index-entry", rel, f"{rel}: index entry {j} (offset {int(off[j])}, nbytes {int(nb[j])}) must have "
                f"nbytes {g.e} and lie before the index at {data_end}")
            return
        order = np.flatnonzero(used)[np.argsort(off[used], kind="stable")]
        at = 0
        for j in order.tolist():
            o = int(off[j])
            if o != at:
                what = f"overlaps the inner chunk before it (it starts at {o}, before {at})" if o < at else \
                    f"leaves bytes [{at}, {o}) that no index entry references"
                add("index-layout", rel, f"{rel}: inner chunk {j} {what}")
                return
            at = o + g.e
        if at != data_end:
            add("index-layout", rel, f"{rel}: bytes [{at}, {data_end}) before the index are referenced by no entry")
            return
        _check_inner(fd, rel, e, g, off, np.flatnonzero(used & inside).tolist(), data_end, add)
    finally:
        os.close(fd)


def _check_inner(fd: int, rel: str, e: dict, g: Geometry, off: np.ndarray, which: list[int], data_end: int,
                 add: Add) -> None:
    whole = base.pread(fd, data_end, 0) if data_end <= BLOCK else None
    failed: list[int] = []
    for j in which:
        o = int(off[j])
        if whole is not None:
            body = whole[o:o + g.e]
            crc = base.crc32c(body[:-4])
            stored_crc = body[-4:]
        elif g.e <= BLOCK:
            body = base.pread(fd, g.e, o)
            crc, stored_crc = base.crc32c(body[:-4]), body[-4:]
        else:
            body, crc, done = None, 0, 0
            while done < g.e - 4:
                n = min(BLOCK, g.e - 4 - done)
                crc = base.crc32c(base.pread(fd, n, o + done), crc)
                done += n
            stored_crc = base.pread(fd, 4, o + g.e - 4)
        if crc != int.from_bytes(stored_crc, "little"):
            failed.append(j)
        elif e["dtype"] == "bool" and body is not None:
            _, part = g.extent(j)
            elems = np.frombuffer(body, dtype="u1", count=g.e - 4).reshape(g.inner)[part]
            if elems.size and int(elems.max()) > 1:
                add("bool-value", rel, f"{rel}: inner chunk {j} holds a bool byte {int(elems.max())}; bools are 0 or 1")
    if failed:
        add("chunk-crc", rel, f"{rel}: the CRC-32C of inner chunk {failed[0]} does not match "
            f"({len(failed)} of {len(which)} inner chunks fail): the data is corrupt")


class TensorReader:
    """Reads small tensors whose metadata and chunks validated (for the
    training-state checks); None for anything else."""

    def __init__(self, root: str, tensors: dict[str, dict], usable: set[str]) -> None:
        self.root, self.tensors, self.usable = root, tensors, usable

    def __call__(self, key: str) -> np.ndarray | None:
        e = self.tensors.get(key)
        if e is None or key not in self.usable or e["dtype"] not in NUMPY:
            return None
        dt = np.dtype(NUMPY[e["dtype"]])
        if math.prod(e["shape"]) * dt.itemsize > READ_CAP:
            return None
        out = np.zeros(e["shape"], dtype=dt)
        grid = [-(-s // c) for s, c in zip(e["shape"], e["chunk_shape"])]
        try:
            for pos in (_positions(grid) if math.prod(grid) else ()):
                g = Geometry(e, pos)
                rel = f"{key}/{chunk_name(pos)}"
                fd = base.open_file(self.root, rel)
                try:
                    size = os.fstat(fd).st_size
                    if not g.bounds[0] <= size <= g.bounds[1] or size > READ_CAP + g.index_len:
                        return None
                    blob = base.pread(fd, size, 0)
                finally:
                    os.close(fd)
                idx = np.frombuffer(blob[size - g.index_len:], dtype="<u8", count=2 * g.n).reshape(g.n, 2)
                for j in np.flatnonzero(g.mask()).tolist():
                    o = int(idx[j, 0])
                    body = blob[o:o + g.e]
                    if len(body) != g.e or base.crc32c(body[:-4]) != int.from_bytes(body[-4:], "little"):
                        return None
                    origin, part = g.extent(j)
                    elems = np.frombuffer(body, dtype=dt, count=math.prod(g.inner)).reshape(g.inner)[part]
                    out[tuple(slice(o_, o_ + p.stop) for o_, p in zip(origin, part))] = elems
        except (OSError, ValueError):
            return None
        return out.astype(bool) if e["dtype"] == "bool" else out
