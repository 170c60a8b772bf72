"""``kvwire serve``'s prefill/decode flows (proxy/pairs.py) over real HTTP on loopback: a
RouterCore + Proxy served by kvwire's HTTP server in front of stand-in engines.

The stand-ins: each engine here is a small real HTTP server (kvwire.http1.server, real
sockets) that speaks the two protocols' surface as vLLM and SGLang engines do and records
every body and header it was sent, which a real engine does not show: a vLLM prefill engine
answers ``kv_transfer_params``; an SGLang prefill engine "pushes" its room (a shared table)
and a decode engine waits for that push (bounded) before it answers. They also fail on
demand (500, refused, hung, a stream broken off: the faults the flows must survive), which
a real engine cannot be asked to do. tests/test_pd_serve.py runs the flows against real
``kvwire engine --role`` processes (its faults: SIGKILL, a client leaving). The engines'
blocks are applied to the router's index directly (as the feed applies a delivery), so
which engine holds a prefix is known."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pd_helpers import metrics

from kvwire.consume.engine_spec import EngineSpec
from kvwire.consume.stream import Batch
from kvwire.http1.server import Request, Routes, Server
from kvwire.http1.server import serve_in_thread as http_in_thread
from kvwire.proxy.proxy import Proxy, ProxyConfig
from kvwire.routing.core import RouterCore
from kvwire.routing.pairs import PairConfig
from kvwire.routing.policy import RoutingPolicy
from kvwire.serve.app import serve_in_thread
from kvwire.tokenize import load_tokenizer
from kvwire.wire.events import BlockStored, KVEventBatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from waiting import wait_for as _wait_for  # noqa: E402

TIMEOUT = 20.0
wait_for = functools.partial(_wait_for, timeout=TIMEOUT, interval=0.01)
BS = 16

#: SGLang's transfer, as the stand-ins play it: room -> pushed by the prefill engine
_ROOMS: dict[int, threading.Event] = {}
_ROOMS_LOCK = threading.Lock()


def _room(room: int) -> threading.Event:
    with _ROOMS_LOCK:
        return _ROOMS.setdefault(room, threading.Event())


class FakeEngine:
    """A stand-in engine of one role on loopback (module docstring). ``status``: what its
    generation answers are (500: broken); ``hold``: a prefill waits for this event (or
    its client leaving) before it answers; ``no_params``: a vLLM prefill answer without
    ``kv_transfer_params``; ``break_after``: a stream sends this many events, then the
    connection drops."""

    def __init__(self, name: str, role: str, status: int = 200,
                 hold: threading.Event | None = None, no_params: bool = False,
                 break_after: int | None = None) -> None:
        self.name, self.role, self.status = name, role, status
        self.hold, self.no_params, self.break_after = hold, no_params, break_after
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.gone = 0  # requests whose client (the router) went away before the answer
        self.holding = 0
        self._tasks: set[asyncio.Task] = set()
        routes = Routes(headers=True, fallback=self._run)
        self.server, self.thread, port = http_in_thread(routes, server=Server(routes))
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        if self.hold is not None:
            self.hold.set()
        self.server.should_exit = True
        self.thread.join(TIMEOUT)

    def _run(self, req: Request) -> None:
        task = asyncio.get_running_loop().create_task(self.handle(req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _wait(self, req: Request, ev: threading.Event, limit: float) -> bool:
        """Wait (bounded) for ``ev``; False if the client left or the time ran out."""
        left = []
        req.on_close = lambda: left.append(1)
        end = asyncio.get_running_loop().time() + limit
        while not ev.is_set() and not left and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.005)
        req.on_close = None
        if left:
            self.gone += 1
        return ev.is_set() and not left

    async def handle(self, req: Request) -> None:
        if req.method == b"GET":
            if req.path == b"/v1/models":
                req.respond(200, b'{"object":"list","data":[{"id":"m","parent":null}]}')
            else:
                req.respond(200, b"{}")
            return
        body = json.loads(req.body)
        self.bodies.append(body)
        self.headers.append({k.decode(): v.decode() for k, v in req.headers})
        if self.status >= 500:
            req.respond(self.status, b'{"error":{"message":"engine broke","code":500}}')
            return
        if self.status != 200:
            req.respond(self.status, b'{"error":{"message":"bad prompt","code":400}}')
            return
        kv = body.get("kv_transfer_params")
        room = body.get("bootstrap_room")
        if isinstance(kv, dict) and kv.get("do_remote_decode"):  # vLLM: the prefill side
            if self.hold is not None:
                self.holding += 1
                ok = await self._wait(req, self.hold, TIMEOUT)
                self.holding -= 1
                if not ok:
                    return
            out: dict[str, Any] = {"id": "cmpl-p", "object": "text_completion",
                                   "choices": [{"index": 0, "text": "x",
                                                "finish_reason": "length"}]}
            if not self.no_params:
                out["kv_transfer_params"] = {
                    "do_remote_prefill": True, "do_remote_decode": False,
                    "remote_block_ids": [1, 2], "remote_engine_id": self.name,
                    "remote_request_id": self.headers[-1].get("x-request-id"),
                    "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1}
            req.respond(200, json.dumps(out).encode())
            return
        if room is not None:  # SGLang
            rooms = room if isinstance(room, list) else [room]
            if self.role == "prefill":
                if self.hold is not None:
                    self.holding += 1
                    ok = await self._wait(req, self.hold, TIMEOUT)
                    self.holding -= 1
                    if not ok:
                        return
                for r in rooms:
                    _room(r).set()  # pushed
            else:
                for r in rooms:  # the decode side waits for the push (bounded)
                    if not await self._wait(req, _room(r), 5.0):
                        if not req.done:
                            req.respond(500, b'{"error":{"message":"no KV pushed"}}')
                        return
        await self._answer(req, body)

    async def _answer(self, req: Request, body: dict[str, Any]) -> None:
        n = int(body.get("max_tokens") or 4)
        usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}
        chat = "messages" in body
        if not body.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": "tok" * n},
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": "tok" * n, "finish_reason": "length"})
            req.respond(200, json.dumps({
                "id": "cmpl-d", "object": "chat.completion" if chat else "text_completion",
                "created": 0, "model": "m", "choices": [choice], "usage": usage}).encode())
            return
        req.start(200, [(b"content-type", b"text/event-stream")])
        for i in range(n):
            if self.break_after is not None and i == self.break_after:
                req.abort()
                return
            delta = ({"index": 0, "delta": {"content": "tok"}, "finish_reason": None} if chat
                     else {"index": 0, "text": "tok", "finish_reason": None})
            ev = {"id": "cmpl-d", "object": "chat.completion.chunk" if chat else
                  "text_completion", "created": 0, "model": "m", "choices": [delta]}
            req.send(b"data: " + json.dumps(ev).encode() + b"\n\n")
            await asyncio.sleep(0)
        last = {"id": "cmpl-d", "object": "chat.completion.chunk" if chat else
                "text_completion", "created": 0, "model": "m", "choices": [], "usage": usage}
        req.end(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")

    def sides(self) -> list[str]:
        """What each request asked of this engine: prefill, decode or whole."""
        out = []
        for b in self.bodies:
            kv = b.get("kv_transfer_params")
            if isinstance(kv, dict) and kv.get("do_remote_decode"):
                out.append("prefill")
            elif isinstance(kv, dict) and kv.get("do_remote_prefill"):
                out.append("decode")
            elif "bootstrap_room" in b:
                out.append(self.role)
            else:
                out.append("whole")
        return out


class PDStack:
    """Stand-in engines of the given roles + RouterCore + Proxy + HTTP, on loopback."""

    def __init__(self, roles: dict[str, str], protocol: str | None = "vllm",
                 engine_kw: dict[str, dict] | None = None,
                 pairs: PairConfig | None = None,
                 **cfg: Any) -> None:
        kw = engine_kw or {}
        self.engines = {n: FakeEngine(n, r, **kw.get(n, {})) for n, r in roles.items()}
        urls = {n: e.url for n, e in self.engines.items()}
        specs = [EngineSpec(n, f"ipc:///nonexistent/{n}", url=urls[n], role=r,
                            bootstrap_port=9000 + i if r != "decode" else 8998)
                 for i, (n, r) in enumerate(roles.items())]
        self.core = RouterCore(specs, policy=RoutingPolicy(load_weight=0.5, seed=1),
                               block_size=BS, pairs=pairs)
        self.core.start()
        cfg.setdefault("probe_interval", 0.1)
        cfg.setdefault("cooloff", 0.3)
        self.proxy = Proxy(self.core, load_tokenizer(None),
                           config=ProxyConfig(pd_protocol=protocol, **cfg))
        self.proxy.start()
        self.server, self.thread, port = serve_in_thread(self.core, proxy=self.proxy)
        self.url = f"http://127.0.0.1:{port}"
        assert self.proxy.wait_probed(TIMEOUT)
        wait_for(lambda: all(link.up for link in self.proxy.links.values()),
                 "every engine probed up")

    def hold(self, name: str, tokens: list[int]) -> None:
        """Engine ``name`` holds ``tokens`` (whole blocks), as its events would say."""
        t = next(t for t in self.core.targets if t.engine == name)
        nb = len(tokens) // BS
        stored = BlockStored(list(range(1, nb + 1)), None, tokens[:nb * BS], BS, None)
        self.core.feed._apply([Batch(t.stream, 0, KVEventBatch(0.0, [stored], 0), 1)])

    def loads(self) -> dict[str, float]:
        with self.core.lock:
            return self.core.loads.loads()

    def idle(self) -> bool:
        with self.core.lock:
            return not self.core.loads.loads() and len(self.core.loads) == 0

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(TIMEOUT)
        self.proxy.close()
        self.core.close()
        for e in self.engines.values():
            e.close()


@pytest.fixture
def pd() -> Iterator[Callable[..., PDStack]]:
    made: list[PDStack] = []

    def make(roles: dict[str, str], **kw: Any) -> PDStack:
        s = PDStack(roles, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _tokens(text: str) -> list[int]:
    return list(load_tokenizer(None).encode(text))


PROMPT = "the quick brown fox jumps over the lazy dog " * 12


# ------------------------------------------------------------------------------ vLLM


def test_vllm_pair_bodies_headers_and_answers(pd: Callable[..., PDStack]) -> None:
    """The prefill engine gets the client's body with vLLM's remote-decode params, whole,
    one token, no stream options, no minimum; the decode engine the client's own body plus
    the prefill answer's params; both the same X-Request-Id; the answer (streamed and not,
    chat and completions, through the openai client unchanged) is the decode engine's;
    every load ends at 0."""
    s = pd({"p0": "prefill", "d0": "decode"})
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    r = client.completions.with_raw_response.create(
        model="m", prompt=PROMPT, max_tokens=5, extra_body={"min_tokens": 3})
    assert r.headers["x-kvwire-engine"] == "prefill=p0,decode=d0"
    assert r.parse().choices[0].text == "tok" * 5
    p, d = s.engines["p0"], s.engines["d0"]
    assert p.sides() == ["prefill"] and d.sides() == ["decode"]
    pb, db = p.bodies[0], d.bodies[0]
    assert pb["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert (pb["stream"], pb["max_tokens"], pb["prompt"]) == (False, 1, PROMPT)
    assert "min_tokens" not in pb
    assert db["min_tokens"] == 3 and db["max_tokens"] == 5 and db["prompt"] == PROMPT
    assert db["kv_transfer_params"]["remote_engine_id"] == "p0"
    assert db["kv_transfer_params"]["do_remote_prefill"] is True
    xid = p.headers[0]["x-request-id"]
    assert xid and d.headers[0]["x-request-id"] == xid
    assert db["kv_transfer_params"]["remote_request_id"] == xid
    # streamed chat, with stream options and max_completion_tokens
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPT}], stream=True,
        max_completion_tokens=3, stream_options={"include_usage": True},
        extra_body={"min_completion_tokens": 2}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "tok" * 4  # (the stand-in answers max_tokens, 4 when absent)
    assert chunks[-1].usage is not None
    pb, db = p.bodies[1], d.bodies[1]
    assert (pb["stream"], pb["max_tokens"], pb["max_completion_tokens"]) == (False, 1, 1)
    assert "stream_options" not in pb and "min_completion_tokens" not in pb
    assert db["stream"] is True and db["stream_options"] == {"include_usage": True}
    assert db["max_completion_tokens"] == 3 and db["min_completion_tokens"] == 2
    assert p.headers[1]["x-request-id"] == d.headers[1]["x-request-id"] != xid
    wait_for(s.idle, "every load released")


def test_a_clients_own_protocol_fields_are_overwritten(pd: Callable[..., PDStack]) -> None:
    """kv_transfer_params and bootstrap_* are the router's: a client's (malformed or not)
    never reaches an engine, neither on a pair nor on a local prefill."""
    s = pd({"p0": "prefill", "d0": "decode"})
    r = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT, json={
        "model": "m", "prompt": PROMPT, "max_tokens": 2,
        "kv_transfer_params": "not an object", "bootstrap_room": -1})
    assert r.status_code == 200
    p, d = s.engines["p0"], s.engines["d0"]
    assert p.bodies[0]["kv_transfer_params"]["do_remote_decode"] is True
    assert d.bodies[0]["kv_transfer_params"]["remote_engine_id"] == "p0"
    assert "bootstrap_room" not in p.bodies[0] and "bootstrap_room" not in d.bodies[0]
    r = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT, json={
        "model": "m", "prompt": PROMPT, "max_tokens": 2,
        "kv_transfer_params": {"do_remote_decode": True, "remote_host": "10.0.0.1"}})
    assert r.status_code == 200
    assert p.bodies[1]["kv_transfer_params"]["remote_host"] is None
    # local (the decider): the client's field is dropped
    s.core.pairs = PairConfig(min_disagg_blocks=1000)
    r = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT, json={
        "model": "m", "prompt": PROMPT, "max_tokens": 2,
        "kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 200 and r.headers["x-kvwire-engine"] == "prefill=d0,decode=d0"
    assert d.sides()[-1] == "whole" and "kv_transfer_params" not in d.bodies[-1]
    wait_for(s.idle, "every load released")


def test_prefill_goes_where_its_prefix_is_and_the_decider_keeps_cached_ones_local(
        pd: Callable[..., PDStack]) -> None:
    s = pd({"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"},
           pairs=PairConfig(min_disagg_blocks=2))
    toks = _tokens(PROMPT)
    s.hold("p1", toks)
    s.hold("d1", toks[:BS])
    r = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT,
                   json={"model": "m", "prompt": PROMPT, "max_tokens": 2})
    assert r.headers["x-kvwire-engine"] == "prefill=p1,decode=d1"
    # d1 now holds the prefix (predicted: it pulled the blocks): again, it misses under 2
    # blocks, so it prefills itself
    r = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT,
                   json={"model": "m", "prompt": PROMPT, "max_tokens": 2})
    assert r.headers["x-kvwire-engine"] == "prefill=d1,decode=d1"
    assert s.engines["d1"].sides() == ["decode", "whole"]
    assert s.engines["p0"].bodies == [] and len(s.engines["p1"].bodies) == 1
    assert s.engines["d0"].bodies == []
    m = _metrics(s.url)
    assert m[("kvwire_proxy_pd_decisions_total", (("why", "disagg"),))] == 1
    assert m[("kvwire_proxy_pd_decisions_total", (("why", "cached"),))] == 1
    assert m[("kvwire_proxy_pd_requests_total", (("engine", "p1"), ("role", "prefill")))] == 1
    assert m[("kvwire_proxy_pd_requests_total", (("engine", "d1"), ("role", "both")))] == 1
    assert m[("kvwire_proxy_pd_prefill_seconds_count", (("engine", "p1"),))] == 1
    assert m[("kvwire_proxy_pd_decode_first_token_seconds_count", (("engine", "d1"),))] == 1
    wait_for(s.idle, "every load released")


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    return metrics(httpx.get(url + "/metrics", timeout=TIMEOUT).text)


@pytest.mark.parametrize("fault", ["500", "refused", "no_params"])
def test_a_failed_prefill_is_retried_on_the_next_prefill_engine(
        pd: Callable[..., PDStack], fault: str) -> None:
    """p0 fails (500, nothing listening, or an answer without kv_transfer_params); p1 holds
    less of the prefix, so it is tried second; the client never sees the failure."""
    kw = {"500": {"p0": {"status": 500}}, "no_params": {"p0": {"no_params": True}},
          "refused": {}}[fault]
    # (probed once: p0 seen up, then closed before the request)
    s = pd({"p0": "prefill", "p1": "prefill", "d0": "decode"}, engine_kw=kw,
           probe_interval=60.0)
    if fault == "refused":
        s.engines["p0"].close()
    toks = _tokens(PROMPT)
    s.hold("p0", toks)
    r = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT,
                   json={"model": "m", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvwire-engine"] == "prefill=p1,decode=d0"
    if fault != "refused":
        assert s.engines["p0"].sides() == ["prefill"]
    assert s.engines["p1"].sides() == ["prefill"] and s.engines["d0"].sides() == ["decode"]
    assert s.proxy.counts["pd_prefill_failures"] == 1
    assert _metrics(s.url)[("kvwire_proxy_pd_prefill_failures_total", ())] == 1
    wait_for(s.idle, "every load released")


@pytest.mark.parametrize("fallback", ["local", "fail"])
def test_every_prefill_failing_falls_back_as_configured(pd: Callable[..., PDStack],
                                                        fallback: str) -> None:
    s = pd({"p0": "prefill", "p1": "prefill", "d0": "decode"}, pd_fallback=fallback,
           engine_kw={"p0": {"status": 500}, "p1": {"status": 503}}, retries=1)
    r = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT,
                   json={"model": "m", "prompt": PROMPT, "max_tokens": 2})
    assert s.engines["p0"].sides() == ["prefill"] and s.engines["p1"].sides() == ["prefill"]
    if fallback == "local":
        assert r.status_code == 200 and r.headers["x-kvwire-engine"] == "prefill=d0,decode=d0"
        assert s.engines["d0"].sides() == ["whole"]
        assert s.proxy.counts["pd_fallbacks"] == 1
    else:
        assert r.status_code == 502 and "--pd-fallback is fail" in r.json()["error"]["message"]
        assert s.engines["d0"].bodies == []
    wait_for(s.idle, "every load released")


def test_a_prefill_4xx_is_the_clients_answer(pd: Callable[..., PDStack]) -> None:
    """The prefill engine refuses the request (its own fault, 4xx): not retried elsewhere,
    not sent to decode; the client gets that answer."""
    s = pd({"p0": "prefill", "p1": "prefill", "d0": "decode"},
           engine_kw={"p0": {"status": 400}, "p1": {"status": 400}})
    r = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT,
                   json={"model": "m", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["message"] == "bad prompt"
    assert len(s.engines["p0"].bodies) + len(s.engines["p1"].bodies) == 1
    assert s.engines["d0"].bodies == []
    wait_for(s.idle, "every load released")


def test_client_disconnect_during_prefill_aborts_and_holds_nothing(
        pd: Callable[..., PDStack]) -> None:
    hold = threading.Event()
    s = pd({"p0": "prefill", "d0": "decode"}, engine_kw={"p0": {"hold": hold}})
    p = s.engines["p0"]

    async def go() -> None:
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            task = asyncio.create_task(c.post(s.url + "/v1/completions", json={
                "model": "m", "prompt": PROMPT, "max_tokens": 2, "stream": True}))
            while not p.holding:
                await asyncio.sleep(0.01)
            assert s.loads()  # both sides reserved while the prefill runs
            task.cancel()

    asyncio.run(go())
    wait_for(lambda: p.gone == 1, "the prefill engine sees its client leave")
    wait_for(s.idle, "every load released")
    assert s.engines["d0"].bodies == []
    assert s.proxy.fleet.in_flight == {"p0": 0, "d0": 0}


def test_a_decode_stream_broken_off_ends_with_an_sse_error(pd: Callable[..., PDStack]) -> None:
    s = pd({"p0": "prefill", "d0": "decode"}, engine_kw={"d0": {"break_after": 2}})
    with httpx.stream("POST", s.url + "/v1/completions", timeout=TIMEOUT, json={
            "model": "m", "prompt": PROMPT, "max_tokens": 6, "stream": True}) as r:
        body = b"".join(r.iter_bytes())
    assert r.status_code == 200
    assert body.count(b'"text": "tok"') == 2
    assert b"failed mid-stream" in body and body.endswith(b"data: [DONE]\n\n")
    wait_for(s.idle, "every load released")


def test_a_decode_engine_refusing_is_replaced_with_the_same_blocks(
        pd: Callable[..., PDStack]) -> None:
    """vLLM: the prefill is done and held; the decode engine chosen is gone (refused): the
    next decode engine gets the same kv_transfer_params (no second prefill)."""
    s = pd({"p0": "prefill", "d0": "decode", "d1": "decode"}, probe_interval=60.0)
    s.hold("d0", _tokens(PROMPT)[:BS])  # d0 is chosen first
    s.engines["d0"].close()
    r = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT,
                   json={"model": "m", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-kvwire-engine"] == "prefill=p0,decode=d1"
    assert len(s.engines["p0"].bodies) == 1
    assert s.engines["d1"].bodies[0]["kv_transfer_params"]["remote_engine_id"] == "p0"
    assert not s.proxy.links["d0"].breaker.up  # (refused: its breaker opened)
    wait_for(s.idle, "every load released")


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_decode_5xx_after_a_remote_prefill_reruns_the_pair(pd: Callable[..., PDStack],
                                                             protocol: str) -> None:
    """The decode engine answers 500 (as a failed pull is answered): the pair runs again
    with the other prefill engine; the decode engine's breaker stays closed."""
    s = pd({"p0": "prefill", "p1": "prefill", "d0": "decode"}, protocol=protocol)
    s.hold("p0", _tokens(PROMPT))  # p0 first
    d = s.engines["d0"]
    d.status = 500
    real = d.handle

    async def once(req: Request) -> None:  # 500 to the first generation request only
        await real(req)
        if req.method == b"POST":
            d.status = 200

    d.handle = once  # type: ignore[method-assign]
    r = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT,
                   json={"model": "m", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-kvwire-engine"] == "prefill=p1,decode=d0"
    assert len(d.bodies) == 2 and s.proxy.links["d0"].breaker.up
    assert s.proxy.counts["pd_prefill_failures"] == 1
    wait_for(s.idle, "every load released")


# ------------------------------------------------------------------------------ SGLang


def test_sglang_pair_bodies_and_answers(pd: Callable[..., PDStack]) -> None:
    """The same body to both, with the prefill engine's bootstrap host and port and a
    room below 2^63 (one per prompt for a batch); the decode answer is the client's."""
    s = pd({"p0": "prefill", "d0": "decode"}, protocol="sglang")
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    r = client.completions.with_raw_response.create(model="m", prompt=PROMPT, max_tokens=3)
    assert r.parse().choices[0].text == "tok" * 3
    assert r.headers["x-kvwire-engine"] == "prefill=p0,decode=d0"
    p, d = s.engines["p0"], s.engines["d0"]
    assert p.bodies[0] == d.bodies[0]
    b = p.bodies[0]
    assert b["bootstrap_host"] == "127.0.0.1" and b["bootstrap_port"] == 9000
    assert 0 <= b["bootstrap_room"] < 2 ** 63 and b["max_tokens"] == 3
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPT}], stream=True, max_tokens=2))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "tok" * 2
    assert p.bodies[1]["bootstrap_room"] == d.bodies[1]["bootstrap_room"] != b["bootstrap_room"]
    # a batch of prompts: a room each
    r2 = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT,
                    json={"model": "m", "prompt": [PROMPT, PROMPT + "x"], "max_tokens": 1})
    assert r2.status_code == 200
    b = d.bodies[2]
    assert b["bootstrap_host"] == ["127.0.0.1"] * 2 and b["bootstrap_port"] == [9000] * 2
    assert len(set(b["bootstrap_room"])) == 2
    wait_for(s.idle, "every load released")


