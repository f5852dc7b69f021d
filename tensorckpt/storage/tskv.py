"""TensorStore kvstore backends (see :mod:`.backend`): ``memory://`` and
``s3://`` (TensorStore's ``s3`` driver, configured from the AWS environment
variables: :mod:`.location`), object stores with no rename and no
modification times (a leftover's age is the time a save stamped in its
marker), committed root-last (:mod:`.commit_kv`). Another store is one more
subclass with its flags, and one line in ``backend._REGISTRY``.

Chunks are written through TensorStore arrays (:mod:`.arrays`) and read
through tensorckpt's own codec (:mod:`.direct` over the kvstore's byte
ranges, :mod:`.kvobjects`: ``chunk_reader``), so the checks of local reads
apply here too (the chunk digests of format 1.3, overlapping index entries,
bounds from the checked metadata, without asking any object's size).
TensorStore's arrays still read everything ``verify`` reads and every
read on a host without the native CRC-32C (``fast_reads`` False), bounded
first by the sizes S3 gives (``StoredArrays.check_objects``). No valid
entry is past the codec's buffers any more: they are spec 12's caps, which
every reader refuses at the root (``direct.usable``).

On S3 every operation is bounded: TensorStore's S3 client has no timeout of
its own (an endpoint that accepts connections and never answers hangs it),
so each kvstore operation waits at most ``TENSORCKPT_S3_TIMEOUT`` seconds
(default 60) before a ``TensorckptError`` naming the URL and the operation,
and each HTTP request is ended by libcurl when it moves no byte for that
long (``TENSORSTORE_CURL_LOW_SPEED_*``, set from it unless already set;
TensorStore reads them once per process) and retried within
``location.S3_RETRIES``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator

from ..errors import InvalidPathError, TensorckptError
from . import direct, kv, pinned
from .commit_kv import RootLastCommit, stamped_age
from .direct import Pool, Writer
from .kvobjects import PROBE_AT, THREADS, KvObjects, size_in
from .location import Location


class KvStore:
    """Any TensorStore kvstore driver, by the location's kvstore spec."""

    supports_rename = False
    records_times = False
    fast_chunks = False
    kvstore = True
    shared = True
    commit = RootLastCommit()

    @property
    def timeout(self) -> float | None:
        return None

    @property
    def fast_reads(self) -> bool:
        return direct.available(True)

    def read_error(self, loc: Location, e: ValueError, doing: str) -> TensorckptError:
        """A failure of the store, as the error a reader raises."""
        return TensorckptError(f"{loc}: {doing} failed: {str(e).split(' [')[0]}")

    def read(self, loc: Location, key: str, limit: int, where: str) -> tuple[object, bytes | None]:
        return pinned.read_remote(loc, key, limit, where)

    def read_range(self, loc: Location, key: str, start: int, length: int) -> bytes | None:
        return kv.read_range(loc, key, start, length)

    def write(self, loc: Location, key: str, data: bytes) -> None:
        kv.write(loc, key, data)

    def list(self, loc: Location, limit: int | None = None) -> list[str]:
        return kv.ts_list(loc, limit)

    def names(self, loc: Location) -> set[str]:
        return {k.split("/", 1)[0] for k in self.list(loc, limit=100_000)}

    def exists(self, loc: Location) -> bool:
        return bool(self.list(loc, limit=1))

    def sizes(self, loc: Location, prefix: str) -> Iterator[tuple[str, int | None]]:
        sub = loc.child(prefix)
        for name in self.list(sub):
            data = kv.read(sub, name)
            if data is not None:
                yield name, len(data)

    def age(self, loc: Location) -> float | None:
        return stamped_age(loc)  # no modification times: the stamp a save keeps in its marker (commit_kv)

    def committed_at(self, loc: Location) -> float | None:
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
        if not self.fast_reads:
            return None
        return Pool(KvObjects(loc, self.read_error), url, threads=threads or THREADS)


class MemoryStore(KvStore):
    """``memory://``: TensorStore's in-process store, seen by this process only."""

    shared = False


S3_TIMEOUT_DEFAULT = 60.0  # seconds: TENSORCKPT_S3_TIMEOUT when unset


