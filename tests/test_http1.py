"""kvwire's one HTTP/1.1 server (:mod:`kvwire.http1.server`), checked under each of its route
tables (the engine's, the router's, the indexer's) over real loopback sockets: bad HTTP gets a 400 JSON answer and the connection is
closed; pipelined requests are answered in order on one connection; a body over the cap
gets 413; ``Connection: close`` is honoured. Plus :class:`InOrder` alone."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvwire import http1
from kvwire.http1.server import Request, Routes, Server
from kvwire.indexer.server import IndexHttp

TIMEOUT = 10.0


def _engine_app(conn: Request) -> None:
    conn.respond(200, b'{"path":"%s"}' % conn.path)


def _index_handle(method: str, path: str, body: bytes) -> tuple[int, bytes]:
    return 200, b'{"path":"%s"}' % path.encode()


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, int]]:
    """The server under the engine's, the router's and the indexer's route tables, on one
    loop in a thread."""
    loop = asyncio.new_event_loop()
    ports: dict[str, int] = {}
    up = threading.Event()
    front = Routes(headers=True, fallback=_engine_app)
    front.claim((b"/v1/completions",), _engine_app, prefix=b"/v1/responses",
                render=http1.HttpError.openai, cap=lambda: 1 << 20)

    async def main() -> None:
        made = {
            "engine": Routes(render=http1.HttpError.openai, headers=(b"x-data-parallel-rank",),
                             fallback=_engine_app, fail_started="end"),
            "front": front,
            "indexer": IndexHttp(_index_handle),
        }
        for name, routes in made.items():
            srv = Server(routes)
            await srv.start(host="127.0.0.1", port=0)
            ports[name] = srv.port
        up.set()

    t = threading.Thread(target=lambda: (loop.run_until_complete(main()), loop.run_forever()),
                         daemon=True)
    t.start()
    assert up.wait(TIMEOUT)
    yield ports
    loop.call_soon_threadsafe(loop.stop)
    t.join(TIMEOUT)


def _read_all(s: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk


def _responses(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Split content-length framed responses."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        hdrs = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        n = int(hdrs["content-length"])
        out.append((status, hdrs, rest[:n]))
        raw = rest[n:]
    return out


NAMES = ("engine", "front", "indexer")


@pytest.mark.parametrize("name", NAMES)
def test_bad_http_gets_400_json_and_the_connection_closes(servers: dict[str, int],
                                                         name: str) -> None:
    with socket.create_connection(("127.0.0.1", servers[name]), timeout=TIMEOUT) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        [(status, hdrs, body)] = _responses(_read_all(s))  # then closed: recv gave b""
    assert status == 400 and hdrs["connection"] == "close"
    assert hdrs["content-type"] == "application/json" and "error" in json.loads(body)


@pytest.mark.parametrize("name", NAMES)
def test_pipelined_requests_are_answered_in_order(servers: dict[str, int], name: str) -> None:
    reqs = b"".join(b"GET /p%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(5))
    last = b"GET /last HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", servers[name]), timeout=TIMEOUT) as s:
        s.sendall(reqs + last)  # one write: the server reads them all at once
        got = _responses(_read_all(s))  # ``connection: close`` on the last ends it
    assert [json.loads(b)["path"] for _, _, b in got] == [f"/p{i}" for i in range(5)] + ["/last"]
    assert all(st == 200 for st, _, _ in got)
    assert got[-1][1].get("connection") == "close"


@pytest.mark.parametrize("name", NAMES)
def test_a_body_over_the_cap_is_read_on_answered_413_and_the_connection_goes_on(
        servers: dict[str, int], name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """(The cap is lowered for the test.) Closing at once with the body still arriving
    would reset the connection before the client read its 413 (it did, now and then)."""
    import kvwire.http1.server as hs

    monkeypatch.setattr(hs, "MAX_BODY", 1000)
    body = b"x" * 200_000
    with socket.create_connection(("127.0.0.1", servers[name]), timeout=TIMEOUT) as s:
        s.sendall(b"POST /big HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
                  b"GET /after HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
                  % (len(body), body))
        (big, _, err), (after, _, out) = _responses(_read_all(s))
    assert big == 413 and b"too large" in err
    assert after == 200 and json.loads(out)["path"] == "/after"


# --------------------------------------------------------------------------- InOrder alone


class _Req:
    def __init__(self, keep_alive: bool = True) -> None:
        self.keep_alive = keep_alive
        self.on_close: Any = None


class _Transport:
    closed = False

    def close(self) -> None:
        self.closed = True


def test_in_order_runs_one_at_a_time_and_closes_when_asked() -> None:
    ran: list[_Req] = []
    order = http1.InOrder(ran.append)
    a, b, c = _Req(), _Req(keep_alive=False), _Req()
    for r in (a, b, c):
        order.add(r)
    assert ran == [a]  # b and c wait for a's answer
    t = _Transport()
    order.finished(b, t)  # not the current one: nothing happens
    assert ran == [a] and order.current is a
    order.finished(a, t)
    assert ran == [a, b] and not t.closed
    order.finished(b, t)  # b asked for close: c is never run
    assert t.closed and ran == [a, b] and order.current is None


def test_in_order_lost_tells_the_current_request_once_and_survives_its_error(
        caplog: pytest.LogCaptureFixture) -> None:
    order = http1.InOrder(lambda r: None)
    a, b = _Req(), _Req()
    calls: list[int] = []

    def boom() -> None:
        calls.append(1)
        raise RuntimeError("listener failed")

    a.on_close = boom
    b.on_close = lambda: calls.append(2)
    order.add(a)
    order.add(b)
    order.lost()
    order.lost()
    assert calls == [1] and order.current is None and not order.queue  # b never ran
    assert "on_close failed" in caplog.text


@pytest.mark.parametrize(("status", "line"), [
    (200, b"HTTP/1.1 200 OK\r\n"), (413, b"HTTP/1.1 413 Request Entity Too Large\r\n"),
    (299, b"HTTP/1.1 299 Unknown\r\n")])
def test_status_lines(status: int, line: bytes) -> None:
    assert http1.status_line(status) == line


# --------------------------------------------------------------------------- the route table


@pytest.fixture(scope="module")
def routed() -> Iterator[int]:
    """A route table with each kind of route, served in a thread."""
    from kvwire.http1.server import serve_in_thread

    r = Routes(headers=(b"x-keep",))
    r.add("GET", "/plain", lambda q: q.respond(200, b'{"x-keep":"%s","other":"%s"}' % (
        q.header(b"x-keep") or b"", q.header(b"x-other") or b"")))
    r.add("DELETE", "/things/{name}", lambda q: q.respond(200, json.dumps(q.params).encode()))

    async def later(q: Request) -> None:
        await asyncio.sleep(0)
        raise http1.HttpError(409, "taken", "conflict")

    r.add("POST", "/later", later)
    r.add("GET", "/boom", lambda q: 1 / 0)
    r.claim((b"/v1/x",), lambda q: q.respond(200, b"%d" % q.too_large), prefix=b"/v1/p/",
            render=http1.HttpError.openai, cap=lambda: 10)
    seen: list[str] = []
    r.on_error = lambda q, e: seen.append(e.reason)
    server, thread, port = serve_in_thread(r)
    yield port
    server.should_exit = True
    thread.join(TIMEOUT)


def _ask(port: int, raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
        s.sendall(raw)
        return _responses(_read_all(s))


def test_routes_answer_404_405_in_kvwire_shape_and_patterns_capture(routed: int) -> None:
    close = b"host: x\r\nconnection: close\r\n\r\n"
    [(st, _, body)] = _ask(routed, b"GET /nowhere HTTP/1.1\r\n" + close)
    assert st == 404 and json.loads(body) == {"error": "Not Found: GET /nowhere",
                                              "reason": "http_404"}
    [(st, _, body)] = _ask(routed, b"POST /plain HTTP/1.1\r\ncontent-length: 0\r\n" + close)
    assert st == 405 and json.loads(body)["reason"] == "http_405"
    [(st, _, body)] = _ask(routed, b"GET /things/a%20b HTTP/1.1\r\n" + close)
    assert st == 405  # the pattern's path, another method
    [(st, _, body)] = _ask(routed, b"DELETE /things/a%20b HTTP/1.1\r\n" + close)
    assert st == 200 and json.loads(body) == {"name": "a b"}


def test_only_the_headers_asked_for_are_kept(routed: int) -> None:
    [(st, _, body)] = _ask(routed, b"GET /plain HTTP/1.1\r\nX-Keep: 1\r\nX-Other: 2\r\n"
                           b"host: x\r\nconnection: close\r\n\r\n")
    assert st == 200 and json.loads(body) == {"x-keep": "1", "other": ""}


def test_errors_of_async_and_failing_handlers(routed: int) -> None:
    close = b"host: x\r\nconnection: close\r\n\r\n"
    [(st, _, body)] = _ask(routed, b"POST /later HTTP/1.1\r\ncontent-length: 0\r\n" + close)
    assert st == 409 and json.loads(body) == {"error": "taken", "reason": "conflict"}
    [(st, _, body)] = _ask(routed, b"GET /boom HTTP/1.1\r\n" + close)
    assert st == 500 and json.loads(body)["reason"] == "internal"


def test_claimed_paths_have_their_cap_and_rendering(routed: int) -> None:
    """A claimed path's body over its own cap is its handler's to answer; an error on a
    path under its prefix is rendered OpenAI's way."""
    close = b"host: x\r\nconnection: close\r\n\r\n"
    [(st, _, body)] = _ask(routed, b"POST /v1/x HTTP/1.1\r\ncontent-length: 11\r\n" + close[:-2]
                           + b"\r\n" + b"x" * 11)
    assert st == 200 and body == b"1"
    [(st, _, body)] = _ask(routed, b"POST /v1/x HTTP/1.1\r\ncontent-length: 10\r\n" + close[:-2]
                           + b"\r\n" + b"x" * 10)
    assert st == 200 and body == b"0"
    with socket.create_connection(("127.0.0.1", routed), timeout=TIMEOUT) as s:
        s.sendall(b"GET /v1/p/q HTTP/1.1\r\nhost: x\r\n\r\n"
                  b"GET /v1/p/q HTTP/1.1\r\nno colon here\r\n\r\n")
        raw = _read_all(s)
    (st, _, body), (bad, _, err) = _responses(raw)
    assert st == 200 and bad == 400 and json.loads(err)["error"]["type"] == "BadRequestError"
    [(bad, _, err)] = _ask(routed, b"GET /plain HTTP/1.1\r\nno colon here\r\n\r\n")
    assert bad == 400 and json.loads(err)["reason"] == "bad_http"


