"""A long prompt's new text is tokenized off the proxy's event loop (proxy/offload.py): other
requests' streams go on meanwhile, a full queue is a 429 (a /v1/responses request is routed
by load instead, not counted as shed), and nothing is left counted when a client leaves; and
`kvwire serve` says at start what a tokenizer without proven cuts tokenizes again. Real engines, router and HTTP
server on loopback (test_proxy.py's Stack), and real `kvwire serve` processes.

The one stand-in: the builtin tokenizer with a gate its worker waits at before a long encode,
so that "while a long prompt is being tokenized" lasts exactly as long as the test needs it
to (an order made certain, not a race timed)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_proxy import (  # noqa: F401 (fixtures)
    TIMEOUT,
    Stack,
    _scrape,
    _Stub,
    make_stack,
    serve_proc,
    wait_for,
)

from kvwire.engine import EngineConfig, StepCost
from kvwire.proxy.offload import Offload
from kvwire.routing.policy import RoundRobinPolicy
from kvwire.tokenize import BuiltinTokenizer
from kvwire.tokenize.base import Plan

LONG = " ".join(f"never{i}seen" for i in range(6000))  # ~70k characters of new text
#: engines that take LONG's ~42k tokens quickly
ENGINE = {"max_model_len": 65536, "config": EngineConfig(
    num_gpu_blocks=8000, block_size=16, cost=StepCost(base_s=2e-3, prefill_token_s=1e-8))}


class GatedTokenizer(BuiltinTokenizer):
    """Work on a worker of more than ``over`` characters waits at ``gate`` (``entered``
    says it got there)."""

    releases_gil = True  # the gate's wait does

    def __init__(self, over: int = 0) -> None:
        super().__init__()
        self.over = over
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.threads: set[str] = set()

    def run(self, plan: Plan) -> list[Sequence[int]]:
        worker = threading.current_thread() is not threading.main_thread() and \
            threading.current_thread().name.startswith("kvwire-tokenize")
        if worker and plan.chars > self.over:
            self.threads.add(threading.current_thread().name)
            self.entered.set()
            if not self.gate.wait(TIMEOUT):
                raise RuntimeError("the test never opened the gate")
        return super().run(plan)


def _long_request(url: str, out: dict[str, Any], prompt: str = LONG) -> threading.Thread:
    def send() -> None:
        try:
            out["response"] = httpx.post(url + "/v1/completions", timeout=TIMEOUT, json={
                "model": "m", "prompt": prompt, "max_tokens": 2})
        except httpx.HTTPError as e:
            out["error"] = e
    t = threading.Thread(target=send, daemon=True)
    t.start()
    return t


def test_a_long_prompt_being_tokenized_delays_no_other_stream(
        make_stack: Callable[..., Stack]) -> None:  # noqa: F811 (the fixture)
    """While a never-seen long prompt is in the tokenizer's worker, a short streamed request
    is answered whole; the long one is answered too (routed on its start), and its ids are
    kept once the worker is done: sent again, it has nothing long to encode."""
    tok = GatedTokenizer()
    s = make_stack(2, engine_kw=ENGINE, tokenizer=tok, tokenize_threads=1)
    out: dict[str, Any] = {}
    long_req = _long_request(s.url, out)
    assert tok.entered.wait(TIMEOUT)
    short = {"model": "m", "prompt": "a short one", "max_tokens": 8, "ignore_eos": True,
             "stream": True}
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c, \
            c.stream("POST", "/v1/completions", json=short) as r:
        assert r.status_code == 200
        body = b"".join(r.iter_raw())
    assert body.endswith(b"data: [DONE]\n\n")
    assert s.proxy.offload.rests == 1  # its rest still at the gate
    assert tok.threads and all(n.startswith("kvwire-tokenize") for n in tok.threads)
    tok.gate.set()
    long_req.join(TIMEOUT)
    assert out["response"].status_code == 200, out["response"].text
    assert out["response"].json()["usage"]["prompt_tokens"] == len(BuiltinTokenizer()
                                                                    .encode(LONG, True))
    wait_for(lambda: s.proxy.offload.rests == 0, "the worker done")
    m = _scrape(s.url)
    assert m["kvwire_proxy_tokenize_encodes_total", frozenset({("where", "worker")})] == 1
    assert m["kvwire_proxy_tokenize_encodes_total", frozenset({("where", "loop")})] >= 1
    # the same prompt again: known now, so planned on the loop with nothing long to encode
    again = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT,
                       json={"model": "m", "prompt": LONG + " one more", "max_tokens": 2})
    assert again.status_code == 200
    assert _scrape(s.url)["kvwire_proxy_tokenize_encodes_total",
                          frozenset({("where", "worker")})] == 1


def test_a_long_new_prompt_is_routed_on_its_start_while_the_rest_is_tokenized(
        make_stack: Callable[..., Stack]) -> None:  # noqa: F811 (the fixture)
    """A never-seen long prompt's start (its first 4k characters) shows that no engine
    holds more of it than that: it is routed and answered while the rest of its text is
    still at the worker's gate. Once the rest is done the whole prompt is predicted on its
    engine, and its ids are kept: the same text with a long new part after it is routed
    on its start too, to the engine that holds the first."""
    tok = GatedTokenizer()
    s = make_stack(2, engine_kw=ENGINE, tokenizer=tok, tokenize_threads=1)
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert tok.entered.is_set() and s.proxy.offload.rests == 1  # the rest at the gate
        assert s.proxy.offload.pending == 0  # (none waits for its route)
        assert _scrape(s.url)["kvwire_proxy_routed_on_start_total", frozenset()] == 1
        home = r.headers["x-kvwire-engine"]
        tok.gate.set()
        wait_for(lambda: s.proxy.offload.rests == 0, "the rest encoded")
        ids = BuiltinTokenizer().encode(LONG, True)

        def whole_on_home() -> bool:
            with s.core.lock:
                m = s.core.index.match(ids)
            return m[home + "/dp0"].blocks == len(ids) // 16

        wait_for(whole_on_home, "the whole prompt held or predicted on its engine")
        more = LONG + "".join(f" then{i}more" for i in range(2000))  # (past inline_chars)
        r = c.post("/v1/completions", json={"model": "m", "prompt": more, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvwire-engine"] == home
        assert _scrape(s.url)["kvwire_proxy_routed_on_start_total", frozenset()] == 2
    wait_for(lambda: s.proxy.offload.rests == 0 and s.loads() == {}, "nothing held")


def test_past_the_rests_bound_a_rest_is_skipped_and_a_held_start_grows(
        make_stack: Callable[..., Stack]) -> None:  # noqa: F811 (the fixture)
    """With ``tokenize_queue`` rests in hand, a long prompt routed on its start has its
    rest skipped (counted): the router sheds work for later requests, not the request. One whose
    start an engine holds whole (sent before as token ids, so the router never tokenized
    its text) is tokenized further, waiting for its route, until its start settles it or
    is all of it: it goes to that engine."""
    tok = GatedTokenizer()
    s = make_stack(2, engine_kw=ENGINE, tokenizer=tok, tokenize_threads=1,
                   tokenize_queue=1)
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        # routed on its start, its rest held at the gate
        r = c.post("/v1/completions", json={"model": "m", "prompt": "0 " + LONG,
                                            "max_tokens": 2})
        assert r.status_code == 200 and s.proxy.offload.rests == 1
        assert tok.entered.wait(TIMEOUT)
        r = c.post("/v1/completions", json={"model": "m", "prompt": "past " + LONG,
                                            "max_tokens": 2})
        assert r.status_code == 200 and s.proxy.offload.rests == 1
        m = _scrape(s.url)
        assert m["kvwire_proxy_routed_on_start_total", frozenset()] == 2
        assert m["kvwire_proxy_tokenize_rests_skipped_total", frozenset()] == 1
        third = "third " + LONG
        ids = BuiltinTokenizer().encode(third, True)
        r = c.post("/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 2})
        assert r.status_code == 200
        holder = r.headers["x-kvwire-engine"]

        def held() -> bool:
            with s.core.lock:
                m = s.core.index.match(ids)
            return m[holder + "/dp0"].blocks - m[holder + "/dp0"].predicted == len(ids) // 16

        wait_for(held, "the third prompt's blocks in the index, from its engine's events")
        out: dict[str, Any] = {}
        t = _long_request(s.url, out, third)  # as text: its start is held whole
        wait_for(lambda: s.proxy.offload.pending == 1, "more of it at the gate, for its route")
        assert "response" not in out
        tok.gate.set()
        t.join(TIMEOUT)
        assert out["response"].status_code == 200
        assert out["response"].headers["x-kvwire-engine"] == holder
        m = _scrape(s.url)
        assert m["kvwire_proxy_routed_on_start_total", frozenset()] == 2
        assert m["kvwire_proxy_tokenize_rests_skipped_total", frozenset()] == 1
    wait_for(lambda: s.proxy.offload.pending + s.proxy.offload.rests == 0, "nothing held")


def _queue_full(make: Callable[..., Stack]) -> tuple[
        GatedTokenizer, Stack, dict[str, Any], threading.Thread]:
    """One engine, one tokenize worker, a queue of one, and that one long prompt in hand
    (held at the gate) waiting for its route: the next long prompt finds the queue full.
    (Its tokenizer keeps whole segments only, as one without proven cuts does: a long
    prompt is then one piece of work, none of it known before the rest, so nothing is
    routed on its start.)"""
    tok = GatedTokenizer()
    tok.segments.store = None
    s = make(1, engine_kw=ENGINE, tokenizer=tok, tokenize_threads=1,
                   tokenize_queue=1)
    out: dict[str, Any] = {}
    first = _long_request(s.url, out)
    assert tok.entered.wait(TIMEOUT)
    return tok, s, out, first


def test_a_full_tokenizer_queue_is_a_429(
        make_stack: Callable[..., Stack]) -> None:  # noqa: F811 (the fixture)
    """With ``tokenize_queue`` long prompts in hand, the next long one is refused at once
    with OpenAI's 429 and Retry-After, counted; short ones are still served."""
    tok, s, out, first = _queue_full(make_stack)
    r = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT,
                   json={"model": "m", "prompt": LONG + " another", "max_tokens": 2})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["code"] == 429 and "--tokenize-queue" in err["message"]
    ok = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT,
                    json={"model": "m", "prompt": "short", "max_tokens": 2})
    assert ok.status_code == 200
    m = _scrape(s.url)
    assert m["kvwire_proxy_tokenize_shed_total", frozenset()] == 1
    assert m["kvwire_proxy_tokenize_pending", frozenset()] == 1
    tok.gate.set()
    first.join(TIMEOUT)
    assert out["response"].status_code == 200
    wait_for(lambda: s.proxy.offload.pending == 0, "the worker done")


