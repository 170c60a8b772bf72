"""One proxied generation request, end to end: check, tokenize and route (through the
:class:`~kvwire.proxy.proxy.Proxy`), send to the chosen engine, retry on the next-best
one before the client got a byte, and pass the answer back on the client's
:class:`~kvwire.http1.server.Request`.

The hot path costs one task per request and nothing per streamed chunk beyond the bytes:
the engine's connection pushes each read's chunks to a :class:`_Relay`, which writes them
to the client as one HTTP chunk in one socket write (chunks that arrived together leave
together; the read that ends the answer leaves with the end, and the first with the held
head), pauses the engine's connection while the client's buffer is full, and arms one
timer per stream (the late head, then the stall timeout, re-armed only when it fires).
Socket writes are most of a stream's cost on loopback (each wakes the reader), so a stream
whose answer came in one read after the head costs one write to the client. A client that
goes away cancels the request's task, whose ``finally`` releases the load and closes the
engine's connection (the engine aborts).
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import msgspec

from ..http1 import HttpError
from ..http1.client import Response, UpstreamError
from ..routing.core import RouteError
from .decisions import Lifecycle, Outcome, marks_down, should_retry
from .responses import SCAN_LIMIT, addressed

if TYPE_CHECKING:
    from ..http1.server import Request
    from .proxy import Proxy, _Link

__all__ = ["PASS", "PATHS", "BadRequest", "handle", "openai_error"]

_enc = msgspec.json.Encoder()
#: Hop-by-hop and framing headers not forwarded (either way).
HOP = frozenset((b"host", b"content-length", b"connection", b"keep-alive",
                 b"transfer-encoding", b"te", b"trailer", b"upgrade", b"proxy-authorization",
                 b"proxy-connection", b"expect"))
COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
PATHS = {b"/v1/completions": False, b"/v1/chat/completions": True}
#: vLLM's other model endpoints a client of one vLLM server also calls: forwarded unchanged
#: to an engine that serves the body's ``model``, with the same retries, breaker, headers
#: and streaming as a generation request. Embeddings and (de)tokenize are routed by load
#: alone (their prompts are not tokenized); a ``/v1/responses`` that starts a conversation
#: by the cache, as the chat it renders to; one that names a ``previous_response_id``, and
#: ``/v1/responses/{id}...``, go to the engine that holds that response
#: (proxy/responses.py).
PASS = frozenset((b"/v1/embeddings", b"/v1/responses", b"/tokenize", b"/detokenize"))
RESPONSES = b"/v1/responses"
_NO_CACHE = (b"cache-control", b"no-cache")
#: A stream's head waits this long (s) for the first chunk, to leave in the same write: a
#: socket write saved per stream; an engine slower to its first token than this sends the
#: head alone (the client's time to the first event is not changed either way).
HEAD_HOLD = 0.02


def openai_error(status: int, message: str, type_: str = "BadRequestError",
                 param: str | None = None) -> bytes:
    """OpenAI's (and vLLM's) error object."""
    return _enc.encode({"error": {"message": message, "type": type_, "param": param,
                                  "code": status}})


#: The proxy's refusals are kvwire's one HTTP error, rendered OpenAI's way
#: (:meth:`~kvwire.http1.HttpError.openai`: ``param``, ``type``).
BadRequest = HttpError


def handle(proxy: Proxy, req: Request) -> None:
    """Answer ``req`` (a path :meth:`Proxy.handles`); called from the server's protocol."""
    path, method = req.path, req.method
    if path == b"/v1/models":
        if method != b"GET":
            req.respond(405, openai_error(405, "Method Not Allowed", "MethodNotAllowed"))
        else:
            req.respond(200, proxy._models())
        return
    rid = addressed(path)
    if rid == "":
        _bad(proxy, req, HttpError(404, f"no such path: {path.decode('latin-1')} (under "
                                        "/v1/responses/: {id}, {id}/cancel, {id}/input_items)",
                                   type="NotFoundError"))
        return
    if method != b"POST" and (rid is None or method not in (b"GET", b"DELETE")):
        req.respond(405, openai_error(405, "Method Not Allowed", "MethodNotAllowed"))
        return
    if req.too_large:
        _bad(proxy, req, HttpError(413, f"request body over {proxy.cfg.max_body} bytes",
                                   param="body"))
        return
    cap = proxy.cfg.max_in_flight
    if cap and proxy.active >= cap:  # refused whole, before any work: the client retries
        proxy.counts["overloaded"] += 1
        proxy.requests["none", 429] += 1
        req.respond(429, openai_error(429, f"kvwire serve has {proxy.active} requests in "
                                           f"flight, its limit (--max-in-flight); retry later",
                                      "RateLimitError"), [(b"retry-after", b"1")])
        return
    loop = req.proto.server.loop  # (asyncio.get_running_loop() costs a getpid() call)
    task = loop.create_task(_serve(proxy, req, PATHS.get(path), loop, rid))
    proxy.active += 1
    req.on_done = proxy.ended  # answered, aborted or abandoned: once

    def gone() -> None:  # the client left before the answer ended: abandon it
        proxy.counts["client_disconnects"] += 1
        task.cancel()

    req.on_close = gone


