"""The subscriber over real sockets on loopback.

Against two publishers: a minimal reference-style one built here from raw pyzmq (PUB +
ROUTER replay, no kvwire extensions: the "degrade" path) and kvwire's own
``ZmqEventPublisher`` (INFO, snapshots, heartbeats, epochs). Every wait is a condition
with a deadline; nothing sleeps and hopes.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable

import pytest
import zmq
from waiting import wait_for  # noqa: E402

from kvwire.consume.stream import Batch, Liveness, Reset, Snapshot, StreamConfig
from kvwire.consume.subscriber import StreamSpec, Subscriber
from kvwire.index.cache import BlockCache
from kvwire.publish.publisher import ZmqEventPublisher
from kvwire.wire import protocol
from kvwire.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
)

pytestmark = pytest.mark.timeout(60)

FAST = StreamConfig(request_timeout=1.0, info_timeout=0.3, retry_delay=0.1)


# --------------------------------------------------------------------------- helpers


class Gen:
    """Random but valid event batches, applied to a ground-truth cache as they are made."""

    def __init__(self, seed: int = 0, tokens_per_block: int = 4) -> None:
        self.rng = random.Random(seed)
        self.truth = BlockCache()
        self.next = 1
        self.bs = tokens_per_block

    def batch(self) -> KVEventBatch:
        rng, events = self.rng, []
        keys = [k for k, _ in self.truth.items()]
        for _ in range(rng.randint(1, 3)):
            r = rng.random()
            if r < 0.6 or not keys:
                n = rng.randint(1, 3)
                hashes = list(range(self.next, self.next + n))
                self.next += n
                parent = rng.choice(keys)[1] if keys and rng.random() < 0.5 else None
                events.append(BlockStored(hashes, parent, [rng.randint(0, 999)
                                                           for _ in range(n * self.bs)],
                                          self.bs, None, rng.choice([None, "CPU"])))
            elif r < 0.98:
                tier, h = rng.choice(keys)
                events.append(BlockRemoved([h], None if tier == "GPU" else tier))
            else:
                events.append(AllBlocksCleared())
        b = KVEventBatch(time.time(), events, 0)
        self.truth.apply(b)
        return b


class App:
    """What an application does with the items: one cache per stream."""

    def __init__(self) -> None:
        self.caches: dict[str, BlockCache] = {}
        self.next: dict[str, int] = {}
        self.items: list[object] = []
        self.resets: dict[str, list[str]] = {}
        self.snapshots: dict[str, list[Snapshot]] = {}
        self.liveness: dict[str, list[bool]] = {}

    def feed(self, d: object) -> None:
        self.items.append(d)
        if isinstance(d, Reset):
            self.resets.setdefault(d.stream, []).append(d.reason)
            self.caches[d.stream] = BlockCache()
            self.next.pop(d.stream, None)
        elif isinstance(d, Snapshot):
            c = self.caches[d.stream] = BlockCache()
            c.apply_events(d.blocks)
            self.next[d.stream] = d.seq + 1
            self.snapshots.setdefault(d.stream, []).append(d)
        elif isinstance(d, Batch):
            assert d.seq == self.next[d.stream], (d.seq, self.next[d.stream])
            self.next[d.stream] += 1
            self.caches[d.stream].apply(d.batch)
        elif isinstance(d, Liveness):
            self.liveness.setdefault(d.stream, []).append(d.alive)

    def last_seq(self, stream: str) -> int:
        return self.next.get(stream, 0) - 1

    def cache(self, stream: str) -> dict:
        c = self.caches.get(stream)
        return {} if c is None else c.as_dict()


def pump(sub: Subscriber, app: App, until: Callable[[], bool], timeout: float = 10.0) -> None:
    """Feed items to ``app`` until ``until()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not until():
        left = deadline - time.monotonic()
        assert left > 0, f"condition not met in {timeout}s; stats: {sub.stats()}"
        item = sub.poll(min(left, 0.1))
        if item is not None:
            app.feed(item)



# --------------------------------------------------------------------------- reference publisher