def test_a_responses_request_past_a_full_queue_goes_by_load_not_counted_as_shed(
        make_stack: Callable[..., Stack]) -> None:  # noqa: F811 (the fixture)
    """A new ``/v1/responses`` conversation whose prompt finds the tokenizer's queue full is
    routed by load, not refused: counted apart from the requests refused with 429."""
    tok, s, out, first = _queue_full(make_stack)
    by_load = s.proxy.counts["responses_by_load"]
    r = httpx.post(s.url + "/v1/responses", timeout=TIMEOUT,
                   json={"model": "m", "input": LONG + " as a conversation"})
    # kvwire engines do not serve the Responses API: their 404, relayed, says it was sent
    assert r.status_code != 429 and r.headers["x-kvwire-engine"] == "e0", r.text
    assert s.proxy.counts["responses_by_load"] == by_load + 1
    m = _scrape(s.url)
    assert m["kvwire_proxy_tokenize_shed_total", frozenset()] == 0
    assert m["kvwire_proxy_tokenize_full_by_load_total", frozenset()] == 1
    refused = httpx.post(s.url + "/v1/completions", timeout=TIMEOUT,
                         json={"model": "m", "prompt": LONG + " another", "max_tokens": 2})
    assert refused.status_code == 429
    m = _scrape(s.url)
    assert m["kvwire_proxy_tokenize_shed_total", frozenset()] == 1
    assert m["kvwire_proxy_tokenize_full_by_load_total", frozenset()] == 1
    assert s.proxy.counts["tokenize_shed"] == 1
    tok.gate.set()
    first.join(TIMEOUT)
    assert out["response"].status_code == 200
    wait_for(lambda: s.proxy.offload.pending == 0, "the worker done")


