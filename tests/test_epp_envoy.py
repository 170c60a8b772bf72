"""``kvwire epp`` behind a real Envoy (the bootstrap ``kvwire epp --envoy-config`` prints),
in front of a real ``kvwire fleet``, in both request-body modes gateways configure
(FULL_DUPLEX_STREAMED, the Inference Extension chart's; BUFFERED, with the answer's body
streamed through the picker or not at all): every behaviour is seen
by a client of Envoy. The openai client, streamed chunk by chunk and not; requests that
follow the cache (the engine's own ``cached_tokens`` says it held the prefix); refusals in
OpenAI's shape (400, 429, 503); the load's prefill share dropped at the answer's first
bytes, and every load released when clients go or an engine dies mid-answer; a SIGKILLed
engine gets no more traffic once a probe saw it gone; answers streaming through a picker
told to stop (SIGTERM) end whole; the pick kept by Envoy as ``envoy.lb`` metadata;
``kvwire serve``'s policies and status page on the picker."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request

import httpx
import openai
import pytest
from envoy_helpers import Envoy, Epp, Fleet, envoy_binary, until
from ports import refused

pytestmark = pytest.mark.timeout(300)

MODES = {"full_duplex": ("--request-body-mode", "FULL_DUPLEX_STREAMED"),
         "buffered": ("--request-body-mode", "BUFFERED", "--response-body-mode", "STREAMED"),
         # the lightest that keeps the load exact: Envoy keeps the picker's stream open
         # until the answer ended (or the client left), without sending its body
         "light": ("--request-body-mode", "BUFFERED", "--response-body-mode", "NONE")}
MAX_IN_FLIGHT = 4


def _world(tmp, fleet_args: tuple, epp_args: tuple):
    """A fleet, a picker (the builtin tokenizer: routed by the cache) in front of it, one
    Envoy per body mode; all stopped after."""
    envoy_binary()  # (skips loudly before anything starts)
    started: list = []
    try:
        fleet = Fleet(*fleet_args)
        started.append(fleet)
        epp = Epp(fleet.engine_args(), "--tokenizer", "builtin", "--probe-interval", "0.5",
                  *epp_args)
        started.append(epp)
        envoys = {}
        for name, flags in MODES.items():
            envoys[name] = Envoy(epp, tmp, *flags)
            started.append(envoys[name])
        yield fleet, epp, envoys
    finally:
        for p in reversed(started):
            p.stop()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Two engines (a model clock 5x wall time: a long answer lasts seconds), one picker
    refusing past ``MAX_IN_FLIGHT``, one Envoy per body mode."""
    yield from _world(tmp_path_factory.mktemp("epp"), (2, "--speed", "5"),
                      ("--max-in-flight", str(MAX_IN_FLIGHT)))


@pytest.fixture(params=list(MODES))
def mode(request, world):
    fleet, epp, envoys = world
    return envoys[request.param], epp


