"""``kvwire serve``'s OpenAI proxy over real HTTP and ZeroMQ on loopback: in-thread
``kvwire engine``s (the same EngineApp the CLI runs) behind a RouterCore + Proxy served by
kvwire's HTTP server, and at the end real ``kvwire engine`` and ``kvwire serve`` processes (SIGKILL and
restart). The one stand-in: a tiny HTTP server that answers 500 or records headers, for the
engine faults and the header check a kvwire engine cannot be made to show."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvwire.consume.engine_spec import EngineSpec
from kvwire.consume.stream import StreamConfig
from kvwire.engine import EngineConfig, StepCost
from kvwire.proxy.proxy import Proxy, ProxyConfig
from kvwire.routing.core import RouterCore
from kvwire.routing.policy import RoundRobinPolicy, RoutingPolicy
from kvwire.serve.app import serve_in_thread
from kvwire.tokenize import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_helpers import import_or_skip  # noqa: E402
from test_engine_http import EngineThread, _opts  # noqa: E402
from waiting import wait_for as _wait_for  # noqa: E402

TIMEOUT = 20.0
wait_for = functools.partial(_wait_for, timeout=TIMEOUT, interval=0.01)
ROOT = Path(__file__).resolve().parent.parent



def _engine(**kw: Any) -> EngineThread:
    return EngineThread(_opts(**kw))


class Stack:
    """Engines + RouterCore + Proxy + the HTTP server, all in this process, on loopback."""

    def __init__(self, engines: list[Any], urls: list[str] | None = None,
                 tokenizer: Any = "builtin", policy: Any = None,
                 admin_token: str | None = None, **cfg: Any) -> None:
        self.engines = engines
        urls = urls or [e.url for e in engines]
        specs = [EngineSpec(f"e{i}", e.events[0], url=u)
                 for i, (e, u) in enumerate(zip(engines, urls))]
        self.core = RouterCore(specs, policy=policy or RoutingPolicy(load_weight=0.5, seed=1),
                               stream_config=StreamConfig())
        self.core.start()
        cfg.setdefault("probe_interval", 0.1)
        cfg.setdefault("cooloff", 0.3)
        tok = load_tokenizer(None) if tokenizer == "builtin" else tokenizer
        self.proxy = Proxy(self.core, tok, tokenize_with_engine=tokenizer == "engine",
                           config=ProxyConfig(**cfg))
        self.proxy.start()
        self.server, self.thread, port = serve_in_thread(self.core, proxy=self.proxy,
                                                         admin_token=admin_token)
        self.url = f"http://127.0.0.1:{port}"
        assert self.proxy.wait_probed(TIMEOUT)
        wait_for(lambda: all(self.core.alive.values()), "every event stream alive")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(TIMEOUT)
        self.proxy.close()
        self.core.close()

    def loads(self) -> dict[str, float]:
        with self.core.lock:
            return self.core.loads.loads()


@pytest.fixture
def make_stack() -> Iterator[Callable[..., Stack]]:
    made: list[Stack] = []
    engines: list[Any] = []

    def make(n: int = 2, engine_kw: dict | None = None, **kw: Any) -> Stack:
        es = [_engine(**(engine_kw or {})) for _ in range(n)]
        engines.extend(es)
        s = Stack(es, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
    for e in engines:
        if e.thread.is_alive():
            e.close()


def _chat(prefix: str, suffix: str, **kw: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 4,
            "messages": [{"role": "system", "content": prefix},
                         {"role": "user", "content": suffix}], **kw}


# ---------------------------------------------------------------------------- routing


def test_requests_follow_the_cache(make_stack: Callable[..., Stack]) -> None:
    """Each conversation's later turns go to the engine that holds its prefix, and hit it."""
    s = make_stack(3)
    tok = load_tokenizer(None)  # what the stack's proxy tokenizes with

    def held_by_home(body: dict[str, Any], home: str) -> bool:
        """The router's index credits ``home`` with most of the prompt: its events (or the
        prediction of the turn before) have landed. On a loaded box ingest can lag a turn."""
        ids = tok.encode_chat(body["messages"])
        with s.core.lock:
            matches = s.core.index.match(ids)
        credit = {name: m.credit for name, m in matches.items()}
        best = max(credit, key=credit.get, default=None)  # (all at 0: a tie, not a holder)
        return best is not None and credit[best] > 0 and best.split("/")[0] == home

    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        homes: dict[int, str] = {}
        for k in range(6):
            prefix = f"conversation {k}: " + "context words " * 120
            for turn in range(3):
                body = _chat(prefix, f"question {turn}")
                if turn:
                    wait_for(lambda b=body, h=homes[k]: held_by_home(b, h),
                             f"conversation {k}'s prefix in the index")
                r = c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                eng = r.headers["x-kvwire-engine"]
                homes.setdefault(k, eng)
                assert eng == homes[k], f"conversation {k} turn {turn} left its engine"
                if turn:
                    u = r.json()["usage"]
                    cached = u["prompt_tokens_details"]["cached_tokens"]
                    assert cached >= u["prompt_tokens"] // 2, u
        assert len(set(homes.values())) >= 2  # and they spread over the engines
    wait_for(lambda: s.loads() == {}, "every reservation released")


def test_lora_and_salt_route_apart(make_stack: Callable[..., Stack]) -> None:
    """A model naming a LoRA adapter (an engine's /v1/models parent) routes with that
    lora_name; cache_salt is the salt; the base model routes with neither. (A spy on the
    real route_proxy call records its arguments.)"""
    s = make_stack(2)
    seen: list[tuple[Any, Any]] = []
    real = s.core.route_proxy

    def spy(tokens: Any, lora: Any, salt: Any, *a: Any) -> Any:
        seen.append((lora, salt))
        return real(tokens, lora, salt, *a)

    s.core.route_proxy = spy  # type: ignore[method-assign]
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        for model, salt in (("ad1", None), ("m", "s1"), ("m", None), (None, None)):
            body: dict[str, Any] = {"prompt": "lora prompt " * 20, "max_tokens": 2}
            if model:
                body["model"] = model
            if salt:
                body["cache_salt"] = salt
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
    assert seen == [("ad1", None), (None, "s1"), (None, None), (None, None)]


def test_policy_baseline_spreads_blindly(make_stack: Callable[..., Stack]) -> None:
    """--policy round_robin ignores the cache: the same prompt alternates engines."""
    s = make_stack(2, policy=RoundRobinPolicy())
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        got = [c.post("/v1/chat/completions", json=_chat("same " * 100, "q")
                      ).headers["x-kvwire-engine"] for _ in range(4)]
    assert got[0] != got[1] and got[0] == got[2]


def test_without_tokenizer_routes_by_load(make_stack: Callable[..., Stack],
                                          caplog: pytest.LogCaptureFixture) -> None:
    """No tokenizer: the proxy still serves, by load, and said so at start."""
    with caplog.at_level("WARNING", logger="kvwire.proxy.proxy"):
        s = make_stack(2, tokenizer=None)
    assert sum("routed by load only" in r.message for r in caplog.records) == 1
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/chat/completions", json=_chat("x " * 50, "y"))
        assert r.status_code == 200
    assert s.core.counts["routes"] == 1


