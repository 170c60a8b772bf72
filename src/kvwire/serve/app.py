"""``kvwire serve``'s HTTP face: its routes on kvwire's one HTTP server
(:mod:`kvwire.http1.server`), the proxy's ``/v1`` paths among them; what ``/metrics``
reads is in :mod:`.metrics`, the engines at run time in :mod:`.admin`, the status page's
feed in :mod:`.status`.

Bodies are decoded with msgspec, not pydantic: a 2k-token prompt decodes in microseconds, and
its errors name the offending field (``Expected `int`, got `str` - at `$.token_ids[3]```).
Every bad request is answered 4xx with ``{"error": ..., "reason": ...}`` and counted in
``kvwire_router_bad_requests_total{reason}``; the service keeps serving.
"""

from __future__ import annotations

import math
import threading
import time
from array import array
from typing import Annotated, Any

import msgspec
from prometheus_client import generate_latest

from ..http1 import HttpError
from ..http1.server import Request, Routes, Server
from ..http1.server import serve_in_thread as _serve_in_thread
from ..index.keys import TokenId
from ..indexer.indexer import INDEXER_PATHS, Indexer
from ..routing.core import RouterCore
from ..routing.tokens import parse_route_body
from .admin import add_membership_routes
from .metrics import IndexerCollector, ServeMetrics
from .status.feed import StatusFeed
from .status.page import STATUS_HTML

__all__ = ["RouterApp", "build_app", "serve_in_thread"]

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


_METRICS_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_HTML = b"text/html; charset=utf-8"
#: refusals the bad-request counter does not count: a handler's failure (logged), and a
#: body over the cap (refused by the server before any route)
_UNCOUNTED = frozenset(("internal", "too_large"))


class RouterApp(Routes):
    """``kvwire serve``'s route table, with the objects its routes answer from."""

    core: RouterCore
    proxy: Any
    metrics: ServeMetrics
    indexer: Indexer
    status_feed: StatusFeed

    def serving(self, probes: bool = False) -> None:
        """On the server's loop as it starts: the loop's lag is sampled there; with
        ``probes``, the proxy probes its engines there too (no thread of its own)."""
        self.metrics.loop_lag.start()
        if probes and self.proxy is not None:
            self.proxy.start()

    def stopping(self, probes: bool = False) -> None:
        """On the server's loop as it stops: the sampling (and with ``probes`` the probes)
        end, and the idle engine connections close."""
        self.metrics.loop_lag.stop()
        if self.proxy is not None:
            if probes:
                self.proxy.close()
            self.proxy.close_pools()


