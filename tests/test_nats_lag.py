"""``kvwire.nats.lag.Lag``: the bridge's per-batch lag histogram (engine ts -> PubAck).
Its quantiles are upper bounds within one bucket (a factor 2**0.25) of the exact ones."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from kvwire.nats.lag import Lag

_LAGS = st.lists(st.floats(min_value=2e-5, max_value=200.0, allow_nan=False), min_size=1,
                 max_size=300)


def exact(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[max(1, math.ceil(q * len(s))) - 1]


@given(_LAGS, st.sampled_from([0.0, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0]))
def test_quantiles_bound_the_exact_ones_within_one_bucket(xs: list[float], q: float) -> None:
    lag = Lag()
    for x in xs:
        lag.add(x)
    got, want = lag.quantile(q), exact(xs, q)
    assert got is not None
    assert want <= got <= want * 2 ** 0.25 * (1 + 1e-9), (got, want)
    assert lag.n == len(xs) and lag.max == max(xs) and lag.ahead == 0


@given(_LAGS, _LAGS)
def test_merge_is_adding_both(a: list[float], b: list[float]) -> None:
    one, two, both = Lag(), Lag(), Lag()
    for x in a:
        one.add(x)
        both.add(x)
    for x in b:
        two.add(x)
        both.add(x)
    one.merge(two)
    assert (one.counts, one.n, one.max, one.ahead) == (both.counts, both.n, both.max, both.ahead)


def test_clock_ahead_tiny_and_empty() -> None:
    lag = Lag()
    assert lag.quantile(0.5) is None and lag.summary()["p99_ms"] is None
    assert lag.text() == "lag n/a (no batches)"
    lag.add(-0.003)  # the engine's clock ahead of the bridge's
    lag.add(0.0)
    lag.add(0.004)
    assert lag.n == 3 and lag.ahead == 1
    assert lag.quantile(0.5) == 1e-5  # the first bucket: at most 10 us
    assert 0.004 <= lag.quantile(1.0) <= 0.004 * 2 ** 0.25
    s = lag.summary()
    assert s["batches"] == 3 and s["ahead"] == 1 and s["max_ms"] == 4.0
    assert lag.text().startswith("lag p50 0.01 / p99 4.00 / max 4.00 ms (3)")
    huge = Lag()
    huge.add(3600.0)  # beyond the last bucket: counted there, max kept exactly
    assert huge.max == 3600.0 and huge.quantile(0.5) is not None and huge.quantile(0.5) > 200
