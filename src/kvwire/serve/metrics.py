"""What ``kvwire serve``'s ``/metrics`` reads: a registry of its own (nothing leaks into or
from the process's default one), the per-request figures the routes record, and collectors
that read the routing core's, the load sharing's and the indexer API's figures at scrape
time (free on the routing path)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..indexer.indexer import Indexer
from ..routing.core import RouterCore
from ..routing.ingest import stream_metrics
from .loop_lag import LoopLag

__all__ = ["CoreCollector", "IndexerCollector", "ServeMetrics"]


class ServeMetrics:
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
        r.register(CoreCollector(core))
        self.loop_lag = LoopLag()  # started and stopped by the server, on its loop
        r.register(self.loop_lag)
        if proxy is not None:
            r.register(proxy.metrics)  # kvwire_proxy_*

    def on_route(self, label: str, credit: float, prompt_blocks: float) -> None:
        self.routed.labels(label).inc()
        self.hit.observe(credit / prompt_blocks if prompt_blocks > 0 else 0.0)


class CoreCollector:
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
        # per-stream counts, named as kvwire listen names them
        for name, kind, doc, values in stream_metrics(status):
            fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                name, doc, labels=["stream"])
            for stream, v in values:
                fam.add_metric([stream], v)
            yield fam
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


class IndexerCollector:
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
