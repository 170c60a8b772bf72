"""A lean HTTP/1.1 server for ``kvwire engine``: httptools parses, an asyncio Protocol writes.

Why not an ASGI framework: a streamed token must cost a few microseconds, so there is no
task, queue or framework object per request. The application sees a :class:`Conn` per
request, answers it at once (``respond``) or later (``start_stream`` / ``send`` / ``end``),
and may set ``on_close`` to learn that the client went away (the engine aborts then).

Keep-alive and pipelined requests are served in order, one at a time per connection.
Malformed HTTP gets 400 and the connection is closed; bodies over ``MAX_BODY`` get 413.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httptools

from ..http1 import MAX_BODY, TOO_LARGE, InOrder, feed, reason, refuse, status_line

__all__ = ["MAX_BODY", "Conn", "HttpProtocol", "serve"]

log = logging.getLogger("kvwire.engine.http")

JSON = b"application/json"


class Conn:
    """One request on a connection: method, path, body; the ways to answer it."""

    __slots__ = ("proto", "method", "path", "body", "keep_alive", "on_close", "done",
                 "streaming", "dp_rank", "query", "too_large")

    def __init__(self, proto: HttpProtocol, method: bytes, path: bytes, body: bytes,
                 keep_alive: bool, dp_rank: bytes | None = None, query: bytes = b"",
                 too_large: bool = False) -> None:
        self.proto = proto
        #: the body was over ``MAX_BODY`` (read and dropped): answered 413, never handed on
        self.too_large = too_large
        #: the URL's query string, without the ``?`` (empty when there is none)
        self.query = query
        #: vLLM's ``X-data-parallel-rank`` header as sent (a router's choice of DP rank)
        self.dp_rank = dp_rank
        self.method = method
        self.path = path
        self.body = body
        self.keep_alive = keep_alive
        self.on_close: Callable[[], None] | None = None
        self.done = False
        self.streaming = False

    @property
    def closed(self) -> bool:
        return self.proto.transport is None

    def respond(self, status: int, body: bytes, ctype: bytes = JSON) -> None:
        """The whole response at once."""
        if self.done:
            return
        t = self.proto.transport
        if t is not None:
            t.write(status_line(status) + b"content-type: %s\r\ncontent-length: %d\r\n%s\r\n" % (
                ctype, len(body), b"" if self.keep_alive else b"connection: close\r\n") + body)
        self._finish()

    def start_stream(self, ctype: bytes = b"text/event-stream; charset=utf-8") -> None:
        """A 200 with chunked transfer encoding; then :meth:`send` and :meth:`end`."""
        self.streaming = True
        t = self.proto.transport
        if t is not None:
            t.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncache-control: no-cache\r\n"
                    b"transfer-encoding: chunked\r\n%s\r\n" % (
                        ctype, b"" if self.keep_alive else b"connection: close\r\n"))

    def send(self, data: bytes) -> None:
        t = self.proto.transport
        if t is not None and data:
            t.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end(self, data: bytes = b"") -> None:
        if self.done:
            return
        t = self.proto.transport
        if t is not None:
            t.write((b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + b"0\r\n\r\n")
        self._finish()

    def _finish(self) -> None:
        self.done = True
        self.on_close = None
        self.proto._finished(self)


class HttpProtocol(asyncio.Protocol):
    """One connection: parse requests, hand each to ``app(conn)`` in order."""

    __slots__ = ("app", "transport", "parser", "_url", "_body", "_size", "_dp_rank", "order")

    def __init__(self, app: Callable[[Conn], None]) -> None:
        self.app = app
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._body: list[bytes] = []
        self._size = 0
        self.order = InOrder(self._run)

    # asyncio callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None
        self.order.lost()

    def data_received(self, data: bytes) -> None:
        bad = feed(self.parser, data)
        if bad is not None:
            refuse(self.transport, bad[0], _error(*bad))

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._body = []
        self._size = 0
        self._dp_rank = None

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 20 and name.lower() == b"x-data-parallel-rank":
            self._dp_rank = value

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > MAX_BODY:
            self._body = []  # read on, keep nothing (see MAX_BODY)
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        p = self.parser
        path, _, query = self._url.partition(b"?")
        self.order.add(Conn(self, p.get_method(), path, b"".join(self._body),
                            p.should_keep_alive(), self._dp_rank, query,
                            self._size > MAX_BODY))

    def _run(self, conn: Conn) -> None:
        if conn.too_large:
            conn.respond(413, _error(413, TOO_LARGE))
            return
        try:
            self.app(conn)
        except Exception:
            log.exception("handler failed for %s %s", conn.method, conn.path)
            if not conn.done:
                if conn.streaming:
                    conn.end()
                else:
                    conn.respond(500, b'{"error":{"message":"internal error","type":'
                                      b'"InternalServerError","param":null,"code":500}}')

    def _finished(self, conn: Conn) -> None:
        self.order.finished(conn, self.transport)


def _error(status: int, msg: bytes) -> bytes:
    """OpenAI's error object."""
    return (b'{"error":{"message":"%s","type":"%s","param":null,"code":%d}}'
            % (msg.replace(b'"', b"'"), reason(status), status))


async def serve(app: Callable[[Conn], None], host: str, port: int, **kw) -> asyncio.Server:
    """Listen on host:port (port 0: any free one)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: HttpProtocol(app), host, port, **kw)
