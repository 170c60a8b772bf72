"""The request server: answers the replay socket (REPLAY, INFO, SNAPSHOT) on the sender thread.

Requests are read and jobs advanced in slices between live sends, so a big replay or a
snapshot of a large cache never stalls the live stream. What it needs of the publisher
is handed to it explicitly (``StreamView``: the ring, the snapshot model, the counters,
two seq readers and the INFO reply; ``RequestLimits``); it owns its jobs and nothing else.
All of it runs on the sender thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from ..index.cache import chain_events
from ..wire import protocol
from ..wire.events import BlockStored, KVEventBatch
from .replay import ReplayJob, ReplayRing
from .snapshot import SnapshotModel

__all__ = ["RequestLimits", "RequestServer", "SnapshotJob", "StreamView"]

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


class RequestLimits(msgspec.Struct, frozen=True):
    """How much the request server does per loop turn and holds at once."""

    request_slice: int  # requests read per turn
    replay_slice: int  # replayed messages per job per turn
    max_replay_jobs: int
    max_snapshot_jobs: int
    job_timeout: float  # seconds before a job whose client stopped reading is abandoned


class StreamView(msgspec.Struct, frozen=True):
    """What the request server reads of the stream it serves (all on the sender thread).

    ``last_seq()``: the newest seq taken; ``done_seq()``: the newest the sender handled
    (so it is in the ring); ``info()``: the INFO reply's fields.
    """

    ring: ReplayRing
    model: SnapshotModel | None
    counters: dict[str, int]
    topic: bytes
    epoch: int
    rank: int | None
    last_seq: Callable[[], int]
    done_seq: Callable[[], int]
    info: Callable[[], dict[str, Any]]


class RequestServer:
    """Reads requests from a ROUTER socket (through ``send``/``recv``) and advances the
    replies, from the stream it is given."""

    def __init__(self, stream: StreamView, limits: RequestLimits, send: Any, recv: Any) -> None:
        self._stream = stream
        self._limits = limits
        self._send = send
        self._recv = recv
        self._replays: dict[bytes, ReplayJob] = {}
        self._snapshots: dict[bytes, SnapshotJob] = {}

    def read(self) -> bool:
        """Handle up to ``request_slice`` requests; True if there were any."""
        recv = self._recv
        for i in range(self._limits.request_slice):
            frames = recv()
            if frames is None:
                return i > 0
            self.handle(frames)
        return True

    def handle(self, frames: list[bytes]) -> None:
        stream, limits = self._stream, self._limits
        ident = frames[0]
        req = protocol.parse_request(frames[1:])
        c = stream.counters
        if type(req) is protocol.ReplayRequest:
            c["replay_requests"] += 1
            if ident not in self._replays and len(self._replays) >= limits.max_replay_jobs:
                c["busy_rejections"] += 1
                self.send_to(ident, [b"", b"", protocol.END_SEQ, b""])
                return
            last = stream.last_seq()
            self._replays[ident] = ReplayJob(ident, stream.ring.start_for(req.start, last), last)
        elif type(req) is protocol.ControlRequest:
            if req.op == protocol.OP_INFO:
                c["info_requests"] += 1
                self.send_to(ident, protocol.info_frames(stream.info()))
                return
            c["snapshot_requests"] += 1
            model = stream.model
            if model is None:
                self.send_to(ident, protocol.err_frames("snapshots are disabled"))
                return
            why = model.unavailable()
            if why is not None:
                c["snapshots_unavailable"] += 1
                self.send_to(ident, protocol.err_frames(why))
            elif ident not in self._snapshots and len(self._snapshots) >= limits.max_snapshot_jobs:
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
        stream, limits = self._stream, self._limits
        now = time.monotonic()
        ring, topic, done = stream.ring, stream.topic, stream.done_seq()
        c = stream.counters
        timeout, budget = limits.job_timeout, limits.replay_slice

        def replayed() -> None:
            c["replayed"] += 1

        for ident, job in list(self._replays.items()):
            finished = ring.advance(job, self.send_to, topic, done, budget, replayed)
            if finished or now - job.started > timeout:
                del self._replays[ident]
        for ident, snap in list(self._snapshots.items()):
            if self._advance_snapshot(snap) or now - snap.started > timeout:
                del self._snapshots[ident]
        return True

    def _advance_snapshot(self, snap: SnapshotJob) -> bool:
        stream = self._stream
        i = snap.next_chunk
        part = snap.blocks[i * snap.chunk : (i + 1) * snap.chunk]
        payload = _snapshot_encoder.encode(
            KVEventBatch(time.time(), chain_events(part, snap.positions), stream.rank)
        )
        header = {
            "epoch": stream.epoch,
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
        stream.counters["snapshot_chunks"] += 1
        snap.next_chunk = i + 1
        return snap.next_chunk >= snap.chunks
