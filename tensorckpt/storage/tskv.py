"""TensorStore kvstore backends (see :mod:`.backend`): object stores with no
rename and no modification times, committed root-last (:mod:`.commit_kv`);
chunks are read and written through TensorStore arrays
(:mod:`.arrays`). ``memory://`` today; an S3 or fsspec store is one more
subclass with its flags, and one line in ``backend._REGISTRY``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

from . import kv, pinned
from .commit_kv import RootLastCommit
from .direct import Pool, Writer
from .location import Location


class KvStore:
    """Any TensorStore kvstore driver, by the location's kvstore spec."""

    supports_rename = False
    records_times = False
    fast_chunks = False
    shared = True
    commit = RootLastCommit()

    def read(self, loc: Location, key: str, limit: int, where: str) -> tuple[object, bytes | None]:
        return pinned.read_remote(loc, key, limit, where)

    def read_range(self, loc: Location, key: str, start: int, length: int) -> bytes | None:
        data = kv.read(loc, key)
        return None if data is None else data[start:start + length]

    def write(self, loc: Location, key: str, data: bytes) -> None:
        kv.write(loc, key, data)

    def list(self, loc: Location, limit: int | None = None) -> list[str]:
        return kv.ts_list(loc, limit)

    def names(self, loc: Location) -> set[str]:
        return {k.split("/", 1)[0] for k in self.list(loc, limit=100_000)}

    def exists(self, loc: Location) -> bool:
        return bool(self.list(loc, limit=1))

    def sizes(self, loc: Location, prefix: str) -> Iterator[tuple[str, int | None]]:
        sub = Location(loc.scheme, f"{loc.path}/{prefix}")
        for name in self.list(sub):
            data = kv.read(sub, name)
            if data is not None:
                yield name, len(data)

    def age(self, loc: Location) -> float | None:
        return None

    def delete(self, loc: Location, key: str) -> None:
        kv.delete(loc, key)

    def delete_all(self, loc: Location) -> None:
        kv.ts_delete_all(loc)

    def prepare(self, loc: Location) -> None:
        return None

    def sync(self, loc: Location, keys: Collection[str] | None = None, fsynced: Collection[str] = ()) -> None:
        return None  # every write is complete when its future is

    def chunk_writer(self, loc: Location) -> Writer | None:
        return None

    def chunk_reader(self, loc: Location, url: str, threads: int | None = None) -> Pool | None:
        return None


class MemoryStore(KvStore):
    """``memory://``: TensorStore's in-process store, seen by this process only."""

    shared = False