class S3Store(KvStore):
    """``s3://bucket/prefix``: TensorStore's ``s3`` kvstore. The root
    ``zarr.json`` of a new checkpoint is written with a conditional create,
    after a claim object made the same way, so of two saves to one new
    location exactly one writes and commits (:mod:`.commit_kv`)."""

    commit = RootLastCommit(claim=True, error=lambda loc, e, doing: s3_error(loc, e, doing))

    def __init__(self) -> None:
        seconds = str(max(1, round(self.timeout)))
        os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", seconds)
        os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")

    @property
    def timeout(self) -> float:
        raw = os.environ.get("TENSORCKPT_S3_TIMEOUT", "")
        try:
            t = float(raw) if raw else S3_TIMEOUT_DEFAULT
        except ValueError:
            t = -1.0
        if not t > 0:
            raise InvalidPathError(f"TENSORCKPT_S3_TIMEOUT={raw!r}: must be a positive number of seconds")
        return t

    def read_error(self, loc: Location, e: ValueError, doing: str) -> TensorckptError:
        return s3_error(loc, e, doing)

    def read(self, loc: Location, key: str, limit: int, where: str) -> tuple[object, bytes | None]:
        try:
            return super().read(loc, key, limit, where)
        except ValueError as e:
            raise s3_error(loc, e, f"reading {key}") from e

    def list(self, loc: Location, limit: int | None = None) -> list[str]:
        try:
            return super().list(loc, limit)
        except ValueError as e:  # the first request of a save, a load or clean: say what to fix
            raise s3_error(loc, e, "listing") from e

    def sizes(self, loc: Location, prefix: str) -> Iterator[tuple[str, int | None]]:
        """Sizes without fetching the objects: S3 lists no sizes through
        TensorStore, but refuses a range past an object's end naming its
        ``ActualObjectSize``; one small request per object, all at once.
        Where the answer names none (another server), the object is read;
        an object of ``PROBE_AT`` bytes or more is given as ``PROBE_AT + 1``."""
        sub = loc.child(prefix)
        names = self.list(sub)
        if not names:
            return
        store = kv.open_store(sub)
        probes = [(n, store.read(n, byte_range=slice(PROBE_AT, PROBE_AT + 1))) for n in names]
        for name, future in probes:
            try:
                kv.result(sub, future, f"reading the size of {name}")
                yield name, PROBE_AT + 1  # at least that: never fetched (a reader refuses it by its size)
                continue
            except ValueError as e:
                if "NOT_FOUND" in str(e) and "NoSuchKey" in str(e):
                    continue  # deleted since the listing
                if "OUT_OF_RANGE" not in str(e):  # not the 416 asked for: the request failed (retries spent)
                    raise s3_error(loc, e, f"reading the size of {prefix}/{name}") from e
                size = size_in(str(e))
            if size is None:
                data = kv.read(sub, name)
                if data is None:
                    continue
                size = len(data)
            yield name, size


def s3_error(loc: Location, e: ValueError, doing: str) -> TensorckptError:
    """A storage error of TensorStore's S3 driver as what went wrong where and what to set."""
    msg = str(e)
    spec = loc.kvstore()
    at = spec.get("endpoint", "AWS (no AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL set)")
    if "NoSuchBucket" in msg:
        return TensorckptError(f"{loc}: {doing} failed: bucket {spec['bucket']!r} does not exist at {at}; "
                               "create it, or check the URL and AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL")
    if any(s in msg for s in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "http_response_code='403'")):
        return TensorckptError(f"{loc}: {doing} failed: access denied by {at}; check the credentials "
                               "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, or AWS_PROFILE; "
                               "storage_options key / secret / token / profile override them)")
    if any(s in msg for s in ("curl_code='6'", "curl_code='7'", "Could not connect", "Could not resolve")):
        return TensorckptError(f"{loc}: {doing} failed: cannot connect to {at} (retried, location.S3_RETRIES); check "
                               "that storage_options endpoint_url or AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL names a running S3 "
                               "server you can reach")
    return TensorckptError(f"{loc}: {doing} failed at {at}: {msg.split(' [http_response_body=')[0]}")