def build_app(core: RouterCore, proxy: Any = None, indexer: Indexer | None = None,
              admin_token: str | None = None, engines_file: Any = None) -> RouterApp:
    """The routes over ``core`` (whose subscriber thread the caller starts/stops): ``POST
    /route``, ``/score``, ``/release``, ``GET /engines``, ``/health``, ``/metrics``, the
    status page (``/``, ``/status.json``), the RFC #1403 indexer API over the same index;
    with ``proxy`` (a :class:`~kvwire.proxy.proxy.Proxy`), its ``/v1`` paths too and
    ``/health`` needs an engine live on both HTTP and events. With ``admin_token``, ``POST
    /engines`` and ``DELETE /engines/{name}`` change the engines
    (:mod:`~kvwire.serve.admin`); without, they answer 403. With ``engines_file``
    (an :class:`~kvwire.serve.engines_file.EnginesFile`) those changes are kept there.

    ``/route``, ``/score`` and ``/release`` are answered in the request's own callback: no
    task, no framework object; their body's ``token_ids`` parsed by a small C parser."""
    app = RouterApp(render=HttpError.kvwire,
                    headers=True if proxy is not None else (b"authorization",))
    metrics = ServeMetrics(core, proxy)
    feed = StatusFeed(core, proxy)  # the status page's charts, sampled once a second

    def on_route(label: str, credit: float, prompt_blocks: float) -> None:
        metrics.on_route(label, credit, prompt_blocks)
        feed.on_route(label, credit, prompt_blocks)

    core.on_route = on_route
    feed.start()
    app.status_feed = feed
    app.core = core
    app.proxy = proxy
    app.metrics = metrics
    # the RFC #1403 indexer API over the same index
    app.indexer = indexer = (indexer if indexer is not None
                             else Indexer(core, max_tokens=core.max_tokens))
    metrics.registry.register(IndexerCollector(indexer))
    bad = metrics.bad

    def counted(req: Request, e: HttpError) -> None:
        if e.reason not in _UNCOUNTED:
            bad.labels(e.reason).inc()

    app.on_error = counted
    latency = {True: metrics.latency.labels("route"), False: metrics.latency.labels("score")}

    def answer(req: Request, reserve: bool) -> None:
        t0 = time.perf_counter()
        body = _decode_route(req.body)
        out = core.route(body.token_ids, body.lora_name, body.salt, reserve=reserve)
        latency[reserve].observe(time.perf_counter() - t0)
        req.respond(200, _enc.encode(out))

    # Choose an engine and reserve load under the returned request_id.
    app.add("POST", "/route", lambda req: answer(req, True))
    # The same answer as /route, reserving nothing.
    app.add("POST", "/score", lambda req: answer(req, False))

    @app.route("POST", "/release")
    def release(req: Request) -> None:
        rel = _decode_body(req.body, _release_dec)
        req.respond(200, _enc.encode(core.release(rel.request_id, rel.output_tokens)))

    def indexer_api(req: Request) -> None:
        target = req.path.decode() + ("?" + req.query.decode("latin-1") if req.query else "")
        req.respond(*indexer.handle(req.method.decode(), target, req.body))

    app.claim(INDEXER_PATHS, indexer_api)

    @app.route("GET", "/engines")
    def engines(req: Request) -> None:
        out = core.engines_status()
        if proxy is not None:
            for name, st in proxy.status().items():
                if name in out:
                    out[name]["http"] = st
        req.respond(200, _enc.encode(out))

    add_membership_routes(app, core, proxy, admin_token, kept=engines_file)

    @app.route("GET", "/health")
    def health(req: Request) -> None:
        ok, why = core.healthy()
        if proxy is not None and ok:
            ok, why = proxy.healthy()
        req.respond(200 if ok else 503, _enc.encode({"ok": ok, "detail": why}))

    @app.route("GET", "/metrics")
    def metrics_page(req: Request) -> None:
        req.respond(200, generate_latest(metrics.registry), ctype=_METRICS_TYPE)

    @app.route("GET", "/status.json")
    def status_json(req: Request) -> None:
        """The status page's charts: per engine, one point a second for ``seconds``."""
        seconds = req.args().get("seconds", "300")
        try:
            window = float(seconds)
        except ValueError:
            window = math.nan
        if not 1 <= window <= feed.series.capacity * feed.interval:
            raise HttpError(400, f"seconds must be a number from 1 to "
                            f"{feed.series.capacity * feed.interval:g}, got {seconds[:40]!r}",
                            "bad_seconds")
        req.respond(200, _enc.encode(feed.window(window)))

    app.add("GET", "/", lambda req: req.respond(200, _STATUS_PAGE, ctype=_HTML))

    if proxy is not None:  # the OpenAI paths: the proxy answers them (its errors OpenAI's)
        from ..proxy.handler import PASS, PATHS
        from ..proxy.responses import PREFIX as RESPONSES_PREFIX

        app.claim((*PATHS, *PASS, b"/v1/models"), proxy.handle, prefix=RESPONSES_PREFIX,
                  render=HttpError.openai, cap=lambda: proxy.cfg.max_body)
        app.timed = True  # (its latency histograms start at the request's arrival)
    return app


_STATUS_PAGE = STATUS_HTML.encode()


def _decode_body(body: bytes, dec: msgspec.json.Decoder) -> Any:
    try:
        return dec.decode(body)
    except msgspec.ValidationError as e:
        raise HttpError(422, f"invalid request body: {e}", "wrong_type") from None
    except msgspec.DecodeError as e:
        raise HttpError(400, f"malformed JSON body: {e}", "malformed_json") from None


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
                    engines_file: Any = None) -> tuple[Server, threading.Thread, int]:
    """Serve :func:`build_app`'s routes in a daemon thread (tests, docs, embedding).

    Returns ``(server, thread, port)``; stop with ``server.should_exit = True;
    thread.join()``. ``port=0`` picks a free port (the socket is bound here first)."""
    routes = build_app(core, proxy, admin_token=admin_token, engines_file=engines_file)
    # (the proxy's probes are the caller's to start: a test's fleet may want none)
    server = Server(routes, on_start=routes.serving, on_stop=routes.stopping)
    return _serve_in_thread(routes, host, port, timeout, server, name="kvwire-router-http")
