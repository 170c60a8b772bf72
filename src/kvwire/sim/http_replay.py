"""Replay a Mooncake trace over real HTTP against any OpenAI-compatible endpoint.

The simulator answers "which policy wins" in virtual time; this answers it on the wire: each
trace request becomes a streamed ``POST /v1/completions`` whose ``prompt`` is the request's
token ids (derived from its hash ids exactly as the simulator derives them, so prefixes are
shared as the trace says and no tokenizer is involved), sent at the trace's arrival time
(times ``time_scale``). What comes back is one :class:`ReplayRecord` per request, measured
by the client: TTFT (send to the first chunk carrying a token), end to end, and the
engine's own ``usage.prompt_tokens_details.cached_tokens``. The target can be ``kvwire
serve``, SGLang's router, or an engine itself: only the URL changes.

:func:`request_token_ids`, :func:`completion_body`, :class:`SseTally` and :func:`summarize`
are pure; :func:`replay` and :func:`replay_many` (asyncio, on kvwire's own HTTP client
:mod:`kvwire.http1.client`) are the I/O. ::

    records = replay_sync("http://127.0.0.1:8000", load_trace(bundled_trace_path(), limit=50),
                          time_scale=0.1)   # a kvwire serve, an SGLang router, an engine
    print(summarize(records).ttft_p99_s)
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..http1.client import Pool, endpoint
from .quantile import percentile  # (re-exported: kvwire.sim.http_replay.percentile)
from .trace import Request, prompt_tokens

__all__ = [
    "TAIL_TOKEN_RANGE",
    "ReplayRecord",
    "ReplaySummary",
    "completion_body",
    "percentile",
    "SseTally",
    "replay",
    "replay_many",
    "replay_sync",
    "request_token_ids",
    "summarize",
]

#: Token ids of the prompt tokens no hash id names (unique to their request): above the
#: hash-id tokens' 0..65535, inside kvwire engine's builtin vocabulary (65,808 ids). The
#: simulator uses ids past 65,535 too (any, as it has no vocabulary to respect).
TAIL_TOKEN_RANGE = (16, 65_808)


def request_token_ids(req: Request, index: int) -> list[int]:
    """The prompt token ids of trace request ``index``: its hash ids' blocks as the simulator
    derives them (:func:`~kvwire.sim.trace.prompt_tokens`), then, for prompt tokens past
    what the ids name, ids seeded by ``index`` alone (never shared with another request)."""
    ids = prompt_tokens(req)
    extra = max(req.input_length, 1) - len(ids)
    if extra > 0:
        rng = random.Random(f"kvwire-http/tail/{index}")
        lo, hi = TAIL_TOKEN_RANGE
        ids.extend(rng.randrange(lo, hi) for _ in range(extra))
    return ids


def completion_body(req: Request, index: int, *, model: str | None = None,
                    max_output_tokens: int | None = None,
                    extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The streamed ``/v1/completions`` body of trace request ``index``: its token ids, its
    output length (capped at ``max_output_tokens``) with ``ignore_eos`` so the engine
    generates exactly that many, and usage in the last chunk."""
    out = max(1, req.output_length)
    if max_output_tokens is not None:
        out = min(out, max_output_tokens)
    body: dict[str, Any] = {"prompt": request_token_ids(req, index), "max_tokens": out,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    if extra:
        body.update(extra)
    return body


@dataclass(frozen=True, slots=True)
class ReplayRecord:
    """One request as the client saw it. Times in wall seconds; ``scheduled_s`` and
    ``sent_s`` from the replay's start; ``status`` 0 when no HTTP answer came (``error``
    says why); ``cached_tokens`` None when the answer carried no usage."""

    index: int
    scheduled_s: float
    sent_s: float
    status: int
    ttft_s: float | None
    e2e_s: float | None
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int
    engine: str | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.ttft_s is not None


@dataclass(frozen=True, slots=True)
class ReplaySummary:
    """What a run of :func:`replay` amounts to (see :func:`summarize`)."""

    requests: int
    ok: int
    failed: int
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    prompt_tokens: int
    cached_tokens: int
    max_send_lag_s: float
    engine_work: dict[str, float] = field(default_factory=dict)

    @property
    def cached_ratio(self) -> float:
        """Cached prompt tokens the engines reported / prompt tokens (successful requests)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def work_max_over_mean(self) -> float:
        """Busiest engine's work over the mean (1.0: perfectly even; 0.0: no work)."""
        w = list(self.engine_work.values())
        mean = sum(w) / len(w) if w else 0.0
        return max(w) / mean if mean > 0 else 0.0


def summarize(records: Sequence[ReplayRecord], engines: Sequence[str] = (), *,
              prefill_token_cost: float = 50e-6, decode_token_cost: float = 30e-6
              ) -> ReplaySummary:
    """Percentiles over the successful requests, cached tokens as the engines reported them,
    and each engine's work: its uncached prompt tokens x ``prefill_token_cost`` + its output
    tokens x ``decode_token_cost`` (kvwire engine's step-cost terms, in model seconds).
    ``engines`` lists engines that count even if they got nothing (an idle engine is
    imbalance too); records without an engine name (a target that does not say) are left
    out of the work."""
    good = [r for r in records if r.ok]
    work = {e: 0.0 for e in engines}
    for r in good:
        if r.engine is not None:
            uncached = r.prompt_tokens - (r.cached_tokens or 0)
            work[r.engine] = (work.get(r.engine, 0.0) + uncached * prefill_token_cost
                              + r.completion_tokens * decode_token_cost)
    ttft = [r.ttft_s for r in good if r.ttft_s is not None]
    e2e = [r.e2e_s for r in good if r.e2e_s is not None]
    return ReplaySummary(
        requests=len(records), ok=len(good), failed=len(records) - len(good),
        ttft_p50_s=percentile(ttft, 0.50), ttft_p99_s=percentile(ttft, 0.99),
        e2e_p50_s=percentile(e2e, 0.50), e2e_p99_s=percentile(e2e, 0.99),
        prompt_tokens=sum(r.prompt_tokens for r in good),
        cached_tokens=sum(r.cached_tokens or 0 for r in good),
        max_send_lag_s=max((r.sent_s - r.scheduled_s for r in records), default=0.0),
        engine_work=work)


# --------------------------------------------------------------------------- I/O

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()


class SseTally:
    """What a streamed completion's bytes say, fed as they arrive (pure: no I/O, no clock).

    Only the events that matter are decoded: those up to the first one carrying a choice
    (the first token), and those naming ``usage`` or ``error``; the hundreds of token
    chunks between are skipped unparsed, so the client stays cheap beside the fleet."""

    def __init__(self) -> None:
        self._buf = b""
        self.first_token = False
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False

    def feed(self, data: bytes) -> bool:
        """Take the next bytes; True when they completed the first event with a choice."""
        self._buf += data
        first = False
        while (end := self._buf.find(b"\n\n")) >= 0:
            event, self._buf = self._buf[:end], self._buf[end + 2:]
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                elif (not self.first_token or b'"usage"' in payload
                      or b'"error"' in payload):
                    first |= self._event(payload)
        return first

    def _event(self, payload: bytes) -> bool:
        try:
            chunk = _decode.decode(payload)
        except msgspec.DecodeError:
            self.error = self.error or f"malformed SSE event: {payload[:120]!r}"
            return False
        if not isinstance(chunk, dict):
            return False
        if chunk.get("error") is not None:
            self.error = self.error or f"error event: {chunk['error']}"
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if not self.first_token and chunk.get("choices"):
            self.first_token = True
            return True
        return False


async def _one(pool: Pool, path: bytes, index: int, payload: bytes, n_prompt: int,
               scheduled: float, start: float, headers: list[tuple[bytes, bytes]],
               timeout: float) -> ReplayRecord:
    sent = time.monotonic()
    status, engine, ttft, error = 0, None, None, None
    tally = SseTally()

    def on_data(data: bytes) -> bool:
        """A piece of the body, timed in the read that brought it; True: stop reading."""
        nonlocal ttft
        if tally.feed(data):
            ttft = time.monotonic() - sent
        return tally.error is not None

    try:
        resp = await pool.request(b"POST", path, headers, payload, timeout=timeout)
        try:
            status = resp.status
            name = resp.headers.get(b"x-kvwire-engine")
            engine = name.decode("latin-1") if name is not None else None
            if status != 200:
                text = (await resp.read(timeout))[:300].decode("utf-8", "replace")
                error = f"HTTP {status}: {text}"
            else:
                await resp.stream(on_data, idle=timeout)
                error = tally.error
                if error is None and not tally.done:
                    error = "the stream ended without data: [DONE]"
        finally:
            resp.close()
    except Exception as e:  # noqa: BLE001 - every failure is a record, never a crash
        error = f"{type(e).__name__}: {e}"
    end = time.monotonic()
    usage = tally.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return ReplayRecord(index=index, scheduled_s=scheduled, sent_s=sent - start,
                        status=status, ttft_s=ttft, e2e_s=end - sent if error is None else None,
                        prompt_tokens=usage.get("prompt_tokens", n_prompt),
                        cached_tokens=details.get("cached_tokens"),
                        completion_tokens=usage.get("completion_tokens", 0),
                        engine=engine, error=error)


async def replay_many(urls: Sequence[str], requests: Sequence[Request], *,
                      time_scale: float = 1.0, model: str | None = None,
                      max_output_tokens: int | None = None, path: str = "/v1/completions",
                      headers: Mapping[str, str] | None = None, timeout: float = 120.0,
                      extra_body: Mapping[str, Any] | None = None
                      ) -> list[list[ReplayRecord]]:
    """Send ``requests`` to every ``url`` + ``path`` at their trace times x ``time_scale``
    (from the first request's), streamed, all concurrently; per url, one record per
    request in trace order.

    Each request goes to every target at the same moment with the same bytes, so targets
    compared in one call share the machine and whatever else loads it. ``time_scale`` < 1
    compresses the trace (engines run ``--speed 8`` want 1/8). A request that fails
    (refused, timeout, non-200, an SSE error event, no ``[DONE]``) is a record with
    ``error`` set, never an exception; a URL that is not ``http[s]://HOST[:PORT]`` is a
    ValueError before anything is sent. ``headers`` go with every request (``host`` and
    ``content-length`` are the client's). Bodies are built before the clock starts."""
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale!r}")
    if not requests or not urls:
        return [[] for _ in urls]
    targets = []
    for u in urls:  # a keep-alive pool per target; ValueError for a URL it cannot reach
        host, port, tls, base = endpoint(u)
        targets.append((Pool(host, port, connect_timeout=timeout, max_idle=512, ssl=tls),
                        (base + path).encode()))
    merged = {"content-type": "application/json"}
    merged.update((k.lower(), v) for k, v in (headers or {}).items())
    sent_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in merged.items()
                    if k not in ("content-length", "host")]  # (the client writes those)
    t0 = requests[0].t
    plan = []
    for i, r in enumerate(requests):  # encoded now: bytes are ~5x smaller than int lists
        body = completion_body(r, i, model=model, max_output_tokens=max_output_tokens,
                               extra=extra_body)
        plan.append(((r.t - t0) * time_scale, _encode.encode(body), len(body["prompt"])))
    try:
        start = time.monotonic()
        tasks: list[list[asyncio.Task[ReplayRecord]]] = [[] for _ in targets]
        for i, (at, payload, n_prompt) in enumerate(plan):
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            for k, (pool, target) in enumerate(targets):
                tasks[k].append(asyncio.create_task(
                    _one(pool, target, i, payload, n_prompt, at, start, sent_headers,
                         timeout)))
        return [list(await asyncio.gather(*ts)) for ts in tasks]
    finally:
        for pool, _ in targets:
            pool.close()


async def replay(url: str, requests: Sequence[Request], **kw: Any) -> list[ReplayRecord]:
    """:func:`replay_many` to one target (same keywords)."""
    return (await replay_many([url], requests, **kw))[0]


def replay_sync(url: str, requests: Sequence[Request], **kw: Any) -> list[ReplayRecord]:
    """:func:`replay` from synchronous code (its own event loop)."""
    return asyncio.run(replay(url, requests, **kw))