def _bad(proxy: Proxy, req: Request, e: HttpError) -> None:
    proxy.counts["bad_requests"] += 1
    proxy.requests["none", e.status] += 1
    req.respond(e.status, e.openai())


async def _serve(proxy: Proxy, req: Request, chat: bool | None,
                 loop: asyncio.AbstractEventLoop, rid: str | None = None) -> None:
    """``chat``: True for chat, False for completions, None for a :data:`PASS` path or,
    with ``rid``, a path naming a stored response (``/v1/responses/{rid}...``)."""
    # a request that creates a stored response (Responses API): its id is learned
    creates = rid is None and chat is None and req.path == RESPONSES
    try:
        if rid is not None:  # GET/DELETE have no body; cancel's is the engine's to read
            body: Any = proxy.no_body
            tokens: Any = ()
        elif chat is None:
            body = proxy._check_pass(req.body)
            tokens = (await proxy._response_tokens(body)
                      if creates and not body.previous_response_id else ())
        else:
            body = proxy._check(req.body, chat)
            tokens = await proxy._tokens(body, chat)
    except HttpError as e:
        _bad(proxy, req, e)
        return
    known = proxy._known_models()
    model = body.model
    lora = model if model is not None and known.get(model) else None
    headers = [h for h in req.headers if h[0] not in HOP]
    stream = bool(body.stream) if rid is None else _stream_query(req.query)
    tried: set[str] = set()
    last: tuple[int, bytes] | None = None
    last_engine = "none"
    cfg = proxy.cfg
    # a stored response lives on the engine that produced it: what names one goes there
    pin = rid if rid is not None else (body.previous_response_id if creates else None)
    plan: list[str] | None = None  # the engines to try, in order (None: routed)
    probe = False  # a 404 means "not on this engine": ask the next one
    if pin:
        owner = proxy.owners.get(pin)
        if owner is not None and owner in proxy.links:
            plan = [owner]
            proxy.counts["responses_pinned"] += 1
        else:  # not known here (restarted, or forgotten): ask each engine in turn (an
            # engine without it answers 404 before doing any work)
            plan, probe = list(proxy._names), True
            proxy.counts["responses_looked_up"] += 1
    for attempt in range(cfg.retries + 1 if plan is None else len(plan)):
        with proxy._lock:
            ok = {n for n, lk in proxy.links.items() if lk.breaker.up and n not in tried
                  and (model is None or not lk.model_ids or model in lk.model_ids)}
        if plan is not None:
            want = plan[attempt]
            if want not in ok:
                if not probe:
                    last = (503, openai_error(503, f"engine {want}, which holds response "
                                              f"{pin}, is down", "ServiceUnavailable"))
                continue
            ok = {want}
        try:
            routed = proxy.core.route_proxy(tokens, lora, body.cache_salt, ok.__contains__,
                                            proxy._up)
        except RouteError as e:
            if last is None:
                last = (e.status, openai_error(e.status, str(e), "ServiceUnavailable"))
            break
        tried.add(routed.engine)
        outcome, sent, last = await _attempt(proxy, req, routed, headers, stream,
                                             attempt == 0, loop, probe=probe,
                                             learn=creates, rid=rid)
        last_engine = routed.engine
        if marks_down(outcome):
            proxy.counts["upstream_failures"] += 1
            failed = proxy.links.get(routed.engine)  # (None: removed meanwhile)
            if failed is not None:
                with proxy._lock:
                    failed.breaker.failure(time.monotonic())
        if plan is not None:  # its engines only, each once
            if sent:
                return
            continue
        if not should_retry(outcome, attempt, cfg.retries, sent):
            if sent:
                return
            break
        proxy.retried[routed.engine, outcome.value] += 1
    if last is None and probe:  # no engine could be asked (all down)
        last = (503, openai_error(503, f"no engine is available to look for response {pin}",
                                  "ServiceUnavailable"))
    status, payload = last or (502, openai_error(502, "no engine answered", "BadGateway"))
    proxy.requests[last_engine, status] += 1
    req.respond(status, payload)


