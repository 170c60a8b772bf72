"""kvwire.shm: a shared-memory broadcast queue, drop-in for vLLM's ``MessageQueue``.

One writer, N readers, every reader gets every message in order; local readers
share a ring in /dev/shm, remote ones get the frames over ZeroMQ TCP. A dead
peer raises a typed error instead of hanging. See docs/shm.md.

``NATIVE`` tells whether the per-message path runs in C (``kvwire.shm._ring``, built by
setup.py when a compiler is there; ``KVWIRE_SHM_PURE=1`` turns it off) or in Python.
"""

# The sides: importing each registers it with MessageQueue, whose constructors build them.
from . import reader, remote_reader, writer  # noqa: F401
from ._native import NATIVE
from .buffer import ShmRingBuffer, shm_free_bytes
from .errors import (
    PeerDeadError,
    QueueShutdownError,
    ReaderDeadError,
    ShmCapacityError,
    ShmQueueError,
    WriterDeadError,
)
from .group import StatelessGroup, node_key
from .handle import Handle
from .queue import MessageQueue
from .serializer import MsgspecSerializer, PickleSerializer, Serializer

__all__ = [
    "Handle",
    "MessageQueue",
    "MsgspecSerializer",
    "NATIVE",
    "PeerDeadError",
    "PickleSerializer",
    "QueueShutdownError",
    "ReaderDeadError",
    "Serializer",
    "ShmCapacityError",
    "ShmQueueError",
    "ShmRingBuffer",
    "StatelessGroup",
    "WriterDeadError",
    "node_key",
    "shm_free_bytes",
]
