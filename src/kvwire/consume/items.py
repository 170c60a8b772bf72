"""What a stream machine outputs: actions for the I/O layer (requests to send, a socket to
recycle) and deliveries for the application (``Batch``, ``Reset``, ``Snapshot``,
``Liveness``). See :mod:`kvwire.consume.stream` for the guarantee they carry."""

from __future__ import annotations

import msgspec

from ..wire import protocol
from ..wire.events import BlockStored, KVEventBatch

__all__ = ["Action", "Batch", "Delivery", "Liveness", "Output", "RecycleRequests", "Reset",
           "SendInfo", "SendReplay", "SendSnapshot", "Snapshot"]

# --------------------------------------------------------------------------- actions


class SendInfo(msgspec.Struct, frozen=True):
    """Ask the publisher for INFO (epoch, heartbeat interval, snapshot support)."""

    def frames(self) -> list[bytes]:
        return [b"", protocol.MAGIC, protocol.OP_INFO]


class SendReplay(msgspec.Struct, frozen=True):
    """Ask for every buffered batch with ``seq >= start``."""

    start: int

    def frames(self) -> list[bytes]:
        return [b"", protocol.pack_seq(self.start)]


class SendSnapshot(msgspec.Struct, frozen=True):
    """Ask for the publisher's cache contents (in chunks of ``max_blocks`` blocks)."""

    max_blocks: int | None = None

    def frames(self) -> list[bytes]:
        f = [b"", protocol.MAGIC, protocol.OP_SNAPSHOT]
        if self.max_blocks is not None:
            f.append(self.max_blocks.to_bytes(4, "big"))
        return f


class RecycleRequests(msgspec.Struct, frozen=True):
    """Close the request socket and open a new one: drops replies to abandoned requests."""

    reason: str


Action = SendInfo | SendReplay | SendSnapshot | RecycleRequests

# --------------------------------------------------------------------------- deliveries


class Batch(msgspec.Struct, frozen=True, gc=False):
    """One batch of stream ``stream``, delivered exactly once and in seq order
    (untracked by the GC, like the batch it carries)."""

    stream: str
    seq: int
    batch: KVEventBatch
    epoch: int | None = None


class Reset(msgspec.Struct, frozen=True):
    """Drop everything known about this stream's engine; a :class:`Snapshot` follows."""

    stream: str
    reason: str
    epoch: int | None = None


class Snapshot(msgspec.Struct, frozen=True):
    """The engine's blocks after every batch with seq <= ``seq``; replaces the state.

    ``exact`` is False when the publisher could not provide its contents (reference
    publishers, or loss that no replay could fill): then ``blocks`` is empty and only
    what the following batches say is known.
    """

    stream: str
    seq: int
    blocks: list[BlockStored]  # events covering the blocks; an event may be a chain
    epoch: int | None = None
    exact: bool = True

    @property
    def block_count(self) -> int:
        """Blocks covered: ``blocks`` holds events, and an event may be a chain of blocks."""
        return sum(len(e.block_hashes) for e in self.blocks)


class Liveness(msgspec.Struct, frozen=True):
    """The stream went silent for longer than ``dead_after`` (or came back)."""

    stream: str
    alive: bool
    reason: str


Delivery = Batch | Reset | Snapshot | Liveness
Output = Action | Delivery
