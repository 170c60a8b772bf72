"""kvwire's one HTTP/1.1 client (asyncio): the proxy's upstream requests, its engine health
probes and the demo's replay client. One keep-alive :class:`Pool` per ``host:port``, O(1)
per request, an ``asyncio.Protocol`` per connection (httptools parses).

Why not streams: a streamed answer's chunks must cost microseconds each. Here the body is
pushed as it arrives, either collected (:meth:`Response.read`) or handed to a *sink*
(:meth:`Response.relay`) once per ``data_received`` with every chunk that read held: no
task, future or timer per chunk, and chunks that arrive together leave together.

A streamed body can also be handed to a plain callback, one piece at a time, inside the
read that brought it (:meth:`Response.stream`): a clock read there is the arrival time,
with no task switch between the socket and the measurement (the replay client's TTFT).

asyncio sets TCP_NODELAY on its TCP transports. A connection goes back to its pool only
after a complete response; one abandoned mid-answer is closed, which is how an engine
learns the client left.
"""

from __future__ import annotations

import asyncio
import socket
import ssl as _ssl
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

import httptools

__all__ = ["Pool", "Response", "Sink", "UpstreamError", "endpoint"]


class UpstreamError(OSError):
    """The engine could not be reached, or broke the HTTP exchange."""


class _Stale(Exception):
    """A pooled connection the engine had closed before answering a byte: try another."""


def _expire(fut: asyncio.Future) -> None:
    """A timeout as one timer handle on the awaited future (no task, no context manager)."""
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


class Sink(Protocol):
    """Where :meth:`Response.relay` pushes a body."""

    def on_chunks(self, chunks: list[bytes]) -> None: ...
    def on_end(self, chunks: list[bytes]) -> None: ...  # the last read's chunks ([]: none)
    def on_error(self, error: UpstreamError) -> None: ...


class Response:
    """An engine's answer: ``status``, lower-cased ``headers``, then its body, read whole
    or relayed. ``last_read`` is the loop time of the last bytes received (stall timers)."""

    __slots__ = ("_conn", "_parts", "_done_fut", "_sink", "done", "headers", "status",
                 "keep")

    def __init__(self, conn: _Conn, status: int, headers: dict[bytes, bytes],
                 keep: bool) -> None:
        self._conn: _Conn | None = conn
        self.status = status
        self.headers = headers
        self.keep = keep
        self.done = False
        self._parts: list[bytes] = []
        self._done_fut: asyncio.Future | None = None
        self._sink: Sink | None = None

    @property
    def last_read(self) -> float:
        c = self._conn
        return c.last_read if c is not None else 0.0

    # called by the connection
    def _body(self, data: bytes) -> None:
        self._parts.append(data)

    def _flush(self) -> None:
        """End of one ``data_received``: hand what it held to the sink."""
        if self._sink is not None and self._parts:
            parts, self._parts = self._parts, []
            self._sink.on_chunks(parts)

    def _complete(self) -> None:
        """The body ended: a sink gets the chunks of the read that ended it with the end
        (one client write for both: the terminator costs no socket write of its own)."""
        self.done = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.response = None
            conn.release(self.keep)
        sink = self._sink
        if sink is not None:
            parts, self._parts = self._parts, []
            sink.on_end(parts)
        elif self._done_fut is not None and not self._done_fut.done():
            self._done_fut.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        self._conn = None
        if self._sink is not None:
            self._sink.on_error(error)
        elif self._done_fut is not None and not self._done_fut.done():
            self._done_fut.set_exception(error)

    # the caller's side
    async def read(self, timeout: float | None = None) -> bytes:
        """The whole body (raises UpstreamError if the engine breaks it off,
        asyncio.TimeoutError if it takes over ``timeout`` s)."""
        if not self.done:
            if self._conn is None:
                raise UpstreamError("engine broke its answer")
            loop = self._conn.loop
            self._done_fut = fut = loop.create_future()
            timer = loop.call_later(timeout, _expire, fut) if timeout is not None else None
            try:
                await fut
            finally:
                self._done_fut = None
                if timer is not None:
                    timer.cancel()
        parts, self._parts = self._parts, []
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def relay(self, sink: Sink) -> None:
        """Push the body to ``sink`` from now on (what arrived already goes at once)."""
        self._sink = sink
        if self.done:
            parts, self._parts = self._parts, []
            sink.on_end(parts)
            return
        self._flush()
        if self._conn is None:
            sink.on_error(UpstreamError("engine closed the connection mid-body"))

    def detach(self) -> None:
        """Push nothing more to the sink (it has ended the answer its own way)."""
        self._sink = None

    async def stream(self, on_data: Callable[[bytes], Any], idle: float | None = None) -> None:
        """Call ``on_data`` with each piece of the body as it arrives, inside the read that
        brought it, until the body ends. ``on_data`` returning a true value stops early
        (the connection closes: the server learns the client left), as does raising
        (re-raised here). Raises UpstreamError if the server breaks the body off, and
        asyncio.TimeoutError after ``idle`` s without a byte."""
        conn = self._conn
        loop = conn.loop if conn is not None else asyncio.get_running_loop()
        fut = loop.create_future()
        timer: list[asyncio.TimerHandle] = []

        def check() -> None:
            """No byte for ``idle`` s: time out; else look again when it could be so."""
            if fut.done():
                return
            left = self.last_read + idle - loop.time() if self._conn is not None else 0.0
            if left <= 0:
                fut.set_exception(asyncio.TimeoutError())
            else:
                timer[:] = [loop.call_later(left, check)]

        if idle is not None and not self.done:
            timer.append(loop.call_later(idle, check))
        try:
            self.relay(_Each(on_data, fut))
            await fut
        finally:
            if timer:
                timer[0].cancel()
            if not self.done:
                self.close()

    def pause(self) -> None:
        """Stop reading from the engine (the client is slow): TCP pushes back to it."""
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.pause_reading()

    def resume(self) -> None:
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.resume_reading()

    def close(self) -> None:
        """Unfinished: the connection closes and the engine aborts the request."""
        conn, self._conn = self._conn, None
        self._sink = None
        if conn is not None and not self.done:
            conn.response = None
            conn.close()


