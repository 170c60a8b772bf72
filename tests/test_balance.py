"""The balance slack of RoutingPolicy (cache first until a queue pulls ahead), SGLang's
``cache_aware`` rebuilt as a baseline (kvwire.sim.baselines), the simulator's load
lifecycle (prefill share dropped at the first token). All pure and fast: the policies side
by side on the bundled trace take minutes, so they are measured by bench/sim.py --compare
and bench/routing.py, not here (docs/benchmarks.md has the numbers)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.routing import Candidate, LoadTracker, RoutingPolicy, make_policy
from kvwire.sim.baselines import CacheAwareParams, CacheAwarePolicy

loads = st.floats(0, 1e5, allow_nan=False)
credits = st.floats(0, 64, allow_nan=False)


@st.composite
def fleets(draw):
    n = draw(st.integers(1, 8))
    return [Candidate(f"e{i}", draw(credits), draw(loads), draw(st.booleans()))
            for i in range(n)]


@settings(max_examples=300, deadline=None)
@given(fleets(), st.integers(1, 64), st.floats(0, 1e4, allow_nan=False),
       st.floats(0, 4, allow_nan=False))
def test_dead_engine_never_chosen_while_one_lives(cands, prompt, slack, lw) -> None:
    d = RoutingPolicy(load_weight=lw, balance_slack=slack, seed=0).choose(prompt, cands)
    if any(c.alive for c in cands):
        assert next(c for c in cands if c.name == d.name).alive


@settings(max_examples=200, deadline=None)
@given(fleets(), st.integers(1, 64), st.floats(0, 1e4, allow_nan=False), st.integers())
def test_ties_are_deterministic_under_a_seed(cands, prompt, slack, seed) -> None:
    def run() -> list[str]:
        p = RoutingPolicy(balance_slack=slack, seed=seed)
        return [p.choose(prompt, cands).name for _ in range(5)]
    assert run() == run()


@settings(max_examples=300, deadline=None)
@given(fleets(), st.integers(1, 64), st.floats(0, 4, allow_nan=False))
def test_zero_slack_is_the_old_cost(cands, prompt, lw) -> None:
    d = RoutingPolicy(load_weight=lw, seed=0).choose(prompt, cands)
    for c in cands:
        assert d.cost[c.name] == pytest.approx(max(prompt - c.credit, 0) + lw * c.load)


@settings(max_examples=300, deadline=None)
@given(fleets(), st.integers(1, 64), st.floats(0, 1e4, allow_nan=False),
       st.floats(0, 4, allow_nan=False), st.floats(0, 4, allow_nan=False))
def test_choose_prices_each_engine_as_cost_does(cands, prompt, slack, pw, lw) -> None:
    """``choose`` inlines the cost formula on its hot path; ``cost`` is the readable one the
    docs and callers use. They must agree, the least load taken over the live engines."""
    p = RoutingPolicy(prefill_weight=pw, load_weight=lw, balance_slack=slack, seed=0)
    d = p.choose(prompt, cands)
    least = min(c.load for c in ([c for c in cands if c.alive] or cands))
    for c in cands:
        assert d.cost[c.name] == pytest.approx(p.cost(prompt, c, least), abs=1e-9)
    if slack > 0:  # the slack is measured from the least load: below it, a queue is free
        free = Candidate("x", 0.0, least + slack * 0.999)
        assert p.cost(prompt, free, least) == pytest.approx(pw * prompt)
        over = Candidate("y", 0.0, least + slack + 10.0)
        assert p.cost(prompt, over, least) == pytest.approx(pw * prompt + lw * 10.0)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64), st.floats(1, 1e4, allow_nan=False),
       st.floats(0, 2e4, allow_nan=False), st.floats(0, 50, allow_nan=False))
def test_owner_kept_until_its_queue_exceeds_the_slack(prompt, slack, owner_load,
                                                      other_load) -> None:
    """The cache-first/balance switch: the engine holding the whole prompt keeps it while
    its load is within slack + the other's uncached work of the least-loaded engine's."""
    owner = Candidate("owner", float(prompt), owner_load)
    other = Candidate("other", 0.0, other_load)
    d = RoutingPolicy(balance_slack=slack, seed=0).choose(prompt, [owner, other])
    least = min(owner_load, other_load)
    owner_cost = max(owner_load - least - slack, 0.0)
    other_cost = prompt + max(other_load - least - slack, 0.0)
    assert d.cost == pytest.approx({"owner": owner_cost, "other": other_cost})
    if owner_cost < other_cost - 1e-6:
        assert d.name == "owner"
    elif owner_cost > other_cost + 1e-6:
        assert d.name == "other"
    if owner_load <= least + slack:
        assert d.name == "owner"  # cache first: the queue costs nothing yet


def test_slack_is_measured_from_the_least_loaded_live_engine() -> None:
    p = RoutingPolicy(balance_slack=10.0, seed=0)
    cands = [Candidate("a", 8.0, 30.0), Candidate("b", 0.0, 25.0),
             Candidate("dead", 0.0, 0.0, alive=False)]
    d = p.choose(8, cands)
    # least live load 25: a's excess max(30-25-10, 0) = 0, cost 0; b's cost 8
    assert d.name == "a" and d.cost["a"] == 0.0 and d.cost["b"] == 8.0
    with pytest.raises(ValueError, match="balance_slack"):
        RoutingPolicy(balance_slack=-1)
    assert make_policy("kvwire", balance_slack=3.0).balance_slack == 3.0


# ------------------------------------------------------------- SGLang's cache_aware


def test_cache_aware_follows_its_tree_and_fills_the_smallest() -> None:
    pol = CacheAwarePolicy(["w0", "w1", "w2"], CacheAwareParams(eviction_interval=0,
                                                                miss="smallest_tree"))
    first = pol.choose([1, 2, 3, 4], 4, now=0.0)
    assert pol.choose([1, 2, 3, 4, 5], 5, now=1.0) == first  # 4/5 matched > 0.3
    other = pol.choose([9, 8, 7], 3, now=2.0)  # no match: the smallest tree
    assert other != first
    assert pol.choose([1, 7, 7, 7], 4, now=3.0) != first  # 1/4 = 0.25 <= 0.3: a miss
    assert pol.cache_routes == 1 and pol.miss_routes == 3


def test_cache_aware_sends_a_miss_to_the_least_loaded_by_default() -> None:
    pol = CacheAwarePolicy(["w0", "w1", "w2"])
    assert pol.choose([1, 2, 3], 3, now=0.0) == "w0"  # all idle: the first worker
    assert pol.choose([4, 5, 6], 3, now=0.0) == "w1"  # w0 has one in flight
    pol.complete("w0")
    assert pol.choose([7, 8, 9], 3, now=0.0) == "w0"  # idle again: the first (concentrates)
    assert pol.choose([1, 2, 3, 4], 4, now=0.0) == "w0"  # 3/4 matched: its tree's owner
    with pytest.raises(ValueError, match="miss"):
        CacheAwarePolicy(["w0"], CacheAwareParams(miss="nearest"))


def test_cache_aware_goes_to_the_shortest_queue_when_imbalanced() -> None:
    pol = CacheAwarePolicy(["w0", "w1"], CacheAwareParams(balance_abs_threshold=3,
                                                          balance_rel_threshold=1.5))
    home = pol.choose([1, 2], 2, now=0.0)
    for t in range(3):  # in flight on home: 4 vs 0 once these are routed
        assert pol.choose([1, 2], 2, now=1.0 + t) == home
    away = pol.choose([1, 2], 2, now=5.0)  # 4 - 0 > 3 and 4 > 0 x 1.5: shortest queue
    assert away != home and pol.imbalanced_routes == 1
    for _ in range(4):
        pol.complete(home)
    assert pol.choose([1, 2], 2, now=6.0) in (home, away)  # balanced again: the tree
    assert pol.imbalanced_routes == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=6),
                          st.sets(st.integers(0, 3), max_size=4)), min_size=1, max_size=30))
def test_cache_aware_never_picks_a_dead_worker_while_one_lives(steps) -> None:
    names = [f"w{i}" for i in range(4)]
    pol = CacheAwarePolicy(names, CacheAwareParams(balance_abs_threshold=2,
                                                   balance_rel_threshold=1.0))
    for t, (keys, dead) in enumerate(steps):
        alive = {n: i not in dead for i, n in enumerate(names)}
        name = pol.choose(keys, len(keys), float(t), alive)
        if any(alive.values()):
            assert alive[name]


def test_cache_aware_evicts_least_recent_past_max_tree_size() -> None:
    pol = CacheAwarePolicy(["w0"], CacheAwareParams(eviction_interval=10, max_tree_size=3))
    pol.choose(["a", "b"], 2, now=0.0)
    pol.choose(["c", "d"], 2, now=5.0)
    assert pol.size["w0"] == 4
    pol.choose(["c", "d"], 2, now=11.0)  # eviction pass first: drops the oldest leaf
    assert pol.size["w0"] == 3
    assert pol._match(["a"])[0] == 1 and pol._match(["a", "b"])[0] == 1


def test_cache_aware_boundaries_as_sglang_states_them() -> None:
    """The strict inequalities of SGLang's rule: a match rate of exactly the threshold is a
    miss, a gap of exactly the absolute threshold (or a max of exactly rel x min) is still
    balanced; the rate counts items of ``unit`` length against the prompt's length."""
    pol = CacheAwarePolicy(["w0", "w1"], unit=16)
    home = pol.choose([1, 2, 3], 48, now=0.0)
    pol.complete(home)
    # 3 of 10 blocks = 0.3 (not above 0.3): a miss, to the least loaded (w0, the first)
    assert pol.choose([1, 2, 3, 9, 9, 9, 9, 9, 9, 9], 160, now=1.0) == "w0"
    assert pol.cache_routes == 0
    pol.complete("w0")
    # 3 of 9 blocks (0.33): the tree's owner, with the rate in blocks x 16 / tokens
    assert pol.choose([1, 2, 3, 8, 8, 8, 8, 8, 8], 144, now=2.0) == home
    assert pol.cache_routes == 1
    pol = CacheAwarePolicy(["w0", "w1"], CacheAwareParams(balance_abs_threshold=2,
                                                          balance_rel_threshold=2.0))
    pol.load.update(w0=4, w1=2)  # gap 2 (not above 2): balanced; 4 = 2 x 2.0 (not above)
    pol.choose([5], 1, now=0.0)
    assert pol.imbalanced_routes == 0
    pol.load.update(w0=3, w1=1)  # 3 > 1 x 2.0, but gap 2 (not above 2): balanced
    pol.choose([5], 1, now=0.0)
    pol.load.update(w0=6, w1=3)  # gap 3 > 2, but 6 = 3 x 2.0 (not above): balanced
    pol.choose([5], 1, now=0.0)
    assert pol.imbalanced_routes == 0
    pol.load.update(w0=5, w1=2)  # gap 3 > 2 and 5 > 4: the shortest queue
    assert pol.choose([5], 1, now=0.0) == "w1" and pol.imbalanced_routes == 1


