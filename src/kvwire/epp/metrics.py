"""The picker's own Prometheus figures, beside the proxy's (the fleet's requests, in-flight
and active gauges count the picker's requests too): the ``Process`` streams, how they
ended, the messages exchanged with Envoy, and the time from a complete request to its pick
(tokenizing and the routing decision), read at scrape time or observed once per pick."""

from __future__ import annotations

from collections import Counter
from typing import Any

from prometheus_client.core import CounterMetricFamily

from ..proxy.metrics import CheapHistogram

__all__ = ["EppMetrics"]

_PICK_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)

#: counts key -> (metric, help)
_COUNTS = {
    "epp_streams": ("kvwire_epp_streams", "ext_proc streams opened by Envoy (one per request)"),
    "epp_streams_cut": ("kvwire_epp_streams_cut", "Streams that ended before the answer did "
                        "(Envoy reset them: the client went away; or an answer body mode "
                        "that does not show the end)"),
    "epp_protocol_errors": ("kvwire_epp_protocol_errors", "Streams ended with an error for a "
                            "message out of order"),
    "epp_unsupported": ("kvwire_epp_unsupported", "Streams refused for a processing mode "
                        "that cannot carry the pick (request body STREAMED)"),
    "epp_served_reported": ("kvwire_epp_served_reported", "Answers for which the gateway "
                            "reported the endpoint that served them"),
    "epp_served_elsewhere": ("kvwire_epp_served_elsewhere", "Answers the gateway says an "
                             "endpoint other than the pick served"),
    "epp_messages_in": ("kvwire_epp_messages_received", "ProcessingRequest messages received"),
    "epp_messages_out": ("kvwire_epp_messages_sent", "ProcessingResponse messages sent"),
}


class EppMetrics:
    """A collector over the fleet's ``counts`` (the ``epp_*`` keys) and the pick histogram."""

    def __init__(self, counts: Counter[str]) -> None:
        self.counts = counts
        self.pick = CheapHistogram(
            "kvwire_epp_pick_seconds", "A complete request to its pick: tokenizing and the "
            "routing decision, seconds", _PICK_BUCKETS)

    def describe(self) -> list:
        return []

    def collect(self) -> Any:
        for key, (name, doc) in _COUNTS.items():
            c = CounterMetricFamily(name, doc)
            c.add_metric([], self.counts.get(key, 0))
            yield c
        yield from self.pick.collect()
