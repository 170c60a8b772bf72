"""kvwire's one HTTP/1.1 stack: the server (:mod:`kvwire.http1.server`, under the engine, the
router, the indexer and ``listen --metrics``) and the upstream client pool
(:mod:`kvwire.http1.client`). Here, what both use: status lines, the answer to bad HTTP
(:func:`feed`, :func:`refuse`), the body cap (:data:`MAX_BODY`), the order of requests on a
keep-alive connection (:class:`InOrder`) and the one error type (:class:`HttpError`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, Protocol

import httptools

from ..errors import HttpError

__all__ = ["MAX_BODY", "TOO_LARGE", "HttpError", "InOrder", "feed", "reason", "refuse",
           "status_line"]

log = logging.getLogger("kvwire.http1")

#: The largest request body a server keeps by default (the proxy has its own cap). A larger
#: body is read on and dropped, and the request answered 413 when it ends: closing at once
#: with the body still arriving would reset the connection, and the client might never
#: read its answer.
MAX_BODY = 64 << 20
#: The message of that 413.
TOO_LARGE = b"request body too large"






def reason(status: int) -> bytes:
    """The reason phrase of ``status`` (``Unknown`` for a code Python does not know)."""
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


_LINES = {s: b"HTTP/1.1 %d %s\r\n" % (s, reason(s))
          for s in (200, 201, 400, 404, 405, 409, 413, 422, 500, 502, 503, 504, 507)}


def status_line(status: int) -> bytes:
    """``HTTP/1.1 <status> <reason>\\r\\n``."""
    line = _LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d %s\r\n" % (status, reason(status))


def feed(parser: Any, data: bytes) -> tuple[int, bytes] | None:
    """Give ``data`` to an httptools parser (its callbacks run meanwhile). None, or for bad
    HTTP the answer it gets before the connection closes: ``(status, message)``."""
    try:
        parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        return 400, b"upgrade not supported"
    except httptools.HttpParserError as e:
        return 400, str(e).encode()
    return None


def refuse(transport: Any, status: int, body: bytes) -> None:
    """Answer ``status`` with a JSON ``body`` and close: after bad HTTP the rest of the
    connection's bytes cannot be trusted to frame requests."""
    if transport is None:
        return
    transport.write(status_line(status) + b"content-type: application/json\r\n"
                    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
    transport.close()


class _Request(Protocol):
    keep_alive: bool
    on_close: Callable[[], None] | None


class InOrder:
    """The requests of one connection, answered one at a time in the order they came
    (keep-alive and pipelining): :meth:`add` runs a request at once if none is being
    answered, else queues it; :meth:`finished` (the answer ended) closes a connection that
    asked for it or runs the next; :meth:`lost` (the client went away) tells the request
    being answered through its ``on_close`` and forgets the rest."""

    __slots__ = ("current", "queue", "run")

    def __init__(self, run: Callable[[Any], None]) -> None:
        self.run = run
        self.current: Any = None
        self.queue: deque[Any] = deque()

    def add(self, req: _Request) -> None:
        if self.current is None:
            self.current = req
            self.run(req)
        else:
            self.queue.append(req)

    def finished(self, req: _Request, transport: Any) -> None:
        if req is not self.current:
            return
        self.current = None
        if not req.keep_alive:
            if transport is not None:
                transport.close()
            return
        if self.queue:
            self.add(self.queue.popleft())

    def lost(self) -> None:
        cur, self.current = self.current, None
        self.queue.clear()
        if cur is not None and cur.on_close is not None:
            cb, cur.on_close = cur.on_close, None
            try:
                cb()
            except Exception:
                log.exception("on_close failed")
