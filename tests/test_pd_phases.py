"""Prefill/decode pairs through ``kvwire serve``: the time to first token split into its
phases at the router (prefill, KV transfer, first decode token), and a client that leaves
while its prompt's KV is moving. Real ``kvwire engine --role`` processes behind a real
``kvwire serve``, both protocols; the transfer is made slow with the engines' own flags
(``--kv-latency-ms``) and every wait is on a condition."""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable, Iterator

import httpx
import pytest
from pd_helpers import MODEL, TIMEOUT, Fleet, fleets, until
from pd_helpers import total_metric as _metric
from pd_helpers import words_prompt as _prompt

from kvwire.proxy.metrics import CheapHistogram
from kvwire.proxy.pairs import _Phases


@pytest.fixture
def fleet() -> Iterator[Callable[..., Fleet]]:
    yield from fleets()


LATENCY_S = 0.4  # the decode engine's modelled transfer latency (--speed 1: wall seconds)


def _hist(text: str, name: str, **labels: str) -> tuple[float, float]:
    """(count, sum) of a histogram in a /metrics page."""
    return (_metric(text, name + "_count", **labels), _metric(text, name + "_sum", **labels))


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_ttft_is_split_into_prefill_transfer_and_decode(fleet: Callable[..., Fleet],
                                                        protocol: str) -> None:
    """Three streamed answers over a transfer of ~0.4 s: the router's transfer phase is
    what the decode engine measured (its kvwire_engine_kv_transfer_seconds; under SGLang's
    protocol less the part that waited for the prefill), the three phases add up to no
    more than the client's TTFT, and a non-streamed answer is not counted."""
    f = fleet({"prefill0": "prefill", "decode0": "decode"}, protocol,
              engine_flags={"decode0": ("--speed", "1",
                                        "--kv-latency-ms", str(LATENCY_S * 1000))})
    n = 3
    for i in range(n):
        with httpx.stream("POST", f.url + "/v1/completions", timeout=TIMEOUT, json={
                "model": MODEL, "prompt": _prompt(30 + i), "max_tokens": 3,
                "stream": True}) as r:
            assert r.status_code == 200
            assert b"[DONE]" in b"".join(r.iter_raw())
    r = f.http.post("/v1/completions", json={"model": MODEL, "prompt": _prompt(40),
                                             "max_tokens": 3})
    assert r.status_code == 200
    # (the decode engine's own figures: model seconds, which at --speed 1 are wall seconds)
    d = f.engines["decode0"]
    until(lambda: d.metric("kvwire_engine_kv_transfer_seconds_count") == n + 1,
          "the decode engine's transfers counted")
    eng = d.metric("kvwire_engine_kv_transfer_seconds_sum") * n / (n + 1)  # (about)
    m = f.metrics()
    counts = {p: _hist(m, "kvwire_proxy_pd_ttft_seconds", phase=p)
              for p in ("prefill", "transfer", "decode")}
    assert all(c == n for c, _ in counts.values()), counts
    transfer = counts["transfer"][1]
    assert transfer >= n * LATENCY_S * 0.75, (transfer, eng)  # visibly the transfer
    assert transfer <= eng * 1.05 + 0.05, (transfer, eng)
    if protocol == "vllm":  # the pull is all transfer
        assert transfer >= eng * 0.9, (transfer, eng)
    ttft = _hist(m, "kvwire_proxy_ttft_seconds", engine="decode0")
    assert ttft[0] == n + 0  # (streamed answers only)
    phases = sum(s for _, s in counts.values())
    assert ttft[1] * 0.6 <= phases <= ttft[1] + 0.01, (phases, ttft)
    until(f.all_idle, "nothing held")


