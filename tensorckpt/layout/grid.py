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

from ..format.metadata import MAX_INNER_CHUNK_BYTES

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
    whose smallest factor exceeds 16 is left whole rather than cut to slivers,
    unless the inner chunk would then be larger than a reader accepts
    (``MAX_INNER_CHUNK_BYTES``, spec 12): past that, any factor is used (a
    dimension with none, a prime, stays whole and the plan refuses the tensor)."""
    inner = _split(shard, itemsize, target_bytes, 16)
    return _split(inner, itemsize, MAX_INNER_CHUNK_BYTES - 4, None)  # the cap counts the CRC-32C's 4 bytes


def _split(dims: tuple[int, ...], itemsize: int, target_bytes: int, largest: int | None) -> tuple[int, ...]:
    """``dims`` split as :func:`inner_chunks` says, by factors up to
    ``largest`` (None: any factor of a dimension that is not prime)."""
    out = list(dims)
    while math.prod(out) * itemsize > target_bytes:
        factors = [_smallest_prime_factor(n, largest) for n in out]
        splittable = [i for i, (n, f) in enumerate(zip(out, factors))
                      if f > 1 and (f <= largest if largest is not None else f < n)]
        if not splittable:
            break
        d = max(splittable, key=lambda i: (out[i], i))  # ties: the later dimension
        out[d] //= factors[d]
    return tuple(out)


def _smallest_prime_factor(n: int, largest: int | None = 16) -> int:
    """The smallest prime factor of ``n``, or, where it exceeds ``largest``,
    some number above ``largest`` (``n`` where it is prime)."""
    f = 2
    while f * f <= n and (largest is None or f <= largest):
        if n % f == 0:
            return f
        f += 1
    return n if f * f > n else f  # f > largest: some factor above it (or n prime)


def cap_chunks(chunk: tuple[int, ...], itemsize: int, shard_bytes: int = DEFAULT_SHARD_BYTES) -> tuple[int, ...]:
    """Split a chunk (from :func:`tensorckpt.layout.regrid.choose_grid`) into
    divisors of itself until it holds at most ``shard_bytes`` where
    divisibility allows; boundaries of the uncapped grid stay chunk boundaries."""
    return _split(chunk, itemsize, shard_bytes, 16)
