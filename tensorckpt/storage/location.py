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

``storage_options`` (every public entry point that takes a path, the CLI's
``--storage-option KEY=VALUE``) configure one location explicitly; they
travel on the :class:`Location` (a canonical JSON string, part of its
equality and hash, never part of ``str(loc)``, ``repr`` or a message: they
may hold secrets). For ``s3://`` they override the environment, key by key,
under the names s3fs and DCP's ``FsspecWriter`` use:

- ``endpoint_url`` (over ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``),
  ``region`` (over ``AWS_REGION`` / ``AWS_DEFAULT_REGION``);
- ``key`` + ``secret`` (+ ``token``): explicit credentials. TensorStore's s3
  spec takes no literal keys (its ``environment`` credentials read the
  process environment, shared by every location), so they are written to a
  private credentials file (mode 0600, in a 0700 directory of the system's
  temporary directory, removed at exit) used through TensorStore's
  ``profile`` credentials; ``profile``: a named profile of the usual AWS
  files; ``anon=True``: unsigned requests;
- ``request_concurrency``: HTTP requests in flight at once for each store
  TensorStore opens with it (an ``s3_request_concurrency`` resource in the
  spec, so a save's many opened arrays may together have more); unset:
  TensorStore's one queue per process, 32 requests (or
  ``TENSORSTORE_S3_REQUEST_CONCURRENCY``, read once).

Throughput settings: requests go ``request_concurrency`` at a time; each
stored object is one PUT (TensorStore's s3 driver makes no multipart
uploads: an object is at most one shard of a few hundred MiB, far below S3's
5 GiB single-PUT limit, and an interrupted PUT leaves nothing behind);
transient failures are retried ``S3_RETRIES`` times with backoff.

