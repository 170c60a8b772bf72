"""The NATS consumer's command lines in real processes: ``kvwire listen nats://`` shows the
items, ``kvwire serve --nats`` routes by a cache that arrived through JetStream."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("nats")

from nats_writer import Writer  # noqa: E402
from test_nats_consumer import _write, run  # noqa: E402
from waiting import wait_for  # noqa: E402

BS = 16


def _toks(seed: int, blocks: int = 8) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(blocks * BS)]


async def _two_engines(w: Writer) -> None:
    """Engines a and b on JetStream, each holding 8 blocks of its own prompt."""
    from kvwire.wire.events import BlockStored

    for e in ("a", "b"):
        await w.start(e, 0, epoch=1)
    await w.batch("a", 0, [BlockStored(list(range(100, 108)), None, _toks(1), BS, None)])
    await w.batch("b", 0, [BlockStored(list(range(200, 208)), None, _toks(2), BS, None)])


def test_kvwire_listen_nats_in_a_real_process(nats_server: Any) -> None:
    """``kvwire listen nats://... --json --count N`` shows the items (and the plain output
    names the streams); the summary on stderr has the NATS counters."""
    import json
    import subprocess
    import sys

    async def plan(w: Writer) -> None:
        await w.start("a", 0, epoch=4)
        await w.start("b", 2, epoch=1)
        await w.batches("a", 0, 7)
        await w.batches("b", 2, 5)

    run(_write(nats_server.url, plan))
    base = [sys.executable, "-m", "kvwire", "listen", nats_server.url, "--stream", "KVWIRE"]
    r = subprocess.run(base + ["--json", "--count", "12", "--duration", "60"],
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in r.stdout.splitlines()]
    a = [(x["kind"], x.get("seq")) for x in recs if x["stream"] == "a/dp0"]
    assert a == [("reset", None), ("snapshot", 0)] + [("batch", s) for s in range(1, 8)]
    assert {x["stream"] for x in recs} == {"a/dp0", "b/dp2"}
    assert "nats: 16 messages, 12 batches, 0 gaps" in r.stderr, r.stderr
    # a subject filter narrows it to one engine; plain output
    r = subprocess.run(base + ["--subject", "kvwire.events.b.>", "--count", "5",
                               "--duration", "60", "--no-view"],
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    assert "b/dp2" in r.stdout and "a/dp0" not in r.stdout
    assert "b/dp2: snapshot at seq 0" in r.stderr
    # a bad durable name: one clear line, exit 2
    r = subprocess.run(base + ["--durable", "no.dots", "--count", "1"],
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 2 and "durable consumer name 'no.dots'" in r.stderr, r.stderr


def test_kvwire_serve_nats_routes_by_a_cache_that_came_through_jetstream(
        nats_server: Any) -> None:
    """``kvwire serve --nats URL`` (a real process): the engines are found on the stream, the
    index is fed from JetStream, and a prompt goes to the engine whose cache holds it."""
    import re
    import subprocess
    import sys

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("httptools")

    bs = BS
    toks = _toks
    run(_write(nats_server.url, _two_engines))
    p = subprocess.Popen([sys.executable, "-m", "kvwire", "serve", "--nats", nats_server.url,
                          "--port", "0", "--block-size", str(bs)],
                         stderr=subprocess.PIPE, text=True)
    try:
        port = None
        deadline = time.monotonic() + 60
        while port is None:
            assert time.monotonic() < deadline and p.poll() is None, "serve did not start"
            m = re.search(r"2 streams; http://127\.0\.0\.1:(\d+)/", p.stderr.readline())
            port = int(m.group(1)) if m else None
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            def indexed() -> bool:
                eng = http.get("/engines").json()
                return all(sum(eng[e]["ranks"][0]["blocks"].values()) == 8 for e in "ab")

            wait_for(indexed, timeout=60, interval=0.05, what="both engines indexed from JetStream")
            for seed, want in ((1, "a"), (2, "b")):
                r = http.post("/score", json={"token_ids": toks(seed)})
                assert r.status_code == 200 and r.json()["engine"] == want, r.text
                assert r.json()["overlap"][want] == 8
    finally:
        p.terminate()
        p.wait(10)


def test_kvwire_serve_nats_started_before_its_stream_waits_for_it(nats_server: Any) -> None:
    """``kvwire serve --nats URL`` started before any bridge has created its stream (a real
    process): it says so on stderr, naming the streams the server does have (a misspelt
    ``--stream`` shows there), is up and unhealthy, and routes by the cache once a bridge
    creates the stream and an engine writes to it."""
    import re
    import subprocess
    import sys

    httpx = pytest.importorskip("httpx")

    async def other(w: Writer) -> None:  # another application's stream on the same server
        pass

    async def engine_a(w: Writer) -> None:
        await w.start("a", 0, epoch=1)
        await w.batch("a", 0, [BlockStored(list(range(100, 108)), None, _toks(1), BS, None)])

    from kvwire.wire.events import BlockStored

    run(_write(nats_server.url, other, Writer(nats_server.url, stream="OTHER",
                                              prefix="other.events")))
    p = subprocess.Popen([sys.executable, "-m", "kvwire", "serve", "--nats", nats_server.url,
                          "--port", "0", "--block-size", str(BS)],
                         stderr=subprocess.PIPE, text=True)
    try:
        seen, url = "", None
        deadline = time.monotonic() + 60
        while url is None:
            assert time.monotonic() < deadline and p.poll() is None, f"no start: {seen}"
            line = p.stderr.readline()
            seen += line
            m = re.search(r"(http://\S+)/", line)
            url = m.group(1) if m else None
        assert (f"stream KVWIRE does not exist at {nats_server.url} yet (streams there: "
                "OTHER): waiting for a bridge to create it") in seen, seen
        with httpx.Client(base_url=url, timeout=10) as http:
            assert http.get("/health").status_code == 503
            run(_write(nats_server.url, engine_a))  # the stream created, then a's blocks

            def routes() -> Any:
                r = http.post("/score", json={"token_ids": _toks(1)})
                return (r.json()["engine"], r.json()["overlap"]["a"]) if r.is_success else None

            wait_for(lambda: routes() == ("a", 8), timeout=60, interval=0.05,
                     what="a found on the stream created after the router started")
            wait_for(lambda: http.get("/health").status_code == 200, timeout=60,
                     interval=0.05, what="healthy with a live engine")
    finally:
        p.terminate()
        p.wait(10)
    assert p.returncode == 0


def test_kvwire_serve_nats_routes_to_engines_that_appear_later(nats_server: Any) -> None:
    """``kvwire serve --nats URL`` without ``--nats-engine`` (a real process), started on a
    stream with no engine yet: an engine whose first message comes after the router started
    is routed to by its cache, a DP rank
    seen later widens it, and one an operator removed stays out whatever it still writes,
    until it is added again (then it is found and widened as before)."""
    import subprocess
    import sys

    httpx = pytest.importorskip("httpx")
    from test_indexer_api import _url

    from kvwire.wire.events import BlockStored

    auth = {"authorization": "Bearer t0ken"}

    async def engine_a(w: Writer) -> None:
        await w.start("a", 0, epoch=1)
        await w.batch("a", 0, [BlockStored(list(range(100, 108)), None, _toks(1), BS, None)])

    async def engine_c(w: Writer) -> None:  # starts late, one rank
        await w.start("c", 0, epoch=1)
        await w.batch("c", 0, [BlockStored(list(range(300, 308)), None, _toks(3), BS, None)])

    async def c_rank_1(w: Writer) -> None:
        await w.start("c", 1, epoch=1)
        await w.batch("c", 1, [BlockStored(list(range(400, 408)), None, _toks(4), BS, None)])

    async def c_rank_1_again(w: Writer) -> None:
        await w.batch("c", 1, [BlockStored(list(range(600, 608)), 407, _toks(6), BS, None)])

    async def c_then_d(w: Writer) -> None:  # (the consumer reads them in this order)
        await w.batch("c", 0, [BlockStored(list(range(500, 508)), 307, _toks(5), BS, None)])
        await w.start("d", 0, epoch=1)

    async def nothing(w: Writer) -> None:  # the stream, as a bridge creates it, no engine
        pass

    w = run(_write(nats_server.url, nothing))
    p = subprocess.Popen([sys.executable, "-m", "kvwire", "serve", "--nats", nats_server.url,
                          "--port", "0", "--block-size", str(BS), "--admin-token", "t0ken"],
                         stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=_url(p), timeout=10) as http:
            def routes(seed: int) -> tuple[str, int, float] | None:
                r = http.post("/score", json={"token_ids": _toks(seed)})
                if r.status_code == 503:  # (no engine yet)
                    return None
                j = r.json()
                return j["engine"], j["rank"], max(j["overlap"].values())

            # started before any engine: up, unhealthy, and saying why
            r = http.post("/score", json={"token_ids": _toks(1)})
            assert r.status_code == 503 and "no engine on the JetStream stream yet" in r.text
            assert http.get("/health").status_code == 503
            run(_write(nats_server.url, engine_a, w))
            wait_for(lambda: routes(1) == ("a", 0, 8), timeout=60, interval=0.05,
                     what="a, the first engine, found and indexed from JetStream")
            wait_for(lambda: http.get("/health").status_code == 200, timeout=60,
                     interval=0.05, what="healthy with a live engine")
            run(_write(nats_server.url, engine_c, w))
            wait_for(lambda: routes(3) == ("c", 0, 8), timeout=60, interval=0.05,
                     what="c, started after the router, found and routed to")
            run(_write(nats_server.url, c_rank_1, w))
            wait_for(lambda: routes(4) == ("c", 1, 8), timeout=60, interval=0.05,
                     what="c's second rank seen: c widened")
            assert len(http.get("/engines").json()["c"]["ranks"]) == 2
            assert "kvwire_router_engines_discovered_total 3.0" in http.get("/metrics").text
            assert set(http.post("/score", json={"token_ids": _toks(4)}).json()["overlap"]) \
                == {"a", "c/dp0", "c/dp1"}  # (its answers name the ranks now)

            assert http.delete("/engines/c", headers=auth).status_code == 200
            run(_write(nats_server.url, c_then_d, w))
            wait_for(lambda: "d" in http.get("/engines").json(), timeout=60, interval=0.05,
                     what="d found (after c's last batch)")
            assert "c" not in http.get("/engines").json()  # removed: not found again
            assert set(http.post("/score", json={"token_ids": _toks(3)}).json()["overlap"]) \
                == {"a", "d"}
            r = http.post("/engines", headers=auth, json={"engine": "c"})  # one rank, ...
            assert r.status_code == 201, r.text
            assert routes(3) == ("c", 0, 8)
            run(_write(nats_server.url, c_rank_1_again, w))
            wait_for(lambda: routes(4) == ("c", 1, 8), timeout=60, interval=0.05,
                     what="... widened again by what its second rank writes")
            r = http.post("/score", json={"token_ids": _toks(3) + _toks(5)}).json()
            assert (r["engine"], r["overlap"]["c/dp0"]) == ("c", 16)  # what it wrote meanwhile
    finally:
        p.terminate()
        p.wait(10)


def test_listen_nats_without_nats_py_says_how_to_get_it() -> None:
    """Without the nats extra: one line naming the extra, exit 2 (nats-py is installed here,
    so it is made unimportable in the child: the one way to cause this for real)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['nats'] = None\n"
            "from kvwire.cli.main import main\n"
            "sys.exit(main(['listen', 'nats://127.0.0.1:1', '--count', '1']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "pip install 'kvwire[nats]'" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------- a NATS that is not there

