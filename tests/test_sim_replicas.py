"""The simulator's router replicas (``SimConfig.replicas``): requests spread over several
kvwire routers in turn, each with its own load, sharing it through the same
:class:`~kvwire.routing.sharing.PeerLoads` that ``kvwire serve --nats`` replicas use."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvwire.sim.fleet import SimConfig, simulate_policy
from kvwire.sim.quantile import percentile as quantile
from kvwire.sim.trace import bundled_trace_path, load_trace


def _head(n: int, load: float) -> list:
    return [replace(r, t=r.t / load) for r in load_trace(bundled_trace_path())[:n]]


def test_replicas_that_share_at_once_route_as_one_router_and_apart_they_do_not() -> None:
    """Reports that arrive at once make every replica's load the fleet's: the same choices,
    request for request, as one router. Replicas that do not share route each on its own
    third of the load, and the tail grows; a report delay lies between."""
    reqs = _head(800, 4.0)  # (one router: TTFT p99 5.3 s; three apart: 9.1 s)
    cfg = SimConfig(engines=8, capacity=5000)
    one = simulate_policy(reqs, "kvwire", cfg, progress=False)
    shared = simulate_policy(reqs, "kvwire", replace(cfg, replicas=3, share_delay=0.0),
                             progress=False)
    apart = simulate_policy(reqs, "kvwire", replace(cfg, replicas=3, share_load=False),
                            progress=False)
    assert shared.ttft_s == one.ttft_s and shared.hit_ratio == one.hit_ratio
    p99 = {name: quantile(r.ttft_s, 0.99) for name, r in
           (("one", one), ("shared", shared), ("apart", apart))}
    assert p99["apart"] > 1.4 * p99["one"], p99
    late = simulate_policy(reqs, "kvwire", replace(cfg, replicas=3, share_delay=0.002),
                           progress=False)
    assert len(late.ttft_s) == len(reqs)
    assert quantile(late.ttft_s, 0.99) < 1.1 * p99["one"] < p99["apart"]


def test_bad_replica_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="replicas >= 1"):
        SimConfig(replicas=0)
    with pytest.raises(ValueError, match="share_delay >= 0"):
        SimConfig(replicas=2, share_delay=-1.0)


def test_the_cli_runs_replicas_and_refuses_bad_settings() -> None:
    """``kvwire sim --replicas N [--no-share-load] [--share-delay S]`` in a real process; a
    replica count below 1 or a negative delay is a usage error naming the flag."""
    import json
    import subprocess
    import sys

    base = [sys.executable, "-m", "kvwire", "sim", "--limit", "200", "--policies", "kvwire",
            "--json", "--workers", "1"]
    one = subprocess.run(base, capture_output=True, text=True, timeout=120)
    shared = subprocess.run(base + ["--replicas", "3", "--share-delay", "0"],
                            capture_output=True, text=True, timeout=120)
    assert one.returncode == 0 == shared.returncode, one.stderr + shared.stderr
    assert json.loads(one.stdout)["policies"] == json.loads(shared.stdout)["policies"]
    for flag, value in (("--replicas", "0"), ("--share-delay", "-1")):
        r = subprocess.run(base + [flag, value], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and f"argument {flag}" in r.stderr, r.stderr