def _stream_query(query: bytes) -> bool:
    """``?stream=true`` (a stored response's events replayed as they come)."""
    if not query:
        return False
    v = parse_qs(query.decode("latin-1")).get("stream", [""])[-1]
    return v.lower() in ("true", "1")


async def _attempt(proxy: Proxy, req: Request, routed: Any, headers: list, stream: bool,
                   first: bool, loop: asyncio.AbstractEventLoop, *, probe: bool = False,
                   learn: bool = False, rid: str | None = None
                   ) -> tuple[Outcome, bool, tuple[int, bytes] | None]:
    """One try at one engine: (outcome, whether the client got bytes, the error to answer
    with if nothing was sent). The reservation ends here, on every path (a cancel lands
    in an await, and ``finally`` runs). ``probe``: a 404 is :attr:`Outcome.NOT_HERE`;
    ``learn``: the answer creates a response, whose id is remembered with this engine;
    ``rid``: the stored response the request names (found here unless 404)."""
    link = proxy.links[routed.engine]
    name = link.name
    cfg = proxy.cfg
    lc = Lifecycle(routed.request_id, routed.prefill)
    out_tokens: int | None = None
    if link.ranks > 1:
        headers = [*headers, (b"x-data-parallel-rank", str(routed.rank).encode())]
    resp: Response | None = None
    proxy.counts["attempts"] += 1
    proxy.in_flight[name] += 1
    sent_at: list[float] = []
    relayed = False
    try:
        try:
            resp = await proxy._pool(link).request(
                req.method, req.path + b"?" + req.query if req.query else req.path,
                headers, req.body, sent_at, time.perf_counter, cfg.first_byte_timeout)
        except asyncio.TimeoutError:
            return Outcome.TIMEOUT, False, (504, openai_error(
                504, f"engine {name} did not answer in {cfg.first_byte_timeout:g} s",
                "Timeout"))
        except UpstreamError as e:
            return Outcome.REFUSED, False, (502, openai_error(
                502, f"engine {name} unreachable: {e}", "BadGateway"))
        hdrs = [(b"x-kvwire-engine", link.name_b), (b"x-kvwire-rank", b"%d" % routed.rank)]
        ctype = resp.headers.get(b"content-type", b"application/json")
        if stream and resp.status == 200:
            if rid is not None:
                proxy.owners.learn(rid, name)
            req.start(200, [(b"content-type", ctype), _NO_CACHE, *hdrs], hold=True)
            proxy.requests[name, 200] += 1
            _Relay(proxy, req, resp, lc, link, loop, learn)  # it ends the stream: no await
            relayed = True
            return Outcome.OK, True, None
        try:
            payload = await resp.read(cfg.first_byte_timeout)
        except (asyncio.TimeoutError, UpstreamError) as e:
            return Outcome.TIMEOUT, False, (504, openai_error(
                504, f"engine {name} did not finish its answer: {e!r}", "Timeout"))
        if resp.status >= 500:
            return Outcome.SERVER_ERROR, False, (resp.status, payload)
        if probe and resp.status == 404:
            return Outcome.NOT_HERE, False, (404, payload)
        if learn and resp.status == 200:
            proxy.owners.learn_from(payload, name)
        elif rid is not None and resp.status < 400:
            if req.method == b"DELETE":
                proxy.owners.forget(rid)
            else:
                proxy.owners.learn(rid, name)
        proxy._first(lc)
        m = COMPLETION_TOKENS.search(payload)
        out_tokens = int(m.group(1)) if m else None
        if m:
            proxy._count_usage(name, payload, payload.rfind(b'"usage"'))
        proxy.requests[name, resp.status] += 1
        link.e2e.observe(time.perf_counter() - req.t0)
        _settle(proxy, lc, name, out_tokens)  # before the client can see the answer
        req.respond(resp.status, payload, hdrs, ctype)
        return Outcome.OK, True, None
    finally:
        if not relayed:  # (a relay settles and closes when its stream ends)
            _settle(proxy, lc, name, out_tokens)  # first: nothing below may skip it
            if resp is not None:
                resp.close()  # unfinished: the connection closes and the engine aborts
        if first and sent_at:
            proxy.metrics.overhead.observe(sent_at[0] - req.t0)


