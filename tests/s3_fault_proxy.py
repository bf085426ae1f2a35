"""A fault-injecting HTTP/1.1 proxy between fastckpt and the tests' S3 server (moto).

Every request is forwarded as it came; a :class:`Fault` matching a request's method and key
changes what happens to it instead:

* ``"lose_reply"``: the request is forwarded (the store applies it) and the connection is
  then cut without an answer: the client cannot tell whether it was applied;
* ``"cut"``: the connection is cut before anything is forwarded (never applied);
* ``"pass"``: forwarded and answered as usual (counted: a trigger for another fault's
  ``after``);
* a callable: called (with no argument) before the request is forwarded as usual: another
  client acting at that moment.

Nothing of the client is mocked: fastckpt's own S3 client talks HTTP to the proxy, which talks
HTTP to moto.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import socketserver
import struct
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

__all__ = ["Fault", "FaultProxy"]


@dataclass
class Fault:
    """What to do (``action``) to requests with ``method`` whose path ends with ``suffix``:
    the first ``times`` of them (None: every one), once the fault ``after`` (if any) changed
    a request; with ``query``, only those whose query string holds it. ``hits`` counts the
    requests it changed."""

    method: str
    suffix: str
    action: str | Callable[[], object]
    times: int | None = 1
    after: Fault | None = None
    #: only requests whose query string holds this (e.g. ``"uploads"``)
    query: str | None = None
    hits: int = field(default=0)

    def take(self, method: str, path: str, query: str = "") -> bool:
        """Whether this fault applies to the request (and count it)."""
        if method != self.method or not urllib.parse.unquote(path).endswith(self.suffix):
            return False
        if self.query is not None and self.query not in query:
            return False
        if self.after is not None and not self.after.hits:
            return False
        if self.times is not None and self.hits >= self.times:
            return False
        self.hits += 1
        return True


class FaultProxy:
    """The proxy, listening on a free port of 127.0.0.1 (:attr:`endpoint`) until
    :meth:`close`. Add faults to :attr:`faults` (under :attr:`lock`) at any time."""

    def __init__(self, upstream: str) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        assert parsed.hostname is not None and parsed.port is not None
        self.faults: list[Fault] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                upstream_conn: socket.socket | None = None
                try:
                    for method, path, query, raw in _requests(self.rfile):
                        action = proxy._action(method, path, query)
                        if action == "cut":
                            return _cut(self.connection)
                        if upstream_conn is None:
                            upstream_conn = socket.create_connection((parsed.hostname, parsed.port))
                        upstream_conn.sendall(raw)
                        reply = http.client.HTTPResponse(upstream_conn, method=method)
                        reply.begin()
                        body = reply.read()
                        if reply.will_close:
                            upstream_conn.close()
                            upstream_conn = None
                        if action == "lose_reply":
                            return _cut(self.connection)
                        self.wfile.write(_encode(reply, body, method))
                        self.wfile.flush()
                except OSError:
                    return
                finally:
                    if upstream_conn is not None:
                        upstream_conn.close()

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _action(self, method: str, path: str, query: str) -> str | None:
        with self.lock:
            taken = next((f for f in self.faults if f.take(method, path, query)), None)
        if taken is None or taken.action == "pass":
            return None
        if callable(taken.action):
            taken.action()
            return None
        return taken.action

    def close(self) -> None:
        """Stop listening."""
        self._server.shutdown()
        self._server.server_close()


def _requests(rfile: BinaryIO) -> Iterator[tuple[str, str, str, bytes]]:
    """(method, path, query string, raw bytes) of each request on a kept-alive connection."""
    while True:
        line = rfile.readline(65537)
        if not line:
            return
        raw = [line]
        headers: dict[str, str] = {}
        while True:
            header = rfile.readline(65537)
            raw.append(header)
            if header in (b"\r\n", b"\n", b""):
                break
            name, _, value = header.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size_line = rfile.readline()
                raw.append(size_line)
                size = int(size_line.split(b";")[0].strip(), 16)
                raw.append(rfile.read(size + 2))
                if size == 0:
                    break
        else:
            raw.append(rfile.read(int(headers.get("content-length") or 0)))
        method, target, _ = line.decode("latin-1").split(" ", 2)
        parts = urllib.parse.urlsplit(target)
        yield method, parts.path, parts.query, b"".join(raw)


def _encode(reply: Any, body: bytes, method: str) -> bytes:
    """The upstream reply, re-framed with a Content-Length."""
    lines = [f"HTTP/1.1 {reply.status} {reply.reason}\r\n"]
    for name, value in reply.getheaders():
        if name.lower() not in ("content-length", "transfer-encoding", "connection"):
            lines.append(f"{name}: {value}\r\n")
    length = reply.getheader("content-length", "0") if method == "HEAD" else len(body)
    lines.append(f"Content-Length: {length}\r\n\r\n")
    head = "".join(lines).encode("latin-1")
    return head if method == "HEAD" else head + body


def _cut(connection: socket.socket) -> None:
    """Close the client's connection with a reset (no answer at all)."""
    with contextlib.suppress(OSError):
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()
