"""Two ``kvwire epp`` pickers behind one real Envoy, sharing their load over a real
nats-server as ``kvwire serve`` replicas do: the engines' events reach both through
JetStream (``kvwire bridge``), Envoy spreads the requests' streams over both pickers, and a
request picked by one weighs on the other's view of its engine until it ends."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from envoy_helpers import Envoy, Epp, Fleet, envoy_binary, until

pytestmark = pytest.mark.timeout(300)


def _streams(p: Epp) -> float:
    return p.metric("kvwire_epp_streams_total")


def test_pickers_behind_one_envoy_share_their_load_over_nats(nats_server: Any,
                                                             tmp_path: Any) -> None:
    """A streamed answer picked by one picker: the other counts the same load on that
    engine while it runs (``kvwire_router_peer_reservations``), and both go back to 0 when
    the client leaves. Routing by the cache holds through either picker."""
    from bridge_helpers import BridgeProc

    envoy_binary()  # (skips loudly before anything starts)
    fleet = Fleet(2, "--speed", "0.5")  # (a 300-token answer: several seconds)
    started: list[Any] = [fleet]
    try:
        events = [re.sub(r",url=\S+$", "", s) for s in fleet.specs]
        bridge = BridgeProc(tmp_path, nats_server.url, events)
        try:
            bridge.wait_started()
            flags = ("--nats", nats_server.url, "--tokenizer", "builtin",
                     "--probe-interval", "0.3",
                     *[f"--nats-engine={s.split('=', 1)[0]},url={u}"
                       for s, u in zip(fleet.specs, fleet.urls)])
            a = Epp([], *flags)
            started.append(a)
            b = Epp([], *flags)
            started.append(b)
            envoy = Envoy(a, tmp_path, "--request-body-mode", "BUFFERED",
                          "--response-body-mode", "NONE",
                          "--more-pickers", f"127.0.0.1:{b.grpc_port}")
            started.append(envoy)
            with httpx.Client(base_url=envoy.url, timeout=60) as c:
                # warm-ups spread over both pickers: each stream is one pick by one of them
                for i in range(6):
                    r = c.post("/v1/completions", json={"model": "kvwire-engine",
                                                        "prompt": f"warm {i} " * 40,
                                                        "max_tokens": 4})
                    assert r.status_code == 200, r.text
                before = {id(p): _streams(p) for p in (a, b)}
                body = {"model": "kvwire-engine", "prompt": "a long story " * 200,
                        "max_tokens": 300, "ignore_eos": True, "stream": True}
                with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    engine = r.headers["x-kvwire-engine"]
                    chunks = r.iter_raw()  # (kept: a dropped iterator closes the response)
                    next(chunks)  # running: its prefill done
                    picked, other = (a, b) if _streams(a) > before[id(a)] else (b, a)
                    assert _streams(picked) == before[id(picked)] + 1
                    assert _streams(other) == before[id(other)]
                    until(lambda: 0 < other.loads()[engine][1] == picked.loads()[engine][1],
                          "the running answer's load the same at the other picker", 30)
                    assert other.metric("kvwire_router_peer_reservations") == 1
                    assert other.loads()[engine][0] == 0  # (not in flight there)
                until(lambda: picked.loads()[engine][1] == 0, "the client gone: released", 30)
                until(lambda: other.loads()[engine][1] == 0, "... at the other picker too", 30)
                assert other.metric("kvwire_router_peer_reservations") == 0
                # the cache, through whichever picker Envoy chooses
                for i in range(4):
                    prompt = f"document {i}: " + " ".join(f"w{i}x{j}" for j in range(300))
                    first = c.post("/v1/completions", json={"model": "kvwire-engine",
                                                            "prompt": prompt, "max_tokens": 1})
                    again = c.post("/v1/completions", json={"model": "kvwire-engine",
                                                            "prompt": prompt, "max_tokens": 1})
                    assert first.status_code == again.status_code == 200
                    u = again.json()["usage"]
                    assert u["prompt_tokens_details"]["cached_tokens"] >= u["prompt_tokens"] // 2, (
                        i, u, first.headers["x-kvwire-engine"], again.headers["x-kvwire-engine"])
        finally:
            bridge.stop()
    finally:
        for p in reversed(started):
            p.stop()
