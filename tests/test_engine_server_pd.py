"""``kvwire engine --role prefill|decode`` as processes on loopback, driven as a P/D router
drives them: vLLM's protocol (prefill answer's ``kv_transfer_params`` handed to the decode
engine, which pulls over the KV side channel) and SGLang's (the same body to both at once,
the decode engine finding the prefill engine through its bootstrap server). Checked: the
answers, the blocks pulled (only those missing), the pulled blocks in the decode engine's
KV events and cache, leases back to 0, a prefill engine killed before the pull under both
load-failure policies, a lease that expires, bad input, an HTTP/2 preface."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pd_helpers
import pytest
from pd_helpers import TIMEOUT, refused_port, until

PROMPT = ("Disaggregated serving splits prefill and decode onto different engines, "
          "and the decode engine pulls the prompt's KV blocks from the prefill engine.")


class Engine(pd_helpers.Engine):
    """One ``kvwire engine`` with a role, named after it: few small blocks, a fast clock,
    KV events only when asked."""

    DEFAULT_FLAGS = ("--speed", "20", "--num-gpu-blocks", "64", "--block-size", "4")

    def __init__(self, role: str, *flags: str, events: bool = False) -> None:
        super().__init__(role, role, *flags, events=events)


@pytest.fixture(scope="module")
def pair():
    lease = ("--kv-lease-s", "600")  # 30 s of wall time: no expiry on a loaded box
    p = Engine("prefill", *lease)
    d = Engine("decode", *lease, events=True)
    try:
        yield p, d
    finally:
        p.close()
        d.close()


def plain(engine: Engine, body: dict, chat: bool = False) -> str:
    """The answer's text to ``body`` served whole by one engine (no P/D)."""
    r = engine.http.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["message"]["content"] if chat else c["text"]


def streamed_text(r: httpx.Response, chat: bool) -> str:
    out = []
    for line in r.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        d = json.loads(line[6:])
        assert "error" not in d, d
        for c in d["choices"]:
            out.append((c["delta"].get("content") or "") if chat else c["text"])
    return "".join(out)


