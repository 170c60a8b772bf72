"""Publishers: the engine side. ``publish()`` never blocks the engine loop.

Engine code written against vLLM's ``vllm.distributed.kv_events`` switches by changing the
import: the class names, constructor arguments and factory behave the same. What differs is
what happens under pressure (see docs/design.md):

* ``publish()`` only assigns a seq and appends to a bounded deque (about a microsecond);
  encoding, the snapshot model and socket work happen on one background thread.
* When the queue is full the batch is not sent live but still consumes its seq, so
  subscribers see a gap, and it is encoded into the replay buffer so the gap can be filled.
* ``shutdown()`` flushes what was accepted within its timeout and reports the rest.
* The replay socket also answers kvwire's INFO and SNAPSHOT requests, served in slices
  between live sends so a large replay never stalls the live stream.
"""

from __future__ import annotations

import abc
import collections
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from .. import wire
from ..consume.cache import BlockCache, chain_events
from ..wire.curve import CurveServer
from ..wire.endpoint import (
    EndpointError,
    binds_all_interfaces,
    check_endpoint,
    is_bind,
    offset_for_rank,
    resolve_check,
)
from ..wire.events import (
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    KVEventBatch,
    check_dialect,
    encode_batch,
)
from ..wire.frames import FrameReceiver, FrameSender, poll_ms
from .config import KVEventsConfig

__all__ = [
    "EventPublisher",
    "EventPublisherFactory",
    "NullEventPublisher",
    "PublisherClosedError",
    "PublisherStats",
    "ShutdownReport",
    "ZmqEventPublisher",
]

log = logging.getLogger("kvwire.publisher")

_snapshot_encoder = msgspec.msgpack.Encoder()

#: The replay ring is preallocated; this bounds what a config typo can allocate.
MAX_BUFFER_STEPS = 10_000_000


class PublisherClosedError(RuntimeError):
    """``publish()`` was called after ``shutdown()``."""


class PublisherStats(msgspec.Struct, frozen=True):
    """Counters of one publisher; all monotonic except ``queue_depth`` and ``last_seq``."""

    published: int = 0
    sent: int = 0
    dropped: int = 0
    heartbeats: int = 0
    encode_errors: int = 0
    replay_requests: int = 0
    replayed: int = 0
    info_requests: int = 0
    snapshot_requests: int = 0
    snapshot_chunks: int = 0
    bad_requests: int = 0
    busy_rejections: int = 0
    snapshots_unavailable: int = 0
    queue_depth: int = 0
    last_seq: int = -1
    epoch: int = 0


class ShutdownReport(msgspec.Struct, frozen=True):
    """What ``shutdown()`` managed: ``unsent`` batches were accepted but never sent live."""

    sent: int
    unsent: int
    timed_out: bool


