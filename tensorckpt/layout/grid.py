"""Chunk-grid math (pure; spec section "Chunking").

A stored tensor has a regular chunk grid whose chunk (a Zarr v3 *shard*, one
stored object) is written by one writer: usually the box that writer holds
(irregular splits: :mod:`tensorckpt.layout.regrid`); inside it, the ``sharding_indexed``
codec splits it into *inner chunks* of about 256 KiB, the unit of partial
reads, so a reader that needs a slice fetches only the inner chunks it
overlaps.
"""

from __future__ import annotations

import math

DEFAULT_SHARD_BYTES = 64 << 20
DEFAULT_INNER_BYTES = 256 << 10  # near-square [256, 256] fp32: cheap partial reads both ways


def single_writer_chunks(shape: tuple[int, ...], itemsize: int, shard_bytes: int = DEFAULT_SHARD_BYTES) -> tuple[int, ...]:
    """Shard shape for a tensor written by one process: whole trailing
    dimensions, the leading dimension cut into blocks of at most
    ``shard_bytes`` (at least one row). Zero-size dimensions get chunk 1."""
    if not shape:
        return ()
    chunk = [max(1, s) for s in shape]
    row_bytes = math.prod(chunk[1:]) * itemsize
    rows = max(1, shard_bytes // max(1, row_bytes))
    if rows > 64:
        rows -= rows % 64  # blocks of 64-row multiples split into clean inner chunks
    if chunk[0] <= rows:  # one block: round up so an odd row count still divides well
        rows = -(-chunk[0] // 64) * 64 if chunk[0] > 64 else chunk[0]
    chunk[0] = rows
    return tuple(chunk)


def inner_chunks(shard: tuple[int, ...], itemsize: int, target_bytes: int = DEFAULT_INNER_BYTES) -> tuple[int, ...]:
    """An inner-chunk shape that divides ``shard`` exactly and holds at most
    ``target_bytes`` where divisibility allows: repeatedly split the largest
    dimension by its smallest prime factor, which keeps inner chunks
    near-square so both row and column readers fetch little extra. A dimension
    whose smallest factor exceeds 16 is left whole rather than cut to slivers."""
    inner = list(shard)
    while math.prod(inner) * itemsize > target_bytes:
        splittable = [i for i in range(len(inner)) if 1 < _smallest_prime_factor(inner[i]) <= 16]
        if not splittable:
            break
        d = max(splittable, key=lambda i: (inner[i], i))  # ties: the later dimension
        inner[d] //= _smallest_prime_factor(inner[d])
    return tuple(inner)


def _smallest_prime_factor(n: int) -> int:
    f = 2
    while f * f <= n and f <= 16:
        if n % f == 0:
            return f
        f += 1
    return n if f * f > n else f  # f > 16: some factor above 16 (or n prime)


def cap_chunks(chunk: tuple[int, ...], itemsize: int, shard_bytes: int = DEFAULT_SHARD_BYTES) -> tuple[int, ...]:
    """Split a chunk (from :func:`tensorckpt.layout.regrid.choose_grid`) into
    divisors of itself until it holds at most ``shard_bytes`` where
    divisibility allows; boundaries of the uncapped grid stay chunk boundaries."""
    return inner_chunks(chunk, itemsize, shard_bytes)