def test_tokenizer_engine_mode_equals_local(make_stack: Callable[..., Stack]) -> None:
    """--tokenizer engine asks an engine's /tokenize: the same ids as the local tokenizer
    (so the same route); a prompt of token ids is used as it is."""
    s = make_stack(1, tokenizer="engine")
    tok = load_tokenizer(None)
    body = _chat("tok " * 40, "hello", tools=None)

    async def ids(b: dict[str, Any], chat: bool) -> Any:
        from kvwire.proxy.body import body_dec as _body_dec

        return await s.proxy.tokens.prompt(_body_dec.decode(json.dumps(b).encode()), chat)

    async def all_three() -> list[Any]:
        try:
            return [list(await ids(body, True)), list(await ids({"prompt": "abc def"}, False)),
                    list(await ids({"prompt": [5, 6, 7]}, False))]
        finally:
            for link in s.proxy.links.values():  # its connections belong to this loop
                if link.pool is not None:
                    link.pool.close()
                    link.pool = None

    chat, text, given = asyncio.run(all_three())
    assert chat == tok.encode_chat(body["messages"])
    assert text == tok.encode("abc def", add_special_tokens=True)
    assert given == [5, 6, 7]
    assert s.proxy.counts["tokenize_failures"] == 0


# ---------------------------------------------------------------------------- streaming


