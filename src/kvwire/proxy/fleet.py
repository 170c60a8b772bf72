"""The engines the proxy sends to, and what it counts about them: one :class:`Link` per
engine (URL, connection pool, breaker, last probe, models) and the :class:`Fleet` that owns
them, their membership and the proxy's counters.

The fleet is the one owner of this state; the request handler, the relay, the health
prober, ``/metrics`` and ``/engines`` use its public methods and read its public counters.
The counters (``counts``, ``requests``, ``retried``) are plain ``Counter`` objects the
request path adds to directly (a method call per count would buy nothing); the per-engine
ones (``in_flight``, ``prompt_tokens``, ``cached_tokens``) are replaced, never resized in
place, when an engine comes or goes (copy-on-write: the prober and the status sampler
iterate them from another thread), so they change only through the methods here.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import msgspec

from ..consume.engine_spec import EngineSpec
from ..http1 import HttpError
from ..http1.client import Pool
from .decisions import Breaker
from .metrics import ProxyMetrics
from .responses import ResponseOwners

__all__ = ["Fleet", "Link"]

log = logging.getLogger("kvwire.proxy.proxy")

_enc = msgspec.json.Encoder()
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"prompt_tokens_details"\s*:\s*\{[^{}]*?"cached_tokens"\s*:\s*(\d+)')


class Link:
    """One proxied engine: its URL, connection pool, breaker, last probe and models."""

    def __init__(self, spec: EngineSpec, cooloff: float, connect_timeout: float) -> None:
        assert spec.url is not None
        self.name = spec.name
        self.name_b = spec.name.encode()
        self.ranks = spec.ranks
        #: prefill/decode serving: what it does, and (SGLang's protocol) its bootstrap port
        self.role = spec.role
        self.bootstrap_port = spec.bootstrap_port
        self.breaker = Breaker(cooloff)
        self.connect_timeout = connect_timeout
        self.ttft: Any = None  # this engine's histogram children (set by the Fleet)
        self.e2e: Any = None
        self.pool: Pool | None = None  # made in the serving loop, on first use
        self.set_url(spec.url)
        self.http_up = False
        self.models: list[dict[str, Any]] = []
        self.model_ids: frozenset[str] = frozenset()

    def set_url(self, url: str) -> None:
        """Point at ``url`` (``http://HOST:PORT``); new connections go there."""
        u = urlsplit(url)
        self.url = url
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.pool = None

    def client(self) -> Pool:
        """The engine's keep-alive pool (made on first use, on the loop that uses it)."""
        pool = self.pool
        if pool is None:
            pool = self.pool = Pool(self.host, self.port, self.connect_timeout)
        return pool

    def close_pool(self) -> None:
        """Close the idle connections; the others close as their requests end."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    @property
    def up(self) -> bool:
        """Usable: its last /health probe answered and its breaker is closed."""
        return self.http_up and self.breaker.up


class Fleet:
    """The proxied engines (``links``, by name) and the proxy's counters. Membership
    changes on the serving loop; the breakers and models are also set from the prober's
    loop, under a lock of the fleet's own."""

    def __init__(self, specs: Iterable[EngineSpec], cooloff: float = 5.0,
                 connect_timeout: float = 2.0, response_ids: int = 100_000) -> None:
        self.cooloff = cooloff
        self.connect_timeout = connect_timeout
        self.links = {e.name: Link(e, cooloff, connect_timeout) for e in specs if e.url}
        #: the engines' names, in the order given (the stored-response look-up's order)
        self.names = list(self.links)
        self.counts: Counter[str] = Counter()
        #: which engine holds which stored response (OpenAI's Responses API)
        self.owners = ResponseOwners(response_ids)
        #: (engine or "none", HTTP status) of each answered generation request
        self.requests: Counter[tuple[str, int]] = Counter()
        #: (failed engine, Outcome value) of each retry
        self.retried: Counter[tuple[str, str]] = Counter()
        self.in_flight: dict[str, int] = dict.fromkeys(self.links, 0)
        #: requests being answered (from arrival to the end of their answer), all engines
        self.active = 0
        #: prompt and cached tokens of the answers that carried a ``usage`` object
        self.prompt_tokens: dict[str, int] = dict.fromkeys(self.links, 0)
        self.cached_tokens: dict[str, int] = dict.fromkeys(self.links, 0)
        #: prefill/decode pairs (proxy/pairs.py): requests sent per (role, engine), where
        #: role is ``prefill``, ``decode`` or ``both`` (a local prefill); decisions by why
        self.pd_requests: Counter[tuple[str, str]] = Counter()
        self.pd_decisions: Counter[str] = Counter()
        self._known: dict[str, str | None] = {}
        self._known_gen: tuple[int, int] = (-1, -1)  # the generations _known was built at
        self._models_gen = 0  # bumped by the prober each time it sets an engine's models
        self._members_gen = 0  # bumped (on the serving loop) when an engine comes or goes
        self.metrics = ProxyMetrics(self)
        for link in self.links.values():
            self._label(link)
        self._lock = threading.Lock()  # the prober's loop and the serving loop

    # ------------------------------------------------------------------ membership

    def _label(self, link: Link) -> None:
        link.ttft = self.metrics.ttft.labels(link.name)
        link.e2e = self.metrics.e2e.labels(link.name)

    def add(self, spec: EngineSpec) -> Link:
        """One more engine (``spec.url`` set), on the serving loop; counts of an earlier
        engine of the same name carry on (its requests may still be running)."""
        link = Link(spec, self.cooloff, self.connect_timeout)
        self._label(link)
        name = spec.name
        self.in_flight = {**self.in_flight, name: self.in_flight.get(name, 0)}
        self.prompt_tokens = {**self.prompt_tokens, name: self.prompt_tokens.get(name, 0)}
        self.cached_tokens = {**self.cached_tokens, name: self.cached_tokens.get(name, 0)}
        self.links = {**self.links, name: link}
        self.names = list(self.links)
        self._members_gen += 1
        return link

    def remove(self, name: str) -> int | None:
        """Stop sending to engine ``name`` (on the serving loop): its idle connections
        close now, the others as their requests end. Returns how many requests are in
        flight there, or None if it is not proxied."""
        link = self.links.get(name)
        if link is None:
            return None
        self.links = {n: lk for n, lk in self.links.items() if n != name}
        self.names = list(self.links)
        self._members_gen += 1
        if link.pool is not None:
            link.pool.close()  # idle ones now; the rest as their requests end
        return self.in_flight.get(name, 0)

    def close_pools(self) -> None:
        """Close the idle engine connections (the serving loop is ending)."""
        for link in self.links.values():
            link.close_pool()

    # ------------------------------------------------------------------ health

    def up(self, engine: str) -> bool:
        """Engine ``engine``'s HTTP health (the routing core's ``up``: per candidate per
        decision, so :attr:`Link.up` inlined)."""
        link = self.links[engine]
        return link.http_up and link.breaker.up

    def usable(self, model: str | None, tried: set[str]) -> set[str]:
        """The engines a request for ``model`` may go to now: breaker closed, not tried
        yet, serving ``model`` (or not known to serve any list yet)."""
        with self._lock:
            return {n for n, lk in self.links.items() if lk.breaker.up and n not in tried
                    and (model is None or not lk.model_ids or model in lk.model_ids)}

    def failed(self, engine: str) -> None:
        """A request to ``engine`` failed: its breaker opens (for the cool-off)."""
        self.counts["upstream_failures"] += 1
        link = self.links.get(engine)  # (None: removed meanwhile)
        if link is not None:
            with self._lock:
                link.breaker.failure(time.monotonic())

    def probed(self, link: Link, ok: bool, models: list[dict[str, Any]] | None) -> None:
        """A health probe's result (from the prober's loop): ``/health`` answered, and the
        engine's ``/v1/models`` entries if they were read."""
        if models is not None:
            link.models = models
            link.model_ids = frozenset(m["id"] for m in models)
            with self._lock:  # (the serving loop reads it)
                self._models_gen += 1
        now = time.monotonic()
        with self._lock:
            was = link.breaker.up and link.http_up
            link.http_up = ok
            link.breaker.probe(ok, now)
            if was != (link.breaker.up and ok):  # an engine lost is news; one back, less so
                log.log(logging.INFO if ok else logging.WARNING, "engine %s is %s",
                        link.name, "up" if ok else "down")
            if not ok:
                self.counts["probe_failures"] += 1

    def live(self, alive: dict[str, bool], streams: dict[str, list[str]]) -> list[str]:
        """The engines up on HTTP with at least one live event stream (``streams``: each
        engine's streams; ``alive``: each stream's liveness)."""
        return [n for n, link in self.links.items() if link.up
                and any(alive.get(s) for s in streams.get(n, ()))]

    # ------------------------------------------------------------------ models

    def known_models(self) -> dict[str, str | None]:
        """Model id -> parent (LoRA adapters) over the engines; rebuilt only after a probe
        set an engine's list (read first: a list set while this builds is seen next time)."""
        gen = (self._models_gen, self._members_gen)
        if gen == self._known_gen:
            return self._known
        out: dict[str, str | None] = {}
        for link in self.links.values():
            for m in link.models:
                out.setdefault(m["id"], m.get("parent"))
        self._known, self._known_gen = out, gen
        return out

    def check_model(self, model: str | None) -> None:
        """404 (OpenAI's shape) for a ``model`` no engine serves, once engines listed any."""
        if model is not None:
            known = self.known_models()
            if known and model not in known:
                raise HttpError(404, f"The model `{model}` does not exist.", param="model",
                                type="NotFoundError")

    def refused(self, e: HttpError) -> None:
        """Count a request answered ``e`` by the router itself, never sent to an engine: a
        429 is the tokenizer's full queue (proxy/offload.py), not the client's fault."""
        self.counts["tokenize_shed" if e.status == 429 else "bad_requests"] += 1
        self.requests["none", e.status] += 1

    def overloaded(self, router: str) -> HttpError:
        """Count a request refused whole at ``--max-in-flight``, before any work, and the
        429 that tells the client to retry; ``router`` names the command in its message."""
        self.counts["overloaded"] += 1
        self.requests["none", 429] += 1
        return HttpError(429, f"{router} has {self.active} requests in flight, its limit "
                         "(--max-in-flight); retry later", type="RateLimitError",
                         headers=((b"retry-after", b"1"),))

    def models_json(self) -> bytes:
        """``GET /v1/models``'s answer: every engine's models, each id once."""
        seen: dict[str, dict[str, Any]] = {}
        for link in self.links.values():
            for m in link.models:
                seen.setdefault(m["id"], m)
        return _enc.encode({"object": "list", "data": list(seen.values())})

    # ------------------------------------------------------------------ counters

    def began(self) -> None:
        """A request arrived and is being answered: one more active."""
        self.active += 1

    def ended(self) -> None:
        """A request is over (answered, failed or its client gone): one less active."""
        self.active -= 1

    def sending(self, engine: str) -> None:
        """An attempt at ``engine`` starts: one more in flight there."""
        self.counts["attempts"] += 1
        self.in_flight[engine] += 1

    def settled(self, engine: str) -> None:
        """An attempt at ``engine`` is over (its load released)."""
        self.in_flight[engine] -= 1

    def count_usage(self, engine: str, payload: bytes, at: int) -> None:
        """Add an answer's ``usage`` (found at ``at``) to the engine's prompt and cached
        token counts; an answer without ``prompt_tokens_details`` counts 0 cached."""
        if at < 0:
            return
        p = _PROMPT_TOKENS.search(payload, at)
        if p is None:
            return
        self.prompt_tokens[engine] += int(p.group(1))
        c = _CACHED_TOKENS.search(payload, at)
        if c is not None:
            self.cached_tokens[engine] += int(c.group(1))

    def retries_total(self) -> int:
        return sum(self.retried.values())

    def status(self) -> dict[str, Any]:
        """``GET /engines``'s ``http`` entries (the same counters /metrics reads)."""
        out: dict[str, Any] = {
            n: {"url": link.url, "role": link.role, "http_up": link.http_up,
                "breaker_up": link.breaker.up,
                "breaker_opened": link.breaker.opened, "failures": link.breaker.failures,
                "in_flight": self.in_flight[n],
                "requests": {str(st): c for (e, st), c in self.requests.items() if e == n},
                "retries": {why: c for (e, why), c in self.retried.items() if e == n}}
            for n, link in self.links.items()}
        return out | {"counts": dict(self.counts, retries=self.retries_total(),
                                     responses_known=len(self.owners), active=self.active)}
