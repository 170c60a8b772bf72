"""Ports for the servers tests start: free just now, below the kernel's ephemeral range.

A port found by binding port 0 is an ephemeral one: until the server it is meant for binds it,
the kernel may hand the same port to any outgoing connection on the box (a test's HTTP
client, a ZeroMQ socket, a probe), and that server then fails to start. Ports below the
ephemeral range are only ever taken by an explicit bind. Each port is handed out once per
process (a cursor walks the range from a place set by the pid), so a test is not given a
port that an earlier test's lingering process or socket still holds.
"""

from __future__ import annotations

import os
import socket

__all__ = ["free_port", "free_ports", "port_free", "refused"]

LOW = 10_000  # below: well-known and registered services


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


_HIGH = _ephemeral_low()
_cursor = LOW + (os.getpid() * 7919) % max(1, _HIGH - LOW)


def port_free(port: int) -> bool:
    """Nothing holds ``port`` on any address right now (a wildcard bind would succeed)."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _ephemeral(span: int) -> int:
    """The old way, when the range below the ephemeral one is too small to walk."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + span <= 65_535 and all(port_free(base + i) for i in range(span)):
            return base
    raise RuntimeError("no free port found")


def free_port(span: int = 1, offsets: tuple[int, ...] | range = (0,)) -> int:
    """A port P with ``P + offset + i`` free for every offset and ``i < span`` (a fleet's
    layout: DP ranks side by side, events and replay ports 1000 apart)."""
    global _cursor
    top = max(offsets) + span
    width = _HIGH - top - LOW
    if width < 1000:
        if top > span:
            raise RuntimeError(f"no room for offsets up to {max(offsets)} below port {_HIGH}")
        return _ephemeral(span)
    for _ in range(width // span + 1):
        base = LOW + (_cursor - LOW) % width
        _cursor = base + span
        if all(port_free(base + off + i) for off in offsets for i in range(span)):
            return base
    raise RuntimeError(f"no free run of {span} ports below {_HIGH}")


def free_ports(n: int) -> list[int]:
    """``n`` different free ports."""
    return [free_port() for _ in range(n)]


def refused(port: int) -> bool:
    """A connection to ``port`` on loopback is refused: nothing listens there (any more)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    return False
