"""One proxied request, end to end, in one direction: the body's few routing fields
(:mod:`.body`), its tokens (:mod:`.tokens`), the routing core's decision among the engines
the :class:`~kvwire.proxy.fleet.Fleet` says are usable, an attempt at the chosen engine on
the one HTTP client, a retry on the next-best one before the client got a byte, and the
answer back through :mod:`.relay`.

The hot path costs one task per request; a streamed answer is then the relay's, which
costs nothing per chunk beyond the bytes. A client that goes away cancels the request's
task, whose ``finally`` releases the load and closes the engine's connection (the engine
aborts).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from ..http1 import HttpError
from ..http1.client import Response, UpstreamError
from ..routing.core import RouteError, RouterCore
from .body import NO_BODY, generation, passthrough
from .decisions import Lifecycle, Outcome, marks_down, should_retry
from .fleet import Fleet
from .offload import Partial
from .pairs import Pairs
from .relay import Relay, answer, openai_error, settle
from .responses import PREFIX as RESPONSES_PREFIX
from .responses import addressed
from .start import route_on_start, whole_ids
from .tokens import Tokens

if TYPE_CHECKING:
    from ..http1.server import Request
    from .config import ProxyConfig

__all__ = ["PASS", "PATHS", "BadRequest", "Handler", "handles", "openai_error"]

#: Hop-by-hop and framing headers not forwarded (either way).
HOP = frozenset((b"host", b"content-length", b"connection", b"keep-alive",
                 b"transfer-encoding", b"te", b"trailer", b"upgrade", b"proxy-authorization",
                 b"proxy-connection", b"expect"))
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

#: The proxy's refusals are kvwire's one HTTP error, rendered OpenAI's way
#: (:meth:`~kvwire.http1.HttpError.openai`: ``param``, ``type``).
BadRequest = HttpError


def handles(path: bytes) -> bool:
    """Whether ``path`` is the proxy's to answer."""
    return (path in PATHS or path in PASS or path == b"/v1/models"
            or path.startswith(RESPONSES_PREFIX))


