"""The fleet story in one call: the bundled trace, 8 engines, every policy, a PNG report."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from .fleet import POLICIES, SimConfig, SimResult, run_sim
from .trace import bundled_trace_path, load_trace

__all__ = ["TARGETS", "missed_targets", "run_fleet_demo"]

#: What the fleet story promises for kvwire's policy: its hit ratio over the oracle's
#: (at least), over random's (at least), and its work max/mean across engines (at most).
TARGETS = {"oracle": 0.98, "random": 2.5, "work_max_over_mean": 1.10}


def _ratio(a: float, b: float) -> float:
    """a / b, where 0 / 0 is 1 (both equal) and x / 0 is infinite."""
    if b:
        return a / b
    return 1.0 if not a else float("inf")


def missed_targets(result: SimResult) -> list[str]:
    """The targets :func:`run_fleet_demo` printed that ``result`` misses, each as one line
    (empty: all met). ``kvwire demo`` exits non-zero on any, so ``make demo`` catches a
    routing regression."""
    kv, orc, rnd = (result.results[p] for p in ("kvwire", "oracle", "random"))
    out = []
    r = _ratio(kv.hit_ratio, orc.hit_ratio)
    if r < TARGETS["oracle"]:
        out.append(f"kvwire's hit ratio is {r:.3f}x the oracle's (target >= "
                   f"{TARGETS['oracle']:g})")
    r = _ratio(kv.hit_ratio, rnd.hit_ratio)
    if r < TARGETS["random"]:
        out.append(f"kvwire's hit ratio is {r:.3f}x random's (target >= "
                   f"{TARGETS['random']:g})")
    if kv.work_max_over_mean > TARGETS["work_max_over_mean"]:
        out.append(f"kvwire's work max/mean is {kv.work_max_over_mean:.3f} (target <= "
                   f"{TARGETS['work_max_over_mean']:.2f})")
    return out


def run_fleet_demo(out_png: str | Path | None = "report.png", engines: int = 8,
                   capacity: int = 5000, seed: int = 0, limit: int | None = None,
                   out: Callable[[str], None] = print,
                   progress: bool | None = None, workers: int | None = None) -> SimResult:
    """Simulate Mooncake's synthetic trace on a fleet under every routing policy.

    Prints what it does, the per-policy table and where the report went (``out_png=None``
    skips the PNG). Engines publish real events; the ``kvwire`` policy routes from them.
    Policies run in one process per CPU (``workers``; spawned: a calling script needs the
    ``if __name__ == "__main__":`` guard)."""
    t0 = time.monotonic()
    reqs = load_trace(bundled_trace_path(), limit=limit)
    out(f"kvwire fleet demo: {len(reqs)} requests of Mooncake's synthetic trace, {engines} "
        f"engines x {capacity} blocks of 512 tokens, policies {', '.join(POLICIES)}")
    out("each engine publishes its cache events over ZeroMQ; 'kvwire' routes from them "
        "(Subscriber -> PrefixIndex -> RoutingPolicy), 'oracle' reads the caches directly")
    result = run_sim(reqs, SimConfig(engines=engines, capacity=capacity, seed=seed),
                     POLICIES, progress=progress, workers=workers)
    out(result.table())
    kv, orc, rnd = (result.results[p] for p in ("kvwire", "oracle", "random"))

    def times(a: float, b: float) -> str:
        return f"{a / b:.3f}x" if b else ("1x" if not a else "inf x")

    out(f"kvwire: {times(kv.hit_ratio, orc.hit_ratio)} the oracle's hit ratio (target >= "
        f"0.98), {times(kv.hit_ratio, rnd.hit_ratio)} random's (>= 2.5), work max/mean "
        f"{kv.work_max_over_mean:.3f} (<= 1.10)")
    if out_png is not None:
        from .report import ReportUnavailable, write_report

        try:
            path = write_report(result, out_png)
        except ReportUnavailable as e:
            out(str(e))
        else:
            out(f"report written to {path.resolve()}")
    out(f"done in {time.monotonic() - t0:.1f}s")
    return result
