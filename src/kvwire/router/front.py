"""``kvwire serve``'s HTTP server when it proxies (engines with ``url=``): httptools parses,
an ``asyncio.Protocol`` writes, as in :mod:`kvwire.engine.http`.

Why not uvicorn for everything: a proxied request crossed uvicorn's ASGI cycle (a task, a
queue of messages, a dict per send) and a streamed answer paid that per chunk: about half
of the proxy's CPU. Here ``POST /v1/completions``, ``POST /v1/chat/completions`` and
``GET /v1/models`` go straight to the :class:`~kvwire.router.proxy.Proxy`, which answers on
the :class:`Request` (a whole response, or a chunked stream written once per read from
the engine, with backpressure through :attr:`Request.on_pause` / ``on_resume``). Every
other path (``/route``, ``/metrics``, ``/health``, the status page, ...) is handed to the
ASGI app (:func:`~kvwire.router.app.fast_app`) through a small ASGI bridge, so the routes
stay defined in one place.

:class:`Server` has the part of ``uvicorn.Server``'s interface that ``kvwire serve`` and
``serve_in_thread`` use: ``run(sockets=...)``, ``started``, ``should_exit``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import httptools

from ..http1 import MAX_BODY, InOrder, feed, refuse
from ..http1 import status_line as _status_line

__all__ = ["HttpProtocol", "Request", "Server"]

log = logging.getLogger("kvwire.router.front")

_JSON = b"application/json"
# Bodies of the paths the ASGI app answers are capped at http1.MAX_BODY (the proxy has its own).


class Request:
    """One request on a client connection and the ways to answer it: :meth:`respond`
    (whole), or :meth:`start` then :meth:`write` / :meth:`end` (chunked). ``on_close``
    is called if the client goes away before the answer ended; ``on_pause`` /
    ``on_resume`` when the client's socket buffer fills / drains; ``on_done`` once when
    the request is over either way (answered, aborted or its client gone)."""

    __slots__ = ("proto", "method", "path", "query", "headers", "body", "keep_alive",
                 "too_large", "t0", "on_close", "on_pause", "on_resume", "on_done", "done",
                 "started", "_head")

    def __init__(self, proto: HttpProtocol, method: bytes, path: bytes, query: bytes,
                 headers: list[tuple[bytes, bytes]], body: bytes, keep_alive: bool,
                 too_large: bool, t0: float) -> None:
        self.proto = proto
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers  # names lower-cased, in the client's order
        self.body = body
        self.keep_alive = keep_alive
        self.too_large = too_large  # the body was over the cap (and dropped)
        self.t0 = t0  # time.perf_counter() when the request began to arrive
        self.on_close: Callable[[], None] | None = None
        self.on_pause: Callable[[], None] | None = None
        self.on_resume: Callable[[], None] | None = None
        self.on_done: Callable[[], None] | None = None
        self.done = False
        self.started = False
        self._head = b""  # a started answer's head not yet written (see start)

    @property
    def closed(self) -> bool:
        return self.proto.transport is None

    def _conn_header(self) -> bytes:
        if self.keep_alive and not self.proto.server.draining:
            return b""
        return b"connection: close\r\n"

    def respond(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = (),
                ctype: bytes | None = _JSON) -> None:
        """The whole answer at once (``content-type``: ``ctype`` unless in ``headers``)."""
        if self.done:
            return
        t = self.proto.transport
        if t is not None:
            extra = b"".join([k + b": " + v + b"\r\n" for k, v in headers])
            t.write(b"".join((
                _status_line(status),
                b"" if ctype is None else b"content-type: " + ctype + b"\r\n",
                extra, b"content-length: %d\r\n" % len(body), self._conn_header(), b"\r\n",
                b"" if self.method == b"HEAD" else body)))
        self._finish()

    def start(self, status: int, headers: list[tuple[bytes, bytes]],
              hold: bool = False) -> None:
        """The head of a chunked answer (``headers`` as given). ``hold``: keep it to go
        out with the first chunk, in one socket write (the caller calls :meth:`flush`
        if that chunk is late)."""
        self.started = True
        self._head = b"".join((_status_line(status),
                               *[k + b": " + v + b"\r\n" for k, v in headers],
                               b"transfer-encoding: chunked\r\n", self._conn_header(),
                               b"\r\n"))
        if not hold:
            self.flush()

    def flush(self) -> None:
        """Write a held head now."""
        head, self._head = self._head, b""
        t = self.proto.transport
        if head and t is not None:
            t.write(head)

    def write(self, chunks: list[bytes]) -> None:
        """Chunks of a started answer: one socket write for all of them."""
        t = self.proto.transport
        if t is None:
            return
        if len(chunks) == 1:
            c = chunks[0]
            data = b"%x\r\n%s\r\n" % (len(c), c) if c else b""
        else:
            data = b"".join([b"%x\r\n%s\r\n" % (len(c), c) for c in chunks if c])
        if self._head:
            data, self._head = self._head + data, b""
        if data:
            t.write(data)

    def end(self, chunk: bytes = b"") -> None:
        """The last ``chunk`` (if any) and the end of a started answer: one socket write
        (with a head still held)."""
        if self.done:
            return
        t = self.proto.transport
        if t is not None:
            t.write(b"%s%x\r\n%s\r\n0\r\n\r\n" % (self._head, len(chunk), chunk)
                    if chunk else self._head + b"0\r\n\r\n")
        self._head = b""
        self._finish()

    def abort(self) -> None:
        """Drop the connection (an answer that cannot be finished properly)."""
        self.done = True
        self.on_close = self.on_pause = self.on_resume = None
        self.over()
        t = self.proto.transport
        if t is not None:
            t.close()

    def over(self) -> None:
        """Call ``on_done`` if it has not been called."""
        cb, self.on_done = self.on_done, None
        if cb is not None:
            cb()

    def _finish(self) -> None:
        self.done = True
        self.on_close = self.on_pause = self.on_resume = None
        self.over()
        self.proto._finished(self)


class HttpProtocol(asyncio.Protocol):
    """One client connection: parse requests, hand each to the proxy or the ASGI bridge,
    one at a time in order (keep-alive and pipelining)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0
        self._cap = MAX_BODY
        self._too_large = False
        self._t0 = 0.0
        self.order = InOrder(self._run)
        self._paused = False

    # asyncio
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server._conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server._conns.discard(self)
        cur = self.order.current
        self.order.lost()  # (its on_close first: the owner abandons the answer)
        if cur is not None:
            cur.over()

    def pause_writing(self) -> None:
        self._paused = True
        cur = self.order.current
        if cur is not None and cur.on_pause is not None:
            cur.on_pause()

    def resume_writing(self) -> None:
        self._paused = False
        cur = self.order.current
        if cur is not None and cur.on_resume is not None:
            cur.on_resume()

    def data_received(self, data: bytes) -> None:
        bad = feed(self.parser, data)
        if bad is not None:  # (a body over the cap is read on and answered 413 by its owner)
            status, msg = bad
            refuse(self.transport, status, b'{"error":{"message":"%s","type":"BadRequestError",'
                   b'"param":null,"code":%d}}' % (msg.replace(b'"', b"'"), status))

    # httptools
    def on_message_begin(self) -> None:
        self._t0 = time.perf_counter()
        self._url = b""
        self._headers = []
        self._body = []
        self._size = 0
        self._too_large = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        path = self._url.split(b"?", 1)[0]
        proxy = self.server.proxy
        self._cap = (proxy.cfg.max_body if proxy is not None and proxy.handles(path)
                     else MAX_BODY)

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self._cap:
            self._too_large = True  # read on, keep nothing: answered 413 at the end
            self._body = []
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        p = self.parser
        path, _, query = self._url.partition(b"?")
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self.order.add(Request(self, p.get_method(), path, query, self._headers, body,
                               p.should_keep_alive(), self._too_large, self._t0))

    def _run(self, req: Request) -> None:
        server = self.server
        try:
            if server.proxy is not None and server.proxy.handles(req.path):
                server.proxy.handle(req)
            else:
                server.loop.create_task(server.asgi(req))
        except Exception:
            log.exception("handler failed for %s %s", req.method, req.path)
            if not req.done:
                if req.started:
                    req.abort()
                else:
                    req.respond(500, b'{"error":{"message":"internal error","type":'
                                     b'"InternalServerError","param":null,"code":500}}')

    def _finished(self, req: Request) -> None:
        if self.server.draining:
            req.keep_alive = False  # the connection closes after this answer
        self.order.finished(req, self.transport)