The storage systems fsspec implements and TensorStore has no driver for
(``gs://``, ``hdfs://``, ``abfs://``, ...: :data:`FSSPEC_STORES`) and,
explicitly for any fsspec protocol,
``fsspec+PROTO://...`` (``fsspec+s3://bucket/x``, ``fsspec+file:///abs/x``)
is stored through fsspec (:mod:`.fsspec`, scheme ``"fsspec"``; the path is
the URL as given). There ``storage_options`` are passed as they are to
``fsspec.filesystem(PROTO, **storage_options)``; their values must be
JSON values (they travel on the location).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import posixpath
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import unquote, urlparse

import tensorstore as ts

from ..errors import InvalidPathError, TensorckptError

# One context for the process: memory:// stores live in it (so separate opens
# see the same data) and its resource limits apply to every checkpoint.
# file_io_sync is off: each save syncs its files once, before it commits.
CONTEXT = ts.Context({"file_io_sync": False, "cache_pool": {"total_bytes_limit": 0}})
# For large stored objects: TensorStore fsyncs each file as soon as it is
# written, so the disk works while the CPU encodes the next ones (a sync at
# the end would wait for all of it). A child: memory:// stores are shared.
SYNC_CONTEXT = ts.Context({"file_io_sync": True}, parent=CONTEXT)

SCHEMES = ("file", "memory", "s3")  # TensorStore drivers; "fsspec" holds the rest
FSSPEC_PREFIX = "fsspec+"
# Schemes taken to fsspec without the prefix: the storage systems among fsspec's implementations
# (not http, archives, caches or other wrappers: those need fsspec+PROTOCOL:// explicitly)
FSSPEC_STORES = ("gs", "hdfs", "abfs", "az", "gcs", "abfss", "adl", "webhdfs", "viewfs", "oss", "sftp", "ssh",
                 "smb", "ftp", "dbfs", "oci", "ocilake", "tos", "tosfs", "s3a", "lakefs")
S3_DEFAULT_REGION = "us-east-1"
# S3 retries transient failures (503 SlowDown, 500, dropped connections, cut bodies, refused connections)
# this often, waiting 0.2, 0.4, 0.8, 1.6, 3.2 s (+ up to 0.2 s jitter each) between the 6 attempts: a
# persistent failure ends in "All 5 retry attempts failed: ..." after ~7 s (6.2-7.2 s of waits plus the
# requests), not minutes (tests/test_s3_faults.py). TENSORCKPT_S3_TIMEOUT should exceed that bound.
S3_RETRIES = {"max_retries": 5, "initial_delay": "0.2s", "max_delay": "4s"}
_BUCKET_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789.-")


# What each scheme accepts as storage_options (fsspec: whatever its file system takes)
S3_OPTIONS = {"endpoint_url": str, "region": str, "key": str, "secret": str, "token": str, "profile": str,
              "anon": bool, "request_concurrency": int}
OPTIONS: dict[str, dict[str, type] | None] = {"file": {}, "memory": {}, "s3": S3_OPTIONS, "fsspec": None}


@dataclass(frozen=True)
class Location:
    scheme: str  # "file", "memory", "s3" or "fsspec"
    path: str  # absolute local path, or "bucket/prefix" (s3), or the key prefix inside the memory store (no trailing "/"), or the URL (fsspec)
    options: str = field(default="", repr=False)  # the storage options as canonical JSON ("": none); never printed

    @property
    def url(self) -> str:
        return self.path if self.scheme in ("file", "fsspec") else f"{self.scheme}://{self.path}"

    @property
    def storage_options(self) -> dict[str, Any]:
        return json.loads(self.options) if self.options else {}

    def kvstore(self, sub: str = "") -> dict:
        """TensorStore kvstore spec of this location (or of ``sub`` inside it), as a directory."""
        p = (posixpath.join(self.path, sub) if sub else self.path).strip("/")
        if self.scheme == "fsspec":  # nothing may fall back to TensorStore here: say what is not possible
            raise TensorckptError(
                f"{self.url}: this needs TensorStore, which has no driver for this fsspec location (a tensor "
                "read on a host without the native CRC-32C, or a partial write of a stored chunk); use a local "
                "path or s3:// for this checkpoint")
        if self.scheme == "s3":
            return s3_kvstore(p, self.storage_options)
        if self.scheme == "file":
            p = "/" + p
        return {"driver": self.scheme, "path": p + "/" if p.strip("/") else p}

    def child(self, sub: str) -> Location:
        """``sub`` inside this location (same storage options)."""
        return replace(self, path=posixpath.join(self.path, sub))

    def sibling(self, name: str) -> Location:
        return replace(self, path=posixpath.join(posixpath.dirname(self.path), name))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    def __str__(self) -> str:
        return self.url


def s3_kvstore(path: str, options: Mapping[str, Any] | None = None) -> dict:
    """The ``s3`` kvstore spec of ``bucket/prefix`` (a directory), configured
    from ``options`` over the environment (see the module docstring)."""
    o = options or {}
    bucket, _, prefix = path.partition("/")
    spec: dict = {
        "driver": "s3", "bucket": bucket, "path": prefix + "/" if prefix else "",
        "aws_region": o.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        or S3_DEFAULT_REGION,
        "aws_credentials": _s3_credentials(o),
        "s3_request_retries": S3_RETRIES,
    }
    if "request_concurrency" in o:
        spec["s3_request_concurrency"] = {"limit": o["request_concurrency"]}
    endpoint = o.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint.rstrip("/")
    return spec


def _s3_credentials(o: Mapping[str, Any]) -> dict:
    if o.get("key"):
        creds, config = _credentials_files(o["key"], o.get("secret", ""), o.get("token", ""))
        return {"type": "profile", "profile": CREDENTIALS_PROFILE, "credentials_file": creds, "config_file": config}
    if o.get("anon"):
        return {"type": "anonymous"}
    if o.get("profile"):
        return {"type": "default", "profile": o["profile"]}
    return {"type": "environment" if os.environ.get("AWS_ACCESS_KEY_ID") else "default"}


CREDENTIALS_PROFILE = "tensorckpt"


@functools.lru_cache(maxsize=64)
def _credentials_files(key: str, secret: str, token: str) -> tuple[str, str]:
    """A private AWS credentials file (and an empty config file, which
    TensorStore's profile credentials require) holding these keys; removed
    at exit. The keys never appear in a spec, a message or a log."""
    folder = tempfile.mkdtemp(prefix="tensorckpt-aws-")  # mode 0700
    atexit.register(shutil.rmtree, folder, True)
    creds, config = os.path.join(folder, "credentials"), os.path.join(folder, "config")
    lines = [f"[{CREDENTIALS_PROFILE}]", f"aws_access_key_id = {key}", f"aws_secret_access_key = {secret}"]
    if token:
        lines.append(f"aws_session_token = {token}")
    for name, text in ((creds, "\n".join(lines) + "\n"), (config, f"[profile {CREDENTIALS_PROFILE}]\n")):
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return creds, config


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


def parse(path: PathArg, storage_options: Mapping[str, Any] | None = None) -> Location:
    """The location of ``path`` with ``storage_options`` (None: those a
    given :class:`Location` has, else none), checked against what its scheme
    accepts (:data:`OPTIONS`)."""
    loc = _parse(path)
    if storage_options is None:
        return loc
    return replace(loc, options=check_options(loc, storage_options))


def takes_options(loc: Location) -> bool:
    """Whether ``loc``'s scheme accepts any storage options (s3, fsspec)."""
    return OPTIONS[loc.scheme] != {}


def check_options(loc: Location, options: Mapping[str, Any]) -> str:
    """``options`` as canonical JSON, once every name is one ``loc``'s scheme
    accepts and every value of the accepted type. Messages name the keys,
    never a value (values may be secrets)."""
    if not isinstance(options, Mapping):
        raise InvalidPathError(f"{loc}: storage_options must be a mapping of option names to values, "
                               f"got a {type(options).__name__}")
    accepted = OPTIONS[loc.scheme]
    if accepted is not None:
        unknown = sorted(str(k) for k in options if k not in accepted)
        if unknown:
            takes = f"accepted: {', '.join(accepted)}" if accepted else (
                "a local or memory:// path takes none (they are for s3:// and fsspec URLs)")
            raise InvalidPathError(f"{loc}: unknown storage option(s) {', '.join(map(repr, unknown))}; {takes}")
        options = {k: _coerce(v, accepted[k]) for k, v in options.items()}
        for k, v in options.items():
            kind = accepted[k]
            if not isinstance(v, kind) or (kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 1)):
                want = {str: "a str", bool: "True or False", int: "an int >= 1"}[kind]
                raise InvalidPathError(f"{loc}: storage option {k!r} must be {want}, got a {type(v).__name__}")
        if options.get("key") and not options.get("secret"):
            raise InvalidPathError(f"{loc}: storage option 'key' needs 'secret' too")
    if not all(isinstance(k, str) for k in options):
        raise InvalidPathError(f"{loc}: storage option names must be str")
    try:
        return json.dumps(dict(options), sort_keys=True, separators=(",", ":"), allow_nan=False) if options else ""
    except (TypeError, ValueError):
        raise InvalidPathError(f"{loc}: storage option values must be JSON values (str, number, bool, None, "
                               "lists and mappings of them): they travel with the location") from None


