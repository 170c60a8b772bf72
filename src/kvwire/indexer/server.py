"""The lean HTTP face of the RFC #1403 indexer (``kvwire index``), on one core or several.

The indexer's logic is a pure ``handle(method, path, body) -> (status, body)``
(:mod:`kvwire.indexer.indexer`); this module only carries requests to it, as fast as Python
allows: kvwire's one HTTP server (:mod:`kvwire.http1.server`) answers each request in its
own callback with one write (no task per request), on uvloop when it is installed;
the worker's ingest runs on the same loop (:mod:`kvwire.indexer.ingest`). A static
2,048-token ``/query`` costs 24-46 us of CPU in all, kernel included (docs/benchmarks.md).

**Several workers, one index (docs/indexer-api.md).** ``--workers N`` runs N processes; the parent
listens and hands each connection to the worker with the fewest open ones
(:mod:`kvwire.indexer.handout`: evenly, not by the kernel's hash). Each holds an exact
replica of the index: it follows every registered stream itself, and the per-stream state
machine makes replicas equal at each applied sequence number. What must not diverge is the
set of registrations, so ``/register`` and ``/unregister`` go through the parent, which is
the sequencer: it sends each one to every worker in one total order (the same on every
worker), and the worker that received it answers only when all workers have applied it. So a
client that got its ``/register`` answer finds the stream registered on whatever worker its
next connection lands on; reads (``/query``, ``/dump``) never leave their worker.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from ..http1 import HttpError
from ..http1.server import Request, Routes, Server
from ..http1.server import event_loop as _event_loop
from ..http1.server import listen as listen_socket

__all__ = ["CONTROL_PATHS", "Handle", "IndexHttp", "Sequencer", "WorkerLink",
           "listen_socket", "run_workers", "serve_forever"]

log = logging.getLogger("kvwire.indexer.server")

#: ``handle(method, path, body) -> (status, JSON body)``: the indexer's whole HTTP contract.
Handle = Callable[[str, str, bytes], tuple[int, bytes]]
#: Requests that change the set of followed streams: sequenced through the parent.
CONTROL_PATHS = frozenset((b"/register", b"/unregister"))
#: How long a worker waits for all replicas to apply a control request before it answers 503.
CONTROL_TIMEOUT = 10.0
_METHODS: dict[bytes, str] = {}
_PATHS: dict[bytes, str] = {}


def _text(cache: dict[bytes, str], raw: bytes) -> str:
    s = cache.get(raw)
    if s is None:
        s = raw.decode("latin-1")
        if len(cache) < 256:  # method and path names are few; a scan of random paths is not
            cache[raw] = s
    return s


class IndexHttp(Routes):
    """The indexer's routes on the one HTTP server: every request goes to ``handle``, which
    routes it (no header is read: the parser skips them); control requests go through
    ``link`` (a :class:`WorkerLink`) when there are several workers, and are answered when
    every worker has applied them (pipelined requests behind one wait for its answer)."""

    def __init__(self, handle: Handle, link: WorkerLink | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        super().__init__(render=HttpError.kvwire, headers=None)
        self.handle = handle
        self.link = link
        self.requests = 0
        #: called when a connection closes (a worker tells the parent's handout)
        self.on_lost = on_close

    def __call__(self, req: Request) -> None:
        """(The table has one route: straight to it, in one call on the hot path.)"""
        if req.too_large:
            self.fail(req, HttpError(413, "request body too large", "too_large"))
            return
        path, method = req.path, req.method
        try:
            if self.link is not None and path in CONTROL_PATHS and method == b"POST":
                self.requests += 1
                self.link.submit(req)
                return
            self.requests += 1
            query = req.query
            text = _text(_PATHS, path) if not query else (path + b"?" + query).decode("latin-1")
            status, out = self.handle(_text(_METHODS, method), text, req.body)
        except Exception:  # handle never raises; if it does, this request gets a 500
            self.crashed(req)
            return
        req.respond(status, out)


def _error(status: int, message: str) -> bytes:
    return b'{"error":"%s"}' % message.replace('"', "'").encode()


class WorkerLink:
    """A worker's end of the control pipe: submits control requests to the parent, applies
    every control request the parent sends (its own included) in the parent's order, and
    answers its own when the parent says every worker has applied it."""

    def __init__(self, conn: Connection, handle: Handle, worker: int) -> None:
        self.conn = conn
        self.handle = handle
        self.worker = worker
        self._next = 0
        self._waiting: dict[int, tuple[Request, tuple[int, bytes] | None, float]] = {}
        self.applied = 0
        self.timeouts = 0

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(self.conn.fileno(), self._readable)

    def submit(self, conn: Request) -> None:
        self._next += 1
        op = self._next
        self._waiting[op] = (conn, None, time.monotonic() + CONTROL_TIMEOUT)
        path = conn.path + b"?" + conn.query if conn.query else conn.path
        self.conn.send(("submit", op, conn.method.decode(), path.decode("latin-1"), conn.body))
        asyncio.get_running_loop().call_later(CONTROL_TIMEOUT, self._expire, op)

    def _expire(self, op: int) -> None:
        w = self._waiting.pop(op, None)
        if w is not None:
            self.timeouts += 1
            w[0].respond(503, _error(503, "not every indexer worker applied this request "
                                          f"within {CONTROL_TIMEOUT:g} s; it may still apply"))

    def _readable(self) -> None:
        while self.conn.poll():
            try:
                msg = self.conn.recv()
            except EOFError:  # the parent is gone: so is the service
                log.error("indexer worker %d: the parent closed the control pipe", self.worker)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            kind = msg[0]
            if kind == "apply":
                _, origin, op, method, path, body = msg
                result = self.handle(method, path, body)
                self.applied += 1
                if origin == self.worker and op in self._waiting:
                    c, _, dl = self._waiting[op]
                    self._waiting[op] = (c, result, dl)
                self.conn.send(("applied", origin, op))
            elif kind == "done":
                _, op = msg
                w = self._waiting.pop(op, None)
                if w is not None and w[1] is not None:
                    w[0].respond(*w[1])


class Sequencer:
    """The parent's part: one total order of control requests over all workers. Pure
    bookkeeping over the pipes (``step`` does one message), so it can be tested alone."""

    def __init__(self, conns: list[Connection]) -> None:
        self.conns = conns
        self._acks: dict[tuple[int, int], int] = {}
        self.sequenced = 0

    def step(self, w: int, msg: tuple) -> None:
        kind = msg[0]
        if kind == "submit":
            _, op, method, path, body = msg
            self._acks[(w, op)] = len(self.conns)
            self.sequenced += 1
            for c in self.conns:
                c.send(("apply", w, op, method, path, body))
        elif kind == "applied":
            _, origin, op = msg
            key = (origin, op)
            left = self._acks.get(key)
            if left is None:
                return
            if left > 1:
                self._acks[key] = left - 1
            else:
                del self._acks[key]
                self.conns[origin].send(("done", op))


def serve_forever(handle: Handle, sock: socket.socket | None, *,
                  link_conn: Connection | None = None, worker: int = 0,
                  ready: Callable[[], None] | None = None,
                  handout: socket.socket | None = None) -> None:
    """Serve ``handle`` until SIGINT/SIGTERM (one worker's life): the connections accepted on
    the bound ``sock``, or those the parent hands over ``handout`` (its Unix socket pair:
    :class:`~kvwire.indexer.handout.Intake`)."""
    loop = _event_loop()
    asyncio.set_event_loop(loop)
    link = WorkerLink(link_conn, handle, worker) if link_conn is not None else None
    app = IndexHttp(handle, link)
    server = Server(app)
    intake = None
    if handout is not None:
        from .handout import Intake

        intake = Intake(handout, server.protocol)
        app.on_lost = intake.closed
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def main() -> None:
        # what exists now (the index's tables, modules) lives as long as the process: out of
        # the collector's sight, so a full collection between requests stays short (p99)
        gc.freeze()
        if sock is not None:
            sock.setblocking(False)
        await server.start([sock] if sock is not None else [], backlog=1024)
        # an indexer that ingests on this loop (Indexer.standalone(on_loop=True), as
        # kvwire index makes it) starts doing so
        attach = getattr(getattr(handle, "__self__", None), "attach", None)
        if callable(attach):
            attach(loop)
        if link is not None:
            link.attach(loop)
        if intake is not None:
            intake.attach(loop)
        if ready is not None:
            ready()
        await stop.wait()
        server.close()

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def _worker_main(factory: Callable[[int], Handle], handout: socket.socket, conn: Connection,
                 worker: int, level: int) -> None:
    logging.basicConfig(level=level, format=f"%(asctime)s w{worker} %(name)s %(message)s")
    handle = factory(worker)
    serve_forever(handle, None, link_conn=conn, worker=worker, handout=handout,
                  ready=lambda: conn.send(("ready", worker)))
    closer = getattr(handle, "close", None) or getattr(getattr(handle, "__self__", None),
                                                       "close", None)
    if callable(closer):
        closer()


def run_workers(factory: Callable[[int], Handle], host: str, port: int, workers: int, *,
                on_ready: Callable[[int], None] | None = None,
                start_timeout: float = 60.0) -> int:
    """Run ``workers`` processes serving ``factory()``'s handle on one port, with this
    process as their control sequencer and the one that accepts connections and hands them
    out evenly (:mod:`kvwire.indexer.handout`); returns when one of them exits (then
    stops the rest) or on SIGINT/SIGTERM. ``factory(worker)`` must be picklable (a
    module-level callable or a ``functools.partial`` of one): each worker builds its own
    replica. Returns an exit status."""
    from .handout import Handout

    listener = listen_socket(host, port)
    listener.listen(1024)  # connections wait in the queue until every worker is ready
    port = listener.getsockname()[1]
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(workers)]
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(workers)]
    handout = Handout(listener, [ours for ours, _ in pairs])
    level = logging.getLogger().getEffectiveLevel()
    procs = [ctx.Process(target=_worker_main, name=f"kvwire-index-w{i}", daemon=True,
                         args=(factory, pairs[i][1], pipes[i][1], i, level))
             for i in range(workers)]
    stopping = []
    prev = {s: signal.signal(s, lambda *_: stopping.append(1))
            for s in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        for p in procs:
            p.start()
        for _, child in pipes:
            child.close()
        for _, theirs in pairs:
            theirs.close()
        conns = [parent for parent, _ in pipes]
        seq = Sequencer(conns)
        ready: set[int] = set()
        deadline = time.monotonic() + start_timeout
        links = {s: w for w, s in enumerate(handout.links)}
        while not stopping:
            readable = wait([*conns, *(p.sentinel for p in procs), *links,
                             *((listener,) if len(ready) == workers else ())], timeout=0.5)
            if stopping:  # a terminal's Ctrl-C reaches the workers too: not a failure
                break
            dead = [p for p in procs if p.exitcode is not None]
            if dead:
                log.error("indexer worker %s exited (%s): stopping the others",
                          dead[0].name, dead[0].exitcode)
                status = 1
                break
            for r in readable:
                if r is listener:
                    handout.accept()
                    continue
                if r in links:
                    handout.closed(links[r])
                    continue
                if not isinstance(r, Connection):
                    continue
                w = conns.index(r)
                try:
                    msg = r.recv()
                except EOFError:
                    continue
                if msg[0] == "ready":
                    ready.add(w)
                    if len(ready) == workers and on_ready is not None:
                        on_ready(port)
                else:
                    seq.step(w, msg)
            if len(ready) < workers and time.monotonic() > deadline:
                log.error("indexer workers did not start within %g s", start_timeout)
                status = 1
                break
    finally:
        for p in procs:
            if p.exitcode is None and p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            p.join(5)
            if p.exitcode is None:
                p.kill()
                p.join()
        for s, h in prev.items():
            signal.signal(s, h)
        listener.close()
        for ours, _ in pairs:
            ours.close()
    return status


def describe_loop() -> str:
    """``uvloop`` or ``asyncio``: which event loop the workers run (for the startup line)."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"