def test_streaming_is_chunked(make_stack: Callable[..., Stack]) -> None:
    """The first chunk reaches the client while the engine is still generating."""
    s = make_stack(1, engine_kw={"speed": 1.0})
    body = {"model": "m", "prompt": "stream " * 50, "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["x-kvwire-engine"] == "e0"
        chunks = r.iter_raw()
        first = next(chunks)
        assert first.startswith(b"data: {")
        running = s.engines[0].metrics()
        assert running['vllm:num_requests_running{model_name="m",engine="0"}'] == 1.0
        rest = b"".join(chunks)
    assert rest.endswith(b"data: [DONE]\n\n")
    wait_for(lambda: s.loads() == {}, "load released")


def test_requests_over_max_in_flight_get_429(make_stack: Callable[..., Stack]) -> None:
    """Bounded: with ``max_in_flight`` requests being answered, the next is refused at
    once with OpenAI's 429 and Retry-After (the openai client backs off and retries on
    it), counted; once one ends, requests are taken again."""
    s = make_stack(1, max_in_flight=2)
    body = {"model": "m", "prompt": "hold " * 20, "max_tokens": 300, "ignore_eos": True,
            "stream": True}  # ~0.6 s of decoding each
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c, \
            c.stream("POST", "/v1/completions", json=body) as a, \
            c.stream("POST", "/v1/completions", json=body) as b:
        its = [a.iter_raw(), b.iter_raw()]  # (kept: a dropped one closes its connection)
        firsts = [next(it) for it in its]  # both are being answered
        assert all(f.startswith(b"data: {") for f in firsts)
        r = c.post("/v1/completions", json=dict(body, stream=False))
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == 429 and err["type"] == "RateLimitError"
        assert "--max-in-flight" in err["message"]
        assert s.proxy.active == 2
        rest = [b"".join(it) for it in its]
    assert all(x.endswith(b"data: [DONE]\n\n") for x in rest)
    wait_for(lambda: s.proxy.active == 0, "the two answers ended")
    ok = httpx.post(s.url + "/v1/completions", json=dict(body, stream=False, max_tokens=2),
                    timeout=TIMEOUT)
    assert ok.status_code == 200
    m = _scrape(s.url)
    assert m["kvwire_proxy_requests_total", frozenset({("engine", "none"),
                                                       ("status", "429")})] == 1
    assert m["kvwire_proxy_active", frozenset()] == 0
    assert s.proxy.status()["counts"]["overloaded"] == 1


def test_first_token_drops_the_prefill_share(make_stack: Callable[..., Stack]) -> None:
    """Load follows the request: prompt blocks + decode until the first token, decode only
    after it, nothing once it ends. (1,000 output tokens: 2 s of decode after the first
    token, so a starved test thread still looks while it runs; with 50, 0.1 s, it once
    looked after the end beside a busy process.)"""
    slow = EngineConfig(num_gpu_blocks=2000, block_size=16,
                        cost=StepCost(base_s=2e-3, prefill_token_s=4e-4))  # ~0.4 s prefill
    s = make_stack(1, engine_kw={"speed": 1.0, "config": slow})
    body = {"model": "m", "prompt": list(range(1, 1025)), "max_tokens": 1000,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        before = s.loads()["e0"]
        assert before == 1024 / 16 + 1.0  # 64 uncached blocks + decode_load
        chunks = r.iter_raw()
        next(chunks)
        assert s.loads()["e0"] == 1.0
        for _ in chunks:
            pass
    wait_for(lambda: s.loads() == {}, "load released")
    wait_for(lambda: s.core.counts["releases"] == 1, "the release counted")


def test_usage_and_output_tokens_are_read_off_the_answers(
        make_stack: Callable[..., Stack]) -> None:
    """What the proxy reads in passing, per answer: the output length it teaches the
    decode model (the last ``usage.completion_tokens``, else the SSE events it relayed) and
    the prompt and cached tokens of the last ``usage`` object, streamed or not, whatever
    reads the engine's chunks came in."""
    s = make_stack(1, engine_kw={"speed": 1.0})
    core, proxy = s.core, s.proxy

    def learned() -> tuple[int, int]:
        return core._out_sum, core._out_n

    prompt = "usage " * 60
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        for kw, n, expect in (
                ({}, 5, 5),  # not streamed: the answer's usage
                ({"stream": True, "stream_options": {"include_usage": True}}, 7, 7),
                ({"stream": True}, 6, None)):  # no usage: the events relayed
            body = {"model": "m", "prompt": prompt, "max_tokens": n, "ignore_eos": True, **kw}
            out0, n0 = learned()
            p0, c0 = proxy.prompt_tokens["e0"], proxy.cached_tokens["e0"]
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            if kw:
                # (an engine behind real time sends several tokens in one event, as vLLM
                # does: beside a busy process 6 tokens came as 5 events)
                events = r.content.count(b"data: {")
                assert r.content.endswith(b"data: [DONE]\n\n") and 1 <= events <= n + 1
            else:
                events = 0
            assert learned() == (out0 + (expect or events), n0 + 1), (kw, learned())
            if expect is None:
                assert (proxy.prompt_tokens["e0"], proxy.cached_tokens["e0"]) == (p0, c0)
                continue
            usage = (r.json() if not kw else json.loads(
                [ln for ln in r.text.split("\n\n") if '"usage"' in ln][-1][6:]))["usage"]
            assert usage["completion_tokens"] == expect
            assert proxy.prompt_tokens["e0"] - p0 == usage["prompt_tokens"] > 0
            assert proxy.cached_tokens["e0"] - c0 == \
                usage["prompt_tokens_details"]["cached_tokens"]
        assert proxy.cached_tokens["e0"] > 0  # the same prompt again: cached on the engine
    assert s.loads() == {}


def test_client_disconnect_aborts_upstream_and_releases(
        make_stack: Callable[..., Stack]) -> None:
    s = make_stack(1, engine_kw={"speed": 1.0})
    body = {"model": "m", "prompt": "bye " * 50, "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    aborted = 'kvwire_engine_aborted_requests_total'
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        chunks = r.iter_raw()  # (held: a dropped generator closes the response)
        first = next(chunks)
        assert r.status_code == 200, first
        assert s.loads() == {"e0": 1.0}  # decoding
        assert s.proxy.counts["client_disconnects"] == 0
        r.close()  # the client leaves mid-stream
    wait_for(lambda: s.engines[0].metrics().get(aborted, 0) >= 1, "the engine aborted")
    wait_for(lambda: s.loads() == {}, "load released")
    assert s.proxy.counts["client_disconnects"] == 1


# ---------------------------------------------------------------------------- failures


class _LoopbackServer:
    """A stand-in engine on loopback: ``_serve`` starts the handler's server in a thread,
    ``close`` releases whatever the handler waits on and stops it."""

    release: threading.Event

    def _serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class _Stub(_LoopbackServer):
    """A loopback HTTP server standing in for an engine fault (500s) and recording the
    headers it was sent."""

    def __init__(self, status: int = 500, hang: bool = False) -> None:
        stub = self
        self.hits = 0
        self.release = threading.Event()
        self.headers: list[dict[str, str]] = []

        class H(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                n = int(self.headers.get("content-length", 0))
                self.rfile.read(n)
                stub.headers.append({k.lower(): v for k, v in self.headers.items()}
                                    | {":path": self.path})
                code = 200 if self.path in ("/health", "/v1/models") else status
                if self.path != "/health":
                    stub.hits += self.path.startswith("/v1/c")
                if hang and self.path.startswith("/v1/c"):  # one event, then silence
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    event = b'data: {"choices": [{"text": "x"}]}\n\n'
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                    stub.release.wait(TIMEOUT)
                    return
                body = (b'{"object":"list","data":[{"id":"m","parent":null}]}'
                        if self.path == "/v1/models" else
                        b'{"error":{"message":"engine broke","type":"InternalServerError",'
                        b'"param":null,"code":%d}}' % code)
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *a: Any) -> None:
                pass

        self._serve(H)


class _TokenizeStub(_LoopbackServer):
    """An engine that answers /tokenize with fixed ids and keeps the bodies it was sent."""

    def __init__(self) -> None:
        stub = self
        self.release = threading.Event()
        self.bodies: list[dict[str, Any]] = []

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/tokenize":
                    stub.bodies.append(json.loads(body))
                    out = b'{"tokens": [1, 2, 3], "count": 3, "max_model_len": 4096}'
                else:
                    out = b'{"choices": [{"text": "ok"}]}'
                self.send_response(200)
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def do_GET(self) -> None:
                out = b'{"object": "list", "data": [{"id": "m"}]}'
                self.send_response(200)
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a: Any) -> None:
                pass

        self._serve(H)


def test_tokenize_requests_render_as_each_engine_renders_a_chat(
        make_stack: Callable[..., Stack]) -> None:
    """--tokenizer engine: the /tokenize body leaves add_generation_prompt and
    continue_final_message out at their defaults. vLLM's defaults are the same; SGLang
    (0.5.23) renders messages "as for a chat completion" only when add_generation_prompt is
    absent (given, it renders them as given, and refuses non-jinja templates). Checked
    against both engines' own request models."""
    vllm_tok = import_or_skip("vllm.entrypoints.serve.tokenize.protocol", "vllm")
    sgl = import_or_skip("sglang.srt.entrypoints.openai.protocol", "sglang")
    stub = _TokenizeStub()
    try:
        s = make_stack(1, urls=[stub.url], tokenizer="engine")
        msgs = [{"role": "user", "content": "hi"}]
        cont = [*msgs, {"role": "assistant", "content": "Once upon"}]
        for body in ({"model": "m", "messages": msgs},
                     {"model": "m", "messages": msgs, "add_generation_prompt": False},
                     {"model": "m", "messages": cont, "add_generation_prompt": False,
                      "continue_final_message": True}):
            r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
            assert r.status_code == 200, r.text
        plain, no_gen, cont_q = stub.bodies
        assert "add_generation_prompt" not in plain and "continue_final_message" not in plain
        v = vllm_tok.TokenizeChatRequest(**plain)
        assert v.add_generation_prompt and not v.continue_final_message
        assert sgl.TokenizeRequest(**plain).to_chat_completion_request() \
            ._format_add_generation_prompt is None  # SGLang: as for a chat completion
        assert no_gen["add_generation_prompt"] is False
        assert not vllm_tok.TokenizeChatRequest(**no_gen).add_generation_prompt
        assert (cont_q["add_generation_prompt"], cont_q["continue_final_message"]) == (
            False, True)
        assert vllm_tok.TokenizeChatRequest(**cont_q).continue_final_message
        assert s.proxy.counts["tokenize_failures"] == 0
    finally:
        stub.close()


def test_5xx_is_retried_on_the_next_engine_and_breaks_the_circuit(
        make_stack: Callable[..., Stack]) -> None:
    stub = _Stub(500)
    try:
        s = make_stack(2, urls=None, policy=RoundRobinPolicy(), cooloff=60.0)
        s.proxy.links["e1"].set_url(stub.url)  # e1's events are real; its HTTP answers 500
        with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
            for _ in range(6):
                r = c.post("/v1/completions", json={"model": "m", "prompt": "p " * 20,
                                                    "max_tokens": 2})
                assert r.status_code == 200, r.text
                assert r.headers["x-kvwire-engine"] == "e0"
        assert stub.hits == 1  # tried once, then down for the cool-off
        assert s.proxy.retries_total() == 1
        assert s.proxy.links["e1"].breaker.opened == 1
        assert s.loads() == {}
    finally:
        stub.close()


def _scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """/metrics as {(sample name, labels): value}, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return {(smp.name, frozenset(smp.labels.items())): smp.value
            for fam in text_string_to_metric_families(text) for smp in fam.samples}


def test_metrics_count_requests_retries_and_latencies(
        make_stack: Callable[..., Stack]) -> None:
    """/metrics after real requests (streamed and not, one retried off a 500 stub, one
    bad): requests by engine and status, retries by engine and reason, the overhead,
    tokenize, TTFT and end-to-end histograms' counts, and in-flight back to 0 (1 while a
    stream is open). /engines shows the same counters."""
    stub = _Stub(500)
    try:
        # (a model clock at 0.2x: a 200-token stream lasts ~2 s, so the mid-stream scrape
        # lands inside it also on a busy host; at 1x it lasted ~0.4 s and once did not)
        s = make_stack(2, engine_kw={"speed": 0.2}, policy=RoundRobinPolicy(), cooloff=60.0)
        s.proxy.links["e1"].set_url(stub.url)  # e1's events are real; its HTTP answers 500

        def m(name: str, **labels: str) -> float:
            return _scrape(s.url).get((name, frozenset(labels.items())), 0.0)

        with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
            for body in ({"model": "m", "prompt": "metrics " * 20, "max_tokens": 2},
                         {"model": "m", "prompt": list(range(1, 40)), "max_tokens": 2},
                         _chat("metrics chat " * 20, "q")):
                r = c.post("/v1/chat/completions" if "messages" in body else
                           "/v1/completions", json=body)
                assert r.status_code == 200 and r.headers["x-kvwire-engine"] == "e0", r.text
            assert stub.hits == 1  # one of them was retried off e1
            for body in ({"model": "m", "prompt": "streamed " * 20, "max_tokens": 200,
                          "ignore_eos": True, "stream": True},
                         _chat("streamed chat " * 20, "q", stream=True, max_tokens=200,
                               ignore_eos=True)):
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                with c.stream("POST", path, json=body) as r:
                    chunks = r.iter_raw()
                    assert next(chunks).startswith(b"data: {") and r.status_code == 200
                    assert m("kvwire_proxy_in_flight", engine="e0") == 1.0  # mid-stream
                    rest = b"".join(chunks)
                assert rest.endswith(b"data: [DONE]\n\n")
            r = c.post("/v1/completions", content=b"{not json",
                       headers={"content-type": "application/json"})
            assert r.status_code == 400
        wait_for(lambda: m("kvwire_proxy_in_flight", engine="e0") == 0.0,
                 "the last request's accounting done")
        got = _scrape(s.url)

        def g(name: str, **labels: str) -> float:
            return got.get((name, frozenset(labels.items())), 0.0)

        assert g("kvwire_proxy_requests_total", engine="e0", status="200") == 5
        assert g("kvwire_proxy_requests_total", engine="none", status="400") == 1
        assert sum(v for (n, _), v in got.items() if n == "kvwire_proxy_requests_total") == 6
        assert g("kvwire_proxy_retries_total", engine="e1", reason="server_error") == 1
        assert g("kvwire_proxy_in_flight", engine="e1") == 0.0
        assert ("kvwire_proxy_in_flight", frozenset({("engine", "e1")})) in got
        assert g("kvwire_proxy_overhead_seconds_count") == 5  # first attempts only
        assert 0 < g("kvwire_proxy_overhead_seconds_sum") < g("kvwire_proxy_e2e_seconds_sum",
                                                               engine="e0")
        assert ("kvwire_proxy_overhead_seconds_bucket", frozenset({("le", "0.0001")})) in got
        assert g("kvwire_proxy_tokenize_seconds_count") == 4  # not the token-id prompt
        assert g("kvwire_proxy_ttft_seconds_count", engine="e0") == 2  # the streams
        assert g("kvwire_proxy_e2e_seconds_count", engine="e0") == 5
        assert g("kvwire_proxy_ttft_seconds_count", engine="e1") == 0
        http = {n: e["http"] for n, e in httpx.get(s.url + "/engines").json().items()}
        assert http["e0"]["requests"] == {"200": 5} and http["e0"]["in_flight"] == 0
        assert http["e1"]["retries"] == {"server_error": 1} and http["e1"]["requests"] == {}
        assert s.proxy.status()["counts"]["retries"] == 1
        assert s.loads() == {}
    finally:
        stub.close()


class _Health(_LoopbackServer):
    """An engine's ``/health`` only: answers ``status`` after ``delay`` seconds (both may be
    changed while it runs), counting the probes and how many wait at once."""

    def __init__(self, delay: float = 0.0, status: int = 200) -> None:
        stub = self
        self.delay, self.status = delay, status
        self.release = threading.Event()
        self.probes = self.waiting = self.most_waiting = 0
        lock = threading.Lock()

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with lock:
                    stub.probes += 1
                    stub.waiting += 1
                    stub.most_waiting = max(stub.most_waiting, stub.waiting)
                stub.release.wait(stub.delay)
                with lock:
                    stub.waiting -= 1
                body = b'{"object":"list","data":[{"id":"m","parent":null}]}'
                self.send_response(stub.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:  # the prober gave up on it
                    pass

            def log_message(self, *a: Any) -> None:
                pass

        self._serve(H)


def _probed_proxy(urls: dict[str, str], **cfg: Any) -> tuple[RouterCore, Proxy]:
    core = RouterCore([EngineSpec(n, f"tcp://127.0.0.1:{i + 1}", url=u)
                       for i, (n, u) in enumerate(urls.items())])
    proxy = Proxy(core, load_tokenizer(None), config=ProxyConfig(probe_interval=0.1, **cfg))
    proxy.start()
    assert proxy.wait_probed(TIMEOUT)
    return core, proxy


def test_a_slow_health_answer_is_no_failure_and_one_past_the_timeout_is() -> None:
    """A loaded engine answers /health in 1.5 s, with probes every 0.1 s and 2.5 s allowed:
    it stays up, probed once at a time (until 2026-11-30 a probe timed out after
    max(interval, 0.5 s) and marked it down). Past the timeout, a probe fails."""
    slow = _Health(delay=1.5)
    core, proxy = _probed_proxy({"s": slow.url}, probe_timeout=2.5)
    try:
        link = proxy.links["s"]
        wait_for(lambda: slow.probes >= 3, timeout=TIMEOUT, interval=0.05,
                 what="three probes of s")
        assert link.http_up and link.breaker.up and proxy.counts["probe_failures"] == 0
        assert slow.most_waiting == 1 and link.model_ids == frozenset({"m"})
        slow.delay = 4.0
        wait_for(lambda: not link.http_up, timeout=TIMEOUT, interval=0.05, what="s down")
        assert proxy.counts["probe_failures"] >= 1
    finally:
        slow.release.set()  # (the probe under way ends now)
        proxy.close()
        core.close()
        slow.close()


def test_an_engine_whose_health_hangs_delays_no_other_engines_probe() -> None:
    """Engine h's /health starts hanging (30 s allowed); engine f's then turns 500, and f is
    down while h's probe still waits: engines are probed side by side, each once at a time
    (one after another, f waited behind h)."""
    hung, fast = _Health(), _Health()
    core, proxy = _probed_proxy({"h": hung.url, "f": fast.url}, probe_timeout=30.0)
    try:
        h, f = proxy.links["h"], proxy.links["f"]
        assert h.http_up and f.http_up
        hung.delay = 30.0
        wait_for(lambda: hung.waiting == 1, timeout=TIMEOUT, interval=0.01,
                 what="a probe of h hanging")
        fast.status = 500
        wait_for(lambda: not f.http_up, timeout=10.0, interval=0.01, what="f down")
        assert hung.waiting == 1 and hung.most_waiting == 1 and h.http_up
    finally:
        hung.release.set()
        proxy.close()
        core.close()
        hung.close()
        fast.close()


def _threads_of(run: Callable[[], None], before: set[threading.Thread]) -> list[str]:
    """The names of the threads started since ``before`` that are still running when
    ``run()`` returns (a stub engine's per-request threads left out)."""
    run()
    return sorted(t.name for t in threading.enumerate()
                  if t not in before and not t.name.endswith("(process_request_thread)"))


def test_kvwire_serve_probes_on_its_serving_loop() -> None:
    """``kvwire serve``'s service (:func:`kvwire.serve.build.build`, which the command line
    runs) probes its engines on the one event loop that serves HTTP: a proxy adds no thread
    to a service without one (no probe thread), and its probes still mark an engine down
    and up again (seen in ``/engines``)."""
    from kvwire.serve.build import ServeConfig, build

    h = _Health()
    cfg = ProxyConfig(probe_interval=0.1, cooloff=0.1)
    before = set(threading.enumerate())
    plain = build(ServeConfig(engines=[EngineSpec("h", "tcp://127.0.0.1:9")], port=0))
    try:
        without = _threads_of(plain.start, before)
    finally:
        plain.close()
    wait_for(lambda: set(threading.enumerate()) <= before | {
        t for t in threading.enumerate() if t.name.endswith("(process_request_thread)")},
             "the first service's threads gone")
    svc = build(ServeConfig(engines=[EngineSpec("h", "tcp://127.0.0.1:9", url=h.url)],
                            port=0, tokenizer="builtin", proxy=cfg))
    try:
        def serving() -> None:
            svc.start()
            assert svc.proxy is not None and svc.proxy.wait_probed(TIMEOUT)

        assert _threads_of(serving, before) == without
        c = httpx.Client(base_url=svc.url, timeout=TIMEOUT)

        def http_up() -> bool:
            return c.get("/engines").json()["h"]["http"]["http_up"]

        assert http_up()
        h.status = 500
        wait_for(lambda: not http_up(), "h down after a failed probe")
        h.status = 200
        wait_for(http_up, "h up again after a good probe")
        c.close()
    finally:
        svc.close()
        h.close()


def test_dp_rank_goes_in_vllms_header(make_stack: Callable[..., Stack]) -> None:
    """An engine with ranks=2: the chosen rank reaches the engine as X-data-parallel-rank
    (vLLM's header) and the client as x-kvwire-rank. (The recording stub answers.)"""
    stub = _Stub(200)
    eng = _engine(dp_size=2)
    try:
        core = RouterCore([EngineSpec("e0", eng.events[0], ranks=2, url=stub.url)],
                          policy=RoutingPolicy(seed=3))
        core.start()
        proxy = Proxy(core, load_tokenizer(None), config=ProxyConfig(probe_interval=0.1))
        proxy.start()
        server, thread, port = serve_in_thread(core, proxy=proxy)
        try:
            seen = set()
            for i in range(12):
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=TIMEOUT,
                               json={"prompt": f"rank {i} " * 20})
                rank = r.headers["x-kvwire-rank"]
                sent = [h for h in stub.headers if h[":path"] == "/v1/completions"][-1]
                assert sent["x-data-parallel-rank"] == rank
                seen.add(rank)
            assert seen == {"0", "1"}
        finally:
            server.should_exit = True
            thread.join(TIMEOUT)
            proxy.close()
            core.close()
    finally:
        stub.close()
        eng.close()


