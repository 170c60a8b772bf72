"""Prefill/decode pairs through the proxy: one generation request served by two engines, in
the protocol the engines speak (``kvwire serve --pd-protocol``).

The routing core chooses the pair (:meth:`~kvwire.routing.core.RouterCore.route_pair`:
decode first, then whether to disaggregate, then the prefill engine); this module talks to
the two engines:

* **vllm** (sequential, as vLLM's NixlConnector proxies do): the client's body to the
  prefill engine with ``kv_transfer_params`` asking for a remote decode, ``stream`` false,
  ``max_tokens`` (and ``max_completion_tokens`` if given) 1, no ``stream_options``, no
  ``min_tokens``/``min_completion_tokens``; its answer's ``kv_transfer_params`` (where the
  blocks are held) then go with the client's own body to the decode engine, whose answer is
  the client's. Both get the same ``X-Request-Id``.
* **sglang** (concurrent, as SGLang's router does): the same body to both, with
  ``bootstrap_host`` (the prefill engine's host), ``bootstrap_port`` (its ``bootstrap_port``)
  and ``bootstrap_room`` (a random integer below 2^63; a list, one per prompt, for a batch of
  prompts); the decode answer is the client's, the prefill answer is drained.

The router owns these fields: a client's own ``kv_transfer_params`` or ``bootstrap_*`` is
dropped (a local prefill) or overwritten (a remote one), whatever its shape.

Failures: a prefill that fails before the decode side started (refused, 5xx, timed out,
an answer without ``kv_transfer_params``) is tried on the next prefill engine, up to
``--retries`` times, then falls back per ``--pd-fallback``: ``local`` (prefill on the decode
engine) or ``fail`` (502). A decode engine that is refused or times out before the client
got a byte is replaced by the next (vllm: with the same ``kv_transfer_params``, the blocks
are still held; sglang: the pair again, with a new room); one that answers 5xx is taken
for a failed transfer (the prefill engine gone, its lease expired): the pair runs again
with another prefill engine, as after a failed prefill, and no breaker opens. Every wait is bounded (``--first-byte-timeout``
for an answer to begin, ``--stall-timeout`` for a drained prefill answer to end). A client
that goes away cancels both sides: their connections close, the engines abort, and both
reservations are released.

Load: each side holds its own reservation (the routing core's); the prefill side's ends
with the prefill answer, the decode side's as any proxied request's.

Time to first token, for a disaggregated streamed answer, is split into its phases
(``kvwire_proxy_pd_ttft_seconds{phase}``, :class:`_Phases`): the prefill (the prefill
answer's time: one token, so its end is the prefill's end), the KV transfer (only the
decode engine knows it: kvwire's engine sends it in the ``x-kvwire-kv-transfer-seconds``
header of its answer, whose head it sends with the first token, once the transfer is over)
and the first decode token (the rest, to the decode answer's first bytes). With an engine
that does not say (vLLM's, SGLang's), the transfer stays inside the decode phase.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from ..http1.client import UpstreamError
from ..routing.core import Routed, RoutedPair, RouteError
from .decisions import Outcome, marks_down, should_retry
from .relay import openai_error

if TYPE_CHECKING:
    from ..http1.server import Request
    from ..routing.core import RouterCore
    from .config import ProxyConfig
    from .fleet import Fleet

__all__ = ["PD_FIELDS", "VLLM_PREFILL_PARAMS", "Pairs", "sglang_body", "vllm_decode_body",
           "vllm_prefill_body"]

_enc = msgspec.json.Encoder()

#: The body fields of the two protocols: the router's to set, never the client's.
PD_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")
#: What the prefill request asks of a vLLM prefill engine (vLLM's own proxy sends this).
VLLM_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                       "remote_engine_id": None, "remote_block_ids": None,
                       "remote_host": None, "remote_port": None}
_RETRYABLE = (Outcome.REFUSED, Outcome.SERVER_ERROR, Outcome.TIMEOUT)


def vllm_prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's body (vLLM's protocol): the client's, computing the prompt and
    one token, whole, with the blocks held for a remote decode."""
    out = {k: v for k, v in body.items()
           if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
    out["kv_transfer_params"] = dict(VLLM_PREFILL_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def vllm_decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The decode engine's body (vLLM's protocol): the client's, with the prefill answer's
    ``kv_transfer_params``."""
    return {**body, "kv_transfer_params": params}


def sglang_body(body: dict[str, Any], host: str, port: int, rng: random.Random
                ) -> dict[str, Any]:
    """Both engines' body (SGLang's protocol): the client's with the prefill engine's
    bootstrap host and port and a fresh room (a random integer below 2^63); for a batch
    of prompts (a completion's list of strings, or of token-id lists), a list of each, one per prompt."""
    p = body.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        n = len(p)
        return {**body, "bootstrap_host": [host] * n, "bootstrap_port": [port] * n,
                "bootstrap_room": [rng.getrandbits(63) for _ in range(n)]}
    return {**body, "bootstrap_host": host, "bootstrap_port": port,
            "bootstrap_room": rng.getrandbits(63)}


class _Try(NamedTuple):
    """How one pair (or one side) went: ``sent`` (the client has its answer, or its
    stream started), ``prefill`` (the prefill failed, the decode side did not start, or
    the transfer failed), ``decode`` (the decode engine failed, refused or timed out,
    before the client got a byte), ``transfer`` (the decode engine answered 5xx after a
    remote prefill), ``error`` (an answer not to retry, ``last``, the client gets it)."""

    kind: str
    outcome: Outcome = Outcome.OK
    last: tuple[int, bytes] | None = None
    engine: str = "none"


_SENT = _Try("sent")

#: the decode engine's report of its KV transfer (kvwire's engine), wall seconds, sent
#: with a streamed answer's head when the request asks (``_HOLD``: the head then waits for
#: the first token; other engines ignore the ask)
TRANSFER_HEADER = b"x-kvwire-kv-transfer-seconds"
_HOLD = (b"x-kvwire-hold-head", b"1")


class _Phases:
    """One disaggregated streamed answer's time to first token, split (observed once,
    when both the prefill answer's end and the decode answer's first bytes are known:
    under SGLang's protocol either may come first). vLLM's protocol is sequential: the
    decode phase runs from the decode request to its first bytes. SGLang's is concurrent:
    the decode request waits for the prefill, so its phases start where the prefill
    ended. The transfer the decode engine reports is the part of that wait that was
    moving KV (never more than the wait)."""

    __slots__ = ("hist", "concurrent", "t_p", "prefill", "t_d", "first", "transfer", "done")

    def __init__(self, hist: Any, concurrent: bool) -> None:
        self.hist = hist
        self.concurrent = concurrent
        self.t_p = time.perf_counter()  # the prefill request sent (about)
        self.prefill: float | None = None  # its answer's end, seconds after t_p
        self.t_d = 0.0  # the (last) decode request sent
        self.first: float | None = None  # the decode answer's first bytes (perf_counter)
        self.transfer: float | None = None  # the decode engine's report
        self.done = False

    def head(self, headers: dict[bytes, bytes]) -> None:
        v = headers.get(TRANSFER_HEADER)
        try:
            t = float(v) if v is not None else None
        except ValueError:
            t = None
        self.transfer = t if t is not None and t >= 0 and t != float("inf") else None

    def observe(self) -> None:
        if self.done or self.prefill is None or self.first is None:
            return
        self.done = True
        start = self.t_p + self.prefill if self.concurrent else self.t_d
        wait = max(self.first - start, 0.0)
        h = self.hist
        h.labels("prefill").observe(self.prefill)
        if self.transfer is not None:
            moved = min(self.transfer, wait)
            h.labels("transfer").observe(moved)
            wait -= moved
        h.labels("decode").observe(wait)


@dataclass
class _Ctx:
    """One request's state across its tries."""

    req: Request
    chat: bool
    tokens: Any
    lora: str | None
    salt: str | None
    model: str | None
    body: dict[str, Any]  # the client's, without the protocols' fields
    headers: list[tuple[bytes, bytes]]  # forwarded to both (x-request-id added)
    stream: bool
    loop: asyncio.AbstractEventLoop
    tried_p: set[str] = field(default_factory=set)
    tried_d: set[str] = field(default_factory=set)
    first: bool = True  # the first request sent (the proxy's overhead is observed once)
    #: the reservations whose side began (its coroutine ran): those end there, the
    #: others (a task cancelled before its first step) here
    started: set[str] = field(default_factory=set)


class Pairs:
    """The proxy's prefill/decode flows (:meth:`serve`), for the :class:`~.handler.Handler`,
    whose ``attempt`` (one try at one engine, its answer relayed to the client) serves the
    decode side."""

    def __init__(self, core: RouterCore, fleet: Fleet, cfg: ProxyConfig,
                 attempt: Callable[..., Awaitable[tuple[Outcome, bool, Any]]]) -> None:
        self.attempt = attempt
        self.core = core
        self.fleet = fleet
        self.cfg = cfg
        self.protocol = self.cfg.pd_protocol or "vllm"
        self.metrics = self.fleet.metrics
        self.rng = random.Random()
        #: drained SGLang prefill answers still running after their request's task ended
        self._bg: set[asyncio.Task] = set()

    @property
    def active(self) -> bool:
        """Whether generation requests are routed as pairs: a protocol was asked for, or
        an engine has a role other than both."""
        return self.cfg.pd_protocol is not None or self.core.has_roles

    def _usable(self, model: str | None, tried: set[str], role: str) -> set[str]:
        """The engines usable now that can take ``role``'s side (never ``role`` of the
        other kind)."""
        links = self.fleet.links
        other = "decode" if role == "prefill" else "prefill"
        return {n for n in self.fleet.usable(model, tried) if links[n].role != other}

    def usable_for_any(self, ok: set[str]) -> set[str]:
        """Of ``ok``, the engines a request not served as a pair may go to (no
        prefill-only engine: it does not decode)."""
        links = self.fleet.links
        return {n for n in ok if links[n].role != "prefill"}

    # ------------------------------------------------------------------ one request

    async def serve(self, req: Request, chat: bool, body: Any, tokens: Any,
                    lora: str | None, headers: list[tuple[bytes, bytes]],
                    stream: bool, loop: asyncio.AbstractEventLoop) -> None:
        """Answer a generation request as a pair (or locally, as the decider says)."""
        fleet, core, cfg = self.fleet, self.core, self.cfg
        raw = msgspec.json.decode(req.body)  # (an object: the handler decoded it already)
        clean = {k: v for k, v in raw.items() if k not in PD_FIELDS}
        xid = next((v for k, v in headers if k == b"x-request-id"), None) or (
            uuid.uuid4().hex.encode())
        headers = [*(h for h in headers if h[0] != b"x-request-id"), (b"x-request-id", xid)]
        ctx = _Ctx(req, chat, tokens, lora, body.cache_salt, body.model, clean, headers,
                   stream, loop)
        failed_p: list[str] = []  # prefill engines that failed this request
        fallback = False  # every prefill try failed: local from now on
        decode_failures = 0
        last: tuple[int, bytes] | None = None
        last_engine = "none"
        for _ in range(2 * cfg.retries + 3):  # (each turn marks an engine tried, or ends)
            usable = self._usable(ctx.model, ctx.tried_d, "decode")
            p_ok = set() if fallback else self._usable(ctx.model, ctx.tried_p, "prefill")
            try:
                pair = core.route_pair(tokens, lora, ctx.salt, usable.__contains__, fleet.up,
                                       prefill_usable=p_ok.__contains__)
            except RouteError as e:
                if last is None:
                    last = (e.status, openai_error(e.status, str(e), "ServiceUnavailable"))
                break
            if failed_p and pair.prefill is None:
                if cfg.pd_fallback == "fail":  # no local prefill after a failed one
                    core.finish(pair.decode.request_id, None)
                    fleet.pd_decisions["fallback_refused"] += 1
                    last = (502, openai_error(
                        502, f"the prefill failed on {', '.join(failed_p)} and "
                        "--pd-fallback is fail", "BadGateway"))
                    break
                fleet.counts["pd_fallbacks"] += 1
                fleet.pd_decisions["fallback"] += 1
            else:
                fleet.pd_decisions[pair.why] += 1
            if pair.prefill is None:
                res = await self._local(ctx, pair.decode)
            elif self.protocol == "vllm":
                res = await self._vllm(ctx, pair)
            else:
                res = await self._sglang(ctx, pair)
            if res.kind == "sent":
                return
            last, last_engine = res.last, res.engine
            if res.kind == "prefill":
                ctx.tried_p.add(res.engine)
                failed_p.append(res.engine)
                fleet.counts["pd_prefill_failures"] += 1
                fleet.retried[res.engine, res.outcome.value] += 1
                if len(failed_p) > cfg.retries:
                    fallback = True
                continue
            if res.kind == "decode":
                ctx.tried_d.add(res.engine)
                if should_retry(res.outcome, decode_failures, cfg.retries, False):
                    decode_failures += 1
                    fleet.retried[res.engine, res.outcome.value] += 1
                    continue
            break
        status, payload = last or (502, openai_error(502, "no engine answered", "BadGateway"))
        fleet.requests[last_engine, status] += 1
        req.respond(status, payload)

    # ------------------------------------------------------------------ the sides

    def _named(self, prefill: str, decode: str) -> bytes:
        return f"prefill={prefill},decode={decode}".encode()

    async def _local(self, ctx: _Ctx, d: Routed) -> _Try:
        """The whole request on the decode engine (its prefill local)."""
        self.fleet.pd_requests["both", d.engine] += 1
        return await self._decode(ctx, d, d.engine, _enc.encode(ctx.body), remote=False)

    async def _decode(self, ctx: _Ctx, d: Routed, prefill: str, body: bytes,
                      remote: bool = True, gate: Any = None,
                      phases: _Phases | None = None) -> _Try:
        """The decode side: its answer is the client's (relayed as any proxied answer);
        ``phases`` learns when it was sent, its head and its first bytes."""
        ctx.started.add(d.request_id)
        fleet = self.fleet
        if d.engine not in fleet.links:  # removed meanwhile
            self.core.finish(d.request_id, None)
            return _Try("decode", Outcome.REFUSED, (502, openai_error(
                502, f"engine {d.engine} was removed", "BadGateway")), d.engine)
        if remote:
            fleet.pd_requests["decode", d.engine] += 1
        t = time.perf_counter()
        hist = self.metrics.pd_decode_first.labels(d.engine) if remote else None
        if phases is not None:
            phases.t_d, phases.transfer = t, None

        def first() -> None:
            now = time.perf_counter()
            if hist is not None:
                hist.observe(now - t)
            if phases is not None:
                phases.first = now
                phases.observe()

        first_send, ctx.first = ctx.first, False
        headers = [*ctx.headers, _HOLD] if phases is not None else ctx.headers
        outcome, sent, last = await self.attempt(
            ctx.req, d, headers, ctx.stream, first_send, ctx.loop, body=body,
            named=self._named(prefill, d.engine), on_first=first, gate=gate,
            on_head=phases.head if phases is not None else None)
        if sent:
            return _SENT
        if remote and outcome is Outcome.SERVER_ERROR:
            # a decode engine's 5xx after a remote prefill is most likely the transfer
            # failing (the prefill engine gone, its lease expired): not the decode engine's
            # fault, and the held blocks are not to be tried again
            return _Try("transfer", outcome, last, d.engine)
        if marks_down(outcome):
            fleet.failed(d.engine)
        return _Try("decode" if outcome in _RETRYABLE else "error", outcome, last, d.engine)

    async def _prefill(self, ctx: _Ctx, p: Routed, body: bytes, read_timeout: float,
                       head: asyncio.Future | None = None, phases: _Phases | None = None
                       ) -> tuple[bytes | None, _Try | None]:
        """Send the prefill request and read its whole answer: (the answer, None), or
        (None, how it failed). The prefill side's reservation ends here on every path
        (learnt from, as a first token, when the answer came). ``head`` is set when the
        answer's head came (True: 200) or the request failed before (False); ``phases``
        learns when the answer ended."""
        ctx.started.add(p.request_id)
        fleet, core, cfg = self.fleet, self.core, self.cfg
        name = p.engine
        link = fleet.links.get(name)
        if link is None:  # removed meanwhile
            core.finish(p.request_id, None)
            return None, _Try("prefill", Outcome.REFUSED, (502, openai_error(
                502, f"engine {name} was removed", "BadGateway")), name)
        fleet.sending(name)
        fleet.pd_requests["prefill", name] += 1
        headers = ctx.headers
        if link.ranks > 1:
            headers = [*headers, (b"x-data-parallel-rank", str(p.rank).encode())]
        req = ctx.req
        path = req.path + b"?" + req.query if req.query else req.path
        t = time.perf_counter()
        sent: list[float] = []
        resp = None
        done = False
        try:
            try:
                resp = await link.client().request(b"POST", path, headers, body, sent,
                                                   time.perf_counter, cfg.first_byte_timeout)
                if head is not None and not head.done():
                    head.set_result(resp.status == 200)
                payload = await resp.read(read_timeout)
            except asyncio.TimeoutError:
                fleet.failed(name)
                return None, _Try("prefill", Outcome.TIMEOUT, (504, openai_error(
                    504, f"prefill engine {name} did not answer in time", "Timeout")), name)
            except UpstreamError as e:
                fleet.failed(name)
                return None, _Try("prefill", Outcome.REFUSED, (502, openai_error(
                    502, f"prefill engine {name} unreachable: {e}", "BadGateway")), name)
            if resp.status >= 500:
                fleet.failed(name)
                return None, _Try("prefill", Outcome.SERVER_ERROR, (resp.status, payload),
                                  name)
            if resp.status != 200:  # the request's own fault: the client is told as is
                return None, _Try("error", Outcome.OK, (resp.status, payload), name)
            done = True
            took = time.perf_counter() - t
            self.metrics.pd_prefill.labels(name).observe(took)
            if phases is not None:
                phases.t_p, phases.prefill = t, took
                phases.observe()
            return payload, None
        finally:
            if head is not None and not head.done():
                head.set_result(False)
            if done:
                core.first_token(p.request_id, p.prefill)  # (teaches its prefill rate)
            core.finish(p.request_id, None)
            fleet.settled(name)
            if resp is not None:
                resp.close()  # unfinished: the connection closes and the engine aborts
            if ctx.first and sent:
                ctx.first = False
                self.metrics.overhead.observe(sent[0] - req.t0)

    # ------------------------------------------------------------------ vLLM: sequential

    async def _vllm(self, ctx: _Ctx, pair: RoutedPair) -> _Try:
        """Prefill, then decode with what the prefill engine holds; a decode engine that
        fails before the client got a byte is replaced by the next (same blocks)."""
        p, d = pair.prefill, pair.decode
        assert p is not None
        phases = _Phases(self.metrics.pd_ttft, False) if ctx.stream else None
        try:
            payload, failed = await self._prefill(
                ctx, p, _enc.encode(vllm_prefill_body(ctx.body)), self.cfg.first_byte_timeout,
                phases=phases)
        except BaseException:
            self.core.finish(d.request_id, None)  # the decode side never started
            raise
        if failed is None:
            params = _transfer_params(payload)
            if params is None:
                failed = _Try("prefill", Outcome.SERVER_ERROR, (502, openai_error(
                    502, f"prefill engine {p.engine} answered without kv_transfer_params "
                    "(is it a prefill engine of vLLM's protocol?)", "BadGateway")), p.engine)
        if failed is not None:
            self.core.finish(d.request_id, None)
            return failed
        body = _enc.encode(vllm_decode_body(ctx.body, params))
        for attempt in range(self.cfg.retries + 1):
            res = await self._decode(ctx, d, p.engine, body, phases=phases)
            if res.kind == "transfer":  # the pair again, with another prefill engine
                return _Try("prefill", res.outcome, res.last, p.engine)
            if res.kind != "decode":
                return res
            ctx.tried_d.add(d.engine)
            if not should_retry(res.outcome, attempt, self.cfg.retries, False):
                return _Try("error", res.outcome, res.last, res.engine)
            self.fleet.retried[d.engine, res.outcome.value] += 1
            ok = self._usable(ctx.model, ctx.tried_d, "decode")
            try:
                d = self.core.route_proxy(ctx.tokens, ctx.lora, ctx.salt, ok.__contains__,
                                          self.fleet.up)
            except RouteError:
                return _Try("error", res.outcome, res.last, res.engine)
        return _Try("error")  # (not reached: the last attempt returns)

    # ------------------------------------------------------------------ SGLang: concurrent

    async def _sglang(self, ctx: _Ctx, pair: RoutedPair) -> _Try:
        """Both at once; the decode answer is the client's, the prefill answer drained. A
        prefill that fails before its answer began ends the decode request too: the decode
        answer reaches the client only once the prefill engine has answered (its head), so
        a prefill engine that is refused, fails or times out is retried elsewhere even when
        the decode engine started its stream at once."""
        p, d = pair.prefill, pair.decode
        assert p is not None
        link = self.fleet.links.get(p.engine)
        host, port = (link.host, link.bootstrap_port) if link is not None else ("", 0)
        body = _enc.encode(sglang_body(ctx.body, host, port, self.rng))
        loop = ctx.loop
        head: asyncio.Future = loop.create_future()
        phases = _Phases(self.metrics.pd_ttft, True) if ctx.stream else None
        p_task = loop.create_task(self._prefill(ctx, p, body, self.cfg.stall_timeout, head,
                                                phases))
        self._bg.add(p_task)
        p_task.add_done_callback(self._bg.discard)

        async def gate() -> bool:  # (bounded: the prefill request's own timeouts set it)
            return await asyncio.shield(head)

        d_task = loop.create_task(self._decode(ctx, d, p.engine, body, gate=gate,
                                               phases=phases))
        try:
            await asyncio.wait((p_task, d_task), return_when=asyncio.FIRST_COMPLETED)
            if not d_task.done():
                failed = _failed(p_task)
                # before the decode answer began: the decode request ends too, retried
                if failed is not None and d_task.cancel():
                    await asyncio.wait((d_task,))
                    self._unstarted(ctx, d)
                    return failed
            res = await d_task
            if res.outcome is Outcome.ABANDONED:  # the prefill failed first: its failure
                await asyncio.wait((p_task,))     # (ending now: its head is set)
                return _failed(p_task) or res
        except BaseException:  # the client went away (cancelled): both sides end
            p_task.cancel()
            d_task.cancel()
            self._unstarted(ctx, p, d)
            raise
        if res.kind == "transfer":
            res = _Try("prefill", res.outcome, res.last, p.engine)
        if res.kind != "sent":
            p_task.cancel()  # nothing left to prefill for
        elif not p_task.done():
            gone = ctx.req.on_close  # a stream being relayed: its client leaving ends both
            if gone is not None:
                def both() -> None:
                    p_task.cancel()
                    gone()

                ctx.req.on_close = both
        return res

    def _unstarted(self, ctx: _Ctx, *sides: Routed) -> None:
        """Release the reservations of sides whose task was cancelled before it ran."""
        for r in sides:
            if r.request_id not in ctx.started:
                ctx.started.add(r.request_id)
                self.core.finish(r.request_id, None)


def _failed(task: asyncio.Task) -> _Try | None:
    """A finished prefill task's failure (None: it answered)."""
    if task.cancelled():
        return _Try("prefill", Outcome.CLIENT_GONE, None, "none")
    exc = task.exception()
    if exc is not None:
        return _Try("prefill", Outcome.SERVER_ERROR, (502, openai_error(
            502, f"prefill failed: {exc!r}", "BadGateway")), "none")
    return task.result()[1]


def _transfer_params(payload: bytes | None) -> dict[str, Any] | None:
    """A vLLM prefill answer's top-level ``kv_transfer_params`` (None: none, or not an
    object)."""
    if not payload:
        return None
    try:
        doc = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return None
    params = doc.get("kv_transfer_params") if isinstance(doc, dict) else None
    return params if isinstance(params, dict) and params else None
