"""RouterCore's one decision (``decide``) behind the decision API's ``route`` and the
proxy's ``route_proxy``, and the differences between the two it keeps (``proxied``): the
same prompt on the same index, each asked of a fresh core (engines never started: no
sockets; a prediction is observed as the report replicas would be sent)."""

from __future__ import annotations

from typing import Any

import pytest

from kvwire.consume.stream import Batch
from kvwire.routing.core import EngineSpec, RouteError, RouterCore
from kvwire.wire.events import BlockStored, KVEventBatch

BS = 16


def yes(_engine: str) -> bool:
    return True


def _core(tokens: list[int], block_size: int, medium: str | None) -> tuple[RouterCore, list]:
    """A one-engine core whose engine holds ``tokens`` (whole blocks of ``block_size``) in
    tier ``medium``, and the list the core's shared reports go to."""
    core = RouterCore([EngineSpec("e0", "ipc:///nonexistent/e0")], block_size=BS)
    n = len(tokens) // block_size
    if n:
        stored = BlockStored(list(range(1, n + 1)), None, tokens[:n * block_size], block_size,
                             None, medium=medium)
        core.feed._apply([Batch(core.targets[0].stream, 0, KVEventBatch(0.0, [stored], 0), 1)])
    ops: list[Any] = []
    core.share = ops.append
    return core, ops