def _client(envoy: Envoy) -> openai.OpenAI:
    return openai.OpenAI(base_url=envoy.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _idle(epp: Epp) -> bool:
    """No request in flight anywhere, no load reserved, none active."""
    loads = epp.loads()
    return (all(n == 0 and load == 0 for n, load in loads.values())
            and epp.metric("kvwire_proxy_active") == 0)


def test_openai_client_streamed_chunk_by_chunk_and_not(mode) -> None:
    envoy, epp = mode
    c = _client(envoy)
    done = c.completions.create(model="kvwire-engine", prompt="hello there", max_tokens=5)
    assert done.choices[0].text and done.usage.completion_tokens == 5
    chat = c.chat.completions.create(model="kvwire-engine", max_tokens=4,
                                     messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content and chat.usage.prompt_tokens > 0
    # streamed: each chunk arrives as the engine makes it (about 1 ms apart here), so a
    # long answer comes in many reads, and the first well before the last
    t0 = time.monotonic()
    seen = []
    with c.chat.completions.create(model="kvwire-engine", max_tokens=400, stream=True,
                                   extra_body={"ignore_eos": True},
                                   messages=[{"role": "user", "content": "tell me"}]) as s:
        for chunk in s:
            seen.append((time.monotonic() - t0, chunk))
    text = "".join(ch.choices[0].delta.content or "" for _, ch in seen if ch.choices)
    assert len(seen) >= 50 and text, len(seen)  # (an engine step may carry a few tokens)
    # (a gateway that held the answer until its end would deliver the first chunk last)
    assert seen[0][0] < 0.5 * seen[-1][0], ("the chunks came all at once, not as made",
                                            seen[0][0], seen[-1][0])
    assert seen[-1][1].choices[0].finish_reason == "length"
    until(lambda: _idle(epp), "no load left once the answers ended", 10)


def _prompt(i: int) -> str:
    return f"document {i}: " + " ".join(f"w{i}x{j}" for j in range(300))


def test_requests_follow_the_cache(mode) -> None:
    """Each prompt asked twice: the second time it goes where the first went, so the
    engine itself (its usage, through Envoy) finds most of it cached. With two engines and
    a cache-blind pick, four repeats would all land right 1 time in 16."""
    envoy, epp = mode
    c = _client(envoy)
    tag = envoy.port  # (prompts of their own per mode: the other mode's are cached already)
    before = epp.requests()
    streams = epp.metric("kvwire_epp_streams_total")
    for i in range(4):
        c.completions.create(model="kvwire-engine", prompt=_prompt(tag * 10 + i), max_tokens=1)
    assert epp.metric("kvwire_epp_streams_total") == streams + 4  # (one per request)
    spread = {n: v - before.get(n, 0) for n, v in epp.requests().items()}
    for i in range(4):
        again = c.completions.create(model="kvwire-engine", prompt=_prompt(tag * 10 + i),
                                     max_tokens=1)
        u = again.usage
        assert u.prompt_tokens_details.cached_tokens >= u.prompt_tokens // 2, (i, u, spread)
    until(lambda: _idle(epp), "no load left", 10)


def test_a_long_new_prompt_is_picked_on_its_start(mode) -> None:
    """A never-seen prompt with ~23k characters of new text is picked on its start (the
    picker's counter), its rest tokenized while the engine works; answered whole, and
    asked again it goes where the first went, which holds it (the engine's usage)."""
    envoy, epp = mode
    c = _client(envoy)
    prompt = f"report {envoy.port}: " + " ".join(f"r{envoy.port}y{j}" for j in range(3000))
    started = epp.metric("kvwire_proxy_routed_on_start_total")
    first = c.completions.create(model="kvwire-engine", prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens > 10_000
    assert epp.metric("kvwire_proxy_routed_on_start_total") == started + 1
    again = c.completions.create(model="kvwire-engine", prompt=prompt, max_tokens=1)
    u = again.usage
    assert u.prompt_tokens_details.cached_tokens >= u.prompt_tokens // 2, u
    until(lambda: _idle(epp), "no load left", 10)


def test_unparseable_body_is_400_in_openai_s_shape(mode) -> None:
    """Refused by the picker itself, in OpenAI's shape, and counted as the proxy counts its
    own refusals (engine "none")."""
    envoy, epp = mode
    mine = 'kvwire_proxy_requests_total{engine="none",status="%d"}'
    before = {st: epp.metric(mine % st) for st in (400, 404)}
    r = httpx.post(envoy.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and "JSON" in err["message"]
    with pytest.raises(openai.BadRequestError, match="messages"):
        _client(envoy).chat.completions.create(model="kvwire-engine", messages=None)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _client(envoy).completions.create(model="no-such-model", prompt="x", max_tokens=1)
    # (the openai client retries nothing 4xx: one request each)
    assert epp.metric(mine % 400) == before[400] + 2
    assert epp.metric(mine % 404) == before[404] + 1
    until(lambda: _idle(epp), "no load left", 10)


def test_envoy_s_grpc_health_check_sees_the_picker_serving(mode) -> None:
    """Envoy's health check of the ext_proc cluster (gRPC health, the ext_proc service's
    name, as the Inference Extension's chart configures it) finds the picker healthy."""
    envoy, epp = mode

    def flags() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{envoy.admin}/clusters", timeout=5) as r:
            return "".join(line for line in r.read().decode().splitlines()
                           if line.startswith("kvwire_epp::") and "health_flags" in line)

    until(lambda: flags().endswith("health_flags::healthy"), "Envoy's health check passed",
          15, every=0.2)


def test_a_body_over_envoy_s_default_buffer_reaches_the_engine(mode) -> None:
    """1.6 MB of prompt (token ids): past Envoy's default 1 MiB buffer, which a BUFFERED body
    must fit (the printed bootstrap raises it): through the picker in every mode, and the
    engine's own refusal (its context length) comes back."""
    envoy, epp = mode
    r = httpx.post(envoy.url + "/v1/completions", timeout=60, json={
        "model": "kvwire-engine", "prompt": [77] * 400_000, "max_tokens": 1})
    assert r.status_code == 400 and "maximum context length" in r.text, (r.status_code,
                                                                        r.text[:300])
    until(lambda: _idle(epp), "no load left", 10)


def test_a_request_without_a_body_is_picked_at_its_headers(mode) -> None:
    envoy, epp = mode
    models = _client(envoy).models.list()
    assert [m.id for m in models.data] == ["kvwire-engine"]
    r = httpx.get(envoy.url + "/health", timeout=30)
    assert r.status_code == 200
    until(lambda: _idle(epp), "no load left", 10)


def _long_stream(url: str, client: httpx.Client, i: int,
                 **more: object) -> tuple[httpx.Response, object]:
    """A streamed answer of some seconds (3,000 tokens), begun (its first line read), and
    its line iterator (kept: dropping it closes the response)."""
    r = client.send(client.build_request("POST", url + "/v1/completions", json={
        "model": "kvwire-engine", "prompt": f"long story {i}", "max_tokens": 3000,
        "ignore_eos": True, "stream": True, **more}, timeout=60), stream=True)
    assert r.status_code == 200
    lines = r.iter_lines()
    next(lines)
    return r, lines


def test_clients_gone_mid_stream_leave_no_load(mode) -> None:
    """Clients that read a first chunk and drop the connection: Envoy resets the picker's
    streams; every reservation and count is released, and the engines stop (abort)."""
    envoy, epp = mode
    clients = [httpx.Client() for _ in range(3)]
    streams = []
    try:
        for i, cl in enumerate(clients):
            streams.append(_long_stream(envoy.url, cl, i))
        busy = epp.loads()
        assert sum(n for n, _ in busy.values()) == 3 and \
            epp.metric("kvwire_proxy_active") == 3, busy
    finally:
        for cl in clients:
            cl.close()  # (mid-stream: the connection goes)
    until(lambda: _idle(epp), "every load released after the clients left", 15)


def test_past_max_in_flight_is_429_with_retry_after(mode) -> None:
    envoy, epp = mode
    clients = [httpx.Client() for _ in range(MAX_IN_FLIGHT)]
    streams = []
    try:
        for i, cl in enumerate(clients):
            streams.append(_long_stream(envoy.url, cl, 100 + i))
        r = httpx.post(envoy.url + "/v1/completions", timeout=30,
                       json={"model": "kvwire-engine", "prompt": "one more", "max_tokens": 1})
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["type"] == "RateLimitError"
    finally:
        for cl in clients:
            cl.close()
    until(lambda: _idle(epp), "no load left", 15)
    r = httpx.post(envoy.url + "/v1/completions", timeout=30,
                   json={"model": "kvwire-engine", "prompt": "one more", "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_a_killed_engine_gets_no_more_traffic_then_503(tmp_path) -> None:
    """SIGKILL one engine: within a probe interval (0.3 s here, plus the probe's refused
    connection) the picker stops choosing it, and every request goes to the other; with
    both gone, an immediate 503 in OpenAI's shape; one restarted is used again."""
    envoy_binary()
    started: list = []
    try:
        # two fleets of one (a fleet stops its other engines when one dies)
        fleets = [Fleet(1, "--speed", "50") for _ in range(2)]
        started += fleets
        engines = [a for i, f in enumerate(fleets)
                   for a in ("--engine", f.specs[0].replace("engine0=", f"engine{i}=", 1))]
        epp = Epp(engines, "--probe-interval", "0.3", "--cooloff", "0.5")
        started.append(epp)
        envoy = Envoy(epp, tmp_path)
        started.append(envoy)
        c = _client(envoy)
        for i in range(4):
            c.completions.create(model="kvwire-engine", prompt=f"warm {i}", max_tokens=1)
        os.kill(fleets[0].pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        until(lambda: not epp.engines()["engine0"]["http"]["breaker_up"], "engine0 seen down",
              5)
        seen_after = time.monotonic() - t0
        before = epp.requests()
        for i in range(10):
            r = c.completions.create(model="kvwire-engine", prompt=f"after {i}", max_tokens=1)
            assert r.choices
        after = epp.requests()
        assert after["engine0"] == before["engine0"], (before, after)
        assert after["engine1"] == before["engine1"] + 10
        assert seen_after < 0.3 + 2.0, seen_after
        os.kill(fleets[1].pids[0], signal.SIGKILL)
        until(lambda: not epp.engines()["engine1"]["http"]["breaker_up"], "engine1 seen down",
              5)
        r = httpx.post(envoy.url + "/v1/completions", timeout=30,
                       json={"model": "kvwire-engine", "prompt": "anyone?", "max_tokens": 1})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == 503 and "no engine" in err["message"]
        back = Fleet(1, "--speed", "50", base=fleets[0].base)  # engine0 again, same address
        started.append(back)
        until(lambda: epp.engines()["engine0"]["http"]["breaker_up"], "engine0 back", 15)
        before = epp.requests()
        for i in range(3):
            r = c.completions.create(model="kvwire-engine", prompt=f"back {i}", max_tokens=1)
            assert r.choices
        assert epp.requests()["engine0"] == before["engine0"] + 3
        until(lambda: _idle(epp), "no load left", 10)
    finally:
        for p in reversed(started):
            p.stop()


def test_the_picker_killed_and_restarted_under_load(tmp_path) -> None:
    """SIGKILL kvwire epp with answers streaming through Envoy: nothing hangs (those
    answers end, cut, and new requests fail at once: Envoy's ext_proc filter fails closed);
    restarted on the same port, Envoy uses it again, and a prompt the engines cached before
    the restart goes where it is cached (the new picker rebuilt its index from the engines'
    event streams)."""
    envoy_binary()
    started: list = []
    try:
        fleet = Fleet(2, "--speed", "5")
        started.append(fleet)
        flags = ("--tokenizer", "builtin", "--probe-interval", "0.5")
        epp = Epp(fleet.engine_args(), *flags)
        started.append(epp)
        envoy = Envoy(epp, tmp_path)
        started.append(envoy)
        c = _client(envoy)
        for i in range(4):
            c.completions.create(model="kvwire-engine", prompt=_prompt(900 + i), max_tokens=1)
        clients = [httpx.Client() for _ in range(2)]
        streams = [_long_stream(envoy.url, cl, 900 + i) for i, cl in enumerate(clients)]
        os.kill(epp.proc.p.pid, signal.SIGKILL)
        t0 = time.monotonic()
        for _r, lines in streams:  # cut, not hung
            with pytest.raises(httpx.HTTPError):
                for _ in lines:
                    pass
        r = httpx.post(envoy.url + "/v1/completions", timeout=30,
                       json={"model": "kvwire-engine", "prompt": "hello", "max_tokens": 1})
        assert r.status_code >= 500 and time.monotonic() - t0 < 10, (r.status_code, r.text)
        for cl in clients:
            cl.close()
        again = Epp(fleet.engine_args(), *flags, grpc_port=epp.grpc_port,
                    http_port=epp.http_port)
        started.append(again)
        ok = until(lambda: httpx.post(envoy.url + "/v1/completions", timeout=30, json={
            "model": "kvwire-engine", "prompt": "hello", "max_tokens": 1}).status_code == 200,
            "Envoy using the restarted picker", 30, every=0.2)
        assert ok
        for i in range(4):
            u = c.completions.create(model="kvwire-engine", prompt=_prompt(900 + i),
                                     max_tokens=1).usage
            assert u.prompt_tokens_details.cached_tokens >= u.prompt_tokens // 2, (i, u)
        until(lambda: _idle(again), "no load left", 10)
    finally:
        for p in reversed(started):
            p.stop()


@pytest.mark.parametrize("name", list(MODES))
def test_sigterm_lets_answers_streaming_through_envoy_end_whole(name, tmp_path) -> None:
    """A rolling restart: SIGTERM kvwire epp while answers stream through Envoy. The picker
    stops taking streams (a request then fails at once: Envoy's ext_proc filter fails
    closed) but stays up while those answers go on; each ends whole (every token, then
    ``[DONE]``), and the picker then exits 0, long before ``--shutdown-timeout``."""
    import json

    envoy_binary()
    started: list = []
    try:
        fleet = Fleet(2, "--speed", "5")
        started.append(fleet)
        epp = Epp(fleet.engine_args(), "--tokenizer", "builtin", "--probe-interval", "0.5",
                  "--shutdown-timeout", "120")
        started.append(epp)
        envoy = Envoy(epp, tmp_path, *MODES[name])
        started.append(envoy)
        clients = [httpx.Client() for _ in range(2)]
        streams = [_long_stream(envoy.url, cl, 950 + i,
                                stream_options={"include_usage": True})
                   for i, cl in enumerate(clients)]
        t0 = time.monotonic()
        epp.proc.p.send_signal(signal.SIGTERM)
        until(lambda: refused(epp.grpc_port), "the picker's gRPC listener closed", 10)
        r = httpx.post(envoy.url + "/v1/completions", timeout=30,
                       json={"model": "kvwire-engine", "prompt": "hello", "max_tokens": 1})
        assert r.status_code >= 500 and time.monotonic() - t0 < 10, (r.status_code, r.text)
        assert epp.proc.p.poll() is None, "the picker left before its answers ended"
        for (resp, lines), cl in zip(streams, clients):
            rest = [line for line in lines if line]
            resp.close()
            cl.close()
            assert rest[-1] == "data: [DONE]", rest[-3:]
            usage = json.loads(rest[-2].removeprefix("data: "))["usage"]
            assert usage["completion_tokens"] == 3000, usage
            last = json.loads(rest[-3].removeprefix("data: "))
            assert last["choices"][0]["finish_reason"] == "length", last
        assert epp.proc.p.wait(30) == 0, epp.proc.text()
        assert time.monotonic() - t0 < 100
    finally:
        for p in reversed(started):
            p.stop()


def test_engines_added_and_removed_at_run_time(world, tmp_path) -> None:
    """``POST /engines`` and ``DELETE /engines/NAME`` on the picker's HTTP side (kvwire
    serve's admin routes): the added engine is picked once probed, the removed one no more."""
    fleet, _, _ = world
    epp = Epp(["--engine", fleet.specs[0]], "--admin-token", "t", "--probe-interval", "0.3")
    envoy = None
    try:
        envoy = Envoy(epp, tmp_path)
        auth = {"authorization": "Bearer t"}
        r = httpx.post(epp.url + "/engines", json={"engine": fleet.specs[1]}, headers=auth)
        assert r.status_code == 201, r.text
        until(lambda: epp.engines()["engine1"]["http"]["http_up"], "engine1 probed", 10)
        r = httpx.delete(epp.url + "/engines/engine0", headers=auth)
        assert r.status_code == 200, r.text
        c = _client(envoy)
        for i in range(3):
            r = c.completions.with_raw_response.create(model="kvwire-engine",
                                                       prompt=f"moved {i}", max_tokens=1)
            assert r.headers["x-kvwire-engine"] == "engine1"  # (set on the answer)
        got = epp.requests()
        assert got == {"engine1": 3}, got
        until(lambda: _idle(epp), "no load left", 10)
    finally:
        if envoy is not None:
            envoy.stop()
        rc = epp.stop()
    assert rc == 0, epp.proc.text()  # (SIGTERM: a clean stop)


SUBSET_FROM_HEADER = """\
          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: x-gateway-destination-endpoint-subset
                on_header_present:
                  metadata_namespace: envoy.lb.subset_hint
                  key: x-gateway-destination-endpoint-subset
                  type: STRING
                remove: true
"""


def _subset_from_header(text: str) -> str:
    """The bootstrap with a gateway's subset hint: a request header made filter metadata
    (envoy.lb.subset_hint), which the ext_proc filter forwards to the picker."""
    at = text.index("          - name: envoy.filters.http.ext_proc")
    text = text[:at] + SUBSET_FROM_HEADER + text[at:]
    forwarded = "                forwarding_namespaces:\n                  untyped: [envoy.lb]\n"
    assert forwarded in text
    return text.replace(forwarded, forwarded.replace("[envoy.lb]",
                                                     "[envoy.lb, envoy.lb.subset_hint]"))


def test_a_gateway_s_subset_hint_restricts_the_pick(world, tmp_path) -> None:
    """Filter metadata ``envoy.lb.subset_hint`` (here made by Envoy from a request header):
    the pick comes from the subset only; a subset of no engine here is 503."""
    fleet, epp, _ = world
    envoy = Envoy(epp, tmp_path, edit=_subset_from_header)
    try:
        c = _client(envoy)
        for i, want in enumerate((1, 0, 1, 0, 0, 1)):
            address = fleet.urls[want].removeprefix("http://")
            r = c.completions.with_raw_response.create(
                model="kvwire-engine", prompt=f"subset {i}", max_tokens=1,
                extra_headers={"x-gateway-destination-endpoint-subset": f"10.9.9.9:1,{address}"})
            assert r.headers["x-kvwire-engine"] == f"engine{want}", (i, want)
        r = httpx.post(envoy.url + "/v1/completions", timeout=30,
                       headers={"x-gateway-destination-endpoint-subset": "10.9.9.9:1"},
                       json={"model": "kvwire-engine", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and "subset" in r.json()["error"]["message"], r.text
        until(lambda: _idle(epp), "no load left", 10)
    finally:
        envoy.stop()


def test_the_gateway_reports_the_engine_that_served(world, tmp_path) -> None:
    """The printed bootstrap gives the picker the address that served each answer
    (``envoy.lb`` / ``x-gateway-destination-endpoint-served``, from Envoy's upstream address):
    it is the pick, and an answer said to come from elsewhere is counted. The header that
    carries it inside Envoy does not reach the client."""
    fleet, epp, _ = world
    for edit, elsewhere in ((None, 0),
                            (lambda t: t.replace("%UPSTREAM_REMOTE_ADDRESS%", "10.9.9.9:1"), 1)):
        envoy = Envoy(epp, tmp_path, *MODES["light"], edit=edit)
        try:
            reported = epp.metric("kvwire_epp_served_reported_total")
            other = epp.metric("kvwire_epp_served_elsewhere_total")
            r = httpx.post(envoy.url + "/v1/completions", timeout=60, json={
                "model": "kvwire-engine", "prompt": "who served", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert "x-gateway-destination-endpoint-served" not in r.headers
            until(lambda n=reported + 1: epp.metric("kvwire_epp_served_reported_total") == n,
                  "the served endpoint reported", 10)
            assert epp.metric("kvwire_epp_served_elsewhere_total") == other + elsewhere
        finally:
            envoy.stop()


def test_several_pickers_behind_one_envoy(world, tmp_path) -> None:
    """``--more-pickers``: Envoy spreads the requests' streams over two ``kvwire epp``
    processes; each picks by the cache (both follow every engine's events)."""
    fleet, _, _ = world
    flags = ("--tokenizer", "builtin", "--probe-interval", "0.3")
    a, b = Epp(fleet.engine_args(), *flags), None
    try:
        b = Epp(fleet.engine_args(), *flags)
        envoy = Envoy(a, tmp_path, "--more-pickers", f"127.0.0.1:{b.grpc_port}")
        try:
            # (a first health check that failed on a busy box is tried again in 5 s)
            until(lambda: envoy.healthy() == [True, True], "Envoy seeing both pickers", 20)
            c = _client(envoy)
            for i in range(12):
                c.completions.create(model="kvwire-engine", prompt=_prompt(700 + i % 3),
                                     max_tokens=1)
            got = [p.metric("kvwire_epp_streams_total") for p in (a, b)]
            assert sum(got) == 12 and min(got) > 0, got
            u = c.completions.create(model="kvwire-engine", prompt=_prompt(700),
                                     max_tokens=1).usage
            assert u.prompt_tokens_details.cached_tokens >= u.prompt_tokens // 2, u
            until(lambda: _idle(a) and _idle(b), "no load left", 10)
        finally:
            envoy.stop()
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_envoy_to_the_picker_over_tls(world, tmp_path) -> None:
    """``--grpc-tls-cert/--grpc-tls-key`` on the picker and the same certificate given to
    ``--envoy-config``: Envoy speaks to it over TLS (trusting that certificate) and its
    health check passes; requests are picked as in plaintext."""
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    fleet, _, _ = world
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True, timeout=60)
    tls = ("--grpc-tls-cert", str(cert))
    epp = Epp(fleet.engine_args(), *tls, "--grpc-tls-key", str(key))
    try:
        assert "(gRPC, TLS)" in epp.proc.text()
        envoy = Envoy(epp, tmp_path, *tls)
        try:
            assert "UpstreamTlsContext" in envoy.config.read_text()
            r = _client(envoy).completions.with_raw_response.create(
                model="kvwire-engine", prompt="over tls", max_tokens=1)
            assert r.headers["x-kvwire-engine"] in ("engine0", "engine1")
            assert epp.metric("kvwire_epp_streams_total") == 1
        finally:
            envoy.stop()
    finally:
        epp.stop()


def _recording_engine():
    """An engine that records each POST's headers and body (and answers 200): what Envoy
    delivered, byte for byte."""
    import http.server
    import threading

    got: list[tuple[dict, bytes]] = []

    class Engine(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - /health and /v1/models
            self._answer(b'{"data": [{"id": "m"}]}' if "models" in self.path else b"")

        def do_POST(self) -> None:  # noqa: N802
            n = int(self.headers.get("content-length") or 0)
            got.append((dict(self.headers.items()), self.rfile.read(n)))
            self._answer(b'{"choices": [], "usage": {"completion_tokens": 1}}')

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, got


@contextlib.contextmanager
def _picker_of_a_recording_engine():
    """``kvwire epp`` over one engine that records what it gets (no KV events), and the
    processes to stop (an Envoy the test starts goes in too): (epp, got, started)."""
    envoy_binary()
    server, got = _recording_engine()
    started: list = []
    try:
        epp = Epp(["--engine", f"e0=tcp://127.0.0.1:9,url=http://127.0.0.1:{server.server_port}"],
                  "--probe-interval", "0.3", events=False)
        started.append(epp)
        yield epp, got, started
    finally:
        for p in reversed(started):
            p.stop()
        server.shutdown()


def test_the_engine_gets_the_body_with_its_length(tmp_path) -> None:
    """Envoy drops a request's content-length in FULL_DUPLEX_STREAMED (and 1.40 drops it
    again after the picker sets it): the picker also sends it as x-kvwire-content-length,
    which the printed bootstrap's header_mutation filter makes content-length again. An
    engine that records what it got sees the length and the body, not chunks, in every
    mode."""
    import json

    with _picker_of_a_recording_engine() as (epp, got, started):
        for flags in MODES.values():
            envoy = Envoy(epp, tmp_path, *flags)
            started.append(envoy)
            body = json.dumps({"model": "m", "prompt": "x " * 5000, "max_tokens": 1}).encode()
            r = httpx.post(envoy.url + "/v1/completions", content=body, timeout=30,
                           headers={"content-type": "application/json"})
            assert r.status_code == 200, (flags, r.text)
            headers, seen = got.pop()
            lower = {k.lower(): v for k, v in headers.items()}
            assert lower.get("content-length") == str(len(body)), (flags, headers)
            assert "transfer-encoding" not in lower and "x-kvwire-content-length" not in lower
            assert seen == body


def test_a_2mb_prompt_crosses_every_flow_control_window_whole(tmp_path) -> None:
    """2 MB of prompt, more than the picker's gRPC windows (1 MiB a stream) and Envoy's:
    in FULL_DUPLEX_STREAMED Envoy streams it to the picker chunk by chunk and the picker
    echoes every chunk back; in BUFFERED it is one gRPC message over many DATA frames.
    The engine gets it byte for byte, three at a time, and the picker holds no load after."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    with _picker_of_a_recording_engine() as (epp, got, started):
        for name in ("full_duplex", "buffered"):
            envoy = Envoy(epp, tmp_path, *MODES[name])
            started.append(envoy)
            bodies = [json.dumps({"model": "m", "max_tokens": 1, "prompt": " ".join(
                f"{name}{i}w{j}" for j in range(2_000_000 // 12))}).encode() for i in range(3)]
            assert all(len(b) > 2_000_000 for b in bodies)

            def post(body: bytes, url: str = envoy.url) -> int:
                return httpx.post(url + "/v1/completions", content=body, timeout=60,
                                  headers={"content-type": "application/json"}).status_code

            with ThreadPoolExecutor(3) as pool:
                assert list(pool.map(post, bodies)) == [200] * 3, name
            assert sorted(b for _, b in got) == sorted(bodies), name
            got.clear()
            until(lambda: _idle(epp), "no load left", 10)


# ---------------------------------------------------------------------------- the load's lifecycle

PREFILL_US = 2000  # a prompt token's prefill, in wall microseconds: ~1 s for the prompts below


@pytest.fixture(scope="module")
def slow_world(tmp_path_factory):
    """One engine on the wall clock whose prefill takes about a second (its answer's headers
    come at once, its first chunk after the prefill), a picker whose reservation is exactly
    the uncached prompt blocks plus 1 (``--decode-share 0 --decode-load 1``: what remains
    once the prefill share is dropped), one Envoy per body mode."""
    yield from _world(tmp_path_factory.mktemp("epp-slow"),
                      (1, "--speed", "1", "--step-prefill-token-us", str(PREFILL_US)),
                      ("--decode-share", "0", "--decode-load", "1"))


@pytest.mark.parametrize("name", list(MODES))
def test_the_prefill_share_is_dropped_at_the_answer_s_first_bytes(slow_world, name) -> None:
    """A streamed answer through Envoy: while the engine computes the prompt (its headers
    already reached the client) the picker holds the uncached prompt blocks plus 1; once the
    first chunk arrived, and while the answer still streams, only the 1; after its end,
    nothing. In mode ``light`` (no answer body through the picker) the share is dropped at
    the answer's headers."""
    import json

    _, epp, envoys = slow_world
    prompt = f"{name}: " + " ".join(f"w{j}" for j in range(300))  # (uncached: one per mode)
    with httpx.Client() as cl:
        r = cl.send(cl.build_request("POST", envoys[name].url + "/v1/completions", json={
            "model": "kvwire-engine", "prompt": prompt, "max_tokens": 400, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}, timeout=60),
            stream=True)
        try:
            assert r.status_code == 200
            at_headers = epp.loads()["engine0"]
            lines = r.iter_lines()
            first = next(lines)
            assert first.startswith("data: {"), first
            at_first = epp.loads()["engine0"]
            rest = [line for line in lines if line]
        finally:
            r.close()
    assert rest[-1] == "data: [DONE]", rest[-3:]
    usage = json.loads(rest[-2].removeprefix("data: "))["usage"]
    blocks = usage["prompt_tokens"] / 16  # (the picker's builtin tokenizer is the engine's)
    assert usage["completion_tokens"] == 400 and blocks > 20, usage
    # in flight, only the decode share (--decode-load) left
    assert at_first[0] == 1 and at_first[1] == pytest.approx(1.0), (at_headers, at_first)
    if name == "light":
        assert at_headers[0] == 1 and at_headers[1] == pytest.approx(1.0), at_headers
    else:
        assert at_headers[0] == 1 and at_headers[1] - 1 == pytest.approx(blocks, abs=1), (
            at_headers, blocks)
    until(lambda: _idle(epp), "no load left once the answer ended", 10)


@pytest.mark.parametrize("name", list(MODES))
def test_an_engine_killed_mid_answer_leaves_no_load(name, tmp_path) -> None:
    """SIGKILL the engine while its answer streams through Envoy: the client's stream
    fails (cut, not hung) and the picker releases the request's load."""
    envoy_binary()
    started: list = []
    try:
        fleet = Fleet(1, "--speed", "5")
        started.append(fleet)
        epp = Epp(fleet.engine_args(), "--tokenizer", "builtin", "--probe-interval", "0.5")
        started.append(epp)
        envoy = Envoy(epp, tmp_path, *MODES[name])
        started.append(envoy)
        with httpx.Client() as cl:
            _r, lines = _long_stream(envoy.url, cl, 0)
            n, load = epp.loads()["engine0"]
            assert n == 1 and load > 0 and epp.metric("kvwire_proxy_active") == 1
            os.kill(fleet.pids[0], signal.SIGKILL)
            with pytest.raises(httpx.HTTPError):
                for _ in lines:
                    pass
        until(lambda: _idle(epp), "the load released after the engine died", 15)
    finally:
        for p in reversed(started):
            p.stop()


# ---------------------------------------------------------------------------- envoy.lb metadata

PICKED = """\
                - header: {key: x-test-picked, value: "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)%"}
"""
RECEIVING = "receiving_namespaces:\n                  untyped: [envoy.lb]"


def _answer_names_the_pick(text: str, receiving: bool = True) -> str:
    """The bootstrap with a header on each answer naming the pick as Envoy kept it (dynamic
    metadata ``envoy.lb``; Envoy leaves an empty header out); ``receiving`` False:
    ``envoy.lb`` left out of the ext_proc filter's receiving namespaces."""
    at = "                response_headers_to_add:\n"
    assert at in text and RECEIVING in text
    text = text.replace(at, at + PICKED)
    return text if receiving else text.replace(RECEIVING, RECEIVING.replace("envoy.lb",
                                                                            "kvwire.none"))


@pytest.mark.parametrize("name", list(MODES))
def test_envoy_keeps_the_pick_as_envoy_lb_metadata(world, tmp_path, name) -> None:
    """The pick's dynamic metadata (``envoy.lb`` / ``x-gateway-destination-endpoint``), read
    by Envoy into a header of the answer: the picked engine's address, in every body mode
    (the pick is answered at the headers or at the body). Without ``envoy.lb`` among the
    filter's receiving namespaces (which the printed bootstrap lists) Envoy drops it."""
    fleet, epp, _ = world
    for receiving in (True, False):
        envoy = Envoy(epp, tmp_path, *MODES[name],
                      edit=lambda t, r=receiving: _answer_names_the_pick(t, r))
        try:
            for i in range(3):
                r = httpx.post(envoy.url + "/v1/completions", timeout=60, json={
                    "model": "kvwire-engine", "prompt": f"metadata {name} {i}",
                    "max_tokens": 1})
                assert r.status_code == 200, r.text
                engine = r.headers["x-kvwire-engine"]
                want = fleet.urls[int(engine.removeprefix("engine"))].removeprefix("http://")
                assert r.headers.get("x-test-picked") == (want if receiving else None), (
                    receiving, engine, r.headers)
        finally:
            envoy.stop()
    until(lambda: _idle(epp), "no load left", 10)


# ---------------------------------------------------------------------------- serve's HTTP side

@pytest.fixture(scope="module")
def round_robin(world, tmp_path_factory):
    """A second picker over the world's engines with ``--policy round_robin`` (a policy
    ``kvwire serve`` takes), behind its own Envoy."""
    fleet, _, _ = world
    epp = Epp(fleet.engine_args(), "--tokenizer", "builtin", "--policy", "round_robin",
              "--probe-interval", "0.5")
    try:
        envoy = Envoy(epp, tmp_path_factory.mktemp("epp-rr"))
        try:
            yield epp, envoy
        finally:
            envoy.stop()
    finally:
        epp.stop()


def test_a_policy_flag_is_the_picker_s_policy(world, round_robin) -> None:
    """The same prompt four times: ``--policy round_robin`` alternates the engines, where the
    default policy sends every repeat where the prompt is cached."""
    _, default_epp, envoys = world
    epp, envoy = round_robin

    def engines(url: str, tag: int) -> list[str]:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        return [c.completions.with_raw_response.create(
            model="kvwire-engine", prompt=_prompt(tag), max_tokens=1
        ).headers["x-kvwire-engine"] for _ in range(4)]

    turns = engines(envoy.url, 5000)
    assert turns[0] != turns[1] and turns[:2] == turns[2:], turns
    cached = engines(envoys["full_duplex"].url, 5001)  # (a prompt of its own)
    assert len(set(cached)) == 1, cached
    until(lambda: _idle(epp) and _idle(default_epp), "no load left", 10)


def test_the_status_page_charts_the_picker_s_requests(round_robin) -> None:
    """``GET /`` on the picker's HTTP side is kvwire serve's status page, and
    ``/status.json`` charts the requests picked through Envoy, as its counters count them."""
    epp, envoy = round_robin
    c = _client(envoy)
    before = sum(epp.requests().values())
    for i in range(4):
        c.completions.create(model="kvwire-engine", prompt=f"status {i}", max_tokens=1)
    assert sum(epp.requests().values()) == before + 4
    page = httpx.get(epp.url + "/", timeout=10)
    assert page.status_code == 200 and "<title>kvwire router</title>" in page.text
    assert page.headers["content-type"].startswith("text/html")

    def charted() -> dict | None:
        st = httpx.get(epp.url + "/status.json", timeout=10).json()
        done = {n: sum(v * dt for v, dt in zip(e["requests_per_s"], e["dt"]))
                for n, e in st["engines"].items()}  # (rate x interval: the answers again)
        return st if done == pytest.approx(epp.requests(), abs=0.01) else None

    st = until(charted, "the picks charted", 20, every=0.5)
    assert st["proxy"] is True and set(st["engines"]) == {"engine0", "engine1"}
    assert all(e["proxied"] and e["alive"] for e in st["engines"].values())


def test_a_registered_stream_is_indexed_but_never_picked(world, tmp_path) -> None:
    """``POST /register`` on the picker (the indexer API of ``kvwire serve``) follows an
    event stream into the index (``/registrations`` sees it alive), but only engines with
    ``url=`` are picked: with round robin, every request still goes to the one engine."""
    fleet, _, _ = world
    epp = Epp(["--engine", fleet.specs[0]], "--policy", "round_robin")
    envoy = None
    try:
        envoy = Envoy(epp, tmp_path)
        events = fleet.specs[1].split(",")[0].partition("=")[2]
        r = httpx.post(epp.url + "/register", timeout=10, json={
            "endpoint": events, "type": "vLLM", "modelname": "kvwire-engine",
            "tenant_id": "default", "instance_id": "registered", "block_size": 16})
        assert r.status_code == 200, r.text
        until(lambda: [g["alive"] for g in httpx.get(epp.url + "/registrations",
                                                     timeout=10).json()] == [True],
              "the registered stream followed", 15)
        c = _client(envoy)
        got = [c.completions.with_raw_response.create(
            model="kvwire-engine", prompt=f"registered {i}", max_tokens=1
        ).headers["x-kvwire-engine"] for i in range(4)]
        assert got == ["engine0"] * 4 and set(epp.engines()) == {"engine0"}, got
    finally:
        if envoy is not None:
            envoy.stop()
        epp.stop()