class RefPublisher:
    """A reference-style publisher from raw pyzmq: PUB + ROUTER replay, no extensions.

    It ignores requests with the wrong frame count (so INFO/SNAPSHOT go unanswered) and
    can use the pre-0.26 replay layout without the topic frame.
    """

    def __init__(self, *, legacy: bool = False, topic: bytes = b"", buffer_steps: int = 1000,
                 port: int = 0, replay_port: int = 0) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.legacy, self.topic, self.buffer_steps = legacy, topic, buffer_steps
        self.seq = -1
        self.ring: list[tuple[int, bytes]] = []
        self.lock = threading.Lock()
        self.requests: list[list[bytes]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def publish(self, batch: KVEventBatch | bytes) -> int:
        payload = batch if isinstance(batch, bytes) else encode_batch(batch, "vllm")
        with self.lock:
            self.seq += 1
            self.ring.append((self.seq, payload))
            del self.ring[:-self.buffer_steps]
            self.pub.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
            return self.seq

    def send_raw(self, frames: list[bytes]) -> None:
        with self.lock:
            self.pub.send_multipart(frames)

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(20):
                continue
            frames = self.router.recv_multipart()
            self.requests.append(frames[1:])
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue  # what a reference publisher does with INFO/SNAPSHOT
            start = int.from_bytes(frames[2], "big")
            with self.lock:
                ring = list(self.ring)
            ident = frames[0]
            for seq, payload in ring:
                if seq >= start:
                    body = [seq.to_bytes(8, "big"), payload]
                    self.router.send_multipart([ident, b""] + ([] if self.legacy else [self.topic])
                                               + body)
            end = [protocol.END_SEQ, b""]
            self.router.send_multipart([ident, b""] + ([] if self.legacy else [b""]) + end)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


@pytest.fixture
def closer():
    things: list = []
    yield things.append
    for t in reversed(things):
        if isinstance(t, KvPub):
            t.shutdown(timeout=1.0)
        else:
            t.close()


# --------------------------------------------------------------------------- reference publisher tests


@pytest.mark.parametrize("legacy", [False, True], ids=["topic-frame", "pre-0.26-layout"])
def test_degrades_to_reference_publisher(closer, legacy):
    """No INFO answer: start from replay (exact, since its buffer reaches seq 0), then live."""
    pub = RefPublisher(legacy=legacy, topic=b"kv")
    closer(pub)
    gen = Gen(1)
    for _ in range(30):
        pub.publish(gen.batch())  # before anyone listens: only replay has these
    sub = Subscriber([StreamSpec("e", pub.endpoint, "kv", pub.replay_endpoint)], config=FAST)
    closer(sub)
    app = App()
    pump(sub, app, lambda: app.last_seq("e") >= 29)
    for _ in range(20):
        pub.publish(gen.batch())
    pump(sub, app, lambda: app.last_seq("e") >= 49)
    assert app.cache("e") == gen.truth.as_dict()
    assert app.resets["e"] == ["bootstrap"]
    snap = app.snapshots["e"][0]
    assert snap.seq == -1 and snap.exact and snap.epoch is None
    st = sub.stats()["e"].stream
    assert st.mode == "reference" and st.batches == 50 and st.bad_frames == 0
    assert any(r[:3] == [b"", b"KVW1", b"INFO"] for r in pub.requests)  # it did ask


def test_reference_late_join_is_inexact_and_survives_garbage(closer):
    pub = RefPublisher(buffer_steps=5)
    closer(pub)
    gen = Gen(2)
    for _ in range(20):
        pub.publish(gen.batch())
    sub = Subscriber([StreamSpec("e", pub.endpoint, "", pub.replay_endpoint)], config=FAST)
    closer(sub)
    app = App()
    pump(sub, app, lambda: app.last_seq("e") >= 19)
    snap = app.snapshots["e"][0]
    assert not snap.exact and snap.seq == 14  # only 15..19 were replayable, and it says so
    # garbage on the live socket: wrong frame counts, short seq, undecodable payload
    pub.send_raw([b"", b"x"])
    pub.send_raw([b"", b"\x00\x01", b"p"])
    pub.publish(b"\xc1 not msgpack")  # seq 20: counted, skipped
    pub.publish(gen.batch())
    pump(sub, app, lambda: app.last_seq("e") >= 21)
    assert "not a decodable batch" in app.resets["e"][-1] and not app.snapshots["e"][-1].exact
    st = sub.stats()["e"].stream
    assert st.bad_frames == 2 and st.bad_payloads == 1


def test_reference_restart_is_a_reset(closer):
    pub = RefPublisher()
    port = int(pub.endpoint.rsplit(":", 1)[1])
    rport = int(pub.replay_endpoint.rsplit(":", 1)[1])
    sub = Subscriber([StreamSpec("e", pub.endpoint, "", pub.replay_endpoint)], config=FAST)
    closer(sub)
    app = App()
    gen = Gen(3)
    pump(sub, app, lambda: sub.stats()["e"].stream.mode == "reference")
    for _ in range(10):
        pub.publish(gen.batch())
    pump(sub, app, lambda: app.last_seq("e") >= 9)
    pub.close()
    pub2 = RefPublisher(port=port, replay_port=rport)
    closer(pub2)
    gen2 = Gen(4)
    # the SUB reconnects in the background; publish until the new run is seen
    deadline = time.monotonic() + 10
    while len(app.resets["e"]) < 2:
        assert time.monotonic() < deadline, sub.stats()
        pub2.publish(gen2.batch())
        item = sub.poll(0.05)
        if item is not None:
            app.feed(item)
    pump(sub, app, lambda: app.last_seq("e") == pub2.seq)
    assert "went back" in app.resets["e"][1]
    assert app.cache("e") == gen2.truth.as_dict()  # exact: the new run's replay reached seq 0


def test_dead_endpoint_never_hangs():
    """Nothing behind the endpoints: bounded waits, an explicit death, no exception.

    The request and INFO timeouts (2 s) are far above the poll's bound (1.5 s), so a poll
    that waited on either fails it, while a box stall of a second does not."""
    cfg = StreamConfig(request_timeout=2.0, info_timeout=2.0, dead_after=0.5)
    with Subscriber([StreamSpec("gone", "tcp://127.0.0.1:9", "", "tcp://127.0.0.1:9")],
                    config=cfg) as sub:
        t0 = time.monotonic()
        assert sub.poll(0.05) is None
        assert time.monotonic() - t0 < 1.5
        app = App()
        pump(sub, app, lambda: app.liveness.get("gone") == [False]
             and sub.stats()["gone"].stream.mode == "reference", timeout=15)


def test_live_only_stream_without_replay_endpoint(closer):
    pub = RefPublisher()
    closer(pub)
    # a short check interval: a live-only stream has no check to run, and its poller
    # must still sleep past that interval (it once spun a core from then on)
    cfg = StreamConfig(request_timeout=1.0, info_timeout=0.3, retry_delay=0.1,
                       info_interval=0.2, dead_after=60.0)
    sub = Subscriber([StreamSpec("e", pub.endpoint)], config=cfg)
    closer(sub)
    app = App()
    gen = Gen(5)
    # slow joiner: publish until something arrives
    deadline = time.monotonic() + 10
    while "e" not in app.next:
        assert time.monotonic() < deadline
        pub.publish(gen.batch())
        item = sub.poll(0.02)
        if item is not None:
            app.feed(item)
    first = app.snapshots["e"][0]
    assert first.exact == (first.seq == -1)
    n = pub.seq
    for _ in range(5):
        pub.publish(gen.batch())
    pump(sub, app, lambda: app.last_seq("e") == n + 5)
    assert sub.stats()["e"].requests_sent == 0
    # idle, well past the check interval: poll sleeps (thread CPU, not wall time, so a
    # busy box does not make this fail; spinning used ~0.7 s of CPU a second here)
    cpu0, end = time.thread_time(), time.monotonic() + 1.0
    while (left := end - time.monotonic()) > 0:
        assert sub.poll(left) is None
    assert time.thread_time() - cpu0 < 0.2


# --------------------------------------------------------------------------- kvwire publisher tests


class KvPub:
    """A ``ZmqEventPublisher`` bound on a free port, with loopback addresses to connect to.

    (By the spec's rule only ``*``/``::`` endpoints bind, so the publisher binds
    ``tcp://*:0`` and reports the node's address; tests connect over loopback.)
    """

    def __init__(self, port: int = 0, replay_port: int = 0, **kw) -> None:
        self.pub = ZmqEventPublisher(endpoint=f"tcp://*:{port}",
                                     replay_endpoint=f"tcp://*:{replay_port}", **kw)
        self.port = int(self.pub.endpoint.rsplit(":", 1)[1])
        self.replay_port = int(self.pub.replay_endpoint.rsplit(":", 1)[1])
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}"

    def __getattr__(self, name: str):
        return getattr(self.pub, name)

    def spec(self, name: str = "e") -> StreamSpec:
        return StreamSpec(name, self.endpoint, "", self.replay_endpoint)