class _Each:
    """The sink of :meth:`Response.stream`: every piece to a callback, then the end."""

    __slots__ = ("fn", "fut")

    def __init__(self, fn: Callable[[bytes], Any], fut: asyncio.Future) -> None:
        self.fn = fn
        self.fut = fut

    def on_chunks(self, chunks: list[bytes]) -> None:
        fut = self.fut
        for c in chunks:
            if fut.done():
                return
            try:
                if self.fn(c):
                    fut.set_result(None)  # the caller has what it wanted
            except Exception as e:  # (raised to the caller, never into the protocol)
                fut.set_exception(e)

    def on_end(self, chunks: list[bytes]) -> None:
        self.on_chunks(chunks)
        if not self.fut.done():
            self.fut.set_result(None)

    def on_error(self, error: UpstreamError) -> None:
        if not self.fut.done():
            self.fut.set_exception(error)


class _Conn(asyncio.Protocol):
    """One keep-alive connection to an engine: one request at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.loop = asyncio.get_running_loop()
        self.last_read = 0.0
        self.head: asyncio.Future | None = None  # resolves to the Response
        self.response: Response | None = None
        self.got_bytes = False
        self._headers: dict[bytes, bytes] = {}

    # asyncio
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # (uvloop: already)

    def data_received(self, data: bytes) -> None:
        self.last_read = self.loop.time()
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._broken(UpstreamError(f"malformed answer from the engine: {e}"))
            return
        r = self.response
        if r is not None:
            r._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.pool.forget(self)
        r = self.response
        if r is not None and b"content-length" not in r.headers and \
                b"chunked" not in r.headers.get(b"transfer-encoding", b"").lower():
            r.keep = False  # a body framed by the end of the connection: complete
            r._complete()
            return
        if self.head is not None or self.response is not None:
            self._broken(UpstreamError("engine closed the connection" +
                                       (" mid-body" if self.response else " before answering")))

    def _broken(self, err: UpstreamError) -> None:
        head, self.head = self.head, None
        r, self.response = self.response, None
        if self.transport is not None:
            self.transport.close()
        if head is not None and not head.done():
            head.set_exception(err if self.got_bytes else _Stale())
        if r is not None:
            r._fail(err)

    # httptools
    def on_message_begin(self) -> None:
        self._headers = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        p = self.parser
        r = Response(self, p.get_status_code(), self._headers, p.should_keep_alive())
        self.response = r
        head, self.head = self.head, None
        if head is not None and not head.done():
            head.set_result(r)
        else:
            # nobody waits for this answer: its request was cancelled or timed out just
            # before it came, and that request's task, not run yet, still holds this
            # connection and will close it. Given back to the pool (keep-alive), another
            # request could take it first and lose its head to that close.
            r.keep = False

    def on_body(self, data: bytes) -> None:
        r = self.response
        if r is not None:
            r._body(data)

    def on_message_complete(self) -> None:
        r = self.response
        if r is not None:
            r._complete()

    # the pool's side
    def send(self, data: bytes) -> asyncio.Future:
        self.got_bytes = False
        self.head = self.loop.create_future()
        self.transport.write(data)  # type: ignore[union-attr]
        return self.head

    def release(self, keep: bool) -> None:
        if keep and self.transport is not None and not self.transport.is_closing():
            self.pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        self.head = None
        if self.transport is not None:
            self.transport.close()
        self.pool.forget(self)

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()


def endpoint(url: str) -> tuple[str, int, _ssl.SSLContext | None, str]:
    """``http[s]://HOST[:PORT][/BASE]`` as (host, port, a TLS context for https or None,
    base path without its trailing ``/``); ValueError naming what is wrong otherwise."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http:// or https:// URL: {url!r}")
    try:
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError as e:  # a port that is not a number, or out of range
        raise ValueError(f"bad port in {url!r}: {e}") from None
    tls = _ssl.create_default_context() if u.scheme == "https" else None
    return u.hostname, port, tls, u.path.rstrip("/")


