"""``kvwire serve``'s object graph: built from a :class:`ServeConfig`, started, and closed
in one place, so that Python code runs the same service the command line does.

:func:`build` makes and starts everything but the HTTP server: the routing core and its
subscriber (or JetStream feed), load sharing with other replicas, the indexer API, the
proxy, the engines file, the status feed, and the listening socket (bound here, so that
port 0 is known and a port in use is one clear error before anything serves). The
:class:`Service` it returns then serves: :meth:`Service.run` on the calling thread (the
command line: signals drain it), or :meth:`Service.start` in a thread. One event loop
answers HTTP, talks to the engines and probes their health: the proxy's prober starts on
the server's loop as it starts serving.

    svc = build(ServeConfig(engines=[EngineSpec.parse("e0=tcp://127.0.0.1:5557")], port=0))
    svc.start()          # serving at svc.url
    ...
    svc.close()

Errors: :class:`ConfigError` for what the configuration got wrong (the command line exits
2), :class:`StartError` for what the world refused: a NATS server that does not answer, a
port in use (exit 1). Either way what was started is closed again.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..consume.engine_spec import EngineSpec
from ..consume.stream import StreamConfig
from ..http1.server import Server, run_loop
from ..indexer.indexer import Indexer
from ..proxy.proxy import Proxy, ProxyConfig
from ..routing.core import RouterCore
from ..routing.pairs import PairConfig
from ..routing.policy import make_policy
from .app import RouterApp, build_app

__all__ = ["ConfigError", "ServeConfig", "ServeError", "Service", "StartError", "build"]

log = logging.getLogger("kvwire.serve")


class ServeError(Exception):
    """Why the service cannot run (one line, said as is)."""


class ConfigError(ServeError):
    """The configuration is wrong: a flag, an engine, a stream, a file that cannot be read."""


class StartError(ServeError):
    """The world refused: a NATS server that does not answer, a port that cannot be bound."""


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``kvwire serve``'s flags say (``kvwire serve --help`` tells each one)."""

    #: engines whose KV events are followed (``--engine``); with ``url=`` they are proxied to
    engines: Sequence[EngineSpec] = ()
    host: str = "127.0.0.1"
    #: 0: any free port (:attr:`Service.port` says which)
    port: int = 8000
    policy: str = "kvwire"
    prefill_weight: float = 1.0
    load_weight: float = 1.0
    #: tokens of load an engine may hold beyond the least-loaded one's at no cost
    balance_slack: float = 131_072.0
    temperature: float = 0.0
    seed: int | None = None
    block_size: int = 16
    max_tokens: int = 1 << 20
    expiry: float = 600.0
    predict_ttl: float = 3.0
    decode_load: float = 1.0
    decode_share: float = 0.6
    dead_after: float | None = None
    #: the proxy's tokenizer: None (route by load only), "engine", "builtin" or a directory
    tokenizer: str | None = None
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    #: the index fed from JetStream at this URL instead of the engines' sockets
    nats: str | None = None
    stream: str = "KVWIRE"
    subject: str | None = None
    #: with ``nats``: the engines to route to (empty: every one on the stream, found as
    #: they appear)
    nats_engines: Sequence[EngineSpec] = ()
    #: with ``nats``: share load with the other replicas (None: yes)
    share_load: bool | None = None
    connect_timeout: float = 10.0
    #: the indexer API's registrations, kept in this file
    registrations: str | None = None
    #: engines added and removed at run time, kept in this file
    engines_file: str | None = None
    #: allows ``POST /engines`` and ``DELETE /engines/NAME`` (None: they answer 403)
    admin_token: str | None = None
    #: seconds a first SIGTERM/SIGINT lets the requests in flight finish (0: stop at once)
    shutdown_timeout: float = 30.0
    #: prefill/decode: a prompt missing fewer tokens than this on its decode engine is
    #: prefilled there
    disagg_min_tokens: int = 0
    #: prefill/decode: every prefill engine's load past this (blocks): prefill locally
    pd_prefill_busy: float = math.inf