def kv_pub(**kw) -> KvPub:
    return KvPub(**kw)


def test_late_join_bootstraps_from_snapshot(closer):
    pub = kv_pub(buffer_steps=50)
    closer(pub)
    gen = Gen(6)
    for _ in range(500):  # far more than the replay buffer holds
        pub.publish(gen.batch())
    sub = Subscriber([StreamSpec("e", pub.endpoint, "", pub.replay_endpoint)],
                     config=StreamConfig(snapshot_chunk_blocks=16))
    closer(sub)
    app = App()
    pump(sub, app, lambda: app.last_seq("e") >= 499)
    snap = app.snapshots["e"][0]
    assert snap.exact and snap.epoch == pub.epoch and snap.seq >= 499 - 50
    for _ in range(20):
        pub.publish(gen.batch())
    pump(sub, app, lambda: app.last_seq("e") >= 519)
    assert app.cache("e") == gen.truth.as_dict()
    st = sub.stats()["e"].stream
    assert st.mode == "kvwire" and st.snapshots == 1 and st.resets == 1 and st.exact


def test_publisher_restart_resets_and_rebootstraps(closer):
    pub = kv_pub(heartbeat_interval=0.2)
    sub = Subscriber([pub.spec()], config=StreamConfig(request_timeout=1.0))
    closer(sub)
    app = App()
    gen = Gen(7)
    for _ in range(30):
        pub.publish(gen.batch())
    pump(sub, app, lambda: app.last_seq("e") >= 29)
    old_epoch = pub.epoch
    pub.shutdown(timeout=1.0)
    pub2 = kv_pub(port=pub.port, replay_port=pub.replay_port, heartbeat_interval=0.2)
    closer(pub2)
    gen2 = Gen(8)
    for _ in range(5):
        pub2.publish(gen2.batch())
    pump(sub, app, lambda: sub.stats()["e"].stream.epoch == pub2.epoch
         and app.last_seq("e") >= 4 and sub.stats()["e"].stream.phase == "live")
    assert pub2.epoch != old_epoch
    assert any("restarted" in r for r in app.resets["e"][1:])
    assert app.snapshots["e"][-1].epoch == pub2.epoch
    assert app.cache("e") == gen2.truth.as_dict()
    assert sub.stats()["e"].stream.restarts >= 1


