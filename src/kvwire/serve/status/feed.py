"""What ``GET /status.json`` answers: the router's and the proxy's figures, read once a
second by a daemon thread into a :class:`~.status_series.StatusSeries`.

The reading is cheap and off the request path: the core's per-stream load and this
module's tally of routing decisions (:meth:`StatusFeed.on_route`, a few dict additions per
decision), the proxy's counters and its TTFT histogram (read as ``/metrics`` reads them).
The thread holds the feed only weakly, so it ends with the app that owns the feed.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

from .series import SERIES, EngineReading, StatusSeries

__all__ = ["StatusFeed"]

log = logging.getLogger("kvwire.router.status")


class StatusFeed:
    """Samples every ``interval`` s; keeps ``capacity`` points per engine (10 minutes by
    default: about 60 kB per engine as JSON)."""

    def __init__(self, core: Any, proxy: Any = None, interval: float = 1.0,
                 capacity: int = 600) -> None:
        self.core = core
        self.proxy = proxy
        self.interval = interval
        self.series = StatusSeries(capacity)
        self.clock = time.monotonic
        self._lock = threading.Lock()  # series: the sampler thread and the HTTP thread
        #: label (NAME or NAME/dpR) -> engine name; stream -> engine name; the engines
        self._engine_of: dict[str, str] = {}
        self._stream_engine: dict[str, str] = {}
        self.engines: list[str] = []
        # routing tally per engine (keys are only ever added: on_route adds to them from
        # the serving loop without a lock)
        self._routed: dict[str, int] = {}
        self._credit: dict[str, float] = {}
        self._blocks: dict[str, float] = {}
        self._seen: Any = None  # the core.targets the maps were built from
        self._sync()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples = 0
        self.errors = 0  # ticks whose reading failed (logged; the next tick tries again)

    # ------------------------------------------------------------------ routing tally

    def _sync(self) -> None:
        """Follow the core's engines (added or removed at run time): a removed engine's
        points are dropped, so its charts go with it."""
        targets = self.core.targets
        if targets is self._seen:
            return
        self._engine_of = {t.label: t.engine for t in targets}
        self._stream_engine = {t.stream: t.engine for t in targets}
        engines = list(dict.fromkeys(t.engine for t in targets))
        for e in engines:
            self._routed.setdefault(e, 0)
            self._credit.setdefault(e, 0.0)
            self._blocks.setdefault(e, 0.0)
        with self._lock:
            for e in self.engines:
                if e not in engines:
                    self.series.forget(e)
        self.engines = engines
        self._seen = targets

    def on_route(self, label: str, credit: float, prompt_blocks: float) -> None:
        """RouterCore's per-decision hook (with the metrics'): count it for its engine."""
        engine = self._engine_of.get(label)
        if engine is None:  # an engine added since the maps were built
            self._sync()
            engine = self._engine_of.get(label)
            if engine is None:
                return
        self._routed[engine] += 1
        self._credit[engine] += min(credit, prompt_blocks)
        self._blocks[engine] += prompt_blocks

    # ------------------------------------------------------------------ sampling

    def read(self) -> dict[str, EngineReading]:
        """Every engine's cumulative figures now."""
        self._sync()
        loads: dict[str, float] = dict.fromkeys(self.engines, 0.0)
        for name, e in self.core.engines_status().items():
            loads[name] = sum(r["load"] for r in e["ranks"])
        proxied = self._proxy_figures()
        out = {}
        for name in self.engines:
            p = proxied.get(name, {})
            out[name] = EngineReading(
                routed=self._routed[name], hit_credit=self._credit[name],
                hit_blocks=self._blocks[name], load=loads.get(name, 0.0), **p)
        return out

    def _proxy_figures(self) -> dict[str, dict[str, Any]]:
        p = self.proxy
        if p is None:
            return {}
        for _ in range(3):  # the event loop may add a key while we copy: copy again
            try:
                requests = list(p.requests.items())
                break
            except RuntimeError:
                continue
        else:
            return {}
        per: dict[str, float] = {}
        for (engine, _status), n in requests:
            per[engine] = per.get(engine, 0) + n
        buckets: dict[str, list[tuple[float, float]]] = {}
        for fam in p.metrics.ttft.collect():
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    buckets.setdefault(s.labels["engine"], []).append(
                        (float(s.labels["le"]), s.value))
        return {name: {"requests": float(per.get(name, 0)),
                       "prompt_tokens": float(p.prompt_tokens.get(name, 0)),
                       "cached_tokens": float(p.cached_tokens.get(name, 0)),
                       "in_flight": float(p.in_flight.get(name, 0)),
                       "ttft": tuple(sorted(buckets.get(name, ())))}
                for name in p.links}

    def sample(self, now: float | None = None) -> None:
        """Take one reading and add it to the series."""
        readings = self.read()
        with self._lock:
            self.series.add(self.clock() if now is None else now, readings)
            self.samples += 1

    def start(self) -> None:
        """Sample every ``interval`` s in a daemon thread (until :meth:`close`, or until
        the feed is garbage: the thread keeps only a weak reference)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=_run, args=(weakref.ref(self), self._stop,
                                                           self.interval),
                                        name="kvwire-router-status", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    # ------------------------------------------------------------------ answer

    def window(self, seconds: float) -> dict[str, Any]:
        """``/status.json``'s answer for the last ``seconds``."""
        self._sync()
        with self._lock:
            engines = self.series.window(self.clock(), seconds)
        live: dict[str, bool] = dict.fromkeys(self.engines, False)
        for stream, alive in list(self.core.alive.items()):  # (one C call: no resize race)
            name = self._stream_engine.get(stream)
            if name is not None and alive:
                live[name] = True
        proxied = set(self.proxy.links) if self.proxy is not None else set()
        for name, cols in engines.items():
            cols["alive"] = live.get(name, False)
            cols["proxied"] = name in proxied
        return {"interval_s": self.interval, "seconds": seconds,
                "capacity_s": self.series.capacity * self.interval,
                "proxy": self.proxy is not None, "series": SERIES, "engines": engines}


def _run(ref: weakref.ref, stop: threading.Event, interval: float) -> None:
    next_at = time.monotonic()
    while not stop.is_set():
        feed = ref()
        if feed is None:
            return
        try:
            feed.sample()
        except Exception:  # pragma: no cover - a figure we could not read: try next tick
            feed.errors += 1
            log.exception("status page: sampling failed")
        del feed
        now = time.monotonic()
        next_at = max(next_at + interval, now)  # late (a busy box): no burst to catch up
        stop.wait(next_at - now)
