"""The serving loop's lag, sampled by a timer: a callback that holds the loop shows up as
the lag it caused, and nothing else does (``/metrics`` shows it: tests/test_serve.py)."""

from __future__ import annotations

import asyncio
import time

from kvwire.serve.loop_lag import LoopLag


def _counts(lag: LoopLag) -> dict[str, float]:
    fam = next(iter(lag.collect()))
    return {s.labels["le"]: s.value for s in fam.samples if s.name.endswith("_bucket")}


def test_a_held_loop_shows_as_the_lag_it_caused() -> None:
    lag = LoopLag(interval=0.01)

    async def main() -> None:
        lag.start()
        lag.start()  # once only
        await asyncio.sleep(0.1)  # idle: every sample about on time (a busy box: < 0.25 s)
        idle = _counts(lag)
        assert idle["+Inf"] >= 3 and idle["0.25"] == idle["+Inf"], idle
        time.sleep(0.3)  # a callback holding the loop for 300 ms (a stall)
        await asyncio.sleep(0.05)
        held = _counts(lag)
        assert held["+Inf"] - held["0.25"] == 1, held  # that one sample, late
        assert lag.max >= 0.25
        lag.stop()
        n = held["+Inf"]
        await asyncio.sleep(0.05)
        assert _counts(lag)["+Inf"] <= n + 1  # stopped (a tick already due may run)

    asyncio.run(main())
