"""Connections handed to ``kvwire index``'s workers evenly, not hashed to them.

With ``SO_REUSEPORT`` on every worker, the kernel picks a connection's worker by a hash of
its address and port pair, and a keep-alive connection stays where it landed: wrk's 16
connections split 10/6, 9/7, 11/5, 10/6 over two workers in one bench run (bench/indexer.py's
``conns`` column), so one worker queued up to twice the requests of the other, and the
p99 was its. Here the parent alone listens: it accepts each connection and hands it to the
worker holding the fewest open connections (ties in turn), as a file descriptor over a
Unix socket pair (``SCM_RIGHTS``); the worker reports each close back on the same pair with
one byte, so the counts stay right as clients come and go. The parent is in the path of a
connection's opening only; its requests go straight to the worker.

:class:`Handout` is the parent's end, :class:`Intake` a worker's; :func:`least` the choice.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

__all__ = ["Handout", "Intake", "least"]

log = logging.getLogger("kvwire.indexer.handout")

#: connections taken from the listen queue per wake-up of the parent
ACCEPT_BATCH = 64


def least(open_conns: list[int], last: int) -> int:
    """The worker with the fewest open connections; among equals, the first after ``last``
    (so fresh one-request connections go round, not all to worker 0)."""
    n = len(open_conns)
    low = min(open_conns)
    for k in range(1, n + 1):
        w = (last + k) % n
        if open_conns[w] == low:
            return w
    return 0  # not reached


class Handout:
    """The parent's end: accepts on ``listener`` and hands each connection to a worker over
    its ``links[w]`` (the parent's end of a ``socket.socketpair``)."""

    def __init__(self, listener: socket.socket, links: list[socket.socket]) -> None:
        listener.setblocking(False)
        for s in links:
            s.setblocking(False)
        self.listener = listener
        self.links = links
        #: open connections per worker (handed minus reported closed)
        self.open = [0] * len(links)
        self.handed = 0
        self.dropped = 0  # accepted but no worker could take it (all pairs full or gone)
        self._last = len(links) - 1
        self._gone = [False] * len(links)

    def accept(self) -> int:
        """Take what the listen queue holds (up to ``ACCEPT_BATCH``); returns how many."""
        n = 0
        while n < ACCEPT_BATCH:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:  # e.g. out of file descriptors: logged, the next wake retries
                log.warning("indexer: accept failed: %s", e)
                break
            n += 1
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._give(conn)
            finally:
                conn.close()  # the worker holds its own copy now (or it was dropped)
        return n

    def _give(self, conn: socket.socket) -> None:
        tried: set[int] = set()
        while len(tried) < len(self.links):
            counts = [c if w not in tried and not self._gone[w] else 1 << 30
                      for w, c in enumerate(self.open)]
            w = least(counts, self._last)
            if w in tried or self._gone[w]:
                break
            tried.add(w)
            try:
                socket.send_fds(self.links[w], [b"c"], [conn.fileno()])
            except (BlockingIOError, InterruptedError):
                continue  # that worker's pair is full (it is stalled): another one
            except OSError:
                self._gone[w] = True
                continue
            self._last = w
            self.open[w] += 1
            self.handed += 1
            return
        self.dropped += 1
        log.warning("indexer: no worker could take a connection (dropped %d)", self.dropped)

    def closed(self, w: int) -> None:
        """``links[w]`` is readable: worker ``w`` reported closes (one byte each)."""
        try:
            data = self.links[w].recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the worker is gone (the parent's other checks stop the service)
            self._gone[w] = True
            return
        self.open[w] = max(0, self.open[w] - len(data))


class Intake:
    """A worker's end: takes the connections the parent hands over ``link`` into ``loop``
    with ``protocol()``, and reports each close (:meth:`closed`, from the protocol's
    ``connection_lost``) back to the parent."""

    def __init__(self, link: socket.socket, protocol: Callable[[], asyncio.Protocol]) -> None:
        link.setblocking(False)
        self.link = link
        self.protocol = protocol
        self.taken = 0
        self._unsent = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self.link.fileno(), self._readable)

    def _readable(self) -> None:
        loop = self._loop
        while loop is not None:
            try:
                msg, fds, _, _ = socket.recv_fds(self.link, 64, 64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                msg, fds = b"", []
            if not msg and not fds:  # the parent is gone; the control pipe says so too
                loop.remove_reader(self.link.fileno())
                self._loop = None
                return
            for fd in fds:
                sock = socket.socket(fileno=fd)
                sock.setblocking(False)
                self.taken += 1
                loop.create_task(self._take(loop, sock))

    async def _take(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        try:
            await loop.connect_accepted_socket(self.protocol, sock)
        except OSError:  # the client left before we took it: nothing to serve
            sock.close()
            self.closed()

    def closed(self) -> None:
        """One handed connection closed: tell the parent (never blocks; a full pair keeps
        the count to send with the next one)."""
        self._unsent += 1
        try:
            sent = self.link.send(b"x" * self._unsent)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._unsent = 0
            return
        self._unsent -= sent