class Service:
    """A built ``kvwire serve``: its parts, started, and the HTTP server over them (not yet
    serving until :meth:`run` or :meth:`start`). :meth:`close` closes it all, once."""

    def __init__(self, core: RouterCore, proxy: Proxy | None, routes: RouterApp,
                 sock: socket.socket, shutdown_timeout: float) -> None:
        self.core = core
        self.proxy = proxy
        self.routes = routes
        self.indexer = routes.indexer
        self.sock = sock
        self.host, self.port = sock.getsockname()[:2]
        self.server = Server(routes, drain_timeout=shutdown_timeout,
                             on_start=lambda: routes.serving(probes=True),
                             on_stop=lambda: routes.stopping(probes=True))
        self._thread: threading.Thread | None = None
        self._closed = False
        self._beside: list[tuple[Callable[[], Awaitable[Any]], Callable[[], Awaitable[Any]]]] = []

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve on this thread until stopped: SIGINT/SIGTERM on the main thread (a first one
        drains for ``shutdown_timeout``), or ``server.should_exit``. Call :meth:`close`
        after."""
        if not self._beside:
            self.server.run(sockets=[self.sock])
            return
        run_loop(self._serve_beside())

    # -------------------------------------------- work beside HTTP on the serving loop

    def beside(self, start: Callable[[], Awaitable[Any]],
               stop: Callable[[], Awaitable[Any]]) -> None:
        """Run ``start()`` on the serving loop before HTTP serves and ``stop()`` there after
        it stopped (``kvwire epp``'s gRPC server: it uses the proxy's fleet, which lives on
        that loop). Call before :meth:`run` or :meth:`start`."""
        self._beside.append((start, stop))

    async def _serve_beside(self) -> None:
        stops = []
        try:
            for start, stop in self._beside:
                await start()
                stops.append(stop)
            await self.server.serve([self.sock])
        finally:
            for stop in reversed(stops):
                await stop()

    def start(self, timeout: float = 10.0) -> Service:
        """Serve in a daemon thread (embedding, tests); returns once the server listens.
        RuntimeError if it does not within ``timeout`` s."""
        if self._thread is not None:
            return self
        self._thread = thread = threading.Thread(target=self.run, name="kvwire-serve",
                                                 daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop serving (a thread of :meth:`start`: waits up to ``timeout`` s for it), then
        close the status feed, the proxy, the subscriber and the load sharing."""
        if self._closed:
            return
        self._closed = True
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.sock.close()
        self.routes.status_feed.close()
        if self.proxy is not None:
            self.proxy.close()  # (closed on the loop already if it served)
        self.core.close()  # (the load sharing too)

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def build(cfg: ServeConfig, say: Callable[[str], None] | None = None) -> Service:
    """Build and start ``kvwire serve``'s parts for ``cfg`` and bind its socket; ``say``
    tells what an operator should see (the command line prints it on stderr; default: the
    log). Raises :class:`ConfigError` or :class:`StartError`, having closed what it
    started."""
    say = say or _log_line
    try:
        engines, nats, kept, withdrawn = _engines(cfg, say)
        core = RouterCore(
            engines, nats=nats, discover=nats is not None and not cfg.nats_engines,
            withdrawn=withdrawn,
            policy=make_policy(cfg.policy, cfg.prefill_weight, cfg.load_weight,
                               cfg.temperature, cfg.seed, cfg.balance_slack / cfg.block_size),
            block_size=cfg.block_size, max_tokens=cfg.max_tokens, expiry_s=cfg.expiry,
            predict_ttl=cfg.predict_ttl, decode_load=cfg.decode_load,
            decode_share=cfg.decode_share,
            stream_config=StreamConfig(dead_after=cfg.dead_after),
            pairs=PairConfig(cfg.disagg_min_tokens / cfg.block_size, cfg.pd_prefill_busy,
                             always=cfg.proxy.pd_protocol is not None),
        )
        proxy = _proxy(cfg, core, engines)
    except (ValueError, ImportError) as e:
        raise ConfigError(str(e)) from e
    except OSError as e:  # kvwire.nats.connect.NatsConnectError included
        raise StartError(str(e)) from e
    try:
        core.start()
    except ValueError as e:  # a stream the subscriber cannot open
        core.close()
        raise ConfigError(str(e)) from e
    except (RuntimeError, OSError) as e:
        core.close()
        raise StartError(str(e)) from e
    try:
        _share_load(cfg, core, say)
        try:
            indexer = Indexer(core, cfg.registrations, max_tokens=cfg.max_tokens)
        except (ValueError, OSError) as e:  # a registrations file that cannot be read
            raise ConfigError(str(e)) from e
        # Bound here, before anything serves: port 0 is then known, and a port in use is
        # one clear line.
        try:
            sock = _bind(cfg.host, cfg.port)
        except OSError as e:
            raise StartError(f"cannot listen on {cfg.host}:{cfg.port}: {e}") from e
    except BaseException:
        core.close()
        raise
    try:
        routes = build_app(core, proxy, indexer, admin_token=cfg.admin_token,
                           engines_file=kept)
    except BaseException:
        sock.close()
        core.close()
        raise
    svc = Service(core, proxy, routes, sock, cfg.shutdown_timeout)
    say(f"{len(core.targets)} streams; {svc.url}/")
    return svc


def _log_line(line: str) -> None:
    log.info("%s", line)


