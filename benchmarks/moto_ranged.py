"""moto's S3 server, PATCHED so that a ranged GET reads only its range, as
S3 does; not S3, and not moto as released. Used by ``bench_s3.py --server
range``; runs as moto's own server does, with its arguments:

    .venv/bin/python benchmarks/moto_ranged.py -H 127.0.0.1 -p 5000

Released moto answers ``GET`` with ``Range: bytes=a-b`` by copying the whole
object out of the key's buffer (``FakeKey.value``) and slicing the copy
afterwards (``S3Response._handle_range_header``), so a reader of many small
ranges of large objects pays, per request, the object's size; S3 charges a
ranged GET by its range. Here, for a GET with one byte range (``bytes=a-b``,
``bytes=a-``, ``bytes=-n``) and no ``partNumber``, the key's value is a
:class:`Ranged` stand-in whose length is the object's size and whose slices
read only their bytes from the key's buffer (seek + read). moto's own range
logic still decides everything else (the 206 and its ``Content-Range``, the
416 ``InvalidRange`` with ``ActualObjectSize``, suffix ranges, a range it
ignores answered 200 with the whole object); every other request is moto's,
unchanged.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from moto.s3 import models, responses

_ranged = threading.local()  # on, during the get_object of a GET with one byte range (werkzeug: a thread per request)


class Ranged:
    """A key's value as ``_handle_range_header`` uses it (``len``, one
    slice), read from the key's buffer by the range asked for."""

    def __init__(self, key: models.FakeKey) -> None:
        self.key = key

    def __len__(self) -> int:
        return self.key.size

    def __getitem__(self, part: slice) -> bytes:
        start, stop, _ = part.indices(len(self))
        with self.key.lock:
            buf = self.key._value_buffer
            buf.seek(start)
            return buf.read(max(0, stop - start))


def _one_range(value: str) -> bool:
    return value.startswith("bytes=") and "," not in value


_value = models.FakeKey.value  # the property: whole-object reads everywhere else


def _get_value(key: models.FakeKey) -> Any:
    return Ranged(key) if getattr(_ranged, "on", False) else _value.fget(key)


_get_object = responses.S3Response.get_object
_handle_range = responses.S3Response._handle_range_header


def get_object(self: responses.S3Response) -> Any:
    on = _one_range(self.headers.get("range") or "") and "partNumber" not in self.querystring
    _ranged.on = on
    try:
        return _get_object(self)
    finally:
        _ranged.on = False


def handle_range_header(self: responses.S3Response, request: Any, headers: dict[str, Any], content: Any) -> Any:
    status, headers, body = _handle_range(self, request, headers, content)
    return status, headers, body[:] if isinstance(body, Ranged) else body  # a range moto ignores: the whole object


def patch() -> None:
    models.FakeKey.value = property(_get_value, _value.fset)  # type: ignore[method-assign,assignment]
    responses.S3Response.get_object = get_object  # type: ignore[method-assign]
    responses.S3Response._handle_range_header = handle_range_header  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    patch()
    from moto.server import main as serve

    print("moto_ranged: moto's server, patched so ranged GETs read only their range (not S3)", file=sys.stderr)
    serve(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