def test_a_client_gone_while_its_prompt_is_tokenized_leaves_nothing(
        make_stack: Callable[..., Stack]) -> None:  # noqa: F811 (the fixture)
    """The client leaves while its prompt is in the worker: the request ends, the worker's
    encode stays counted until it is done, then nothing is pending and no load is held."""
    tok = GatedTokenizer()
    s = make_stack(1, engine_kw=ENGINE, tokenizer=tok, tokenize_threads=1)

    async def leave() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(s.url.rsplit(":", 1)[1]))
        body = json.dumps({"model": "m", "max_tokens": 2, "prompt": LONG}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        await asyncio.get_running_loop().run_in_executor(None, tok.entered.wait, TIMEOUT)
        writer.close()

    asyncio.run(leave())
    wait_for(lambda: s.proxy.active == 0, "the request ended with its client")
    assert s.proxy.offload.pending + s.proxy.offload.rests == 1
    tok.gate.set()
    wait_for(lambda: s.proxy.offload.pending + s.proxy.offload.rests == 0, "the worker done")
    # (routed on its start, it held a reservation at the engine when its client left)
    wait_for(lambda: s.loads() == {}, "no load held")


def test_a_retry_of_a_prompt_routed_on_its_start_is_weighed_whole(
        make_stack: Callable[..., Stack]) -> None:  # noqa: F811 (the fixture)
    """A long prompt routed on its start whose engine fails (a real 500, from a stand-in
    engine's HTTP) is retried on the next one with its whole ids: the retry waits for its
    rest, then reserves the whole prompt there, not its start. (The engine's prefill is
    made slow, so the reservation is read before its first token drops the prefill.)"""
    tok = GatedTokenizer()
    stub = _Stub(500)
    slow = {**ENGINE, "config": EngineConfig(num_gpu_blocks=8000, block_size=16, cost=StepCost(
        base_s=2e-3, prefill_token_s=1e-3))}  # ~40 s for LONG
    try:
        s = make_stack(2, engine_kw=slow, tokenizer=tok, tokenize_threads=1, urls=None,
                       policy=RoundRobinPolicy(), cooloff=60.0)
        s.proxy.links["e1"].set_url(stub.url)  # tried first (round robin): answers 500
        whole = len(BuiltinTokenizer().encode(LONG, True)) // 16

        def e0() -> float:
            return sum(v for k, v in s.loads().items() if k.startswith("e0"))

        async def go() -> tuple[float, float]:
            loop = asyncio.get_running_loop()
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", int(s.url.rsplit(":", 1)[1]))
            body = json.dumps({"model": "m", "max_tokens": 2, "prompt": LONG}).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                         b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
                         + body)
            await writer.drain()
            await loop.run_in_executor(None, wait_for, lambda: stub.hits == 1,
                                       "the first engine tried")
            waiting = e0()  # the retry waits for the rest, at the gate: nothing reserved
            tok.gate.set()
            await loop.run_in_executor(None, wait_for, lambda: e0() > 0,
                                       "the retry reserved on e0")
            held = e0()
            writer.close()  # (the client leaves: the engine's 40 s prefill is aborted)
            return waiting, held

        waiting, held = asyncio.run(go())
        assert waiting == 0
        assert held >= whole  # the whole prompt's blocks (its start's are ~1/17 of them)
        assert _scrape(s.url)["kvwire_proxy_routed_on_start_total", frozenset()] == 1
        wait_for(lambda: s.loads() == {} and s.proxy.offload.rests == 0, "nothing held")
    finally:
        stub.close()