def test_http_error_renders_two_ways() -> None:
    e = http1.HttpError(404, 'no "x"', "unknown", param="model", type="NotFoundError")
    assert json.loads(e.kvwire()) == {"error": 'no "x"', "reason": "unknown"}
    assert json.loads(e.openai()) == {"error": {"message": 'no "x"', "type": "NotFoundError",
                                                "param": "model", "code": 404}}
    assert json.loads(http1.HttpError(400, "m").openai())["error"]["type"] == "BadRequestError"


def test_serve_imports_no_framework() -> None:
    """kvwire serve's whole HTTP face loads without FastAPI, starlette, pydantic, uvicorn."""
    import subprocess
    import sys

    code = ("import sys; from kvwire.serve.app import build_app; import kvwire.cli.serve; "
            "import kvwire.engine.server.app; import kvwire.indexer.server; "
            "print(sorted(m for m in ('fastapi', 'starlette', 'pydantic', 'uvicorn') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"


def test_on_start_and_on_stop_run_on_the_serving_loop() -> None:
    """``Server(on_start=, on_stop=)``: both run on the loop that answers requests (what
    should share it: the proxy's probes), on_start before the server reports started, so
    before any request; on_stop as it stops."""
    from kvwire.http1.server import serve_in_thread

    seen: dict[str, Any] = {}

    def hello(req: Request) -> None:
        seen["request"] = asyncio.get_running_loop()
        req.respond(200, b"{}")

    server = Server(Routes(fallback=hello),
                    on_start=lambda: seen.setdefault(
                        "start", (asyncio.get_running_loop(), server.started)),
                    on_stop=lambda: seen.setdefault("stop", asyncio.get_running_loop()))
    server, thread, port = serve_in_thread(server.routes, server=server)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
            s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            assert _read_all(s).startswith(b"HTTP/1.1 200")
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
    loop, started = seen["start"]
    assert started is False and loop is seen["request"] is seen["stop"] is server.loop


def test_a_listening_socket_queues_a_client_before_the_server_runs() -> None:
    """``kvwire index`` prints its address as soon as it has the socket: a client that
    connects at once is queued until the server takes it, not refused."""
    from kvwire.http1.server import listen

    sock = listen("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname(), timeout=5):
            pass
    finally:
        sock.close()