def _predicted(ops: list[Any]) -> int:
    return sum(len(op[2]) // 8 for op in ops if op[0] == "p")


def test_a_prompt_held_only_in_a_tier_worth_no_credit_is_predicted_by_route_only() -> None:
    """The engine holds all 4 blocks, in a tier nobody configured (credit 0): the decision
    API counts only credited blocks as held, so it predicts the prefix there; the proxy
    counts matched blocks of any tier, so it does not."""
    tokens = list(range(4 * BS))
    api, api_ops = _core(tokens, BS, "TAPE")
    answer = api.route(tokens)
    assert answer["overlap"] == {"e0": 0}
    assert _predicted(api_ops) == 4
    proxy, proxy_ops = _core(tokens, BS, "TAPE")
    proxy.route_proxy(tokens, None, None, yes, yes)
    assert _predicted(proxy_ops) == 0
    # the same blocks on the GPU: held for both, predicted by neither
    for route in (lambda c: c.route(tokens), lambda c: c.route_proxy(tokens, None, None, yes,
                                                                     yes)):
        core, ops = _core(tokens, BS, None)
        route(core)
        assert _predicted(ops) == 0
    # and nothing held: predicted by both
    for route in (lambda c: c.route(tokens), lambda c: c.route_proxy(tokens, None, None, yes,
                                                                     yes)):
        core, ops = _core([], BS, None)
        core.index.prompt_keys(core.targets[0].stream, tokens, block_size=BS)  # (its size)
        route(core)
        assert _predicted(ops) == 4


def test_a_prompt_under_one_reference_block_is_matched_by_route_only() -> None:
    """10 tokens: no reference block (16), but one of the engine's own 8-token blocks. The
    decision API matches it (held there: shown, not predicted; not held: predicted); the
    proxy routes it by load alone (neither matched nor predicted)."""
    tokens = list(range(100, 110))
    for held, overlap, predicted in ((tokens[:8], 1, 0), (list(range(200, 208)), 0, 1)):
        api, api_ops = _core(held, 8, None)  # (also teaches the engine's block size, 8)
        assert api.route(tokens)["overlap"] == {"e0": overlap}
        assert _predicted(api_ops) == predicted
        proxy, proxy_ops = _core(held, 8, None)
        assert proxy.route_proxy(tokens, None, None, yes, yes).overlap == 0.0
        assert _predicted(proxy_ops) == 0


def test_ids_and_the_prefill_share_differ_the_rest_is_one_decision() -> None:
    """The proxy's ids are p0, p1, ... and its reservation holds the uncached blocks as a
    prefill share (dropped at the first token); the decision API's are uuids with none.
    Both reserve the same amount on the same engine, and both count a route."""
    tokens = list(range(4 * BS))
    api, api_ops = _core(tokens[:2 * BS], BS, None)  # 2 of the 4 blocks held
    proxy, proxy_ops = _core(tokens[:2 * BS], BS, None)
    answer = api.route(tokens)
    routed = proxy.route_proxy(tokens, None, None, yes, yes)
    assert len(answer["request_id"]) == 32 and routed.request_id.startswith("p")
    assert api.loads.prefill(answer["request_id"]) == 0.0
    assert proxy.loads.prefill(routed.request_id) == routed.prefill == 2.0
    assert (api.loads.amount(answer["request_id"]) == proxy.loads.amount(routed.request_id)
            == 2.0 + 1.0)  # uncached blocks + decode_load
    assert answer["engine"] == routed.engine == "e0" and routed.overlap == 2.0
    assert api.counts["routes"] == proxy.counts["routes"] == 1
    assert [op[0] for op in api_ops] == [op[0] for op in proxy_ops] == ["r", "p"]
    assert api.route(tokens, reserve=False)["engine"] == "e0"
    assert api.counts["scores"] == 1 and len(api.loads) == 1


def _two(held: list[int]) -> tuple[RouterCore, list]:
    """Two engines, e0 holding ``held`` (whole blocks of BS), e1 known to use BS too."""
    core = RouterCore([EngineSpec("e0", "ipc:///nonexistent/e0"),
                       EngineSpec("e1", "ipc:///nonexistent/e1")], block_size=BS)
    e0, e1 = (t.stream for t in core.targets)
    n = len(held) // BS
    other = list(range(10**6, 10**6 + BS))
    core.feed._apply([
        Batch(e0, 0, KVEventBatch(0.0, [BlockStored(list(range(1, n + 1)), None, held[:n * BS],
                                                    BS, None)], 0), 1),
        Batch(e1, 0, KVEventBatch(0.0, [BlockStored([99], None, other, BS, None)], 0), 1)])
    ops: list[Any] = []
    core.share = ops.append
    return core, ops


def test_a_long_prompt_routes_on_its_start_and_its_whole_ids_complete_the_route() -> None:
    """e0 holds 4 blocks of a 70-block prompt whose start (6 blocks) is known: the match
    ends inside the start on both engines, so the start settles it. It goes to e0, its
    credit 4 blocks (not 4 of 6 scaled up), its load reserved at the estimate (64 blocks);
    the whole ids then set the load to the true length and predict all 70 blocks; the
    first token drops the share as set, not as first reserved."""
    whole = list(range(70 * BS))
    core, ops = _two(whole[:4 * BS])
    routed = core.route_proxy(whole[:6 * BS], None, None, yes, yes, total=64 * BS)
    assert routed is not None and routed.engine == "e0"
    assert routed.overlap == 4.0 and routed.prefill == 60.0
    dl = core.decode_load  # (each request's decode share, beside its prefill)
    assert core.loads.loads() == {"e0": 60.0 + dl}
    assert _predicted(ops) == 6  # the start's blocks, until the whole is known
    assert core.complete(routed, whole, None, None)
    assert core.loads.loads() == {"e0": 66.0 + dl}
    assert _predicted(ops) == 6 + 70
    assert ["r", routed.request_id, "e0", 66.0 + dl, 66.0] in ops  # (replicas told the new size)
    core.first_token(routed.request_id, routed.prefill)
    assert core.loads.loads() == {"e0": dl}
    core.finish(routed.request_id, None)
    assert not core.complete(routed, whole, None, None)  # ended: nothing more to do
    assert _predicted(ops) == 6 + 70


def test_a_start_an_engine_holds_to_its_end_waits_for_the_whole_prompt() -> None:
    """e0 holds every full block of the start: the prompt's next blocks may be there too,
    so the start settles nothing (None, nothing reserved or predicted); nor does a start
    shorter than one block of an engine's block size."""
    whole = list(range(70 * BS))
    core, ops = _two(whole[:6 * BS])
    assert core.route_proxy(whole[:6 * BS], None, None, yes, yes, total=70 * BS) is None
    assert core.route_proxy(whole[:BS - 1], None, None, yes, yes, total=70 * BS) is None
    assert core.loads.loads() == {} and ops == []
    routed = core.route_proxy(whole, None, None, yes, yes)  # the whole: routed as ever
    assert routed.engine == "e0" and routed.overlap == 6.0


def test_an_estimate_over_the_limit_waits_for_the_whole_ids_to_say_413() -> None:
    """An estimate is no reason for a 413: a start whose estimated length is over
    ``max_tokens`` is not routed on (None); the whole ids over it are the 413."""
    core, ops = _two([])
    core.max_tokens = 1000
    assert core.route_proxy(list(range(100)), None, None, yes, yes, total=1001) is None
    assert core.loads.loads() == {} and ops == []
    with pytest.raises(RouteError) as e:
        core.route_proxy(list(range(1001)), None, None, yes, yes)
    assert e.value.status == 413
