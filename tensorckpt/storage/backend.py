"""The storage interface: what tensorckpt needs from a place that stores a
checkpoint, and :func:`backend_for`, the one place a :class:`Location` is
mapped to the code that stores it.

Who calls what, in which order:

- a save (``engine/save.py``): :meth:`Backend.commit` ``.begin`` on rank 0
  (checks the target, picks where to write), :meth:`Backend.prepare` on every
  rank, then the array metadata through :mod:`.kv` and the chunks through
  :meth:`Backend.chunk_writer` (or TensorStore arrays where it gives None),
  :meth:`Backend.sync` on every rank, and ``commit.finish`` on rank 0 (or
  ``commit.abort`` on failure). :mod:`.commit` holds the two strategies'
  shared rules; the strategies themselves are :mod:`.commit_local` (spec
  10.2, atomic rename of a staging directory) and :mod:`.commit_kv` (10.3,
  the root ``zarr.json`` written last);
- a read (``storage/reader.py``, ``engine/load.py``, ``verify.py``):
  :meth:`Backend.read` for each small document (capped, spec 12), and
  :meth:`Backend.chunk_reader` where :attr:`Backend.fast_reads` (else
  TensorStore arrays, :meth:`Backend.sizes` bounding what they may allocate);
- ``clean`` and the manager: :meth:`Backend.names`, :meth:`Backend.age`,
  :meth:`Backend.committed_at`, :meth:`Backend.exists` and the strategy's
  ``leftovers`` / ``remove`` / ``promote`` / ``retire``.

The backends: :mod:`.local` (``file``), :mod:`.tskv` (``memory``, ``s3``:
TensorStore kvstores) and :mod:`.fsspec` (``fsspec``: every other file
system, with its own object I/O, ``kvstore`` False).

Backends differ by capability flags, never by scheme tests at call sites (as
zarr-python's ``Store``). Adding a kind of storage is one class here or in a
module of its own, and one line in :data:`_REGISTRY`.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Protocol

from .location import Location

if TYPE_CHECKING:
    from .commit import CommitStrategy
    from .direct import Pool, Writer


class Backend(Protocol):
    """One kind of storage. Every method takes the :class:`Location` it acts on."""

    @property
    def supports_rename(self) -> bool:
        """A file system: directories that can be held open and renamed atomically (10.2)."""
    @property
    def records_times(self) -> bool:
        """Objects carry modification times: :meth:`age` is not None (False: it
        is known only where a save stamped its marker, :mod:`.commit_kv`)."""
    @property
    def fast_chunks(self) -> bool:
        """:meth:`chunk_writer` / :meth:`chunk_reader` give tensorckpt's own codec (``direct.py``)."""
    @property
    def fast_reads(self) -> bool:
        """:meth:`chunk_reader` gives tensorckpt's own codec (also where TensorStore writes the chunks)."""
    @property
    def kvstore(self) -> bool:
        """TensorStore opens the location's kvstore spec; False: the backend
        does its own object I/O (``get``, ``create``, ``write_many``,
        ``copy_all`` besides the methods here; :mod:`.kv` asks it)."""
    @property
    def shared(self) -> bool:
        """Other processes see the same objects (a distributed job can use it)."""
    @property
    def commit(self) -> CommitStrategy:
        """How a save becomes valid in one step."""
    @property
    def timeout(self) -> float | None:
        """Seconds one storage operation may take before it fails; None: unbounded."""

    def read(self, loc: Location, key: str, limit: int, where: str) -> tuple[object, bytes | None]:
        """(storage generation or None, bytes or None if absent) of a small
        object, refused (``CorruptCheckpointError``) past ``limit`` bytes."""
    def read_range(self, loc: Location, key: str, start: int, length: int) -> bytes | None:
        """``length`` bytes of an object from ``start`` (fewer at its end), or None if absent."""
    def write(self, loc: Location, key: str, data: bytes) -> None: ...
    def list(self, loc: Location, limit: int | None = None) -> list[str]:
        """Keys under ``loc`` (relative to it), sorted; at most ``limit``."""
    def names(self, loc: Location) -> set[str]:
        """The first components of the keys under ``loc`` (a directory's entries)."""
    def exists(self, loc: Location) -> bool:
        """Whether anything at all is stored at or under ``loc``."""
    def sizes(self, loc: Location, prefix: str) -> Iterator[tuple[str, int | None]]:
        """(key relative to ``prefix``, size) of every object under it; size
        None: not a plain object (a link, FIFO or device)."""
    def age(self, loc: Location) -> float | None:
        """Seconds since anything under ``loc`` changed (object stores: since
        the save writing it last stamped its marker); None: unknown."""
    def committed_at(self, loc: Location) -> float | None:
        """When the checkpoint at ``loc`` was committed (an upper bound, a
        time.time()); None: unknown (no times kept, or no root)."""
    def delete(self, loc: Location, key: str) -> None: ...
    def delete_all(self, loc: Location) -> None: ...
    def prepare(self, loc: Location) -> None:
        """Before a rank writes under ``loc`` (also when it writes nothing)."""
    def sync(self, loc: Location, keys: Collection[str] | None = None, fsynced: Collection[str] = ()) -> None:
        """Make the objects ``keys`` this process wrote under ``loc`` durable
        (``fsynced``: those of them already durable, their directory entries
        not yet); ``keys`` None: everything written under ``loc``."""
    def chunk_writer(self, loc: Location) -> Writer | None:
        """The writer of whole stored chunks, each durable when its write is
        done; None: write through TensorStore arrays."""
    def chunk_reader(self, loc: Location, url: str, threads: int | None = None) -> Pool | None:
        """The reader of stored chunks under ``loc`` (messages name ``url``);
        None: read through TensorStore arrays."""


# scheme -> (module of this package, class): one line per kind of storage
_REGISTRY: dict[str, tuple[str, str]] = {
    "file": ("local", "LocalFileSystem"),
    "memory": ("tskv", "MemoryStore"),
    "s3": ("tskv", "S3Store"),
    "fsspec": ("fsspec", "FsspecStore"),
}
_BACKENDS: dict[str, Backend] = {}


def backend_for(loc: Location) -> Backend:
    """The backend that stores ``loc`` (one instance per scheme)."""
    b = _BACKENDS.get(loc.scheme)
    if b is None:
        module, name = _REGISTRY[loc.scheme]
        b = _BACKENDS[loc.scheme] = getattr(importlib.import_module(f".{module}", __package__), name)()
    return b
