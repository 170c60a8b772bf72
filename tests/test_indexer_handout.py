"""``kvwire index --workers N``'s connection handout (router/indexer_handout), real sockets:

* ``least``: the fewest open connections, ties in turn (fresh one-request connections go
  round instead of all to worker 0);
* a ``Handout`` on a real listener with two real Unix socket pairs: 16 keep-alive
  connections go 8/8 (the kernel's ``SO_REUSEPORT`` hash split wrk's 16 as 10/6, 11/5 in
  bench/indexer.py); the fds the workers receive are the clients' connections (bytes pass
  both ways); closes reported by a worker make its next share larger;
* ``kvwire index --workers 2`` (real processes): 16 keep-alive connections held open are
  served 8 by each worker (counted from /proc: the sockets each worker process holds).
"""

from __future__ import annotations

import json
import os
import socket
import time

from engine_helpers import TIMEOUT
from hypothesis import given
from hypothesis import strategies as st
from test_indexer_http import _start, _stop
from waiting import wait_for

from kvwire.indexer.handout import Handout, least


@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.integers(0, 5))
def test_least_is_the_fewest_then_the_next_in_turn(open_conns, last) -> None:
    last %= len(open_conns)
    w = least(open_conns, last)
    assert open_conns[w] == min(open_conns)
    ahead = [(last + k) % len(open_conns) for k in range(1, len(open_conns) + 1)]
    assert all(open_conns[v] > open_conns[w] for v in ahead[:ahead.index(w)])


def _received(worker_end: socket.socket, want: int) -> list[socket.socket]:
    got: list[socket.socket] = []
    deadline = time.monotonic() + TIMEOUT
    worker_end.settimeout(0.2)
    while len(got) < want and time.monotonic() < deadline:
        try:
            _, fds, _, _ = socket.recv_fds(worker_end, 64, 64)
        except TimeoutError:
            continue
        got += [socket.socket(fileno=fd) for fd in fds]
    return got


def test_handout_spreads_connections_evenly_and_follows_closes() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    pairs = [socket.socketpair() for _ in range(2)]
    h = Handout(listener, [ours for ours, _ in pairs])
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
    try:
        wait_for(lambda: h.accept() >= 0 and h.handed == 16, "16 connections handed",
                 timeout=TIMEOUT, interval=0.01)
        assert h.open == [8, 8] and h.dropped == 0
        held = [_received(theirs, 8) for _, theirs in pairs]
        assert [len(x) for x in held] == [8, 8]
        # they are the clients' connections: a byte each way
        by_port = {c.getsockname()[1]: c for c in clients}
        for s in held[0] + held[1]:
            c = by_port.pop(s.getpeername()[1])
            c.sendall(b"q")
            assert s.recv(1) == b"q"
            s.sendall(b"a")
            assert c.recv(1) == b"a"
        assert not by_port
        # worker 1 reports three closes: the next three connections go to it
        pairs[1][1].sendall(b"xxx")
        wait_for(lambda: h.closed(1) is None and h.open == [8, 5], "the closes counted",
                 timeout=TIMEOUT, interval=0.01)
        more = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        clients += more
        wait_for(lambda: h.accept() >= 0 and h.handed == 20, "4 more handed",
                 timeout=TIMEOUT, interval=0.01)
        assert h.open == [9, 8] or h.open == [8, 9]
        assert len(_received(pairs[1][1], 3)) == 3
    finally:
        for c in clients:
            c.close()
        listener.close()
        for a, b in pairs:
            a.close()
            b.close()


def _peers_of(pid: int, port: int) -> set[int]:
    """The client ports of the established TCP connections on ``port`` that ``pid`` holds."""
    peers = {}
    with open("/proc/net/tcp") as f:
        for line in list(f)[1:]:
            parts = line.split()
            if parts[3] == "01" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                peers[parts[9]] = int(parts[2].rsplit(":", 1)[1], 16)
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in peers:
            out.add(peers[link[8:-1]])
    return out


def test_two_workers_take_eight_connections_each() -> None:
    kv, port = _start()
    clients = []
    try:
        kids = [int(p) for p in os.popen(f"pgrep -P {kv.pid} -f spawn_main").read().split()]
        assert len(kids) == 2, kids
        body = json.dumps({"token_ids": [1, 2, 3], "model": "m"}).encode()
        req = b"POST /query HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (
            len(body), body)

        def connect() -> None:  # a keep-alive connection, answered once, kept open
            c = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
            clients.append(c)
            c.sendall(req)
            assert c.recv(65536).startswith(b"HTTP/1.1 200"), "answered"

        for _ in range(16):
            connect()
        assert sorted(len(_peers_of(k, port)) for k in kids) == [8, 8]
        # worker 0's clients leave: once it has seen them go (and told the parent), the
        # next 8 connections all go to it
        gone = _peers_of(kids[0], port)
        for c in [c for c in clients if c.getsockname()[1] in gone]:
            clients.remove(c)
            c.close()
        wait_for(lambda: not _peers_of(kids[0], port), "worker 0 to see its clients go",
                 timeout=TIMEOUT, interval=0.01)
        for _ in range(8):
            connect()
        assert [len(_peers_of(k, port)) for k in kids] == [8, 8]
    finally:
        for c in clients:
            c.close()
        _stop(kv)
