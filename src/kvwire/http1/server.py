"""kvwire's one HTTP/1.1 server: under ``kvwire engine``, ``kvwire serve`` (the proxy and
every other route), ``kvwire index`` and ``kvwire listen --metrics``.

httptools parses; an ``asyncio.Protocol`` per connection writes. Why not an ASGI framework: a
proxied or streamed answer crossed uvicorn's ASGI cycle (a task, a queue of messages, a dict
per send) and paid that per chunk: about half of the proxy's CPU. Here a request is one
:class:`Request` handed to a handler from a :class:`Routes` table, which answers it at once
(:meth:`Request.respond`) or later (:meth:`Request.start`, :meth:`Request.write`,
:meth:`Request.end`), in its own callback or in a task it makes. No task, queue or framework
object per request unless the handler wants one.

A connection's requests are answered one at a time in the order they came (keep-alive and
pipelining, :class:`~kvwire.http1.InOrder`). Malformed HTTP gets 400 and the connection is
closed; a body over the cap is read on and dropped, then answered 413. ``on_close`` tells a
handler that its client went away; ``on_pause``/``on_resume`` that the client's socket buffer
filled/drained (backpressure). :class:`Server` adds the listening sockets, signals and a
graceful drain.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qsl, unquote

import httptools

from . import MAX_BODY, TOO_LARGE, HttpError, InOrder, feed, refuse, status_line

__all__ = ["JSON", "HttpProtocol", "Request", "Routes", "Server", "event_loop", "run_loop",
           "serve", "serve_in_thread"]

log = logging.getLogger("kvwire.http1.server")

JSON = b"application/json"
_SSE = b"text/event-stream; charset=utf-8"
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
#: HTTP/2 frames (RFC 9113): an empty SETTINGS, and a GOAWAY (last stream 0, error
#: HTTP_1_1_REQUIRED = 0xd)
_H2_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_H2_GOAWAY = (b"\x00\x00\x08\x07\x00\x00\x00\x00\x00" + (0).to_bytes(4, "big")
              + (0xD).to_bytes(4, "big"))


class Request:
    """One request on a connection and the ways to answer it: :meth:`respond` (whole), or
    :meth:`start` then :meth:`write` / :meth:`end` (chunked). ``on_close`` is called if the
    client goes away before the answer ended; ``on_pause`` / ``on_resume`` when the client's
    socket buffer fills / drains; ``on_done`` once when the request is over either way
    (answered, aborted or its client gone)."""

    # (no __slots__: the attributes most requests never set are class defaults, and an
    # instance is made faster without them; one is made per request)
    on_close: Callable[[], None] | None = None
    on_pause: Callable[[], None] | None = None
    on_resume: Callable[[], None] | None = None
    on_done: Callable[[], None] | None = None
    done = False
    started = False
    _head = b""  # a started answer's head not yet written (see start)
    #: a pattern route's captured path segment (``/engines/{name}``), decoded
    params: dict[str, str] | None = None

    def __init__(self, proto: HttpProtocol, method: bytes, path: bytes, query: bytes,
                 headers: list[tuple[bytes, bytes]], body: bytes, keep_alive: bool,
                 too_large: bool, t0: float) -> None:
        self.proto = proto
        self.method = method
        self.path = path
        #: the URL's query string, without the ``?`` (empty when there is none)
        self.query = query
        #: names lower-cased, in the client's order: those the routes asked for
        #: (:attr:`Routes.headers`)
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        #: the body was over the cap (read and dropped)
        self.too_large = too_large
        #: ``time.perf_counter()`` when the request began to arrive (0 unless the routes
        #: are :attr:`Routes.timed`)
        self.t0 = t0

    @property
    def closed(self) -> bool:
        return self.proto.transport is None

    @property
    def streaming(self) -> bool:
        return self.started

    def header(self, name: bytes) -> bytes | None:
        """The first value of the (lower-case) header ``name``, or None."""
        for k, v in self.headers:
            if k == name:
                return v
        return None

    @property
    def dp_rank(self) -> bytes | None:
        """vLLM's ``X-data-parallel-rank`` header as sent (a router's choice of DP rank;
        the last one, if it came twice)."""
        for k, v in reversed(self.headers):
            if k == b"x-data-parallel-rank":
                return v
        return None

    def args(self) -> dict[str, str]:
        """The query string's arguments, percent-decoded (the last of a repeated one)."""
        return dict(parse_qsl(self.query.decode("latin-1"), keep_blank_values=True))

    def _conn_header(self) -> bytes:
        if self.keep_alive and not self.proto.server.draining:
            return b""
        return b"connection: close\r\n"

    def respond(self, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = (),
                ctype: bytes | None = JSON) -> None:
        """The whole answer at once (``content-type``: ``ctype`` unless None)."""
        if self.done:
            return
        t = self.proto.transport
        if t is not None:
            head = _HEADS.get((status, ctype)) if not headers else None
            if head is None:
                head = b"".join((
                    status_line(status),
                    b"" if ctype is None else b"content-type: " + ctype + b"\r\n",
                    *[k + b": " + v + b"\r\n" for k, v in headers], b"content-length: "))
                if not headers and len(_HEADS) < 64:
                    _HEADS[(status, ctype)] = head
            conn = (b"" if self.keep_alive and not self.proto.server.draining
                    else b"connection: close\r\n")
            t.write(b"%s%d\r\n%s\r\n%s" % (head, len(body), conn,
                                            b"" if self.method == b"HEAD" else body))
        self._finish()

    def start(self, status: int, headers: Iterable[tuple[bytes, bytes]],
              hold: bool = False) -> None:
        """The head of a chunked answer (``headers`` as given). ``hold``: keep it to go
        out with the first chunk, in one socket write (the caller calls :meth:`flush`
        if that chunk is late)."""
        self.started = True
        self._head = b"".join((status_line(status),
                               *[k + b": " + v + b"\r\n" for k, v in headers],
                               b"transfer-encoding: chunked\r\n", self._conn_header(),
                               b"\r\n"))
        if not hold:
            self.flush()

    def start_stream(self, ctype: bytes = _SSE) -> None:
        """A 200 event stream (``cache-control: no-cache``); then :meth:`send` and :meth:`end`."""
        self.start(200, ((b"content-type", ctype), (b"cache-control", b"no-cache")))

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

    def send(self, data: bytes) -> None:
        """One chunk of a started answer."""
        t = self.proto.transport
        if t is not None and data:
            if self._head:
                self.flush()
            t.write(b"%x\r\n%s\r\n" % (len(data), data))

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
        if self.on_close is not None:
            self.on_close = None
        if self.on_pause is not None or self.on_resume is not None:
            self.on_pause = self.on_resume = None
        if self.on_done is not None:
            self.over()
        proto = self.proto
        if proto.server.draining:
            self.keep_alive = False  # the connection closes after this answer
        proto.order.finished(self, proto.transport)


