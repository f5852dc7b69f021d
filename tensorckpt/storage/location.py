"""Where a checkpoint lives: the one place paths and URLs are parsed.

``parse("runs/ckpt")``, ``parse("file:///abs/ckpt")``, ``parse("memory://name")``
and ``parse("s3://bucket/prefix/name")`` give a :class:`Location` holding the
TensorStore kvstore spec of the checkpoint's root. What stores a location
(and how it commits) is its backend,
:func:`tensorckpt.storage.backend.backend_for`; nothing else tests the scheme.

S3 (TensorStore's ``s3`` kvstore driver) is configured from the standard AWS
environment variables, read each time a kvstore spec is made:

- ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``: the endpoint (an
  S3-compatible server such as MinIO or moto); neither: AWS itself;
- ``AWS_REGION``, else ``AWS_DEFAULT_REGION``; neither: ``us-east-1``;
- credentials: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
  ``AWS_SESSION_TOKEN`` when ``AWS_ACCESS_KEY_ID`` is set (TensorStore's
  ``environment`` credentials); otherwise TensorStore's ``default`` chain,
  which reads ``AWS_PROFILE`` (and ``AWS_SHARED_CREDENTIALS_FILE``,
  ``AWS_CONFIG_FILE``) and then the instance metadata service;
- ``TENSORCKPT_S3_TIMEOUT`` (seconds, default 60): see
  :mod:`tensorckpt.storage.tskv` (``S3Store``).
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

SCHEMES = ("file", "memory", "s3")
S3_DEFAULT_REGION = "us-east-1"
# S3 retries transient failures (503 SlowDown, 500, dropped connections, cut bodies, refused connections)
# this often, waiting 0.2, 0.4, 0.8, 1.6, 3.2 s (+ up to 0.2 s jitter each) between the 6 attempts: a
# persistent failure ends in "All 5 retry attempts failed: ..." after ~7 s (6.2-7.2 s of waits plus the
# requests), not minutes (tests/test_s3_faults.py). TENSORCKPT_S3_TIMEOUT should exceed that bound.
S3_RETRIES = {"max_retries": 5, "initial_delay": "0.2s", "max_delay": "4s"}
_BUCKET_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789.-")


@dataclass(frozen=True)
class Location:
    scheme: str  # "file", "memory" or "s3"
    path: str  # absolute local path, or "bucket/prefix" (s3), or the key prefix inside the memory store (no trailing "/")

    @property
    def url(self) -> str:
        return self.path if self.scheme == "file" else f"{self.scheme}://{self.path}"

    def kvstore(self, sub: str = "") -> dict:
        """TensorStore kvstore spec of this location (or of ``sub`` inside it), as a directory."""
        p = (posixpath.join(self.path, sub) if sub else self.path).strip("/")
        if self.scheme == "s3":
            return s3_kvstore(p)
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


def s3_kvstore(path: str) -> dict:
    """The ``s3`` kvstore spec of ``bucket/prefix`` (a directory), configured
    from the environment (see the module docstring)."""
    bucket, _, prefix = path.partition("/")
    spec: dict = {
        "driver": "s3", "bucket": bucket, "path": prefix + "/" if prefix else "",
        "aws_region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or S3_DEFAULT_REGION,
        "aws_credentials": {"type": "environment" if os.environ.get("AWS_ACCESS_KEY_ID") else "default"},
        "s3_request_retries": S3_RETRIES,
    }
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint.rstrip("/")
    return spec


def _parse_s3(path: str, bucket: str, key: str) -> Location:
    form = "the expected form is s3://bucket/prefix/name"
    if not bucket:
        raise InvalidPathError(f"{path!r}: an S3 URL needs a bucket; {form}")
    if not 3 <= len(bucket) <= 63 or not set(bucket) <= _BUCKET_CHARS or not bucket[0].isalnum():
        raise InvalidPathError(
            f"{path!r}: {bucket!r} is not an S3 bucket name (3-63 lowercase letters, digits, '.' and '-'); {form}")
    parts = key.strip("/").split("/")
    if not key.strip("/") or any(p in ("", ".", "..") for p in parts):
        raise InvalidPathError(
            f"{path!r}: an S3 checkpoint needs a name inside the bucket, without empty, '.' or '..' "
            f"components; {form}")
    return Location("s3", f"{bucket}/{'/'.join(parts)}")


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
    if url.scheme == "s3":
        if url.query or url.fragment or url.params:
            raise InvalidPathError(f"{path!r}: an S3 URL has no '?', '#' or ';' part; the expected form is s3://bucket/prefix/name")
        return _parse_s3(path, url.netloc, unquote(url.path))
    raise InvalidPathError(
        f"{path!r}: unsupported scheme {url.scheme!r}; use a local path, file://, memory:// or s3://bucket/prefix/name"
    )
