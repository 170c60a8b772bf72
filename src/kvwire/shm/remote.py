"""Remote readers: the writer publishes every message on a ZeroMQ XPUB over TCP.

Each remote reader subscribes to everything plus a topic naming its rank. XPUB
reports that topic's subscription (so the writer knows when all remote readers
are connected: no slow-joiner loss) and its unsubscription when the reader's
connection drops (so a dead remote reader is detected like a dead local one).
Readers watch the connection with a socket monitor and ZMTP heartbeats, so a
dead writer is detected too.
"""

from __future__ import annotations

import socket as _socket
from typing import Any

import zmq

KIND_MSG = b"M"
KIND_READY = b"R"
KIND_SHUTDOWN = b"S"
_ZERO_COPY_MIN = 64 * 1024
_HEARTBEAT_MS = 1000


def rank_topic(rank: int) -> bytes:
    return b"\xffkvwire-rank-%d" % rank


def _parse_rank(topic: bytes) -> int | None:
    prefix = b"\xffkvwire-rank-"
    if topic.startswith(prefix):
        try:
            return int(topic[len(prefix):])
        except ValueError:
            return None
    return None


def default_ip() -> str:
    """An address of this host that others can reach (no packet is sent)."""
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        s.connect(("10.254.254.254", 1))
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


class RemotePublisher:
    """Writer side: one XPUB bound on ``connect_ip``; tracks remote readers by rank."""

    def __init__(self, connect_ip: str, n_remote: int) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop: every reader gets every message
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * _HEARTBEAT_MS)
        ipv6 = ":" in connect_ip
        if ipv6:
            self.sock.setsockopt(zmq.IPV6, 1)
        host = f"[{connect_ip}]" if ipv6 else connect_ip
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.addr = f"tcp://{host}:{port}"
        self.ipv6 = ipv6
        self.n_remote = n_remote
        self.joined: set[int] = set()
        self.gone: set[int] = set()

    def poll_events(self, timeout_ms: int = 0) -> None:
        """Consume (un)subscription notices: who joined, who left."""
        while self.sock.poll(timeout_ms, zmq.POLLIN):
            timeout_ms = 0
            msg = self.sock.recv()
            rank = _parse_rank(msg[1:])
            if rank is None:
                continue
            if msg[:1] == b"\x01":
                self.joined.add(rank)
            elif msg[:1] == b"\x00" and rank in self.joined:
                self.gone.add(rank)

    def all_joined(self) -> bool:
        return len(self.joined) >= self.n_remote

    def send(self, kind: bytes, frames: list[Any]) -> None:
        if not frames:
            self.sock.send(kind)
            return
        self.sock.send(kind, zmq.SNDMORE)
        last = len(frames) - 1
        for i, f in enumerate(frames):
            big = len(memoryview(f)) >= _ZERO_COPY_MIN
            self.sock.send(f, zmq.SNDMORE if i < last else 0, copy=not big)

    def close(self) -> None:
        self.sock.close()


class RemoteSubscriber:
    """Reader side: SUB connected to the writer, plus a monitor for disconnects."""

    def __init__(self, addr: str, rank: int, ipv6: bool) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        if ipv6:
            self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * _HEARTBEAT_MS)
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.SUBSCRIBE, rank_topic(rank))
        self.sock.connect(addr)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.connected_once = False
        self.disconnected = False

    def wait(self, timeout_ms: int | None) -> bool:
        """True when a message is ready; updates ``disconnected`` from monitor events."""
        events = dict(self.poller.poll(timeout_ms))
        if self.monitor in events:
            from zmq.utils.monitor import recv_monitor_message

            while self.monitor.poll(0):
                ev = recv_monitor_message(self.monitor)
                if ev["event"] == zmq.EVENT_CONNECTED:
                    self.connected_once = True
                elif ev["event"] == zmq.EVENT_DISCONNECTED and self.connected_once:
                    self.disconnected = True
        return self.sock in events or bool(self.sock.poll(0))

    def recv(self) -> list[zmq.Frame]:
        return self.sock.recv_multipart(copy=False)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
