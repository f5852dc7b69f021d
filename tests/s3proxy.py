"""A fault and latency proxy between an S3 client and an S3 server, for the
tests and the benchmarks: an HTTP/1.1 forwarder on 127.0.0.1 that can add a
delay to every request, answer a fraction of them with ``503 SlowDown`` or
``500 InternalError``, drop connections (before a response, or in the
middle of one), go down as a killed server does and come back, and counts
requests and the bytes it passes each way.

``with S3Proxy(moto.endpoint) as p: p.endpoint`` is the URL to point clients at
(``AWS_ENDPOINT_URL_S3``). Headers pass unchanged (``Host`` included, so SigV4
signatures still verify); hop-by-hop headers and ``Expect`` are handled here.
"""

from __future__ import annotations

import http.client
import http.server
import random
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlparse

from s3server import free_port

_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}
PIECE = 1 << 20
_ERRORS = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
}


@dataclass
class Faults:
    """What to inject: each request matching ``methods`` (all if empty) and
    ``path`` (a substring; all if empty) fails with probability ``rate``,
    as one of ``kinds`` ("503", "500", "drop": closed before a response,
    "cut": closed half-way through the response body), at most ``limit``
    times (None: no limit)."""

    rate: float = 0.0
    kinds: tuple[str, ...] = ("503",)
    methods: tuple[str, ...] = ()
    path: str = ""
    limit: int | None = None
    seed: int = 0
    injected: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def pick(self, method: str, path: str) -> str | None:
        if self.methods and method not in self.methods or self.path not in path:
            return None
        if self.limit is not None and sum(self.injected.values()) >= self.limit:
            return None
        if self._rng.random() >= self.rate:
            return None
        kind = self._rng.choice(self.kinds)
        self.injected[kind] += 1
        return kind


class S3Proxy:
    def __init__(self, upstream: str, latency_s: float = 0.0) -> None:
        u = urlparse(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.latency_s = latency_s
        self.faults = Faults()
        self.requests: Counter = Counter()  # by method
        self.bytes_out = 0  # response body bytes sent to clients
        self.bytes_in = 0  # request body bytes received from clients
        self._down = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._server = _Server(("127.0.0.1", self.port), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3proxy", daemon=True)

    def start(self) -> S3Proxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.kill()

    def kill(self) -> None:
        """As a killed server: every open connection is cut, new ones are closed at once."""
        self._down.set()
        with self._lock:
            for s in list(self._sockets):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def revive(self) -> None:
        self._down.clear()

    @property
    def down(self) -> bool:
        return self._down.is_set()

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes_out = self.bytes_in = 0

    def _count(self, method: str = "", sent: int = 0, received: int = 0) -> None:
        with self._lock:
            if method:
                self.requests[method] += 1
            self.bytes_out += sent
            self.bytes_in += received

    def __enter__(self) -> S3Proxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client or the proxy itself cut the connection (kill, drop, cut): expected, not worth a traceback


def _handler(proxy: S3Proxy) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        _up: http.client.HTTPConnection | None = None

        def log_message(self, *args: object) -> None:
            pass

        def setup(self) -> None:
            super().setup()
            with proxy._lock:
                proxy._sockets.add(self.connection)
            if proxy.down:
                self.connection.shutdown(socket.SHUT_RDWR)

        def finish(self) -> None:
            with proxy._lock:
                proxy._sockets.discard(self.connection)
            if self._up is not None:
                self._up.close()
            try:
                super().finish()
            except OSError:
                pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                parts = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return b"".join(parts)
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _drop(self) -> None:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def _error(self, kind: str) -> None:
            status, code, message = _ERRORS[kind]
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                    f"<Message>{message}</Message></Error>").encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _forward(self) -> None:
            body = self._body()
            proxy._count(self.command, received=len(body))
            if proxy.down:
                return self._drop()
            if proxy.latency_s:
                time.sleep(proxy.latency_s)
            kind = proxy.faults.pick(self.command, self.path)
            if kind == "drop":
                return self._drop()
            if kind in _ERRORS:
                return self._error(kind)
            try:
                resp = self._upstream(body)
            except (OSError, http.client.HTTPException):
                self._up = None
                return self._drop()
            self.send_response(resp.status, resp.reason)
            length = resp.getheader("Content-Length")
            for k, v in resp.getheaders():
                if k.lower() not in _HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            if length is None and self.command != "HEAD":
                data = resp.read()  # no length upstream: buffer it to give one
                length, pieces = str(len(data)), iter([data])
            else:
                pieces = iter(lambda: resp.read(PIECE), b"")
            self.send_header("Content-Length", length or "0")
            self.end_headers()
            if self.command == "HEAD":
                resp.read()
                return None
            total, sent = int(length or 0), 0
            for piece in pieces:
                if proxy.down or kind == "cut" and sent + len(piece) >= total // 2:
                    self._up = None
                    return self._drop()
                self.wfile.write(piece)
                sent += len(piece)
                proxy._count(sent=len(piece))
            return None

        def _upstream(self, body: bytes) -> http.client.HTTPResponse:
            for attempt in (0, 1):  # a kept-alive upstream connection may have been closed by the server
                if self._up is None:
                    self._up = http.client.HTTPConnection(*proxy.upstream, timeout=120)
                try:
                    self._up.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for k, v in self.headers.items():
                        if k.lower() not in _HOP and k.lower() != "content-length":
                            self._up.putheader(k, v)
                    if body or self.command in ("PUT", "POST"):
                        self._up.putheader("Content-Length", str(len(body)))
                    self._up.endheaders(body or None)
                    return self._up.getresponse()
                except (OSError, http.client.HTTPException):
                    self._up.close()
                    self._up = None
                    if attempt:
                        raise
            raise AssertionError("unreachable")

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    return Handler