def test_5xx_passes_through_when_retries_are_used_up(
        make_stack: Callable[..., Stack]) -> None:
    stub = _Stub(503)
    try:
        s = make_stack(1, retries=0)
        s.proxy.links["e0"].set_url(stub.url)
        r = httpx.post(s.url + "/v1/completions",
                       json={"model": "m", "prompt": "p", "max_tokens": 2},
                       headers={"authorization": "Bearer sk-test", "x-request-id": "abc-1"},
                       timeout=TIMEOUT)
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "engine broke"
        assert s.proxy.requests == {("e0", 503): 1}  # /metrics: the engine's own status
        sent = [h for h in stub.headers if "x-request-id" in h][0]
        assert sent["authorization"] == "Bearer sk-test" and sent["x-request-id"] == "abc-1"
        assert s.loads() == {}
    finally:
        stub.close()


def test_stalled_stream_ends_with_an_error_event(make_stack: Callable[..., Stack]) -> None:
    """An engine that goes silent mid-stream: after the stall timeout the client gets an SSE
    error event and [DONE], and the load is released."""
    stub = _Stub(hang=True)
    try:
        s = make_stack(1, stall_timeout=0.5)
        s.proxy.links["e0"].set_url(stub.url)
        t0 = time.monotonic()
        with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c, c.stream(
                "POST", "/v1/completions", json={"prompt": "p", "stream": True}) as r:
            body = r.read()
        assert 0.5 <= time.monotonic() - t0 < TIMEOUT
        assert body.startswith(b'data: {"choices"'), body
        assert b"sent nothing for 0.5 s" in body and body.endswith(b"data: [DONE]\n\n")
        assert s.loads() == {} and s.proxy.counts["broken_streams"] == 1
    finally:
        stub.close()