class Pool:
    """Keep-alive connections to one ``host:port`` (``ssl``: over TLS). ``max_idle`` = 0:
    each connection closes after its answer."""

    def __init__(self, host: str, port: int, connect_timeout: float = 2.0,
                 max_idle: int = 256, ssl: _ssl.SSLContext | None = None) -> None:
        self.host, self.port = host, port
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.ssl = ssl
        self._idle: deque[_Conn] = deque()
        shown = f"[{host}]" if ":" in host else host  # an IPv6 address is bracketed
        self._hostline = f"host: {shown}:{port}\r\n".encode()
        self.closed = False  # closed: connections given back are closed, not kept

    def put(self, conn: _Conn) -> None:
        if len(self._idle) < self.max_idle and not self.closed:
            self._idle.append(conn)
        else:
            conn.close()

    def forget(self, conn: _Conn) -> None:
        # O(n) but only on a closed connection (rare); the deque is usually short
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    def close(self) -> None:
        self.closed = True
        while self._idle:
            self._idle.pop().close()

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(self), self.host, self.port,
                                       ssl=self.ssl),
                self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as e:
            raise UpstreamError(f"cannot connect to {self.host}:{self.port}: {e!r}") from None
        return conn

    async def request(self, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes, sent: list[float] | None = None,
                      clock: Callable[[], float] | None = None,
                      timeout: float | None = None) -> Response:
        """Send a request and wait for the status line and headers. A kept-alive
        connection the engine closed meanwhile is replaced by a fresh one. ``sent`` gets
        ``clock()`` each time the request is written. No head within ``timeout`` s of
        writing: asyncio.TimeoutError. Cancelled or timed out: the connection closes (an
        answer that came whole before the cancel has given it back to the pool already)."""
        data = b"".join([method, b" ", path, b" HTTP/1.1\r\n", self._hostline,
                         *[k + b": " + v + b"\r\n" for k, v in headers],
                         b"content-length: %d\r\n\r\n" % len(body), body])
        while True:
            fresh = not self._idle
            conn = await self._connect() if fresh else self._idle.pop()
            if not conn.usable:
                continue
            head = conn.send(data)
            if sent is not None and clock is not None:
                sent.append(clock())
            timer = (conn.loop.call_later(timeout, _expire, head) if timeout is not None
                     else None)
            try:
                return await head
            except _Stale:
                if fresh:
                    raise UpstreamError("engine closed the connection before answering"
                                        ) from None
            except BaseException:  # cancelled (the client left) or timed out: abandoned
                if head.done() and not head.cancelled() and head.exception() is None:
                    # the head came before the cancel reached this task: the connection is
                    # its Response's now, and if the whole answer came with it, back in the
                    # pool and maybe another request's already; only the Response may
                    # close it (it does only while it still owns it)
                    head.result().close()
                else:
                    conn.close()
                raise
            finally:
                if timer is not None:
                    timer.cancel()

    async def fetch(self, method: bytes, path: bytes, timeout: float,
                    headers: list[tuple[bytes, bytes]] | None = None,
                    body: bytes = b"") -> tuple[int, bytes]:
        """One whole exchange, for what is not a hot path (health probes, polls): the
        status and the body, each within ``timeout`` s (UpstreamError,
        asyncio.TimeoutError)."""
        r = await self.request(method, path, headers or [], body, timeout=timeout)
        try:
            return r.status, await r.read(timeout)
        finally:
            r.close()
