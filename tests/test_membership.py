"""Engines added and removed while the router runs (``POST /engines``,
``DELETE /engines/{name}``, serve/admin.py), over real HTTP and ZeroMQ on loopback:
in-thread ``kvwire engine``s behind a RouterCore + Proxy (test_proxy's Stack), a bare
RouterCore fed by real publishers, and at the end a real ``kvwire serve`` process."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvwire.consume.engine_spec import EngineSpec
from kvwire.consume.stream import StreamConfig
from kvwire.consume.subscriber import StreamSpec
from kvwire.routing.core import EngineConflict, RouterCore
from kvwire.serve.app import serve_in_thread
from kvwire.wire.events import BlockStored, KVEventBatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_proxy import (  # noqa: E402
    TIMEOUT,
    EngineProc,
    Stack,
    _chat,
    _engine,
    _scrape,
    engine_procs,  # noqa: F401 (a fixture)
    make_stack,  # noqa: F401 (a fixture)
    serve_proc,  # noqa: F401 (a fixture)
)
from waiting import wait_for as _wait_for  # noqa: E402

wait_for = functools.partial(_wait_for, timeout=TIMEOUT, interval=0.01)
TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


# ---------------------------------------------------------------------------- the core


class _Publisher:
    """A real kvwire publisher that stored one prompt (4 blocks of 16 tokens)."""

    def __init__(self, where: Path, first: int) -> None:
        from test_serve import publisher

        self.pub = publisher(where, str(first))
        self.tokens = list(range(first, first + 64))
        self.pub.publish(KVEventBatch(ts=0.0, events=[BlockStored(
            block_hashes=[first + i for i in range(4)], parent_block_hash=None,
            token_ids=self.tokens, block_size=16, lora_id=None)]))

    def spec(self, name: str) -> EngineSpec:
        return EngineSpec(name, self.pub.endpoint, replay=self.pub.replay_endpoint)

    def close(self) -> None:
        self.pub.shutdown()


@pytest.fixture
def publishers(tmp_path: Path) -> Iterator[Callable[[int], _Publisher]]:
    made: list[_Publisher] = []

    def make(first: int) -> _Publisher:
        made.append(_Publisher(tmp_path, first))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_core_follows_engines_added_and_removed(
        publishers: Callable[[int], _Publisher]) -> None:
    """An engine added to a running core is indexed and routed to; removed, no decision
    names it and its blocks leave the index; added again under the same name, it is
    followed anew. Names in use are refused, before and after start."""
    a, b = publishers(1000), publishers(5000)
    core = RouterCore([a.spec("a")], stream_config=StreamConfig(info_interval=0.2))
    core.add_engine(b.spec("early"))  # before start: it starts with the rest
    core.start()
    try:
        def overlap(tokens: list[int]) -> dict[str, int]:
            return core.route(tokens, reserve=False)["overlap"]

        wait_for(lambda: overlap(b.tokens).get("early") == 4, "the early engine indexed")
        assert core.remove_engine("early") and not core.remove_engine("early")
        core.add_engine(b.spec("b"))
        wait_for(lambda: overlap(b.tokens).get("b") == 4, "the added engine indexed")
        assert core.route(b.tokens, reserve=False)["engine"] == "b"
        assert set(overlap(a.tokens)) == {"a", "b"}
        with pytest.raises(EngineConflict, match="already routed"):
            core.add_engine(a.spec("a"))
        core.add_stream(StreamSpec("c/dp0", a.pub.endpoint))  # an indexer API registration
        with pytest.raises(EngineConflict, match="c/dp0"):
            core.add_engine(a.spec("c"))
        assert core.remove_engine("b")
        wait_for(lambda: "b/dp0" not in core.index.streams(), "b's blocks dropped")
        assert set(overlap(b.tokens)) == {"a"} and core.route(b.tokens)["engine"] == "a"
        assert "b" not in core.engines_status() and "b/dp0" not in core.alive
        core.add_engine(b.spec("b"))  # the same name again: a fresh stream, indexed anew
        wait_for(lambda: overlap(b.tokens).get("b") == 4, "b indexed again")
    finally:
        core.close()


def test_core_under_nats_adds_and_removes_named_engines() -> None:
    """With --nats the streams come from JetStream: an engine is added by name (and ranks),
    never with a ZeroMQ endpoint; removed, its blocks stay indexed (JetStream keeps
    delivering them) and what JetStream said of its liveness is kept for a re-add."""
    core = RouterCore([EngineSpec.parse_named("a")], nats=object())
    with pytest.raises(ValueError, match="JetStream"):
        core.add_engine(EngineSpec.parse("b=tcp://127.0.0.1:5557"))
    assert [e.name for e in core.engines] == ["a"]
    core.alive["b/dp0"] = True  # JetStream already delivered b's stream, not routed to
    core.add_engine(EngineSpec.parse_named("b:2"))
    assert [t.stream for t in core.targets] == ["a/dp0", "b/dp0", "b/dp1"]
    assert core.alive["b/dp0"] is True and core.alive["b/dp1"] is False
    with pytest.raises(EngineConflict, match="already routed"):
        core.add_engine(EngineSpec.parse_named("b"))
    assert core.remove_engine("b") and not core.remove_engine("b")
    assert [t.stream for t in core.targets] == ["a/dp0"] and core.alive["b/dp0"] is True
    assert core.specs == []  # no ZeroMQ stream was ever asked for


def test_core_finds_engines_on_the_stream_only_when_told_to() -> None:
    """``discover`` (``serve --nats`` without ``--nats-engine``): a stream NAME/dpR that is
    no target makes NAME one, widened by a higher rank; without it (engines named on the
    command line) a stranger's items are indexed and never routed to."""
    from kvwire.consume.stream import Batch

    def item(stream: str) -> Batch:
        return Batch(stream, 1, KVEventBatch(0.0, [BlockStored([7], None, list(range(16)),
                                                               16, None)], 0), 1)

    for discover, want in ((False, ["a/dp0"]), (True, ["a/dp0", "z/dp0", "z/dp1", "z/dp2"])):
        core = RouterCore([EngineSpec.parse_named("a")], nats=object(), discover=discover)
        core.feed._apply([item("z/dp0"), item("not-a-rank-stream")])
        core.feed._apply([item("z/dp2"), item("z/dp1")])
        assert [t.stream for t in core.targets] == want
        assert "z/dp0" in core.index.streams()  # indexed either way
    assert core.discovered == 2 and [e.ranks for e in core.engines] == [1, 3]
    assert RouterCore([], discover=True).discover is False  # (ZeroMQ: engines are named)