def _coerce(value: Any, kind: type) -> Any:
    """A string (the CLI's, an environment variable's) for an int or bool option, as that."""
    if isinstance(value, str) and kind is int and value.strip().isdigit():
        return int(value)
    if isinstance(value, str) and kind is bool and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    return value


def _parse(path: PathArg) -> Location:
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
    if url.scheme.startswith(FSSPEC_PREFIX) or url.scheme in FSSPEC_STORES:
        return _parse_fsspec(path)
    raise InvalidPathError(
        f"{path!r}: unsupported scheme {url.scheme!r}; use a local path, file://, memory://, s3://bucket/prefix/name, "
        f"a storage URL fsspec implements ({', '.join(s + '://' for s in FSSPEC_STORES[:4])}, ...), or "
        "fsspec+PROTOCOL://... for any fsspec file system"
    )


def fsspec_knows(protocol: str) -> bool:
    """Whether fsspec has an implementation registered for ``protocol`` (it may still need a package)."""
    from fsspec.registry import known_implementations, registry

    return protocol in known_implementations or protocol in registry


def _parse_fsspec(path: str) -> Location:
    """An fsspec URL: the protocol must be one fsspec knows and can import;
    the name has no empty, '.' or '..' components; a local one is absolute."""
    protocol, _, rest = path.removeprefix(FSSPEC_PREFIX).partition("://")
    if not fsspec_knows(protocol):
        raise InvalidPathError(f"{path!r}: fsspec knows no file system for protocol {protocol!r}")
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as e:  # fsspec names the package that implements it
        raise InvalidPathError(f"{path!r}: the fsspec file system for {protocol!r} is not installed: {e}") from None
    if protocol in ("file", "local"):
        rest = os.path.abspath(unquote(rest)) if rest.startswith("/") else ""
    parts = rest.strip("/").split("/")
    if not rest.strip("/") or any(p in ("", ".", "..") for p in parts):
        raise InvalidPathError(
            f"{path!r}: an fsspec URL needs a name, without empty, '.' or '..' components"
            + ("; a local one an absolute path (fsspec+file:///abs/ckpt)" if protocol in ("file", "local") else ""))
    head = FSSPEC_PREFIX if path.startswith(FSSPEC_PREFIX) else ""
    return Location("fsspec", f"{head}{protocol}://{'/' if protocol in ('file', 'local') else ''}{'/'.join(parts)}")