def test_late_info_answer_is_upgraded_to_kvwire_by_the_next_check(closer, monkeypatch):
    """A kvwire publisher on a starved host answers the first INFO after the subscriber's
    deadline (made to happen by delaying that one answer: starvation cannot be caused on
    cue). The subscriber takes it for a reference publisher at first, follows it inexactly
    (the replay buffer no longer reaches seq 0), and at its next periodic INFO check,
    answered in time, upgrades: it re-bootstraps from a snapshot with epochs and ends exact."""
    info = ZmqEventPublisher._info
    answered = []

    def late_once(self):  # (in the publisher's sender thread)
        answered.append(time.monotonic())
        if len(answered) == 1:
            time.sleep(1.5)
        return info(self)

    monkeypatch.setattr(ZmqEventPublisher, "_info", late_once)
    pub = kv_pub(buffer_steps=50)
    closer(pub)
    gen = Gen(11)
    for _ in range(300):  # past what the replay buffer holds
        pub.publish(gen.batch())
    cfg = StreamConfig(request_timeout=1.0, info_timeout=1.0, info_interval=0.5,
                       retry_delay=0.1)
    sub = Subscriber([pub.spec()], config=cfg)
    closer(sub)
    app = App()
    pump(sub, app, lambda: sub.stats()["e"].stream.mode == "reference")
    assert "reference publisher" in (sub.stats()["e"].stream.last_error or "")
    for _ in range(10):
        pub.publish(gen.batch())
    pump(sub, app, lambda: sub.stats()["e"].stream.mode == "kvwire"
         and sub.stats()["e"].stream.phase == "live", timeout=20)
    assert any("now answers INFO" in r for r in app.resets["e"])
    assert app.snapshots["e"][-1].exact and app.snapshots["e"][-1].epoch == pub.epoch
    for _ in range(10):
        pub.publish(gen.batch())
    wait_for(lambda: pub.stats().queue_depth == 0)
    last = pub.stats().last_seq  # (heartbeats take seqs too)
    pump(sub, app, lambda: app.last_seq("e") >= last)
    assert app.cache("e") == gen.truth.as_dict()
    st = sub.stats()["e"].stream
    assert st.exact and st.epoch == pub.epoch and len(answered) >= 2