def test_sglang_prefill_failure_before_decode_ends_both_and_retries(
        pd: Callable[..., PDStack]) -> None:
    """p0 answers 500: the decode request waiting for its push is ended (its connection
    closes) and the pair runs again on p1 with a new room."""
    s = pd({"p0": "prefill", "p1": "prefill", "d0": "decode"}, protocol="sglang",
           engine_kw={"p0": {"status": 500}})
    s.hold("p0", _tokens(PROMPT))
    r = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT,
                   json={"model": "m", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-kvwire-engine"] == "prefill=p1,decode=d0"
    d = s.engines["d0"]
    wait_for(lambda: d.gone == 1, "the first decode request ended by the router")
    rooms = [b["bootstrap_room"] for b in d.bodies]
    assert len(rooms) == 2 and rooms[0] != rooms[1]
    assert s.engines["p1"].bodies[0]["bootstrap_port"] == 9001
    wait_for(s.idle, "every load released")


def test_sglang_client_disconnect_ends_both_sides(pd: Callable[..., PDStack]) -> None:
    hold = threading.Event()
    s = pd({"p0": "prefill", "d0": "decode"}, protocol="sglang",
           engine_kw={"p0": {"hold": hold}})
    p, d = s.engines["p0"], s.engines["d0"]

    async def go() -> None:
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            task = asyncio.create_task(c.post(s.url + "/v1/completions", json={
                "model": "m", "prompt": PROMPT, "max_tokens": 2}))
            while not (p.holding and d.bodies):
                await asyncio.sleep(0.01)
            task.cancel()

    asyncio.run(go())
    wait_for(lambda: p.gone == 1 and d.gone == 1, "both engines see the router leave")
    wait_for(s.idle, "every load released")


# ------------------------------------------------------------------------------ status, CLI


def test_engines_show_roles(pd: Callable[..., PDStack]) -> None:
    """/engines (what the status page renders from) carries each engine's role."""
    s = pd({"p0": "prefill", "d0": "decode", "b0": "both"})
    e = httpx.get(s.url + "/engines", timeout=TIMEOUT).json()
    assert {n: v["role"] for n, v in e.items()} == {"p0": "prefill", "d0": "decode",
                                                    "b0": "both"}
    assert e["p0"]["http"]["role"] == "prefill"
    # a pass-through request never goes to a prefill-only engine
    for _ in range(6):
        r = httpx.post(s.url + "/tokenize", timeout=TIMEOUT, json={"model": "m", "prompt": "x"})
        assert r.headers["x-kvwire-engine"] in ("d0", "b0")


def test_status_page_shows_roles_in_headless_chromium(pd: Callable[..., PDStack],
                                                      tmp_path: Path) -> None:
    """The status page, rendered by its script in a real browser: each engine's row names
    its role (a prefill or decode engine), an engine of both roles only its name."""
    from test_status_page import _browse  # (skips loudly without chromium)

    s = pd({"p0": "prefill", "d0": "decode", "b0": "both"})
    dom = _browse(s.url.rsplit(":", 1)[1], tmp_path)
    rows = dict(re.findall(r'<tr data-stream="([^"]+)"[^>]*><td>([^<]*)</td>', dom))
    assert rows == {"p0/dp0": "p0 (prefill)", "d0/dp0": "d0 (decode)", "b0/dp0": "b0"}, \
        dom[-3000:]


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvwire", "serve", "--port", "0", *args],
                          capture_output=True, text=True, timeout=60)


