"""An engine's answer back to the client: a started stream relayed chunk by chunk
(:class:`Relay`), or a whole answer (:func:`answer`); on the way, what the proxy reads in
passing: the first token (the prefill share of the load is dropped), the ``usage`` counts,
a created response's id. Each ends by releasing the request's load (:func:`settle`).

The hot path costs nothing per streamed chunk beyond the bytes: the engine's connection
pushes each read's chunks to the :class:`Relay`, which writes them to the client as one HTTP
chunk in one socket write (chunks that arrived together leave together; the read that ends
the answer leaves with the end, and the first with the held head), pauses the engine's
connection while the client's buffer is full, and arms one timer per stream (the late
head, then the stall timeout, re-armed only when it fires). Socket writes are most of a
stream's cost on loopback (each wakes the reader), so a stream whose answer came in one
read after the head costs one write to the client.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from ..http1.client import Response, UpstreamError
from ..routing.core import RouterCore
from .decisions import Lifecycle
from .fleet import Fleet, Link
from .responses import SCAN_LIMIT

if TYPE_CHECKING:
    from ..http1.server import Request

__all__ = ["COMPLETION_TOKENS", "HEAD_HOLD", "Relay", "answer", "first_token",
           "openai_error", "settle"]

_enc = msgspec.json.Encoder()
COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
#: A stream's head waits this long (s) for the first chunk, to leave in the same write: a
#: socket write saved per stream; an engine slower to its first token than this sends the
#: head alone (the client's time to the first event is not changed either way).
HEAD_HOLD = 0.02


def openai_error(status: int, message: str, type_: str = "BadRequestError",
                 param: str | None = None) -> bytes:
    """OpenAI's (and vLLM's) error object."""
    return _enc.encode({"error": {"message": message, "type": type_, "param": param,
                                  "code": status}})


def first_token(core: RouterCore, lc: Lifecycle) -> None:
    """The answer's first bytes arrived: the prompt is computed, its prefill share of the
    reserved load is dropped (once)."""
    drop = lc.first_token()
    if drop:
        core.first_token(lc.request_id, drop)


def settle(core: RouterCore, fleet: Fleet, lc: Lifecycle, engine: str,
           out_tokens: int | None) -> None:
    """Release the reservation and the in-flight count, once (``Lifecycle.end``): before
    the last byte goes to the client where possible, so a client that saw its answer
    end never sees the load still held."""
    if lc.end():
        core.finish(lc.request_id, out_tokens)
        fleet.settled(engine)


def answer(core: RouterCore, fleet: Fleet, req: Request, lc: Lifecycle, link: Link,
           status: int, payload: bytes, headers: list[tuple[bytes, bytes]],
           ctype: bytes) -> None:
    """A whole answer (read already) to the client, its load released first."""
    name = link.name
    first_token(core, lc)
    m = COMPLETION_TOKENS.search(payload)
    out_tokens = int(m.group(1)) if m else None
    if m:
        fleet.count_usage(name, payload, payload.rfind(b'"usage"'))
    fleet.requests[name, status] += 1
    link.e2e.observe(time.perf_counter() - req.t0)
    settle(core, fleet, lc, name, out_tokens)  # before the client can see the answer
    req.respond(status, payload, headers, ctype)


class Relay:
    """A started stream: the engine's chunks to the client as they come (a
    :class:`~kvwire.http1.client.Sink`). The first drops the prefill share; an engine
    failing or going silent mid-stream becomes an SSE error event and a clean end. From
    its start the relay owns the request's end: the request's task has returned (no
    await and no wake-up per stream for its end), so the relay settles the load, and a
    client that goes away (``on_close``) closes the engine's connection (it aborts)."""

    __slots__ = ("core", "fleet", "stall", "req", "resp", "lc", "link", "finished", "events",
                 "usage", "last_usage", "first", "paused", "timer", "loop", "since", "learn",
                 "tail", "on_first")

    def __init__(self, core: RouterCore, fleet: Fleet, stall: float, req: Request,
                 resp: Response, lc: Lifecycle, link: Link, loop: asyncio.AbstractEventLoop,
                 learn: bool = False, on_first: Callable[[], None] | None = None) -> None:
        #: told of the first chunk (a prefill/decode pair's decode first-token time)
        self.on_first = on_first
        #: bytes of a response-creating stream still to look through for its id (0: none)
        self.learn = SCAN_LIMIT if learn else 0
        self.tail = b""  # the end of the last read, for an id split between two reads
        self.core, self.fleet, self.stall = core, fleet, stall
        self.req, self.resp, self.lc, self.link = req, resp, lc, link
        self.loop = loop
        self.finished = False
        self.events = 0
        self.usage: int | None = None
        self.last_usage = b""
        self.first = True
        self.paused = False
        self.since = loop.time()
        self.timer: asyncio.TimerHandle | None = None
        req.on_pause = self.pause
        req.on_resume = self.resume
        req.on_close = self.gone
        resp.relay(self)
        if not self.finished:
            # one timer per stream: first at HEAD_HOLD to send a head still held (no chunk
            # came with it), then as the stall check
            self.timer = loop.call_later(min(HEAD_HOLD, stall) if self.first else stall,
                                         self._stall_check)

    def _see(self, chunks: list[bytes]) -> bytes:
        """What one read held, as one piece, and what the proxy reads in it in passing:
        the first chunk (prefill done), SSE events and the last ``usage``."""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if self.first:
            self.first = False
            first_token(self.core, self.lc)
            self.link.ttft.observe(time.perf_counter() - self.req.t0)
            if self.on_first is not None:
                self.on_first()
        self.events += data.count(b"data: {")
        if self.learn:
            seen = self.tail + data
            if self.fleet.owners.learn_from(seen, self.link.name):
                self.learn = 0
            else:
                self.learn = max(0, self.learn - len(data))
                self.tail = seen[-300:]
        at = data.rfind(b'"completion_tokens"')
        if at >= 0:
            m = COMPLETION_TOKENS.match(data, at)
            if m:
                self.usage = int(m.group(1))
                self.last_usage = data  # cumulative: only the last one is counted
        return data

    def on_chunks(self, chunks: list[bytes]) -> None:
        # one read from the engine: one chunk to the client (the engine's SSE events pass
        # unchanged; only the HTTP chunk framing, which is per hop, is the proxy's own)
        self.req.write((self._see(chunks),))

    def _settle(self) -> None:
        name = self.link.name
        if self.last_usage:
            self.fleet.count_usage(name, self.last_usage, self.last_usage.rfind(b'"usage"'))
        self.link.e2e.observe(time.perf_counter() - self.req.t0)
        settle(self.core, self.fleet, self.lc, name,
               self.usage if self.usage is not None else self.events)

    def on_end(self, chunks: list[bytes]) -> None:
        if self.finished:
            return
        self.finished = True
        data = self._see(chunks) if chunks else b""
        self._settle()
        self.req.end(data)  # the last read's chunks and the end: one write
        self.stop()

    def gone(self) -> None:
        """The client went away mid-stream: the engine's connection closes (it aborts);
        the load is released without an output length (the answer was cut short)."""
        if self.finished:
            return
        self.finished = True
        self.fleet.counts["client_disconnects"] += 1
        self.stop()
        settle(self.core, self.fleet, self.lc, self.link.name, None)
        self.resp.close()

    def on_error(self, error: UpstreamError | None, why: str | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        self.fleet.counts["broken_streams"] += 1
        name = self.link.name
        msg = why or f"engine {name} failed mid-stream: {error}"
        err = openai_error(502, msg, "BadGateway")
        self._settle()
        self.req.end(b"data: " + err + b"\n\ndata: [DONE]\n\n")
        self.stop()
        self.resp.close()

    def _stall_check(self) -> None:
        self.req.flush()  # a head held for a first chunk that is late
        stall = self.stall
        now = self.loop.time()
        if self.paused:
            self.since = now
        idle = now - max(self.resp.last_read, self.since)
        if self.paused or idle < stall:  # a slow client is not a silent engine
            self.timer = self.loop.call_later(stall if self.paused else stall - idle,
                                              self._stall_check)
            return
        self.timer = None
        self.on_error(None, f"engine {self.link.name} sent nothing for {stall:g} s")  # closes

    def pause(self) -> None:
        """The client's buffer is full: stop reading from the engine."""
        self.paused = True
        self.resp.pause()

    def resume(self) -> None:
        self.paused = False
        self.since = self.loop.time()
        self.resp.resume()

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.resp.detach()
