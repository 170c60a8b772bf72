"""``kvwire serve``'s HTTP face (FastAPI + uvicorn; ``pip install kvwire[serve]``).

Bodies are decoded with msgspec, not pydantic: a 2k-token prompt decodes in microseconds, and
its errors name the offending field (``Expected `int`, got `str` - at `$.token_ids[3]```).
Every bad request is answered 4xx with ``{"error": ..., "reason": ...}`` and counted in
``kvwire_router_bad_requests_total{reason}``; the service keeps serving.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from array import array
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from .indexer import INDEXER_PATHS, Indexer
from .ingest import stream_metrics  # per-stream counts in /metrics
from .membership import add_membership_routes
from .service import RouteError, RouterCore
from .status_feed import StatusFeed
from .status_page import STATUS_HTML
from .tokens import parse_route_body

__all__ = ["build_app", "fast_app", "serve_in_thread"]

#: Token ids are vocabulary indices: non-negative and below 2^32.
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
_Name = Annotated[str, msgspec.Meta(max_length=256)]


class RouteBody(msgspec.Struct, forbid_unknown_fields=True):
    token_ids: list[TokenId]
    lora_name: _Name | None = None
    salt: _Name | None = None


class ReleaseBody(msgspec.Struct, forbid_unknown_fields=True):
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    output_tokens: Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)] | None = None


class _RouteRest(msgspec.Struct, forbid_unknown_fields=True):
    """A /route body's members other than token_ids (what the C parser leaves)."""

    lora_name: _Name | None = None
    salt: _Name | None = None


_NO_REST = _RouteRest()
_route_dec = msgspec.json.Decoder(RouteBody)
_route_rest_dec = msgspec.json.Decoder(_RouteRest)
_release_dec = msgspec.json.Decoder(ReleaseBody)
_enc = msgspec.json.Encoder()


class _Metrics:
    """The service's own registry: nothing leaks into (or from) the process default one."""

    def __init__(self, core: RouterCore, proxy: Any = None) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.latency = Histogram(
            "kvwire_router_route_seconds", "Time to answer /route and /score (index match + "
            "policy), seconds", ["endpoint"], registry=r,
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0))
        self.hit = Histogram(
            "kvwire_router_prefix_hit_ratio", "Matched / prompt blocks on the chosen engine "
            "(credit-weighted), per routed request", registry=r,
            buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0))
        self.routed = Counter("kvwire_router_routed_total", "Requests routed, per engine",
                              ["engine"], registry=r)
        self.bad = Counter("kvwire_router_bad_requests_total",
                           "Requests answered 4xx, by reason", ["reason"], registry=r)
        r.register(_CoreCollector(core))
        if proxy is not None:
            r.register(proxy.metrics)  # kvwire_proxy_*

    def on_route(self, label: str, credit: float, prompt_blocks: float) -> None:
        self.routed.labels(label).inc()
        self.hit.observe(credit / prompt_blocks if prompt_blocks > 0 else 0.0)


