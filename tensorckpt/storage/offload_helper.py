"""The helper process of ``AsyncSaver(executor="process")``: the other end
of :mod:`.offload`'s socket (read that module's docstring first).

It is started as ``python -c "...; serve(fd, threads, buffer_bytes)"`` with
this package mapped but its ``__init__`` not run, and imports only this
module, :mod:`.codec` (numpy, google-crc32c), :mod:`.files` and the standard
library: no torch, no TensorStore, so it starts in a fraction of a second and
holds tens of MiB, not hundreds. Messages are JSON, one per ``SOCK_SEQPACKET``
datagram:

    training process -> helper
      {"op": "map", "arena": id, "size": n}  + the arena's memfd (SCM_RIGHTS)
      {"op": "unmap", "arena": id}
      {"op": "write", "id": job, "root": dir, "rel": key, "dtype": numpy str,
       "shape", "chunk", "inner": the array's geometry,
       "arena": id, "offset": bytes, "elements": shape, "strides": bytes}
      {"op": "sync", "id": job, "paths": [file or directory, ...]}  fsync each
    helper -> training process
      {"ready": true}  once, first
      {"id": job, "digest": hex}  or  {"id": job, "error": text, "errno": n | null}

A sync fsyncs each path (opened without following a link), the save's
directories and the files it did not fsync as written. A write encodes the object with :func:`codec.encode` from the arena (mapped
read-only), writes and fsyncs it (:func:`files.write_durable`) on one of
``threads`` threads, and answers with its digest (spec 7.1) or its error.
The helper exits as soon as its socket closes (the saver closed, or the
training process ended): nothing it would still write could be committed.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from . import codec
from .files import ALIGN, aligned_buffer, direct_io, fsync_path, write_durable

MESSAGE_BYTES = 1 << 16  # the largest message either side sends


def serve(fd: int, threads: int, buffer_bytes: int) -> None:
    """Map arenas, write the objects asked for, answer; exit when the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the training process's to handle
    sock = socket.socket(fileno=fd)
    arenas: dict[int, mmap.mmap] = {}
    local = threading.local()
    lock = threading.Lock()
    pool = ThreadPoolExecutor(threads, thread_name_prefix="tensorckpt-offload")
    direct = direct_io()

    def answer(reply: dict[str, Any]) -> None:
        with lock:
            sock.send(json.dumps(reply).encode())

    def run(m: dict[str, Any]) -> None:
        try:
            if m["op"] == "sync":
                for path in m["paths"]:
                    fsync_path(path)
                answer({"id": m["id"], "digest": ""})
                return
            d = np.dtype(m["dtype"])
            g = codec.geometry_of(tuple(m["shape"]), tuple(m["chunk"]), tuple(m["inner"]), d)
            data = np.ndarray(tuple(m["elements"]), d, buffer=arenas[m["arena"]], offset=m["offset"],
                              strides=tuple(m["strides"]))
            size = codec.write_buffer(g, buffer_bytes, ALIGN)
            buf = getattr(local, "buf", None)
            if buf is None or len(buf) < size:
                buf = local.buf = aligned_buffer(size)
            digest = codec.new_digest()
            path = os.path.join(m["root"], m["rel"])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_durable(path, codec.encode(g, data, buf, digest, ALIGN), direct, g.stored_bytes(data.shape))
            answer({"id": m["id"], "digest": digest.hexdigest()})
        except Exception as e:  # noqa: BLE001 - every failure is the training process's to raise
            answer({"id": m["id"], "error": getattr(e, "strerror", None) or str(e) or type(e).__name__,
                    "errno": getattr(e, "errno", None)})

    answer({"ready": True})
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, 1)
        except OSError:
            break
        if not data:
            break
        m = json.loads(data)
        if m["op"] == "map":
            arenas[m["arena"]] = mmap.mmap(fds[0], m["size"], prot=mmap.PROT_READ)
            os.close(fds[0])
        elif m["op"] == "unmap":
            arenas.pop(m["arena"], None)  # unmapped once no write holds it
        else:
            pool.submit(run, m)
    os._exit(0)  # the training process is gone or closed the saver: nothing left to write for
