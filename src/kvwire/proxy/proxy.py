"""``kvwire serve``'s OpenAI-compatible proxy: ``POST /v1/completions``,
``POST /v1/chat/completions`` and ``GET /v1/models`` in front of the engines given with
``url=``, and vLLM's other model endpoints (``forward.PASS``: embeddings, responses,
tokenize, detokenize) forwarded by load, except the Responses API (:mod:`.responses`):
a new conversation is routed by the cache as the chat it renders to, and what names a
stored response goes to the engine holding it. The I/O layer only: decisions (breakers,
retries, the load lifecycle) live in :mod:`.proxy_state`, routing in
:class:`~kvwire.routing.core.RouterCore`.

Per request: decode the few fields routing needs (the body is forwarded unchanged),
tokenize (``--tokenizer``), route, then :mod:`.forward` sends it to the engine over a
keep-alive pool and passes the answer back chunk by chunk as it arrives, on the lean
server of :mod:`kvwire.http1.server`. A client that goes away cancels the upstream request, which
closes its connection: the engine aborts it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from ..consume.engine_spec import EngineSpec
from ..http1 import HttpError
from ..http1.client import Pool, UpstreamError
from ..routing.core import RouterCore
from ..tokenize.content import engine_template_kwargs
from .decisions import Breaker, Lifecycle
from .handler import PASS, PATHS, BadRequest, handle, openai_error
from .health import Prober, probe
from .metrics import ProxyMetrics
from .responses import PREFIX as RESPONSES_PREFIX
from .responses import ResponseOwners, chat_request

__all__ = ["BadRequest", "Proxy", "ProxyConfig", "ProxyMetrics", "openai_error"]

log = logging.getLogger("kvwire.proxy.proxy")

_enc = msgspec.json.Encoder()
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"prompt_tokens_details"\s*:\s*\{[^{}]*?"cached_tokens"\s*:\s*(\d+)')


class _Body(msgspec.Struct):
    """The fields of a generation request the proxy reads (others are ignored here and
    forwarded untouched)."""

    model: str | None = None
    prompt: str | list[Any] | None = None
    messages: list[dict[str, Any]] | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None
    documents: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    cache_salt: str | None = None


_body_dec = msgspec.json.Decoder(_Body)


class _PassBody(msgspec.Struct):
    """What the proxy reads of a pass-through request (``forward.PASS``): which engines
    serve its model, and whether the answer streams."""

    model: str | None = None
    stream: bool | None = False
    cache_salt: str | None = None
    previous_response_id: str | None = None  # /v1/responses: goes where that response is
    # /v1/responses without one: routed by the cache as the chat it renders to
    instructions: Any = None
    input: Any = None
    tools: Any = None
    reasoning: Any = None
    chat_template_kwargs: Any = None


_pass_dec = msgspec.json.Decoder(_PassBody)


@dataclass
class ProxyConfig:
    """``serve``'s proxy flags."""

    retries: int = 2
    cooloff: float = 5.0
    probe_interval: float = 1.0
    #: seconds an engine's /health may take: a loaded engine answers late, and one failed
    #: probe marks it down for the cool-off (until 2026-11-30: max(probe_interval, 0.5))
    probe_timeout: float = 5.0
    connect_timeout: float = 2.0
    first_byte_timeout: float = 60.0
    stall_timeout: float = 300.0
    max_body: int = 32 << 20
    #: stored responses whose engine is remembered (proxy/responses.py)
    response_ids: int = 100_000
    #: requests being answered at once; more are refused with 429 (0: no limit)
    max_in_flight: int = 4096


class _Link:
    """One proxied engine: its URL, breaker, last probe and models."""

    def __init__(self, spec: EngineSpec, cooloff: float) -> None:
        assert spec.url is not None
        self.name = spec.name
        self.name_b = spec.name.encode()
        self.ranks = spec.ranks
        self.breaker = Breaker(cooloff)
        self.ttft: Any = None  # this engine's histogram children (set by the Proxy)
        self.e2e: Any = None
        self.pool: Pool | None = None  # made in the serving loop, on first use
        self.set_url(spec.url)
        self.http_up = False
        self.models: list[dict[str, Any]] = []
        self.model_ids: frozenset[str] = frozenset()

    def set_url(self, url: str) -> None:
        """Point at ``url`` (``http://HOST:PORT``); new connections go there."""
        from urllib.parse import urlsplit

        u = urlsplit(url)
        self.url = url
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.pool = None