class _CoreCollector:
    """Index and stream figures read at scrape time (free on the routing path)."""

    def __init__(self, core: RouterCore, proxy: Any = None) -> None:
        self.core = core

    def describe(self) -> list:
        return []

    def collect(self) -> Any:
        core = self.core
        status = core.engines_status()
        applied = CounterMetricFamily("kvwire_router_events_applied",
                                      "Events applied to the index, per stream", labels=["stream"])
        blocks = GaugeMetricFamily("kvwire_router_blocks", "Blocks indexed per stream and tier",
                                   labels=["engine", "stream", "tier"])
        resets = CounterMetricFamily("kvwire_router_resets", "Stream resets (restart, loss)",
                                     labels=["stream"])
        alive = GaugeMetricFamily("kvwire_router_stream_alive", "1 if the stream is live",
                                  labels=["stream"])
        load = GaugeMetricFamily("kvwire_router_load_blocks",
                                 "Reserved load (uncached blocks of unreleased requests)",
                                 labels=["stream"])
        for engine, e in status.items():
            for row in e["ranks"]:
                s = row["stream"]
                applied.add_metric([s], row["events_applied"])
                resets.add_metric([s], row["resets"])
                alive.add_metric([s], 1.0 if row["alive"] else 0.0)
                load.add_metric([s], row["load"])
                for tier, n in row["blocks"].items():
                    blocks.add_metric([engine, s, str(tier)], n)
        reqs = CounterMetricFamily("kvwire_router_requests", "Answered requests by kind",
                                   labels=["kind"])
        for k, v in core.counts.items():
            reqs.add_metric([k], v)
        lt = core.loads
        expired = CounterMetricFamily("kvwire_router_reservations_expired",
                                      "Reservations dropped because no release came")
        expired.add_metric([], lt.expired)
        yield from (applied, blocks, resets, alive, load, reqs, expired)
        # -- per-stream counts as kvwire listen names them (router/ingest.py: stream_metrics)
        for name, kind, doc, values in stream_metrics(status):
            fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                name, doc, labels=["stream"])
            for stream, v in values:
                fam.add_metric([stream], v)
            yield fam
        # -- end per-stream counts
        if core.discover:  # (serve --nats without --nats-engine)
            found = CounterMetricFamily("kvwire_router_engines_discovered", "Engines found "
                                        "(or widened by a new DP rank) on the JetStream "
                                        "stream after start")
            found.add_metric([], core.discovered)
            yield found
        share = core.load_share
        if share is not None:  # (serve --nats: replicas that share their load)
            ops = CounterMetricFamily(
                "kvwire_router_load_reports", "Load sharing between router replicas: reports "
                "sent, send errors, operations dropped on a full queue; reports, operations, "
                "sequence gaps and malformed operations received; reservations a peer's "
                "heartbeat dropped or corrected; peers expired (silent past the ttl)", labels=["kind"])
            with core.lock:
                counts = {**share.counts, **share.peers.counts}
                peers, held = len(share.peers.peers), share.peers.held()
            for k, v in counts.items():
                ops.add_metric([k], v)
            g = GaugeMetricFamily("kvwire_router_peer_replicas",
                                  "Other router replicas heard from within the ttl")
            g.add_metric([], peers)
            h = GaugeMetricFamily("kvwire_router_peer_reservations",
                                  "Reservations of other replicas counted in the load")
            h.add_metric([], held)
            yield from (ops, g, h)


class _IndexerCollector:
    """The indexer API's counters (requests, 4xx by reason, scope misses, block-size
    mismatches) as ``kvwire_indexer_events_total{what}``, and its registrations."""

    def __init__(self, indexer: Indexer) -> None:
        self.indexer = indexer

    def describe(self) -> list:
        return []

    def collect(self) -> Any:
        c = CounterMetricFamily("kvwire_indexer_events", "Indexer API requests and problems, "
                                "by what (query, bad_<reason>, empty_scope, ...)",
                                labels=["what"])
        for k, v in list(self.indexer.counts.items()):
            c.add_metric([k], v)
        g = GaugeMetricFamily("kvwire_indexer_registrations", "Streams registered")
        g.add_metric([], len(self.indexer.regs))
        yield from (c, g)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_enc.encode(obj), status_code=status, media_type="application/json")