# ---------------------------------------------------------------------------- the proxy


def _home(c: httpx.Client, body: dict[str, Any]) -> str:
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.headers["x-kvwire-engine"]


def test_an_added_engine_takes_requests_and_keeps_its_cache(
        make_stack: Callable[..., Stack]) -> None:  # noqa: F811
    """POST /engines: the new engine is probed, followed and routed to; a conversation that
    went there comes back to it; /v1/models, /engines, /metrics and /status.json show it."""
    s = make_stack(1, admin_token=TOKEN)
    new = _engine(loras=["ad3"])  # model m as e0, and an adapter e0 does not have
    try:
        with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
            r = c.post("/engines", headers=AUTH, json={
                "engine": f"e1={new.events[0]},url={new.url}"})
            assert r.status_code == 201, r.text
            assert r.json() == {"added": "e1", "streams": ["e1/dp0"], "url": new.url}
            wait_for(lambda: s.core.alive.get("e1/dp0") and s.proxy.links["e1"].http_up,
                     "the added engine live on both")
            models = {m["id"] for m in c.get("/v1/models").json()["data"]}
            assert "ad3" in models  # its models joined the union
            assert _home(c, {"model": "ad3", "max_tokens": 2, "messages": [
                {"role": "user", "content": "hi"}]}) == "e1"  # only e1 serves it
            # Fresh conversations alternate over the engines (by the time each was busy);
            # on a loaded box a health probe can time out and sit an engine out for its
            # cool-off, so the next fresh conversation is tried until the condition holds.
            fresh = iter(range(100_000))
            homes: set[str] = set()

            def spread() -> bool:
                homes.add(_home(c, _chat(f"conversation {next(fresh)} " * 40, "q")))
                return homes == {"e0", "e1"}

            wait_for(spread, "fresh conversations on both engines")  # the load spreads

            def to_e1() -> int | None:  # (k + 1: 0 is a conversation too)
                k = next(fresh)
                return k + 1 if _home(c, _chat(f"follow {k} " * 60, "first")) == "e1" else None

            k = wait_for(to_e1, "a fresh conversation routed to the added engine") - 1
            # ... comes back to it with its second turn (its prefix is cached there)
            link = s.proxy.links["e1"]
            wait_for(lambda: link.http_up and link.breaker.up, "e1 usable")
            r = c.post("/v1/chat/completions", json=_chat(f"follow {k} " * 60, "second"))
            assert r.status_code == 200 and r.headers["x-kvwire-engine"] == "e1", r.headers
            u = r.json()["usage"]
            assert u["prompt_tokens_details"]["cached_tokens"] >= u["prompt_tokens"] // 2, u
            eng = c.get("/engines").json()
            assert eng["e1"]["http"]["url"] == new.url and eng["e1"]["ranks"][0]["alive"]
            m = _scrape(s.url)
            assert m["kvwire_router_engine_changes_total", frozenset({("op", "add")})] == 1
            assert m["kvwire_proxy_in_flight", frozenset({("engine", "e1")})] == 0
            wait_for(lambda: "e1" in c.get("/status.json").json()["engines"],
                     "the added engine on the status page")
        wait_for(lambda: s.loads() == {}, "every reservation released")
    finally:
        s.close()
        new.close()


