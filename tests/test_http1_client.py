"""kvwire's one HTTP client (:mod:`kvwire.http1.client`) beyond the proxy's relay, which
tests/test_proxy.py covers: a streamed body handed piece by piece to a callback (the replay
client), stopping early, the idle timeout, a body broken off, whole exchanges
(:meth:`Pool.fetch`), URLs, and the engine health prober built on it
(:mod:`kvwire.proxy.health`). Every server here is a real one on loopback."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.http1.client import Pool, UpstreamError, endpoint
from kvwire.proxy.health import Prober, probe

TIMEOUT = 10.0


def _run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))  # type: ignore[arg-type]


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _server(handler: Handler) -> tuple[asyncio.AbstractServer, int]:
    """``handler`` on a loopback port; a handler still waiting when the test's loop ends
    (a kept-alive client connection) ends quietly."""

    async def quiet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except asyncio.CancelledError:
            pass

    srv = await asyncio.start_server(quiet, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":")[1])
    if n:
        await reader.readexactly(n)
    return head


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


# ---------------------------------------------------------------------------- streaming


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(st.binary(min_size=1, max_size=200), min_size=0, max_size=12),
       cuts=st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=8))
def test_stream_hands_over_the_whole_body_in_order_across_any_split(
        pieces: list[bytes], cuts: list[int]) -> None:
    """The server's chunked body, written in arbitrary byte runs (chunk framing split
    anywhere), reaches the callback whole and in order, and the connection is kept."""
    wire = HEAD + b"".join(_chunk(p) for p in pieces) + b"0\r\n\r\n"

    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_head(reader)
            at, k = 0, 0
            while at < len(wire):
                n = cuts[k % len(cuts)]
                writer.write(wire[at:at + n])
                await writer.drain()
                await asyncio.sleep(0)
                at, k = at + n, k + 1
            await reader.read()  # until the client closes
            writer.close()

        srv, port = await _server(handle)
        pool = Pool("127.0.0.1", port)
        got: list[bytes] = []
        r = await pool.request(b"POST", b"/v1/completions", [], b"{}")
        await r.stream(got.append, idle=TIMEOUT)
        assert b"".join(got) == b"".join(pieces) and r.done
        assert len(pool._idle) == 1  # (a finished answer gives its connection back)
        pool.close()
        srv.close()

    _run(main())


def test_stream_calls_back_as_bytes_arrive_and_stops_when_asked() -> None:
    """Each piece reaches the callback when it arrives (its clock read there is the arrival
    time); returning True stops reading and closes the connection, which the server sees."""
    gone = asyncio.Event

    async def main() -> None:
        closed = gone()
        sent_at: list[float] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_head(reader)
            writer.write(HEAD)
            try:
                for i in range(5):
                    await asyncio.sleep(0.05)
                    sent_at.append(time.monotonic())
                    writer.write(_chunk(b"piece %d;" % i))
                    await writer.drain()
                assert await reader.read() == b""  # the client closed the connection
            except ConnectionError:  # (or reset it, having unread bytes)
                pass
            closed.set()
            writer.close()

        srv, port = await _server(handle)
        pool = Pool("127.0.0.1", port)
        got: list[tuple[float, bytes]] = []

        def on_data(data: bytes) -> bool:
            got.append((time.monotonic(), data))
            return b"piece 2;" in data

        r = await pool.request(b"GET", b"/", [], b"")
        await r.stream(on_data, idle=TIMEOUT)
        assert [d for _, d in got] == [b"piece 0;", b"piece 1;", b"piece 2;"]
        await asyncio.wait_for(closed.wait(), TIMEOUT)
        # each piece was handed over before the server sent the next (not at the end)
        assert all(t < sent_at[i + 1] for i, (t, _) in enumerate(got))
        assert not pool._idle
        srv.close()

    _run(main())


def test_stream_reraises_the_callbacks_error_and_closes() -> None:
    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_head(reader)
            writer.write(HEAD + _chunk(b"bad"))
            await reader.read()
            writer.close()

        srv, port = await _server(handle)
        pool = Pool("127.0.0.1", port)
        r = await pool.request(b"GET", b"/", [], b"")

        def on_data(data: bytes) -> None:
            raise RuntimeError(f"cannot take {data!r}")

        with pytest.raises(RuntimeError, match="cannot take b'bad'"):
            await r.stream(on_data)
        assert not pool._idle
        srv.close()

    _run(main())


def test_stream_times_out_after_idle_seconds_without_a_byte_not_before() -> None:
    """Bytes every 0.1 s for 0.8 s with 0.3 s allowed between them: the stream ends well;
    then a server that goes silent after one piece: asyncio.TimeoutError after ~0.3 s."""

    async def main() -> None:
        async def steady(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_head(reader)
            writer.write(HEAD)
            for _ in range(8):
                await asyncio.sleep(0.1)
                writer.write(_chunk(b"."))
            writer.write(b"0\r\n\r\n")
            await reader.read()
            writer.close()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_head(reader)
            writer.write(HEAD + _chunk(b"."))
            await reader.read()
            writer.close()

        for handle, times_out in ((steady, False), (silent, True)):
            srv, port = await _server(handle)
            got: list[bytes] = []
            r = await Pool("127.0.0.1", port).request(b"GET", b"/", [], b"")
            t0 = time.monotonic()
            if times_out:
                with pytest.raises(asyncio.TimeoutError):
                    await r.stream(got.append, idle=0.3)
                assert 0.25 <= time.monotonic() - t0 < 3.0 and got == [b"."]
            else:
                await r.stream(got.append, idle=0.3)
                assert got == [b"."] * 8 and r.done
            srv.close()

    _run(main())


def test_a_body_broken_off_is_an_upstream_error() -> None:
    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_head(reader)
            writer.write(HEAD + _chunk(b"half"))
            await writer.drain()
            writer.transport.abort()

        srv, port = await _server(handle)
        got: list[bytes] = []
        r = await Pool("127.0.0.1", port).request(b"GET", b"/", [], b"")
        with pytest.raises(UpstreamError, match="mid-body"):
            await r.stream(got.append, idle=TIMEOUT)
        assert got == [b"half"]
        srv.close()

    _run(main())


def test_fetch_returns_status_and_body_and_bounds_a_silent_server() -> None:
    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await _read_head(reader)
            if b"/silent" in head:
                await reader.read()
            else:
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 4\r\n\r\nnope")
                await writer.drain()
            writer.close()

        srv, port = await _server(handle)
        pool = Pool("127.0.0.1", port)
        assert await pool.fetch(b"GET", b"/x", TIMEOUT) == (404, b"nope")
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await pool.fetch(b"GET", b"/silent", 0.2)
        assert time.monotonic() - t0 < 3.0
        srv.close()
        with pytest.raises(UpstreamError, match="cannot connect"):
            await pool.fetch(b"GET", b"/x", TIMEOUT)

    _run(main())


def test_a_request_cancelled_after_its_whole_answer_came_leaves_the_connection_alone(
        ) -> None:
    """A request cancelled between its answer's arrival and its next turn on the loop
    (the proxy cancels a prefill/decode pair's other side so) must not close the
    connection: the whole answer came in one read, so the connection is already back in
    the pool, where a request queued to run before it may have taken it. Closing it then
    left that request's head never set: it hung until its own timeout."""

    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:  # keep-alive: each request answered whole, in one write
                await _read_head(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()

        srv, port = await _server(handle)
        state: dict[str, Any] = {}

        class Hooked(Pool):
            def put(self, conn: Any) -> None:
                super().put(conn)
                first = state.pop("first", None)
                if first is not None:
                    # the first answer came whole and gave the connection back; its task
                    # has not run yet. It is cancelled now, and a request that was queued
                    # to run before it takes the connection (its synchronous part, up to
                    # the wait for its head, run here in that order)
                    first.cancel()
                    second = self.request(b"GET", b"/second", [], b"", timeout=TIMEOUT)
                    state["second"] = (second, second.send(None))

        pool = Hooked("127.0.0.1", port)
        assert (await pool.fetch(b"GET", b"/warm", TIMEOUT)) == (200, b"ok")  # one idle
        first = asyncio.get_running_loop().create_task(
            pool.request(b"GET", b"/first", [], b"", timeout=TIMEOUT))
        state["first"] = first
        with pytest.raises(asyncio.CancelledError):
            await first
        second, head = state["second"]
        await asyncio.wait([head], timeout=3.0)  # (its answer is immediate)
        assert head.done(), "the second request's head never came: its connection was closed"
        with pytest.raises(StopIteration) as done:
            second.send(None)
        r = done.value.value
        assert r.status == 200 and await r.read(TIMEOUT) == b"ok"
        pool.close()
        srv.close()

    _run(main())


async def _drive(coro: Any, fut: Any) -> Any:
    """Finish a coroutine stepped by hand (``fut``: what its last step yielded)."""
    while True:
        if fut is None:
            await asyncio.sleep(0)
        else:
            await asyncio.wait([fut])
        try:
            fut = coro.send(None)
        except StopIteration as e:
            return e.value


def test_an_answer_nobody_waits_for_any_more_does_not_give_its_connection_back() -> None:
    """The mirror case: a request cancelled first, then its whole answer arriving before
    its task ran. That answer must not give the connection back to the pool: the task
    still holds it and closes it when it runs, and a request that took it from the pool
    meanwhile would lose its head and hang until its timeout. The order is forced on
    asyncio's loop: the cancel runs in the same turn as the answer's read, before it, and
    the second request's first step runs in the next turn, before the cancelled task."""
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    got_first = threading.Event()
    send_first = threading.Event()

    def serve() -> None:  # blocking, keep-alive; the first request's answer on a signal
        conns: list[socket.socket] = []
        lsock.settimeout(TIMEOUT)
        try:
            while True:
                c, _ = lsock.accept()
                conns.append(c)
                threading.Thread(target=one, args=(c,), daemon=True).start()
        except OSError:
            pass

    def one(c: socket.socket) -> None:
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = c.recv(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                if b"/first" in head:
                    got_first.set()
                    send_first.wait(TIMEOUT)
                c.sendall(answer)
        except OSError:
            return

    threading.Thread(target=serve, daemon=True).start()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        pool = Pool("127.0.0.1", port)
        assert (await pool.fetch(b"GET", b"/warm", TIMEOUT)) == (200, b"ok")
        first = loop.create_task(pool.request(b"GET", b"/first", [], b"", timeout=TIMEOUT))
        while not got_first.is_set():
            await asyncio.sleep(0.01)
        second: dict[str, Any] = {}

        def start_second() -> None:  # (its synchronous part: it takes a pooled connection)
            c = pool.request(b"GET", b"/second", [], b"", timeout=3.0)
            second["run"] = (c, c.send(None))

        send_first.set()
        time.sleep(0.3)  # (the loop blocked: the answer is in the socket at the next poll)
        loop.call_soon(loop.call_soon, start_second)  # in the turn after the cancel's
        loop.call_soon(first.cancel)  # before the answer's read, in the same turn
        with pytest.raises(asyncio.CancelledError):
            await first
        r = await _drive(*second["run"])  # (bug: TimeoutError after 3 s, no head)
        assert r.status == 200 and await r.read(TIMEOUT) == b"ok"
        pool.close()

    try:
        _run(main())
    finally:
        lsock.close()


# ---------------------------------------------------------------------------- URLs


def test_endpoint_parses_what_the_replay_and_demo_are_given() -> None:
    assert endpoint("http://127.0.0.1:8000") == ("127.0.0.1", 8000, None, "")
    assert endpoint("http://h/base/") == ("h", 80, None, "/base")
    host, port, tls, base = endpoint("https://example.org")
    assert (host, port, base) == ("example.org", 443, "") and tls is not None
    assert endpoint("http://[::1]:9/")[:2] == ("::1", 9)
    for bad, why in (("127.0.0.1:8000", "not an http"), ("ftp://h/", "not an http"),
                     ("http://h:99999/", "bad port"), ("http://h:x/", "bad port")):
        with pytest.raises(ValueError, match=why):
            endpoint(bad)


def test_an_ipv6_host_is_bracketed_in_the_host_header() -> None:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback here")

    async def main() -> bytes:
        heads: list[bytes] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            heads.append(await _read_head(reader))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            writer.close()

        srv = await asyncio.start_server(handle, "::1", 0)
        port = srv.sockets[0].getsockname()[1]
        assert (await Pool("::1", port).fetch(b"GET", b"/", TIMEOUT))[0] == 200
        srv.close()
        return heads[0]

    assert b"\r\nhost: [::1]:" in _run(main())


# ---------------------------------------------------------------------------- health probes


class _Engine:
    """A stand-in engine's ``/health`` and ``/v1/models`` on its own loop in a thread:
    ``hang`` holds every answer until released; it counts probes, how many wait at once,
    how many are held (``hung``: a probe that came just before ``hang`` was set waits
    a moment too, but is answered) and the connections it saw closed."""

    def __init__(self) -> None:
        self.hang = False
        self.status = 200
        self.probes = self.waiting = self.most_waiting = self.hung = self.closed = 0
        self.loop = asyncio.new_event_loop()
        self.release = asyncio.Event()
        ready = threading.Event()

        async def start() -> None:
            self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(start(), self.loop)
        assert ready.wait(TIMEOUT)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await _read_head(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        self.probes += 1
        self.waiting += 1
        self.most_waiting = max(self.most_waiting, self.waiting)
        try:
            if self.hang:
                gone = asyncio.ensure_future(reader.read())
                released = asyncio.ensure_future(self.release.wait())
                self.hung += 1
                try:
                    await asyncio.wait([gone, released], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    self.hung -= 1
                gone.cancel()
                released.cancel()
                if gone.done() and not gone.cancelled():
                    self.closed += 1
                    return
            body = (b'{"object":"list","data":[{"id":"m"},{"no":"id"}]}'
                    if b" /v1/models " in head else b"ok")
            writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s"
                         % (self.status, len(body), body))
            await writer.drain()
        finally:
            self.waiting -= 1
            writer.close()

    def call(self, fn: Callable[[], Any]) -> None:
        self.loop.call_soon_threadsafe(fn)

    def close(self) -> None:
        self.call(self.release.set)
        self.call(self.server.close)
        self.call(self.loop.stop)
        self.thread.join(TIMEOUT)


class _Target:
    def __init__(self, name: str, port: int) -> None:
        self.name, self.port = name, port
        self.results: list[tuple[bool, Any]] = []


def _wait(cond: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _prober(targets: list[_Target], interval: float, timeout: float = TIMEOUT) -> Prober:
    async def check(t: _Target, refresh: bool) -> None:
        t.results.append(await probe("127.0.0.1", t.port, timeout, refresh))

    return Prober(lambda: targets, check, interval)


def test_probe_reads_health_and_the_models_with_an_id() -> None:
    e = _Engine()
    try:
        ok = _run(probe("127.0.0.1", e.port, TIMEOUT, True))
        assert ok == (True, [{"id": "m"}])
        assert _run(probe("127.0.0.1", e.port, TIMEOUT, False)) == (True, None)
        e.status = 503
        assert _run(probe("127.0.0.1", e.port, TIMEOUT, True)) == (False, None)
    finally:
        e.close()
    assert _run(probe("127.0.0.1", e.port, 1.0, True)) == (False, None)  # nobody there


def test_each_engine_is_probed_once_at_a_time_and_a_hung_one_delays_no_other() -> None:
    """h hangs (probes every 0.05 s): it has one probe waiting, never two, while f is
    probed on; released, h is probed again."""
    h, f = _Engine(), _Engine()
    th, tf = _Target("h", h.port), _Target("f", f.port)
    prober = _prober([th, tf], interval=0.05)
    try:
        prober.start()
        assert prober.probed.wait(TIMEOUT)
        h.hang = True
        _wait(lambda: h.hung == 1, "a probe of h hanging")
        n = len(tf.results)
        _wait(lambda: len(tf.results) >= n + 10, "f probed on")
        assert h.waiting == 1 and h.most_waiting == 1
        before = h.probes
        h.hang = False
        h.call(h.release.set)
        _wait(lambda: h.probes >= before + 3, "h probed again")
        assert h.most_waiting == 1
    finally:
        prober.close(TIMEOUT)
        h.close()
        f.close()


def test_at_most_sixteen_probes_wait_at_once_and_the_rest_get_their_turn() -> None:
    e = _Engine()
    e.hang = True
    targets = [_Target(f"e{i}", e.port) for i in range(20)]
    prober = _prober(targets, interval=0.05)
    try:
        prober.start()
        _wait(lambda: e.waiting == 16, "16 probes waiting")
        time.sleep(0.3)  # (rounds pass: nobody else may start)
        assert e.most_waiting == 16 and e.probes == 16
        e.hang = False
        e.call(e.release.set)
        _wait(lambda: all(t.results for t in targets), "every engine probed")
    finally:
        prober.close(TIMEOUT)
        e.close()


def test_on_a_running_loop_probes_run_there_kick_at_once_and_close_abandons() -> None:
    """Started from a running loop (the serving loop), the prober uses it (no thread);
    a kick probes at once (interval 1 h); close abandons a hung probe, whose connection
    the engine sees closed."""
    e = _Engine()
    t = _Target("e", e.port)

    async def main() -> None:
        threads = threading.active_count()
        prober = _prober([t], interval=3600.0, timeout=3600.0)
        prober.start()
        prober.start()  # (once is enough: no second prober)
        assert threading.active_count() == threads
        assert sum("Prober._run" in repr(t.get_coro()) for t in asyncio.all_tasks()) == 1
        while not prober.probed.is_set():
            await asyncio.sleep(0.01)
        assert t.results == [(True, [{"id": "m"}])]
        e.hang = True
        prober.kick()
        while e.hung < 1:
            await asyncio.sleep(0.01)
        prober.close(TIMEOUT)
        while e.closed < 1:
            await asyncio.sleep(0.01)
        assert len(t.results) == 1

    try:
        _run(main())
    finally:
        e.close()


def test_in_its_own_thread_close_ends_it_at_once_despite_a_hung_probe() -> None:
    e = _Engine()
    t = _Target("e", e.port)
    prober = _prober([t], interval=0.05, timeout=3600.0)
    try:
        prober.start()
        assert prober.probed.wait(TIMEOUT)
        e.hang = True
        _wait(lambda: e.hung == 1, "a probe hanging")
        t0 = time.monotonic()
        prober.close(TIMEOUT)
        assert prober._thread is not None and not prober._thread.is_alive()
        assert time.monotonic() - t0 < 2.0
        _wait(lambda: e.closed == 1, "the engine seeing the probe's connection closed")
    finally:
        e.close()