def build_app(core: RouterCore, proxy: Any = None, indexer: Indexer | None = None,
              admin_token: str | None = None, engines_file: Any = None) -> FastAPI:
    """The FastAPI app over ``core`` (whose subscriber thread the caller starts/stops);
    with ``proxy`` (a :class:`~kvwire.router.proxy.Proxy`), ``fast_app`` also serves
    ``/v1`` and ``/health`` needs an engine live on both HTTP and events. With
    ``admin_token``, ``POST /engines`` and ``DELETE /engines/{name}`` change the engines
    (:mod:`~kvwire.router.membership`); without, they answer 403. With ``engines_file``
    (an :class:`~kvwire.router.engines_file.EnginesFile`) those changes are kept there."""
    app = FastAPI(title="kvwire router", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = _Metrics(core, proxy)
    feed = StatusFeed(core, proxy)  # the status page's charts, sampled once a second

    def on_route(label: str, credit: float, prompt_blocks: float) -> None:
        metrics.on_route(label, credit, prompt_blocks)
        feed.on_route(label, credit, prompt_blocks)

    core.on_route = on_route
    feed.start()
    app.state.status_feed = feed
    app.state.core = core
    app.state.proxy = proxy
    app.state.metrics = metrics
    # the RFC #1403 indexer API over the same index (fast_app answers its paths)
    app.state.indexer = indexer = (indexer if indexer is not None
                                   else Indexer(core, max_tokens=core.max_tokens))
    metrics.registry.register(_IndexerCollector(indexer))

    def bad(status: int, message: str, reason: str) -> Response:
        metrics.bad.labels(reason).inc()
        return _json({"error": message, "reason": reason}, status)

    @app.exception_handler(RouteError)
    async def _route_error(request: Request, exc: RouteError) -> Response:
        return bad(exc.status, str(exc), exc.reason)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return bad(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                   "http_" + str(exc.status_code))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return bad(422, str(exc.errors())[:500], "validation")

    async def decode(request: Request, dec: msgspec.json.Decoder) -> Any:
        return _decode_body(await request.body(), dec)

    async def _answer(request: Request, reserve: bool) -> Response:
        t0 = time.perf_counter()
        body = _decode_route(await request.body())
        out = core.route(body.token_ids, body.lora_name, body.salt, reserve=reserve)
        metrics.latency.labels("route" if reserve else "score").observe(
            time.perf_counter() - t0)
        return _json(out)

    @app.post("/route")
    async def route(request: Request) -> Response:
        """Choose an engine and reserve load under the returned request_id."""
        return await _answer(request, True)

    @app.post("/score")
    async def score(request: Request) -> Response:
        """The same answer as /route, reserving nothing."""
        return await _answer(request, False)

    @app.post("/release")
    async def release(request: Request) -> Response:
        body = await decode(request, _release_dec)
        return _json(core.release(body.request_id, body.output_tokens))

    @app.get("/engines")
    async def engines() -> Response:
        out = core.engines_status()
        if proxy is not None:
            for name, st in proxy.status().items():
                if name in out:
                    out[name]["http"] = st
        return _json(out)

    add_membership_routes(app, core, proxy, admin_token, _json, bad, kept=engines_file)

    @app.get("/health")
    async def health() -> Response:
        ok, why = core.healthy()
        if proxy is not None and ok:
            ok, why = proxy.healthy()
        return _json({"ok": ok, "detail": why}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(generate_latest(metrics.registry),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/status.json")
    async def status_json(seconds: str = "300") -> Response:
        """The status page's charts: per engine, one point a second for ``seconds``."""
        try:
            window = float(seconds)
        except ValueError:
            window = math.nan
        if not 1 <= window <= feed.series.capacity * feed.interval:
            return bad(400, f"seconds must be a number from 1 to "
                       f"{feed.series.capacity * feed.interval:g}, got {seconds[:40]!r}",
                       "bad_seconds")
        return _json(feed.window(window))

    @app.get("/")
    async def status_page() -> HTMLResponse:
        return HTMLResponse(STATUS_HTML)

    return app


_JSON_HEADERS = [(b"content-type", b"application/json")]


def fast_app(app: FastAPI) -> Any:
    """An ASGI app answering ``POST /route``, ``/score`` and ``/release`` directly (the hot
    path: no routing table, no Request/Response objects; several times less overhead per
    request than going through FastAPI) and passing everything else to ``app``. (The
    proxy's ``/v1`` paths are served by :class:`~kvwire.router.front.Server`, not here.)

    Same answers and errors as the FastAPI routes (which stay registered for the rest)."""
    core: RouterCore = app.state.core
    metrics: _Metrics = app.state.metrics
    indexer: Indexer = app.state.indexer
    latency = {b"/route": metrics.latency.labels("route"),
               b"/score": metrics.latency.labels("score")}

    async def asgi(scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("raw_path") or scope.get("path", "").encode()
        if path in INDEXER_PATHS and scope["type"] == "http":
            await _indexer_answer(indexer, scope, receive, send, path)
            return
        if scope["type"] != "http" or scope["method"] != "POST" or path not in _FAST:
            await app(scope, receive, send)
            return
        t0 = time.perf_counter()
        body = await _read_body(receive)
        if body is None:
            return  # client went away
        status = 200
        try:
            if path == b"/release":
                rel = _decode_body(body, _release_dec)
                out = core.release(rel.request_id, rel.output_tokens)
            else:
                req = _decode_route(body)
                out = core.route(req.token_ids, req.lora_name, req.salt,
                                 reserve=path == b"/route")
                latency[path].observe(time.perf_counter() - t0)
        except RouteError as e:
            metrics.bad.labels(e.reason).inc()
            status, out = e.status, {"error": str(e), "reason": e.reason}
        payload = _enc.encode(out)
        await send({"type": "http.response.start", "status": status,
                    "headers": [*_JSON_HEADERS,
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    return asgi


_FAST = frozenset((b"/route", b"/score", b"/release"))


async def _read_body(receive: Any) -> bytes | None:
    """The ASGI request's whole body (None: the client went away first)."""
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _indexer_answer(indexer: Indexer, scope: dict, receive: Any, send: Any,
                          path: bytes) -> None:
    """An indexer API request, answered by ``Indexer.handle`` (kvwire.router.indexer)."""
    body = await _read_body(receive)
    if body is None:
        return  # client went away
    qs = scope.get("query_string") or b""
    target = path.decode() + ("?" + qs.decode("latin-1") if qs else "")
    status, payload = indexer.handle(scope["method"], target, body)
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON_HEADERS, (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def _decode_body(body: bytes, dec: msgspec.json.Decoder) -> Any:
    try:
        return dec.decode(body)
    except msgspec.ValidationError as e:
        raise RouteError(422, f"invalid request body: {e}", "wrong_type") from None
    except msgspec.DecodeError as e:
        raise RouteError(400, f"malformed JSON body: {e}", "malformed_json") from None


def _decode_route(body: bytes) -> Any:
    """A /route or /score body; token ids as an int64 ``array`` when the C parser takes
    them (plain ints in range: no Python int per token), else exactly as msgspec decodes
    and validates them (so every bad body still gets msgspec's named error)."""
    if parse_route_body is not None:
        fast = parse_route_body(body)
        if fast is not None:
            packed, rest = fast
            try:
                more = _NO_REST if rest is None else _route_rest_dec.decode(rest)
            except msgspec.DecodeError:
                more = None  # the strict decode below names what is wrong
            if more is not None:
                toks = array("q")
                toks.frombytes(packed)
                return RouteBody(toks, more.lora_name, more.salt)  # type: ignore[arg-type]
    return _decode_body(body, _route_dec)


def serve_in_thread(core: RouterCore, host: str = "127.0.0.1", port: int = 0,
                    timeout: float = 10.0, proxy: Any = None,
                    admin_token: str | None = None,
                    engines_file: Any = None) -> tuple[Any, threading.Thread, int]:
    """Run the app with uvicorn (with ``proxy``: :class:`~kvwire.router.front.Server`) in
    a daemon thread (tests, docs, embedding).

    Returns ``(server, thread, port)``; stop with ``server.should_exit = True;
    thread.join()``. ``port=0`` picks a free port (the socket is bound here first)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    if proxy is not None:  # the proxy's hot paths on the lean server, the rest bridged
        from .front import Server

        server: Any = Server(fast_app(build_app(core, proxy, admin_token=admin_token,
                                                engines_file=engines_file)), proxy)
    else:
        config = uvicorn.Config(fast_app(build_app(core, proxy, admin_token=admin_token,
                                                   engines_file=engines_file)),
                                log_level="warning",
                                access_log=False, lifespan="off", proxy_headers=False)
        server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="kvwire-router-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    return server, thread, port
