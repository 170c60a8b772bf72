"""The request server: answers the replay socket (REPLAY, INFO, SNAPSHOT) on the sender thread.

Requests are read and jobs advanced in slices between live sends, so a big replay or a
snapshot of a large cache never stalls the live stream. It reads the publisher's state
(seqs, the ring, the snapshot model, limits) through the publisher object it serves; all
of it runs on the sender thread.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from ..consume.cache import chain_events
from ..wire import protocol
from ..wire.events import BlockStored, KVEventBatch
from .replay import ReplayJob

if TYPE_CHECKING:
    from .publisher import ZmqEventPublisher

__all__ = ["RequestServer", "SnapshotJob"]

log = logging.getLogger("kvwire.publisher")

_snapshot_encoder = msgspec.msgpack.Encoder()


class SnapshotJob:
    """An in-flight snapshot reply: a point-in-time copy of the cache, sent in chunks."""

    __slots__ = ("ident", "blocks", "positions", "seq", "chunk", "next_chunk", "chunks",
                 "started")

    def __init__(
        self, ident: bytes, blocks: list[tuple[Any, BlockStored]], seq: int, chunk: int
    ) -> None:
        self.ident = ident
        self.blocks = blocks  # (hash, event), from BlockCache.raw_copy()
        self.positions: dict[int, dict[Any, int]] = {}  # chain_events' cache, across chunks
        self.seq = seq
        self.chunk = chunk
        self.next_chunk = 0
        self.chunks = max(1, -(-len(blocks) // chunk))
        self.started = time.monotonic()


class RequestServer:
    """Reads requests from the publisher's ROUTER socket and advances the replies."""

    def __init__(self, pub: ZmqEventPublisher, router: zmq.Socket, send: Any, recv: Any) -> None:
        self._pub = pub
        self._router = router
        self._send = send
        self._recv = recv
        self._replays: dict[bytes, ReplayJob] = {}
        self._snapshots: dict[bytes, SnapshotJob] = {}

    def read(self) -> bool:
        """Handle up to ``REQUEST_SLICE`` requests; True if there were any."""
        recv = self._recv
        for i in range(self._pub.REQUEST_SLICE):
            frames = recv()
            if frames is None:
                return i > 0
            self.handle(frames)
        return True

    def handle(self, frames: list[bytes]) -> None:
        pub = self._pub
        ident = frames[0]
        req = protocol.parse_request(frames[1:])
        c = pub._c
        if type(req) is protocol.ReplayRequest:
            c["replay_requests"] += 1
            if ident not in self._replays and len(self._replays) >= pub.MAX_REPLAY_JOBS:
                c["busy_rejections"] += 1
                self.send_to(ident, [b"", b"", protocol.END_SEQ, b""])
                return
            last = pub._next_seq - 1
            self._replays[ident] = ReplayJob(ident, pub._ring.start_for(req.start, last), last)
        elif type(req) is protocol.ControlRequest:
            if req.op == protocol.OP_INFO:
                c["info_requests"] += 1
                self.send_to(ident, protocol.info_frames(pub._info()))
                return
            c["snapshot_requests"] += 1
            model = pub._model
            if model is None:
                self.send_to(ident, protocol.err_frames("snapshots are disabled"))
                return
            why = model.unavailable()
            if why is not None:
                c["snapshots_unavailable"] += 1
                self.send_to(ident, protocol.err_frames(why))
            elif ident not in self._snapshots and len(self._snapshots) >= pub.MAX_SNAPSHOT_JOBS:
                c["busy_rejections"] += 1
                self.send_to(ident, protocol.err_frames("busy: too many snapshots in flight"))
            else:  # same thread as the model: exact as of its seq
                self._snapshots[ident] = SnapshotJob(
                    ident, model.cache.raw_copy(), model.seq, req.chunk_blocks
                )
        else:
            c["bad_requests"] += 1
            log.debug("ignored bad replay-socket request: %s", req.reason)

    def send_to(self, ident: bytes, frames: list[bytes]) -> bool | None:
        """Send to one client: True sent, False client busy (retry later), None client gone."""
        try:
            return self._send(ident, *frames)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return None
            raise

    def advance(self) -> bool:
        """Advance every job by one slice; True if there were jobs."""
        if not self._replays and not self._snapshots:
            return False
        pub = self._pub
        now = time.monotonic()
        ring, topic, done = pub._ring, pub._topic_b, pub._done_seq
        c = pub._c

        def replayed() -> None:
            c["replayed"] += 1

        for ident, job in list(self._replays.items()):
            finished = ring.advance(job, self.send_to, topic, done, pub.REPLAY_SLICE, replayed)
            if finished or now - job.started > pub.JOB_TIMEOUT:
                del self._replays[ident]
        for ident, snap in list(self._snapshots.items()):
            if self._advance_snapshot(snap) or now - snap.started > pub.JOB_TIMEOUT:
                del self._snapshots[ident]
        return True

    def _advance_snapshot(self, snap: SnapshotJob) -> bool:
        pub = self._pub
        i = snap.next_chunk
        part = snap.blocks[i * snap.chunk : (i + 1) * snap.chunk]
        payload = _snapshot_encoder.encode(
            KVEventBatch(time.time(), chain_events(part, snap.positions), pub._data_parallel_rank)
        )
        header = {
            "epoch": pub.epoch,
            "seq": snap.seq,
            "chunk": i,
            "chunks": snap.chunks,
            "blocks": len(snap.blocks),
        }
        r = self.send_to(snap.ident, protocol.snap_frames(header, payload))
        if r is None:
            return True
        if r is False:
            return False
        pub._c["snapshot_chunks"] += 1
        snap.next_chunk = i + 1
        return snap.next_chunk >= snap.chunks
