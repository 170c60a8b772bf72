"""How far behind its engines the bridge writes: per batch, the time from the engine's
``ts`` (set when the batch was made) to the PubAck that says JetStream stored it.

That is the latency the bridge adds before any consumer can read the batch, measured where
it ends, for every batch, at the cost of a subtraction and a bucket increment. It reads the
engine's clock against the bridge's: across machines, clock offset is part of the number
(negative values, an engine clock ahead, are counted apart as ``ahead``).

:class:`Lag` is a histogram of log-spaced buckets (four per doubling, from 10 us), so a
quantile is exact to within one bucket: 19% of its value.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["Lag"]

_LOW = 1e-5  # seconds: the first bucket's upper edge
_PER_DOUBLING = 4
_BUCKETS = 100  # up to 10 us * 2**24.75 = ~4.7 min; longer lags count in the last bucket
_EDGES = [_LOW * 2 ** (k / _PER_DOUBLING) for k in range(_BUCKETS)]


class Lag:
    """Counts of lags (seconds) in log-spaced buckets; :meth:`quantile` reads them back."""

    __slots__ = ("counts", "n", "ahead", "max")

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.n = 0
        self.ahead = 0  # negative lags: the engine's clock is ahead of the bridge's
        self.max = 0.0

    def add(self, seconds: float) -> None:
        self.n += 1
        if seconds <= _LOW:
            if seconds < 0:
                self.ahead += 1
            self.counts[0] += 1
            return
        if seconds > self.max:
            self.max = seconds
        k = math.ceil(math.log2(seconds / _LOW) * _PER_DOUBLING)
        self.counts[k if k < _BUCKETS else _BUCKETS - 1] += 1

    def quantile(self, q: float) -> float | None:
        """The upper edge of the bucket holding quantile ``q`` (None: nothing counted)."""
        if not self.n:
            return None
        rank = max(1, math.ceil(q * self.n))
        seen = 0
        for k, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                return min(_EDGES[k], self.max) if k else _EDGES[0]
        return self.max  # pragma: no cover - the counts add up to n

    def merge(self, other: Lag) -> None:
        for k, c in enumerate(other.counts):
            if c:
                self.counts[k] += c
        self.n += other.n
        self.ahead += other.ahead
        self.max = max(self.max, other.max)

    def summary(self) -> dict[str, Any]:
        """Milliseconds, for logs and the bridge's stop summary."""
        def ms(v: float | None) -> float | None:
            return None if v is None else round(v * 1e3, 3)

        return {"batches": self.n, "p50_ms": ms(self.quantile(0.5)),
                "p99_ms": ms(self.quantile(0.99)), "p999_ms": ms(self.quantile(0.999)),
                "max_ms": ms(self.max if self.n else None), "ahead": self.ahead}

    def text(self) -> str:
        """One line: ``lag p50 1.2 / p99 3.4 / max 5.6 ms (n)``."""
        if not self.n:
            return "lag n/a (no batches)"
        p50, p99 = self.quantile(0.5) or 0.0, self.quantile(0.99) or 0.0
        return (f"lag p50 {p50 * 1e3:.2f} / p99 {p99 * 1e3:.2f} / max {self.max * 1e3:.2f} ms "
                f"({self.n})")
