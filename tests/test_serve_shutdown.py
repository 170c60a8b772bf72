"""``kvwire serve --shutdown-timeout``: a SIGTERM (a rolling restart, a scale-down) drains.
Real processes on loopback: a ``kvwire engine`` that decodes slowly, ``kvwire serve`` in
front of it, a client streaming through it when the signal comes. The stream in flight ends
whole, the port stops accepting at once, idle connections close, the process then exits 0;
past the time-out the rest is cut and the engine's request aborted; a second signal stops at
once."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
from ports import refused
from test_proxy import ROOT, EngineProc, _engine_args
from test_serve import _stderr_line
from waiting import wait_for

TIMEOUT = 30.0
#: 20 ms a decode step: max_tokens N streams for about N / 50 seconds
SLOW = ("--step-base-ms", "20")


@pytest.fixture
def slow_engine() -> Iterator[EngineProc]:
    e = EngineProc(*SLOW)
    try:
        e.wait_ready()
        yield e
    finally:
        e.stop()


@pytest.fixture
def serve() -> Iterator[Callable[..., tuple[subprocess.Popen, int]]]:
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> tuple[subprocess.Popen, int]:
        p = subprocess.Popen([str(ROOT / ".venv/bin/kvwire"), "serve", "--port", "0", *args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(p)
        line = _stderr_line(p, r"streams; http://")
        port = int(line.rsplit(":", 1)[1].strip().rstrip("/"))
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health",
                                   timeout=2.0).status_code == 200, "kvwire serve healthy")
        return p, port

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(TIMEOUT)
        if p.stderr:
            p.stderr.close()


def _body(max_tokens: int) -> dict:
    return {"model": "m", "prompt": list(range(1, 200)), "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}


def _running(e: EngineProc) -> float:
    text = httpx.get(e.url + "/metrics", timeout=5.0).text
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_requests_running in the engine's /metrics")


def test_sigterm_drains_the_streams_in_flight(slow_engine, serve) -> None:
    e = slow_engine
    p, port = serve(*_engine_args([e]), "--shutdown-timeout", "30")
    url = f"http://127.0.0.1:{port}"
    idle = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    idle.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
    assert idle.recv(65536).startswith(b"HTTP/1.1 200")  # kept alive, then idle
    with httpx.Client(timeout=TIMEOUT) as c, \
            c.stream("POST", url + "/v1/completions", json=_body(100)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(x for x in lines if x.startswith("data:"))
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _stderr_line(p, r"draining: 1 request\(s\) in flight")
        wait_for(lambda: refused(port), "the port refusing new connections", TIMEOUT)
        idle.settimeout(TIMEOUT)
        assert idle.recv(65536) == b"", "the idle keep-alive connection was not closed"
        assert p.poll() is None, "kvwire serve exited with a stream in flight"
        rest = [x for x in lines if x.startswith("data:")]
        ended = time.monotonic()
    datas = [first, *rest]
    assert datas[-1] == "data: [DONE]", datas[-3:]
    chunks = [json.loads(x[5:]) for x in datas[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for ch in chunks if ch["choices"][0]["text"]) >= 90  # the whole answer
    assert ended - t0 > 0.5, "the stream ended before it could have been drained"
    _stderr_line(p, r"drained: every request in flight has ended")
    assert p.wait(TIMEOUT) == 0


@contextmanager
def _streaming(port: int, max_tokens: int) -> Iterator[Iterator[str]]:
    """A streamed completion through the proxy, its first event read: the rest of its lines
    (kept referenced: a dropped iterator closes the connection, and the proxy aborts)."""
    with httpx.Client(timeout=TIMEOUT) as c, \
            c.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                     json=_body(max_tokens)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(x for x in lines if x.startswith("data:"))
        yield lines


def test_drain_time_out_cuts_the_rest_and_aborts_upstream(slow_engine, serve) -> None:
    e = slow_engine
    p, port = serve(*_engine_args([e]), "--shutdown-timeout", "1")
    with _streaming(port, 5000) as lines:  # ~100 s of decoding
        assert _running(e) == 1
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        with pytest.raises(httpx.RemoteProtocolError):  # cut: no chunked-body end
            for _ in lines:
                pass
    assert p.wait(TIMEOUT) == 0
    assert time.monotonic() - t0 < 15.0
    _stderr_line(p, r"drain time-out: 1 request\(s\) still in flight after 1 s are cut")
    wait_for(lambda: _running(e) == 0, "the engine aborting the cut request", TIMEOUT)


@pytest.mark.parametrize("timeout", ["600", "0"], ids=["second-signal", "no-drain"])
def test_stopping_at_once(slow_engine, serve, timeout: str) -> None:
    """A second signal ends a drain at once; ``--shutdown-timeout 0`` never drains."""
    e = slow_engine
    p, port = serve(*_engine_args([e]), "--shutdown-timeout", timeout)
    with _streaming(port, 5000):
        p.send_signal(signal.SIGTERM)
        if timeout != "0":
            _stderr_line(p, r"draining: 1 request\(s\) in flight")
            assert p.poll() is None
            p.send_signal(signal.SIGINT)
        assert p.wait(TIMEOUT) == 0
    wait_for(lambda: _running(e) == 0, "the engine aborting the cut request", TIMEOUT)
