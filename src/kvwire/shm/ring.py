"""Pure slot-state logic of the single-writer / N-reader ring (no I/O, no shm).

Sequence numbers count messages from 0. Message ``s`` lives in slot ``s % n_chunks``;
the slot's seq word holds ``s + 1`` once the message is complete ("published").
Reader ``r`` has consumed everything below ``rseq[r]``. The writer may fill
slot for ``wseq`` only when every live reader is less than ``n_chunks`` behind, i.e.
it will not overwrite a slot some live reader has yet to read.

queue.py uses these functions on values it loads from shared memory;
tests/test_shm_ring.py drives :class:`RingModel` with hypothesis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def slot_of(seq: int, n_chunks: int) -> int:
    """Slot index of message ``seq``."""
    return seq % n_chunks


def published_word(seq: int) -> int:
    """Value of a slot's seq word once message ``seq`` is fully written into it."""
    return seq + 1


def is_readable(slot_word: int, rseq: int) -> bool:
    """Whether a reader whose next message is ``rseq`` may read the slot holding ``slot_word``."""
    return slot_word == rseq + 1


def can_write(wseq: int, min_rseq: int, n_chunks: int) -> bool:
    """Whether message ``wseq`` may be written given the slowest live reader's position."""
    return wseq - min_rseq < n_chunks


def min_live_rseq(rseqs: Sequence[int], live: Sequence[bool], wseq: int) -> int:
    """Position of the slowest live reader (``wseq`` when no reader is live)."""
    m = wseq
    for r, ok in zip(rseqs, live):
        if ok and r < m:
            m = r
    return m


def blocking_readers(rseqs: Sequence[int], live: Sequence[bool], wseq: int,
                     n_chunks: int) -> list[int]:
    """Indices of live readers that prevent message ``wseq`` from being written."""
    return [i for i, (r, ok) in enumerate(zip(rseqs, live)) if ok and wseq - r >= n_chunks]


@dataclass
class RingModel:
    """Executable specification of the ring, used as the oracle in property tests."""

    n_reader: int
    n_chunks: int
    slots: list[int] = field(default_factory=list)  # seq words
    payloads: list[object] = field(default_factory=list)
    rseqs: list[int] = field(default_factory=list)
    live: list[bool] = field(default_factory=list)
    wseq: int = 0

    def __post_init__(self) -> None:
        self.slots = [0] * self.n_chunks
        self.payloads = [None] * self.n_chunks
        self.rseqs = [0] * self.n_reader
        self.live = [True] * self.n_reader

    def can_write(self) -> bool:
        return can_write(self.wseq, min_live_rseq(self.rseqs, self.live, self.wseq),
                         self.n_chunks)

    def write(self, payload: object) -> bool:
        if not self.can_write():
            return False
        i = slot_of(self.wseq, self.n_chunks)
        self.payloads[i] = payload  # data first ...
        self.slots[i] = published_word(self.wseq)  # ... seq word last
        self.wseq += 1
        return True

    def can_read(self, r: int) -> bool:
        return is_readable(self.slots[slot_of(self.rseqs[r], self.n_chunks)], self.rseqs[r])

    def read(self, r: int) -> tuple[bool, object]:
        if not self.live[r] or not self.can_read(r):
            return False, None
        payload = self.payloads[slot_of(self.rseqs[r], self.n_chunks)]
        self.rseqs[r] += 1
        return True, payload

    def drop(self, r: int) -> None:
        self.live[r] = False
