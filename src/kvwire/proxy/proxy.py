"""``kvwire serve``'s OpenAI-compatible proxy: ``POST /v1/completions``,
``POST /v1/chat/completions`` and ``GET /v1/models`` in front of the engines given with
``url=``, and vLLM's other model endpoints (``handler.PASS``: embeddings, responses,
tokenize, detokenize) forwarded by load, except the Responses API (:mod:`.responses`):
a new conversation is routed by the cache as the chat it renders to, and what names a
stored response goes to the engine holding it.

:class:`Proxy` is the facade ``kvwire serve`` builds: it puts together one owner per
concern and passes calls on. :mod:`.fleet` holds the engines (links, pools, breakers) and
the counters; :mod:`.handler` answers one request (body, tokens, the routing core's
decision, attempts and retries); :mod:`.pairs` serves a generation request as a
prefill/decode pair when the engines have roles; :mod:`.relay` passes the answer back chunk
by chunk as it arrives; :mod:`.health` probes the engines; :mod:`.decisions` holds the pure decisions
(breaker, retries, the load lifecycle); routing is
:class:`~kvwire.routing.core.RouterCore`'s. A client that goes away cancels the upstream
request, which closes its connection: the engine aborts it.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from ..consume.engine_spec import EngineSpec
from ..routing.core import RouterCore
from ..tokenize.segments import WHOLE_CHARS
from .body import NO_BODY
from .config import ProxyConfig
from .fleet import Fleet, Link
from .handler import BadRequest, Handler, handles, openai_error
from .health import Prober, checker
from .metrics import ProxyMetrics
from .offload import Offload
from .responses import ResponseOwners
from .tokens import Tokens

__all__ = ["BadRequest", "Proxy", "ProxyConfig", "ProxyMetrics", "openai_error"]

log = logging.getLogger("kvwire.proxy.proxy")


def _whole_what(tokenizer: Any) -> str:
    """What a tokenizer without chunks tokenizes again of a prompt that extends another:
    each segment it changed, when special tokens cut its text into segments; else all."""
    if getattr(getattr(tokenizer, "segments", None), "splitter", None) is not None:
        return ("from the start of each segment that changed (the text between two special "
                f"tokens: a chat's turn); one seen before, up to {WHOLE_CHARS // 1024}k "
                "characters, is looked up")
    return ("whole (its text is not cut at special tokens); only a text seen before exactly, "
            f"up to {WHOLE_CHARS // 1024}k characters, is looked up")


class Proxy:
    """The ``/v1`` handler and the engines' health prober: a :class:`~.fleet.Fleet`, a
    :class:`~.handler.Handler` and a :class:`~.health.Prober`, built and wired here."""

    #: what a request with no body of its own (``GET /v1/responses/{id}``) reads as
    no_body = NO_BODY
    handles = staticmethod(handles)

    def __init__(self, core: RouterCore, tokenizer: Any = None, *,
                 tokenize_with_engine: bool = False,
                 config: ProxyConfig | None = None) -> None:
        self.core = core
        self.tok = tokenizer
        self.tokenize_with_engine = tokenize_with_engine
        self.cfg = cfg = config or ProxyConfig()
        self.fleet = Fleet(core.engines, cfg.cooloff, cfg.connect_timeout, cfg.response_ids)
        if not self.fleet.links:
            raise ValueError("no engine has url=: nothing to proxy to")
        self.mode = "engine" if tokenize_with_engine else ("local" if tokenizer else "none")
        if self.mode == "local":
            tokenizer.warm()  # (before it serves: the first chat request would wait for it)
        if self.mode == "none":
            log.warning("no --tokenizer: proxied requests are routed by load only (no "
                        "prefix overlap is computed)")
        self.metrics: ProxyMetrics = self.fleet.metrics
        #: the prompts' token ids (``await proxy.tokens.prompt(body, chat)``)
        self.offload = Offload(tokenizer if self.mode == "local" else None,
                               cfg.tokenize_threads, cfg.tokenize_queue)
        if self.mode == "local" and tokenizer.prefix_reason:
            log.warning("tokenizer %s: no chunks of long text are kept (%s), so a prompt "
                        "extending one seen before is tokenized again %s", tokenizer.name,
                        tokenizer.prefix_reason, _whole_what(tokenizer))
        if self.mode == "local" and getattr(tokenizer, "bpe_reason", ""):
            log.info("tokenizer %s: encoded by the tokenizers library, not kvwire's C "
                     "encoder (%s)", tokenizer.name, tokenizer.bpe_reason)
        self.tokens = Tokens(self.fleet, tokenizer, self.mode, cfg.connect_timeout,
                             self.offload)
        self.metrics.offload = self.offload
        self.handler = Handler(core, self.fleet, self.tokens, cfg)
        #: answer a :class:`~kvwire.http1.server.Request` for a path :meth:`handles` (the
        #: handler's own method: no call in between on the hot path)
        self.handle = self.handler.run
        self.prober = Prober(lambda: self.fleet.links.values(),
                             checker(self.fleet, cfg.probe_timeout), cfg.probe_interval)

    # ------------------------------------------------------------------ the fleet's state

    @property
    def links(self) -> dict[str, Link]:
        return self.fleet.links

    @property
    def counts(self) -> Counter[str]:
        return self.fleet.counts

    @property
    def owners(self) -> ResponseOwners:
        return self.fleet.owners

    @owners.setter
    def owners(self, owners: ResponseOwners) -> None:  # (a fresh table: a restart, forgotten)
        self.fleet.owners = owners

    @property
    def requests(self) -> Counter[tuple[str, int]]:
        return self.fleet.requests

    @property
    def retried(self) -> Counter[tuple[str, str]]:
        return self.fleet.retried

    @property
    def in_flight(self) -> dict[str, int]:
        return self.fleet.in_flight

    @property
    def active(self) -> int:
        return self.fleet.active

    @property
    def prompt_tokens(self) -> dict[str, int]:
        return self.fleet.prompt_tokens

    @property
    def cached_tokens(self) -> dict[str, int]:
        return self.fleet.cached_tokens

    # ------------------------------------------------------------------ health probes

    def start(self) -> None:
        """Start probing the engines' ``/health`` (and reading their ``/v1/models``): on
        the running event loop if called from one (the serving loop), else on a loop of
        its own in one thread."""
        self.prober.start()

    def close(self) -> None:
        """Stop probing (a probe under way is abandoned, its connection closed)."""
        self.prober.close(self.cfg.probe_timeout + 1.0)

    def wait_probed(self, timeout: float) -> bool:
        """Block until every engine has been probed once (tests, start-up)."""
        return self.prober.probed.wait(timeout)

    # ------------------------------------------------------------------ membership

    def add_engine(self, spec: EngineSpec) -> None:
        """Route and proxy to one more engine (call on the serving loop, as the admin
        endpoint does, or before serving). An engine with ``url=`` takes requests once its
        ``/health`` answers and an event stream is live; one without serves ``/route``
        only. Raises as :meth:`RouterCore.add_engine` does, changing nothing."""
        self.core.add_engine(spec)
        if spec.url is None:
            return
        self.fleet.add(spec)
        self.prober.kick()
        log.info("engine %s added (%s)", spec.name, spec.url)

    def remove_engine(self, name: str) -> int | None:
        """Stop routing to engine ``name`` (on the serving loop). Requests already sent there
        run to their end (their load is released then); its idle connections close, and so
        do the others as those requests finish. Returns how many were in flight there, or
        None if no such engine."""
        if not self.core.remove_engine(name):
            return None
        n = self.fleet.remove(name)
        if n is None:  # an engine without url=: routed, never proxied
            return 0
        log.info("engine %s removed (%d requests in flight there)", name, n)
        return n

    # ------------------------------------------------------------------ status

    def healthy(self) -> tuple[bool, str]:
        """Live on both: HTTP health (breaker closed) and at least one live event stream."""
        streams: dict[str, list[str]] = {}
        for t in self.core.targets:
            streams.setdefault(t.engine, []).append(t.stream)
        live = self.fleet.live(self.core.alive, streams)
        if not live:
            return False, "no engine is live on both its HTTP /health and its event stream"
        return True, f"{len(live)}/{len(self.fleet.links)} engines live"

    def status(self) -> dict[str, Any]:
        """``GET /engines``'s ``http`` entries (the same counters /metrics reads)."""
        return self.fleet.status()

    def retries_total(self) -> int:
        return self.fleet.retries_total()

    # ------------------------------------------------------------------ serving

    def ended(self) -> None:
        """A request is over (answered, failed or its client gone): one less active."""
        self.fleet.ended()

    def close_pools(self) -> None:
        """Close the idle engine connections and stop the tokenizer's workers (the serving
        loop is ending)."""
        self.fleet.close_pools()
        self.offload.close()