def test_stalled_subscriber_gaps_are_filled_by_replay(closer):
    pub = kv_pub(hwm=20, buffer_steps=20_000, heartbeat_interval=None)
    closer(pub)
    sub = Subscriber([StreamSpec("e", pub.endpoint, "", pub.replay_endpoint)], rcvhwm=20)
    closer(sub)
    app = App()
    gen = Gen(9, tokens_per_block=256)  # ~10 MB in all: more than socket buffers hold
    pump(sub, app, lambda: sub.stats()["e"].stream.phase == "live")
    pub.publish(gen.batch())
    pump(sub, app, lambda: app.last_seq("e") >= 0)
    for _ in range(5000):  # the subscriber is not reading: HWM drops
        pub.publish(gen.batch())
    wait_for(lambda: pub.stats().queue_depth == 0)  # all sent (PUB drops silently at HWM)
    pump(sub, app, lambda: app.last_seq("e") >= 5000, timeout=30)
    st = sub.stats()["e"].stream
    assert st.gaps >= 1 and st.replayed > 0 and st.resets == 1
    assert app.cache("e") == gen.truth.as_dict()


def idle_window(sub: Subscriber, app: App, seconds: float) -> tuple[list[float], float]:
    """Pump an idle stream for ``seconds``: the sender-side times (``ts``) of the batches
    that came, between the window's own start and end (wall clock), and this thread's
    longest time between two polls returning."""
    beats: list[float] = [time.time()]
    end = time.monotonic() + seconds
    last = time.monotonic()
    worst = 0.0
    while (now := time.monotonic()) < end:
        item = sub.poll(min(end - now, 0.1))
        t = time.monotonic()
        worst, last = max(worst, t - last), t
        if item is not None:
            app.feed(item)
            if isinstance(item, Batch):
                beats.append(item.batch.ts)
    beats.append(time.time())
    return beats, worst


def test_heartbeats_keep_alive_and_death_is_reported(closer):
    # 0.2 s heartbeats (dead after 3 missed = 0.6 s): 0.1 s ones made a 0.3 s stall of a
    # busy CI box look like a dead publisher
    interval, stall = 0.2, 0.4  # a stall: a heartbeat came (or was polled) 2 intervals late
    pub = kv_pub(heartbeat_interval=interval)
    sub = Subscriber([StreamSpec("e", pub.endpoint, "", pub.replay_endpoint)])
    closer(sub)
    app = App()
    pump(sub, app, lambda: sub.stats()["e"].stream.phase == "live")
    # Idle for 7-8 heartbeat intervals (3 make it dead): still alive, seqs keep coming. A
    # death is accepted (and the window run again, up to 3 times) only when the box
    # demonstrably stalled: the publisher's heartbeats (timed by the sender, so a stall of
    # this thread cannot fake it) or this thread's polls were `stall` s apart. A
    # subscriber that ignores heartbeats reports a death with neither.
    windows = []
    for _ in range(3):
        deaths = len(app.liveness.get("e", []))
        first = app.last_seq("e")
        beats, poll_gap = idle_window(sub, app, 1.5)
        died = False in app.liveness.get("e", [])[deaths:]
        sender_gap = max(b - a for a, b in zip(beats, beats[1:]))
        windows.append(f"seqs {first}..{app.last_seq('e')}, died {died}, heartbeat gap "
                       f"{sender_gap:.3f} s, poll gap {poll_gap:.3f} s")
        if not died or (sender_gap < stall and poll_gap < stall):
            break
        pump(sub, app, lambda: app.liveness["e"][-1])  # alive again once the stall is over
    assert not died and app.last_seq("e") > first + 3, windows
    pub.shutdown(timeout=1.0)
    t0 = time.monotonic()
    reported = len(app.liveness.get("e", []))
    pump(sub, app, lambda: app.liveness.get("e", [])[reported:] == [False], timeout=5)
    # dead_after is 0.6 s: 5x that still tells a report at dead_after from, say, one at
    # the next INFO probe (10 s)
    assert time.monotonic() - t0 < 3.0
    assert not sub.stats()["e"].stream.alive


def test_many_publishers_one_subscriber_and_callbacks(closer):
    pubs = [kv_pub(data_parallel_rank=r) for r in range(3)]
    for p in pubs:
        closer(p)
    gens = [Gen(10 + r) for r in range(3)]
    specs = [StreamSpec(f"e/dp{r}", p.endpoint, "", p.replay_endpoint)
             for r, p in enumerate(pubs)]
    sub = Subscriber(specs)
    closer(sub)
    app = App()
    for _ in range(40):
        for p, g in zip(pubs, gens):
            p.publish(g.batch())
    last = {s.name: pubs[i].stats().last_seq for i, s in enumerate(specs)}
    # callback style
    sub.run(app.feed, timeout=15, stop=lambda: all(
        app.last_seq(n) >= s for n, s in last.items()))
    for r, g in enumerate(gens):
        assert app.cache(f"e/dp{r}") == g.truth.as_dict()
        assert app.snapshots[f"e/dp{r}"][0].epoch == pubs[r].epoch