class Proxy:
    """The ``/v1`` handler and the engines' health prober (:mod:`.health`)."""

    #: what a request with no body of its own (``GET /v1/responses/{id}``) reads as
    no_body = _PassBody()

    def __init__(self, core: RouterCore, tokenizer: Any = None, *,
                 tokenize_with_engine: bool = False,
                 config: ProxyConfig | None = None) -> None:
        self.core = core
        self.tok = tokenizer
        self.tokenize_with_engine = tokenize_with_engine
        self.cfg = config or ProxyConfig()
        self.links = {e.name: _Link(e, self.cfg.cooloff) for e in core.engines if e.url}
        if not self.links:
            raise ValueError("no engine has url=: nothing to proxy to")
        self._names = list(self.links)
        self.mode = "engine" if tokenize_with_engine else ("local" if tokenizer else "none")
        if self.mode == "none":
            log.warning("no --tokenizer: proxied requests are routed by load only (no "
                        "prefix overlap is computed)")
        self.counts: Counter[str] = Counter()
        #: which engine holds which stored response (OpenAI's Responses API)
        self.owners = ResponseOwners(self.cfg.response_ids)
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
        self._known: dict[str, str | None] = {}
        self._known_gen: tuple[int, int] = (-1, -1)  # the generations _known was built at
        self._models_gen = 0  # bumped by the prober each time it sets an engine's models
        self._members_gen = 0  # bumped (on the serving loop) when an engine comes or goes
        self.metrics = ProxyMetrics(self)
        for link in self.links.values():
            self._label(link)
        self._lock = threading.Lock()  # breakers: the prober's loop and the serving loop
        self._prober = Prober(lambda: self.links.values(), self._probe,
                              self.cfg.probe_interval)

    # ------------------------------------------------------------------ health probes

    def start(self) -> None:
        """Start probing the engines' ``/health`` (and reading their ``/v1/models``): on
        the running event loop if called from one (the serving loop), else on a loop of
        its own in one thread."""
        self._prober.start()

    def close(self) -> None:
        """Stop probing (a probe under way is abandoned, its connection closed)."""
        self._prober.close(self.cfg.probe_timeout + 1.0)

    # ------------------------------------------------------------------ membership

    def _label(self, link: _Link) -> None:
        link.ttft = self.metrics.ttft.labels(link.name)
        link.e2e = self.metrics.e2e.labels(link.name)

    def add_engine(self, spec: EngineSpec) -> None:
        """Route and proxy to one more engine (call on the serving loop, as the admin
        endpoint does, or before serving). An engine with ``url=`` takes requests once its
        ``/health`` answers and an event stream is live; one without serves ``/route``
        only. Raises as :meth:`RouterCore.add_engine` does, changing nothing."""
        self.core.add_engine(spec)
        if spec.url is None:
            return
        link = _Link(spec, self.cfg.cooloff)
        self._label(link)
        name = spec.name
        # copy-on-write: the prober and the status sampler iterate these; counts of
        # an earlier engine of the same name carry on (its requests may still be running)
        self.in_flight = {**self.in_flight, name: self.in_flight.get(name, 0)}
        self.prompt_tokens = {**self.prompt_tokens, name: self.prompt_tokens.get(name, 0)}
        self.cached_tokens = {**self.cached_tokens, name: self.cached_tokens.get(name, 0)}
        self.links = {**self.links, name: link}
        self._names = list(self.links)
        self._members_gen += 1
        self._prober.kick()
        log.info("engine %s added (%s)", name, spec.url)

    def remove_engine(self, name: str) -> int | None:
        """Stop routing to engine ``name`` (on the serving loop). Requests already sent there
        run to their end (their load is released then); its idle connections close, and so
        do the others as those requests finish. Returns how many were in flight there, or
        None if no such engine."""
        if not self.core.remove_engine(name):
            return None
        link = self.links.get(name)
        if link is None:  # an engine without url=: routed, never proxied
            return 0
        self.links = {n: lk for n, lk in self.links.items() if n != name}
        self._names = list(self.links)
        self._members_gen += 1
        if link.pool is not None:
            link.pool.close()  # idle ones now; the rest as their requests end
        n = self.in_flight.get(name, 0)
        log.info("engine %s removed (%d requests in flight there)", name, n)
        return n

    async def _probe(self, link: _Link, refresh: bool) -> None:
        ok, models = await probe(link.host, link.port, self.cfg.probe_timeout,
                                 refresh or not link.models)
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

    def wait_probed(self, timeout: float) -> bool:
        """Block until every engine has been probed once (tests, start-up)."""
        return self._prober.probed.wait(timeout)

    def healthy(self) -> tuple[bool, str]:
        """Live on both: HTTP health (breaker closed) and at least one live event stream."""
        alive = self.core.alive
        live = [n for n, link in self.links.items() if link.http_up and link.breaker.up
                and any(alive.get(s) for s in _streams(self.core, n))]
        if not live:
            return False, "no engine is live on both its HTTP /health and its event stream"
        return True, f"{len(live)}/{len(self.links)} engines live"

    def status(self) -> dict[str, Any]:
        """``GET /engines``'s ``http`` entries (the same counters /metrics reads)."""
        out: dict[str, Any] = {
            n: {"url": link.url, "http_up": link.http_up, "breaker_up": link.breaker.up,
                "breaker_opened": link.breaker.opened, "failures": link.breaker.failures,
                "in_flight": self.in_flight[n],
                "requests": {str(st): c for (e, st), c in self.requests.items() if e == n},
                "retries": {why: c for (e, why), c in self.retried.items() if e == n}}
            for n, link in self.links.items()}
        return out | {"counts": dict(self.counts, retries=self.retries_total(),
                                     responses_known=len(self.owners), active=self.active)}

    def retries_total(self) -> int:
        return sum(self.retried.values())

    # ------------------------------------------------------------------ serving

    @staticmethod
    def handles(path: bytes) -> bool:
        return (path in PATHS or path in PASS or path == b"/v1/models"
                or path.startswith(RESPONSES_PREFIX))

    def handle(self, req: Any) -> None:
        """Answer a :class:`~kvwire.http1.server.Request` for a path :meth:`handles`."""
        handle(self, req)

    def ended(self) -> None:
        """A request is over (answered, failed or its client gone): one less active."""
        self.active -= 1

    def close_pools(self) -> None:
        """Close the idle engine connections (the serving loop is ending)."""
        for link in self.links.values():
            if link.pool is not None:
                link.pool.close()
                link.pool = None

    def _models(self) -> bytes:
        seen: dict[str, dict[str, Any]] = {}
        for link in self.links.values():
            for m in link.models:
                seen.setdefault(m["id"], m)
        return _enc.encode({"object": "list", "data": list(seen.values())})

    # ------------------------------------------------------------------ one request

    def _check(self, body: bytes, chat: bool) -> _Body:
        req = _decode(_body_dec, body)
        if chat and req.messages is None:
            raise HttpError(400, "`messages` is required", param="messages")
        if not chat and req.prompt is None:
            raise HttpError(400, "`prompt` is required", param="prompt")
        self._check_model(req.model)
        return req

    def _check_pass(self, body: bytes) -> _PassBody:
        """A pass-through body: a JSON object whose ``model`` (if any) an engine serves;
        the rest is the engine's to judge (its errors pass through with their status)."""
        req = _decode(_pass_dec, body)
        self._check_model(req.model)
        return req

    def _check_model(self, model: str | None) -> None:
        if model is not None:
            known = self._known_models()
            if known and model not in known:
                raise HttpError(404, f"The model `{model}` does not exist.", param="model",
                                type="NotFoundError")

    def _known_models(self) -> dict[str, str | None]:
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

    async def _tokens(self, req: _Body, chat: bool) -> Sequence[int]:
        """The prompt's token ids as the engine will compute them ([] when unknown: the
        request is routed by load only)."""
        prompt = req.prompt
        if not chat:
            if isinstance(prompt, list):
                if not prompt:
                    raise HttpError(400, "`prompt` is empty", param="prompt")
                first = prompt[0]
                if isinstance(first, int) and not isinstance(first, bool):
                    if not all(type(t) is int and t >= 0 for t in prompt):
                        raise HttpError(400, "`prompt` token ids must be integers >= 0",
                                        param="prompt")
                    return prompt  # token ids: no tokenizing
                if isinstance(first, list):
                    if not all(type(t) is int and t >= 0 for t in first):
                        raise HttpError(400, "`prompt` token ids must be integers >= 0",
                                        param="prompt")
                    return first
                if not isinstance(first, str):
                    raise HttpError(400, "`prompt` must be a string, token ids, or a list "
                                    "of either", param="prompt")
                prompt = first
        if self.mode == "none":
            return ()
        t0 = time.perf_counter()
        if self.mode == "engine":
            toks = await self._engine_tokens(req, chat, prompt)
            self.metrics.tokenize.observe(time.perf_counter() - t0)
            return toks
        from ..tokenize import TokenizerError

        try:
            if chat:
                toks = self.tok.encode_engine_chat(  # rendered as the engine renders it
                    req.messages, tools=req.tools,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    reasoning_effort=req.reasoning_effort, documents=req.documents,
                    chat_template_kwargs=req.chat_template_kwargs)
            else:
                toks = self.tok.encode(prompt, add_special_tokens=req.add_special_tokens)
        except (TokenizerError, TypeError, KeyError, AttributeError, ValueError) as e:
            raise HttpError(400, f"cannot tokenize the request: {e}",
                            param="messages" if chat else "prompt") from None
        self.metrics.tokenize.observe(time.perf_counter() - t0)
        return toks

    async def _response_tokens(self, body: _PassBody) -> Sequence[int]:
        """A ``/v1/responses`` request's token ids, rendered as the chat vLLM makes of it
        (proxy/responses.py); [] (routed by load, counted) when it holds what that does
        not map or cannot be tokenized here: the engine judges it."""
        if self.mode == "none":
            return ()
        conv = chat_request(body.instructions, body.input, body.tools, body.reasoning)
        if conv is not None and (body.chat_template_kwargs is None
                                 or isinstance(body.chat_template_kwargs, dict)):
            try:
                return await self._tokens(_Body(
                    model=body.model, messages=conv.messages, tools=conv.tools,
                    add_generation_prompt=not conv.continue_final_message,
                    continue_final_message=conv.continue_final_message,
                    reasoning_effort=conv.reasoning_effort,
                    chat_template_kwargs=body.chat_template_kwargs), True)
            except HttpError:
                pass
        self.counts["responses_by_load"] += 1
        return ()

    async def _engine_tokens(self, req: _Body, chat: bool, prompt: Any) -> Sequence[int]:
        q: dict[str, Any] = {"model": req.model}
        if chat:  # /tokenize takes no effort or documents: they go as template variables
            kw = engine_template_kwargs(req.chat_template_kwargs,
                                        add_generation_prompt=req.add_generation_prompt,
                                        continue_final_message=req.continue_final_message,
                                        reasoning_effort=req.reasoning_effort,
                                        documents=req.documents)
            q.update(messages=req.messages, tools=req.tools)
            # The defaults are left out: vLLM's are the same, and SGLang renders messages
            # "as for a chat completion" only when add_generation_prompt is absent (given,
            # it renders them as given, and only with a jinja template).
            if not kw.pop("add_generation_prompt"):
                q["add_generation_prompt"] = False
            if kw.pop("continue_final_message"):
                q["continue_final_message"] = True
            q["chat_template_kwargs"] = kw or None
        else:
            q.update(prompt=prompt, add_special_tokens=req.add_special_tokens)
        for link in self.links.values():
            if not (link.http_up and link.breaker.up):
                continue
            try:
                r = await asyncio.wait_for(self._pool(link).request(
                    b"POST", b"/tokenize", [(b"content-type", b"application/json")],
                    _enc.encode(q)), self.cfg.connect_timeout)
                payload = await asyncio.wait_for(r.read(), self.cfg.connect_timeout)
            except (UpstreamError, asyncio.TimeoutError):
                continue
            if r.status == 200:
                try:
                    toks = msgspec.json.decode(payload).get("tokens")
                except (msgspec.DecodeError, AttributeError):
                    toks = None
                if isinstance(toks, list):
                    return toks
            break  # the engine refused it: it will refuse the request too, with reasons
        self.counts["tokenize_failures"] += 1
        return ()

    def _pool(self, link: _Link) -> Pool:
        if link.pool is None:
            link.pool = Pool(link.host, link.port, self.cfg.connect_timeout)
        return link.pool

    def _up(self, engine: str) -> bool:
        link = self.links[engine]
        return link.http_up and link.breaker.up

    def _first(self, lc: Lifecycle) -> None:
        drop = lc.first_token()
        if drop:
            self.core.first_token(lc.request_id, drop)

    def _count_usage(self, name: str, payload: bytes, at: int) -> None:
        """Add an answer's ``usage`` (found at ``at``) to the engine's prompt and cached
        token counts; an answer without ``prompt_tokens_details`` counts 0 cached."""
        if at < 0:
            return
        p = _PROMPT_TOKENS.search(payload, at)
        if p is None:
            return
        self.prompt_tokens[name] += int(p.group(1))
        c = _CACHED_TOKENS.search(payload, at)
        if c is not None:
            self.cached_tokens[name] += int(c.group(1))


def _decode(dec: msgspec.json.Decoder, body: bytes) -> Any:
    try:
        return dec.decode(body)
    except msgspec.ValidationError as e:
        msg = str(e)
        param = msg.rsplit("at `$.", 1)[-1].rstrip("`") if "at `$." in msg else None
        raise HttpError(400, f"invalid request body: {msg}", param=param) from None
    except msgspec.DecodeError as e:
        raise HttpError(400, f"malformed JSON body: {e}", param="body") from None


def _streams(core: RouterCore, engine: str) -> list[str]:
    return [t.stream for t in core.targets if t.engine == engine]
