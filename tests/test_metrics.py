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
    finally:
        server.shutdown()
        sub.close()
        pub.shutdown(timeout=1)