class _Firehose:
    """An engine that streams a huge answer as fast as its socket takes it, counting the
    bytes the kernel accepted: what a proxy without backpressure would read into memory."""

    CHUNK = b"data: " + b"x" * 65530 + b"\n\n"
    TOTAL = 256 << 20

    def __init__(self) -> None:
        fh = self
        self.sent = 0
        self.aborted = threading.Event()

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                if not self.path.startswith("/v1/c"):
                    body = (b'{"object":"list","data":[{"id":"m","parent":null}]}'
                            if self.path == "/v1/models" else b"")
                    self.send_response(200)
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                frame = b"%x\r\n%s\r\n" % (len(fh.CHUNK), fh.CHUNK)
                try:
                    while fh.sent < fh.TOTAL:
                        self.wfile.write(frame)  # blocks while the proxy does not read
                        fh.sent += len(frame)
                except OSError:
                    fh.aborted.set()
                self.close_connection = True

            do_GET = do_POST = _answer

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_slow_client_pushes_back_on_the_engine(make_stack: Callable[..., Stack]) -> None:
    """A client that stops reading a stream: the proxy stops reading the engine (its
    connection paused while the client's socket buffer is full), so what the engine could
    send stays bounded by the socket buffers instead of piling up in the proxy's memory;
    the client leaving then aborts the engine's answer and releases the load."""
    fh = _Firehose()
    try:
        s = make_stack(1)
        s.proxy.links["e0"].set_url(fh.url)
        port = int(s.url.rsplit(":", 1)[1])
        import socket

        c = socket.create_connection(("127.0.0.1", port))
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        body = json.dumps({"prompt": "p", "stream": True}).encode()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                  b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        assert c.recv(1 << 16).startswith(b"HTTP/1.1 200")  # then it reads no more
        last, still = -1, 0
        while still < 20:  # the engine's progress holds still for 1 s
            time.sleep(0.05)
            still = still + 1 if fh.sent == last else 0
            last = fh.sent
            assert fh.sent < fh.TOTAL, "the proxy read the whole answer into memory"
        assert fh.sent < 64 << 20, fh.sent
        assert s.loads() != {}  # still streaming
        c.close()
        assert fh.aborted.wait(TIMEOUT), "the engine's answer was not aborted"
        wait_for(lambda: s.loads() == {}, "load released")
        assert s.proxy.counts["client_disconnects"] == 1
    finally:
        fh.close()


def test_hung_engine_times_out_is_retried_and_marked_down(
        make_stack: Callable[..., Stack]) -> None:
    """An engine that hangs between probes (its loop stopped, connections left open): no
    first byte in time, so its request goes to the next-best engine and it is marked down.
    (Refused connections: the SIGKILL test with processes.)"""
    s = make_stack(2, probe_interval=3600.0, cooloff=3600.0, first_byte_timeout=0.5)
    body = _chat("dying " * 100, "q")
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        home = c.post("/v1/chat/completions", json=body).headers["x-kvwire-engine"]
        other = "e1" if home == "e0" else "e0"
        s.engines[int(home[1])].close()  # connection refused from now on
        for _ in range(3):
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvwire-engine"] == other
    assert s.proxy.retries_total() == 1
    assert not s.proxy.links[home].breaker.up
    assert s.loads() == {}


def test_health_needs_http_and_events(make_stack: Callable[..., Stack]) -> None:
    """/health is 200 only while an engine is live on both its /health and its events."""
    stub_port_dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    s = make_stack(1)
    wait_for(lambda: httpx.get(s.url + "/health").status_code == 200, "healthy")
    s.proxy.links["e0"].set_url(stub_port_dead)  # events still live, HTTP gone
    wait_for(lambda: not s.proxy.links["e0"].http_up, "the probe failing")
    r = httpx.get(s.url + "/health")
    assert s.core.alive["e0/dp0"]  # the event stream is live all along
    assert r.status_code == 503 and "HTTP /health" in r.json()["detail"], r.text


