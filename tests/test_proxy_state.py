"""The proxy's pure decisions (kvwire.proxy.decisions) and the load accounting they drive
on a real LoadTracker: no reservation outlives its request, whatever order the I/O layer
reports first tokens, ends, failures, disconnects and retries in."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.proxy.decisions import Breaker, Lifecycle, Outcome, marks_down, should_retry
from kvwire.routing.load import LoadTracker
from kvwire.routing.policy import Candidate as C
from kvwire.routing.policy import (
    LeastLoadPolicy,
    RoundRobinPolicy,
    make_policy,
)


def test_lifecycle_drops_prefill_once_and_releases_once() -> None:
    lt = LoadTracker()
    lt.reserve("r", "e", 10.0)
    lc = Lifecycle("r", 8.0)
    assert lt.reduce("r", lc.first_token()) == 8.0
    assert lt.load("e") == 2.0
    assert lc.first_token() == 0.0  # a second first byte drops nothing
    assert lc.end() and lt.release("r")
    assert not lc.end()
    assert lt.loads() == {} and len(lt) == 0


def test_lifecycle_end_before_first_token() -> None:
    lc = Lifecycle("r", 5.0)
    assert lc.end()
    assert lc.first_token() == 0.0  # a late first byte after the end changes nothing


def test_reduce_is_bounded_and_ignores_unknown_ids() -> None:
    lt = LoadTracker()
    lt.reserve("a", "e", 3.0)
    lt.reserve("b", "e", 4.0)
    assert lt.reduce("a", 10.0) == 3.0  # never below zero
    assert lt.load("e") == 4.0 and lt.amount("a") == 0.0
    assert lt.reduce("zz", 1.0) == 0.0
    assert lt.release("a") and lt.release("b") and lt.loads() == {}


# One request: route (reserve) on an engine, maybe a first token, then an end; a failed
# attempt ends and reserves again on another engine (a retry). Events of many requests
# interleave in any order.
_events = st.lists(st.tuples(st.integers(0, 7), st.sampled_from(
    ["first", "end", "retry", "expire_check"])), max_size=120)


@settings(max_examples=300, deadline=None)
@given(_events, st.lists(st.floats(0, 64, allow_nan=False), min_size=8, max_size=8))
def test_no_reservation_outlives_its_request(events: list, prefills: list[float]) -> None:
    lt = LoadTracker()
    live: dict[int, tuple[Lifecycle, str, float]] = {}  # request -> (lifecycle, engine, held)
    n_ids = [0]

    def route(i: int, engine: str) -> None:
        rid = f"{i}-{n_ids[0]}"
        n_ids[0] += 1
        amount = prefills[i] + 1.0  # prefill + decode
        lt.reserve(rid, engine, amount)
        live[i] = (Lifecycle(rid, prefills[i]), engine, amount)

    def end(i: int) -> None:
        lc, _, _ = live.pop(i)
        if lc.end():
            assert lt.release(lc.request_id)
        assert not lc.end()

    for i in range(8):
        route(i, f"e{i % 3}")
    for i, ev in events:
        if i not in live:
            continue
        lc, engine, held = live[i]
        if ev == "first":
            drop = lc.first_token()
            got = lt.reduce(lc.request_id, drop)
            assert got == drop  # the prefill share is there to drop, exactly once
            live[i] = (lc, engine, held - got)
        elif ev == "end":
            end(i)
        elif ev == "retry":  # the attempt failed: its reservation ends, a new one starts
            end(i)
            route(i, f"e{(int(engine[1]) + 1) % 3}")
        # the exact accounting: each engine's load is what its live requests hold
        for e in ("e0", "e1", "e2"):
            want = sum(h for _, en, h in live.values() if en == e)
            assert abs(lt.load(e) - want) < 1e-6
    for i in list(live):
        end(i)
    assert lt.loads() == {} and len(lt) == 0 and lt.unknown_releases == 0


def test_retry_decisions() -> None:
    for o in (Outcome.REFUSED, Outcome.SERVER_ERROR, Outcome.TIMEOUT):
        assert should_retry(o, 0, 2, False) and should_retry(o, 1, 2, False)
        assert not should_retry(o, 2, 2, False)  # retries used up
        assert not should_retry(o, 0, 2, True)  # the client has bytes: committed
        assert marks_down(o)
    for o in (Outcome.OK, Outcome.CLIENT_GONE):
        assert not should_retry(o, 0, 2, False) and not marks_down(o)
    assert not should_retry(Outcome.REFUSED, 0, 0, False)


def test_breaker_cooloff_and_probe_back() -> None:
    b = Breaker(cooloff=5.0)
    assert b.up
    b.failure(100.0)
    assert not b.up and b.opened == 1
    b.probe(True, 103.0)  # healthy, but still cooling off
    assert not b.up
    b.failure(104.0)  # another failure extends the cool-off, counted once as an opening
    assert b.opened == 1 and b.failures == 2
    b.probe(True, 108.0)
    assert not b.up
    b.probe(True, 109.0)
    assert b.up
    b.probe(False, 110.0)  # a failed probe marks an up engine down
    assert not b.up and b.opened == 2


def test_baseline_policies() -> None:
    cands = [C("a", 10.0, 5.0), C("b", 0.0, 1.0), C("c", 0.0, 3.0, alive=False)]
    rr = RoundRobinPolicy()
    picks = [rr.choose(10, cands).name for _ in range(4)]
    assert sorted(set(picks)) == ["a", "b"] and picks[0] != picks[1]  # dead one skipped
    assert LeastLoadPolicy(seed=1).choose(10, cands).name == "b"
    assert make_policy("kvwire").choose(10, cands).name == "a"  # the cache wins
    assert {make_policy("random", seed=s).choose(10, cands).name for s in range(20)} == {
        "a", "b"}
    try:
        make_policy("nope")
    except ValueError as e:
        assert "round_robin" in str(e)
    else:
        raise AssertionError("unknown policy accepted")