def test_cache_aware_defaults_are_sglang_router_0_3_2s() -> None:
    """The defaults of ``sglang_router.router_args.RouterArgs`` in sglang-router 0.3.2 (the
    version bench/proxy.py runs), and of its gateway's miss rule."""
    assert CacheAwareParams() == CacheAwareParams(
        cache_threshold=0.3, balance_abs_threshold=64, balance_rel_threshold=1.5,
        eviction_interval=60.0, max_tree_size=2**26, miss="min_load")
    try:
        from sglang_router.router_args import RouterArgs  # the bench tier installs it
    except ImportError:
        return
    a = RouterArgs()
    assert (a.cache_threshold, a.balance_abs_threshold, a.balance_rel_threshold,
            a.eviction_interval_secs, a.max_tree_size) == (0.3, 64, 1.5, 60, 2**26)


def test_cache_aware_edges() -> None:
    """No workers is an error; completing an idle worker leaves it at 0; a worker missing
    from ``alive`` counts as alive (only a False keeps it out)."""
    with pytest.raises(ValueError, match="no workers"):
        CacheAwarePolicy([])
    pol = CacheAwarePolicy(["w0", "w1"])
    pol.complete("w0")
    pol.complete("gone")  # a worker it does not know: nothing to lower
    assert pol.load == {"w0": 0, "w1": 0}
    assert pol.choose([], 0, now=0.0) == "w0" and pol.miss_routes == 1  # empty: a miss
    pol.complete("w0")
    assert pol.choose([1], 1, now=0.0, alive={"w0": False}) == "w1"