class _FailingRest(GatedTokenizer):
    """Its worker fails on work of more than ``over`` characters: the rest of a prompt
    whose start was encoded. A stand-in for a fault no real input was found to cause (a
    text the library encodes in part but not whole)."""

    def run(self, plan: Plan) -> list[Sequence[int]]:
        if threading.current_thread().name.startswith("kvwire-tokenize_") \
                and plan.chars > self.over:
            raise ValueError("no encoding for this text")
        return super().run(plan)


def test_a_rest_that_fails_is_counted_and_its_request_answered(
        make_stack: Callable[..., Stack]) -> None:  # noqa: F811 (the fixture)
    """A long prompt routed on its start whose rest cannot be tokenized is still answered
    (it was sent on its start), the failure is counted in /metrics, and nothing stays
    held: no rest in hand, no load once it ends."""
    tok = _FailingRest(over=2 * 4096)
    tok.gate.set()
    s = make_stack(2, engine_kw=ENGINE, tokenizer=tok, tokenize_threads=1)
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 200, r.text
    wait_for(lambda: s.proxy.offload.rests == 0, "the rest ended")
    m = _scrape(s.url)
    assert m["kvwire_proxy_routed_on_start_total", frozenset()] == 1
    assert m["kvwire_proxy_tokenize_rest_failures_total", frozenset()] == 1
    wait_for(lambda: s.loads() == {}, "no load held")


