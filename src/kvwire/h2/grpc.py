"""A gRPC server on asyncio and :class:`~.connection.Connection`: as much of gRPC over HTTP/2
as Envoy's gRPC clients use (its ``ext_proc`` filter's streams, its gRPC health checks):
unary and bidirectional-streaming methods, length-prefixed messages (no compression),
``grpc-timeout``, status in trailers. Cleartext (h2c, prior knowledge) or TLS (ALPN ``h2``).

Each connection is an :class:`asyncio.Protocol` that runs its frames through the pure
connection machine as they come; each call is one task running the method's handler, fed
from a queue (no task or coroutine per frame). A call the peer resets (RST_STREAM: the HTTP
request behind it ended or its client left) or whose connection drops has its task
cancelled, so a handler's ``finally`` runs as it does under grpc.aio."""

from __future__ import annotations

import asyncio
import logging
import ssl as _ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any
from urllib.parse import quote

from . import frames as f
from .connection import Connection, Data, Request, Reset, Terminated

__all__ = ["Abort", "Context", "Deframer", "Method", "Server", "StatusCode", "context", "stream_stream",
           "unary_unary"]

log = logging.getLogger("kvwire.h2")


class StatusCode(IntEnum):
    """gRPC's status codes."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class Abort(Exception):
    """Ends a call with a status (raised by :meth:`Context.abort`)."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Context:
    """What a handler gets beside its request(s): ``headers`` (the request's, raw),
    :meth:`abort`."""

    __slots__ = ("headers",)

    def __init__(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.headers = headers

    async def abort(self, code: StatusCode, message: str = "") -> None:
        raise Abort(code, message)


@dataclass(frozen=True, slots=True)
class Method:
    """A method's handler: ``stream`` false: ``await fn(request, context)`` returns the
    answer; true: ``fn(requests, context)`` is an async iterator of answers (an async
    generator) over an async iterator of requests. ``decode`` / ``encode`` turn message
    bytes into the handler's values and back (None: bytes as they are)."""

    fn: Callable[..., Any]
    stream: bool
    decode: Callable[[bytes], Any] | None = None
    encode: Callable[[Any], bytes] | None = None


def unary_unary(fn: Callable[[Any, Context], Awaitable[Any]], decode: Any = None,
                encode: Any = None) -> Method:
    return Method(fn, False, decode, encode)


def stream_stream(fn: Callable[[AsyncIterator[Any], Context], AsyncIterator[Any]],
                  decode: Any = None, encode: Any = None) -> Method:
    return Method(fn, True, decode, encode)


_HEADERS = f.header_block([(b":status", b"200"), (b"content-type", b"application/grpc")])
_TRAILERS_OK = f.header_block([(b"grpc-status", b"0")])
_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
#: complete messages a call may hold unread before its stream window stays shut
_HOLD = 1 << 20
#: answer bytes a call may have waiting for the peer's window before its handler waits
_PENDING = 1 << 20


def _timeout(value: bytes) -> float | None:
    """``grpc-timeout`` (at most 8 digits and a unit) in seconds; None if malformed."""
    unit = _UNITS.get(value[-1:])
    if unit is None or not 1 < len(value) <= 9 or not value[:-1].isdigit():
        return None
    return int(value[:-1]) * unit


def _status_block(code: int, message: str, first: bool) -> bytes:
    """Trailers (``first``: a trailers-only answer, so with :status and content-type)."""
    h = [(b":status", b"200"), (b"content-type", b"application/grpc")] if first else []
    h.append((b"grpc-status", str(int(code)).encode()))
    if message:  # percent-encoded (gRPC over HTTP/2: grpc-message)
        h.append((b"grpc-message", quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")
                  .encode()))
    return f.header_block(h)


class Deframer:
    """gRPC's length-prefixed messages (a flag byte: compressed or not, a 4-byte length)
    out of a stream's DATA, however the frames cut them. Pure."""

    __slots__ = ("buf", "max_message")

    def __init__(self, max_message: int) -> None:
        self.buf = bytearray()
        self.max_message = max_message

    def feed(self, data: bytes, end: bool, out: deque[bytes] | list[bytes]) -> int:
        """Append the messages ``data`` completes to ``out``; their bytes. Raises
        :class:`Abort` for a compressed message (none is accepted: this side announces no
        grpc-accept-encoding), one longer than ``max_message``, or an ``end`` inside one."""
        buf = self.buf
        if not buf and len(data) >= 5 and data[0] == 0 \
                and int.from_bytes(data[1:5], "big") == len(data) - 5:
            out.append(data[5:])  # one whole message: the usual case
            return len(data) - 5
        got = 0
        buf += data
        while len(buf) >= 5:
            if buf[0]:
                raise Abort(StatusCode.UNIMPLEMENTED, "compressed messages are not accepted")
            n = int.from_bytes(buf[1:5], "big")
            if n > self.max_message:
                raise Abort(StatusCode.RESOURCE_EXHAUSTED,
                            f"a message of {n} bytes (at most {self.max_message})")
            if len(buf) < 5 + n:
                break
            out.append(bytes(buf[5:5 + n]))
            got += n
            del buf[:5 + n]
        if end and buf:
            raise Abort(StatusCode.INTERNAL, "the stream ended inside a message")
        return got


class _Call:
    """One call: its messages in, its answers out, the task running its handler."""

    __slots__ = ("conn", "sid", "method", "queue", "messages", "closed", "waiter", "task",
                 "headers_sent", "held", "unread", "reset", "expired", "timer", "drain",
                 "failed")

    def __init__(self, conn: _Protocol, sid: int, method: Method) -> None:
        self.conn = conn
        self.sid = sid
        self.method = method
        self.queue: deque[bytes] = deque()
        self.messages = Deframer(conn.server.max_message)
        self.closed = False  # the peer sent its last message
        self.waiter: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None
        self.headers_sent = False
        self.held = 0  # window bytes not yet given back (too much unread)
        self.unread = 0  # bytes of complete messages the handler has not taken
        self.reset = False
        self.expired = False
        self.timer: asyncio.TimerHandle | None = None
        self.drain: asyncio.Future[None] | None = None
        self.failed: Abort | None = None  # bad framing: the handler is cancelled with this

    # --------------------------------------------------------------- in

    def feed(self, data: bytes, flow: int, end: bool) -> None:
        try:
            self.unread += self.messages.feed(data, end, self.queue)
        except Abort as e:
            self._fail(e)
            return
        if end:
            self.closed = True
        self.held += flow
        if self.unread <= _HOLD:
            self.conn.h2.consumed(self.sid, self.held)
            self.held = 0
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, e: Abort) -> None:
        self.failed = e
        self.closed = True
        if self.task is not None:
            self.task.cancel()

    def __aiter__(self) -> _Call:
        return self

    async def __anext__(self) -> Any:
        queue = self.queue
        while not queue:
            if self.closed:
                raise StopAsyncIteration
            self.waiter = w = asyncio.get_running_loop().create_future()
            await w
        raw = queue.popleft()
        self.unread -= len(raw)
        if self.held and self.unread <= _HOLD:
            self.conn.h2.consumed(self.sid, self.held)
            self.held = 0
            self.conn.flush_soon()
        decode = self.method.decode
        return raw if decode is None else decode(raw)

    async def one(self) -> Any:
        """A unary call's request: exactly one message, then the end."""
        got = None
        async for m in self:
            if got is not None:
                raise Abort(StatusCode.UNIMPLEMENTED, "more than one request message")
            got = (m,)
        if got is None:
            raise Abort(StatusCode.UNIMPLEMENTED, "no request message")
        return got[0]

    # --------------------------------------------------------------- out

    def send(self, raw: bytes) -> None:
        h2 = self.conn.h2
        if not self.headers_sent:
            self.headers_sent = True
            h2.send_headers(self.sid, _HEADERS)
        h2.send_data(self.sid, b"\x00" + len(raw).to_bytes(4, "big") + raw)
        self.conn.flush_soon()

    def finish(self, code: int, message: str) -> None:
        h2 = self.conn.h2
        if not self.headers_sent:
            self.headers_sent = True
            h2.send_headers(self.sid, _status_block(code, message, True), end=True)
        else:
            h2.send_trailers(self.sid, _TRAILERS_OK if code == 0 and not message
                             else _status_block(code, message, False))
        self.conn.flush_soon()

    async def run(self, ctx: Context) -> None:
        m = self.method
        code: int = StatusCode.OK
        message = ""
        try:
            if m.stream:
                encode = m.encode
                pending = self.conn.h2.pending
                async for out in m.fn(self, ctx):
                    self.send(out if encode is None else encode(out))
                    if pending(self.sid) > _PENDING:
                        await self._drained()
            else:
                out = await m.fn(await self.one(), ctx)
                self.send(out if m.encode is None else m.encode(out))
        except Abort as e:
            code, message = e.code, e.message
        except asyncio.CancelledError:
            if self.reset:
                return  # the peer reset the stream or left: nobody to answer
            if self.failed is not None:
                code, message = self.failed.code, self.failed.message
            elif self.expired:
                code, message = StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
            else:
                code, message = StatusCode.UNAVAILABLE, "the server is stopping"
        except Exception as e:  # noqa: BLE001 - a handler's bug fails its call, not the server
            log.exception("gRPC handler %s failed", getattr(m.fn, "__name__", m.fn))
            code, message = StatusCode.UNKNOWN, f"{type(e).__name__}: {e}"
        finally:
            if self.timer is not None:
                self.timer.cancel()
            self.conn.calls.pop(self.sid, None)
            self.conn.server.call_ended()
        if not self.reset:
            self.finish(code, message)

    async def _drained(self) -> None:
        self.drain = asyncio.get_running_loop().create_future()
        try:
            await self.drain
        finally:
            self.drain = None

    def expire(self) -> None:
        self.expired = True
        if self.task is not None:
            self.task.cancel()


