"""The validator's checks of format 1.3's position-bound integrity
(spec/format-v1.md 7.1 and 9.8), written from the spec alone (never
tensorckpt): the root's checksum over its own bytes (wherever the member is
present, whatever version the root claims), its ``checkpoint_id`` and
``array_digests``, each array ``zarr.json``'s digest, id and
``chunk_digests``, and every stored chunk's digest: the SHA-256 of the stored
CRC-32Cs of its inner chunks that intersect the array, in C order of the inner
grid. Used by :mod:`conformance.validate`."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
from collections.abc import Callable

Add = Callable[[str, str, str], None]

RULES = {
    "root-checksum": ("format-v1.md 9.8", "a root with a checksum ends with it, the SHA-256 of the document with its digits as zeros"),
    "integrity-members": ("format-v1.md 9.8", "a 1.3 root has checkpoint_id, array_digests naming exactly the tensors, and checksum"),
    "array-digest": ("format-v1.md 9.8", "an array zarr.json is the one the root records, with its checkpoint_id and a digest per chunk"),
    "chunk-digest": ("format-v1.md 7.1", "a chunk's digest (its inner chunks' CRC-32Cs) is the one its array records at its position"),
}

_SUFFIX = re.compile(rb'"checksum": "([0-9a-f]{64})"\}\}\}\Z')
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_EMPTY = 2**64 - 1


def _version(meta: dict) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)", str(meta.get("format_version", "")))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_root(raw: bytes, meta: dict, add: Add) -> bool:
    """The root's checksum and 1.3 members. Returns whether the arrays'
    digests are to be checked (a 1.3 root with well-formed members)."""
    if "checksum" in meta:
        m = _SUFFIX.search(raw)
        if m is None or m.group(1).decode() != meta["checksum"]:
            add("root-checksum", "zarr.json", "the checksum member is not the document's last, as 9.8 requires")
        else:
            unsealed = raw[:m.start(1)] + b"0" * 64 + raw[m.end(1):]
            if hashlib.sha256(unsealed).hexdigest() != meta["checksum"]:
                add("root-checksum", "zarr.json", "the root document fails its checksum: some byte of it changed")
    if _version(meta) < (1, 3):
        return False
    ident, sums, tensors = meta.get("checkpoint_id"), meta.get("array_digests"), meta.get("tensors")
    problems = []
    if not (isinstance(ident, str) and _HEX32.fullmatch(ident)):
        problems.append("checkpoint_id is not 32 lower-case hex digits")
    if "checksum" not in meta:
        problems.append("checksum is missing")
    if not (isinstance(sums, dict) and isinstance(tensors, dict) and sums.keys() == tensors.keys()
            and all(isinstance(v, str) and _HEX64.fullmatch(v) for v in sums.values())):
        problems.append("array_digests does not give a 64-hex-digit digest for exactly the tensors")
    for p in problems:
        add("integrity-members", "zarr.json", p)
    return not problems


def check_arrays(root: str, meta: dict, tensors: dict[str, dict], usable: set[str],
                 stored: dict[str, dict[tuple[int, ...], int | None]], add: Add) -> None:
    """Each usable array's document against the root, then its stored chunks' digests."""
    for key in sorted(usable):
        rel = f"{key}/zarr.json"
        with open(os.path.join(root, rel), "rb") as f:  # a regular file: check_nodes found the array usable
            data = f.read(16 << 20)
        if hashlib.sha256(data).hexdigest() != meta["array_digests"].get(key):
            add("array-digest", rel, "not the array document the root records (swapped, from another checkpoint, or changed)")
            continue
        attrs = json.loads(data).get("attributes", {}).get("tensorckpt", {})
        e = tensors[key]
        grid = [-(-s // c) for s, c in zip(e["shape"], e["chunk_shape"])]
        digests = attrs.get("chunk_digests")
        if attrs.get("checkpoint_id") != meta["checkpoint_id"]:
            add("array-digest", rel, "its checkpoint_id is not the root's")
            continue
        if not (isinstance(digests, list) and len(digests) == math.prod(grid)):
            add("array-digest", rel, f"chunk_digests does not list {math.prod(grid)} digests, one per chunk")
            continue
        for pos, size in sorted(stored.get(key, {}).items()):
            if size is None:
                continue
            got = _chunk_digest(os.path.join(root, key, "c", *map(str, pos)), e, pos)
            linear = 0
            for p, n in zip(pos, grid):
                linear = linear * n + p
            if got is not None and got != digests[linear]:
                add("chunk-digest", f"{key}/c/{'/'.join(map(str, pos))}",
                    "intact, but not the chunk its array records at this position (swapped or replayed)")


def _chunk_digest(path: str, e: dict, pos: tuple[int, ...]) -> str | None:
    """The digest of the chunk object at ``path`` (7.1), read 4 bytes per
    inner chunk after its index; None where the index or an entry is damaged
    (other rules report that)."""
    chunk, inner, shape = e["chunk_shape"], e["inner_chunk_shape"], e["shape"]
    sub = [c // i for c, i in zip(chunk, inner)]
    n = math.prod(sub)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        size = os.fstat(fd).st_size
        if size < 16 * n + 4:
            return None
        index = os.pread(fd, 16 * n, size - 16 * n - 4)
        extent = [min(c, s - p * c) for c, s, p in zip(chunk, shape, pos)]
        crcs = []
        for j, w in enumerate(itertools.product(*[range(k) for k in sub])):
            if any(x * i >= x_max for x, i, x_max in zip(w, inner, extent)):
                continue  # wholly outside the array
            off = int.from_bytes(index[16 * j:16 * j + 8], "little")
            nbytes = int.from_bytes(index[16 * j + 8:16 * j + 16], "little")
            if off == _EMPTY or nbytes < 4 or off + nbytes > size - 16 * n - 4:
                return None
            crcs.append(os.pread(fd, 4, off + nbytes - 4))
    finally:
        os.close(fd)
    return hashlib.sha256(b"".join(crcs)).hexdigest()
