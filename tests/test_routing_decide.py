"""RouterCore's one decision (``decide``) behind the decision API's ``route`` and the
proxy's ``route_proxy``, and the differences between the two it keeps (``proxied``): the
same prompt on the same index, each asked of a fresh core (engines never started: no
sockets; a prediction is observed as the report replicas would be sent)."""

from __future__ import annotations

from typing import Any

from kvwire.consume.stream import Batch
from kvwire.routing.core import EngineSpec, RouterCore
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