def test_an_engine_that_does_not_report_its_transfer_leaves_decode_unsplit() -> None:
    """The split itself (no engine: the router's :class:`_Phases` fed as the pair flows
    feed it): without the decode engine's header, the transfer stays inside the decode
    phase; with it, it is taken out, never more than the wait it was part of; a malformed
    value counts as none. SGLang's protocol starts the decode phases where the prefill
    ended."""
    def run(concurrent: bool, header: bytes | None, t_p: float, prefill: float, t_d: float,
            first: float) -> dict[str, tuple[int, float]]:
        h = CheapHistogram("x", "x", (1.0,), "phase")
        ph = _Phases(h, concurrent)
        ph.t_p, ph.prefill = t_p, prefill
        ph.t_d = t_d
        ph.head({} if header is None else {b"x-kvwire-kv-transfer-seconds": header})
        ph.first = first
        ph.observe()
        ph.observe()  # (once)
        return {k: (sum(c.counts), round(c.sum, 6)) for k, c in h.children.items()}

    # vLLM: prefill 1 s, then the decode request: 3 s to its first bytes
    assert run(False, None, 0.0, 1.0, 1.5, 4.5) == {"prefill": (1, 1.0), "decode": (1, 3.0)}
    assert run(False, b"2.0", 0.0, 1.0, 1.5, 4.5) == {
        "prefill": (1, 1.0), "transfer": (1, 2.0), "decode": (1, 1.0)}
    assert run(False, b"9.0", 0.0, 1.0, 1.5, 4.5)["transfer"] == (1, 3.0)
    assert "transfer" not in run(False, b"soon", 0.0, 1.0, 1.5, 4.5)
    assert "transfer" not in run(False, b"-1", 0.0, 1.0, 1.5, 4.5)
    # SGLang: both sent at 0; the prefill ends at 1 s, the first decode bytes at 4.5 s
    assert run(True, None, 0.0, 1.0, 0.0, 4.5) == {"prefill": (1, 1.0), "decode": (1, 3.5)}
    assert run(True, b"3.0", 0.0, 1.0, 0.0, 4.5) == {
        "prefill": (1, 1.0), "transfer": (1, 3.0), "decode": (1, 0.5)}


def _send_raw(url: str, body: dict) -> socket.socket:
    """A streamed request on a raw socket (closing it is a client leaving)."""
    req = httpx.Request("POST", url + "/v1/completions", json=body)
    data = req.read()
    raw = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n" % len(data)) + data
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    sock.sendall(raw)
    return sock


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_client_leaving_during_the_transfer_leaves_nothing_held(
        fleet: Callable[..., Fleet], protocol: str) -> None:
    """The decode engine's transfer takes 60 s; once it is under way (the prefill engine
    served the blocks, the decode engine counts a transfer in progress) the client
    closes its connection: the decode engine aborts the pull, the prefill engine's blocks
    are freed (not left to the lease: 30 s), every load is 0, within 15 s."""
    f = fleet({"prefill0": "prefill", "decode0": "decode"}, protocol,
              engine_flags={"decode0": ("--speed", "1", "--kv-latency-ms", "60000",
                                        "--kv-lease-s", "120"),
                            "prefill0": ("--kv-lease-s", "120")})
    p, d = f.engines["prefill0"], f.engines["decode0"]
    sock = _send_raw(f.url, {"model": MODEL, "prompt": _prompt(50), "max_tokens": 4,
                             "stream": True})
    try:
        until(lambda: d.metric("kvwire_engine_kv_transfers_in_progress") == 1
              and p.metric("kvwire_engine_kv_served_blocks_total") > 0,
              "the KV on its way")
        assert d.metric("kvwire_engine_kv_transfers_total", result="ok") == 0
    finally:
        sock.close()
    until(lambda: d.metric("kvwire_engine_kv_transfers_total", result="aborted") == 1,
          "the decode engine to abort the pull", 15)
    until(f.all_idle, "every load 0, no engine holding or running anything", 15)
    assert d.metric("kvwire_engine_kv_transfers_in_progress") == 0
    assert d.metric("kvwire_engine_kv_transfers_total", result="failed") == 0
    assert p.metric("kvwire_engine_kv_leases_expired_total") == 0
    assert p.metric("kvwire_engine_kv_leases_released_total") == 1
    assert d.metric("kvwire_engine_aborted_requests_total") == 1


