"""``kvwire engine`` over real HTTP on loopback: the openai client, raw SSE, bad input,
/metrics, /tokenize, client disconnects, and KV events over real ZeroMQ that rebuild the
engine's cache exactly. The engine runs in a thread with its own event loop (the same
:class:`EngineApp` the CLI runs); tests/test_fleet.py runs it as processes."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import Counter
from typing import Any

import httpx
import msgspec
import openai
import pytest
import zmq

from kvwire.engine import EngineConfig, StepCost
from kvwire.engine.server.app import EngineApp, EngineOptions
from kvwire.tokenize import load_tokenizer
from kvwire.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

TIMEOUT = 20.0


class EngineThread:
    """An EngineApp serving on 127.0.0.1:<free port> from its own thread and loop."""

    def __init__(self, opts: EngineOptions, tokenizer: Any = None) -> None:
        self.app = EngineApp(opts, tokenizer or load_tokenizer(None))
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.error: BaseException | None = None

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self.app.start("127.0.0.1", 0))
            except BaseException as e:  # reported to the test below
                self.error = e
                started.set()
                return
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        assert started.wait(TIMEOUT)
        if self.error:
            raise self.error
        self.url = f"http://127.0.0.1:{self.app.port}"
        self.events = [ep.replace(ep.split("//")[1].rsplit(":", 1)[0], "127.0.0.1", 1)
                       for ep in self.app.event_endpoints]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.app.stop(timeout=1.0), self.loop).result(TIMEOUT)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics").text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


def _opts(**kw: Any) -> EngineOptions:
    cfg = kw.pop("config", EngineConfig(num_gpu_blocks=2000, block_size=16,
                                        cost=StepCost(base_s=2e-3, prefill_token_s=1e-6)))
    base = dict(model="m", loras=["ad1", "ad2"], config=cfg, max_model_len=4096, speed=1.0,
                events="tcp://*:0")
    base.update(kw)
    return EngineOptions(**base)


@pytest.fixture(scope="module")
def engine():
    e = EngineThread(_opts())
    yield e
    e.close()


def _until(cond, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_openai_client_completions_and_chat(engine):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0)
    prompt = "The cache keeps what the prompt shares. " * 20  # > 10 blocks
    a = client.completions.create(model="m", prompt=prompt, max_tokens=12,
                                  extra_body={"ignore_eos": True})
    assert a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 12
    assert a.usage.prompt_tokens > 160 and a.choices[0].text
    b = client.completions.create(model="m", prompt=prompt, max_tokens=12,
                                  extra_body={"ignore_eos": True})
    assert b.choices[0].text == a.choices[0].text  # deterministic
    # the second run finds the prompt's full blocks in the prefix cache, as vLLM reports it
    assert b.usage.prompt_tokens_details.cached_tokens == a.usage.prompt_tokens // 16 * 16
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    # without ignore_eos the answer may stop early, never past max_tokens
    c = client.completions.create(model="m", prompt="short", max_tokens=500)
    assert c.choices[0].finish_reason == "stop" and 1 <= c.usage.completion_tokens <= 500

    chat = client.chat.completions.create(
        model="ad1", messages=[{"role": "user", "content": "hello"}], max_tokens=5,
        extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5

    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=7, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 7 and not chunks[-1].choices
    assert text == chat.choices[0].message.content or text  # same prompt: same text
    full = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=7,
        extra_body={"ignore_eos": True})
    assert text == full.choices[0].message.content

    cs = list(client.completions.create(model="m", prompt=[[1, 2, 3] * 10, [4, 5] * 9], max_tokens=3,
                                        stream=True, extra_body={"ignore_eos": True}))
    assert {c.choices[0].index for c in cs if c.choices} == {0, 1}


def test_raw_sse_done_and_usage(engine):
    body = {"model": "m", "prompt": list(range(100, 140)), "max_tokens": 4, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    objs = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["prompt_tokens"] == 40
    assert "".join(o["choices"][0]["text"] for o in objs[:-1]) != ""


def test_models_lists_loras_with_parent(engine):
    data = httpx.get(engine.url + "/v1/models").json()["data"]
    assert [(d["id"], d["parent"]) for d in data] == [("m", None), ("ad1", "m"), ("ad2", "m")]
    assert httpx.get(engine.url + "/health").status_code == 200


BAD = [
    ("/v1/completions", b'{"prompt": "x",', 400, "body"),
    ("/v1/completions", b'[1, 2]', 400, None),
    ("/v1/completions", b'{"prompt": "x", "model": "nope"}', 404, "model"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -3}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "ten"}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": 7}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [1, "a"]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [-1, 2]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [99999999999999999999]}', 400, None),
    ("/v1/completions", b'{"prompt": "x", "stream_options": {"include_usage": true}}', 400,
     "stream_options"),
    ("/v1/completions", json.dumps({"prompt": list(range(5000))}).encode(), 400, "input_tokens"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stream": 3}',
     400, "stream"),
    ("/v1/nowhere", b"{}", 404, None),
    ("/tokenize", b'{}', 400, "prompt"),
    ("/detokenize", b'{"tokens": [1, -5]}', 400, "tokens"),
]


def test_bad_input_gets_vllm_status_and_error_object(engine):
    before = engine.metrics()["kvwire_engine_bad_requests_total"]
    with httpx.Client(base_url=engine.url, timeout=TIMEOUT) as c:
        for path, body, status, param in BAD:
            r = c.post(path, content=body)
            assert r.status_code == status, (path, body, r.text)
            err = r.json()["error"]
            assert err["code"] == status and err["message"] and err["type"]
            if param is not None:
                assert err["param"] == param, (body, err)
        assert c.get("/v1/completions").status_code == 405
        ok = c.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
        assert ok.status_code == 200  # the same keep-alive connection still served
    after = engine.metrics()["kvwire_engine_bad_requests_total"]
    assert after - before == len(BAD) + 1


def test_malformed_http_gets_400_and_engine_keeps_serving(engine):
    import socket

    port = engine.app.port
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert s.recv(1000).startswith(b"HTTP/1.1 400")
    assert httpx.get(engine.url + "/health").status_code == 200


def test_metrics_have_vllm_names(engine):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0)
    p = "metrics prompt " * 40
    for _ in range(2):
        client.completions.create(model="m", prompt=p, max_tokens=3)
    m = engine.metrics()
    lab = '{model_name="m",engine="0"}'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert name + lab in m, name
    assert m["vllm:prefix_cache_hits_total" + lab] >= 16
    assert m["vllm:prefix_cache_queries_total" + lab] > m["vllm:prefix_cache_hits_total" + lab]
    assert m["vllm:time_to_first_token_seconds_count" + lab] >= 2
    assert m["vllm:kv_cache_usage_perc" + lab] == 0  # idle: cached blocks are free ones


def test_prefix_cache_counters_move_on_admission_not_first_token():
    """vLLM's scheduler counts prefix_cache_queries/hits when it looks a request up on
    admission (reported when that step ends), not at its first token: a chunked prefill
    shows them after its first chunk, long before its first token (TTFT count)."""
    cfg = EngineConfig(num_gpu_blocks=2000, block_size=16, max_num_batched_tokens=512,
                       cost=StepCost(base_s=1e-3, prefill_token_s=1e-3))
    e = EngineThread(_opts(config=cfg, loras=[]))
    lab = '{model_name="m",engine="0"}'
    q, h, n = (f"vllm:{k}{lab}" for k in ("prefix_cache_queries_total",
                                          "prefix_cache_hits_total",
                                          "time_to_first_token_seconds_count"))
    try:
        head = list(range(1, 161))  # 10 blocks, cached by a short first request
        r = httpx.post(e.url + "/v1/completions", json={"prompt": head, "max_tokens": 1},
                       timeout=TIMEOUT)
        assert r.status_code == 200
        m0 = e.metrics()
        assert (m0[q], m0[h], m0[n]) == (160, 0, 1)
        # 160 cached + 2,000 new tokens: four ~0.5 s chunks before the first token
        body = {"prompt": head + list(range(500, 2500)), "max_tokens": 1, "stream": True}
        with httpx.stream("POST", e.url + "/v1/completions", json=body, timeout=TIMEOUT):
            seen: list[dict[str, float]] = []
            _until(lambda: seen.append(e.metrics()) or seen[-1][q] > m0[q], "the admission")
            m1 = seen[-1]  # one scrape: the counters and the TTFT count together
            assert m1[q] - m0[q] == 2160 and m1[h] - m0[h] == 160
            assert m1[n] == m0[n], "counted only when the first token came"
            assert e.app.cores[0].model.running[0].num_output == 0  # still prefilling
    finally:
        e.close()


def test_tokenize_detokenize(engine):
    r = httpx.post(engine.url + "/tokenize", json={"model": "m", "prompt": "hello world"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 4096
    d = httpx.post(engine.url + "/detokenize", json={"model": "m", "tokens": r["tokens"]}).json()
    assert d["prompt"].endswith("hello world")
    c = httpx.post(engine.url + "/tokenize",
                   json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert c["count"] > 2


def test_disconnect_aborts_and_frees_blocks():
    e = EngineThread(_opts(speed=1.0, loras=[]))
    try:
        body = {"prompt": list(range(1, 400)), "max_tokens": 3000, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", e.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = r.iter_lines()  # kept: dropping the generator closes the response
            next(lines)  # generating: it holds blocks now
            core = e.app.cores[0]
            assert core.model.running and core.model.cache.num_free < 2000
            assert e.metrics()['vllm:kv_cache_usage_perc{model_name="m",engine="0"}'] > 0
        # the client went away: the request is aborted and its blocks freed
        _until(lambda: not core.model.running and not core.model.waiting, "the abort")
        m = e.metrics()
        assert m["kvwire_engine_aborted_requests_total"] == 1
        assert m['vllm:num_requests_running{model_name="m",engine="0"}'] == 0
        assert all(c == 0 for c in core.model.cache.ref)
    finally:
        e.close()


def _follow(endpoint: str):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def _apply(held: Counter, payload: bytes) -> None:
    for ev in decode_batch(payload).events:
        if isinstance(ev, BlockStored) and ev.medium in (None, "GPU"):
            held.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved) and ev.medium in (None, "GPU"):
            held.subtract(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            held.clear()


def _load_in_thread(url: str, n: int) -> threading.Thread:
    """A started thread that sends ``n`` concurrent 20-token completions of prompts with
    shared prefixes (a small cache evicts under them), each asserted to answer 200."""

    async def load() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as ac:
            async def one(i: int) -> None:
                prompt = [i % 7 + 1] * 48 + list(range(i, i + 40))  # shared prefixes
                r = await ac.post("/v1/completions", json={"prompt": prompt,
                                                           "max_tokens": 20,
                                                           "ignore_eos": True})
                assert r.status_code == 200

            await asyncio.gather(*(one(i) for i in range(n)))

    t = threading.Thread(target=lambda: asyncio.run(load()))
    t.start()
    return t


@pytest.mark.parametrize("dialect,publisher", [("vllm", "reference"), ("sglang", "kvwire")])
def test_events_rebuild_the_cache_exactly(dialect, publisher):
    """A small cache under load evicts; the published stream, applied in order from a dump's
    seq, equals the engine's later dump (as a multiset: two blocks may hold one hash). DP
    ranks publish at their own endpoints. A dump of an idle engine covers every batch up
    to its ``seq``: batches are published when their step's outputs are handed out."""
    cfg = EngineConfig(num_gpu_blocks=60, block_size=16, cost=StepCost(base_s=1e-3))
    e = EngineThread(_opts(config=cfg, speed=50.0, dialect=dialect, dp_size=2,
                           publisher=publisher, loras=[]))
    client = httpx.Client(base_url=e.url, timeout=TIMEOUT)
    socks = [_follow(ep) for ep in e.events]
    try:
        assert len(e.events) == 2 and e.events[0] != e.events[1]
        got: list[list[tuple[int, bytes]]] = [[], []]
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)

        def drain(timeout_ms: int) -> None:
            for s, _ in poller.poll(timeout_ms):
                while True:
                    try:
                        frames = s.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    seq = int.from_bytes(frames[1], "big", signed=True)
                    got[socks.index(s)].append((seq, frames[-1]))

        # the slow joiner: requests until both subscriptions have seen a batch
        deadline = time.monotonic() + TIMEOUT
        n = 0
        while not all(got):
            assert time.monotonic() < deadline
            for _ in range(4):  # new prompts: each stores blocks; ranks take turns when idle
                n += 1
                client.post("/v1/completions", json={"prompt": [9000 + n] * 40, "max_tokens": 1})
            drain(50)
        base = client.get("/kvwire/cache").json()["ranks"]  # idle engine: exact at its seq

        t = _load_in_thread(e.url, 60)
        while t.is_alive():
            drain(20)
        t.join()
        final = client.get("/kvwire/cache").json()["ranks"]
        for rank in range(2):
            last = final[rank]["seq"]
            _until(lambda r=rank, s=last: (drain(10) or True) and got[r] and got[r][-1][0] >= s,
                   f"rank {rank}'s batches up to seq {last}")
            held = Counter(base[rank]["blocks"])
            seqs = [s for s, _ in got[rank] if base[rank]["seq"] < s <= last]
            assert seqs == list(range(base[rank]["seq"] + 1, last + 1))  # none lost
            for s, payload in got[rank]:
                if base[rank]["seq"] < s <= last:
                    _apply(held, payload)
            assert +held == Counter(final[rank]["blocks"])
            assert final[rank]["blocks"]
        assert sum(c.model.cache.evictions for c in e.app.cores) > 0  # removals were carried
    finally:
        for s in socks:
            s.close()
        client.close()
        e.close()