def test_bad_roles_exit_2_with_one_line() -> None:
    r = _serve("--engine", "p0=tcp://127.0.0.1:5557,role=prefil")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "unknown role 'prefil' (expected prefill, decode or both)" in r.stderr
    r = _serve("--engine", "p0=tcp://127.0.0.1:5557,role=prefill,url=http://127.0.0.1:9",
               "--engine", "p1=tcp://127.0.0.1:5558,role=prefill")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "role=prefill engines (p0, p1) need an engine that decodes" in r.stderr
    r = _serve("--engine", "p0=tcp://127.0.0.1:5557", "--pd-protocol", "nixl")
    assert r.returncode == 2 and "--pd-protocol" in r.stderr


def test_the_serve_flags_reach_the_router_and_the_proxy(tmp_path: Path) -> None:
    """--disagg-min-tokens (in reference blocks), --pd-prefill-busy, --pd-protocol and
    --pd-fallback as the command line builds the service."""
    from kvwire.cli.options import Parser
    from kvwire.cli.serve import add_arguments, serve_config
    from kvwire.serve.build import build

    p = Parser(prog="kvwire serve")
    add_arguments(p)
    args = p.parse_args([
        "--engine", f"p0=ipc://{tmp_path}/p0,url=http://127.0.0.1:9,role=prefill,"
                    "bootstrap_port=9100",
        "--engine", f"d0=ipc://{tmp_path}/d0,url=http://127.0.0.1:9,role=decode",
        "--port", "0", "--block-size", "16", "--disagg-min-tokens", "64",
        "--pd-prefill-busy", "40", "--pd-protocol", "sglang", "--pd-fallback", "fail"])
    svc = build(serve_config(args))
    try:
        assert svc.core.pairs == PairConfig(min_disagg_blocks=4.0, prefill_busy=40.0,
                                              always=True)  # (--pd-protocol)
        assert svc.proxy is not None
        assert (svc.proxy.cfg.pd_protocol, svc.proxy.cfg.pd_fallback) == ("sglang", "fail")
        assert svc.proxy.handler.pairs.active and svc.proxy.links["p0"].bootstrap_port == 9100
    finally:
        svc.close()
    defaults = serve_config(p.parse_args(["--engine", f"e=ipc://{tmp_path}/e"]))
    assert (defaults.disagg_min_tokens, defaults.pd_prefill_busy) == (0, float("inf"))
    assert defaults.proxy.pd_protocol is None and defaults.proxy.pd_fallback == "local"
