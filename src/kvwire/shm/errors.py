"""Typed errors of the shm queue, so callers can tell a dead peer from a slow one."""

from __future__ import annotations


class ShmQueueError(RuntimeError):
    """Base class of every error raised by :mod:`kvwire.shm`."""


class PeerDeadError(ShmQueueError):
    """A peer process of the queue has exited; waiting for it would hang forever."""


class ReaderDeadError(PeerDeadError):
    """One or more readers died. ``ranks`` names them; ``drop_reader`` lets the writer go on."""

    def __init__(self, ranks: list[int], detail: str = "") -> None:
        self.ranks = sorted(ranks)
        msg = f"reader rank(s) {self.ranks} died"
        if detail:
            msg += f" ({detail})"
        msg += "; call MessageQueue.drop_reader(rank) or drop_dead_readers() to continue without them"
        super().__init__(msg)


class WriterDeadError(PeerDeadError):
    """The writer died; no further message can ever arrive."""


class QueueShutdownError(ShmQueueError):
    """The queue was shut down (by the writer, or locally to cancel a blocked call)."""


class ShmCapacityError(OSError):
    """/dev/shm has too little free space for the requested ring."""
