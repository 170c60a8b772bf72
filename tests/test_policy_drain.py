"""LoadTracker's drained load: reserved prompts not yet at their first token are worked off
at the engine's prefill rate, learned from the first tokens it delivered, so a long prompt
whose prefill is mostly done stops hiding its engine from new ones (the
simulator's numbers are in docs/benchmarks.md). Pure and fast; the proxy path through
RouterCore with engines that are never started (no sockets)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.routing import Candidate, LoadTracker, RoutingPolicy


def test_load_drains_at_the_rate_learned_from_first_tokens() -> None:
    lt = LoadTracker(clock=lambda: 0.0)
    lt.reserve("a", "e", 11.0, now=0.0, prefill=10.0)  # 10 blocks of prompt + 1 of decode
    assert lt.load("e", now=0.5) == 11.0  # no first token yet: nothing known, nothing drained
    assert lt.reduce("a", 10.0, now=1.0) == 10.0  # first token after 1 s: 10 blocks/s
    assert lt.prefill_rate("e") == pytest.approx(10.0)
    assert lt.release("a", now=2.0)
    lt.reserve("b", "e", 21.0, now=10.0, prefill=20.0)
    assert lt.load("e", now=10.0) == pytest.approx(21.0)
    assert lt.load("e", now=11.0) == pytest.approx(11.0)
    assert lt.load("e", now=12.0) == pytest.approx(1.0)
    assert lt.load("e", now=30.0) == pytest.approx(1.0)  # never below the decode share
    lt.reserve("c", "e", 5.0, now=30.0, prefill=5.0)  # queued behind b's remains (none)
    assert lt.load("e", now=30.0) == pytest.approx(6.0)
    assert lt.loads() == {"e": pytest.approx(26.0)}  # what is reserved stays reported whole
    lt.reduce("b", 20.0, now=30.2)
    assert lt.load("e", now=30.2) == pytest.approx(4.0)  # c's 5 blocks less 0.2 s of work
    assert lt.prefill_rate("e") < 10.0  # b took 20.2 s for 20 blocks: the rate learns it


def test_no_drain_without_a_rate_or_when_off() -> None:
    for drain in (True, False):
        lt = LoadTracker(clock=lambda: 0.0, drain=drain)
        lt.reserve("a", "e", 10.0, now=0.0, prefill=10.0)
        lt.reserve("b", "f", 10.0, now=0.0, prefill=10.0)
        lt.reduce("a", 10.0, now=1.0)
        lt.reserve("c", "e", 10.0, now=1.0, prefill=10.0)
        assert lt.load("f", now=100.0) == 10.0  # f never delivered a first token
        assert lt.load("e", now=100.0) == (0.0 if drain else 10.0)


def test_the_rate_counts_only_time_with_prefill_outstanding() -> None:
    """Idle time between bursts is not prefill time: an engine doing 10 blocks/s, idle for
    a minute between two prompts, still has a rate of 10 blocks/s (a rate taken over the
    idle gap too would be ~0.3 and keep its queue looking full long after it is done)."""
    lt = LoadTracker(clock=lambda: 0.0)
    for k, t in enumerate((0.0, 60.0, 130.0)):
        lt.reserve(f"r{k}", "e", 11.0, now=t, prefill=10.0)
        assert lt.reduce(f"r{k}", 10.0, now=t + 1.0) == 10.0
        assert lt.prefill_rate("e") == pytest.approx(10.0)
        assert lt.release(f"r{k}", now=t + 2.0)
    # two prompts at once, done one after the other: still 10 blocks/s of work
    lt.reserve("x", "e", 10.0, now=200.0, prefill=10.0)
    lt.reserve("y", "e", 10.0, now=200.0, prefill=10.0)
    lt.reduce("x", 10.0, now=201.0)
    lt.reduce("y", 10.0, now=202.0)
    assert lt.prefill_rate("e") == pytest.approx(10.0, rel=0.01)
    lt.release("x", now=202.0)
    lt.release("y", now=202.0)
    lt.reserve("z", "e", 30.0, now=300.0, prefill=30.0)
    assert lt.load("e", now=301.0) == pytest.approx(20.0, rel=0.01)


def test_a_request_that_ends_before_its_first_token_leaves_no_prefill_behind() -> None:
    """Its prompt is gone from the engine's queue: the next prompt is not taken as already
    half done by a backlog that no longer exists."""
    lt = LoadTracker(clock=lambda: 0.0)
    lt.reserve("a", "e", 10.0, now=0.0, prefill=10.0)
    lt.reduce("a", 10.0, now=1.0)  # 10 blocks/s learned
    lt.release("a", now=1.0)
    lt.reserve("b", "e", 20.0, now=5.0, prefill=20.0)
    assert lt.release("b", now=5.1)  # failed before its first token
    lt.reserve("c", "e", 10.0, now=6.0, prefill=10.0)
    assert lt.load("e", now=6.0) == pytest.approx(10.0)
    assert lt.load("e", now=6.5) == pytest.approx(5.0)


def test_a_request_that_ends_before_its_first_token_teaches_nothing() -> None:
    lt = LoadTracker(clock=lambda: 0.0)
    lt.reserve("a", "e", 10.0, now=0.0, prefill=10.0)
    assert lt.release("a", now=0.1)  # failed at once: not a prefill rate of 100 blocks/s
    assert lt.prefill_rate("e") == 0.0
    lt.reserve("b", "e", 10.0, now=1.0, prefill=10.0)
    assert lt.load("e", now=50.0) == 10.0


ops = st.lists(st.tuples(st.sampled_from(["reserve", "reduce", "release", "expire",
                                          "resize"]),
                         st.integers(0, 5), st.sampled_from(["e", "f"]),
                         st.floats(0, 50, allow_nan=False), st.floats(0, 1, allow_nan=False),
                         st.floats(0, 3, allow_nan=False)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_drained_load_stays_within_the_reserved_load(seq) -> None:
    """Whatever happens: 0 <= drained load <= reserved load, exactly the reserved load
    until the engine has a rate, and 0 once every reservation has ended."""
    now = [0.0]
    lt = LoadTracker(expiry_s=20.0, clock=lambda: now[0])
    for op, i, name, amount, share, dt in seq:
        now[0] += dt
        rid = f"r{i}"
        if op == "reserve":
            lt.reserve(rid, name, amount, prefill=amount * share)
        elif op == "reduce":
            lt.reduce(rid, amount)
        elif op == "release":
            lt.release(rid)
        elif op == "resize":
            before = lt.amount(rid), lt.prefill(rid)
            if lt.resize(rid, amount, amount * share):
                assert lt.amount(rid) == amount
                assert lt.prefill(rid) == pytest.approx(amount * share)
            else:  # gone, or past its first token: untouched
                assert (lt.amount(rid), lt.prefill(rid)) == before
        else:
            lt.expire()
        live = [f"r{k}" for k in range(6) if lt.amount(f"r{k}") is not None]
        for n in ("e", "f"):
            held = lt.loads().get(n, 0.0)
            got = lt.load(n)
            assert -1e-9 <= got <= held + 1e-9
            if lt.prefill_rate(n) == 0.0:
                assert got == held
            # the reserved load is the sum of the live reservations, resized or not
            assert held == pytest.approx(sum(lt.amount(r) for r in live if lt.holder(r) == n),
                                         abs=1e-6)
    for i in range(6):
        lt.release(f"r{i}")
    assert lt.load("e") == 0.0 and lt.load("f") == 0.0


def test_a_resized_prompt_drains_as_its_new_size() -> None:
    """A prompt reserved at an estimate (10 blocks) and resized to its true length (30)
    before its first token: the engine's queue holds 30 blocks of prefill, drained at the
    learned rate; past its first token it is not resized any more."""
    lt = LoadTracker(clock=lambda: 0.0)
    lt.reserve("a", "e", 11.0, now=0.0, prefill=10.0)
    lt.reduce("a", 10.0, now=1.0)  # 10 blocks/s learned
    lt.release("a", now=1.0)
    lt.reserve("b", "e", 11.0, now=2.0, prefill=10.0)
    assert lt.resize("b", 31.0, 30.0, now=2.0)
    assert lt.loads() == {"e": 31.0} and lt.prefill("b") == 30.0
    assert lt.load("e", now=3.0) == pytest.approx(21.0)  # 1 s of work off 30 blocks
    assert lt.resize("b", 6.0, 5.0, now=3.0)  # smaller than what is done: nothing queued
    assert lt.load("e", now=3.0) == pytest.approx(1.0)
    assert lt.reduce("b", 5.0, now=3.5) == 5.0
    assert not lt.resize("b", 50.0, 49.0) and lt.amount("b") == 1.0
    assert not lt.resize("gone", 1.0, 1.0)


def test_policy_sees_a_long_prompt_that_is_nearly_done() -> None:
    """Engine a took a 300-block prompt 7 s ago at a learned 40 blocks/s, engine b a
    50-block one just now: a new prompt goes to a (reserved load alone says b)."""
    lt = LoadTracker(clock=lambda: 0.0)
    lt.reserve("learn", "a", 40.0, now=0.0, prefill=40.0)
    lt.reduce("learn", 40.0, now=1.0)
    lt.release("learn", now=1.0)
    lt.reserve("long", "a", 301.0, now=3.0, prefill=300.0)
    lt.reserve("short", "b", 51.0, now=10.0, prefill=50.0)
    policy = RoutingPolicy(balance_slack=64.0, seed=0)

    def pick(load) -> str:
        return policy.choose(20, [Candidate(n, 0.0, load(n), True, lt.busy(n, 10.0))
                                  for n in ("a", "b")]).name

    assert pick(lambda n: lt.load(n, now=10.0)) == "a"
    assert pick(lambda n: lt.loads()[n]) == "b"


def test_proxy_routes_past_a_queue_its_engine_has_worked_off() -> None:
    """RouterCore reserves a proxied request's prefill and learns the rate from its first
    token: e_fast delivered 64 blocks in 1 s; later it takes a 200-block prompt and the
    other engine a 100-block one; 9.5 s on, a new prompt goes to the engine that has
    worked its prompt off, though it holds the larger reservation."""
    from kvwire.routing.core import EngineSpec, RouterCore

    now = [0.0]
    core = RouterCore([EngineSpec.parse(f"e{i}=tcp://127.0.0.1:9,url=http://127.0.0.1:9")
                       for i in range(2)], policy=RoutingPolicy(balance_slack=256.0, seed=0),
                      clock=lambda: now[0])
    yes = lambda _name: True  # noqa: E731
    learn = core.route_proxy([1] * 1024, None, None, yes, yes)  # 64 blocks of 16
    now[0] = 1.0
    core.first_token(learn.request_id, learn.prefill)
    now[0] = 1.5
    core.finish(learn.request_id, 16)
    now[0] = 10.0
    small = core.route_proxy([2] * 1600, None, None, yes, yes)  # 100 blocks: the other one
    assert small.engine != learn.engine  # (busy least lately)
    now[0] = 10.5
    big = core.route_proxy([3] * 3200, None, None, yes, yes)  # 200 blocks: the learned one
    assert big.engine == learn.engine
    now[0] = 20.0  # 9.5 s at 64 blocks/s: big's prefill is done, small's may not be
    assert core.route_proxy([4] * 800, None, None, yes, yes).engine == learn.engine


def test_simulator_learns_the_engine_models_prefill_rate() -> None:
    """The simulator's routers reserve each request's prefill and drop it at the first
    token, so the tracker learns the batched engine model's prefill rate: 8,192-token
    chunks of 512-token blocks at 5 ms + 50 us a token = 38.6 blocks/s (a little less
    with the decode steps in between). The oracle router, no publishers: no sockets."""
    from kvwire.sim.batched import BatchedSim, engine_config, run_batched
    from kvwire.sim.fleet import PolicyResult, Progress, SimConfig
    from kvwire.sim.routers import _Oracle
    from kvwire.sim.trace import bundled_trace_path, load_trace

    cfg = SimConfig(engines=2)
    reqs = load_trace(bundled_trace_path(), limit=120)
    engines = [BatchedSim(f"engine{i}", engine_config(cfg), None) for i in range(2)]
    router = _Oracle(engines, cfg)
    run_batched(reqs, engines, router, cfg, Progress("", len(reqs), False), PolicyResult(""))
    true_rate = 8192 / 512 / (5e-3 + 8192 * 50e-6)
    for e in engines:
        assert 0.9 * true_rate <= router.loads.prefill_rate(e.name) <= true_rate