def test_cache_aware_evicts_once_an_interval_and_only_past_the_size() -> None:
    """Eviction runs every ``eviction_interval`` s (not on every route), cuts a tree only
    when it is past ``max_tree_size`` (one of exactly that size stays), and a node left
    with no tenant leaves the trie with its edge."""
    pol = CacheAwarePolicy(["w0"], CacheAwareParams(eviction_interval=10, max_tree_size=2))
    pol.choose(["a", "b"], 2, now=0.0)
    pol.choose(["a", "b"], 2, now=10.0)  # a pass at 10: size 2 is not past 2
    assert pol.size["w0"] == 2
    pol.choose(["c"], 1, now=11.0)  # size 3, but the next pass is at 20
    pol.choose(["d"], 1, now=19.9)
    assert pol.size["w0"] == 4 and pol._match(["a", "b"])[0] == 2
    pol.choose(["d"], 1, now=20.0)  # the pass: the least recent (a, b) go, leaf first
    assert pol.size["w0"] == 2 and pol._match(["a"])[0] == 0
    assert ("a" not in {k for _, k in pol._child}) and len(pol._owners) == 2


# ------------------------------------------------------------- the simulator


def test_sim_router_drops_the_prefill_share_at_the_first_token() -> None:
    from kvwire.sim.batched import BatchedSim, engine_config
    from kvwire.sim.fleet import SimConfig
    from kvwire.sim.routers import _LeastLoad
    from kvwire.sim.trace import Request

    cfg = SimConfig(engines=2, capacity=100)
    engines = [BatchedSim(f"engine{i}", engine_config(cfg), None) for i in range(2)]
    r = _LeastLoad(engines, cfg)
    req = Request(0.0, 4 * 512, 10, (1, 2, 3, 4))
    e = r.route("r0", req, [1, 2, 3, 4], 0.0)
    name = engines[e].name
    assert r.loads.load(name) == 4.0  # 4 uncached blocks (no output learned yet)
    r.first_token("r0")
    assert r.loads.load(name) == 0.0
    r.release("r0", req)
    assert r.loads.load(name) == 0.0 and len(r.loads) == 0


