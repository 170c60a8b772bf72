"""The proxy's Prometheus figures: requests, retries, in-flight and token counts read from
the :class:`~kvwire.proxy.fleet.Fleet`'s public counters at scrape time, and histograms cheap
enough to observe once each per request on the event loop."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

__all__ = ["CheapHistogram", "Counters", "ProxyMetrics"]

_FAST_BUCKETS = (5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 0.1, 1.0)
_SLOW_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                 120.0, 300.0)


class CheapHistogram:
    """A Prometheus histogram observed in ~0.3 us (a bisect and two adds; prometheus_client's
    takes ~1.7 us with its lock): observed on the event loop only, summed at scrape time.
    With ``label``, :meth:`labels` gives one child per value."""

    __slots__ = ("name", "doc", "label", "bounds", "counts", "sum", "children")

    def __init__(self, name: str, doc: str, bounds: Sequence[float],
                 label: str | None = None) -> None:
        self.name, self.doc, self.label = name, doc, label
        self.bounds = (*bounds, math.inf)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.children: dict[str, CheapHistogram] = {}

    def labels(self, value: str) -> CheapHistogram:
        child = self.children.get(value)
        if child is None:
            child = self.children[value] = CheapHistogram(self.name, self.doc, self.bounds[:-1])
        return child

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v

    def _buckets(self) -> list[tuple[str, float]]:
        out, n = [], 0
        for b, c in zip(self.bounds, list(self.counts)):
            n += c
            out.append((floatToGoString(b), n))
        return out

    def collect(self) -> Any:
        fam = HistogramMetricFamily(self.name, self.doc,
                                    labels=[self.label] if self.label else None)
        if self.label:
            for value, child in list(self.children.items()):
                fam.add_metric([value], child._buckets(), child.sum)
        else:
            fam.add_metric([], self._buckets(), self.sum)
        yield fam


class Counters(Protocol):
    """What the figures are read from (the :class:`~kvwire.proxy.fleet.Fleet`)."""

    requests: Mapping[tuple[str, int], int]
    counts: Mapping[str, int]
    retried: Mapping[tuple[str, str], int]
    in_flight: dict[str, int]
    active: int
    prompt_tokens: dict[str, int]
    cached_tokens: dict[str, int]


class ProxyMetrics:
    """The proxy's Prometheus figures (``kvwire serve``'s /metrics registers this). The
    histograms are observed on the request path (one observe each per request); the
    counts and in-flight gauges are the fleet's counters, read at scrape time."""

    def __init__(self, fleet: Counters) -> None:
        self.fleet = fleet
        self.overhead = CheapHistogram(
            "kvwire_proxy_overhead_seconds", "The proxy's own time per request: arrival to "
            "the request written to the engine (first attempt), seconds", _FAST_BUCKETS)
        self.tokenize = CheapHistogram(
            "kvwire_proxy_tokenize_seconds", "Time to tokenize a prompt (local tokenizer or "
            "an engine's /tokenize), seconds", _FAST_BUCKETS)
        self.ttft = CheapHistogram(
            "kvwire_proxy_ttft_seconds", "Arrival to the first chunk of a streamed answer "
            "forwarded, per answering engine, seconds", _SLOW_BUCKETS, "engine")
        self.e2e = CheapHistogram(
            "kvwire_proxy_e2e_seconds", "Arrival to the last byte of an engine's answer "
            "forwarded, per answering engine, seconds", _SLOW_BUCKETS, "engine")
        # prefill/decode pairs (proxy/pairs.py)
        self.pd_prefill = CheapHistogram(
            "kvwire_proxy_pd_prefill_seconds", "A disaggregated request's prefill: sent to "
            "the prefill engine to the end of its answer, per prefill engine, seconds",
            _SLOW_BUCKETS, "engine")
        self.pd_decode_first = CheapHistogram(
            "kvwire_proxy_pd_decode_first_token_seconds", "A disaggregated request's "
            "decode side: sent to the decode engine to the first bytes of its answer (the "
            "KV transfer and the first decode token), per decode engine, seconds",
            _SLOW_BUCKETS, "engine")
        self.pd_ttft = CheapHistogram(
            "kvwire_proxy_pd_ttft_seconds", "A disaggregated streamed answer's time to "
            "first token, split by phase: prefill (sent to the prefill engine to the end of "
            "its answer), transfer (the KV transfer, as the decode engine reports it in "
            "x-kvwire-kv-transfer-seconds; absent when it does not) and decode (the rest, "
            "up to the first bytes of the decode answer), seconds", _SLOW_BUCKETS, "phase")

        #: the tokenizer's workers (proxy/offload.py), when the proxy tokenizes locally
        self.offload: Any = None

    def describe(self) -> list:
        return []

    def collect(self) -> Any:
        p = self.fleet
        reqs = CounterMetricFamily("kvwire_proxy_requests", "Generation requests answered, "
                                   "by the engine that answered (none: the proxy itself) "
                                   "and HTTP status", labels=["engine", "status"])
        for (engine, status), n in sorted(p.requests.items()):
            reqs.add_metric([engine, str(status)], n)
        retries = CounterMetricFamily("kvwire_proxy_retries", "Attempts retried on another "
                                      "engine, by the failed engine and why",
                                      labels=["engine", "reason"])
        for (engine, reason), n in sorted(p.retried.items()):
            retries.add_metric([engine, reason], n)
        inflight = GaugeMetricFamily("kvwire_proxy_in_flight", "Requests being sent to or "
                                     "answered by each engine now", labels=["engine"])
        for engine, n in p.in_flight.items():
            inflight.add_metric([engine], n)
        active = GaugeMetricFamily("kvwire_proxy_active", "Requests being answered now, "
                                   "arrival to end, all engines (refused with 429 at "
                                   "--max-in-flight)")
        active.add_metric([], p.active)
        prompt = CounterMetricFamily("kvwire_proxy_prompt_tokens", "Prompt tokens of the "
                                     "answers that reported usage, per answering engine",
                                     labels=["engine"])
        cached = CounterMetricFamily("kvwire_proxy_cached_tokens", "Of those, the tokens the "
                                     "engine found in its prefix cache (usage.prompt_tokens_"
                                     "details.cached_tokens)", labels=["engine"])
        for engine in p.in_flight:
            prompt.add_metric([engine], p.prompt_tokens[engine])
            cached.add_metric([engine], p.cached_tokens[engine])
        yield from (reqs, retries, inflight, active, prompt, cached)
        pd_req = getattr(p, "pd_requests", None)
        if pd_req is not None:
            sides = CounterMetricFamily("kvwire_proxy_pd_requests", "Prefill/decode pairs: "
                                        "requests sent, by role (prefill, decode, or both: "
                                        "prefilled and decoded there) and engine",
                                        labels=["role", "engine"])
            for (role, engine), n in sorted(pd_req.items()):
                sides.add_metric([role, engine], n)
            why = CounterMetricFamily("kvwire_proxy_pd_decisions", "Prefill/decode pairs: "
                                      "routing decisions by why (disagg; local: cached, "
                                      "prefill_busy, no_prefill, local, fallback)",
                                      labels=["why"])
            for w, n in sorted(p.pd_decisions.items()):
                why.add_metric([w], n)
            failed = CounterMetricFamily("kvwire_proxy_pd_prefill_failures", "Prefill/decode "
                                         "pairs: prefills that failed before the decode side "
                                         "started, or whose transfer failed (the pair runs "
                                         "again on the next prefill engine, then "
                                         "--pd-fallback)")
            failed.add_metric([], p.counts["pd_prefill_failures"])
            yield from (sides, why, failed)
            yield from self.pd_prefill.collect()
            yield from self.pd_decode_first.collect()
            yield from self.pd_ttft.collect()
        o = self.offload
        if o is not None and o.tok is not None:
            done = CounterMetricFamily("kvwire_proxy_tokenize_encodes", "Prompts whose new "
                                       "text was encoded, by where: on the event loop (short) "
                                       "or by a worker (long)", labels=["where"])
            done.add_metric(["loop"], o.inline)
            done.add_metric(["worker"], o.offloaded)
            yield done
            shed = CounterMetricFamily("kvwire_proxy_tokenize_shed", "Requests refused with "
                                       "429: --tokenize-queue long prompts were in hand")
            shed.add_metric([], o.shed)
            yield shed
            by_load = CounterMetricFamily("kvwire_proxy_tokenize_full_by_load", "Requests "
                                          "--tokenize-queue long prompts were in hand for, "
                                          "routed by load instead of refused (/v1/responses)")
            by_load.add_metric([], o.by_load)
            yield by_load
            broke = CounterMetricFamily("kvwire_proxy_tokenize_worker_restarts", "Times a "
                                        "tokenize worker process died and new ones started")
            broke.add_metric([], o.broken)
            yield broke
            start = CounterMetricFamily("kvwire_proxy_routed_on_start", "Long prompts "
                                        "routed on their start while the rest was tokenized")
            start.add_metric([], p.counts["routed_on_start"])
            yield start
            skipped = CounterMetricFamily("kvwire_proxy_tokenize_rests_skipped", "Long "
                                          "prompts routed on their start whose rest was not "
                                          "tokenized: the workers had --tokenize-queue rests")
            skipped.add_metric([], p.counts["rests_skipped"])
            yield skipped
            failed = CounterMetricFamily("kvwire_proxy_tokenize_rest_failures", "Long "
                                         "prompts routed on their start whose rest could not "
                                         "be tokenized: predicted and reserved on the start")
            failed.add_metric([], p.counts["start_rest_failures"])
            yield failed
            pending = GaugeMetricFamily("kvwire_proxy_tokenize_pending", "Long prompts being "
                                        "encoded by the workers now, waiting included")
            pending.add_metric([], o.pending)
            yield pending
            rests = GaugeMetricFamily("kvwire_proxy_tokenize_rests", "Long prompts routed "
                                      "on their start whose rest is being encoded now, "
                                      "waiting included")
            rests.add_metric([], o.rests)
            yield rests
        for h in (self.overhead, self.tokenize, self.ttft, self.e2e):
            yield from h.collect()
