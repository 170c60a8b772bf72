"""Prometheus metrics, scraped over a real HTTP exporter on loopback."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvwire.consume.stream import Batch
from kvwire.consume.subscriber import StreamSpec, Subscriber
from kvwire.metrics import publisher_collector, register, start_exporter, subscriber_collector
from kvwire.publish.publisher import ZmqEventPublisher
from kvwire.wire.events import BlockStored, KVEventBatch


def scrape(port: int) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, next(iter(s.labels.values()), ""))] = s.value
    return out


def test_publisher_and_subscriber_metrics_over_http(tmp_path) -> None:
    pub = ZmqEventPublisher(endpoint=f"ipc://{tmp_path}/l", replay_endpoint=f"ipc://{tmp_path}/r",
                            heartbeat_interval=0.2)
    sub = Subscriber([StreamSpec("e0", pub.endpoint, "", pub.replay_endpoint)])
    reg = CollectorRegistry()
    register(publisher_collector({"e0": pub}), reg)
    register(subscriber_collector(sub), reg)
    server = start_exporter(0, registry=reg)
    try:
        for i in range(5):
            pub.publish(KVEventBatch(time.time(), [BlockStored([i], None, [1] * 4, 4, None)], 0))
        deadline = time.monotonic() + 20
        batches = 0
        while time.monotonic() < deadline and batches < 3:
            item = sub.poll(0.2)
            batches += isinstance(item, Batch)
        assert batches >= 3
        m = scrape(server.server_address[1])
        assert m[("kvwire_publisher_batches_published_total", "e0")] == 5
        assert m[("kvwire_publisher_batches_sent_total", "e0")] >= 5
        assert m[("kvwire_publisher_batches_dropped_total", "e0")] == 0
        assert ("kvwire_publisher_queue_depth_batches", "e0") in m
        assert m[("kvwire_subscriber_batches_delivered_total", "e0")] >= 3
        assert m[("kvwire_subscriber_up", "e0")] == 1
        assert m[("kvwire_subscriber_snapshots_total", "e0")] >= 1
        assert ("kvwire_subscriber_gaps_total", "e0") in m
        assert m[("kvwire_subscriber_unconfirmed", "e0")] == 0  # (a kvwire publisher: never)
    finally:
        server.shutdown()
        sub.close()
        pub.shutdown(timeout=1)


class _Fatal(BaseException):
    """Kills the publisher's sender thread for real (a forced fault): not an Exception."""


class _Deadly(list):
    def __iter__(self):  # type: ignore[override]
        raise _Fatal("forced: the sender thread dies reading this batch")


def test_dead_sender_and_inexact_model_show_in_metrics(tmp_path) -> None:
    pub = ZmqEventPublisher(endpoint=f"ipc://{tmp_path}/l", replay_endpoint=f"ipc://{tmp_path}/r",
                            heartbeat_interval=None)
    reg = CollectorRegistry()
    register(publisher_collector({"e0": pub}), reg)

    def value(name: str) -> float | None:
        return reg.get_sample_value(name, {"publisher": "e0"})

    try:
        assert value("kvwire_publisher_sender_alive") == 1
        assert value("kvwire_publisher_snapshot_exact") == 1
        # A block hash that cannot be a dict key: the model fails half way (forced for real).
        pub.publish(KVEventBatch(0.0, [BlockStored([[1]], None, [1] * 4, 4, None)], 0))  # type: ignore[list-item]
        pub.publish(KVEventBatch(1.0, _Deadly(), 0))
        deadline = time.monotonic() + 20
        while pub.stats().sender_alive and time.monotonic() < deadline:
            time.sleep(0.005)
        for i in range(3):
            pub.publish(KVEventBatch(float(i), [BlockStored([i], None, [1] * 4, 4, None)], 0))
        assert value("kvwire_publisher_sender_alive") == 0
        assert value("kvwire_publisher_batches_dropped_sender_dead_total") == 3
        assert value("kvwire_publisher_model_errors_total") == 1
        assert value("kvwire_publisher_snapshot_exact") == 0
    finally:
        pub.shutdown(timeout=1)
