"""What the host took from a benchmark: CPU time stolen by the hypervisor during the run.

On a shared VM (this project's 2-core test boxes) steal swings from ~0 to 15-20% of the CPU
within minutes, and every latency percentile moves with it; printing it beside the numbers
says which runs were measured on a calm host."""

from __future__ import annotations

import os


def _ticks() -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
    except OSError:
        return None
    vals = [int(x) for x in parts[1:]]
    return sum(vals), (vals[7] if len(vals) > 7 else 0)


class Steal:
    """``Steal()`` at the start; ``str(s)`` at the end: the share of all CPU time stolen."""

    def __init__(self) -> None:
        self.t0 = _ticks()

    def share(self) -> float | None:
        t1 = _ticks()
        if self.t0 is None or t1 is None or t1[0] <= self.t0[0]:
            return None
        return (t1[1] - self.t0[1]) / (t1[0] - self.t0[0])

    def percent(self) -> str:
        """The stolen share alone, e.g. ``1.2%`` (``?`` where /proc/stat is unreadable)."""
        s = self.share()
        return "?" if s is None else f"{s:.1%}"

    def __str__(self) -> str:
        s = self.share()
        load = os.getloadavg()[0]
        if s is None:
            return f"load average {load:.1f}"
        return f"load average {load:.1f}, host steal {s:.1%} of CPU time during the run"