def test_vllm_a_client_leaving_before_the_decode_engine_has_it_leaves_the_lease(
        fleet: Callable[..., Fleet]) -> None:
    """vLLM's protocol has no way for a router to free a prefill engine's blocks: a client
    that leaves after the prefill answered, before the decode engine took the request
    (here: stopped with SIGSTOP), leaves them to the lease (--kv-lease-s 8 at --speed 4:
    2 s), which frees them; resumed, the decode engine ends holding nothing either."""
    f = fleet({"prefill0": "prefill", "decode0": "decode"}, "vllm",
              engine_flags={"prefill0": ("--kv-lease-s", "8")})
    p, d = f.engines["prefill0"], f.engines["decode0"]
    d.proc.send_signal(signal.SIGSTOP)
    try:
        sock = _send_raw(f.url, {"model": MODEL, "prompt": _prompt(60), "max_tokens": 4,
                                 "stream": True})
        try:
            until(lambda: p.metric("kvwire_engine_kv_held_blocks") > 0
                  and f.status()["decode0"]["http"]["in_flight"] == 1,
                  "the prefill done, the decode request sent")
        finally:
            sock.close()
        until(lambda: p.metric("kvwire_engine_kv_leases_expired_total") == 1,
              "the lease to expire", 15)
        assert p.metric("kvwire_engine_kv_held_blocks") == 0
        assert p.metric("kvwire_engine_kv_leases_released_total") == 0
    finally:
        d.proc.send_signal(signal.SIGCONT)
    until(f.all_idle, "every load 0, no engine holding or running anything", 30)


def test_a_pull_whose_request_was_aborted_before_it_started_counts_as_aborted() -> None:
    """A decode engine's step started a pull, and the request's client left before the
    step was handed out (the engine's loop, in-process, driven by hand in one callback so
    nothing interleaves): the pull is counted as aborted, not as a failed transfer, and
    nothing is left transferring."""
    import asyncio

    from test_engine_http import EngineThread

    from kvwire.engine import EngineConfig
    from kvwire.engine.core import Handle
    from kvwire.engine.request import EngineRequest
    from kvwire.engine.server.app import EngineOptions
    from kvwire.engine.server.openai import KVTransferParams

    e = EngineThread(EngineOptions(config=EngineConfig(num_gpu_blocks=64, block_size=4,
                                                       role="decode"),
                                   events=None, kv_port=0))
    try:
        app = e.app
        pd, core, runner = app.pd, app.cores[0], app.runners[0]

        def race() -> tuple[int, bool]:
            h = Handle(EngineRequest("r", list(range(17)), 3, remote_prefill=True),
                       runner.now(), lambda *a: None, "length")
            pd.track(h, KVTransferParams(do_remote_prefill=True, remote_host="127.0.0.1",
                                         remote_port=9, remote_request_id="x",
                                         remote_block_ids=[1, 2, 3, 4, 5]), None)
            core.submit(h)
            step = core.advance(runner.now())
            assert step is not None and step.pulls == [h]
            assert core.abort(h)
            pd.ended(h)  # (as the server's abort does)
            pd.after_step(step)  # the step handed out after the abort
            return len(step.pulls), "r" in pd.remotes

        done = asyncio.run_coroutine_threadsafe(_on_loop(race), e.loop).result(TIMEOUT)
        assert done == (1, False)
        text = httpx.get(e.url + "/metrics", timeout=TIMEOUT).text
        assert 'result="aborted"} 1' in text and 'result="failed"} 0' in text, text
        assert "kvwire_engine_kv_transfer_failures_total{" not in text  # (no reason at all)
        assert _metric(text, "kvwire_engine_kv_transfers_in_progress") == 0
        assert _metric(text, "kvwire_engine_kv_transfers_started_total") == 1
    finally:
        e.close()


