"""Where a checkpoint lives: the one place paths and URLs are parsed.

``parse("runs/ckpt")``, ``parse("file:///abs/ckpt")`` and ``parse("memory://name")``
give a :class:`Location` holding the TensorStore kvstore spec of the
checkpoint's root. What stores a location (and how it commits) is its
backend, :func:`tensorckpt.storage.backend.backend_for`; nothing else tests
the scheme.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

import tensorstore as ts

from ..errors import InvalidPathError

# One context for the process: memory:// stores live in it (so separate opens
# see the same data) and its resource limits apply to every checkpoint.
# file_io_sync is off: each save syncs its files once, before it commits.
CONTEXT = ts.Context({"file_io_sync": False, "cache_pool": {"total_bytes_limit": 0}})
# For large stored objects: TensorStore fsyncs each file as soon as it is
# written, so the disk works while the CPU encodes the next ones (a sync at
# the end would wait for all of it). A child: memory:// stores are shared.
SYNC_CONTEXT = ts.Context({"file_io_sync": True}, parent=CONTEXT)

SCHEMES = ("file", "memory")


@dataclass(frozen=True)
class Location:
    scheme: str  # "file" or "memory"
    path: str  # absolute local path, or the key prefix inside the memory store (no trailing "/")

    @property
    def url(self) -> str:
        return self.path if self.scheme == "file" else f"{self.scheme}://{self.path}"

    def kvstore(self, sub: str = "") -> dict:
        """TensorStore kvstore spec of this location (or of ``sub`` inside it), as a directory."""
        p = (posixpath.join(self.path, sub) if sub else self.path).strip("/")
        if self.scheme == "file":
            p = "/" + p
        return {"driver": self.scheme, "path": p + "/" if p.strip("/") else p}

    def sibling(self, name: str) -> Location:
        return Location(self.scheme, posixpath.join(posixpath.dirname(self.path), name))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    def __str__(self) -> str:
        return self.url


PathArg = str | os.PathLike | Location  # what the public functions accept as a checkpoint's path


def parse(path: PathArg) -> Location:
    if isinstance(path, Location):
        return path
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise InvalidPathError(f"checkpoint path must be a non-empty str or path, got {path!r}")
    if "\0" in path:
        raise InvalidPathError(f"{path!r}: a checkpoint path cannot contain a NUL byte: remove it")
    if "://" not in path:
        return Location("file", os.path.abspath(os.path.expanduser(path)))
    url = urlparse(path)
    if url.scheme == "file":
        if url.netloc not in ("", "localhost"):
            raise InvalidPathError(f"{path!r}: file URLs must be local (file:///abs/path)")
        local = unquote(url.path)
        if not local:  # "file://" or "file://localhost": no path, not the current directory
            raise InvalidPathError(f"{path!r}: a file URL needs an absolute path, e.g. file:///abs/ckpt")
        if "\0" in local:
            raise InvalidPathError(f"{path!r}: a checkpoint path cannot contain a NUL byte: remove it")
        return Location("file", os.path.abspath(local))
    if url.scheme == "memory":
        key = (url.netloc + url.path).strip("/")
        if not key or ".." in key.split("/"):
            raise InvalidPathError(f"{path!r}: memory URLs need a name without '..', e.g. memory://ckpt")
        return Location("memory", key)
    raise InvalidPathError(
        f"{path!r}: unsupported scheme {url.scheme!r}; use a local path, file:// or memory://"
    )
