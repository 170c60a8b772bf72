"""Publishers: the engine side. ``publish()`` never blocks the engine loop.

Engine code written against vLLM's ``vllm.distributed.kv_events`` switches by changing the
import: the class names, constructor arguments and factory behave the same. What differs is
what happens under pressure (see docs/decisions/0002-publish-never-blocks.md):

* ``publish()`` only assigns a seq and appends to a bounded deque (about a microsecond);
  encoding, the snapshot model and socket work happen on one background thread.
* When the queue is full the batch is not sent live but still consumes its seq, so
  subscribers see a gap, and it is encoded into the replay buffer so the gap can be filled.
* ``shutdown()`` flushes what was accepted within its timeout and reports the rest.
* The replay socket also answers kvwire's INFO and SNAPSHOT requests, served in slices
  between live sends so a large replay never stalls the live stream.

This module holds intake (``publish``) and sending (the background thread); the replay
ring (publish/replay.py), the request server (publish/requests.py) and the snapshot model
(publish/snapshot.py) have their own modules, all driven by that one thread.
"""

from __future__ import annotations

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
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventBatch,
    check_dialect,
    encode_batch,
)
from ..wire.frames import FrameReceiver, FrameSender, poll_ms
from .base import (
    EventPublisher,
    NullEventPublisher,
    PublisherClosedError,
    PublisherStats,
    ShutdownReport,
)
from .config import KVEventsConfig
from .replay import ReplayRing
from .requests import RequestLimits, RequestServer, StreamView
from .snapshot import SnapshotModel

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

#: Encodes a batch of an engine's own classes as given: what the engine's encoder does.
_plain_encoder = msgspec.msgpack.Encoder()
_OURS = frozenset({BlockStored, BlockRemoved, AllBlocksCleared})

#: The replay ring is preallocated; this bounds what a config typo can allocate.
MAX_BUFFER_STEPS = 10_000_000


