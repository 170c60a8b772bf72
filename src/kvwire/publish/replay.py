"""The replay ring: the last ``buffer_steps`` batches by seq, for clients filling gaps.

A slot holds ``(seq, payload bytes)`` for a batch the sender sent, or ``(seq, batch)`` for
one the engine thread dropped from the live path (queue full), which is encoded only if a
replay asks for it. The ring is preallocated and indexed by ``seq % size``; the sender's
hot loop writes ``slots`` directly.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from ..wire import protocol

__all__ = ["ReplayJob", "ReplayRing"]

#: Replay answers: the client is gone (True), busy (False) or the frames were queued.
SendTo = Callable[[bytes, list[bytes]], "bool | None"]


class ReplayJob:
    """An in-flight replay reply to one client: seqs ``next..end`` then the end marker."""

    __slots__ = ("ident", "next", "end", "started")

    def __init__(self, ident: bytes, start: int, end: int) -> None:
        self.ident = ident
        self.next = start
        self.end = end
        self.started = time.monotonic()


class ReplayRing:
    """Fixed-size ring of the newest batches; see the module docstring."""

    __slots__ = ("slots", "size", "_encode", "_unencodable")

    def __init__(self, size: int, encode: Callable[[int, Any], bytes | None]) -> None:
        self.size = size
        self.slots: list[tuple[int, Any] | None] = [None] * size
        self._encode = encode
        self._unencodable: collections.deque[int] = collections.deque(maxlen=64)

    def keep_dropped(self, seq: int, batch: Any) -> None:
        """Engine thread, publisher lock held: keep a dropped batch replayable, unencoded."""
        self.slots[seq % self.size] = (seq, batch)

    def oldest(self, done_seq: int) -> int:
        """Oldest seq still held, given the last seq the sender handled (-1: none yet)."""
        return max(0, done_seq - self.size + 1) if done_seq >= 0 else -1

    def start_for(self, requested: int, last: int) -> int:
        """Where a replay asked from ``requested`` really starts (older seqs are gone)."""
        return max(requested, last - self.size + 1, 0)

    def advance(
        self, job: ReplayJob, send_to: SendTo, topic: bytes, done_seq: int, budget: int,
        on_sent: Callable[[], None],
    ) -> bool:
        """Send up to ``budget`` batches of ``job``; True when it is finished (or its
        client is gone). Seqs still queued for the sender are waited for, never skipped."""
        slots, n = self.slots, self.size
        while job.next <= job.end and budget:
            seq = job.next
            slot = slots[seq % n]
            if (slot is None or slot[0] != seq) and seq > done_seq:
                return False  # still queued for the sender: wait for it, don't skip it
            if slot is not None and slot[0] == seq:
                payload = slot[1]
                if type(payload) is not bytes:  # dropped from the live path: encode now
                    payload = self._encode_dropped(seq, payload)
                    if payload is None:
                        job.next = seq + 1
                        continue
                r = send_to(job.ident, [b"", topic, seq.to_bytes(8, "big"), payload])
                if r is None:
                    return True
                if r is False:
                    return False
                on_sent()
                budget -= 1
            job.next = seq + 1
        if job.next > job.end:
            return send_to(job.ident, [b"", b"", protocol.END_SEQ, b""]) is not False
        return False

    def _encode_dropped(self, seq: int, batch: Any) -> bytes | None:
        """Encode a batch kept as an object; an unencodable one is counted once (the slot
        is the engine thread's too, so it is not rewritten from here)."""
        if seq in self._unencodable:
            return None
        payload = self._encode(seq, batch)
        if payload is None:
            self._unencodable.append(seq)
        return payload