def _settle(proxy: Proxy, lc: Lifecycle, name: str, out_tokens: int | None) -> None:
    """Release the reservation and the in-flight count, once (``Lifecycle.end``): before
    the last byte goes to the client where possible, so a client that saw its answer
    end never sees the load still held."""
    if lc.end():
        proxy.core.finish(lc.request_id, out_tokens)
        proxy.in_flight[name] -= 1


class _Relay:
    """A started stream: the engine's chunks to the client as they come (a
    :class:`~kvwire.http1.client.Sink`). The first drops the prefill share; an engine
    failing or going silent mid-stream becomes an SSE error event and a clean end. From
    its start the relay owns the request's end: the request's task has returned (no
    await and no wake-up per stream for its end), so the relay settles the load, and a
    client that goes away (``on_close``) closes the engine's connection (it aborts)."""

    __slots__ = ("proxy", "req", "resp", "lc", "link", "finished", "events", "usage",
                 "last_usage", "first", "paused", "timer", "loop", "since", "learn", "tail")

    def __init__(self, proxy: Proxy, req: Request, resp: Response, lc: Lifecycle,
                 link: _Link, loop: asyncio.AbstractEventLoop, learn: bool = False) -> None:
        #: bytes of a response-creating stream still to look through for its id (0: none)
        self.learn = SCAN_LIMIT if learn else 0
        self.tail = b""  # the end of the last read, for an id split between two reads
        self.proxy, self.req, self.resp, self.lc, self.link = proxy, req, resp, lc, link
        self.loop = loop
        self.finished = False
        self.events = 0
        self.usage: int | None = None
        self.last_usage = b""
        self.first = True
        self.paused = False
        self.since = loop.time()
        self.timer: asyncio.TimerHandle | None = None
        req.on_pause = self._pause
        req.on_resume = self._resume
        req.on_close = self._gone
        resp.relay(self)
        if not self.finished:
            # one timer per stream: first at HEAD_HOLD to send a head still held (no chunk
            # came with it), then as the stall check
            stall = proxy.cfg.stall_timeout
            self.timer = loop.call_later(min(HEAD_HOLD, stall) if self.first else stall,
                                         self._stall_check)

    def _see(self, chunks: list[bytes]) -> bytes:
        """What one read held, as one piece, and what the proxy reads in it in passing:
        the first chunk (prefill done), SSE events and the last ``usage``."""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if self.first:
            self.first = False
            self.proxy._first(self.lc)
            self.link.ttft.observe(time.perf_counter() - self.req.t0)
        self.events += data.count(b"data: {")
        if self.learn:
            seen = self.tail + data
            if self.proxy.owners.learn_from(seen, self.link.name):
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
            self.proxy._count_usage(name, self.last_usage, self.last_usage.rfind(b'"usage"'))
        self.link.e2e.observe(time.perf_counter() - self.req.t0)
        _settle(self.proxy, self.lc, name,
                self.usage if self.usage is not None else self.events)

    def on_end(self, chunks: list[bytes]) -> None:
        if self.finished:
            return
        self.finished = True
        data = self._see(chunks) if chunks else b""
        self._settle()
        self.req.end(data)  # the last read's chunks and the end: one write
        self.stop()

    def _gone(self) -> None:
        """The client went away mid-stream: the engine's connection closes (it aborts);
        the load is released without an output length (the answer was cut short)."""
        if self.finished:
            return
        self.finished = True
        self.proxy.counts["client_disconnects"] += 1
        self.stop()
        _settle(self.proxy, self.lc, self.link.name, None)
        self.resp.close()

    def on_error(self, error: UpstreamError | None, why: str | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        self.proxy.counts["broken_streams"] += 1
        name = self.link.name
        msg = why or f"engine {name} failed mid-stream: {error}"
        err = openai_error(502, msg, "BadGateway")
        self._settle()
        self.req.end(b"data: " + err + b"\n\ndata: [DONE]\n\n")
        self.stop()
        self.resp.close()

    def _stall_check(self) -> None:
        self.req.flush()  # a head held for a first chunk that is late
        stall = self.proxy.cfg.stall_timeout
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

    def _pause(self) -> None:
        self.paused = True
        self.resp.pause()

    def _resume(self) -> None:
        self.paused = False
        self.since = self.loop.time()
        self.resp.resume()

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.resp._sink = None