def _engines(cfg: ServeConfig, say: Callable[[str], None]
             ) -> tuple[list[EngineSpec], Any, Any, set[str]]:
    """The engines to route to, the JetStream source (or None), the engines file (or None)
    and the engines it withdrew. ValueError for a configuration that cannot work."""
    nats = None
    engines = list(cfg.engines)
    if cfg.nats is not None:
        from .nats_engines import nats_engines

        if engines:
            raise ValueError("--engine and --nats exclude each other (with --nats the "
                             "engines' streams come from JetStream; name them with "
                             "--nats-engine)")
        nats, engines = nats_engines(cfg.nats, cfg.stream, cfg.subject, cfg.nats_engines,
                                     cfg.connect_timeout, say)
    elif cfg.nats_engines:
        raise ValueError("--nats-engine needs --nats URL")
    if cfg.share_load and cfg.nats is None:
        raise ValueError("--share-load needs --nats URL (the replicas share their load "
                         "over it)")
    kept, withdrawn = None, set()
    if cfg.engines_file is not None:
        kept, engines, withdrawn = _kept_engines(cfg.engines_file, engines, nats, say)
    prefill = [e.name for e in engines if e.role == "prefill"]
    if prefill and not any(e.decodes for e in engines):
        raise ValueError(f"role=prefill engines ({', '.join(prefill)}) need an engine that "
                         "decodes: give one with role=decode or role=both")
    if nats is None and not engines and cfg.registrations is None:
        raise ValueError("give --engine NAME=ENDPOINT (repeat), --nats URL or "
                         "--registrations FILE (the indexer API alone)")
    return engines, nats, kept, withdrawn


def _proxy(cfg: ServeConfig, core: RouterCore, engines: list[EngineSpec]) -> Proxy | None:
    """The ``/v1`` proxy, when an engine has ``url=`` (it logs already if it routes by load
    only: no tokenizer)."""
    if cfg.tokenizer in (None, "engine") and (
            cfg.chat_template is not None or cfg.chat_template_content_format != "auto"):
        raise ValueError("--chat-template and --chat-template-content-format apply to "
                         "--tokenizer DIR or builtin (with --tokenizer engine the "
                         "engine renders: give them to the engine)")
    if any(e.url for e in engines):
        return Proxy(core, _tokenizer(cfg), tokenize_with_engine=cfg.tokenizer == "engine",
                     config=cfg.proxy)
    if cfg.tokenizer is not None:
        raise ValueError("--tokenizer needs an --engine (or --nats-engine) with url=")
    return None


def _tokenizer(cfg: ServeConfig) -> Any:
    """None (load only), 'engine' (asked per request), 'builtin', or a model directory
    (loaded now: a bad one is a ConfigError), with the chat template."""
    spec = cfg.tokenizer
    if spec is None or spec == "engine":
        return None
    from ..tokenize import load_tokenizer

    return load_tokenizer(None if spec == "builtin" else spec,
                          chat_template=cfg.chat_template,
                          content_format=cfg.chat_template_content_format)


def _share_load(cfg: ServeConfig, core: RouterCore, say: Callable[[str], None]) -> None:
    """With ``nats`` (unless ``share_load`` is False): each request's load goes to the other
    replicas on the stream's load subject, and theirs comes here."""
    if cfg.nats is None or cfg.share_load is False:
        return
    from ..nats.load_channel import LoadShare

    share = LoadShare(core, cfg.nats, f"kvwire.load.{cfg.stream}",
                      connect_timeout=cfg.connect_timeout)
    try:
        share.start()
    except (RuntimeError, OSError) as e:
        raise StartError(f"load sharing: {e}") from e
    core.load_share, core.share = share, share.push
    say(f"sharing load with the other replicas on {share.subject} (--no-share-load: each "
        "routes on its own)")


def _kept_engines(path: str, engines: list, nats: Any, say: Callable[[str], None]
                  ) -> tuple[Any, list, set[str]]:
    """The engines file, the engines to route to (the run-time changes laid over
    ``engines``, the configuration's) and the names removed; said when the changes alter
    the configuration's fleet. ValueError for a file that cannot be read."""
    from .engines_file import EnginesFile

    kept = EnginesFile(path)
    changes = kept.load()
    try:
        start = changes.over(engines, EngineSpec.parse if nats is None
                             else lambda text: EngineSpec.parse_named(text, "engine"))
    except ValueError as e:
        raise ValueError(f"engines file {path}: {e}") from None
    said = []
    if changes.added:
        said.append(f"added {', '.join(sorted(changes.added))}")
    if start.replaced:
        said.append(f"of these, {', '.join(start.replaced)} as added, not as given here")
    if start.dropped:
        said.append(f"{', '.join(start.dropped)} left out (removed at run time: POST "
                    "/engines adds one back)")
    if said:
        say(f"engines file {path}: " + "; ".join(said))
    return kept, start.engines, start.withdrawn


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
