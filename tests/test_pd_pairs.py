"""Prefill/decode pairs: the pure decision (:func:`kvwire.routing.pairs.choose_pair`), the
engines' roles (``EngineSpec``'s ``role=`` and ``bootstrap_port=``) and the routing core's
``route_pair`` (one core, engines never started: their blocks are applied as the feed
applies a delivery)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.consume.stream import Batch
from kvwire.routing.core import EngineSpec, RouterCore
from kvwire.routing.pairs import WHY, PairConfig, PairDecision, choose_pair
from kvwire.routing.policy import Candidate, RoutingPolicy, make_policy
from kvwire.wire.events import BlockStored, KVEventBatch

BS = 16


# ---------------------------------------------------------------------- choose_pair

def _cand(name: str) -> Any:
    return st.builds(Candidate, st.just(name), st.floats(0, 12), st.floats(0, 40),
                     st.booleans(), st.floats(0, 5))


@st.composite
def fleets(draw: Any) -> tuple[int, list[Candidate], list[Candidate]]:
    """A prompt and a fleet: each engine a role; a ``both`` engine is in both lists (the
    same candidate: its one load and overlap)."""
    n = draw(st.integers(1, 6))
    roles = draw(st.lists(st.sampled_from(("prefill", "decode", "both")), min_size=n,
                          max_size=n))
    cands = [draw(_cand(f"e{i}")) for i in range(n)]
    dec = [c for c, r in zip(cands, roles, strict=True) if r != "prefill"]
    pre = [c for c, r in zip(cands, roles, strict=True) if r != "decode"]
    return draw(st.integers(0, 12)), dec, pre


configs = st.builds(PairConfig, st.floats(0, 14),
                    st.one_of(st.just(math.inf), st.floats(0, 45)))


@settings(max_examples=400, deadline=None)
@given(fleets(), configs, st.integers(0, 3))
def test_decode_first_then_the_decider_then_the_prefill_engine(fleet: Any, cfg: PairConfig,
                                                               seed: int) -> None:
    """Every decision, against the rules said independently: the decode engine is the
    policy's pick among the decode candidates; local ("cached") when it misses under
    ``min_disagg_blocks``, else ("no_prefill") with no prefill candidate, else
    ("prefill_busy") when every live prefill candidate (all, if none is live) is past
    the bound, else the policy's pick among the prefill candidates, which is local
    ("local") when it is the decode engine itself (a ``both`` engine)."""
    blocks, dec, pre = fleet
    if not dec:
        with pytest.raises(ValueError, match="no engine can decode"):
            choose_pair(RoutingPolicy(seed=seed), blocks, dec, pre, cfg)
        return
    pd = choose_pair(RoutingPolicy(seed=seed), blocks, dec, pre, cfg)
    # the same decisions made again by a policy of the same seed, one side at a time
    ref = RoutingPolicy(seed=seed)
    d = ref.choose(blocks, dec)
    assert pd.decode == d
    assert pd.why in WHY
    assert pd.decode.name in {c.name for c in dec}
    uncached = max(blocks - d.overlap[d.name], 0.0)
    pool = [c for c in pre if c.alive] or pre
    if uncached < cfg.min_disagg_blocks:
        assert pd.why == "cached" and pd.prefill is None
    elif not pre:
        assert pd.why == "no_prefill" and pd.prefill is None
    elif all(c.load > cfg.prefill_busy for c in pool):
        assert pd.why == "prefill_busy" and pd.prefill is None
    else:
        p = ref.choose(blocks, pre)
        if p.name == d.name:
            assert pd.why == "local" and pd.prefill is None
            assert d.name in {c.name for c in pre}  # a both engine
        else:
            assert pd.why == "disagg" and pd.prefill == p and pd.disaggregated
            assert pd.prefill.name in {c.name for c in pre}
    assert pd.disaggregated == (pd.why == "disagg")


@settings(max_examples=200, deadline=None)
@given(fleets(), configs, st.sampled_from(("round_robin", "least_load", "random")))
def test_any_policy_keeps_the_roles(fleet: Any, cfg: PairConfig, name: str) -> None:
    """Whatever the policy (the cache-blind baselines too): the decode engine can decode,
    the prefill engine can prefill and is another engine."""
    blocks, dec, pre = fleet
    if not dec:
        return
    pd = choose_pair(make_policy(name, seed=1), blocks, dec, pre, cfg)
    assert pd.decode.name in {c.name for c in dec}
    if pd.prefill is not None:
        assert pd.prefill.name in {c.name for c in pre}
        assert pd.prefill.name != pd.decode.name


def test_the_prefill_goes_where_its_prefix_is_and_the_decode_where_its_is() -> None:
    """Two prefill engines, two decode engines: each side by its own overlap."""
    pol = RoutingPolicy(load_weight=0.5, seed=0)
    dec = [Candidate("d0", 0.0), Candidate("d1", 6.0)]
    pre = [Candidate("p0", 8.0), Candidate("p1", 0.0)]
    pd = choose_pair(pol, 8, dec, pre)
    assert (pd.decode.name, pd.prefill and pd.prefill.name, pd.why) == ("d1", "p0", "disagg")
    # the decode engine misses 2 blocks: under a bound of 3 it prefills them itself
    pd = choose_pair(pol, 8, dec, pre, PairConfig(min_disagg_blocks=3))
    assert (pd.decode.name, pd.prefill, pd.why) == ("d1", None, "cached")
    # every prefill engine past the busy bound: local too (a dead one does not count)
    busy = [Candidate("p0", 8.0, load=30.0), Candidate("p1", 0.0, load=21.0),
            Candidate("p2", 0.0, load=0.0, alive=False)]
    pd = choose_pair(pol, 8, dec, busy, PairConfig(prefill_busy=20))
    assert (pd.prefill, pd.why) == (None, "prefill_busy")
    # one under the bound: it disaggregates (to the best by the policy)
    busy[1] = Candidate("p1", 0.0, load=19.0)
    pd = choose_pair(pol, 8, dec, busy, PairConfig(prefill_busy=20))
    assert pd.why == "disagg" and pd.prefill is not None
    assert choose_pair(pol, 8, dec, []).why == "no_prefill"


def test_a_both_engine_chosen_for_both_sides_prefills_locally() -> None:
    pol = RoutingPolicy(seed=0)
    both = Candidate("b0", 8.0)
    pd = choose_pair(pol, 8, [both, Candidate("d0")], [both, Candidate("p0")])
    assert pd == PairDecision(pd.decode, None, "local") and pd.decode.name == "b0"


@pytest.mark.parametrize("kw, msg", [
    ({"min_disagg_blocks": -1}, "min_disagg_blocks"),
    ({"min_disagg_blocks": math.inf}, "min_disagg_blocks"),
    ({"prefill_busy": -0.5}, "prefill_busy"),
    ({"prefill_busy": math.nan}, "prefill_busy"),
])
def test_pair_config_refuses_bad_thresholds(kw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        PairConfig(**kw)


# ---------------------------------------------------------------------- EngineSpec roles

def test_engine_spec_role_and_bootstrap_port() -> None:
    e = EngineSpec.parse("p0=tcp://127.0.0.1:5557,url=http://127.0.0.1:8000,role=prefill,"
                         "bootstrap_port=9100")
    assert (e.role, e.bootstrap_port, e.prefills, e.decodes) == ("prefill", 9100, True, False)
    e = EngineSpec.parse("d0=tcp://127.0.0.1:5557,role=decode")
    assert (e.role, e.bootstrap_port, e.prefills, e.decodes) == ("decode", 8998, False, True)
    e = EngineSpec.parse("b0=tcp://127.0.0.1:5557")
    assert (e.role, e.prefills, e.decodes) == ("both", True, True)
    n = EngineSpec.parse_named("p1:2,url=http://127.0.0.1:8001,role=prefill,bootstrap_port=1")
    assert (n.ranks, n.role, n.bootstrap_port) == (2, "prefill", 1)


@pytest.mark.parametrize("text, msg", [
    ("e=tcp://127.0.0.1:1,role=prefil", "unknown role 'prefil' (expected prefill, decode or "
                                        "both)"),
    ("e=tcp://127.0.0.1:1,role=", "unknown role ''"),
    ("e=tcp://127.0.0.1:1,role=both,role=decode", "role given twice"),
    ("e=tcp://127.0.0.1:1,bootstrap_port=0", "bootstrap_port '0' must be 1..65535"),
    ("e=tcp://127.0.0.1:1,bootstrap_port=x", "bootstrap_port 'x' must be 1..65535"),
    ("e=tcp://127.0.0.1:1,bootstrap_port=70000", "must be 1..65535"),
    ("e=tcp://127.0.0.1:1,role=decode,bootstrap_port=9000", "bootstrap_port is a prefill "
                                                            "engine's"),
    ("e=tcp://127.0.0.1:1,rolle=decode", "unknown option 'rolle=decode'"),
])
def test_engine_spec_refuses_bad_roles(text: str, msg: str) -> None:
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        EngineSpec.parse(text)
    with pytest.raises(ValueError, match="unknown role"):
        EngineSpec.parse_named("e,role=middle")
    with pytest.raises(ValueError, match="unknown role 'x'"):
        EngineSpec("e", None, role="x")


# ---------------------------------------------------------------------- RouterCore.route_pair

def yes(_engine: str) -> bool:
    return True


def _core(roles: dict[str, str], held: dict[str, list[int]],
          **kw: Any) -> tuple[RouterCore, list]:
    """A core over engines of these roles, each holding ``held[name]`` (whole blocks),
    live; and the list its shared reports go to (predictions show there)."""
    core = RouterCore([EngineSpec(n, f"ipc:///nonexistent/{n}", role=r)
                       for n, r in roles.items()], block_size=BS,
                      policy=RoutingPolicy(load_weight=0.5, seed=0), **kw)
    for t in core.targets:
        tokens = held.get(t.engine, [])
        nb = len(tokens) // BS
        core.alive[t.stream] = True
        if nb:
            stored = BlockStored(list(range(1, nb + 1)), None, tokens[:nb * BS], BS, None)
            core.feed._apply([Batch(t.stream, 0, KVEventBatch(0.0, [stored], 0), 1)])
    ops: list[Any] = []
    core.share = ops.append
    return core, ops


def test_route_pair_reserves_each_side_and_predicts_on_both() -> None:
    """p1 holds the prompt's first 3 of 4 blocks, d0 its first 1: the pair is (p1, d0);
    the prefill side reserves its 1 uncached block (+1, as any request) as a prefill
    share; the decode side only its decode work (+1), the prefill being remote; the
    prefix is predicted on both (neither holds all of it)."""
    tokens = list(range(4 * BS))
    core, ops = _core({"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"},
                      {"p1": tokens[:3 * BS], "d0": tokens[:BS]})
    pair = core.route_pair(tokens, None, None, yes, yes)
    assert pair.why == "disagg"
    assert pair.prefill is not None
    assert (pair.decode.engine, pair.prefill.engine) == ("d0", "p1")
    assert (pair.prefill.overlap, pair.decode.overlap) == (3.0, 1.0)
    assert core.loads.amount(pair.prefill.request_id) == 1.0 + 1.0
    assert core.loads.prefill(pair.prefill.request_id) == pair.prefill.prefill == 1.0
    assert core.loads.amount(pair.decode.request_id) == 1.0
    assert core.loads.prefill(pair.decode.request_id) == pair.decode.prefill == 0.0
    predicted = sorted(op[1] for op in ops if op[0] == "p")
    assert predicted == ["d0/dp0", "p1/dp0"]
    # released: nothing held
    core.finish(pair.prefill.request_id, None)
    core.finish(pair.decode.request_id, 5)
    assert core.loads.loads() == {} and len(core.loads) == 0


def test_route_pair_local_is_route_proxys_reservation() -> None:
    """The decode engine misses 1 block, under --disagg-min-tokens' 2 blocks: one
    reservation, on it, with the uncached block as its prefill share."""
    tokens = list(range(4 * BS))
    core, _ = _core({"p0": "prefill", "d0": "decode"}, {"d0": tokens[:3 * BS]},
                    pairs=PairConfig(min_disagg_blocks=2))
    pair = core.route_pair(tokens, None, None, yes, yes)
    assert (pair.why, pair.prefill, pair.decode.engine) == ("cached", None, "d0")
    assert core.loads.amount(pair.decode.request_id) == 1.0 + 1.0
    assert pair.decode.prefill == 1.0 and len(core.loads) == 1


def test_route_pair_never_decodes_on_a_prefill_engine_and_honours_usable() -> None:
    tokens = list(range(2 * BS))
    core, _ = _core({"p0": "prefill", "d0": "decode", "b0": "both"}, {"p0": tokens})
    for _ in range(20):
        pair = core.route_pair(tokens, None, None, yes, yes)
        assert pair.decode.engine != "p0"
        if pair.prefill is not None:
            assert pair.prefill.engine != "d0"
    # the prefill engines tried already are out: the both engine, or local
    pair = core.route_pair(tokens, None, None, yes, yes, prefill_usable=lambda e: e != "p0")
    assert pair.prefill is None or pair.prefill.engine == "b0"
    pair = core.route_pair(tokens, None, None, lambda e: e == "d0", yes,
                           prefill_usable=lambda e: False)
    assert (pair.decode.engine, pair.prefill, pair.why) == ("d0", None, "no_prefill")
    with pytest.raises(Exception, match="no engine that can decode") as e:
        core.route_pair(tokens, None, None, lambda e: e == "p0", yes)
    assert e.value.status == 503  # type: ignore[attr-defined]


def test_route_pair_counts_the_prefill_share_per_side_and_load_steers_the_prefill() -> None:
    """Two equal prefill engines: the second request's prefill goes to the one the first
    did not load (each side's load is its own)."""
    core, _ = _core({"p0": "prefill", "p1": "prefill", "d0": "decode"}, {})
    a = core.route_pair(list(range(4 * BS)), None, None, yes, yes)
    b = core.route_pair(list(range(1000, 1000 + 4 * BS)), None, None, yes, yes)
    assert a.prefill and b.prefill and {a.prefill.engine, b.prefill.engine} == {"p0", "p1"}
