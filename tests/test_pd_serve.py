"""``kvwire serve`` routing prefill/decode pairs end to end: real ``kvwire engine --role``
processes (KV events, KV side channel, SGLang bootstrap servers) behind a real ``kvwire
serve`` process, all on loopback, in both protocols. Checked: the ``openai`` client,
unchanged, gets every answer (streamed and not) and the decode engine really pulled the
prompt's KV; the prefill engine's load ends with its answer while the decode stream goes on;
SGLang's list of prompts is one room per prompt; a prefix goes to the prefill engine whose
events say it holds it; a prefill engine SIGKILLed is retried on the next, then falls back
to a local prefill; one SIGKILLed before the KV left it reruns the pair; a decode engine
SIGKILLed mid-stream gives the client an SSE error; a client leaving during the prefill
leaves nothing held; 2,000 mixed requests with faults end with every load at 0 and no
engine holding a leased block."""

from __future__ import annotations

import asyncio
import random
import re
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from pd_helpers import MODEL, TIMEOUT, Fleet, fleets, metric, total_metric, until, words_prompt

_prompt, _metric = words_prompt, total_metric


@pytest.fixture
def fleet() -> Iterator[Callable[..., Fleet]]:
    yield from fleets()


PAIRED = re.compile(r"prefill=(prefill\d),decode=(decode\d)")


# ------------------------------------------------------------------------------ the protocols


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_both_protocols_through_kvwire_serve(fleet: Callable[..., Fleet],
                                             protocol: str) -> None:
    """Completions and chat, streamed and not, with the openai client unchanged: every
    answer is whole, each names its pair, the decode engine pulled the KV (its transfer
    count), and at the end nothing is held anywhere."""
    f = fleet({"prefill0": "prefill", "prefill1": "prefill", "decode0": "decode"}, protocol)
    client = f.client()
    prompt = _prompt(1)
    r = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=6)
    assert PAIRED.fullmatch(r.headers["x-kvwire-engine"]), r.headers["x-kvwire-engine"]
    c = r.parse()
    assert c.choices[0].text and c.usage.completion_tokens == 6
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt=_prompt(2), max_tokens=5, stream=True) if ch.choices)
    assert text
    r = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": _prompt(3)}], max_tokens=4)
    assert PAIRED.fullmatch(r.headers["x-kvwire-engine"])
    assert r.parse().choices[0].message.content
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": _prompt(4)}], max_tokens=4,
        stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    d = f.engines["decode0"]
    assert d.metric("kvwire_engine_kv_transfers_total", result="ok") == 4
    assert d.metric("kvwire_engine_kv_transfers_total", result="failed") == 0
    m = f.metrics()
    assert _metric(m, "kvwire_proxy_pd_decisions_total", why="disagg") == 4
    assert _metric(m, "kvwire_proxy_pd_requests_total", role="decode") == 4
    assert _metric(m, "kvwire_proxy_pd_requests_total", role="prefill") == 4
    until(f.all_idle, "every load 0 and no engine holding or running anything")


def _loads(f: Fleet) -> dict[str, float]:
    """Each engine's reserved load at the router (/engines, summed over its ranks)."""
    st = f.status()
    return {n: sum(r["load"] for r in v["ranks"]) for n, v in st.items()}


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_the_prefill_load_ends_with_the_prefill_answer(fleet: Callable[..., Fleet],
                                                       protocol: str) -> None:
    """A long stream from a slow decode engine: once its first chunk is in and while it
    still runs, the router holds no load on the prefill engine (its reservation ended with
    the prefill answer) and some on the decode engine; after the stream, none anywhere."""
    f = fleet({"prefill0": "prefill", "decode0": "decode"}, protocol,
              engine_flags={"decode0": ("--speed", "0.5")})
    with httpx.stream("POST", f.url + "/v1/completions", timeout=TIMEOUT, json={
            "model": MODEL, "prompt": _prompt(13), "max_tokens": 400, "ignore_eos": True,
            "stream": True}) as r:
        assert r.status_code == 200
        lines = (x for x in r.iter_lines() if x.startswith("data: "))
        assert '"text"' in next(lines)

        def split() -> dict[str, float] | None:
            now = _loads(f)
            return now if now["prefill0"] == 0 and now["decode0"] > 0 else None

        # (SGLang's prefill answer is drained beside the decode stream: it may end just
        # after the first chunk, so wait for it; the decode load > 0 in the same reading
        # says the stream was still running)
        seen = until(split, "the prefill engine's load at 0 while the decode side streams")
        m = f.metrics()
        assert metric(m, "kvwire_router_load_blocks", stream="prefill0/dp0") == 0, seen
        assert metric(m, "kvwire_router_load_blocks", stream="decode0/dp0") > 0, seen
        after = [x for x in lines if '"text"' in x]
    assert len(after) > 10  # (the stream was far from its end when the loads were read)
    until(f.settled, "every load 0 at the router")
    assert _loads(f) == {"prefill0": 0, "decode0": 0}
    assert metric(f.metrics(), "kvwire_router_load_blocks") == 0