class ZmqEventPublisher(EventPublisher):
    """ZeroMQ PUB publisher, wire-compatible with vLLM's and SGLang's (spec section 3).

    Extra keyword-only options: ``dialect`` (bytes of which engine to produce),
    ``heartbeat_interval`` (seconds of silence before an empty heartbeat batch; None
    disables), ``snapshot`` (keep a cache model and serve SNAPSHOT requests), ``curve``
    (CurveZMQ keys for the live and replay sockets), ``context`` (a zmq.Context to share,
    required for ``inproc://`` endpoints).

    Batches may hold kvwire's event classes (encoded in ``dialect``) or an engine's own
    msgspec structs (encoded as given, byte-exact with that engine's encoder; the snapshot
    model follows them by tag and shape). A batch without a rank goes out with this
    publisher's, as vLLM's does.

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
    #: Batches encoded before their messages go out together (see _send_pending).
    CHUNK = 32
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
        self._config = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
            replay_endpoint=replay_endpoint, buffer_steps=buffer_steps, hwm=hwm,
            max_queue_size=max_queue_size, topic=topic, dialect=dialect,
            heartbeat_interval=heartbeat_interval,
            curve_secret_key_file=getattr(curve, "secret_key_file", None),
            curve_authorized_keys_dir=getattr(curve, "authorized_keys_dir", None),
        )

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
        self._live_send = FrameSender(self._pub).send_batch
        # The replay socket likewise: a GIL release there would also cost a switch interval.
        self._router_send: Any = None
        self._router_recv: Any = None
        if self._router is not None:
            self._router_send = FrameSender(self._router).send_message
            self._router_recv = FrameReceiver(self._router).recv
        self._max_queue = max_queue_size
        self._pending: collections.deque[tuple[int, EventBatch]] = collections.deque()
        self._next_seq = 0
        self._done_seq = -1  # last seq the sender has handled (so it is in the ring)
        # (seq, payload bytes), or (seq, batch) for a batch dropped from the live path,
        # which the sender encodes only if a replay asks for it.
        self._ring = ReplayRing(buffer_steps, self._encode)
        self._c: dict[str, int] = dict.fromkeys(PublisherStats.__struct_fields__, 0)
        # The snapshot model is owned by the sender thread, which applies batches in seq
        # order; the engine thread never pays for it.
        self._model = SnapshotModel(self._lock, self._c) if snapshot else None
        self._requests: RequestServer | None = None
        if self._router is not None:
            stream = StreamView(
                ring=self._ring, model=self._model, counters=self._c, topic=self._topic_b,
                epoch=self.epoch, rank=self._data_parallel_rank,
                last_seq=lambda: self._next_seq - 1, done_seq=lambda: self._done_seq,
                info=self._info,
            )
            limits = RequestLimits(
                request_slice=self.REQUEST_SLICE, replay_slice=self.REPLAY_SLICE,
                max_replay_jobs=self.MAX_REPLAY_JOBS, max_snapshot_jobs=self.MAX_SNAPSHOT_JOBS,
                job_timeout=self.JOB_TIMEOUT,
            )
            self._requests = RequestServer(stream, limits, self._router_send, self._router_recv)
        self._sender_dead = False
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
        if self._sender_dead:
            self._refuse_dead()
            return
        pending = self._pending
        with self._lock:  # _accept, inlined: this is the engine's per-batch cost
            seq = self._next_seq
            self._next_seq = seq + 1
            if len(pending) < self._max_queue:
                pending.append((seq, events))
            else:
                self._drop(seq, events)
        if self._idle:
            self._wake()

    def _accept(self, batch: EventBatch) -> None:
        """Take the next seq for ``batch`` and queue it (lock held); as ``publish()`` does."""
        seq = self._next_seq
        self._next_seq = seq + 1
        if len(self._pending) < self._max_queue:
            self._pending.append((seq, batch))
        else:
            self._drop(seq, batch)

    def _drop(self, seq: int, batch: EventBatch) -> None:
        """Queue full (lock held): skip the live stream, but keep the batch replayable
        (encoded on demand)."""
        self._c["dropped"] += 1
        self._ring.keep_dropped(seq, batch)
        # The sender never sees this batch, so the snapshot model misses it.
        if self._model is not None:
            self._model.note_drop(seq)

    def _refuse_dead(self) -> None:
        """The sender thread died: nothing would ever send this batch. Count it, log once,
        never block or raise into the engine loop."""
        with self._lock:
            self._c["dropped_sender_dead"] += 1
            first = self._c["dropped_sender_dead"] == 1
        if first:
            log.error("KV event publisher's sender thread is dead: publish() drops every "
                      "batch (counted as dropped_sender_dead); restart the publisher")

    def _encode(self, seq: int, batch: EventBatch) -> bytes | None:
        """Bytes of ``batch`` in the configured dialect, tagged with this publisher's rank
        when it has none. A batch holding an engine's own event classes is encoded as
        given (byte-exact with that engine's encoder); None if it cannot be encoded."""
        try:
            if batch.data_parallel_rank is None:
                batch = msgspec.structs.replace(
                    batch, data_parallel_rank=self._data_parallel_rank
                )
            return encode_batch(batch, self._dialect)
        except Exception as e:  # a bad object from the engine must not break the stream
            err: Exception = e
        try:  # an engine's own classes: its encoder's bytes are the plain encoding
            if any(type(ev) not in _OURS for ev in batch.events):
                payload = _plain_encoder.encode(batch)
                self._c["foreign_batches"] += 1
                return payload
        except Exception as e:
            err = e
        self._c["encode_errors"] += 1
        log.error("cannot encode KV event batch seq %d (%s); the seq is skipped", seq, err)
        return None

    def _wake(self) -> None:
        self._idle = False
        if self._wake_w < 0:
            return
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass  # pipe full (the thread is awake anyway) or closed by shutdown

    def stats(self) -> PublisherStats:
        c: dict[str, Any] = dict(self._c)
        c["published"] = self._next_seq - c["heartbeats"]
        c["queue_depth"] = len(self._pending)
        c["last_seq"] = self._next_seq - 1
        c["epoch"] = self.epoch
        c["sender_alive"] = self._thread.is_alive() and not self._sender_dead
        c["snapshot_exact"] = self._model is not None and self._model.exact
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
        for name in ("_wake_r", "_wake_w"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                setattr(self, name, -1)  # never write to a number the OS may hand out again
                try:
                    os.close(fd)
                except OSError:
                    pass

    # ------------------------------------------------------------------ background thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        requests = self._requests
        active_until = 0.0
        try:
            while True:
                worked = self._send_pending()
                if requests is not None:
                    worked = requests.read() or worked
                    worked = requests.advance() or worked
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
        except BaseException:  # a bug or a fault: loud, and visible in stats() and publish()
            log.exception("KV event publisher's sender thread died; publish() now drops "
                          "every batch (stats: sender_alive=False, dropped_sender_dead)")
            self._sender_dead = True
        finally:
            self._close_all(max(0, int((self._deadline - time.monotonic()) * 1000)))

    def _drain_wake(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass

    def _send_pending(self) -> bool:
        """Encode and send what is queued, up to ``SEND_SLICE`` batches per loop turn.

        In chunks of up to ``CHUNK`` batches: the snapshot model takes the whole chunk in
        one call, then each batch is encoded and kept for replay, then the chunk's
        messages go out back to back, so ZeroMQ's I/O thread wakes once per chunk rather
        than once per batch. (A chunk costs a few microseconds per batch before its first
        message goes out; the queue holds only what arrived since the last turn.)
        """
        pending = self._pending
        if not pending:
            return False
        send, topic = self._live_send, self._topic_b
        ring, n, encode = self._ring.slots, self._buffer_steps, self._encode
        dialect = self._dialect
        popleft = pending.popleft
        model = self._model
        sent = failed = 0
        left = min(len(pending), self.SEND_SLICE)
        chunk_max = self.CHUNK
        out: list[tuple[bytes, bytes]] = []
        while left:
            k = left if left < chunk_max else chunk_max
            left -= k
            chunk = [popleft() for _ in range(k)]
            if model is not None:
                model.apply_many(chunk)
            for seq, batch in chunk:
                # encode_batch directly for kvwire's own batches with a rank (the common
                # case); anything else, or any failure, goes through _encode.
                try:
                    if batch.data_parallel_rank is None:
                        payload = encode(seq, batch)
                    else:
                        payload = encode_batch(batch, dialect)
                except Exception:
                    payload = encode(seq, batch)
                if payload is None:
                    continue
                slot = ring[seq % n]
                # Never overwrite a newer dropped batch. (Check-then-write without the
                # lock: should the engine thread drop a batch >= buffer_steps newer into
                # this very slot between the two, that batch is reported lost on replay,
                # never wrong.)
                if slot is None or slot[0] < seq:
                    ring[seq % n] = (seq, payload)
                out.append((seq.to_bytes(8, "big"), payload))
            self._done_seq = chunk[-1][0]
            ok = send(topic, out)
            sent += ok
            failed += len(out) - ok  # PUB drops rather than refuse; kept for safety
            out.clear()
        if failed:
            self._c["dropped"] += failed
        self._c["sent"] += sent
        self._last_live = time.monotonic()
        return True

    def _info(self) -> dict[str, Any]:
        return {
            "version": 1,
            "epoch": self.epoch,
            "seq": self._next_seq - 1,
            "oldest": self._ring.oldest(self._done_seq),
            "topic": self._topic,
            "rank": self._data_parallel_rank,
            "heartbeat_interval": self._heartbeat,
            "snapshot": self._model is not None,
            "buffer_steps": self._buffer_steps,
            "dialect": self._dialect,
        }


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
            null = NullEventPublisher(data_parallel_rank)
            null._config = config
            return null
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
