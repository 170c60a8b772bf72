"""Prometheus metrics for publishers and subscribers (optional: ``pip install kvwire[metrics]``).

Collectors read the objects' ``stats()`` at scrape time, so metrics cost nothing on the
engine's or the router's hot path. Counters are named ``kvwire_<kind>_<what>_total``,
gauges ``kvwire_<kind>_<what>``, with a label naming the publisher or stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgspec

__all__ = [
    "StatsCollector",
    "publisher_collector",
    "register",
    "start_exporter",
    "subscriber_collector",
]

#: Fields of the stats structs that are levels rather than running totals.
GAUGES = frozenset({
    "queue_depth", "last_seq", "buffered", "expected_seq", "alive", "seq", "blocks",
    "last_heartbeat_age", "last_message_age", "state_code", "live", "streams", "exact",
    "sender_alive", "snapshot_exact", "unconfirmed",
})
#: Fields that are identifiers, not measurements.
SKIP = frozenset({"epoch", "name", "endpoint", "state", "topic"})

_PUBLISHER_NAMES = {
    "published": "batches_published",
    "sent": "batches_sent",
    "dropped": "batches_dropped",
    "replayed": "batches_replayed",
    "heartbeats": "heartbeats_sent",
    "queue_depth": "queue_depth_batches",
    "dropped_sender_dead": "batches_dropped_sender_dead",
    "foreign_batches": "batches_encoded_as_given",
}


class StatsCollector:
    """Turns ``{label_value: stats_struct}`` into Prometheus metric families on each scrape."""

    def __init__(
        self,
        kind: str,
        label: str,
        source: Callable[[], dict[str, Any]],
        rename: dict[str, str] | None = None,
        doc: str = "",
    ) -> None:
        self.kind = kind
        self.label = label
        self.source = source
        self.rename = rename or {}
        self.doc = doc or f"kvwire {kind} statistics"

    def describe(self) -> Iterable[Any]:
        return []  # families are dynamic; collect() is cheap

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: dict[str, Any] = {}
        for key, stats in self.source().items():
            values = msgspec.structs.asdict(stats) if isinstance(stats, msgspec.Struct) else stats
            for field, value in values.items():
                if field in SKIP or isinstance(value, bool) and field not in GAUGES:
                    continue
                if not isinstance(value, (int, float)):
                    continue
                name = f"kvwire_{self.kind}_{self.rename.get(field, field)}"
                fam = families.get(field)
                if fam is None:
                    doc = f"{self.doc}: {field.replace('_', ' ')}"
                    fam = (GaugeMetricFamily if field in GAUGES else CounterMetricFamily)(
                        name, doc, labels=[self.label]
                    )
                    families[field] = fam
                fam.add_metric([key], float(value))
        yield from families.values()


def publisher_collector(publishers: dict[str, Any]) -> StatsCollector:
    """A collector over ``{name: ZmqEventPublisher}`` (label ``publisher``)."""
    return StatsCollector(
        "publisher", "publisher",
        lambda: {name: p.stats() for name, p in publishers.items()},
        _PUBLISHER_NAMES, "kvwire KV event publisher",
    )


_SUBSCRIBER_NAMES = {
    "batches": "batches_delivered",
    "events": "events_delivered",
    "replayed": "batches_replayed",
    "lost": "batches_lost",
    "buffered": "buffered_batches",
    "alive": "up",
}


def subscriber_collector(subscriber: Any) -> StatsCollector:
    """A collector over a :class:`~kvwire.subscriber.Subscriber` (label ``stream``)."""

    def source() -> dict[str, dict[str, Any]]:
        out = {}
        for name, st in subscriber.stats().items():
            values = msgspec.structs.asdict(st.stream)
            values.update(requests_sent=st.requests_sent,
                          request_send_failures=st.request_send_failures,
                          request_sockets_recycled=st.request_sockets_recycled)
            out[name] = values
        return out

    return StatsCollector("subscriber", "stream", source, _SUBSCRIBER_NAMES,
                          "kvwire KV event subscriber")


def register(collector: StatsCollector, registry: Any = None) -> StatsCollector:
    """Register on ``registry`` (prometheus_client's default when None)."""
    from prometheus_client import REGISTRY

    (registry or REGISTRY).register(collector)
    return collector


class Exporter:
    """``/metrics`` on kvwire's HTTP server in a daemon thread (what :func:`start_exporter`
    returns): ``server_address`` is ``(host, port)``; :meth:`shutdown` stops it."""

    def __init__(self, registry: Any, addr: str, port: int) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from .http1.server import Routes, serve_in_thread

        ctype = CONTENT_TYPE_LATEST.encode()

        def scrape(req: Any) -> None:  # (any GET path, as prometheus_client's own server)
            if req.method not in (b"GET", b"HEAD"):
                req.respond(405, b"", ctype=None)
            else:
                req.respond(200, generate_latest(registry), ctype=ctype)

        self.server, self.thread, port = serve_in_thread(Routes(fallback=scrape), addr, port,
                                                         name="kvwire-metrics")
        self.server_address = (addr, port)

    def shutdown(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def start_exporter(port: int, addr: str = "127.0.0.1", registry: Any = None) -> Exporter:
    """Serve ``/metrics`` over HTTP on ``addr:port`` (loopback by default); returns the server."""
    from prometheus_client import REGISTRY

    return Exporter(registry or REGISTRY, addr, port)