# ------------------------------------------------------------- busy time as the last tie-break


def test_a_tie_goes_to_the_engine_busy_least_lately() -> None:
    """Equal cost and load (a new prefix, idle engines): not a coin toss but the engine that
    held requests least lately, whatever the seed (without it the seeded pick varies)."""
    cands = [Candidate("a", 0.0, 0.0, True, 30.0), Candidate("b", 0.0, 0.0, True, 12.0),
             Candidate("c", 0.0, 0.0, True, 50.0), Candidate("d", 0.0, 0.0, False, 0.0)]
    for seed in range(20):
        assert RoutingPolicy(balance_slack=256.0, seed=seed).choose(8, cands).name == "b"
        assert RoutingPolicy(load_weight=0.5, seed=seed).choose(8, cands).name == "b"
    # busy time only breaks ties: a cached prefix or a shorter queue still wins
    owner = Candidate("c", 8.0, 0.0, True, 50.0)
    assert RoutingPolicy(balance_slack=256.0, seed=0).choose(8, [cands[0], owner]).name == "c"
    queued = Candidate("b", 0.0, 3.0, True, 0.0)
    assert RoutingPolicy(balance_slack=256.0, seed=0).choose(8, [cands[0], queued]).name == "a"


intervals = st.lists(st.tuples(st.sampled_from("ab"), st.floats(0, 100, allow_nan=False),
                               st.floats(0.01, 50, allow_nan=False)), max_size=30)


@settings(max_examples=300, deadline=None)
@given(intervals)
def test_busy_time_is_the_union_of_reservations_decayed(spans) -> None:
    """LoadTracker.busy is the time an engine held at least one reservation (overlaps
    counted once), each second weighted exp(-age / window): checked against the union of
    the intervals, integrated directly."""
    window = 50.0
    lt = LoadTracker(busy_window=window, clock=lambda: 0.0)
    events = []
    for i, (name, start, length) in enumerate(spans):
        events.append((start, 1, f"r{i}", name))
        events.append((start + length, 0, f"r{i}", name))
    for t, kind, rid, name in sorted(events):  # releases first at equal times
        if kind:
            lt.reserve(rid, name, 1.0, now=t)
        else:
            lt.release(rid, now=t)
    end = 200.0
    for name in "ab":
        union: list[list[float]] = []
        for s, length in sorted((s, length) for n, s, length in spans if n == name):
            if union and s <= union[-1][1]:
                union[-1][1] = max(union[-1][1], s + length)
            else:
                union.append([s, s + length])
        expect = sum(window * (math.exp(-(end - b) / window) - math.exp(-(end - a) / window))
                     for a, b in union)
        assert lt.busy(name, end) == pytest.approx(expect, rel=1e-6, abs=1e-9)
    lt.reserve("open", "a", 1.0, now=end)  # an engine busy now keeps accruing
    assert lt.busy("a", end + 10) == pytest.approx(
        lt.busy("a", end) * math.exp(-10 / window) + window * (1 - math.exp(-10 / window)))
    with pytest.raises(ValueError, match="busy_window"):
        LoadTracker(busy_window=0)