def test_a_tokenizer_holding_the_gil_runs_in_a_process() -> None:
    """The builtin tokenizer without its C encoder holds the GIL: long new text goes to a
    worker process (a real one), with the same ids; a short text stays on the loop."""
    tok = BuiltinTokenizer()
    tok.releases_gil = False
    off = Offload(tok, threads=1, queue=2)
    assert off.mode == "processes"

    async def go() -> tuple[list[int], list[int]]:
        return await off.encode(LONG, True), await off.encode("short text")

    try:
        long_ids, short_ids = asyncio.run(go())
    finally:
        off.close()
    fresh = BuiltinTokenizer()
    assert long_ids == fresh.encode(LONG, True) and short_ids == fresh.encode("short text")
    assert (off.offloaded, off.inline) == (1, 1)


def test_a_killed_worker_process_loses_no_prompt() -> None:
    """SIGKILL the worker process (a real fault: the OOM killer's): the prompt in hand is
    still answered with its ids (on the loop), and the next long one gets a new worker."""
    import multiprocessing
    import os
    import signal

    tok = BuiltinTokenizer()
    tok.releases_gil = False
    off = Offload(tok, threads=1, queue=2)
    fresh = BuiltinTokenizer()

    texts = [" ".join(f"{w}{i}" for i in range(6000)) for w in ("first", "second", "third")]

    async def go() -> list[list[int]]:
        out = [await off.encode(texts[0])]
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGKILL)
            child.join(TIMEOUT)
        out.append(await off.encode(texts[1]))
        out.append(await off.encode(texts[2]))
        return out

    try:
        ids = asyncio.run(go())
    finally:
        off.close()
    assert ids == [fresh.encode(t) for t in texts]
    assert off.broken == 1 and off.offloaded == 2 and off.inline == 1


