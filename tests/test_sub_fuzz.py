"""The Subscriber against an impostor publisher: 10^5+ generated garbage cases.

A raw pyzmq PUB + ROUTER on loopback (no kvwire publisher code) plays the publisher:

* phase A (the 10^5): garbage on the live socket (wrong frame counts, short/long/negative
  seq frames, undecodable / truncated / bit-flipped / wrongly shaped payloads at the next
  seq, mixed with good batches) and garbage on the request socket (random frames, missing
  delimiter, wrong frame counts, wrong magic, unknown ops, truncated or mistyped INFO maps
  and SNAP headers, stray replay messages, end markers and ERRs). Sent in chunks; after
  each chunk the subscriber's counters must account for every case exactly once:
  ``bad_frames + stray_replies + error_replies`` for frames that are not a usable live
  batch, ``batches + bad_payloads`` for live messages at the next seq;
* phase B: an adversarial impostor answering the subscriber's real INFO / replay /
  SNAPSHOT requests with random but well-formed lies (other epochs, seqs out of order,
  inconsistent snapshot chunks, ERRs) and random live seqs (gaps, duplicates, going back);
* phase C: the impostor turns honest (new epoch, correct INFO and replay): the same
  Subscriber must re-bootstrap and deliver the good batches, rebuilding their cache.

Throughout, the per-stream contract (Reset, Snapshot(N), Batch(N+1), ...) is checked on
every delivery, and no ``poll()`` may take much longer than its timeout. Seeded.
"""

from __future__ import annotations

import gc
import random
import time

import msgspec
import pytest
import zmq
from fault_helpers import Rebuild

from kvwire.consume.stream import Batch, StreamConfig
from kvwire.consume.subscriber import StreamSpec, Subscriber
from kvwire.index.cache import BlockCache
from kvwire.wire import protocol
from kvwire.wire.events import BlockRemoved, BlockStored, KVEventBatch, encode_batch

pytestmark = pytest.mark.timeout(120)

N_CASES = 100_000
CHUNK = 1000
_enc = msgspec.msgpack.Encoder()