class Handler:
    """The proxy's requests: :meth:`run` is the route table's entry for every path
    :func:`handles`."""

    def __init__(self, core: RouterCore, fleet: Fleet, tokens: Tokens,
                 cfg: ProxyConfig) -> None:
        self.core = core
        self.fleet = fleet
        self.tokens = tokens
        self.cfg = cfg
        self.overhead = fleet.metrics.overhead
        #: prefill/decode pairs (generation requests, when the fleet has roles)
        self.pairs = Pairs(core, fleet, cfg, self.attempt)

    def run(self, req: Request) -> None:
        """Answer ``req``; called from the server's protocol."""
        path, method = req.path, req.method
        fleet = self.fleet
        if path == b"/v1/models":
            if method != b"GET":
                req.respond(405, openai_error(405, "Method Not Allowed", "MethodNotAllowed"))
            else:
                req.respond(200, fleet.models_json())
            return
        rid = addressed(path)
        if rid == "":
            self._bad(req, HttpError(
                404, f"no such path: {path.decode('latin-1')} (under /v1/responses/: {{id}}, "
                "{id}/cancel, {id}/input_items)", type="NotFoundError"))
            return
        if method != b"POST" and (rid is None or method not in (b"GET", b"DELETE")):
            req.respond(405, openai_error(405, "Method Not Allowed", "MethodNotAllowed"))
            return
        if req.too_large:
            self._bad(req, HttpError(413, f"request body over {self.cfg.max_body} bytes",
                                     param="body"))
            return
        cap = self.cfg.max_in_flight
        if cap and fleet.active >= cap:  # refused whole, before any work: the client retries
            e = fleet.overloaded("kvwire serve")
            req.respond(e.status, e.openai(), e.headers)
            return
        loop = req.proto.server.loop  # (asyncio.get_running_loop() costs a getpid() call)
        task = loop.create_task(self._serve(req, PATHS.get(path), loop, rid))
        fleet.began()
        req.on_done = fleet.ended  # answered, aborted or abandoned: once

        def gone() -> None:  # the client left before the answer ended: abandon it
            fleet.counts["client_disconnects"] += 1
            task.cancel()

        req.on_close = gone

    def _bad(self, req: Request, e: HttpError) -> None:
        self.fleet.refused(e)
        req.respond(e.status, e.openai(), e.headers)

    async def _serve(self, req: Request, chat: bool | None,
                     loop: asyncio.AbstractEventLoop, rid: str | None = None) -> None:
        """``chat``: True for chat, False for completions, None for a :data:`PASS` path or,
        with ``rid``, a path naming a stored response (``/v1/responses/{rid}...``)."""
        fleet = self.fleet
        # a request that creates a stored response (Responses API): its id is learned
        creates = rid is None and chat is None and req.path == RESPONSES
        try:
            if rid is not None:  # GET/DELETE have no body; cancel's is the engine's to read
                body: Any = NO_BODY
                tokens: Any = ()
            elif chat is None:
                body = passthrough(req.body)
                self.fleet.check_model(body.model)
                tokens = (await self.tokens.response(body)
                          if creates and not body.previous_response_id else ())
            else:
                body = generation(req.body, chat)
                self.fleet.check_model(body.model)
                # (a pair's prefill side is chosen by the whole prompt: no routing on its start)
                tokens = await self.tokens.prompt(body, chat, start=not self.pairs.active)
        except HttpError as e:
            self._bad(req, e)
            return
        known = fleet.known_models()
        model = body.model
        lora = model if model is not None and known.get(model) else None
        headers = [h for h in req.headers if h[0] not in HOP]
        stream = bool(body.stream) if rid is None else _stream_query(req.query)
        pd = self.pairs.active
        if pd and chat is not None:
            await self.pairs.serve(req, chat, body, tokens, lora, headers, stream, loop)
            return
        tried: set[str] = set()
        last: tuple[int, bytes] | None = None
        last_engine = "none"
        cfg = self.cfg
        # a stored response lives on the engine that produced it: what names one goes there
        pin = rid if rid is not None else (body.previous_response_id if creates else None)
        plan: list[str] | None = None  # the engines to try, in order (None: routed)
        part: Partial | None = None  # a prompt routed on its start (its rest on the way)
        probe = False  # a 404 means "not on this engine": ask the next one
        if pin:
            owner = fleet.owners.get(pin)
            if owner is not None and owner in fleet.links:
                plan = [owner]
                fleet.counts["responses_pinned"] += 1
            else:  # not known here (restarted, or forgotten): ask each engine in turn (an
                # engine without it answers 404 before doing any work)
                plan, probe = list(fleet.names), True
                fleet.counts["responses_looked_up"] += 1
        for attempt in range(cfg.retries + 1 if plan is None else len(plan)):
            ok = fleet.usable(model, tried)
            if pd:  # (a prefill-only engine does not decode)
                ok = self.pairs.usable_for_any(ok)
            if plan is not None:
                want = plan[attempt]
                if want not in ok:
                    if not probe:
                        last = (503, openai_error(503, f"engine {want}, which holds response "
                                                  f"{pin}, is down", "ServiceUnavailable"))
                    continue
                ok = {want}
            try:
                if type(tokens) is Partial:
                    part = tokens
                    routed, tokens = await route_on_start(
                        self.core, fleet.counts, part, lora, body.cache_salt,
                        ok.__contains__, fleet.up)
                else:
                    if part is not None:  # a retry: weighed, reserved, predicted whole
                        tokens, part = await whole_ids(part, tokens), None
                    routed = self.core.route_proxy(tokens, lora, body.cache_salt,
                                                   ok.__contains__, fleet.up)
            except RouteError as e:
                if last is None:
                    last = (e.status, openai_error(e.status, str(e), "ServiceUnavailable"))
                break
            tried.add(routed.engine)
            outcome, sent, last = await self.attempt(req, routed, headers, stream,
                                                      attempt == 0, loop, probe=probe,
                                                      learn=creates, rid=rid)
            last_engine = routed.engine
            if marks_down(outcome):
                fleet.failed(routed.engine)
            if plan is not None:  # its engines only, each once
                if sent:
                    return
                continue
            if not should_retry(outcome, attempt, cfg.retries, sent):
                if sent:
                    return
                break
            fleet.retried[routed.engine, outcome.value] += 1
        if last is None and probe:  # no engine could be asked (all down)
            last = (503, openai_error(503, f"no engine is available to look for response "
                                      f"{pin}", "ServiceUnavailable"))
        status, payload = last or (502, openai_error(502, "no engine answered", "BadGateway"))
        fleet.requests[last_engine, status] += 1
        req.respond(status, payload)

    async def attempt(self, req: Request, routed: Any, headers: list, stream: bool,
                       first: bool, loop: asyncio.AbstractEventLoop, *, probe: bool = False,
                       learn: bool = False, rid: str | None = None,
                       body: bytes | None = None, named: bytes | None = None,
                       on_first: Any = None, gate: Any = None, on_head: Any = None
                       ) -> tuple[Outcome, bool, tuple[int, bytes] | None]:
        """One try at one engine: (outcome, whether the client got bytes, the error to
        answer with if nothing was sent). The reservation ends here, on every path (a
        cancel lands in an await, and ``finally`` runs). ``probe``: a 404 is
        :attr:`Outcome.NOT_HERE`; ``learn``: the answer creates a response, whose id is
        remembered with this engine; ``rid``: the stored response the request names (found
        here unless 404). A prefill/decode pair's decode side (proxy/pairs.py) sends
        ``body`` instead of the client's, names both engines in ``x-kvwire-engine``
        (``named``), is told of the answer's head (``on_head(headers)``, a 200 about to
        reach the client) and of its first bytes (``on_first()``); with
        ``gate``, its answer reaches the client only once ``await gate()`` is true (the
        prefill side started), else it is :attr:`Outcome.ABANDONED`."""
        fleet = self.fleet
        core = self.core
        link = fleet.links[routed.engine]
        name = link.name
        cfg = self.cfg
        lc = Lifecycle(routed.request_id, routed.prefill)
        if link.ranks > 1:
            headers = [*headers, (b"x-data-parallel-rank", str(routed.rank).encode())]
        resp: Response | None = None
        fleet.sending(name)
        sent_at: list[float] = []
        relayed = False
        try:
            try:
                resp = await link.client().request(
                    req.method, req.path + b"?" + req.query if req.query else req.path,
                    headers, req.body if body is None else body, sent_at, time.perf_counter,
                    cfg.first_byte_timeout)
            except asyncio.TimeoutError:
                return Outcome.TIMEOUT, False, (504, openai_error(
                    504, f"engine {name} did not answer in {cfg.first_byte_timeout:g} s",
                    "Timeout"))
            except UpstreamError as e:
                return Outcome.REFUSED, False, (502, openai_error(
                    502, f"engine {name} unreachable: {e}", "BadGateway"))
            if gate is not None and not await gate():
                return Outcome.ABANDONED, False, None
            if on_head is not None and resp.status == 200:
                on_head(resp.headers)
            hdrs = [(b"x-kvwire-engine", link.name_b if named is None else named),
                    (b"x-kvwire-rank", b"%d" % routed.rank)]
            ctype = resp.headers.get(b"content-type", b"application/json")
            if stream and resp.status == 200:
                if rid is not None:
                    fleet.owners.learn(rid, name)
                req.start(200, [(b"content-type", ctype), _NO_CACHE, *hdrs], hold=True)
                fleet.requests[name, 200] += 1
                # it ends the stream: no await
                Relay(core, fleet, cfg.stall_timeout, req, resp, lc, link, loop, learn,
                      on_first)
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
                fleet.owners.learn_from(payload, name)
            elif rid is not None and resp.status < 400:
                if req.method == b"DELETE":
                    fleet.owners.forget(rid)
                else:
                    fleet.owners.learn(rid, name)
            if on_first is not None:
                on_first()
            answer(core, fleet, req, lc, link, resp.status, payload, hdrs, ctype)
            return Outcome.OK, True, None
        finally:
            if not relayed:  # (a relay settles and closes when its stream ends)
                settle(core, fleet, lc, name, None)  # first: nothing below may skip it
                if resp is not None:
                    resp.close()  # unfinished: the connection closes and the engine aborts
            if first and sent_at:
                self.overhead.observe(sent_at[0] - req.t0)


def _stream_query(query: bytes) -> bool:
    """``?stream=true`` (a stored response's events replayed as they come)."""
    if not query:
        return False
    v = parse_qs(query.decode("latin-1")).get("stream", [""])[-1]
    return v.lower() in ("true", "1")
