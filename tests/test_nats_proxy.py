"""``kvwire serve --nats`` as the OpenAI proxy, every part a real process on loopback:
``kvwire engine``s publish their KV events, ``kvwire bridge`` writes them into a real
nats-server's JetStream, and ``kvwire serve --nats URL --nats-engine NAME,url=URL`` routes
chat requests by the cache that came through JetStream. Engines leave and join there at run
time too (``DELETE``/``POST /engines``, the ``--nats-engine`` syntax)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nats")

import httpx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bridge_helpers import BridgeProc  # noqa: E402
from test_proxy import (  # noqa: E402
    TIMEOUT,
    EngineProc,
    _chat,
    engine_procs,  # noqa: F401 (a fixture)
    serve_proc,  # noqa: F401 (a fixture)
    wait_for,
)

TOKEN = "nats-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _overlap(c: httpx.Client, engine: EngineProc, body: dict[str, Any]) -> dict[str, float]:
    """The router's overlap per engine for ``body``'s prompt, tokenized by the engine itself
    (its vLLM-shaped ``/tokenize``, the same builtin tokenizer the router uses)."""
    ids = httpx.post(engine.url + "/tokenize", json={"model": "m", "messages": body["messages"]},
                     timeout=TIMEOUT).json()["tokens"]
    r = c.post("/score", json={"token_ids": ids})
    assert r.status_code == 200, r.text
    return r.json()["overlap"]


def _usable(c: httpx.Client, name: str) -> bool:
    """``name`` passes its health probes and its breaker is closed (on a loaded box a probe
    can time out and sit an engine out for its cool-off: a request then goes elsewhere)."""
    http = c.get("/engines").json().get(name, {}).get("http", {})
    return bool(http.get("http_up") and http.get("breaker_up"))


def test_serve_nats_proxies_by_the_cache_that_came_through_jetstream(
        nats_server: Any, tmp_path: Path,
        engine_procs: Callable[..., list[EngineProc]],  # noqa: F811
        serve_proc: Callable[..., Any]) -> None:  # noqa: F811
    """Conversations keep their engine and hit its cache, with the index fed only from
    JetStream; a removed engine gets no more requests, and added again it is routed to at
    once by the blocks JetStream kept delivering; an engine given with a ZeroMQ endpoint
    is refused with the syntax that applies."""
    es = engine_procs(2)
    bridge = BridgeProc(tmp_path, nats_server.url, [f"e{i}={e.events}" for i, e in enumerate(es)])
    try:
        bridge.wait_started()
        _, url = serve_proc("--nats", nats_server.url, "--tokenizer", "builtin",
                            "--probe-interval", "0.1", "--admin-token", TOKEN,
                            *[f"--nats-engine=e{i},url={e.url}" for i, e in enumerate(es)])
        by_name = {f"e{i}": e for i, e in enumerate(es)}
        with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
            wait_for(lambda: c.get("/health").status_code == 200, "the proxy healthy")
            assert {m["id"] for m in c.get("/v1/models").json()["data"]} >= {"m"}
            homes: dict[int, str] = {}

            def conversation(k: int) -> str:
                """Two turns of conversation k; the engine both went to."""
                first = _chat(f"conversation {k}: " + "context words " * 100, "question 0")
                r = c.post("/v1/chat/completions", json=first)
                assert r.status_code == 200, r.text
                home = homes[k] = r.headers["x-kvwire-engine"]
                wait_for(lambda: _overlap(c, by_name[home], first).get(home, 0) > 0,
                         f"conversation {k}'s blocks in the index, through JetStream")
                wait_for(lambda: _usable(c, home), f"{home} usable")
                r = c.post("/v1/chat/completions", json=_chat(first["messages"][0]["content"],
                                                              "question 1"))
                assert r.status_code == 200 and r.headers["x-kvwire-engine"] == home, r.text
                u = r.json()["usage"]
                assert u["prompt_tokens_details"]["cached_tokens"] >= u["prompt_tokens"] // 2, u
                return home

            for k in range(4):
                conversation(k)
            # fresh conversations spread by the time each engine was busy: one slow answer
            # can keep them on the other engine for a while, so more are started until both
            # have some (bounded by the wait)
            more = iter(range(4, 100_000))
            wait_for(lambda: conversation(next(more)) and set(homes.values()) == {"e0", "e1"},
                     "conversations on both engines")

            # e1 leaves: everything goes to e0, its conversations included
            r = c.delete("/engines/e1", headers=AUTH)
            assert r.status_code == 200, r.text
            for k in homes:
                body = _chat(f"conversation {k}: " + "context words " * 100, "question 2")
                r = c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200 and r.headers["x-kvwire-engine"] == "e0", r.text
            # ... and joins again: its blocks are still indexed (JetStream kept them coming)
            r = c.post("/engines", headers=AUTH, json={"engine": f"e1,url={es[1].url}"})
            assert r.status_code == 201, r.text
            assert r.json()["streams"] == ["e1/dp0"]
            k1 = next(k for k, h in homes.items() if h == "e1")
            body = _chat(f"conversation {k1}: " + "context words " * 100, "question 3")
            assert _overlap(c, es[1], body).get("e1", 0) > 0
            wait_for(lambda: _usable(c, "e1"), "e1 probed up again")
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.headers["x-kvwire-engine"] == "e1", r.text

            r = c.post("/engines", headers=AUTH, json={"engine": "e2=tcp://127.0.0.1:9"})
            assert r.status_code == 400 and "NAME[:RANKS][,url=URL]" in r.text, r.text
            r = c.post("/engines", headers=AUTH, json={"engine": f"e0,url={es[0].url}"})
            assert r.status_code == 409, r.text
    finally:
        bridge.stop()