def test_sglang_a_list_of_prompts_is_one_room_per_prompt(fleet: Callable[..., Fleet]) -> None:
    """SGLang's protocol, a completion whose prompt is a list of three strings: the router
    gives each prompt its own bootstrap room, so the decode engine takes three prompts' KV
    from the prefill engine (three transfers, three leases released there); every prompt is
    answered at its index, as the decode engine answers that prompt alone; nothing is held
    after."""
    f = fleet({"prefill0": "prefill", "decode0": "decode"}, "sglang")
    p, d = f.engines["prefill0"], f.engines["decode0"]
    prompts = [_prompt(40 + i) for i in range(3)]
    r = f.http.post("/v1/completions", json={"model": MODEL, "prompt": prompts,
                                             "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvwire-engine"] == "prefill=prefill0,decode=decode0"
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert d.metric("kvwire_engine_kv_transfers_total", result="ok") == 3
    assert d.metric("kvwire_engine_kv_transfers_total", result="failed") == 0
    until(lambda: p.metric("kvwire_engine_kv_leases_released_total") == 3,
          "the prefill engine's three rooms pushed and released")
    for c, text in zip(choices, prompts):
        alone = d.http.post("/v1/completions", json={"model": MODEL, "prompt": text,
                                                     "max_tokens": 5}).json()
        assert c["text"] and c["text"] == alone["choices"][0]["text"]
    m = f.metrics()
    assert _metric(m, "kvwire_proxy_pd_requests_total", role="prefill") == 1
    assert _metric(m, "kvwire_proxy_pd_requests_total", role="decode") == 1
    until(f.all_idle, "every load 0 and no engine holding or running anything")
    assert p.metric("kvwire_engine_kv_rooms") == 0
    assert p.metric("kvwire_engine_kv_leases_expired_total") == 0


def test_a_prefix_goes_to_the_prefill_engine_whose_events_hold_it(
        fleet: Callable[..., Fleet]) -> None:
    """Predictions off (--predict-ttl 0): only the events say where a prefix is. For each
    of four prefixes, the second request waits until the first one's prefill engine has
    published the blocks, and then goes there."""
    f = fleet({"prefill0": "prefill", "prefill1": "prefill", "decode0": "decode"}, "vllm",
              "--predict-ttl", "0")
    for k in range(4):
        prefix = _prompt(100 + k, 200)  # (~650 tokens: 40 blocks)
        before = {n: f.blocks(n) for n in ("prefill0", "prefill1")}
        first = f.http.post("/v1/completions", json={"model": MODEL, "prompt": prefix + " one",
                                                     "max_tokens": 2})
        assert first.status_code == 200
        holder = PAIRED.fullmatch(first.headers["x-kvwire-engine"]).group(1)
        until(lambda h=holder, n=before[holder] + 38: f.blocks(h) >= n,
              f"{holder}'s events indexed")
        again = f.http.post("/v1/completions", json={"model": MODEL, "prompt": prefix + " two",
                                                     "max_tokens": 2})
        assert PAIRED.fullmatch(again.headers["x-kvwire-engine"]).group(1) == holder
    until(f.all_idle, "nothing held")


# ------------------------------------------------------------------------------ faults


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_prefill_engine_killed_is_retried_then_falls_back(fleet: Callable[..., Fleet],
                                                            protocol: str) -> None:
    """The router still sees both prefill engines up (probes 30 s apart): the one holding
    the prefix is SIGKILLed, the request goes there, is refused and is retried on the
    other; that one killed too, the prefill falls back to the decode engine."""
    f = fleet({"prefill0": "prefill", "prefill1": "prefill", "decode0": "decode"}, protocol,
              "--probe-interval", "30", "--cooloff", "60", "--predict-ttl", "600")
    prefix = _prompt(7, 200)
    r = f.http.post("/v1/completions", json={"model": MODEL, "prompt": prefix + " a",
                                             "max_tokens": 2})
    holder = PAIRED.fullmatch(r.headers["x-kvwire-engine"]).group(1)
    other = "prefill1" if holder == "prefill0" else "prefill0"
    f.engines[holder].kill()
    r = f.http.post("/v1/completions", json={"model": MODEL, "prompt": prefix + " b",
                                             "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvwire-engine"] == f"prefill={other},decode=decode0"
    assert r.json()["usage"]["completion_tokens"] == 3
    f.engines[other].kill()
    with f.client().completions.create(model=MODEL, prompt=prefix + " c", max_tokens=3,
                                       stream=True) as s:
        assert "".join(ch.choices[0].text for ch in s if ch.choices)
    m = f.metrics()
    assert _metric(m, "kvwire_proxy_pd_prefill_failures_total") == 2
    assert _metric(m, "kvwire_proxy_pd_decisions_total", why="fallback") == 1
    assert _metric(m, "kvwire_proxy_pd_requests_total", role="both", engine="decode0") == 1
    until(f.all_idle, "every load 0, the decode engine idle")


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_prefill_engine_killed_before_the_pull_reruns_the_pair(
        fleet: Callable[..., Fleet], protocol: str) -> None:
    """The prefill done (its blocks held), the decode engine has the request queued (one
    sequence at a time, busy with another); the prefill engine is SIGKILLed before its KV
    left (vLLM: before the decode engine's pull; SGLang: before the decode engine told it
    where to push the room). The transfer fails (--kv-load-failure fail: the decode engine
    answers 500 and frees what it allocated); the router takes that for a failed transfer
    and runs the pair again on the other prefill engine: the client gets its answer."""
    f = fleet({"prefill0": "prefill", "prefill1": "prefill", "decode0": "decode"}, protocol,
              "--predict-ttl", "600",
              engine_flags={"decode0": ("--max-num-seqs", "1", "--speed", "1")})
    d = f.engines["decode0"]
    prefix = _prompt(21, 200)
    r = f.http.post("/v1/completions", json={"model": MODEL, "prompt": prefix + " a",
                                             "max_tokens": 2})
    holder = PAIRED.fullmatch(r.headers["x-kvwire-engine"]).group(1)
    other = "prefill1" if holder == "prefill0" else "prefill0"
    h = f.engines[holder]
    until(h.idle, f"{holder} holding nothing after the first request")
    # the decode engine busy with a long answer of its own (sent to it directly)
    blocker = httpx.Client(timeout=TIMEOUT)
    busy = blocker.send(blocker.build_request("POST", d.url + "/v1/completions", json={
        "model": MODEL, "prompt": "hold the engine", "max_tokens": 3000, "stream": True}),
        stream=True)
    try:
        until(lambda: d.metric("vllm:num_requests_running") == 1, "the decode engine busy")
        answer: dict[str, Any] = {}

        def client() -> None:
            answer["r"] = httpx.post(f.url + "/v1/completions", timeout=TIMEOUT, json={
                "model": MODEL, "prompt": prefix + " b", "max_tokens": 3})

        t = threading.Thread(target=client, daemon=True)
        t.start()
        until(lambda: d.metric("vllm:num_requests_waiting") == 1, "the pair's decode queued")
        until(lambda: h.metric("kvwire_engine_kv_held_blocks") > 0,
              f"{holder} holding the prompt's blocks for the decode engine")
        # (SGLang: its prefill answer, drained beside the decode request, in: the kill
        # then fails the transfer, not the prefill)
        until(lambda: _metric(f.metrics(), "kvwire_proxy_pd_prefill_seconds_count",
                              engine=holder) == 2, f"{holder}'s prefill answer at the router")
        h.kill()
    finally:
        busy.close()  # the decode engine aborts it and admits the queued one
        blocker.close()
    t.join(TIMEOUT)
    r = answer["r"]
    assert r.status_code == 200, r.text
    assert r.headers["x-kvwire-engine"] == f"prefill={other},decode=decode0"
    assert r.json()["usage"]["completion_tokens"] == 3
    assert d.metric("kvwire_engine_kv_transfers_total", result="failed") == 1
    assert _metric(f.metrics(), "kvwire_proxy_pd_prefill_failures_total") == 1
    until(f.all_idle, "every load 0, nothing held")


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_decode_engine_killed_mid_stream_ends_with_an_sse_error(
        fleet: Callable[..., Fleet], protocol: str) -> None:
    f = fleet({"prefill0": "prefill", "decode0": "decode"}, protocol,
              engine_flags={"decode0": ("--speed", "0.5")})
    events: list[str] = []
    with httpx.stream("POST", f.url + "/v1/completions", timeout=TIMEOUT, json={
            "model": MODEL, "prompt": _prompt(9), "max_tokens": 400, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 2:
                    f.engines["decode0"].kill()
    assert '"error"' in events[-2] and "failed mid-stream" in events[-2], events[-3:]
    assert events[-1] == "data: [DONE]"
    until(f.settled, "every load 0 at the router")
    until(f.engines["prefill0"].idle, "the prefill engine holding nothing")


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_client_leaving_during_the_prefill_leaves_nothing_held(
        fleet: Callable[..., Fleet], protocol: str) -> None:
    """A slow prefill engine; the client (a raw socket) closes its connection while the
    prompt is being computed: both sides are aborted, no KV ever moves, every load and
    every lease ends at 0."""
    # (the prompt's prefill takes ~15 s there, in chunks of 64 tokens of ~0.4 s each: the
    # engine sees the abort between two, and a busy box has ample time to close the socket
    # before the prefill could end (at ~1.5 s, the decode side had once begun); a lease it
    # took anyway would end within 10 s)
    f = fleet({"prefill0": "prefill", "decode0": "decode"}, protocol,
              engine_flags={"prefill0": ("--speed", "0.02", "--max-num-batched-tokens", "64",
                                         "--kv-lease-s", "0.2")})
    body = httpx.Request("POST", f.url + "/v1/completions", json={
        "model": MODEL, "prompt": _prompt(11, 800), "max_tokens": 4, "stream": True})
    raw = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n" % len(body.read())) + body.read()
    with socket.create_connection(("127.0.0.1", int(f.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(raw)
        until(lambda: f.status()["prefill0"]["ranks"][0]["load"] > 0
              and f.status()["decode0"]["ranks"][0]["load"] > 0, "both sides reserved")
    until(f.all_idle, "both sides aborted, every load 0, nothing held")
    # aborted, not left to expire (the router closed the prefill engine's connection)
    assert f.engines["prefill0"].metric("kvwire_engine_kv_leases_expired_total") == 0
    if protocol == "vllm":  # (SGLang's decode side had started: it waited for the push)
        assert f.engines["decode0"].metric("kvwire_engine_kv_transfers_started_total") == 0


# ------------------------------------------------------------------------------ many, faulty


N_MIXED = 2000
#: the run's bound (its requests all ended; 8-13 s measured, alone or beside the suite),
#: then the wait for every load to reach 0
RUN_S, SETTLE_S = 180, 90


# (pytest's global 300 s is below the test's own bounds: its run's, its settling's, and
# the start and stop of six processes, each bounded by TIMEOUT)
@pytest.mark.timeout(RUN_S + SETTLE_S + 4 * TIMEOUT)
@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_mixed_requests_with_faults_end_with_nothing_held(fleet: Callable[..., Fleet],
                                                          protocol: str) -> None:
    """2,000 requests, 16 at a time: ten shared prefixes, completions and chat, streamed and
    not, one in six abandoned by its client at a random moment, and a prefill engine
    SIGKILLed half-way. Every request ends (answered, or an error answer); then every load
    is 0 at the router and no live engine holds a leased block or runs anything."""
    f = fleet({"prefill0": "prefill", "prefill1": "prefill", "prefill2": "prefill",
               "decode0": "decode", "decode1": "decode"}, protocol,
              engine_flags={n: ("--kv-lease-s", "3") for n in ("prefill0", "prefill1",
                                                                 "prefill2")})
    prefixes = [_prompt(200 + i, 150) for i in range(10)]
    rng = random.Random(5)
    plan = [(rng.choice(prefixes) + f" q{i}", rng.random() < 0.5, rng.random() < 0.5,
             rng.random() < 1 / 6, rng.random() * 0.3) for i in range(N_MIXED)]
    outcome: dict[str, int] = {}
    done = 0

    async def one(c: httpx.AsyncClient, text: str, chat: bool, stream: bool, drop: bool,
                  after: float) -> None:
        nonlocal done
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        path = "/v1/chat/completions" if chat else "/v1/completions"

        async def go() -> str:
            async with c.stream("POST", path, json=body) as r:
                data = b"".join([x async for x in r.aiter_raw()])
                if r.status_code != 200:
                    return str(r.status_code)
                return "error_event" if b'"error"' in data else "ok"

        try:
            if drop:
                try:
                    key = await asyncio.wait_for(go(), after)
                except asyncio.TimeoutError:
                    key = "dropped"
            else:
                key = await go()
        finally:
            done += 1
        outcome[key] = outcome.get(key, 0) + 1

    async def run() -> None:
        sem = asyncio.Semaphore(16)
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=f.url, timeout=TIMEOUT, limits=limits) as c:
            async def bounded(i: int, job: tuple) -> None:
                async with sem:
                    if i == N_MIXED // 2:
                        f.engines["prefill2"].kill()
                    await one(c, *job)

            await asyncio.wait_for(asyncio.gather(*(bounded(i, j) for i, j in
                                                    enumerate(plan))), RUN_S)

    asyncio.run(run())
    assert done == N_MIXED
    # (every request not dropped by its client answered: the prefill engine killed is
    # retried elsewhere; a stream it broke ends with an error event)
    assert outcome.get("dropped", 0) > 0 and outcome.get("ok", 0) >= 0.8 * N_MIXED, outcome
    assert set(outcome) <= {"ok", "dropped", "error_event"}, outcome
    until(f.all_idle, "every load 0 and no engine holding or running anything", SETTLE_S)