KVWIRE = [__import__("sys").executable, "-m", "kvwire"]


@pytest.fixture
def silent_url() -> Any:
    """A loopback port that accepts connections and never says a word (no NATS INFO)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"nats://127.0.0.1:{s.getsockname()[1]}"


def _kvwire(*argv: str, timeout: float = 60) -> Any:
    import subprocess

    return subprocess.run([*KVWIRE, *argv], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("argv", [
    ["serve", "--nats", "URL", "--port", "0", "--connect-timeout", "1"],
    ["serve", "--nats", "URL", "--nats-engine", "a:2", "--port", "0", "--connect-timeout", "1"],
    ["listen", "URL", "--count", "1", "--connect-timeout", "1"],
    ["listen", "URL", "--duration", "1"],  # (the connect gives up when --duration is over)
    ["bridge", "--nats", "URL", "--engine", "a=tcp://127.0.0.1:1", "--connect-timeout", "1"],
], ids=["serve", "serve-nats-engine", "listen-count", "listen-duration", "bridge"])
def test_a_refused_nats_is_one_line_and_exit_1(refused_url: str, argv: list[str]) -> None:
    """Each command that connects to NATS gives up after its bound, says where and why in
    one line (one warning before it, no tracebacks), and exits 1 (docs/operations.md)."""
    t0 = time.monotonic()
    r = _kvwire(*[refused_url if a == "URL" else a for a in argv])
    took = time.monotonic() - t0
    want = f"cannot connect to NATS at {refused_url}: connection refused (gave up after 1s)"
    assert r.returncode == 1 and f"kvwire {argv[0]}: {want}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) <= 2, lines  # the first failed try's warning, then the error
    assert took < 30, took


def test_a_silent_nats_is_no_answer(silent_url: str) -> None:
    """A server that accepts and never speaks is told apart from a refused one."""
    r = _kvwire("bridge", "--nats", silent_url, "--engine", "a=tcp://127.0.0.1:1",
                "--connect-timeout", "1")
    assert r.returncode == 1, r.stderr
    assert f"cannot connect to NATS at {silent_url}: no answer" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_bridge_says_refused_at_once_and_a_signal_stops_the_wait(refused_url: str) -> None:
    """The reason comes with the first failed try, not after the whole --connect-timeout;
    SIGTERM while it still tries ends the command cleanly."""
    import subprocess

    p = subprocess.Popen([*KVWIRE, "bridge", "--nats", refused_url, "--engine",
                          "a=tcp://127.0.0.1:1", "--connect-timeout", "120"],
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stderr is not None
        line = p.stderr.readline()  # the first failed try's line (the test's timeout bounds it)
        assert f"cannot connect to NATS at {refused_url}: connection refused; retrying for up " \
               "to 120s" in line, line
        assert p.poll() is None  # still trying: said before its timeout
        p.terminate()
        assert p.wait(30) == 0
        assert "stopped while starting" in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


@pytest.mark.parametrize(("level", "shown"), [(None, True), ("error", False)])
def test_bridge_log_level_reaches_kvwire_loggers(refused_url: str, level: str | None,
                                                  shown: bool) -> None:
    """``--log-level`` under ``kvwire bridge`` sets kvwire's own loggers (logging used to be
    set up by ``kvwire`` before the subcommand could ask)."""
    extra = [] if level is None else ["--log-level", level]
    r = _kvwire("bridge", "--nats", refused_url, "--engine", "a=tcp://127.0.0.1:1",
                "--connect-timeout", "1", *extra)
    assert r.returncode == 1, r.stderr
    assert ("kvwire.nats WARNING cannot connect" in r.stderr) is shown, r.stderr


@pytest.mark.parametrize("argv", [
    ["bridge", "--nats", "http://127.0.0.1:4222", "--engine", "a=tcp://127.0.0.1:1"],
    ["serve", "--nats", "http://127.0.0.1:4222"],
])
def test_a_nats_url_with_another_scheme_is_a_usage_error(argv: list[str]) -> None:
    r = _kvwire(*argv)
    assert r.returncode == 2, r.stderr
    assert "argument --nats: --nats 'http://127.0.0.1:4222': scheme 'http' is not one of " \
           "nats://, tls://, ws://, wss://" in r.stderr, r.stderr


def test_a_consumer_that_cannot_connect_says_why_and_stops_when_asked(
        refused_url: str, caplog: Any) -> None:
    """The library side (a Subscriber on NatsStreams): the first connect is tried in bounded
    rounds, one log line each naming the reason, and close() does not wait on nats-py's
    endless first connect."""
    import logging

    from kvwire.consume.subscriber import Subscriber
    from kvwire.nats.consumer import CONNECT_TRY
    from kvwire.nats.streams import NatsStreams

    want = (f"cannot connect to NATS at {refused_url}: connection refused (gave up after "
            f"{CONNECT_TRY:g}s)")
    caplog.set_level(logging.WARNING, logger="kvwire.nats.consumer")
    sub = Subscriber([NatsStreams(refused_url)])
    try:
        wait_for(lambda: any(r.getMessage() == want for r in caplog.records), timeout=30,
              what="a round of tries to end with one line naming the reason")
    finally:
        t0 = time.monotonic()
        sub.close()
        took = time.monotonic() - t0
    assert took < CONNECT_TRY + 2, took


def test_kvwire_serve_nats_with_registrations_follows_both(nats_server: Any, tmp_path) -> None:
    """``kvwire serve --nats URL --registrations FILE`` (a real process): the routing engines
    come from JetStream while a ZeroMQ publisher registered over RFC #1403 ``/register`` is
    followed beside them in the same subscriber; ``/score`` routes by the JetStream caches,
    ``/query`` answers the registered stream's blocks, and after a restart the registration
    is read back from the file and its blocks rebuilt from the publisher's snapshot."""
    import subprocess
    import sys

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("httptools")
    from test_indexer_api import _stop, _url, stored

    from kvwire.publish.publisher import ZmqEventPublisher

    bs = BS
    toks = _toks
    run(_write(nats_server.url, _two_engines))
    regs = tmp_path / "regs.json"
    pub = ZmqEventPublisher(endpoint=f"ipc://{tmp_path}/z.live",
                            replay_endpoint=f"ipc://{tmp_path}/z.replay",
                            heartbeat_interval=0.2)
    z = toks(3, 5)
    argv = [sys.executable, "-m", "kvwire", "serve", "--nats", nats_server.url, "--port", "0",
            "--block-size", str(bs), "--registrations", str(regs)]

    def answer(url: str) -> dict:
        r = httpx.post(url + "/query", json={"model": "m", "token_ids": z}, timeout=5)
        assert r.status_code == 200, r.text
        return {k: v["longest_matched"] for k, v in r.json()["default"].items()}

    def routes(url: str) -> None:
        for seed, want in ((1, "a"), (2, "b")):
            def right(seed: int = seed, want: str = want) -> bool:
                r = httpx.post(url + "/score", json={"token_ids": toks(seed)}, timeout=5)
                assert r.status_code == 200, r.text
                return r.json()["engine"] == want and r.json()["overlap"][want] == 8

            wait_for(right, timeout=60, interval=0.05, what=f"engine {want} indexed from JetStream")

    try:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        try:
            url = _url(proc)
            routes(url)
            r = httpx.post(url + "/register", timeout=10, json={
                "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                "type": "vLLM", "modelname": "m", "instance_id": "z", "block_size": bs})
            assert r.status_code == 200, r.text
            pub.publish(stored(z, 1, bs=bs))
            wait_for(lambda: answer(url) == {"z": 5 * bs}, timeout=60, interval=0.05,
                     what="the registered stream indexed")
            # the registered stream is answered by the indexer API, not a routing target
            r = httpx.post(url + "/score", json={"token_ids": z}, timeout=5)
            assert r.status_code == 200 and r.json()["engine"] in ("a", "b"), r.text
        finally:
            _stop(proc)
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        try:
            url = _url(proc)
            assert [x["instance_id"] for x in httpx.get(url + "/registrations").json()] == ["z"]
            wait_for(lambda: answer(url) == {"z": 5 * bs}, timeout=60, interval=0.05,
                     what="rebuilt after the restart")
            routes(url)
        finally:
            _stop(proc)
    finally:
        pub.shutdown(timeout=1)