Handler = Callable[[Request], Any]
#: an answer's head up to its content-length's value, per (status, content type)
_HEADS: dict[tuple[int, bytes | None], bytes] = {}


class Routes:
    """A route table: ``(method, path) -> handler(req)``, then paths any method may take
    (:meth:`claim`), then path patterns with one ``{name}`` segment, then ``fallback``. A
    handler answers on the request (now or later); a coroutine function runs as a task. An
    :class:`~kvwire.http1.HttpError` it raises is answered with the path's rendering;
    anything else is logged and answered 500.

    ``render(err) -> bytes``: the error body (OpenAI's shape or kvwire's, see
    :class:`~kvwire.http1.HttpError`); ``headers``: which request headers handlers read
    (None: none, True: all, or a set of lower-case names: the parser then skips the rest);
    ``timed``: stamp each request's arrival (``req.t0``); ``on_error(req, err)``: told of
    every error answer (counters); ``fail_started``:
    ``"end"`` ends, ``"abort"`` drops a started answer whose handler raised; ``on_lost``:
    called when a connection closes."""

    def __init__(self, render: Callable[[HttpError], bytes] | None = None,
                 headers: bool | Iterable[bytes] | None = None,
                 fallback: Handler | None = None, fail_started: str = "abort") -> None:
        self.exact: dict[tuple[bytes, bytes], Handler] = {}
        self.paths: set[bytes] = set()
        self.anymethod: dict[bytes, Handler] = {}
        self.patterns: list[tuple[bytes, bytes, str, Handler]] = []
        #: claimed paths with their own rendering and body cap: path -> (render, cap), and
        #: the same for prefixes
        self.own: dict[bytes, tuple[Callable[[HttpError], bytes] | None,
                                    Callable[[], int] | None]] = {}
        self.own_prefixes: list[tuple[bytes, tuple[Callable[[HttpError], bytes] | None,
                                                   Callable[[], int] | None]]] = []
        self.render = render or HttpError.kvwire
        self.headers: bool | frozenset[bytes] | None = (
            headers if headers is None or isinstance(headers, bool)
            else frozenset(h.lower() for h in headers))
        self.fallback = fallback
        self.fail_started = fail_started
        self.on_error: Callable[[Request, HttpError], None] | None = None
        self.on_lost: Callable[[], None] | None = None
        self.timed = False
        self.capped = False  # some path has its own body cap

    def add(self, method: str | bytes, path: str | bytes, handler: Handler) -> None:
        """``handler`` for ``method path``; a path ending in a ``{name}`` segment matches any
        one segment there (in ``req.params``). (No HEAD for a GET unless added: the
        framework kvwire serve ran on before answered HEAD 405.)"""
        m = method.encode() if isinstance(method, str) else method
        p = path.encode() if isinstance(path, str) else path
        h = _wrap(handler)
        if p.endswith(b"}"):
            head, _, name = p.rpartition(b"/")
            self.patterns.append((m, head + b"/", name.strip(b"{}").decode(), h))
            return
        self.exact[(m, p)] = h
        self.paths.add(p)

    def route(self, method: str, path: str) -> Callable[[Handler], Handler]:
        """Decorator form of :meth:`add`."""
        def deco(fn: Handler) -> Handler:
            self.add(method, path, fn)
            return fn
        return deco

    def claim(self, paths: Iterable[bytes], handler: Handler, prefix: bytes | None = None,
              render: Callable[[HttpError], bytes] | None = None,
              cap: Callable[[], int] | None = None) -> None:
        """``paths`` (and every path under ``prefix``), any method, to ``handler``, which
        answers their methods itself; their errors rendered by ``render``; their bodies
        capped at ``cap()`` (a body over it is the handler's to answer: ``req.too_large``)."""
        h = _wrap(handler)
        self.capped = self.capped or cap is not None
        for p in paths:
            self.anymethod[p] = h
            if render is not None or cap is not None:
                self.own[p] = (render, cap)
        if prefix is not None:
            self.patterns.append((b"*", prefix, "", h))
            self.own_prefixes.append((prefix, (render, cap)))

    def _own(self, path: bytes) -> tuple | None:
        o = self.own.get(path)
        if o is not None:
            return o
        for p, o in self.own_prefixes:
            if path.startswith(p):
                return o
        return None

    def cap(self, path: bytes) -> int:
        o = self._own(path)
        return MAX_BODY if o is None or o[1] is None else o[1]()

    def renderer(self, path: bytes) -> Callable[[HttpError], bytes]:
        o = self._own(path)
        return self.render if o is None or o[0] is None else o[0]

    def find(self, req: Request) -> Handler:
        """The handler of ``req`` (raises HttpError 404/405 when there is none)."""
        path = req.path
        h = self.exact.get((req.method, path)) or self.anymethod.get(path)
        if h is not None:
            return h
        allowed = False
        for m, head, name, ph in self.patterns:
            if not path.startswith(head):
                continue
            if m == b"*":
                return ph
            if len(path) > len(head) and b"/" not in path[len(head):]:
                if m == req.method:
                    req.params = {name: unquote(path[len(head):].decode("latin-1"))}
                    return ph
                allowed = True
        if self.fallback is not None:
            return self.fallback
        what = f"{req.method.decode('latin-1')} {unquote(path.decode('latin-1'))}"
        if allowed or path in self.paths:
            raise HttpError(405, f"Method Not Allowed: {what}", "http_405",
                            type="MethodNotAllowed")
        raise HttpError(404, f"Not Found: {what}", "http_404", type="NotFoundError")

    def fail(self, req: Request, e: HttpError) -> None:
        """Answer ``e`` on ``req`` (rendered for its path), telling ``on_error``."""
        if self.on_error is not None:
            self.on_error(req, e)
        if not req.done:
            req.respond(e.status, self.renderer(req.path)(e), e.headers)

    def __call__(self, req: Request) -> None:
        try:
            if req.too_large and (self._own(req.path) or (None, None))[1] is None:
                raise HttpError(413, TOO_LARGE.decode(), "too_large", param="body")
            self.find(req)(req)
        except HttpError as e:
            self.fail(req, e)
        except Exception:
            self.crashed(req)

    def crashed(self, req: Request) -> None:
        log.exception("handler failed for %s %s", req.method, req.path)
        if req.done:
            return
        if req.started:
            if self.fail_started == "end":
                req.end()
            else:
                req.abort()
        else:
            self.fail(req, HttpError(500, "internal error", "internal",
                                     type="InternalServerError"))