class PolicyTokenizer(BuiltinTokenizer):
    """Records the scheduling policy of the thread each long encode runs on."""

    releases_gil = True

    def __init__(self) -> None:
        super().__init__()
        self.policies: list[int] = []

    def run(self, plan: Plan) -> list[Sequence[int]]:
        import os

        if plan.chars > self.inline_chars:
            self.policies.append(os.sched_getscheduler(threading.get_native_id()))
        return super().run(plan)


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="Linux only")
def test_workers_run_at_the_lowest_cpu_priority() -> None:
    """Worker threads and worker processes encode under SCHED_IDLE (when the cores are
    short the loop runs first); the loop's own thread keeps its policy."""
    import multiprocessing
    import os

    before = os.sched_getscheduler(0)
    tok = PolicyTokenizer()
    off = Offload(tok, threads=2, queue=4)
    assert off.mode == "threads"
    try:
        ids = asyncio.run(off.encode(LONG))
    finally:
        off.close()
    assert ids == BuiltinTokenizer().encode(LONG)
    assert tok.policies == [os.SCHED_IDLE] and os.sched_getscheduler(0) == before

    tok2 = BuiltinTokenizer()
    tok2.releases_gil = False
    off = Offload(tok2, threads=1, queue=2)
    assert off.mode == "processes"

    async def go() -> list[int]:
        ids = await off.encode(LONG)
        workers = multiprocessing.active_children()
        assert workers and all(os.sched_getscheduler(w.pid) == os.SCHED_IDLE
                               for w in workers), workers
        return ids

    try:
        assert asyncio.run(go()) == BuiltinTokenizer().encode(LONG)
    finally:
        off.close()
    assert os.sched_getscheduler(0) == before


def test_offload_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="queue"):
        Offload(BuiltinTokenizer(), threads=1, queue=0)
    assert Offload(BuiltinTokenizer(), threads=0).mode == "loop"


def _unproven_tokenizer(d: Path, special: bool) -> Path:
    """A model directory whose tokenizer has no proven cuts (GPT-2's byte-level pre-tokenizer,
    a small BPE trained here): with ``special``, an end-of-text token the text is cut at;
    without, one matched after normalization, so that nothing cuts the text."""
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers, trainers
    from tokenizers.models import BPE

    t = Tokenizer(BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.train_from_iterator([LONG[:2000], "The router keeps what it tokenized.\n"] * 4,
                          trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                              initial_alphabet=pre_tokenizers.ByteLevel
                                              .alphabet()))
    d.mkdir()
    if special:
        (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    else:
        t.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=True)])
    t.save(str(d / "tokenizer.json"))
    return d


@pytest.mark.parametrize("special", [True, False], ids=["segments", "whole"])
def test_serve_says_once_at_start_what_a_tokenizer_without_cuts_tokenizes_again(
        serve_proc: Callable[..., tuple[Any, str]],  # noqa: F811 (the fixture)
        tmp_path: Path, special: bool) -> None:
    """``kvwire serve --tokenizer DIR`` with a tokenizer whose cuts are not proven logs, once
    at start, why, and what a prompt extending an earlier one costs: its changed segments
    (text cut at special tokens) or the whole text (nothing cuts it)."""
    d = _unproven_tokenizer(tmp_path / "gpt2ish", special)
    p, _ = serve_proc("--engine", "e0=tcp://127.0.0.1:9,url=http://127.0.0.1:9",
                      "--tokenizer", str(d))
    said = [line for line in p.said if "no chunks of long text are kept" in line]
    assert len(said) == 1, p.said
    line = said[0]
    assert f"tokenizer {d.name}:" in line and "WARNING" in line.upper()
    if special:
        assert "pre-tokenizer" in line
        assert "from the start of each segment that changed" in line and " whole" not in line
    else:
        assert "an added token" in line and "tokenized again whole" in line
        assert "segment" not in line