def test_a_removed_engine_drains_and_gets_no_more_requests(
        make_stack: Callable[..., Stack]) -> None:  # noqa: F811
    """DELETE /engines/NAME: a stream already under way there runs to its end; every later
    request goes elsewhere; its load and in-flight count come back to 0, its kept-alive
    connections close, and its charts leave the status page."""
    s = make_stack(2, engine_kw={"speed": 1.0}, admin_token=TOKEN)
    long = {"model": "m", "prompt": "drain me " * 30, "max_tokens": 300, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        wait_for(lambda: set(c.get("/status.json").json()["engines"]) == {"e0", "e1"},
                 "both engines charted")
        with c.stream("POST", "/v1/completions", json=long) as r:
            chunks = r.iter_raw()
            assert next(chunks).startswith(b"data: {")
            victim = r.headers["x-kvwire-engine"]
            other = "e1" if victim == "e0" else "e0"
            link = s.proxy.links[victim]
            gone = c.delete(f"/engines/{victim}", headers=AUTH)
            assert gone.status_code == 200, gone.text
            assert gone.json() == {"removed": victim, "in_flight": 1}
            for k in range(6):  # while the stream runs on: new requests go to the other
                assert _home(c, _chat(f"after {k} " * 30, "q")) == other
            rest = b"".join(chunks)
        assert rest.endswith(b"data: [DONE]\n\n") and b'"error"' not in rest, rest[-300:]
        wait_for(lambda: s.loads() == {}, "every reservation released")
        assert s.proxy.in_flight[victim] == 0
        assert victim not in s.proxy.links and victim not in c.get("/engines").json()
        assert link.pool is not None and not link.pool._idle  # its connection closed
        assert c.get("/health").status_code == 200  # the other one is live
        wait_for(lambda: set(c.get("/status.json").json()["engines"]) == {other},
                 "the removed engine's charts gone")
        assert c.delete(f"/engines/{other}", headers=AUTH).status_code == 200
        assert c.delete(f"/engines/{other}", headers=AUTH).status_code == 404  # not counted
        m = _scrape(s.url)
        assert m["kvwire_router_engine_changes_total", frozenset({("op", "remove")})] == 2
        r = c.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailable"
        assert c.get("/health").status_code == 503


def test_removed_engines_connections_close(make_stack: Callable[..., Stack]) -> None:  # noqa: F811
    """A removed engine's kept-alive connections are closed: the idle ones at once, the
    busy ones as their requests end (no connection to an engine that left stays open)."""
    s = make_stack(1, engine_kw={"speed": 1.0}, admin_token=TOKEN)
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        assert _home(c, _chat("warm " * 20, "q")) == "e0"
        link = s.proxy.links["e0"]
        assert link.pool is not None and len(link.pool._idle) == 1
        assert c.delete("/engines/e0", headers=AUTH).status_code == 200
        assert link.pool.closed and len(link.pool._idle) == 0


def test_admin_endpoints_refuse_clearly(make_stack: Callable[..., Stack]) -> None:  # noqa: F811
    """Off without a token (403), the token checked (401), bad bodies and specs named
    (400), a name in use 409, an unknown name 404; each counted; nothing changed."""
    off = make_stack(1)
    r = httpx.post(off.url + "/engines", json={"engine": "x=tcp://127.0.0.1:1"})
    assert r.status_code == 403 and "--admin-token" in r.json()["error"]
    assert httpx.delete(off.url + "/engines/e0").status_code == 403
    s = make_stack(1, admin_token=TOKEN)
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        cases = [
            ({}, {"engine": "x=tcp://127.0.0.1:1"}, 401, "admin token"),
            ({"authorization": "Bearer nope"}, {"engine": "x=tcp://127.0.0.1:1"}, 401, ""),
            ({"authorization": TOKEN}, {"engine": "x=tcp://127.0.0.1:1"}, 401, "Bearer"),
            (AUTH, {"engines": "x"}, 400, 'expected {"engine": "NAME=ENDPOINT['),
            (AUTH, {"engine": 7}, 400, "Expected `str`"),
            (AUTH, {"engine": "no-equals-sign"}, 400, "expected NAME=ENDPOINT"),
            (AUTH, {"engine": "x=udp://127.0.0.1:1"}, 400, "x endpoint"),
            (AUTH, {"engine": "x=tcp://127.0.0.1:1,ranks=zero"}, 400, "ranks"),
            (AUTH, {"engine": "e0=tcp://127.0.0.1:1,url=http://127.0.0.1:1"}, 409, "e0"),
        ]
        for headers, body, status, says in cases:
            r = c.post("/engines", headers=headers, json=body)
            assert r.status_code == status, (body, r.text)
            assert says in r.json()["error"], (body, r.text)
        r = c.post("/engines", headers=AUTH, content=b"{not json")
        assert r.status_code == 400 and "invalid body" in r.json()["error"]
        r = c.delete("/engines/nobody", headers=AUTH)
        assert r.status_code == 404 and "nobody" in r.json()["error"]
        assert [e.name for e in s.core.engines] == ["e0"] and list(s.proxy.links) == ["e0"]
        m = _scrape(s.url)
        assert m["kvwire_router_bad_requests_total", frozenset({("reason", "admin_token")})] == 3
        assert m["kvwire_router_bad_requests_total", frozenset({("reason", "bad_engine")})] == 6
        assert m["kvwire_router_bad_requests_total",
                 frozenset({("reason", "engine_exists")})] == 1
        assert _home(c, _chat("still serving " * 10, "q")) == "e0"


def test_decision_api_only_router_adds_engines_without_url(
        publishers: Callable[[int], _Publisher]) -> None:
    """A kvwire serve that does not proxy (no url=) adds engines for /route; url= is
    refused there with the reason."""
    a, b = publishers(1000), publishers(5000)
    core = RouterCore([a.spec("a")], stream_config=StreamConfig())
    core.start()
    server, thread, port = serve_in_thread(core, admin_token=TOKEN)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as c:
            spec = f"b={b.pub.endpoint},replay={b.pub.replay_endpoint}"
            r = c.post("/engines", headers=AUTH, json={"engine": spec + ",url=http://x:1"})
            assert r.status_code == 400 and "does not proxy" in r.json()["error"]
            assert c.post("/engines", headers=AUTH, json={"engine": spec}).status_code == 201
            wait_for(lambda: c.post("/score", json={"token_ids": b.tokens}).json()["engine"]
                     == "b", "/route sends b's prompt to b")
            r = c.delete("/engines/b", headers=AUTH)
            assert r.json() == {"removed": "b", "in_flight": 0}
            assert c.post("/score", json={"token_ids": b.tokens}).json()["engine"] == "a"
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        core.close()


# ---------------------------------------------------------------------------- the CLI


def test_serve_process_takes_the_token_from_its_environment(
        engine_procs: Callable[..., list[EngineProc]],  # noqa: F811
        serve_proc: Callable[..., tuple[subprocess.Popen, str]]) -> None:  # noqa: F811
    """Real processes: `kvwire serve` with KVWIRE_ADMIN_TOKEN (no flag) in front of one
    `kvwire engine`; a second engine process added over HTTP answers proxied requests."""
    first, second = engine_procs(2)
    _, url = serve_proc("--engine", f"e0={first.events},url={first.url}",
                        "--tokenizer", "builtin", "--probe-interval", "0.1",
                        env={"KVWIRE_ADMIN_TOKEN": TOKEN})
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        wait_for(lambda: c.get("/health").status_code == 200, "router healthy")
        r = c.post("/engines", headers=AUTH,
                   json={"engine": f"e1={second.events},url={second.url}"})
        assert r.status_code == 201, r.text


        def e1_live() -> bool:
            e1 = c.get("/engines").json().get("e1")
            return bool(e1 and e1["ranks"][0]["alive"] and e1["http"]["http_up"])
        wait_for(e1_live, "e1 live on its events and its /health")
        homes = {_home(c, _chat(f"spread {k} " * 30, "q")) for k in range(8)}
        assert homes == {"e0", "e1"}  # new prompts, equal costs: both engines take some


def test_status_feed_follows_the_engines() -> None:
    """The status page's tally counts an added engine's decisions from its first one (no
    sample needed before), and a removed engine leaves its readings."""
    from kvwire.serve.status.feed import StatusFeed

    core = RouterCore([EngineSpec.parse("a=ipc:///tmp/kvwire-no-such-a")])
    feed = StatusFeed(core)  # (not started: sampled by hand)
    core.add_engine(EngineSpec.parse("b=ipc:///tmp/kvwire-no-such-b,ranks=2"))
    feed.on_route("b/dp1", 3.0, 4.0)
    got = feed.read()
    assert set(got) == {"a", "b"}
    assert (got["b"].routed, got["b"].hit_credit, got["b"].hit_blocks) == (1, 3.0, 4.0)
    feed.sample(1.0)
    feed.sample(2.0)
    assert set(feed.window(5.0)["engines"]) == {"a", "b"}
    core.remove_engine("b")
    assert set(feed.read()) == {"a"} and set(feed.window(5.0)["engines"]) == {"a"}


def test_admin_token_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--admin-token`` first, then KVWIRE_ADMIN_TOKEN; empty is unset (off)."""
    import argparse

    from kvwire.cli.serve import _admin_token, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    monkeypatch.delenv("KVWIRE_ADMIN_TOKEN", raising=False)
    assert _admin_token(p.parse_args([])) is None
    monkeypatch.setenv("KVWIRE_ADMIN_TOKEN", "")
    assert _admin_token(p.parse_args([])) is None
    monkeypatch.setenv("KVWIRE_ADMIN_TOKEN", "from-env")
    assert _admin_token(p.parse_args([])) == "from-env"
    assert _admin_token(p.parse_args(["--admin-token", "flag"])) == "flag"


def test_readded_engine_does_not_inherit_the_old_streams_liveness(
        publishers: Callable[[int], _Publisher], tmp_path: Path) -> None:
    """An engine removed and added again under its name, with items of the old stream taken
    but not yet applied: once the old stream is let go, the new one is not live until it
    says so itself (here it never does: nothing publishes at its endpoint). The ingest is
    driven by hand (``pump``) so the order is fixed, not raced."""
    a = publishers(1000)
    core = RouterCore([a.spec("x")], stream_config=StreamConfig(info_interval=0.2))
    core.start(thread=False)
    try:
        wait_for(lambda: core.pump(100) or core.alive["x/dp0"], "x live")

        def taken_not_applied() -> bool:  # a take of more than one piece: some left over
            for i in range(100):
                a.pub.publish(KVEventBatch(ts=0.0, events=[BlockStored(
                    block_hashes=[10**6 + i], parent_block_hash=None,
                    token_ids=list(range(16)), block_size=16, lora_id=None)]))
            core.pump(10_000)
            return bool(core.ingest.backlog)

        wait_for(taken_not_applied, "a take left partly unapplied")
        assert core.remove_engine("x")
        core.add_engine(EngineSpec("x", f"ipc://{tmp_path}/nobody.live"))
        wait_for(lambda: (core.pump(10_000), "x/dp0" not in core.index.streams())[1],
                 "the old stream let go")
        assert core.alive["x/dp0"] is False
        assert core.resets["x/dp0"] == 0
        assert core.route(a.tokens, reserve=False)["overlap"] == {"x": 0}
    finally:
        core.close()