def test_asyncio_api(closer):
    pub = kv_pub()
    closer(pub)
    gen = Gen(11)
    for _ in range(50):
        pub.publish(gen.batch())

    async def main() -> App:
        app = App()
        async with Subscriber([StreamSpec("e", pub.endpoint, "", pub.replay_endpoint)]) as sub:
            async def consume() -> None:
                async for item in sub:
                    app.feed(item)
                    if app.last_seq("e") >= 59:
                        return

            task = asyncio.ensure_future(consume())
            while app.last_seq("e") < 49:
                await asyncio.sleep(0.01)
            for _ in range(10):
                pub.publish(gen.batch())
            await asyncio.wait_for(task, 10)
            assert await sub.apoll(0.01) is None  # bounded wait, nothing pending
        return app

    app = asyncio.run(asyncio.wait_for(main(), 20))
    assert app.cache("e") == gen.truth.as_dict()


def test_stream_spec_for_ranks():
    specs = StreamSpec.for_ranks("llama", "tcp://10.0.0.1:5557", 2, "kv", "tcp://10.0.0.1:5600")
    assert specs == [
        StreamSpec("llama/dp0", "tcp://10.0.0.1:5557", "kv", "tcp://10.0.0.1:5600"),
        StreamSpec("llama/dp1", "tcp://10.0.0.1:5558", "kv", "tcp://10.0.0.1:5601"),
    ]
    with pytest.raises(ValueError):
        Subscriber([StreamSpec("a", "tcp://127.0.0.1:1"), StreamSpec("a", "tcp://127.0.0.1:2")])


def test_poll_many_gives_what_poll_gives_in_bulk(closer):
    """Two subscribers on one publisher, one through poll(), one through poll_many(): the
    same items in the same order (here with HWM drops filled from replay in between)."""
    pub = kv_pub(hwm=20, buffer_steps=20_000, heartbeat_interval=None)
    closer(pub)
    gen = Gen(12, tokens_per_block=256)  # big: more than socket buffers hold
    specs = [StreamSpec("e", pub.endpoint, "", pub.replay_endpoint)]
    one = Subscriber(specs, config=FAST, rcvhwm=20)
    bulk = Subscriber(specs, config=FAST, rcvhwm=20)
    closer(one)
    closer(bulk)
    apps = App(), App()
    for sub, app in zip((one, bulk), apps):
        pump(sub, app, lambda sub=sub: sub.stats()["e"].stream.phase == "live")
    for _ in range(4000):  # nobody reads meanwhile: both lose some of these live
        pub.publish(gen.batch())
    wait_for(lambda: pub.stats().queue_depth == 0)
    pump(one, apps[0], lambda: apps[0].last_seq("e") >= 3999, timeout=30)
    sizes = []
    deadline = time.monotonic() + 30
    while apps[1].last_seq("e") < 3999:
        assert time.monotonic() < deadline, bulk.stats()
        items = bulk.poll_many(0.1, max_items=100)
        assert len(items) <= 100
        sizes.append(len(items))
        for item in items:
            apps[1].feed(item)
    assert max(sizes) > 1  # it did return several at a time
    for app in apps:
        assert app.cache("e") == gen.truth.as_dict()
    kinds = [[(type(i).__name__, getattr(i, "seq", None)) for i in a.items
              if not isinstance(i, Liveness)] for a in apps]
    assert kinds[0] == kinds[1]
    assert bulk.stats()["e"].stream.gaps >= 1
    assert bulk.poll_many(0.01) == []  # bounded wait, nothing pending


def test_asyncio_poll_many(closer):
    pub = kv_pub()
    closer(pub)
    gen = Gen(13)

    async def main() -> App:
        app = App()
        async with Subscriber([StreamSpec("e", pub.endpoint, "", pub.replay_endpoint)]) as sub:
            while app.last_seq("e") < 99:
                if app.last_seq("e") < 0 and sub.stats()["e"].stream.phase == "live":
                    for _ in range(100):
                        pub.publish(gen.batch())
                for item in await sub.apoll_many(0.05, max_items=10):
                    app.feed(item)
            assert await sub.apoll_many(0.01) == []
        return app

    app = asyncio.run(asyncio.wait_for(main(), 20))
    assert app.cache("e") == gen.truth.as_dict()