async def _on_loop(fn: Callable[[], object]) -> object:
    return fn()


def test_route_answers_the_pair_for_a_fleet_with_roles(fleet: Callable[..., Fleet]) -> None:
    """The decision API on a prefill/decode fleet: ``/route`` names the decode engine (never
    a prefill-only one) and the prefill engine with why, as the proxy's pairs are chosen;
    each side is reserved under its own id and released with ``/release``; ``/score``
    answers the same without reserving. With real events: a prompt's prefix goes to the
    prefill engine that holds it, and a prompt the decode engine holds stays local
    (``cached``, no prefill)."""
    f = fleet({"prefill0": "prefill", "prefill1": "prefill", "decode0": "decode"}, "vllm",
              "--disagg-min-tokens", "64")

    def load(name: str) -> float:
        return f.status()[name]["ranks"][0]["load"]

    def release(*rids: str) -> None:
        for rid in rids:
            rel = f.http.post("/release", json={"request_id": rid})
            assert rel.status_code == 200 and rel.json()["released"], rel.text

    fresh = list(range(1000, 1320))  # 20 blocks, held nowhere: disaggregated
    r = f.http.post("/route", json={"token_ids": fresh})
    assert r.status_code == 200, r.text
    a = r.json()
    assert a["engine"] == "decode0" and a["rank"] == 0 and a["why"] == "disagg", a
    p = a["prefill"]
    assert p["engine"] in ("prefill0", "prefill1") and p["rank"] == 0, a
    assert a["request_id"] and p["request_id"] and a["request_id"] != p["request_id"]
    assert set(a["overlap"]) == {"prefill0", "prefill1", "decode0"}
    assert load("decode0") > 0 and load(p["engine"]) >= 20
    s = f.http.post("/score", json={"token_ids": fresh}).json()
    assert "request_id" not in s and "request_id" not in s["prefill"] and s["why"] == "disagg"
    release(a["request_id"], p["request_id"])
    until(f.settled, "every load 0")

    # a prompt served as a pair: both its engines hold it (the decode engine pulled it)
    text = _prompt(70, 200)
    first = f.http.post("/v1/completions", json={"model": MODEL, "prompt": text,
                                                 "max_tokens": 2})
    holder = first.headers["x-kvwire-engine"].split(",")[0].removeprefix("prefill=")
    toks = f.http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]
    n = len(toks) // 16
    until(lambda: f.blocks(holder) >= n and f.blocks("decode0") >= n, "its events indexed")
    more = f.http.post("/route", json={"token_ids": toks + list(range(5000, 5096))}).json()
    assert more["why"] == "disagg" and more["prefill"]["engine"] == holder, more
    assert more["overlap"][holder] >= n and more["overlap"]["decode0"] >= n, more
    release(more["request_id"], more["prefill"]["request_id"])
    same = f.http.post("/route", json={"token_ids": toks}).json()
    assert same["engine"] == "decode0" and same["prefill"] is None, same
    assert same["why"] == "cached"
    release(same["request_id"])
    until(f.settled, "every load 0")


def test_route_answers_a_pair_in_a_fleet_of_both_engines_given_a_protocol(
        fleet: Callable[..., Fleet]) -> None:
    """With ``--pd-protocol`` the proxy serves every request as a pair, also among engines
    that do both: ``/route`` then answers the pair too (a ``both`` engine may serve either
    side, or the whole request: ``local``)."""
    f = fleet({"e0": "both", "e1": "both"}, "vllm")
    a = f.http.post("/route", json={"token_ids": list(range(2000, 2320))}).json()
    assert a["engine"] in ("e0", "e1") and a["why"] in ("disagg", "local"), a
    assert "prefill" in a and (a["prefill"] is None) == (a["why"] == "local"), a
    for rid in (a["request_id"], *([a["prefill"]["request_id"]] if a["prefill"] else [])):
        assert f.http.post("/release", json={"request_id": rid}).json()["released"]
    until(f.settled, "every load 0")
