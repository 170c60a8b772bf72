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
from collections import deque
from collections.abc import Callable

import httptools

__all__ = ["Conn", "HttpProtocol", "serve"]

log = logging.getLogger("kvwire.engine.http")

MAX_BODY = 64 << 20
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            413: "Payload Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}
JSON = b"application/json"


class Conn:
    """One request on a connection: method, path, body; the ways to answer it."""

    __slots__ = ("proto", "method", "path", "body", "keep_alive", "on_close", "done",
                 "streaming", "dp_rank", "query")

    def __init__(self, proto: HttpProtocol, method: bytes, path: bytes, body: bytes,
                 keep_alive: bool, dp_rank: bytes | None = None, query: bytes = b"") -> None:
        self.proto = proto
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
            t.write(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n" % (
                status, _REASONS.get(status, "Unknown").encode(), ctype, len(body),
                b"" if self.keep_alive else b"connection: close\r\n") + body)
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

    __slots__ = ("app", "transport", "parser", "_url", "_body", "_dp_rank", "_queue",
                 "_current")

    def __init__(self, app: Callable[[Conn], None]) -> None:
        self.app = app
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._body: list[bytes] = []
        self._queue: deque[Conn] = deque()
        self._current: Conn | None = None

    # asyncio callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None
        cur, self._current = self._current, None
        self._queue.clear()
        if cur is not None and cur.on_close is not None:
            cb, cur.on_close = cur.on_close, None
            try:
                cb()
            except Exception:
                log.exception("on_close failed")

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, b"upgrade not supported")
        except httptools.HttpParserError as e:
            self._fail(400, str(e).encode())
        except _TooLarge:
            self._fail(413, b"request body too large")

    def _fail(self, status: int, msg: bytes) -> None:
        t = self.transport
        if t is None:
            return
        body = (b'{"error":{"message":"%s","type":"%s","param":null,"code":%d}}'
                % (msg.replace(b'"', b"'"), _REASONS[status].encode(), status))
        t.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (status, _REASONS[status].encode(), len(body),
                                                 body))
        t.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._body = []
        self._dp_rank = None

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 20 and name.lower() == b"x-data-parallel-rank":
            self._dp_rank = value

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        if len(self._body) > 16 and sum(map(len, self._body)) > MAX_BODY:
            raise _TooLarge

    def on_message_complete(self) -> None:
        p = self.parser
        path, _, query = self._url.partition(b"?")
        conn = Conn(self, p.get_method(), path, b"".join(self._body), p.should_keep_alive(),
                    self._dp_rank, query)
        if self._current is None:
            self._run(conn)
        else:
            self._queue.append(conn)

    def _run(self, conn: Conn) -> None:
        self._current = conn
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
        if conn is not self._current:
            return
        self._current = None
        if not conn.keep_alive:
            if self.transport is not None:
                self.transport.close()
            return
        if self._queue:
            self._run(self._queue.popleft())


class _TooLarge(Exception):
    pass


async def serve(app: Callable[[Conn], None], host: str, port: int, **kw) -> asyncio.Server:
    """Listen on host:port (port 0: any free one)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: HttpProtocol(app), host, port, **kw)