def _rebuild(records: list[dict[str, Any]], stream: str, upto: int) -> Counter:
    """The GPU blocks ``kvwire listen --json`` says one stream holds after seq ``upto``
    (reset: clear; snapshot: replace; batch: apply), as a multiset of hashes."""
    held: Counter = Counter()
    last = None
    for rec in records:
        if rec["stream"] != stream or rec["kind"] == "liveness":
            continue
        if rec["kind"] == "reset":
            held.clear()
            continue
        if rec["seq"] > upto:
            break
        last = rec["seq"]
        if rec["kind"] == "snapshot":
            held.clear()
        for ev in rec["blocks"] if rec["kind"] == "snapshot" else rec["events"]:
            if ev["type"] == "AllBlocksCleared":
                held.clear()
            elif ev.get("medium") in (None, "GPU"):
                held.update({"BlockStored": ev["block_hashes"]}.get(ev["type"], []))
                held.subtract({"BlockRemoved": ev["block_hashes"]}.get(ev["type"], []))
    assert last == upto, f"{stream}: listen's records end at seq {last}, not {upto}"
    return +held


def test_kvwire_listen_json_rebuilds_the_cache_dumps_of_a_loaded_engine():
    """The rebuild target as stated: the real ``kvwire listen ... --replay ... --json`` (a
    subprocess) follows both DP ranks of an engine whose small cache evicts under load; the
    cache rebuilt from its JSON lines alone equals every ``GET /kvwire/cache`` dump at the
    dump's seq, exactly (multisets), for dumps taken mid-load (between two steps) and after."""
    import subprocess
    import sys

    cfg = EngineConfig(num_gpu_blocks=60, block_size=16, cost=StepCost(base_s=1e-3))
    e = EngineThread(_opts(config=cfg, speed=50.0, dp_size=2, loras=[], replay="tcp://*:0"))
    replays = [ep.replace(ep.split("//")[1].rsplit(":", 1)[0], "127.0.0.1", 1)
               for ep in e.app.replay_endpoints]
    cmd = [sys.executable, "-m", "kvwire", "listen", *e.events, "--json"]
    for rp in replays:
        cmd += ["--replay", rp]
    listen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    records: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: [records.append(json.loads(ln))
                                              for ln in listen.stdout], daemon=True)
    reader.start()
    client = httpx.Client(base_url=e.url, timeout=TIMEOUT)
    try:
        # both streams bootstrapped (reset, snapshot of the idle engine) before the load
        _until(lambda: {r["stream"] for r in list(records) if r["kind"] == "snapshot"}
               == set(e.events), "kvwire listen's snapshots")
        dumps: list[tuple[bool, list[dict[str, Any]]]] = []  # (taken under load, ranks)

        t = _load_in_thread(e.url, 80)
        while t.is_alive():
            dumps.append((True, client.get("/kvwire/cache").json()["ranks"]))
        t.join()
        dumps.append((False, client.get("/kvwire/cache").json()["ranks"]))
        last = dumps[-1][1]
        _until(lambda: all(any(r["stream"] == ep and r.get("seq", -1) >= last[k]["seq"]
                               for r in list(records)) for k, ep in enumerate(e.events)),
               "listen to reach the last dump's seqs")
        listen.terminate()
        listen.wait(TIMEOUT)
        reader.join(TIMEOUT)
        loaded = 0
        for under_load, ranks in dumps:
            for k, ep in enumerate(e.events):
                d = ranks[k]
                assert _rebuild(records, ep, d["seq"]) == Counter(d["blocks"]), (under_load, d)
                loaded += under_load and d["running"] > 0 and bool(d["blocks"])
        assert loaded >= 2, "no dump was taken while requests ran"
        assert all(last[k]["blocks"] for k in range(2))
        assert sum(c.model.cache.evictions for c in e.app.cores) > 0  # removals were carried
        summary = listen.stderr.read()
        assert summary.count(", 0 lost,") == 2, summary
    finally:
        if listen.poll() is None:
            listen.kill()
            listen.wait(TIMEOUT)
        client.close()
        e.close()