class EventPublisher(abc.ABC):
    """Publishes KV event batches; engines call ``publish`` once per step that changed the cache."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self._data_parallel_rank = data_parallel_rank

    @abc.abstractmethod
    def publish(self, events: EventBatch) -> None:
        """Hand over one batch; must never block the caller."""

    @abc.abstractmethod
    def shutdown(self) -> Any:
        """Flush and release resources; idempotent."""

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class NullEventPublisher(EventPublisher):
    """Accepts and discards batches: what an engine gets with events disabled."""

    def publish(self, events: EventBatch) -> None:
        return None

    def shutdown(self, timeout: float | None = None) -> ShutdownReport:
        return ShutdownReport(sent=0, unsent=0, timed_out=False)


class _Replay:
    """An in-flight replay reply to one client: seqs ``next..end`` then the end marker."""

    __slots__ = ("ident", "next", "end", "started")

    def __init__(self, ident: bytes, start: int, end: int) -> None:
        self.ident = ident
        self.next = start
        self.end = end
        self.started = time.monotonic()


class _Snapshot:
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


class ZmqEventPublisher(EventPublisher):
    """ZeroMQ PUB publisher, wire-compatible with vLLM's and SGLang's (spec section 3).

    Extra keyword-only options: ``dialect`` (bytes of which engine to produce),
    ``heartbeat_interval`` (seconds of silence before an empty heartbeat batch; None
    disables), ``snapshot`` (keep a cache model and serve SNAPSHOT requests), ``curve``
    (CurveZMQ keys for the live and replay sockets), ``context`` (a zmq.Context to share,
    required for ``inproc://`` endpoints).

    Threads: the caller takes a seq and appends to a bounded deque. One background thread
    encodes, keeps the bytes for replay, updates the snapshot model and sends, all without
    releasing the GIL per frame (kvwire.frames); it answers the replay socket and sends
    heartbeats. While batches keep coming it looks at its queue every ``NAP`` seconds;
    only after ``BUSY_LINGER`` seconds of quiet does it sleep until ``publish()`` wakes it
    (a pipe write), so a busy engine pays no syscall per batch.
    """

    #: Replay messages sent per loop turn, between live sends.
    REPLAY_SLICE = 64
    #: Live batches sent per loop turn: a long backlog cannot delay INFO/SNAPSHOT answers.
    SEND_SLICE = 4096
    #: While batches came within the last BUSY_LINGER seconds, the sender looks at its
    #: queue every NAP seconds instead of being woken per batch (adds at most NAP latency).
    NAP = 0.0005
    BUSY_LINGER = 0.05
    #: Requests read per loop turn (a flood cannot starve the other work).
    REQUEST_SLICE = 64
    MAX_REPLAY_JOBS = 64
    MAX_SNAPSHOT_JOBS = 2
    #: A job whose client stops reading for this long is abandoned.
    JOB_TIMEOUT = 30.0
    #: Largest request accepted on the replay socket; larger messages disconnect the peer.
    MAX_REQUEST_BYTES = 1024

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        *,
        dialect: str = "vllm",
        heartbeat_interval: float | None = 1.0,
        snapshot: bool = True,
        curve: CurveServer | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        super().__init__(data_parallel_rank)
        check_dialect(dialect)
        if not (1 <= buffer_steps <= MAX_BUFFER_STEPS) or max_queue_size < 1 or hwm < 0:
            raise ValueError(
                f"buffer_steps ({buffer_steps}) must be in 1..{MAX_BUFFER_STEPS}, "
                f"max_queue_size ({max_queue_size}) >= 1 and hwm ({hwm}) >= 0"
            )
        if heartbeat_interval is not None and heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be > 0 or None, got {heartbeat_interval}")
        self._dialect = dialect
        self._topic = topic
        self._topic_b = topic.encode()
        self._buffer_steps = buffer_steps
        self._heartbeat = heartbeat_interval
        self.epoch = int.from_bytes(os.urandom(8), "big")

        endpoint = offset_for_rank(check_endpoint(endpoint), data_parallel_rank)
        if replay_endpoint is not None:
            replay_endpoint = offset_for_rank(
                check_endpoint(replay_endpoint, "replay_endpoint"), data_parallel_rank
            )
        resolve_check(endpoint)
        if replay_endpoint is not None:
            resolve_check(replay_endpoint, "replay_endpoint")

        # A caller's context is needed for inproc:// (both ends must share it); kvwire then
        # leaves terminating it to the caller.
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.Context(io_threads=1)
        self._sockets: list[zmq.Socket] = []
        self._curve = curve
        self._auth = None
        try:
            if curve is not None:
                self._auth = curve.start(self._ctx)
            self._pub = self._socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self.endpoint = self._attach(self._pub, endpoint, "endpoint")
            self._router: zmq.Socket | None = None
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._router = self._socket(zmq.ROUTER)
                self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._router.setsockopt(zmq.MAXMSGSIZE, self.MAX_REQUEST_BYTES)
                self._router.setsockopt(zmq.SNDHWM, max(1000, hwm))
                self.replay_endpoint = self._attach(self._router, replay_endpoint, "replay_endpoint")
        except BaseException:
            self._close_all(0)
            raise
        exposed = [ep for ep in (endpoint, replay_endpoint) if ep and binds_all_interfaces(ep)]
        if exposed and curve is None:
            log.warning(
                "KV events bound on all interfaces (%s): prompt token ids in BlockStored events "
                "become readable by anyone who can reach these ports. Bind ipc:// or a private "
                "network, or enable CurveZMQ.",
                ", ".join(exposed),
            )

        self._lock = threading.Lock()  # seq, encode, ring, model, queue order
        # Sends from the background thread keep the GIL (see kvwire.frames): a busy engine
        # loop cannot turn each frame into a wait for the interpreter's switch interval.
        self._live_send = FrameSender(self._pub).send_message
        # The replay socket likewise: a GIL release there would also cost a switch interval.
        self._router_send = self._router_recv = None
        if self._router is not None:
            self._router_send = FrameSender(self._router).send_message
            self._router_recv = FrameReceiver(self._router).recv
        self._max_queue = max_queue_size
        self._pending: collections.deque[tuple[int, EventBatch]] = collections.deque()
        self._next_seq = 0
        self._done_seq = -1  # last seq the sender has handled (so it is in the ring)
        # (seq, payload bytes), or (seq, batch) for a batch dropped from the live path,
        # which the sender encodes only if a replay asks for it.
        self._ring: list[tuple[int, bytes | EventBatch] | None] = [None] * buffer_steps
        self._unencodable: collections.deque[int] = collections.deque(maxlen=64)
        # The snapshot model is owned by the sender thread, which applies batches in seq
        # order; the engine thread never pays for it.
        self._model: BlockCache | None = BlockCache() if snapshot else None
        self._model_seq = -1
        self._lost_from: int | None = None  # first dropped seq the model has not seen
        self._last_drop = -1
        self._replays: dict[bytes, _Replay] = {}
        self._snapshots: dict[bytes, _Snapshot] = {}
        self._c: dict[str, int] = dict.fromkeys(PublisherStats.__struct_fields__, 0)
        self._closing = False
        self._deadline = 0.0
        self._report: ShutdownReport | None = None
        self._idle = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._last_live = time.monotonic()
        self._thread = threading.Thread(
            target=self._run, name=f"kvwire-publisher-dp{data_parallel_rank}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ setup helpers

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._curve.apply(sock)
        self._sockets.append(sock)
        return sock

    def _attach(self, sock: zmq.Socket, endpoint: str, field: str) -> str:
        if endpoint.startswith("tcp://") and ("[" in endpoint or "::" in endpoint):
            sock.setsockopt(zmq.IPV6, 1)
        if not is_bind(endpoint) and endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            raise EndpointError(
                f"{field} {endpoint!r}: port 0 can only be bound (tcp://*:0); a host without * "
                "means connect"
            )
        try:
            if is_bind(endpoint):
                sock.bind(endpoint)
                actual = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                sock.connect(endpoint)
                actual = endpoint
        except zmq.ZMQError as e:
            raise EndpointError(f"{field} {endpoint!r}: cannot use it: {e.strerror}") from None
        if actual.startswith("tcp://0.0.0.0:"):
            actual = f"tcp://{_node_ip()}:{actual.rsplit(':', 1)[1]}"
        return actual

    # ------------------------------------------------------------------ engine side

    def publish(self, events: EventBatch) -> None:
        """Hand over one batch; never waits on a consumer.

        Takes the next seq and queues the batch (about a microsecond); the sender thread
        does the rest. If the queue is full the batch is not sent live, but it still
        consumes its seq and goes into the replay buffer as it is (the sender encodes it
        if a replay asks for it), so it stays replayable and the full path costs no more
        than the normal one.
        """
        if self._closing:
            raise PublisherClosedError(
                "publish() after shutdown(): this ZmqEventPublisher no longer accepts batches"
            )
        with self._lock:
            self._accept(events)
        if self._idle:
            self._wake()

    def _accept(self, batch: EventBatch) -> None:
        seq = self._next_seq
        self._next_seq = seq + 1
        if len(self._pending) < self._max_queue:
            self._pending.append((seq, batch))
        else:  # full: skip the live stream, but keep it replayable (encoded on demand)
            self._c["dropped"] += 1
            self._ring[seq % self._buffer_steps] = (seq, batch)
            # The sender never sees this batch, so the snapshot model misses it.
            self._last_drop = seq
            if self._lost_from is None and self._model is not None:
                self._lost_from = seq

    def _encode(self, seq: int, batch: EventBatch) -> bytes | None:
        try:
            return encode_batch(batch, self._dialect)
        except Exception as e:  # a bad object from the engine must not break the stream
            self._c["encode_errors"] += 1
            log.error("cannot encode KV event batch seq %d (%s); the seq is skipped", seq, e)
            return None

    def _wake(self) -> None:
        self._idle = False
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass  # pipe full (the thread is awake anyway) or closed by shutdown

    def stats(self) -> PublisherStats:
        c = dict(self._c)
        c["published"] = self._next_seq - c["heartbeats"]
        c["queue_depth"] = len(self._pending)
        c["last_seq"] = self._next_seq - 1
        c["epoch"] = self.epoch
        return PublisherStats(**c)

    def shutdown(self, timeout: float = 5.0) -> ShutdownReport:
        """Send everything accepted so far (bounded by ``timeout``), then close. Idempotent."""
        with self._lock:
            if self._report is not None:
                return self._report
            if not self._closing:
                self._deadline = time.monotonic() + max(0.0, timeout)
                self._closing = True
        self._wake()
        self._thread.join(max(0.0, self._deadline - time.monotonic()) + 5.0)
        with self._lock:
            if self._report is None:
                unsent = len(self._pending)
                self._report = ShutdownReport(
                    sent=self._c["sent"], unsent=unsent, timed_out=unsent > 0
                )
                if unsent:
                    log.warning(
                        "KV event publisher shut down with %d batches unsent (timeout %.3fs)",
                        unsent, timeout,
                    )
            return self._report

    def _close_all(self, linger_ms: int) -> None:
        for sock in self._sockets:
            if not sock.closed:
                sock.close(linger=linger_ms if sock is getattr(self, "_pub", None) else 0)
        if self._auth is not None:
            self._auth.stop()
        if self._own_ctx:
            self._ctx.term()
        for fd in ("_wake_r", "_wake_w"):
            if hasattr(self, fd):
                try:
                    os.close(getattr(self, fd))
                except OSError:
                    pass

    # ------------------------------------------------------------------ background thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        active_until = 0.0
        try:
            while True:
                worked = self._send_pending()
                if self._router is not None:
                    worked = self._read_requests() or worked
                    worked = self._advance_jobs() or worked
                if self._closing:
                    if not self._pending or time.monotonic() >= self._deadline:
                        break
                    continue
                now = time.monotonic()
                if self._heartbeat is not None and now - self._last_live >= self._heartbeat:
                    with self._lock:
                        if not self._closing:
                            self._c["heartbeats"] += 1
                            self._accept(KVEventBatch(time.time(), [], self._data_parallel_rank))
                    continue
                if worked:
                    active_until = now + self.BUSY_LINGER
                    continue
                if now < active_until:
                    # Busy lately: nap rather than have publish() wake us, which would cost
                    # the engine's thread a pipe write and a thread switch for every batch.
                    # (A sleep, not a poll: zmq_poll counts whole milliseconds, and a
                    # 0.5 ms timeout would become 0, a spin that fights the engine for
                    # the GIL. Requests wait at most NAP for the next turn.)
                    time.sleep(self.NAP)
                    continue
                self._idle = True
                if self._pending or self._closing:  # raced with publish(): don't sleep
                    self._idle = False
                    continue
                wait = 0.25
                if self._heartbeat is not None:
                    wait = min(wait, max(0.0, self._last_live + self._heartbeat - now))
                ready = poller.poll(poll_ms(wait))
                self._idle = False
                if ready:
                    self._drain_wake()
        except Exception:  # pragma: no cover - a bug; make it loud rather than silent
            log.exception("KV event publisher thread failed")
        finally:
            self._close_all(max(0, int((self._deadline - time.monotonic()) * 1000)))

    def _drain_wake(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass

    def _send_pending(self) -> bool:
        """Encode and send what is queued, up to ``SEND_SLICE`` batches per loop turn."""
        pending = self._pending
        if not pending:
            return False
        send, topic = self._live_send, self._topic_b
        ring, n, encode = self._ring, self._buffer_steps, self._encode
        popleft = pending.popleft
        sent = 0
        model = self._model
        for _ in range(min(len(pending), self.SEND_SLICE)):
            seq, batch = popleft()
            self._done_seq = seq
            if model is not None:
                self._apply(model, seq, batch)
            payload = encode(seq, batch)
            if payload is None:
                continue
            slot = ring[seq % n]
            # Never overwrite a newer dropped batch. (Check-then-write without the lock:
            # should the engine thread drop a batch >= buffer_steps newer into this very
            # slot between the two, that batch is reported lost on replay, never wrong.)
            if slot is None or slot[0] < seq:
                ring[seq % n] = (seq, payload)
            if not send(topic, seq.to_bytes(8, "big"), payload):
                self._c["dropped"] += 1  # PUB drops rather than refuse; kept for safety
                continue
            sent += 1
        self._c["sent"] += sent
        self._last_live = time.monotonic()
        return True

    def _apply(self, model: BlockCache, seq: int, batch: EventBatch) -> None:
        """Keep the snapshot model exact, or know since when it is not."""
        lost = self._lost_from
        try:
            if lost is None or seq < lost:
                model.apply_events(batch.events)
            else:
                # A dropped batch never reached the model; a later full clear makes it exact.
                evs = batch.events
                cut = max((i for i, e in enumerate(evs) if type(e) is AllBlocksCleared),
                          default=None)
                if cut is not None and seq > self._last_drop:
                    model.clear()
                    model.apply_events(evs[cut + 1 :])
                    self._lost_from = None
                    log.warning("snapshot model exact again at seq %d (cache cleared)", seq)
        except Exception:  # not a KV batch: the encoder reports it
            pass
        self._model_seq = seq

    # ------------------------------------------------------------------ replay socket

    def _read_requests(self) -> bool:
        recv = self._router_recv
        assert recv is not None
        for i in range(self.REQUEST_SLICE):
            frames = recv()
            if frames is None:
                return i > 0
            self._handle_request(frames)
        return True

    def _handle_request(self, frames: list[bytes]) -> None:
        ident = frames[0]
        req = wire.parse_request(frames[1:])
        c = self._c
        if type(req) is wire.ReplayRequest:
            c["replay_requests"] += 1
            if ident not in self._replays and len(self._replays) >= self.MAX_REPLAY_JOBS:
                c["busy_rejections"] += 1
                self._send_to(ident, [b"", b"", wire.END_SEQ, b""])
                return
            last = self._next_seq - 1
            start = max(req.start, last - self._buffer_steps + 1, 0)
            self._replays[ident] = _Replay(ident, start, last)
        elif type(req) is wire.ControlRequest:
            if req.op == wire.OP_INFO:
                c["info_requests"] += 1
                self._send_to(ident, wire.info_frames(self._info()))
            else:
                c["snapshot_requests"] += 1
                if self._model is None:
                    self._send_to(ident, wire.err_frames("snapshots are disabled"))
                elif self._lost_from is not None and self._lost_from <= self._model_seq:
                    c["snapshots_unavailable"] += 1
                    self._send_to(ident, wire.err_frames(
                        f"snapshot unavailable: the live queue overflowed at seq "
                        f"{self._lost_from}; exact again after the engine clears its cache"))
                elif (
                    ident not in self._snapshots
                    and len(self._snapshots) >= self.MAX_SNAPSHOT_JOBS
                ):
                    c["busy_rejections"] += 1
                    self._send_to(ident, wire.err_frames("busy: too many snapshots in flight"))
                else:
                    seq = self._model_seq  # same thread as the model: exact
                    self._snapshots[ident] = _Snapshot(
                        ident, self._model.raw_copy(), seq, req.chunk_blocks
                    )
        else:
            c["bad_requests"] += 1
            log.debug("ignored bad replay-socket request: %s", req.reason)

    def _info(self) -> dict[str, Any]:
        last = self._next_seq - 1
        done = self._done_seq
        return {
            "version": 1,
            "epoch": self.epoch,
            "seq": last,
            "oldest": max(0, done - self._buffer_steps + 1) if done >= 0 else -1,
            "topic": self._topic,
            "rank": self._data_parallel_rank,
            "heartbeat_interval": self._heartbeat,
            "snapshot": self._model is not None,
            "buffer_steps": self._buffer_steps,
            "dialect": self._dialect,
        }

    def _send_to(self, ident: bytes, frames: list[bytes]) -> bool | None:
        """Send to one client: True sent, False client busy (retry later), None client gone."""
        try:
            return self._router_send(ident, *frames)  # type: ignore[misc]
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return None
            raise

    def _advance_jobs(self) -> bool:
        if not self._replays and not self._snapshots:
            return False
        now = time.monotonic()
        for ident, job in list(self._replays.items()):
            if self._advance_replay(job) or now - job.started > self.JOB_TIMEOUT:
                del self._replays[ident]
        for ident, snap in list(self._snapshots.items()):
            if self._advance_snapshot(snap) or now - snap.started > self.JOB_TIMEOUT:
                del self._snapshots[ident]
        return True

    def _advance_replay(self, job: _Replay) -> bool:
        """Send one slice; True when the job is finished (or its client is gone)."""
        ring, n, topic = self._ring, self._buffer_steps, self._topic_b
        budget = self.REPLAY_SLICE
        while job.next <= job.end and budget:
            seq = job.next
            slot = ring[seq % n]
            if (slot is None or slot[0] != seq) and seq > self._done_seq:
                return False  # still queued for the sender: wait for it, don't skip it
            if slot is not None and slot[0] == seq:
                payload = slot[1]
                if type(payload) is not bytes:  # dropped from the live path: encode now
                    payload = self._encode_dropped(seq, payload)
                    if payload is None:
                        job.next = seq + 1
                        continue
                r = self._send_to(job.ident, [b"", topic, seq.to_bytes(8, "big"), payload])
                if r is None:
                    return True
                if r is False:
                    return False
                self._c["replayed"] += 1
                budget -= 1
            job.next = seq + 1
        if job.next > job.end:
            return self._send_to(job.ident, [b"", b"", wire.END_SEQ, b""]) is not False
        return False

    def _encode_dropped(self, seq: int, batch: EventBatch) -> bytes | None:
        """Encode a batch kept in the ring as an object; an unencodable one is counted once
        (the ring slot is the engine thread's too, so it is not rewritten from here)."""
        if seq in self._unencodable:
            return None
        payload = self._encode(seq, batch)
        if payload is None:
            self._unencodable.append(seq)
        return payload

    def _advance_snapshot(self, snap: _Snapshot) -> bool:
        i = snap.next_chunk
        part = snap.blocks[i * snap.chunk : (i + 1) * snap.chunk]
        payload = _snapshot_encoder.encode(
            KVEventBatch(time.time(), chain_events(part, snap.positions), self._data_parallel_rank)
        )
        header = {
            "epoch": self.epoch,
            "seq": snap.seq,
            "chunk": i,
            "chunks": snap.chunks,
            "blocks": len(snap.blocks),
        }
        r = self._send_to(snap.ident, wire.snap_frames(header, payload))
        if r is None:
            return True
        if r is False:
            return False
        self._c["snapshot_chunks"] += 1
        snap.next_chunk = i + 1
        return snap.next_chunk >= snap.chunks


def _node_ip() -> str:
    """This host's address for reporting a ``tcp://*`` bind; loopback if it has none."""
    try:
        ip = socket.gethostbyname(socket.gethostname())
        return ip if not ip.startswith("127.") else "127.0.0.1"
    except OSError:
        return "127.0.0.1"


class EventPublisherFactory:
    """Builds the publisher a ``KVEventsConfig`` asks for; new kinds can be registered."""

    _registry: dict[str, Callable[..., EventPublisher]] = {
        "null": NullEventPublisher,
        "zmq": ZmqEventPublisher,
    }

    @classmethod
    def register_publisher(cls, name: str, ctor: Callable[..., EventPublisher]) -> None:
        if name in cls._registry:
            raise KeyError(f"publisher {name!r} is already registered")
        cls._registry[name] = ctor

    @classmethod
    def create(
        cls, config: KVEventsConfig | None, data_parallel_rank: int = 0
    ) -> EventPublisher:
        """The configured publisher; the null one when events are off or absent."""
        if config is None or not config.enable_kv_cache_events or config.publisher == "null":
            return NullEventPublisher(data_parallel_rank)
        name = config.publisher or "zmq"
        ctor = cls._registry.get(name)
        if ctor is None:
            raise ValueError(
                f"unknown KV event publisher {name!r}; registered: {', '.join(sorted(cls._registry))}"
            )
        kwargs: dict[str, Any] = {
            f: getattr(config, f)
            for f in ("endpoint", "replay_endpoint", "buffer_steps", "hwm", "max_queue_size", "topic")
        }
        if isinstance(ctor, type) and issubclass(ctor, ZmqEventPublisher):
            kwargs["dialect"] = config.dialect
            kwargs["heartbeat_interval"] = config.heartbeat_interval
            if config.curve_secret_key_file is not None:
                kwargs["curve"] = CurveServer(
                    secret_key_file=config.curve_secret_key_file,
                    authorized_keys_dir=config.curve_authorized_keys_dir,
                )
        return ctor(data_parallel_rank=data_parallel_rank, **kwargs)