def vllm_prefill(p: Engine, body: dict, chat: bool = False) -> dict:
    """As vLLM's proxy sends to the prefill engine: one token, not streamed."""
    pb = dict(body, max_tokens=1, stream=False, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    pb.pop("stream_options", None)
    r = p.http.post("/v1/chat/completions" if chat else "/v1/completions", json=pb,
                    headers={"X-Request-Id": "pd-test"})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def held(p: Engine) -> float:
    return p.metric("kvwire_engine_kv_held_blocks")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_vllm_protocol_end_to_end(pair, stream, chat):
    p, d = pair
    text = f"{PROMPT} ({'chat' if chat else 'text'}, {'stream' if stream else 'whole'})"
    body: dict[str, Any] = ({"messages": [{"role": "user", "content": text}]} if chat
                            else {"prompt": text})
    body["max_tokens"] = 12
    want = plain(d, body, chat)  # the decode engine alone, for the text to expect
    released = p.metric("kvwire_engine_kv_leases_released_total")
    ok = d.metric("kvwire_engine_kv_transfers_total", result="ok")
    kv = vllm_prefill(p, body, chat)
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == p.kv_port
    assert kv["remote_block_ids"] and kv["tp_size"] == 1 and kv["transfer_mode"] == "READ"
    assert kv["remote_blocks_expiry_time"] > time.time()
    assert kv["remote_request_id"] and kv["remote_engine_id"]
    n = kv["remote_num_tokens"]
    assert len(kv["remote_block_ids"]) in (-(-n // 4), -(-(n + 1) // 4))
    assert held(p) >= len(kv["remote_block_ids"])  # held for the decode engine
    db = dict(body, kv_transfer_params=kv, stream=stream)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if stream:
        with d.http.stream("POST", path, json=db) as r:
            assert r.status_code == 200
            got = streamed_text(r, chat)
    else:
        r = d.http.post(path, json=db)
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["message"]["content"] if chat else \
            r.json()["choices"][0]["text"]
    assert got == want
    assert d.metric("kvwire_engine_kv_transfers_total", result="ok") == ok + 1
    assert d.metric("vllm:nixl_xfer_time_seconds_count") == ok + 1 + d.metric(
        "kvwire_engine_kv_transfers_total", result="failed")  # every pull that ended
    assert d.metric("vllm:nixl_bytes_transferred_sum") == d.metric(
        "kvwire_engine_kv_transfer_bytes_total") > 0
    # the decode engine told the prefill engine: its lease is gone
    until(lambda: p.metric("kvwire_engine_kv_leases_released_total") == released + 1,
          "the lease to be released")
    until(lambda: held(p) == 0, "no held block")


@pytest.mark.parametrize("stream", [False, True])
def test_sglang_protocol_end_to_end(pair, stream):
    """Both engines get the same body at once (as SGLang's router sends it); only the
    decode answer counts, the prefill one is drained."""
    p, d = pair
    text = f"{PROMPT} (sglang, {'stream' if stream else 'whole'})"
    body = {"messages": [{"role": "user", "content": text}], "max_completion_tokens": 10}
    want = plain(d, body, chat=True)
    ok = d.metric("kvwire_engine_kv_transfers_total", result="ok")
    room = int.from_bytes(os.urandom(8), "big") >> 1
    sb = dict(body, bootstrap_host="127.0.0.1", bootstrap_port=p.bootstrap_port,
              bootstrap_room=room, stream=stream)
    out: dict[str, Any] = {}

    def prefill() -> None:
        out["prefill"] = p.http.post("/v1/chat/completions", json=sb)

    t = threading.Thread(target=prefill)
    t.start()
    try:
        if stream:
            with d.http.stream("POST", "/v1/chat/completions", json=sb) as r:
                assert r.status_code == 200
                got = streamed_text(r, True)
        else:
            r = d.http.post("/v1/chat/completions", json=sb)
            assert r.status_code == 200, r.text
            got = r.json()["choices"][0]["message"]["content"]
    finally:
        t.join(TIMEOUT)
    assert out["prefill"].status_code == 200
    assert got == want
    assert d.metric("kvwire_engine_kv_transfers_total", result="ok") == ok + 1
    until(lambda: held(p) == 0, "the pushed room's blocks freed")


def _replay_hashes(endpoint: str) -> set[int]:
    import zmq
    from engine_helpers import replay_all

    from kvwire.wire.events import BlockStored, decode_batch

    out: set[int] = set()
    for payload in replay_all(zmq.Context.instance(), endpoint).values():
        for ev in decode_batch(payload).events:
            if isinstance(ev, BlockStored):
                out.update(ev.block_hashes)
    return out


def test_decode_pulls_only_missing_blocks_and_publishes_them(pair):
    """A second prompt sharing the first one's prefix pulls fewer blocks; the pulled
    blocks are in the decode engine's cache and its published BlockStored events."""
    p, d = pair
    shared = PROMPT * 2
    first = {"prompt": shared + " First tail.", "max_tokens": 4}
    second = {"prompt": shared + " Second, different tail.", "max_tokens": 4}
    counts = []
    for body in (first, second):
        before = d.metric("kvwire_engine_kv_transfer_blocks_total")
        kv = vllm_prefill(p, body)
        r = d.http.post("/v1/completions", json=dict(body, kv_transfer_params=kv))
        assert r.status_code == 200, r.text
        counts.append(d.metric("kvwire_engine_kv_transfer_blocks_total") - before)
        until(lambda: held(p) == 0, "the lease released")
    assert counts[0] > 0 and 0 < counts[1] < counts[0] / 2, counts
    # the prompt's full blocks as the prefill engine cached them are now the decode's too
    ids = p.http.post("/tokenize", json={"prompt": first["prompt"]}).json()["tokens"]
    from kvwire.engine.request import block_hashes

    hashes = block_hashes(ids, 4)
    cache = d.http.get("/kvwire/cache").json()["ranks"][0]["blocks"]
    assert set(hashes) <= set(cache)
    assert set(hashes) <= _replay_hashes(d.replay)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_killed_before_the_pull(policy):
    p = Engine("prefill")
    d = Engine("decode", "--kv-load-failure", policy)
    try:
        body = {"prompt": PROMPT, "max_tokens": 6}
        want = plain(d, body)
        # the plain answer left the prompt's blocks cached on the decode engine: a
        # different prompt makes the decode engine pull
        body = {"prompt": "Another prompt. " + PROMPT, "max_tokens": 6}
        kv = vllm_prefill(p, body)
        p.kill()
        r = d.http.post("/v1/completions", json=dict(body, kv_transfer_params=kv))
        if policy == "fail":
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert "KV transfer" in err["message"] and err["code"] == 500
        else:
            assert r.status_code == 200, r.text
            want = plain(d, body)
            assert r.json()["choices"][0]["text"] == want
        assert d.metric("kvwire_engine_kv_transfers_total", result="failed") == 1
        assert d.metric("vllm:nixl_num_failed_transfers_total") == 1
        assert d.metric("kvwire_engine_kv_transfer_failures_total",
                        reason="unreachable") == 1
        # (the prefill engine is gone: telling it to free failed too)
        until(lambda: d.metric("vllm:nixl_num_failed_notifications_total") == 1,
              "the failed notification")
        # the decode engine freed what it allocated for the pull
        dump = d.http.get("/kvwire/cache").json()["ranks"][0]
        assert dump["running"] == 0 and dump["waiting"] == 0
        assert d.metric("vllm:kv_cache_usage_perc") == 0.0
    finally:
        p.close()
        d.close()


def test_prefill_killed_before_the_pull_streamed():
    """Streamed, under ``fail``: the client gets an SSE error event, then [DONE]."""
    p = Engine("prefill")
    d = Engine("decode")
    try:
        body = {"prompt": PROMPT, "max_tokens": 6}
        kv = vllm_prefill(p, body)
        p.kill()
        with d.http.stream("POST", "/v1/completions",
                           json=dict(body, kv_transfer_params=kv, stream=True)) as r:
            lines = [x for x in r.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert "error" in json.loads(lines[-2][6:])
        assert d.metric("vllm:kv_cache_usage_perc") == 0.0
    finally:
        p.close()
        d.close()


def test_lease_expires_when_no_decode_engine_pulls():
    """60 model seconds at --speed 20: the lease lasts 3 s of wall time."""
    p = Engine("prefill", "--kv-lease-s", "60")
    try:
        kv = vllm_prefill(p, {"prompt": PROMPT})
        assert held(p) == len(kv["remote_block_ids"]) > 0
        until(lambda: held(p) == 0, "the lease to expire")
        assert p.metric("kvwire_engine_kv_leases_expired_total") == 1
        assert p.metric("vllm:nixl_num_kv_expired_reqs_total") == 1
        assert p.metric("kvwire_engine_kv_leases") == 0
        # a pull after the expiry finds nothing
        r = httpx.post(f"http://127.0.0.1:{p.kv_port}/kvwire/kv/read",
                       json={"request_id": kv["remote_request_id"],
                             "block_ids": kv["remote_block_ids"]}, timeout=TIMEOUT)
        assert r.status_code == 404
    finally:
        p.close()


@pytest.mark.parametrize("kv, param", [
    ("yes", "kv_transfer_params"),
    ({"do_remote_prefill": True, "remote_port": 5600, "remote_request_id": "x",
      "remote_block_ids": [1]}, "kv_transfer_params.remote_host"),
    ({"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": "5600",
      "remote_request_id": "x", "remote_block_ids": [1]}, "kv_transfer_params.remote_port"),
    ({"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 70000,
      "remote_request_id": "x", "remote_block_ids": [1]}, "kv_transfer_params.remote_port"),
    ({"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5600,
      "remote_request_id": "x", "remote_block_ids": "1"},
     "kv_transfer_params.remote_block_ids"),
    ({"do_remote_decode": True, "do_remote_prefill": True},
     "kv_transfer_params.do_remote_prefill"),
    ({"do_remote_decode": True}, "kv_transfer_params.do_remote_decode"),  # on a decode engine
])
def test_malformed_kv_transfer_params_are_400_naming_the_field(pair, kv, param):
    _, d = pair
    r = d.http.post("/v1/completions", json={"prompt": "hi", "kv_transfer_params": kv})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("extra, param", [
    ({"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": -1},
     "bootstrap_room"),
    ({"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": "7"},
     "bootstrap_room"),
    ({"bootstrap_host": "127.0.0.1", "bootstrap_room": 7, "bootstrap_port": 0},
     "bootstrap_port"),
    ({"bootstrap_room": 7}, "bootstrap_host"),
    ({"bootstrap_host": "127.0.0.1", "bootstrap_room": 7,
      "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
])
def test_malformed_bootstrap_fields_are_400_naming_the_field(pair, extra, param):
    p, _ = pair
    r = p.http.post("/v1/completions", json={"prompt": "hi", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_bad_flags_exit_2_in_one_line():
    for flags, says in ((["--role", "sideways"], "invalid choice: 'sideways'"),
                        (["--role", "decode", "--dp-size", "2"], "needs --dp-size 1"),
                        (["--role", "decode", "--bootstrap-port", "9000"], "not decode")):
        r = subprocess.run([sys.executable, "-m", "kvwire", "engine", *flags],
                           capture_output=True, text=True, timeout=TIMEOUT)
        assert r.returncode == 2, r
        assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_sglang_worker_routes_and_bootstrap_server(pair):
    p, d = pair
    info = p.http.get("/server_info").json()
    assert info["disaggregation_mode"] == "prefill" and "model_path" not in info
    assert info["disaggregation_bootstrap_port"] == p.bootstrap_port
    assert d.http.get("/get_server_info").json()["disaggregation_mode"] == "decode"
    assert "model_path" not in p.http.get("/model_info").json()
    load = d.http.get("/get_load").json()
    assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] == 0
    boot = httpx.Client(base_url=f"http://127.0.0.1:{p.bootstrap_port}", timeout=TIMEOUT)
    with boot:
        assert boot.get("/health").status_code == 200
        q = "prefill_dp_rank={0}&prefill_cp_rank={0}&target_tp_rank={0}&target_pp_rank={0}"
        shape = boot.get("/route?" + q.format(-1)).json()
        assert shape["dp_size"] == 1 and shape["page_size"] == 4
        assert boot.get("/route?" + q.format(0)).json() == {"rank_ip": "127.0.0.1",
                                                           "rank_port": p.kv_port}
        assert boot.get("/route?prefill_dp_rank=0").status_code == 400
        assert boot.get("/route?" + q.format(3)).status_code == 404


def test_http2_preface_gets_goaway_and_the_engine_serves_on(pair):
    """SGLang's router opens some probes with HTTP/2's preface: the answer is HTTP/2's
    GOAWAY (HTTP_1_1_REQUIRED), then the connection closes."""
    p, _ = pair
    host, port = p.url[len("http://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        got = b""
        while True:
            data = s.recv(4096)
            if not data:
                break
            got += data
    assert got[3] == 0x04  # SETTINGS first
    goaway = got[9:]
    assert goaway[3] == 0x07 and int.from_bytes(goaway[13:17], "big") == 0xD
    assert p.http.get("/health").status_code == 200


def test_heartbeats_hold_the_lease_while_the_decode_engine_is_busy():
    """The decode engine runs one request at a time and is busy for ~3 s; the lease is
    1 s: only the decode engine's heartbeats (every third of a lease) keep the blocks until
    its pull."""
    lease = ("--kv-lease-s", "1", "--speed", "1", "--num-gpu-blocks", "128",
             "--step-base-ms", "10")
    p = Engine("prefill", *lease)
    d = Engine("decode", *lease, "--max-num-seqs", "1")
    try:
        out: dict[str, Any] = {}
        busy = threading.Thread(target=lambda: out.setdefault("busy", d.http.post(
            "/v1/completions", json={"prompt": "busy", "max_tokens": 300,
                                     "ignore_eos": True})))
        busy.start()
        until(lambda: d.http.get("/get_load").json()[0]["num_reqs"] == 1, "the busy request")
        body = {"prompt": PROMPT, "max_tokens": 4}
        kv = vllm_prefill(p, body)
        r = d.http.post("/v1/completions", json=dict(body, kv_transfer_params=kv))
        busy.join(TIMEOUT)
        assert out["busy"].status_code == 200
        assert r.status_code == 200, r.text
        assert d.metric("kvwire_engine_kv_transfers_total", result="ok") == 1
        assert p.metric("kvwire_engine_kv_heartbeats_total") >= 1
        assert p.metric("kvwire_engine_kv_leases_expired_total") == 0
        until(lambda: held(p) == 0, "the lease released")
    finally:
        p.close()
        d.close()


def test_client_leaving_during_the_transfer_frees_both_sides():
    """SGLang's protocol, the prefill request not sent yet: the decode engine waits for the
    push holding its blocks; its client leaves: it frees them and tells the prefill engine,
    which frees the room's blocks as soon as its prefill is done (not at the lease's end)."""
    lease = ("--kv-lease-s", "600")  # 30 s of wall time: an expiry would be too late
    p = Engine("prefill", *lease)
    d = Engine("decode", *lease)
    try:
        body = {"prompt": PROMPT, "max_tokens": 6, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": p.bootstrap_port, "bootstrap_room": 7}
        with d.http.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
            assert r.status_code == 200
            until(lambda: d.metric("kvwire_engine_kv_transfers_started_total") == 1,
                  "the pull to start")
            assert d.metric("vllm:kv_cache_usage_perc") > 0
        until(lambda: "kvwire_engine_aborted_requests_total 1" in d.http.get("/metrics").text,
              "the decode engine to abort")
        until(lambda: d.metric("vllm:kv_cache_usage_perc") == 0.0, "decode blocks freed")
        r = p.http.post("/v1/completions", json=body)
        assert r.status_code == 200
        until(lambda: held(p) == 0, "the prefill engine to free the room", timeout=10.0)
        assert p.metric("kvwire_engine_kv_leases_expired_total") == 0
    finally:
        p.close()
        d.close()


def test_client_leaving_before_the_pull_releases_the_lease():
    """vLLM's protocol: the decode engine is busy (one request at a time), the request
    waits for its turn; its client leaves: the decode engine tells the prefill engine,
    which frees the blocks long before the lease would end."""
    p = Engine("prefill", "--kv-lease-s", "600", "--num-gpu-blocks", "128")
    d = Engine("decode", "--speed", "1", "--max-num-seqs", "1", "--num-gpu-blocks", "128")
    try:
        out: dict[str, Any] = {}
        busy = threading.Thread(target=lambda: out.setdefault("busy", d.http.post(
            "/v1/completions", json={"prompt": "busy", "max_tokens": 400,
                                     "ignore_eos": True})))
        busy.start()
        until(lambda: d.http.get("/get_load").json()[0]["num_reqs"] == 1, "the busy request")
        body = {"prompt": PROMPT, "max_tokens": 4}
        kv = vllm_prefill(p, body)
        assert held(p) > 0
        with d.http.stream("POST", "/v1/completions",
                           json=dict(body, kv_transfer_params=kv, stream=True)) as r:
            assert r.status_code == 200
            until(lambda: d.http.get("/get_load").json()[0]["num_reqs"] == 2, "it to queue")
        until(lambda: held(p) == 0, "the prefill engine to free the lease", timeout=10.0)
        assert p.metric("kvwire_engine_kv_leases_released_total") == 1
        assert d.metric("kvwire_engine_kv_transfers_started_total") == 0
        busy.join(TIMEOUT)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("wrong", ["prompt", "engine_id"])
def test_a_pull_of_other_blocks_fails(pair, wrong):
    """The decode body's prompt is not the one the prefill engine computed (the hashes
    differ), or ``remote_engine_id`` names another engine (one restarted on that port):
    the pull fails (``--kv-load-failure fail``: a 500), and the lease is released."""
    p, d = pair
    before = d.metric("kvwire_engine_kv_transfers_total", result="failed")
    ids = list(range(100 + (wrong == "prompt") * 50, 140 + (wrong == "prompt") * 50))
    body = {"prompt": ids, "max_tokens": 4}
    kv = vllm_prefill(p, body)
    if wrong == "prompt":  # as long, the first token differs: every block's hash does
        body["prompt"] = [7, *ids[1:]]
        reason = "hash mismatch"
    else:
        kv["remote_engine_id"] = "0" * 16
        reason = "engine"
    r = d.http.post("/v1/completions", json=dict(body, kv_transfer_params=kv))
    assert r.status_code == 500, r.text
    assert d.metric("kvwire_engine_kv_transfers_total", result="failed") == before + 1
    assert d.metric("kvwire_engine_kv_transfer_failures_total", reason=reason) == 1
    until(lambda: held(p) == 0, "the lease released")


def test_a_small_pull_is_recomputed_and_the_lease_released():
    """The second time a prompt comes, the decode engine holds all but its last block:
    under ``--kv-recompute-blocks 2`` it computes that locally instead of pulling, and tells
    the prefill engine, which frees the lease at once."""
    p = Engine("prefill", "--kv-lease-s", "600")
    d = Engine("decode", "--kv-recompute-blocks", "2")
    try:
        body = {"prompt": PROMPT, "max_tokens": 4}
        for _ in range(2):
            kv = vllm_prefill(p, body)
            r = d.http.post("/v1/completions", json=dict(body, kv_transfer_params=kv))
            assert r.status_code == 200, r.text
            until(lambda: held(p) == 0, "the lease released", timeout=10.0)
        assert d.metric("kvwire_engine_kv_transfers_started_total") == 1
        assert d.metric("kvwire_engine_kv_local_prefills_total") == 1
        assert p.metric("kvwire_engine_kv_leases_released_total") == 2
    finally:
        p.close()
        d.close()


def test_a_prefill_engine_gone_while_a_push_is_awaited():
    """SGLang's protocol: the decode engine told the prefill engine where the room goes,
    then the prefill engine dies before its prefill: the next heartbeat finds it gone and
    the pull fails then (``unreachable``), not when the wait for the push times out."""
    lease = ("--kv-lease-s", "60")  # 3 s of wall time: heartbeats every second
    p = Engine("prefill", *lease)
    d = Engine("decode", *lease, "--kv-load-failure", "recompute")
    try:
        body = {"prompt": PROMPT, "max_tokens": 4, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": p.bootstrap_port, "bootstrap_room": 11}
        out: dict[str, Any] = {}
        t = threading.Thread(target=lambda: out.setdefault(
            "r", d.http.post("/v1/completions", json=body)))
        t.start()
        until(lambda: p.metric("kvwire_engine_kv_rooms") == 1, "the room's destination")
        p.kill()
        t.join(TIMEOUT)
        assert out["r"].status_code == 200, out["r"].text  # recomputed
        reasons = [x for x in d.http.get("/metrics").text.splitlines()
                   if x.startswith("kvwire_engine_kv_transfer_failures_total{")]
        assert len(reasons) == 1 and 'reason="unreachable"} 1' in reasons[0], reasons
        assert d.metric("vllm:kv_cache_usage_perc") == 0.0
    finally:
        p.close()
        d.close()


def test_a_room_asked_for_after_its_lease_expired_fails_at_once():
    """SGLang's protocol, the decode request late: the prefill engine's lease for the room
    expired; when the decode engine asks for the room it hears so at once (410) instead of
    waiting for a push that will not come."""
    lease = ("--kv-lease-s", "20")  # 1 s of wall time
    p = Engine("prefill", *lease)
    d = Engine("decode", *lease, "--kv-load-failure", "recompute")
    try:
        body = {"prompt": PROMPT, "max_tokens": 4, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": p.bootstrap_port, "bootstrap_room": 99}
        assert p.http.post("/v1/completions", json=body).status_code == 200
        until(lambda: p.metric("kvwire_engine_kv_leases_expired_total") == 1, "the expiry")
        assert p.metric("kvwire_engine_kv_rooms") == 1  # the room's tombstone
        r = d.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text  # recomputed
        reasons = [x for x in d.http.get("/metrics").text.splitlines()
                   if x.startswith("kvwire_engine_kv_transfer_failures_total{")]
        assert len(reasons) == 1 and 'reason="lease"} 1' in reasons[0], reasons
        assert p.metric("kvwire_engine_kv_rooms") == 0
    finally:
        p.close()
        d.close()


def test_the_room_table_is_bounded_and_its_drops_counted(monkeypatch):
    """Rooms a decode engine announces but no prefill request claims are kept up to a
    bound; past it the oldest go, counted (in-process engine, a bound of 4)."""
    from test_engine_http import EngineThread

    from kvwire.engine import EngineConfig
    from kvwire.engine.server import pd
    from kvwire.engine.server.app import EngineOptions

    monkeypatch.setattr(pd, "MAX_ROOMS", 4)
    e = EngineThread(EngineOptions(config=EngineConfig(num_gpu_blocks=64, block_size=4,
                                                       role="prefill"),
                                   events=None, kv_port=0, bootstrap_port=0))
    try:
        kv = f"http://127.0.0.1:{e.app.pd.kv_port}"
        for room in range(10):
            r = httpx.post(kv + "/kvwire/kv/room", timeout=TIMEOUT, json={
                "bootstrap_room": room, "dst_host": "127.0.0.1", "dst_port": 9,
                "from_block": 0, "num_blocks": 1})
            assert r.status_code == 200
        text = httpx.get(e.url + "/metrics", timeout=TIMEOUT).text
        assert re.search(r"kvwire_engine_kv_rooms\{[^}]*\} 4\n", text)
        assert re.search(r"kvwire_engine_kv_rooms_dropped_total\{[^}]*\} 6\n", text)
        assert sorted(e.app.pd.rooms) == [6, 7, 8, 9]
        r = httpx.post(kv + "/kvwire/kv/room", json={"bootstrap_room": "x"}, timeout=TIMEOUT)
        assert r.status_code == 400 and "bootstrap_room" in r.json()["error"]
    finally:
        e.close()


def test_no_bootstrap_server_there_fails_the_pull(pair):
    """SGLang's protocol with a bootstrap port where nothing listens: the pull fails
    (``bootstrap``) and, under ``fail``, the client gets a 500, not a hang."""
    _, d = pair
    with refused_port() as port:
        body = {"prompt": PROMPT + " (nowhere)", "max_tokens": 4,
                "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 5}
        r = d.http.post("/v1/completions", json=body)
    assert r.status_code == 500, r.text
    assert d.metric("kvwire_engine_kv_transfer_failures_total", reason="bootstrap") == 1
    assert d.http.get("/get_load").json()[0]["num_reqs"] == 0
