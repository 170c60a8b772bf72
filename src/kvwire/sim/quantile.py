"""The simulator's one quantile rule, nearest rank, shared by the fleet's summary, the floor
and the HTTP replay so that their p50/p99 are comparable number for number."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["nearest_rank", "percentile"]


def nearest_rank(sorted_vals: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of values already sorted; 0.0 for none."""
    if not sorted_vals:
        return 0.0
    return float(sorted_vals[min(len(sorted_vals) - 1,
                                 max(0, int(q * len(sorted_vals) + 0.5) - 1))])


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` in any order; 0.0 for none."""
    return nearest_rank(sorted(values), q)