def test_timing_fields_are_the_models(engine):
    r = httpx.post(engine.url + "/v1/completions",
                   json={"prompt": "t" * 50, "max_tokens": 3, "kvwire_timing": True,
                         "ignore_eos": True}).json()
    t = r["kvwire"][0]
    assert t["first_token"] - t["arrival"] == pytest.approx(t["ttft"]) and t["ttft"] > 0
    assert t["finish"] > t["first_token"] and t["rank"] == 0
    assert re.fullmatch(r"cmpl-[0-9a-f]+", r["id"])
    assert msgspec.json.decode(httpx.post(engine.url + "/v1/completions",
                                          json={"prompt": "t", "max_tokens": 1}).content)["usage"]


def test_lora_blocks_are_published_with_the_adapters_name():
    """A request for a LoRA adapter stores blocks with ``lora_id`` and ``lora_name`` (as vLLM
    0.33 publishes them): routers key adapters by the name clients send as ``model``."""
    e = EngineThread(_opts())
    sub = _follow(e.events[0])
    try:
        seen: list[BlockStored] = []
        deadline = time.monotonic() + TIMEOUT
        while not any(ev.lora_name == "ad2" for ev in seen):  # slow joiner: ask until heard
            assert time.monotonic() < deadline, f"no ad2 block heard: {seen[-3:]}"
            body = {"model": "ad2", "prompt": list(range(100, 164)), "max_tokens": 1}
            assert httpx.post(e.url + "/v1/completions", json=body).status_code == 200
            while sub.poll(100):
                seen += [ev for ev in decode_batch(sub.recv_multipart()[-1]).events
                         if isinstance(ev, BlockStored)]
        assert {(ev.lora_id, ev.lora_name) for ev in seen} == {(2, "ad2")}
    finally:
        sub.close()
        e.close()


def test_dp_rank_header_picks_the_rank():
    """vLLM's ``X-data-parallel-rank`` (a router's choice) is honoured; a rank the engine
    does not have is a 400 naming the header, and the engine keeps serving."""
    e = EngineThread(_opts(dp_size=2))
    try:
        body = {"prompt": "r" * 40, "max_tokens": 1, "kvwire_timing": True}
        for want in (1, 1, 0, 1):
            r = httpx.post(e.url + "/v1/completions", json=body,
                           headers={"X-data-parallel-rank": str(want)})
            assert r.status_code == 200 and r.json()["kvwire"][0]["rank"] == want, r.text
        for bad in ("2", "-1", "one"):
            r = httpx.post(e.url + "/v1/completions", json=body,
                           headers={"X-data-parallel-rank": bad})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "X-data-parallel-rank"
        assert httpx.post(e.url + "/v1/completions", json=body).status_code == 200
    finally:
        e.close()
