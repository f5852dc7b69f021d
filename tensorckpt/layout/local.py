"""Local plans: what one rank holds, in the compact form every rank sends to
rank 0 when a save starts.

At 8,960 ranks and 1,000+ tensors a plan made of one Python object per box
would be about 75 KB pickled per rank (650 MB gathered on rank 0, and a minute
to unpickle). A :class:`LocalItems` is instead two compressed byte strings:

- the *table*, one ``[key, dtype, shape]`` row per tensor, as JSON. Ranks of
  one job mostly hold the same tensors, so rank 0 decodes each distinct table
  once (equal bytes, equal table);
- the *boxes*, one int64 array: for each tensor in table order, its box's
  offset then its shape.

Both are plain bytes (no pickled classes inside): about 3.3 KB per rank for
1,043 tensors sharded FSDP-style. Iterating a :class:`LocalItems` still gives
:class:`LocalItem` objects.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from ..errors import IncompatibleStateError
from .boxes import Box

Spec = tuple[str, str, tuple[int, ...]]  # (key, dtype, global shape)


@dataclass(frozen=True)
class LocalItem:
    """One rank holds ``box`` of tensor ``key`` (global ``shape``, ``dtype``)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    box: Box


class LocalItems(Sequence[LocalItem]):
    """The tensors one rank holds (at most one box of each), compactly.

    Build one with :meth:`of` (from :class:`LocalItem` objects) or
    :meth:`from_arrays`; equal contents give equal bytes, so two are equal
    exactly when they hold the same boxes of the same tensors in the same order.
    """

    __slots__ = ("_count", "_decoded", "boxes", "table")

    def __init__(self, count: int, table: bytes, boxes: bytes) -> None:
        self._count = count  # number of tensors (len(); not `count`, which is Sequence.count)
        self.table = table  # zlib-compressed JSON: [[key, dtype, shape], ...]
        self.boxes = boxes  # zlib-compressed int64 (little-endian): offset + shape per tensor
        self._decoded: tuple[LocalItem, ...] | None = None  # on first use; never sent

    @classmethod
    def of(cls, items: Iterable[LocalItem]) -> LocalItems:
        items = list(items)
        for it in items:
            if len(it.box.offset) != len(it.shape) or len(it.box.shape) != len(it.shape):
                raise IncompatibleStateError(
                    f"{it.key!r}: shard {it.box.to_json()} lies outside the global shape {list(it.shape)}"
                )
        specs = [(it.key, it.dtype, tuple(it.shape)) for it in items]
        flat = [n for it in items for n in (*it.box.offset, *it.box.shape)]
        return cls.from_arrays(specs, np.array(flat, np.int64))

    @classmethod
    def from_arrays(cls, specs: Sequence[Spec], boxes: np.ndarray) -> LocalItems:
        """From the table rows ``(key, dtype, shape)`` and one flat int array
        holding, for each row in turn, its box's offset then its shape
        (``2 * len(shape)`` numbers)."""
        twice = sorted(k for k, n in Counter(k for k, _, _ in specs).items() if n > 1)
        if twice:
            raise ValueError(f"a rank holds at most one box of each tensor; {twice[:10]} appear more than once")
        boxes = np.asarray(boxes, dtype="<i8")
        if boxes.shape != (sum(2 * len(s) for _, _, s in specs),):
            raise ValueError(f"boxes: expected {sum(2 * len(s) for _, _, s in specs)} numbers, got shape {boxes.shape}")
        table = json.dumps([[k, d, list(s)] for k, d, s in specs], separators=(",", ":"))
        return cls(len(specs), zlib.compress(table.encode()), zlib.compress(boxes.tobytes()))

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> LocalItem: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[LocalItem, ...]: ...
    def __getitem__(self, i: int | slice) -> LocalItem | tuple[LocalItem, ...]:
        return self._items()[i]

    def __iter__(self) -> Iterator[LocalItem]:
        return iter(self._items())

    def _items(self) -> tuple[LocalItem, ...]:
        if self._decoded is None:
            out, flat, pos = [], np.frombuffer(zlib.decompress(self.boxes), dtype="<i8").tolist(), 0
            for key, dtype, shape in decode_table(self.table):
                n = len(shape)
                box = Box(tuple(flat[pos : pos + n]), tuple(flat[pos + n : pos + 2 * n]))
                out.append(LocalItem(key, dtype, shape, box))
                pos += 2 * n
            self._decoded = tuple(out)
        return self._decoded

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LocalItems):
            return NotImplemented
        return (self._count, self.table, self.boxes) == (other._count, other.table, other.boxes)

    def __hash__(self) -> int:
        return hash((self._count, self.table, self.boxes))

    def __reduce__(self) -> tuple[type[LocalItems], tuple[int, bytes, bytes]]:
        return (LocalItems, (self._count, self.table, self.boxes))

    def __repr__(self) -> str:
        return f"LocalItems({self._count} tensors, {len(self.table) + len(self.boxes)} bytes)"


def decode_table(table: bytes) -> tuple[Spec, ...]:
    return tuple((k, d, tuple(s)) for k, d, s in json.loads(zlib.decompress(table)))


@dataclass(frozen=True, init=False)
class LocalPlan:
    """What ``rank`` holds: ``items`` (any iterable of :class:`LocalItem`,
    kept as :class:`LocalItems`) and its non-tensor ``values``."""

    rank: int
    items: LocalItems
    values: dict  # flat key -> JSON value

    def __init__(self, rank: int, items: Iterable[LocalItem], values: dict | None = None) -> None:
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "items", items if isinstance(items, LocalItems) else LocalItems.of(items))
        object.__setattr__(self, "values", {} if values is None else values)