class Good:
    """Valid batches (stores and removes) with their ground truth."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.truth = BlockCache()
        self.live: list[int] = []
        self.next_hash = 1

    def batch(self) -> KVEventBatch:
        rng, events = self.rng, []
        if self.live and rng.random() < 0.4:
            k = rng.randrange(1, min(4, len(self.live)) + 1)
            gone = [self.live.pop(rng.randrange(len(self.live))) for _ in range(k)]
            events.append(BlockRemoved(gone, "GPU"))
        n = rng.randrange(1, 4)
        hashes = list(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        parent = rng.choice(self.live) if self.live and rng.random() < 0.5 else None
        events.append(BlockStored(hashes, parent, [rng.randrange(32000) for _ in range(4 * n)],
                                  4, None, "GPU"))
        self.live.extend(hashes)
        return KVEventBatch(time.time(), events, 0)

    def payload(self) -> bytes:
        return encode_batch(self.batch(), "vllm")


def garbage_payload(rng: random.Random, good: Good) -> bytes:
    kind = rng.randrange(8)
    valid = encode_batch(good.batch(), "vllm")  # not applied to any truth
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 64))
    if kind == 1:  # truncated
        return valid[: rng.randrange(0, len(valid))]
    if kind == 2:  # bit flips
        b = bytearray(valid)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == 3:  # wrong shapes
        return _enc.encode(rng.choice([
            {}, 1, "x", [], [1.0], [1.0, "events", 0], ["ts", [], None], [1.0, [], None, 4],
            None, [1.0, [1, 2, 3], None], b"\x00" * 8,
        ]))
    if kind == 4:  # events that are not events
        return _enc.encode([1.0, [rng.choice([
            {"type": "Nope"}, {"no": "type"}, ["BlockStored"], ["Zap", 1], 7, None,
            {"type": "BlockStored", "block_hashes": "x"}, ["BlockRemoved", [1.5], None],
            {"type": "BlockRemoved", "block_hashes": [[1]], "medium": 3},
        ]) for _ in range(rng.randrange(1, 4))], 0])
    if kind == 5:  # trailing bytes
        return valid + rng.randbytes(rng.randrange(1, 8))
    if kind == 6:  # deep nesting
        return b"\x91" * rng.randrange(1, 5000) + b"\xc0"
    return b""


def _seq(n: int) -> bytes:
    return n.to_bytes(8, "big", signed=True)


def garbage_reply(rng: random.Random) -> list[bytes]:
    """One message from the ROUTER (after the identity), as the DEALER will see it."""
    kind = rng.randrange(12)
    info = {"version": 1, "epoch": rng.randrange(1 << 64), "seq": 5, "oldest": 0}
    if kind == 0:  # random frames, no delimiter (mostly)
        return [rng.randbytes(rng.randrange(1, 12)) for _ in range(rng.randrange(1, 5))]
    if kind == 1:  # delimiter, then a wrong number of frames
        return [b""] + [rng.randbytes(rng.randrange(0, 12)) for _ in range(rng.choice([0, 4, 5]))]
    if kind == 2:  # unknown op
        return [b"", protocol.MAGIC, rng.randbytes(rng.randrange(0, 7)), b"x"]
    if kind == 3:  # INFO with a garbage / truncated / mistyped map
        m = _enc.encode(info)
        body = rng.choice([rng.randbytes(rng.randrange(0, 30)), m[: rng.randrange(len(m))],
                           _enc.encode({"epoch": "x"}), _enc.encode({"seq": 1}),
                           _enc.encode([1, 2]), _enc.encode({**info, "epoch": -1})])
        return [b"", protocol.MAGIC, protocol.REPLY_INFO, body]
    if kind == 4:  # SNAP with a garbage / truncated header
        h = _enc.encode({"epoch": 1, "seq": 3, "chunk": 0, "chunks": 1, "blocks": 0})
        body = rng.choice([rng.randbytes(rng.randrange(0, 30)), h[: rng.randrange(len(h))],
                           _enc.encode({"epoch": 1}), _enc.encode({"epoch": 1, "seq": "3",
                                                                   "chunk": 0, "chunks": 1})])
        return [b"", protocol.MAGIC, protocol.REPLY_SNAP, body, rng.randbytes(8)]
    if kind == 5:  # control replies with the wrong frame count
        return [b"", protocol.MAGIC, rng.choice([protocol.REPLY_INFO, protocol.REPLY_SNAP, protocol.REPLY_ERR])]
    if kind == 6:  # wrong magic
        return [b"", rng.choice([b"KVW2", b"kvw1", b"", rng.randbytes(4)]), protocol.REPLY_INFO,
                _enc.encode(info)]
    if kind == 7:  # stray replay messages (both layouts) and end markers
        seq = rng.choice([0, 1, 1 << 40, -1, -2])
        return rng.choice([[b"", b"", _seq(seq), b"p"], [b"", _seq(seq), b"p"]])
    if kind == 8:  # an ERR nobody asked for
        return [b"", protocol.MAGIC, protocol.REPLY_ERR, rng.randbytes(rng.randrange(0, 20))]
    if kind == 9:  # a well-formed INFO / SNAP nobody asked for
        if rng.random() < 0.5:
            return protocol.info_frames(info)
        return protocol.snap_frames({"epoch": 1, "seq": 3, "chunk": 0, "chunks": 1, "blocks": 0},
                                _enc.encode([1.0, [], 0]))
    if kind == 10:  # 8-byte "op": read as a 3-frame replay message
        return [b"", protocol.MAGIC, rng.randbytes(8), b"p"]
    return [b"", b"", rng.randbytes(rng.choice([0, 4, 7, 9]))[:9], b""]  # short seq frame


def garbage_live(rng: random.Random) -> list[bytes]:
    """A live message that is not a batch at all (wrong frames or seq frame)."""
    kind = rng.randrange(3)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 9)) for _ in range(rng.choice([1, 2, 4, 5, 6]))]
    if kind == 1:
        return [b"", rng.randbytes(rng.choice([0, 1, 4, 7, 9, 16])), b"p"]
    return [b"", _seq(-rng.randrange(1, 1 << 62)), b"p"]


class Impostor:
    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.SNDHWM, 0)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ident: bytes | None = None

    def requests(self) -> list[protocol.ReplayRequest | protocol.ControlRequest | protocol.BadRequest]:
        out = []
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            self.ident = frames[0]
            out.append(protocol.parse_request(frames[1:]))

    def reply(self, frames: list[bytes]) -> None:
        assert self.ident is not None
        self.router.send_multipart([self.ident, *frames])

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


def _info(epoch: int, seq: int, oldest: int, snapshot: bool = False,
          hb: float | None = None) -> list[bytes]:
    return protocol.info_frames({"version": 1, "epoch": epoch, "seq": seq, "oldest": oldest,
                             "topic": "", "rank": 0, "heartbeat_interval": hb,
                             "snapshot": snapshot, "buffer_steps": 100_000, "dialect": "vllm"})


class Driver:
    """The subscriber side: polls, feeds a Rebuild, and times every poll: the wall time past
    its timeout (``max_poll``: a wait that never ends) and the CPU it spent past the timeout
    (``max_poll_cpu``: too much work in one call). A poll typically overruns by under 0.1 s.

    Python's cyclic garbage collector runs in whichever call allocates when a generation
    fills up, and a full collection walks the whole process's heap: late in the suite
    (torch, transformers and a thousand tests' objects alive) one took 1.28 s of CPU inside
    a poll. That is the suite's heap, not the subscriber's work, so the time the collector
    spends during a poll (``gc.callbacks``) is taken out of both measures and reported as
    ``max_gc``. The wall bound still leaves room for the host stalling this process (1.17 s
    once on the 2-core VM), which spends no CPU, so the CPU bound stays tight."""

    def __init__(self, sub: Subscriber) -> None:
        self.sub = sub
        self.rb = Rebuild()
        self.max_poll = 0.0
        self.max_poll_cpu = 0.0
        self.max_gc = 0.0
        self.items: list = []
        self._gc_total = 0.0
        self._gc_t0 = 0.0

    def _gc_timer(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.thread_time()
        else:
            self._gc_total += time.thread_time() - self._gc_t0

    def __enter__(self) -> Driver:
        gc.callbacks.append(self._gc_timer)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._gc_timer)

    def poll(self, timeout: float) -> None:
        g0 = self._gc_total
        t0, c0 = time.monotonic(), time.thread_time()
        item = self.sub.poll(timeout)
        wall, cpu = time.monotonic() - t0, time.thread_time() - c0
        in_gc = self._gc_total - g0
        self.max_gc = max(self.max_gc, in_gc)
        self.max_poll = max(self.max_poll, wall - in_gc - timeout)
        self.max_poll_cpu = max(self.max_poll_cpu, cpu - in_gc - timeout)
        if item is not None:
            self.rb.feed(item)
            if type(item) is Batch:
                self.items.append(item)

    def stream(self):
        return self.sub.stats()["e"].stream

    def until(self, cond, timeout: float, what: str, serve=None) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"{what}: stats {self.stream()}"
            if serve is not None:
                serve()
            self.poll(0.01)


def test_subscriber_survives_1e5_garbage_cases():
    rng = random.Random(4321)
    imp = Impostor()
    # info_timeout: the impostor answers the boot INFO from this thread, between polls; a
    # host that holds this thread for 0.3 s made it look silent (a reference publisher, no
    # epoch) and phase A's checks fail; later INFOs are all answered (lies or not)
    cfg = StreamConfig(request_timeout=0.3, info_timeout=2.0, retry_delay=0.05,
                       info_interval=1e9, max_snapshot_errors=2)
    sub = Subscriber([StreamSpec("e", imp.endpoint, "", imp.replay_endpoint)], config=cfg)
    drv = Driver(sub)
    t_start = time.monotonic()
    try:
        with drv:
            _run(rng, imp, drv)
    finally:
        sub.close()
        imp.close()
    print(f"sub fuzz: {time.monotonic() - t_start:.1f}s, max poll overrun {drv.max_poll:.3f}s "
          f"(CPU {drv.max_poll_cpu:.3f}s), longest collection in a poll {drv.max_gc:.3f}s")


def _run(rng: random.Random, imp: Impostor, drv: Driver) -> None:
    good = Good(rng)
    epoch = rng.randrange(1 << 64)
    seq = 0

    # ---- bootstrap against a kvwire-looking impostor without snapshots
    def serve_boot() -> None:
        for req in imp.requests():
            if type(req) is protocol.ControlRequest and req.op == protocol.OP_INFO:
                imp.reply(_info(epoch, -1, -1))
            elif type(req) is protocol.ReplayRequest:
                imp.reply([b"", b"", protocol.END_SEQ, b""])

    drv.until(lambda: drv.stream().phase == "await_first", 10, "boot", serve_boot)
    assert drv.stream().epoch == epoch, drv.stream()  # booted as a kvwire publisher's stream

    def send_good() -> None:
        nonlocal seq
        imp.pub.send_multipart([b"", _seq(seq), good.payload()])
        seq += 1

    deadline = time.monotonic() + 10
    while drv.rb.next is None:  # slow joiner: publish until the SUB hears one
        assert time.monotonic() < deadline, drv.stream()
        send_good()
        drv.poll(0.02)
    drv.until(lambda: drv.stream().phase == "live" and drv.rb.last_seq == seq - 1, 5, "live")

    # ---- phase A: 10^5 cases, every one accounted for
    s0 = drv.stream()
    frames_base = s0.bad_frames + s0.stray_replies + s0.error_replies
    payload_base = s0.batches + s0.bad_payloads
    n_frames = n_payloads = 0
    kinds = {"live_frames": 0, "payload": 0, "good": 0, "reply": 0}
    sent = 0
    while sent < N_CASES:
        for _ in range(CHUNK):
            r = rng.random()
            if r < 0.3:
                imp.pub.send_multipart(garbage_live(rng))
                n_frames += 1
                kinds["live_frames"] += 1
            elif r < 0.55:
                imp.pub.send_multipart([b"", _seq(seq), garbage_payload(rng, good)])
                seq += 1
                n_payloads += 1
                kinds["payload"] += 1
            elif r < 0.6:
                send_good()
                n_payloads += 1
                kinds["good"] += 1
            else:
                imp.reply(garbage_reply(rng))
                n_frames += 1
                kinds["reply"] += 1
        sent += CHUNK

        def counted(want_frames: int = n_frames, want_payloads: int = n_payloads) -> bool:
            s = drv.stream()
            return (s.bad_frames + s.stray_replies + s.error_replies - frames_base == want_frames
                    and s.batches + s.bad_payloads - payload_base == want_payloads)

        drv.until(counted, 20, f"chunk ending at case {sent} not fully counted")
        assert not imp.requests(), "phase A must not make the subscriber ask anything"
    s = drv.stream()
    assert s.bad_frames + s.stray_replies + s.error_replies - frames_base == n_frames
    assert s.batches + s.bad_payloads - payload_base == n_payloads
    assert s.bad_payloads >= kinds["payload"] // 2 and s.stray_replies > 0 and s.error_replies > 0
    assert s.resets == 1 + s.bad_payloads  # each undecodable batch is a reported loss
    assert s.phase == "live" and s.epoch == epoch and s.gaps == 0
    assert drv.max_poll < 3.0 and drv.max_poll_cpu < 1.0, (drv.max_poll, drv.max_poll_cpu)
    print(f"phase A: {sent} cases {kinds}; counters {s}")

    # ---- phase B: lies in answer to real requests, random live seqs
    def lie() -> list[bytes]:
        k = rng.randrange(7)
        if k == 0:
            return _info(rng.choice([epoch, rng.randrange(1 << 64)]), rng.randrange(-1, seq + 50),
                         rng.randrange(-1, seq + 50), rng.random() < 0.5,
                         rng.choice([None, 0.05, 1.0]))
        if k == 1:
            chunks = rng.randrange(1, 3)
            blocks = [BlockStored([rng.randrange(1, 100)], None, [1, 2, 3, 4], 4, None, "GPU")]
            payload = rng.choice([_enc.encode(KVEventBatch(1.0, blocks, 0)), b"\xc1"])
            return protocol.snap_frames({"epoch": rng.choice([epoch, 7]),
                                     "seq": rng.randrange(-1, seq + 10),
                                     "chunk": rng.randrange(-1, chunks + 1), "chunks": chunks,
                                     "blocks": 1}, payload)
        if k == 2:
            return [b"", b"", _seq(rng.randrange(0, seq + 20)),
                    rng.choice([good.payload(), garbage_payload(rng, good)])]
        if k == 3:
            return [b"", b"", protocol.END_SEQ, b""]
        if k == 4:
            return protocol.err_frames(rng.choice(["busy: too many", "snapshots are disabled", ""]))
        return garbage_reply(rng)

    n_b = 0
    end_b = time.monotonic() + 4.0
    while time.monotonic() < end_b:
        for _ in imp.requests():
            for _ in range(rng.randrange(0, 4)):
                imp.reply(lie())
                n_b += 1
        r = rng.random()
        if r < 0.3:
            s_ = rng.choice([seq, seq + rng.randrange(1, 50), max(0, seq - rng.randrange(1, 50))])
            imp.pub.send_multipart([b"", _seq(s_), rng.choice([good.payload(),
                                                                garbage_payload(rng, good)])])
            seq = max(seq, s_ + 1)
            n_b += 1
        elif r < 0.4 and imp.ident is not None:
            imp.reply(lie())
            n_b += 1
        drv.poll(rng.choice([0, 0, 0, 0.001, 0.005]))
    assert drv.max_poll < 3.0 and drv.max_poll_cpu < 1.0, (drv.max_poll, drv.max_poll_cpu)
    print(f"phase B: {n_b} cases; counters {drv.stream()}")

    # ---- phase C: honest again, new epoch; the same subscriber must recover
    epoch_c = rng.randrange(1 << 64)
    base = 1 << 41
    ring: list[tuple[int, bytes, KVEventBatch]] = []
    k_good = 300

    def serve_honest() -> None:
        for req in imp.requests():
            if type(req) is protocol.ReplayRequest:
                for s_, p, _ in ring:
                    if s_ >= req.start:
                        imp.reply([b"", b"", _seq(s_), p])
                imp.reply([b"", b"", protocol.END_SEQ, b""])
            elif type(req) is protocol.ControlRequest and req.op == protocol.OP_INFO:
                last = ring[-1][0] if ring else base - 1
                imp.reply(_info(epoch_c, last, base if ring else -1))
            elif type(req) is protocol.ControlRequest:
                imp.reply(protocol.err_frames("snapshots are disabled"))
        if len(ring) < k_good:
            b = good.batch()
            s_ = base + len(ring)
            p = encode_batch(b, "vllm")
            ring.append((s_, p, b))
            imp.pub.send_multipart([b"", _seq(s_), p])

    last = base + k_good - 1
    drv.until(lambda: drv.rb.last_seq == last and drv.stream().phase == "live", 30,
              "recovery after the garbage", serve_honest)
    snap_seq = drv.rb.snapshots[-1][0]
    assert snap_seq >= base - 1 and drv.rb.snapshots[-1][3] == 0
    truth = BlockCache()
    for s_, _, b in ring:
        if s_ > snap_seq:
            truth.apply(b)
    assert drv.rb.as_dict() == truth.as_dict()
    delivered = {i.seq: i.batch for i in drv.items if i.seq >= base}
    for s_, _, b in ring:
        if s_ > snap_seq:
            assert delivered[s_].events == b.events
    assert drv.max_poll < 3.0 and drv.max_poll_cpu < 1.0, (drv.max_poll, drv.max_poll_cpu)
    print(f"phase C: recovered at snapshot seq {snap_seq - base} (relative); {drv.stream()}")