def test_sim_new_prefixes_even_out_the_engines_work() -> None:
    """The first 400 requests of the bundled trace (outputs capped at 16 tokens, as
    bench/routing.py sends them), 8 engines: with ties placed by busy time the engines'
    work max/mean is 1.015; drawn at random among equally loaded engines it was 1.154."""
    from dataclasses import replace

    from kvwire.sim.fleet import SimConfig, run_sim
    from kvwire.sim.trace import bundled_trace_path, load_trace

    reqs = [replace(r, output_length=min(r.output_length, 16))
            for r in load_trace(bundled_trace_path(), limit=400)]
    res = run_sim(reqs, SimConfig(engines=8), ["kvwire"], workers=1).results["kvwire"]
    assert res.work_max_over_mean <= 1.05
    assert res.hit_ratio >= 0.05


def test_proxy_routes_a_new_prompt_to_the_engine_busy_least_lately() -> None:
    """RouterCore hands the load tracker's busy times to the policy: after e0 (or e1) held
    a request for 10 s, the next prompt with no cached prefix goes to the other one, for
    every seed (engines never started: all dead, so all compete; no sockets opened)."""
    from kvwire.routing.core import EngineSpec, RouterCore

    now = [0.0]
    for seed in range(8):
        now[0] = 0.0
        core = RouterCore([EngineSpec.parse(f"e{i}=tcp://127.0.0.1:9,url=http://127.0.0.1:9")
                           for i in range(2)], policy=RoutingPolicy(balance_slack=256.0,
                                                                    seed=seed),
                          clock=lambda: now[0])
        yes = lambda _name: True  # noqa: E731
        first = core.route_proxy([7] * 64, None, None, yes, yes)
        now[0] = 10.0
        assert core.finish(first.request_id, 16)
        now[0] = 11.0
        second = core.route_proxy([9] * 64, None, None, yes, yes)
        assert second.engine != first.engine
        core.finish(second.request_id, 16)
        now[0] = 40.0  # the decision API's /route and /release: the same (e0 and e1
        held = core.route([5] * 64)  # each had 10 s; now the one that held this is busier)
        now[0] = 50.0
        core.release(held["request_id"])
        assert core.route([3] * 64, reserve=False)["engine"] != held["engine"]


# --------------------------------------------------- the cache-blind baselines of --policy


@settings(max_examples=200, deadline=None)
@given(fleets(), st.integers(0, 2**32))
def test_baselines_spread_over_live_engines_and_avoid_dead_ones(cands, seed) -> None:
    live = [c.name for c in cands if c.alive] or [c.name for c in cands]
    n = 4 * len(live)
    rr = make_policy("round_robin", seed=seed)
    got = [rr.choose(8, cands).name for _ in range(n)]
    assert sorted(got) == sorted(live * 4)  # each live engine exactly in turn
    assert all(got[i] != got[i + 1] for i in range(n - 1)) or len(live) == 1
    least = min(c.load for c in cands if c.name in live)
    ll = make_policy("least_load", seed=seed)
    for _ in range(10):
        d = ll.choose(8, cands)
        assert d.name in live
        assert next(c for c in cands if c.name == d.name).load <= least + 1e-9
        assert d.cost == {c.name: c.load for c in cands}
        assert d.overlap == {c.name: c.credit for c in cands}
    rnd = make_policy("random", seed=seed)
    picks = [rnd.choose(8, cands).name for _ in range(60 * len(live))]
    assert set(picks) == set(live)  # uniform: every live engine comes up (p fail < 1e-9)
    again = make_policy("random", seed=seed)
    assert [again.choose(8, cands).name for _ in range(len(picks))] == picks  # seeded


def test_least_load_ties_are_seeded_random() -> None:
    cands = [Candidate(f"e{i}", 0.0, 5.0) for i in range(4)] + [Candidate("busy", 0.0, 9.0)]
    def run(seed: int) -> list[str]:
        p = make_policy("least_load", seed=seed)
        return [p.choose(1, cands).name for _ in range(40)]
    runs = [run(1), run(1), run(2)]
    assert runs[0] == runs[1] and set(runs[0]) == {"e0", "e1", "e2", "e3"}
    assert runs[0] != runs[2]


def test_make_policy_names_and_errors() -> None:
    from kvwire.routing.policy import (
        POLICIES,
        LeastLoadPolicy,
        RandomPolicy,
        RoundRobinPolicy,
    )
    kinds = {"kvwire": RoutingPolicy, "round_robin": RoundRobinPolicy,
             "least_load": LeastLoadPolicy, "random": RandomPolicy}
    assert set(POLICIES) == set(kinds)
    for name, cls in kinds.items():
        p = make_policy(name, seed=0)
        assert type(p) is cls
        with pytest.raises(ValueError, match="no candidates"):
            p.choose(1, [])
    with pytest.raises(ValueError, match=r"unknown policy 'fastest' \(expected one of kvwire, "):
        make_policy("fastest")