def test_bad_input_gets_openai_errors(make_stack: Callable[..., Stack]) -> None:
    s = make_stack(1, max_body=1 << 16)
    cases = [
        ("/v1/completions", b"{not json", 400, "body"),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/chat/completions", json.dumps({"model": "m"}).encode(), 400, "messages"),
        ("/v1/completions", json.dumps({"model": "m"}).encode(), 400, "prompt"),
        ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), 400, "messages"),
        ("/v1/completions", json.dumps({"prompt": "x", "stream": "yes"}).encode(), 400,
         "stream"),
        ("/v1/completions", json.dumps({"prompt": [1, "a"]}).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": [1, -1]}).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": [1, True]}).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": [1, 2.0]}).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": [[1, 2], [-3]]}).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": [[1, -2]]}).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": []}).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": {}}).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": "x" * 70000}).encode(), 413, "body"),
        ("/v1/completions", json.dumps({"model": "nope", "prompt": "x"}).encode(), 404,
         "model"),
        # the engine's own refusal passes through with its status
        ("/v1/completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": 0}
                                       ).encode(), 400, "max_tokens"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": 3}]}).encode(), 400,
         "messages"),
    ]
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        for path, body, status, param in cases:
            r = c.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, (body[:60], r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
            assert err["param"] == param, (body[:60], err)
        for ids in ([1, -1], [1, True], [1, 2.0], [[1, -2]], [1, 1 << 32]):  # refused here,
            r = c.post("/v1/completions", json={"prompt": ids})  # not by the engine
            assert r.status_code == 400, r.text
            assert "x-kvwire-engine" not in r.headers
            assert "token ids must be integers from 0 to 2^32 - 1" in \
                r.json()["error"]["message"], r.text
        assert c.get("/v1/completions").status_code == 405
    assert s.loads() == {}


def test_models_are_the_union() -> None:
    """Two real engines serving different models (the second without adapters): /v1/models
    is the union of what their /v1/models say, and each model is accepted. (The list is set
    by the engines, not by hand: the proxy's probe refreshes it from them.)"""
    es = [_engine(), _engine(model="other", loras=[])]
    s = Stack(es)
    try:
        ids = {m["id"]: m["parent"] for m in httpx.get(s.url + "/v1/models").json()["data"]}
        assert ids == {"m": None, "ad1": "m", "ad2": "m", "other": None}
        for model in ("other", "ad2"):
            r = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT,
                           json={"model": model, "prompt": "once upon", "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        s.close()
        for e in es:
            e.close()


def test_openai_client_works_unchanged(make_stack: Callable[..., Stack]) -> None:
    s = make_stack(2)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="sk-x", max_retries=0)
    assert {m.id for m in client.models.list()} == {"m", "ad1", "ad2"}
    out = client.chat.completions.create(model="m", max_tokens=5,
                                         messages=[{"role": "user", "content": "hello"}])
    assert out.choices[0].message.content and out.usage.completion_tokens == 5
    text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="ad1", max_tokens=5, stream=True,
        messages=[{"role": "user", "content": "hello"}]) if ch.choices)
    assert text
    comp = client.completions.create(model="m", prompt="once upon", max_tokens=3)
    assert comp.usage.completion_tokens == 3
    parts = list(client.completions.create(model="m", prompt="once upon", max_tokens=3,
                                           stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-nope", prompt="x", max_tokens=1)
    assert s.loads() == {}


class _Responses(_LoopbackServer):
    """A loopback server standing in for an engine's ``POST /v1/responses`` (a kvwire engine
    does not serve it): a streamed answer that sends one event, waits for ``release``, then
    sends the rest, so the test sees the first event reach the client before the end."""

    def __init__(self) -> None:
        stub = self
        self.release = threading.Event()
        self.bodies: list[dict] = []

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _json(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._json(200, b'{"object":"list","data":[{"id":"m","parent":null}]}'
                           if self.path == "/v1/models" else b"{}")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                stub.bodies.append(body)
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                for i, ev in enumerate((b"response.created", b"response.output_text.delta",
                                        b"response.completed")):
                    data = b'event: %s\ndata: {"type": "%s"}\n\n' % (ev, ev)
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                    if i == 0:
                        stub.release.wait(TIMEOUT)
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

            def log_message(self, *a: Any) -> None:
                pass

        self._serve(H)


def test_other_vllm_endpoints_pass_through_by_load(make_stack: Callable[..., Stack]) -> None:
    """/tokenize, /detokenize, /v1/embeddings and /v1/responses reach an engine unchanged,
    routed by load (round robin here: both engines answer), with vLLM's answers and
    statuses; the proxy judges only the JSON and the model."""
    s = make_stack(2, policy=RoundRobinPolicy())
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        direct = httpx.post(s.engines[0].url + "/tokenize",
                            json={"model": "m", "prompt": "hello there"}, timeout=TIMEOUT)
        assert direct.status_code == 200
        seen = set()
        for _ in range(2):
            r = c.post("/tokenize", json={"model": "m", "prompt": "hello there"})
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == direct.json()["tokens"]
            seen.add(r.headers["x-kvwire-engine"])
        assert seen == {"e0", "e1"}
        r = c.post("/detokenize", json={"model": "m", "tokens": direct.json()["tokens"]})
        assert r.status_code == 200 and r.json()["prompt"] == "hello there", r.text
        # an engine that does not serve the endpoint: its own answer, with its status
        r = c.post("/v1/embeddings", json={"model": "m", "input": "x"})
        assert r.status_code == 404 and "x-kvwire-engine" in r.headers, r.text
        # what the proxy itself refuses, in OpenAI's error object
        for body, status, param in ((b"{not json", 400, "body"), (b"[1]", 400, None),
                                    (b'{"model": 3}', 400, "model"),
                                    (b'{"model": "nope"}', 404, "model")):
            r = c.post("/tokenize", content=body,
                       headers={"content-type": "application/json"})
            assert r.status_code == status and "x-kvwire-engine" not in r.headers, r.text
            assert r.json()["error"]["param"] == param
    assert s.loads() == {}
    assert all(s.proxy.in_flight[n] == 0 for n in ("e0", "e1"))

    stub = _Responses()
    try:  # a streamed /v1/responses, relayed as it comes
        for name in ("e0", "e1"):
            s.proxy.links[name].set_url(stub.url)
        body = {"model": "m", "input": "hi", "stream": True}
        with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c, \
                c.stream("POST", "/v1/responses", json=body,
                         headers={"authorization": "Bearer sk-x"}) as r:
            assert r.status_code == 200 and r.headers["x-kvwire-engine"] in ("e0", "e1")
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert "response.created" in first and not stub.release.is_set()
            stub.release.set()  # the rest only now: the first event was not held back
            rest = [line for line in lines if line.startswith("data:")]
        assert [json.loads(x[5:])["type"] for x in rest] == ["response.output_text.delta",
                                                              "response.completed"]
        assert stub.bodies == [body]
        wait_for(lambda: s.loads() == {}, "the streamed pass-through's load released")
    finally:
        stub.close()


# ---------------------------------------------------------------------------- processes


class EngineProc:
    """A real ``kvwire engine`` process on fixed loopback ports (so it can be restarted on
    the same ones)."""

    def __init__(self, *flags: str) -> None:
        from engine_helpers import free_ports

        self.port, self.ev = free_ports(2)
        self.flags = flags
        self.url = f"http://127.0.0.1:{self.port}"
        self.events = f"tcp://127.0.0.1:{self.ev}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [str(ROOT / ".venv/bin/kvwire"), "engine", "--port", str(self.port), "--events",
             f"tcp://*:{self.ev}", "--model", "m", "--lora", "ad1", *self.flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_ready(self) -> None:
        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, "engine exited"
            try:
                return httpx.get(self.url + "/health", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(up, f"engine on {self.port}", timeout=30.0)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(TIMEOUT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def engine_procs() -> Iterator[Callable[..., list[EngineProc]]]:
    made: list[EngineProc] = []

    def make(n: int, *flags: str) -> list[EngineProc]:
        es = [EngineProc(*flags) for _ in range(n)]
        made.extend(es)
        for e in es:
            e.wait_ready()
        return es

    yield make
    for e in made:
        e.stop()


_TEMPLATE = ("{% for m in messages %}### {{ m.role }}: {{ m.content }}\n{% endfor %}"
             "{% if add_generation_prompt %}### assistant:{% endif %}")


def test_chat_template_flags_reach_the_engine_and_the_proxy(
        tmp_path: Path, engine_procs: Callable[..., list[EngineProc]]) -> None:
    """Real processes: ``kvwire engine --chat-template F`` renders with F (its /tokenize),
    and ``kvwire serve --tokenizer builtin --chat-template F`` routes a repeated chat with
    that engine's prefix (the prefix hit ratio it records); without the flag the proxy's
    ids are another template's, and it finds nothing."""
    tpl = tmp_path / "given.jinja"
    tpl.write_text(_TEMPLATE, encoding="utf-8")
    [e] = engine_procs(1, "--chat-template", str(tpl))
    given = load_tokenizer(None, chat_template=str(tpl))
    chats = [{"model": "m", "max_tokens": 2, "messages": [
        {"role": "system", "content": f"rules of house {n} " * 300},
        {"role": "user", "content": "hi"}]} for n in (1, 2)]
    want = given.encode_engine_chat(chats[0]["messages"])
    assert want != load_tokenizer(None).encode_engine_chat(chats[0]["messages"])
    r = httpx.post(e.url + "/tokenize", json={"model": "m", "messages": chats[0]["messages"]},
                   timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["tokens"] == want, r.text
    # a chat the engine has not seen for each proxy (it joins live: no earlier blocks)
    assert _repeat_hit_ratio(e, chats[0], len(want)) == 0.0
    size = len(given.encode_engine_chat(chats[1]["messages"]))
    assert _repeat_hit_ratio(e, chats[1], size, "--chat-template", str(tpl)) > 0.9


def _repeat_hit_ratio(e: EngineProc, chat: dict[str, Any], size: int, *flags: str) -> float:
    """A real ``kvwire serve --tokenizer builtin *flags`` in front of ``e``: ``chat`` (new
    to the engine) sent twice, the second time once the index holds the blocks the
    engine stored for it (``size`` tokens' worth, whatever ids the proxy made); the sum
    of the prefix hit ratios the proxy recorded."""
    from engine_helpers import free_ports

    [port] = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [str(ROOT / ".venv/bin/kvwire"), "serve", "--port", str(port), "--engine",
         f"e0={e.events},url={e.url}", "--tokenizer", "builtin", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def up() -> bool:
        assert proc.poll() is None, "kvwire serve exited"
        try:
            return httpx.get(url + "/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def indexed() -> bool:  # the index holds at least as many blocks as the chat has
        row = httpx.get(url + "/engines", timeout=TIMEOUT).json()["e0"]["ranks"][0]
        return bool(row["block_size"]) and sum(row["blocks"].values()) >= size // row[
            "block_size"]

    try:
        wait_for(up, "kvwire serve up")
        assert httpx.post(url + "/v1/chat/completions", json=chat,
                          timeout=TIMEOUT).status_code == 200
        wait_for(indexed, "the engine's blocks in the index")
        assert httpx.post(url + "/v1/chat/completions", json=chat,
                          timeout=TIMEOUT).status_code == 200
        m = re.search(r"^kvwire_router_prefix_hit_ratio_sum(?:\{[^}]*\})? (\S+)$",
                      httpx.get(url + "/metrics", timeout=TIMEOUT).text, re.M)
        assert m, "no prefix hit ratio in /metrics"
        return float(m.group(1))
    finally:
        proc.terminate()
        proc.wait(TIMEOUT)


class _Proc:
    """Stands in for EngineThread in a Stack: a process's URL and event endpoint."""

    def __init__(self, e: EngineProc) -> None:
        self.url, self.events = e.url, [e.events]


async def _lean_request(port: int, conn: list, body: bytes, drop: bool) -> int:
    """One HTTP/1.1 request on a kept-alive connection (a lean client: the load generator
    must not be the bottleneck); ``drop`` closes the connection after the first chunk."""
    if conn[0] is None:
        conn[0] = await asyncio.open_connection("127.0.0.1", port)
    reader, writer = conn[0]
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
                 b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    m = re.search(rb"content-length: *(\d+)", head, re.I)
    if m:
        await reader.readexactly(int(m.group(1)))
        return status
    while True:  # chunked
        size = int((await reader.readline()).strip(), 16)
        if size == 0:
            await reader.readline()
            return status
        await reader.readexactly(size + 2)
        if drop:
            writer.close()
            conn[0] = None
            return status


def test_no_reservation_outlives_its_request(engine_procs: Callable[..., list[EngineProc]]
                                             ) -> None:
    """10,000 requests, with streams, client disconnects mid-stream, engine 500s (retried),
    engine 400s and bad bodies mixed in: every engine's load ends at 0."""
    stub = _Stub(500)
    procs = engine_procs(2, "--speed", "10")
    s = Stack([_Proc(p) for p in procs] + [_Proc(procs[0])],
              urls=[procs[0].url, procs[1].url, stub.url], probe_interval=0.05, cooloff=0.05)
    try:
        port = int(s.url.rsplit(":", 1)[1])
        statuses: dict[int, int] = {}
        kinds = ["ok"] * 6 + ["stream", "disconnect", "engine_400", "bad"]
        n = 10_000

        def body(i: int) -> tuple[bytes, bool]:
            kind = kinds[i % len(kinds)]
            if kind == "bad":
                return b'{"prompt": [', False
            b: dict[str, Any] = {"model": "m", "prompt": f"{i % 50} " * 40, "max_tokens": 2}
            if kind == "engine_400":
                b["max_tokens"] = 0
            if kind == "stream":
                b["stream"] = True
            if kind == "disconnect":
                b.update(stream=True, max_tokens=1000, ignore_eos=True)
            return json.dumps(b).encode(), kind == "disconnect"

        async def worker(k: int) -> None:
            conn: list = [None]
            for i in range(k, n, 32):
                data, drop = body(i)
                st = await _lean_request(port, conn, data, drop)
                statuses[st] = statuses.get(st, 0) + 1
            if conn[0] is not None:
                conn[0][1].close()

        async def run() -> None:
            await asyncio.gather(*(worker(k) for k in range(32)))

        asyncio.run(run())
        assert statuses == {200: 8000, 400: 2000}, statuses
        assert stub.hits > 0 and s.proxy.retries_total() > 0  # errors were mixed in
        assert s.proxy.counts["client_disconnects"] > 0
        wait_for(lambda: s.loads() == {}, "every engine's load back to 0")
        assert len(s.core.loads) == 0 and s.core.loads.expired == 0
        wait_for(lambda: s.proxy.active == 0, "no request counted as active")
    finally:
        s.close()
        stub.close()


@pytest.fixture
def serve_proc() -> Iterator[Callable[..., tuple[subprocess.Popen, str]]]:
    procs: list[subprocess.Popen] = []

    def start(*args: str, env: dict[str, str] | None = None
              ) -> tuple[subprocess.Popen, str]:
        from test_serve import _stderr_line

        p = subprocess.Popen([str(ROOT / ".venv/bin/kvwire"), "serve", "--port", "0", *args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env=None if env is None else {**os.environ, **env})
        procs.append(p)
        p.said = []  # type: ignore[attr-defined]
        while True:
            line = _stderr_line(p, ".")
            p.said.append(line)  # type: ignore[attr-defined]
            m = re.search(r"(http://\S+)/", line)
            if m and "streams;" in line:
                return p, m.group(1)

    yield start
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(TIMEOUT)
        if p.stderr:
            p.stderr.close()


def _engine_args(procs: list[EngineProc]) -> list[str]:
    out = []
    for i, p in enumerate(procs):
        out += ["--engine", f"e{i}={p.events},url={p.url}"]
    return out


def test_sigkilled_engine_gets_no_traffic_and_a_restarted_one_is_used_again(
        engine_procs: Callable[..., list[EngineProc]],
        serve_proc: Callable[..., tuple[subprocess.Popen, str]]) -> None:
    """Real processes: `kvwire serve` in front of two `kvwire engine`s. A SIGKILLed engine's
    in-flight stream ends with an SSE error event and [DONE]; later requests all go to the
    other one (refused connections are retried, then the breaker keeps it out); once
    restarted on the same ports it is probed back and used again."""
    procs = engine_procs(2, "--speed", "1")
    _, url = serve_proc(*_engine_args(procs), "--tokenizer", "builtin", "--cooloff", "0.5",
                        "--probe-interval", "0.1", "--dead-after", "1")
    c = httpx.Client(base_url=url, timeout=TIMEOUT)
    try:
        wait_for(lambda: c.get("/health").status_code == 200, "router healthy")
        long = {"model": "m", "prompt": "in flight " * 30, "max_tokens": 3000,
                "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=long) as r:
            chunks = r.iter_raw()
            assert next(chunks).startswith(b"data: {")
            victim = r.headers["x-kvwire-engine"]
            procs[int(victim[1])].kill()
            rest = b"".join(chunks)
        assert b'"error"' in rest and rest.endswith(b"data: [DONE]\n\n"), rest[-300:]
        other = "e1" if victim == "e0" else "e0"
        for k in range(12):
            r2 = c.post("/v1/chat/completions", json=_chat(f"after {k} " * 30, "q"))
            assert r2.status_code == 200, r2.text
            assert r2.headers["x-kvwire-engine"] == other
        procs[int(victim[1])].start()
        procs[int(victim[1])].wait_ready()

        def used_again() -> bool:
            got = {c.post("/v1/chat/completions", json=_chat(f"back {time.monotonic()} " * 30,
                                                             "q")).headers["x-kvwire-engine"]
                   for _ in range(4)}
            return victim in got
        wait_for(used_again, "the restarted engine used again")
        assert c.get("/health").status_code == 200
    finally:
        c.close()


def test_serve_cli_flags(engine_procs: Callable[..., list[EngineProc]],
                         serve_proc: Callable[..., tuple[subprocess.Popen, str]],
                         tmp_path: Path) -> None:
    """`kvwire serve` proxies with --policy and --tokenizer DIR; bad values are exit 2 with
    one line; without a tokenizer it says once that it routes by load only."""
    from kvwire.cli.serve import main

    procs = engine_procs(1)
    args = ["--port", "0", *_engine_args(procs)]
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--policy", "fastest"])
    assert exit_.value.code == 2
    for bad in (["--response-ids", "-1"], ["--max-in-flight", "-1"],
                ["--shutdown-timeout", "-1"], ["--shutdown-timeout", "nan"]):
        with pytest.raises(SystemExit) as exit_:
            main([*args, *bad])
        assert exit_.value.code == 2, bad
    import argparse

    from kvwire.cli.serve import add_arguments, proxy_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = proxy_config(parser.parse_args([*args, "--response-ids", "7", "--retries", "1",
                                          "--max-in-flight", "9"]))
    assert (cfg.response_ids, cfg.retries, cfg.max_in_flight) == (7, 1, 9)
    assert main([*args, "--tokenizer", "/nonexistent"]) == 2
    import lzma
    import shutil

    qwen = tmp_path / "qwen3"
    qwen.mkdir()
    src = ROOT / "tests/data/tokenize/qwen3"
    shutil.copy(src / "tokenizer_config.json", qwen)
    (qwen / "tokenizer.json").write_bytes(lzma.decompress((src / "tokenizer.json.xz"
                                                           ).read_bytes()))
    p, url = serve_proc(*_engine_args(procs), "--policy", "least_load", "--tokenizer",
                        str(qwen))
    r = httpx.post(url + "/v1/chat/completions", json=_chat("sys", "hi"), timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["x-kvwire-engine"] == "e0", r.text
    assert not any("load only" in line for line in p.said)  # type: ignore[attr-defined]
    p2, _ = serve_proc(*_engine_args(procs))
    said = [line for line in p2.said if "load only" in line]  # type: ignore[attr-defined]
    assert len(said) == 1 and "no --tokenizer" in said[0], p2.said  # type: ignore[attr-defined]


def test_engine_url_option() -> None:
    e = EngineSpec.parse("e0=tcp://127.0.0.1:5557,url=http://127.0.0.1:8000/,ranks=2")
    assert e.url == "http://127.0.0.1:8000" and e.ranks == 2
    assert EngineSpec.parse("e0=tcp://127.0.0.1:5557").url is None
    for bad in ("ftp://x:1", "http://x", "http://x:1/v1", "http://u:p@x:1", "http://x:99999"):
        with pytest.raises(ValueError, match="url"):
            EngineSpec.parse(f"e0=tcp://127.0.0.1:5557,url={bad}")


def test_tokenization_equals_transformers_on_the_corpus(tmp_path: Path) -> None:
    """The proxy's --tokenizer DIR ids (body decoded as the proxy decodes it) equal
    transformers' apply_chat_template(add_generation_prompt=...) for the corpus of
    tests/test_tokenize.py on Qwen3's real tokenizer.json and template, given the chat as
    vLLM gives it to apply_chat_template (its parser's output: tokenize/content.py, which
    tests/test_tokenize_content.py compares with vLLM's own)."""
    import lzma
    import shutil

    from engine_helpers import import_or_skip
    from test_tokenize import CORPUS, _ref_ids

    from kvwire.proxy.body import body_dec as _body_dec
    from kvwire.tokenize.content import as_engine_messages, as_engine_tools

    transformers = import_or_skip("transformers", "transformers")
    d = tmp_path / "qwen3"
    d.mkdir()
    src = ROOT / "tests/data/tokenize/qwen3"
    shutil.copy(src / "tokenizer_config.json", d)
    (d / "tokenizer.json").write_bytes(lzma.decompress((src / "tokenizer.json.xz"
                                                        ).read_bytes()))
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    core = RouterCore([EngineSpec("e0", "tcp://127.0.0.1:9", url="http://127.0.0.1:9")])
    tok = load_tokenizer(d)
    proxy = Proxy(core, tok)
    checked = 0

    async def ids(body: dict[str, Any], chat: bool) -> list[int]:
        return list(await proxy.tokens.prompt(_body_dec.decode(json.dumps(body).encode()), chat))

    for _name, messages, tools, agp, kwargs in CORPUS:
        try:
            want = _ref_ids(ref, as_engine_messages(messages, tok.content_format(tools)),
                            as_engine_tools(tools), agp, kwargs)
        except Exception:
            continue  # transformers cannot render it (test_tokenize checks kvwire raises)
        body: dict[str, Any] = {"model": "m", "messages": messages,
                                "add_generation_prompt": agp}
        if tools:
            body["tools"] = tools
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        assert asyncio.run(ids(body, True)) == want, _name
        checked += 1
    assert checked >= 8
    text = "Hello <|im_start|>wörld 🙂"
    assert asyncio.run(ids({"prompt": text}, False)) == ref.encode(text)
