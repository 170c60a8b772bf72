"""The status page's live charts as data: per engine, a fixed-size ring of points, one per
sampling tick (``kvwire serve`` samples once a second).

Pure and I/O-free: :class:`StatusSeries` is given timestamped readings of *cumulative*
figures (the same counters and histograms ``/metrics`` exports) and turns each pair of
consecutive readings into one point of rates and ratios over that interval, so a chart of
"the last minutes" needs no Prometheus. Memory is bounded: ``capacity`` points per engine
and at most ``max_engines`` engines. Counters that go backwards (a restarted source) count
from zero again, as Prometheus' ``rate()`` does.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SERIES", "EngineReading", "StatusSeries", "bucket_quantile"]

#: The figures of each point, in order, with what the page calls them. ``None`` in a point:
#: not known for that interval (no proxy, nothing answered, nothing streamed).
SERIES: dict[str, str] = {
    "requests_per_s": "requests/s answered by the engine (proxy)",
    "routed_per_s": "requests/s routed to the engine (router decisions)",
    "cached_ratio": "cached / prompt tokens the engine reported (proxy)",
    "predicted_hit_ratio": "matched / prompt blocks the router predicted",
    "ttft_p50_s": "median time to first token of streamed answers, seconds (proxy)",
    "in_flight": "requests under way at the engine (proxy)",
    "load_blocks": "load the router has reserved on the engine, blocks",
}


@dataclass(frozen=True)
class EngineReading:
    """One engine's cumulative figures at one instant. Proxy figures are ``None`` when the
    engine is not proxied (decision API only). ``ttft``: the TTFT histogram's cumulative
    buckets as ``(upper bound, count)``, ascending, ``+inf`` last."""

    routed: float = 0.0
    hit_credit: float = 0.0
    hit_blocks: float = 0.0
    load: float = 0.0
    requests: float | None = None
    prompt_tokens: float | None = None
    cached_tokens: float | None = None
    in_flight: float | None = None
    ttft: tuple[tuple[float, float], ...] | None = None


def _delta(new: float | None, old: float | None) -> float | None:
    """The increase of a counter; a decrease is a reset (the new value is all new)."""
    if new is None or old is None:
        return None
    return new - old if new >= old else new


def bucket_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of cumulative ``(upper bound, count)`` buckets, interpolated
    linearly inside its bucket as Prometheus' ``histogram_quantile`` does (the first
    bucket starts at 0; a quantile in the ``+inf`` bucket is the last finite bound).
    ``None`` when there are no observations."""
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def _bucket_delta(new: tuple[tuple[float, float], ...] | None,
                  old: tuple[tuple[float, float], ...] | None
                  ) -> list[tuple[float, float]] | None:
    if new is None or old is None:
        return None
    if len(new) != len(old) or any(a[0] != b[0] for a, b in zip(new, old)):
        return list(new)  # the buckets changed: a new histogram, all of it is new
    if any(n[1] < o[1] for n, o in zip(new, old)):
        return list(new)  # reset
    return [(n[0], n[1] - o[1]) for n, o in zip(new, old)]


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return min(max(num / den, 0.0), 1.0)


def point(dt: float, new: EngineReading, old: EngineReading) -> tuple[float | None, ...]:
    """One interval's figures (in :data:`SERIES` order) from two readings ``dt`` s apart."""
    requests = _delta(new.requests, old.requests)
    ttft = _bucket_delta(new.ttft, old.ttft)
    return (
        None if requests is None else requests / dt,
        _delta(new.routed, old.routed) / dt,  # type: ignore[operator]
        _ratio(_delta(new.cached_tokens, old.cached_tokens),
               _delta(new.prompt_tokens, old.prompt_tokens)),
        _ratio(_delta(new.hit_credit, old.hit_credit), _delta(new.hit_blocks, old.hit_blocks)),
        None if ttft is None else bucket_quantile(0.5, ttft),
        new.in_flight,
        new.load,
    )


class StatusSeries:
    """Rings of points per engine. Feed it with :meth:`add` once per tick; read a window
    with :meth:`window`. Not thread-safe: one sampler adds, readers take :meth:`window`'s
    copy (the caller serialises the two)."""

    def __init__(self, capacity: int = 600, max_engines: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.max_engines = max_engines
        #: per engine: (t, seconds since the reading before, the figures of that interval)
        self.rings: dict[str, deque[tuple[float, float, tuple[float | None, ...]]]] = {}
        self._last: dict[str, EngineReading] = {}
        self._last_t: float | None = None
        self.dropped_engines = 0  # readings of engines past max_engines, ignored

    def add(self, t: float, readings: Mapping[str, EngineReading]) -> None:
        """Record the readings taken at ``t`` (seconds, any monotonic clock): a point per
        engine that had a reading at the previous tick. A ``t`` not after the previous one
        is ignored (nothing can be a rate over no time)."""
        prev_t = self._last_t
        if prev_t is not None and t <= prev_t:
            return
        last: dict[str, EngineReading] = {}
        for name, r in readings.items():
            if name not in self.rings:
                if len(self.rings) >= self.max_engines:
                    self.dropped_engines += 1
                    continue
                self.rings[name] = deque(maxlen=self.capacity)
            last[name] = r
            old = self._last.get(name)
            if old is not None and prev_t is not None:
                self.rings[name].append((t, t - prev_t, point(t - prev_t, r, old)))
        self._last, self._last_t = last, t

    def forget(self, name: str) -> None:
        """Drop an engine's points (it left the fleet); one of that name later starts anew."""
        self.rings.pop(name, None)
        self._last.pop(name, None)

    def window(self, now: float, seconds: float) -> dict[str, Any]:
        """The points of the last ``seconds`` before ``now``, JSON-ready: per engine, ``t``
        (seconds before ``now``, oldest first), ``dt`` (each point's interval, seconds) and
        one list per figure of :data:`SERIES`."""
        start = now - seconds
        out: dict[str, Any] = {}
        for name, ring in self.rings.items():
            pts = [e for e in ring if e[0] > start]
            cols: dict[str, Any] = {"t": [round(now - t, 3) for t, _, _ in pts],
                                    "dt": [round(dt, 6) for _, dt, _ in pts]}
            for i, key in enumerate(SERIES):
                cols[key] = [None if p[i] is None else round(p[i], 6) for _, _, p in pts]
            out[name] = cols
        return out