class Server:
    """The proxy (hot paths) and an ASGI app (the rest) on one listening socket.

    ``drain_timeout`` > 0: the first SIGINT/SIGTERM drains instead of stopping: the socket
    stops accepting, idle connections close, and the requests in flight (streams included)
    run to their end for up to ``drain_timeout`` seconds, each connection closing after
    its answer; what is left then is cut (its engine request aborted, its load released).
    A second signal, or ``should_exit``, stops at once. A rolling restart behind a load
    balancer then loses no answer that was already being streamed."""

    def __init__(self, app: Any, proxy: Any = None, drain_timeout: float = 0.0) -> None:
        self.app = app
        self.proxy = proxy
        self.drain_timeout = float(drain_timeout)
        self.should_exit = False
        self.draining = False
        self.started = False
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self._conns: set[HttpProtocol] = set()
        self._drain_until: float | None = None

    def run(self, sockets: list[socket.socket]) -> None:
        """Serve until ``should_exit`` (or SIGINT/SIGTERM in the main thread); uvloop if
        installed (it comes with ``uvicorn[standard]``)."""
        try:
            import uvloop

            runner: Any = uvloop.run
        except ImportError:  # pragma: no cover
            runner = asyncio.run
        runner(self.serve(sockets))

    async def serve(self, sockets: list[socket.socket]) -> None:
        self.loop = loop = asyncio.get_running_loop()
        servers = [await loop.create_server(lambda: HttpProtocol(self), sock=s,
                                            backlog=2048) for s in sockets]
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._exit)
        self.started = True
        try:
            while not self.should_exit:
                if self.draining and self._drained(servers):
                    break
                await asyncio.sleep(0.1)
        finally:
            for s in servers:
                s.close()
            for c in list(self._conns):
                if c.transport is not None:
                    c.transport.close()
            if self.proxy is not None:
                self.proxy.close_pools()
            await asyncio.sleep(0)

    def _exit(self) -> None:
        if self.draining or self.drain_timeout <= 0:
            self.should_exit = True
        else:
            self.draining = True

    def _busy(self) -> int:
        return sum(1 for c in self._conns if c.order.current is not None)

    def _drained(self, servers: list[asyncio.AbstractServer]) -> bool:
        """One look while draining: True once nothing is in flight or the time is up."""
        now = time.monotonic()
        if self._drain_until is None:  # the drain begins
            self._drain_until = now + self.drain_timeout
            for s in servers:
                s.close()  # new connections are refused: a load balancer goes elsewhere
            for c in list(self._conns):
                if c.order.current is None and c.transport is not None:
                    c.transport.close()
            log.warning("draining: %d request(s) in flight, waiting up to %g s for them "
                        "(signal again to stop now)", self._busy(), self.drain_timeout)
        busy = self._busy()
        if busy == 0:
            log.warning("drained: every request in flight has ended")
            return True
        if now >= self._drain_until:
            log.warning("drain time-out: %d request(s) still in flight after %g s are cut",
                        busy, self.drain_timeout)
            return True
        return False

    # ------------------------------------------------------------------ ASGI bridge

    async def asgi(self, req: Request) -> None:
        """Run the ASGI app on one buffered request."""
        t = req.proto.transport
        if req.too_large:
            req.respond(413, b'{"error":"request body too large","reason":"too_large"}')
            return
        peer = t.get_extra_info("peername") if t is not None else None
        here = t.get_extra_info("sockname") if t is not None else None
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": req.method.decode(), "scheme": "http",
                 "path": unquote(req.path.decode("latin-1")), "raw_path": req.path,
                 "query_string": req.query, "root_path": "", "headers": req.headers,
                 "client": tuple(peer[:2]) if peer else None,
                 "server": tuple(here[:2]) if here else None}
        gone = self.loop.create_future()
        state = {"sent_body": False, "status": 200, "headers": [], "chunked": False}

        def closed() -> None:
            if not gone.done():
                gone.set_result(None)

        req.on_close = closed
        first = True

        async def receive() -> dict:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": req.body, "more_body": False}
            await gone
            return {"type": "http.disconnect"}

        async def send(msg: dict) -> None:
            if req.done:
                return
            kind = msg["type"]
            if kind == "http.response.start":
                state["status"] = msg["status"]
                state["headers"] = [(bytes(k).lower(), bytes(v)) for k, v in
                                    msg.get("headers", ())]
                return
            if kind != "http.response.body":
                return
            body = msg.get("body", b"")
            more = msg.get("more_body", False)
            if not state["chunked"]:
                if not more:  # the whole answer in one message
                    hdrs = [h for h in state["headers"] if h[0] != b"content-length"]
                    req.respond(state["status"], body, hdrs, ctype=None)
                    closed()
                    return
                state["chunked"] = True
                req.start(state["status"], [h for h in state["headers"]
                                            if h[0] != b"content-length"])
            if more:
                if body and req.method != b"HEAD":
                    req.write([body])
            else:
                req.end(body if req.method != b"HEAD" else b"")
                closed()

        try:
            await self.app(scope, receive, send)
        except Exception:
            log.exception("ASGI app failed on %s %s", req.method, req.path)
            if not req.done:
                if req.started:
                    req.abort()
                else:
                    req.respond(500, b'{"error":"internal error","reason":"internal"}')
        if not req.done:  # the app returned without finishing its answer
            if req.started:
                req.end()
            else:
                req.respond(500, b'{"error":"no response","reason":"internal"}')