class _Protocol(asyncio.Protocol):
    """One connection: the machine, its calls, the writes (coalesced per loop turn)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.h2 = Connection(max_streams=server.max_streams, window=server.window)
        self.calls: dict[int, _Call] = {}
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.flushing = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.server.conns.add(self)
        transport.write(self.h2.take())

    def data_received(self, data: bytes) -> None:
        h2 = self.h2
        calls = self.calls
        for ev in h2.receive(data):
            t = type(ev)
            if t is Data:
                c = calls.get(ev.stream)
                if c is not None:
                    c.feed(ev.data, ev.flow, ev.end)
            elif t is Request:
                if ev.trailers:
                    c = calls.get(ev.stream)
                    if c is not None:
                        c.feed(b"", 0, True)
                else:
                    self._start(ev)
            elif t is Reset:
                c = calls.pop(ev.stream, None)
                if c is not None:
                    c.reset = True
                    if c.task is not None:
                        c.task.cancel()
            elif t is Terminated:
                log.warning("HTTP/2 connection ended: %s", ev.message)
                self._flush()
                self._cut()
                return
        if h2.out:
            self._flush()
        if h2.send_window > 0:
            for c in calls.values():
                if c.drain is not None and h2.pending(c.sid) <= _PENDING \
                        and not c.drain.done():
                    c.drain.set_result(None)

    def _start(self, ev: Request) -> None:
        path = b""
        timeout = None
        ctype = b""
        for k, v in ev.headers:
            if k == b":path":
                path = v
            elif k == b"grpc-timeout":
                timeout = _timeout(v)
            elif k == b"content-type":
                ctype = v
        if not ctype.startswith(b"application/grpc"):
            self.h2.send_headers(ev.stream, [(b":status", b"415")], end=True)
            return
        method = self.server.methods.get(path.decode("latin-1"))
        if method is None:
            self.h2.send_headers(ev.stream, _status_block(
                StatusCode.UNIMPLEMENTED, f"no method {path.decode('latin-1')}", True), end=True)
            return
        c = _Call(self, ev.stream, method)
        if ev.end:
            c.closed = True
        self.calls[ev.stream] = c
        c.task = self.loop.create_task(c.run(Context(ev.headers)))
        if timeout is not None:
            c.timer = self.loop.call_later(timeout, c.expire)

    def flush_soon(self) -> None:
        if not self.flushing:
            self.flushing = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flushing = False
        t = self.transport
        if self.h2.out and t is not None and not t.is_closing():
            t.write(self.h2.take())

    def _cut(self) -> None:
        """Close the socket and cancel every call (none can answer any more)."""
        for c in self.calls.values():
            c.reset = True
            if c.task is not None:
                c.task.cancel()
        self.calls.clear()
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.conns.discard(self)
        self._cut()
        self.transport = None

    def goaway(self) -> None:
        self.h2.goaway()
        self._flush()


class Server:
    """Serves ``methods`` (``"/package.Service/Method"`` -> :class:`Method`) on the running
    loop. ``max_message``: the longest request message accepted (RESOURCE_EXHAUSTED past
    it); ``max_streams``: concurrent calls per connection; ``window``: the flow-control
    window each call and connection gets."""

    def __init__(self, methods: dict[str, Method], *, max_message: int = 64 << 20,
                 max_streams: int = 1000, window: int = 1 << 20) -> None:
        self.methods = methods
        self.max_message = max_message
        self.max_streams = max_streams
        self.window = window
        self.conns: set[_Protocol] = set()
        self.server: asyncio.AbstractServer | None = None
        self._idle: asyncio.Event | None = None  # set when the last call ends (stopping)

    async def start(self, host: str, port: int, ssl: _ssl.SSLContext | None = None) -> int:
        """Listen on ``host:port`` (0: a free port); the port. With ``ssl``, TLS (its ALPN
        set to ``h2``)."""
        if ssl is not None:
            ssl.set_alpn_protocols(["h2"])
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Protocol(self), host, port, ssl=ssl,
                                               reuse_address=True)
        return self.server.sockets[0].getsockname()[1]

    def calls(self) -> int:
        """Calls under way, on every connection."""
        return sum(len(c.calls) for c in self.conns)

    def call_ended(self) -> None:
        if self._idle is not None and not self.calls():
            self._idle.set()

    async def stop(self, grace: float | None = None) -> None:
        """Stop listening; GOAWAY to every connection; calls under way get ``grace``
        seconds (None: none), then are cancelled and the connections closed."""
        if self.server is not None:
            self.server.close()
        for c in list(self.conns):
            c.goaway()
        if grace and self.calls():
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except asyncio.TimeoutError:
                pass
        for c in list(self.conns):
            c._flush()
            c._cut()
        if self.server is not None:
            await self.server.wait_closed()
            self.server = None


def context(certfile: str, keyfile: str) -> _ssl.SSLContext:
    """A server TLS context for gRPC (TLS 1.2 or later, ALPN ``h2``)."""
    ctx = _ssl.create_default_context(_ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = _ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile, keyfile)
    ctx.set_alpn_protocols(["h2"])
    return ctx
