"""The consumer behind ``kvwire listen``: one live stream, gaps filled from replay.

Delivers each batch once, in seq order, when the replay buffer allows; says so whenever
it cannot (an unfillable gap, a publisher restart). The multi-stream subscriber with
snapshots and epochs lives in :mod:`kvwire.subscriber`; this is the small, dependable
single-stream path that works against any reference publisher.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import msgspec
import zmq

from .curve import CurveClient
from .endpoint import check_endpoint, subscriber_binds
from .events import BatchDecoder, DecodeError, EventError, KVEventBatch
from .replay import ReplayClient, ReplayTimeout

__all__ = ["Delivery", "Listener", "ListenerStats"]


class Delivery(msgspec.Struct, frozen=True):
    """One batch handed to the application."""

    seq: int
    batch: KVEventBatch
    replayed: bool = False


class ListenerStats(msgspec.Struct):
    received: int = 0
    delivered: int = 0
    gaps: int = 0
    missed: int = 0
    filled: int = 0
    restarts: int = 0
    bad_frames: int = 0
    bad_payloads: int = 0
    bad_events: int = 0
    replay_errors: int = 0


class Listener:
    """Subscribe to ``endpoint`` (bind if it is a bind endpoint, else connect)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        ctx: zmq.Context | None = None,
        replay_timeout: float = 2.0,
        from_seq: int | None = None,
        curve: CurveClient | None = None,
        on_notice: Callable[[str], None] | None = None,
    ) -> None:
        check_endpoint(endpoint)
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint, "replay_endpoint")
        self.endpoint = endpoint
        self.topic = topic.encode()
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        if curve is not None:
            curve.apply(self._sub)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        (self._sub.bind if subscriber_binds(endpoint) else self._sub.connect)(endpoint)
        self._replay = (
            ReplayClient(self._ctx, replay_endpoint, replay_timeout, curve)
            if replay_endpoint
            else None
        )
        self._notice = on_notice or (lambda msg: None)
        self._decoder = BatchDecoder(on_error=self._bad_event)
        #: Next seq to deliver; None until the first live message (or ``from_seq``).
        self._expected: int | None = from_seq
        self.stats = ListenerStats()

    def _bad_event(self, err: EventError) -> None:
        self.stats.bad_events += 1
        self._notice(f"skipped malformed event: {err.message}")

    def _decode(self, seq: int, payload: bytes, replayed: bool = False) -> Delivery | None:
        try:
            batch = self._decoder.decode(payload)
        except DecodeError as e:
            self.stats.bad_payloads += 1
            self._notice(f"seq {seq}: undecodable payload: {e}")
            return None
        self.stats.delivered += 1
        return Delivery(seq, batch, replayed)

    def _fill(self, start: int, end: int) -> Iterator[Delivery]:
        """Replay ``start..end`` inclusive; report whatever stays missing."""
        got = start
        if self._replay is not None:
            try:
                for seq, payload in self._replay.replay(start, until=end):
                    if seq < got:
                        continue
                    if seq > got:
                        self._missing(got, seq - 1)
                    got = seq + 1
                    self.stats.filled += 1
                    d = self._decode(seq, payload, replayed=True)
                    if d is not None:
                        yield d
            except ReplayTimeout as e:
                self.stats.replay_errors += 1
                self._notice(str(e))
        if got <= end:
            self._missing(got, end)

    def _missing(self, start: int, end: int) -> None:
        self.stats.missed += end - start + 1
        how = "not in the replay buffer" if self._replay else "no replay endpoint"
        self._notice(f"lost seq {start}..{end} ({end - start + 1} batches): {how}")

    def on_message(self, frames: list[bytes]) -> Iterator[Delivery]:
        """Feed one live multipart message; yields the deliveries it releases, in order."""
        self.stats.received += 1
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.bad_frames += 1
            self._notice(f"ignored live message with {len(frames)} frames (expected 3)")
            return
        seq = int.from_bytes(frames[1], "big")
        exp = self._expected
        if exp is not None and seq < exp:
            self.stats.restarts += 1
            self._notice(f"seq went back from {exp - 1} to {seq}: publisher restarted")
        elif exp is not None and seq > exp:
            self.stats.gaps += 1
            self._notice(f"gap: seq {exp}..{seq - 1} missing, asking replay")
            yield from self._fill(exp, seq - 1)
        self._expected = seq + 1
        d = self._decode(seq, frames[2])
        if d is not None:
            yield d

    def poll(self, timeout: float | None = None) -> list[Delivery]:
        """Wait up to ``timeout`` seconds for one live message; return what it released."""
        try:
            frames = self._sub.recv_multipart(zmq.NOBLOCK)  # no poll syscall when busy
        except zmq.Again:
            if not self._sub.poll(None if timeout is None else timeout * 1000):
                return []
            frames = self._sub.recv_multipart()
        return list(self.on_message(frames))

    def __iter__(self) -> Iterator[Delivery]:
        while True:
            yield from self.poll(None)

    def run(self, count: int | None = None, duration: float | None = None) -> Iterator[Delivery]:
        """Deliveries until ``count`` batches or ``duration`` seconds, whichever first."""
        deadline = None if duration is None else time.monotonic() + duration
        n = 0
        while count is None or n < count:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            for d in self.poll(0.1 if left is None else min(0.1, left)):
                yield d
                n += 1
                if count is not None and n >= count:
                    return

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close()
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