def _wrap(handler: Handler) -> Handler:
    """A coroutine function's handler as one that starts its task (errors answered)."""
    if not inspect.iscoroutinefunction(handler):
        return handler

    def start(req: Request) -> None:
        req.proto.server.loop.create_task(_run_async(handler, req))

    return start


async def _run_async(handler: Handler, req: Request) -> None:
    routes = req.proto.server.routes
    try:
        await handler(req)
    except HttpError as e:
        routes.fail(req, e)
    except Exception:
        routes.crashed(req)
    if not req.done:  # the handler returned without finishing its answer
        if req.started:
            req.end()
        else:
            routes.fail(req, HttpError(500, "no response", "internal",
                                       type="InternalServerError"))


class HttpProtocol(asyncio.Protocol):
    """One connection: parse requests, hand each to the routes, one at a time in order."""

    __slots__ = ("server", "routes", "transport", "parser", "_url", "_headers", "_body",
                 "_size", "_cap", "_too_large", "_t0", "order", "_paused", "_want",
                 "on_header", "on_headers_complete", "_fresh")

    def __init__(self, server: Server) -> None:
        self.server = server
        self.routes = routes = server.routes
        self.transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []  # (shared when none are kept)
        self._body: list[bytes] = []
        self._size = 0
        self._cap = MAX_BODY
        self._too_large = False
        self._t0 = 0.0
        self.order = InOrder(routes)
        self._paused = False
        self._fresh = True  # nothing read yet: an HTTP/2 preface is still possible
        # httptools calls on_header only when the object has it: a server whose handlers
        # read no header (the indexer) pays nothing per header
        want = routes.headers
        if want is True:
            self.on_header = self._all_headers
        elif want:
            self._want = want
            self.on_header = self._some_headers
        if routes.capped:  # a path's own cap: known once its URL is
            self.on_headers_complete = self._pick_cap
        self.parser = httptools.HttpRequestParser(self)

    # asyncio
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server.conns.discard(self)
        cur = self.order.current
        self.order.lost()  # (its on_close first: the owner abandons the answer)
        if cur is not None:
            cur.over()
        if self.routes.on_lost is not None:
            self.routes.on_lost()

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
        if self._fresh:
            self._fresh = False
            if data.startswith(_H2_PREFACE[:len(data)]) and data[:3] == b"PRI":
                self._refuse_h2()
                return
        bad = feed(self.parser, data)
        if bad is not None:  # (a body over the cap is read on and answered 413)
            status, msg = bad
            path = self._url.split(b"?", 1)[0]
            refuse(self.transport, status, self.routes.renderer(path)(
                HttpError(status, msg.decode("latin-1"), "bad_http")))

    def _refuse_h2(self) -> None:
        """A client that opens with HTTP/2's preface (SGLang's router probes workers so)
        gets HTTP/2's own answer, an empty SETTINGS and a GOAWAY saying HTTP/1.1 is
        required, and the connection closes: it falls back to HTTP/1.1, and nothing here
        takes the preface for a bad request."""
        t = self.transport
        if t is not None:
            t.write(_H2_SETTINGS + _H2_GOAWAY)
            t.close()

    # httptools
    def on_message_begin(self) -> None:
        routes = self.routes
        if routes.timed:
            self._t0 = time.perf_counter()
        self._url = b""
        if routes.headers:
            self._headers = []
        self._body = []
        self._size = 0
        self._too_large = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def _all_headers(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def _some_headers(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in self._want:
            self._headers.append((name, value))

    def _pick_cap(self) -> None:
        self._cap = self.routes.cap(self._url.split(b"?", 1)[0])

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
        b = self._body
        self.order.add(Request(self, p.get_method(), path, query, self._headers,
                               b[0] if len(b) == 1 else b"".join(b),
                               p.should_keep_alive(), self._too_large, self._t0))



class Server:
    """The routes on listening sockets: :meth:`run` (blocking, with signals) or
    :meth:`start` (on a running loop).

    ``drain_timeout`` > 0: the first SIGINT/SIGTERM drains instead of stopping: the socket
    stops accepting, idle connections close, and the requests in flight (streams included)
    run to their end for up to ``drain_timeout`` seconds, each connection closing after
    its answer; what is left then is cut. A second signal, or ``should_exit``, stops at
    once. A rolling restart behind a load balancer then loses no answer already streaming.
    ``on_start``: called on the serving loop once it listens, before the first request (what
    should run on that loop: the proxy's health probes); ``on_stop``: called on it as the
    server stops (closing the proxy's pools)."""

    def __init__(self, routes: Routes, drain_timeout: float = 0.0,
                 on_stop: Callable[[], None] | None = None,
                 on_start: Callable[[], None] | None = None) -> None:
        self.routes = routes
        self.drain_timeout = float(drain_timeout)
        self.on_start = on_start
        self.on_stop = on_stop
        self.should_exit = False
        self.draining = False
        self.started = False
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.conns: set[HttpProtocol] = set()
        self.servers: list[asyncio.AbstractServer] = []
        self._drain_until: float | None = None

    def protocol(self) -> HttpProtocol:
        return HttpProtocol(self)

    async def start(self, sockets: list[socket.socket] = (), host: str | None = None,
                    port: int = 0, **kw: Any) -> list[asyncio.AbstractServer]:
        """Listen on ``sockets`` (bound) or ``host:port`` (port 0: any free one)."""
        self.loop = loop = asyncio.get_running_loop()
        kw.setdefault("backlog", 2048)
        if host is not None:
            self.servers.append(await loop.create_server(self.protocol, host, port, **kw))
        for s in sockets:
            self.servers.append(await loop.create_server(self.protocol, sock=s, **kw))
        return self.servers

    @property
    def port(self) -> int:
        return self.servers[0].sockets[0].getsockname()[1]

    def run(self, sockets: list[socket.socket]) -> None:
        """Serve until ``should_exit`` (or SIGINT/SIGTERM in the main thread); on uvloop if
        installed."""
        run_loop(self.serve(sockets))

    async def serve(self, sockets: list[socket.socket]) -> None:
        servers = await self.start(sockets)
        loop = self.loop
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._exit)
        try:
            if self.on_start is not None:
                self.on_start()
            self.started = True
            while not self.should_exit:
                if self.draining and self._drained(servers):
                    break
                await asyncio.sleep(0.1)
        finally:
            self.close(connections=True)
            if self.on_stop is not None:
                self.on_stop()
            await asyncio.sleep(0)

    def close(self, connections: bool = False) -> None:
        """Stop listening; with ``connections``, close every connection too."""
        for s in self.servers:
            s.close()
        if not connections:
            return
        for c in list(self.conns):
            if c.transport is not None:
                c.transport.close()

    def _exit(self) -> None:
        if self.draining or self.drain_timeout <= 0:
            self.should_exit = True
        else:
            self.draining = True

    def _busy(self) -> int:
        return sum(1 for c in self.conns if c.order.current is not None)

    def _drained(self, servers: list[asyncio.AbstractServer]) -> bool:
        """One look while draining: True once nothing is in flight or the time is up."""
        now = time.monotonic()
        if self._drain_until is None:  # the drain begins
            self._drain_until = now + self.drain_timeout
            for s in servers:
                s.close()  # new connections are refused: a load balancer goes elsewhere
            for c in list(self.conns):
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


async def serve(routes: Routes, host: str, port: int, **kw: Any) -> Server:
    """``routes`` on host:port (port 0: any free one), on the running loop."""
    server = Server(routes)
    await server.start(host=host, port=port, **kw)
    server.started = True
    return server


def event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when installed (``kvwire[fast]``), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_loop(main: Any) -> Any:
    """Run the coroutine ``main`` to its end on a new :func:`event_loop`."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port, address reused (``port`` 0: any free one).
    Listening already, so that a client told the address as soon as this returns is queued
    until the server takes it, not refused (the server sets its own backlog later)."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1024)
    return s


def serve_in_thread(routes: Routes, host: str = "127.0.0.1", port: int = 0,
                    timeout: float = 10.0, server: Server | None = None,
                    name: str = "kvwire-http") -> tuple[Server, threading.Thread, int]:
    """Serve ``routes`` in a daemon thread (tests, docs, embedding): ``(server, thread,
    port)``; stop with ``server.should_exit = True; thread.join()``."""
    sock = listen(host, port)
    port = sock.getsockname()[1]
    server = server if server is not None else Server(routes)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=name,
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.01)
    return server, thread, port
