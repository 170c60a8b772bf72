"""A correct replay client: DEALER, both reply layouts, bounded waits.

A REQ socket accepts only the first reply of a multi-message answer, so replay needs a
DEALER. Publishers since vLLM 0.26 frame replies as ``[b"", topic, seq, payload]``; older
ones as ``[b"", seq, payload]``; both end with a seq of -1.
"""

from __future__ import annotations

from collections.abc import Iterator

import zmq

from . import wire
from .curve import CurveClient

__all__ = ["ReplayClient", "ReplayTimeout", "parse_replay_reply"]


class ReplayTimeout(TimeoutError):
    """The replay endpoint did not finish answering in time."""


def parse_replay_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of one reply message, ``(-1, b"")`` for the end marker, None if bad."""
    body = frames[1:] if frames and frames[0] == b"" else frames
    if len(body) == 3:  # topic, seq, payload
        seq_f, payload = body[1], body[2]
    elif len(body) == 2:  # legacy: seq, payload
        seq_f, payload = body[0], body[1]
    else:
        return None
    if len(seq_f) != 8:
        return None
    return wire.unpack_seq(seq_f), payload


class ReplayClient:
    """Asks a publisher's replay endpoint for buffered batches from a start seq."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        timeout: float = 2.0,
        curve: CurveClient | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._curve = curve
        self._ctx = ctx
        self._sock = self._connect()
        self.bad_replies = 0

    def _connect(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._curve.apply(sock)
        sock.connect(self.endpoint)
        return sock

    def replay(self, start: int, until: int | None = None) -> Iterator[tuple[int, bytes]]:
        """Yield ``(seq, payload)`` for buffered seqs ``>= start`` (stop after ``until``).

        Raises :class:`ReplayTimeout` if no reply arrives within ``timeout`` seconds of the
        previous one; the socket is then recreated so a late answer cannot leak into the
        next request.
        """
        self._sock.send_multipart([b"", wire.pack_seq(start)])
        done = False
        try:
            while True:
                if not self._sock.poll(self.timeout * 1000):
                    raise ReplayTimeout(
                        f"replay endpoint {self.endpoint} sent nothing for {self.timeout}s"
                    )
                parsed = parse_replay_reply(self._sock.recv_multipart())
                if parsed is None:
                    self.bad_replies += 1
                    continue
                seq, payload = parsed
                if seq < 0:
                    done = True
                    return
                if until is not None and seq > until:
                    continue
                yield seq, payload
        finally:
            if not done:  # abandoned mid-answer: drop the socket and its queued replies
                self._sock.close(linger=0)
                self._sock = self._connect()

    def close(self) -> None:
        self._sock.close(linger=0)

