"""A reference stream (no INFO, no snapshots) must never lose what its publisher still holds.

Why: vLLM's publisher serves a replay from its sending thread, between live sends,
through a ROUTER that drops what does not fit under its HWM. So a replay answer interleaves
with live messages, can have holes, can lose its end marker, can end before the live edge
(new drops at the PUB's HWM meanwhile) and can lose its head to eviction while it is being
served. This model publisher does all of that (``RefPublisher``), and the property is strict:

* deliveries are exactly the seqs in order, never twice (``App`` checks every item);
* an inexact ``Snapshot(seq=s)`` (a loss, or a late start) is only allowed when the
  publisher no longer holds anything up to ``s`` (its ring's oldest seq is past ``s``);
* in the end everything is delivered; if the ring never evicted anything, the application
  is exact and nothing was counted lost.

Time passes only in ``tick``; as the real subscriber does, the I/O layer reads what has
arrived before it lets the machine judge time-outs, and the publisher's loop runs meanwhile.
"""

from __future__ import annotations

import math
import random
from collections import deque

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace
from test_stream import App, SimPublisher

from kvwire.consume.stream import (
    RecycleRequests,
    SendInfo,
    SendReplay,
    SendSnapshot,
    Snapshot,
    StreamConfig,
    StreamMachine,
)
from kvwire.wire import protocol

CFG = StreamConfig(request_timeout=1.0, info_timeout=0.5, retry_delay=0.2)


class RefPublisher:
    """The reference publisher's sending loop: live sends, and between them ``per_send``
    replay messages of the request being served (None: the whole answer at once, as vLLM
    does), read from the ring as it is at that moment; replies go through a pipe of
    ``pipe_cap`` messages that drops when full (ROUTER at its HWM)."""

    def __init__(self, rng: random.Random, buffer_steps: int, per_send: int | None,
                 pipe_cap: int, first_seq: int = 0) -> None:
        self.sim = SimPublisher(rng, kvwire=False, buffer_steps=buffer_steps,
                                first_seq=first_seq)
        self.per_send = per_send
        self.pipe_cap = pipe_cap
        self.gen = 0  # the client's DEALER generation (RecycleRequests opens a new one)
        self.requests: deque[tuple[int, int]] = deque()  # (gen, start)
        self.serving: list[int] | None = None  # [gen, next seq to send]
        self.pipe: deque[list[bytes]] = deque()
        self.evicted_ever = False
        self.down = False  # the process is gone; requests wait in the client's DEALER

    def die(self) -> None:
        """The process dies with the requests it had and the answer it was serving
        (what it already sent stays readable: it is in the client's socket)."""
        self.requests.clear()
        self.serving = None
        self.down = True

    def restart(self) -> None:
        """A new process binds: a new run from the first seq, with an empty ring."""
        self.sim.restart()
        self.down = False
        self.evicted_ever = False

    @property
    def seq(self) -> int:
        return self.sim.seq

    def oldest(self) -> int:
        return self.sim.ring[0][0] if self.sim.ring else self.sim.seq + 1

    def publish(self) -> list[bytes]:
        if len(self.sim.ring) == self.sim.ring.maxlen:
            self.evicted_ever = True
        seq, payload = self.sim.publish()
        return [b"", protocol.pack_seq(seq), payload]

    def _reply(self, gen: int, frames: list[bytes]) -> None:
        if gen == self.gen and len(self.pipe) < self.pipe_cap:
            self.pipe.append(frames)  # else dropped: a recycled peer, or the HWM

    def serve(self, budget: int | None) -> None:
        """One turn of the loop's replay step: up to ``budget`` messages (None: all)."""
        if self.down:
            return
        n = 0
        while budget is None or n < budget:
            if self.serving is None:
                if not self.requests:
                    return
                self.serving = list(self.requests.popleft())
            gen, cursor = self.serving
            nxt = next(((s, p) for s, p in self.sim.ring if s >= cursor), None)
            if nxt is None:
                self._reply(gen, [b"", b"", protocol.END_SEQ, b""])
                self.serving = None
                if budget is not None:
                    return
                continue
            self._reply(gen, [b"", b"", protocol.pack_seq(nxt[0]), nxt[1]])
            self.serving[1] = nxt[0] + 1
            n += 1

    def request(self, start: int) -> None:
        self.requests.append((self.gen, start))

    def recycle(self) -> None:
        self.gen += 1
        self.pipe.clear()


class RefSim:
    def __init__(self, pub: RefPublisher, config: StreamConfig) -> None:
        self.pub = pub
        self.m = StreamMachine("ref", config=config, first_seq=pub.sim.first_seq)
        self.app = App()
        self.live_q: deque[list[bytes]] = deque()
        self.now = 0.0
        self.protected = 0  # live messages at the tail that must not be dropped
        # (After a restart an inexact start may be a batch of the old run held when the
        # new one was rebuilt: inexact says so, it is not checked against the new ring.)

    def handle(self, outs: list) -> None:
        for o in outs:
            if isinstance(o, RecycleRequests):
                self.pub.recycle()
            elif isinstance(o, SendReplay):
                self.pub.request(o.start)
            elif isinstance(o, (SendInfo, SendSnapshot)):
                pass  # a reference publisher ignores what it does not understand
            else:
                if isinstance(o, Snapshot) and not o.exact and not self.pub.sim.restarts:
                    # Inexact only for what the publisher no longer holds.
                    assert self.pub.oldest() > o.seq, (o, self.pub.oldest(), self.m.stats())
                self.app.feed(o)

    def publish(self, n: int) -> None:
        for _ in range(n):
            self.live_q.append(self.pub.publish())
            self.pub.serve(self.pub.per_send)
        self.protected = 0

    def drop(self, n: int) -> None:
        """The PUB's HWM: the newest unread live messages never arrive."""
        for _ in range(min(n, len(self.live_q) - self.protected)):
            self.live_q.pop()

    def live(self, n: int) -> None:
        msgs = [self.live_q.popleft() for _ in range(min(n, len(self.live_q)))]
        self.protected = min(self.protected, len(self.live_q))
        if msgs:
            self.handle(self.m.live_messages(msgs, self.now))

    def reply(self, n: int) -> None:
        for _ in range(n):
            if not self.pub.pipe:
                return
            self.handle(self.m.reply_frames(self.pub.pipe.popleft(), self.now))

    def read_all(self) -> None:
        while self.live_q or self.pub.pipe:
            self.live(len(self.live_q))
            self.reply(len(self.pub.pipe))

    def tick(self, dt: float) -> None:
        """Time passes in 0.1 s turns: the publisher's loop serves, the I/O layer reads
        what arrived, then the machine judges its deadlines."""
        for _ in range(max(1, round(dt / 0.1))):
            self.stall(0.1)

    def stall(self, dt: float) -> None:
        """The consumer is stopped for ``dt``: the publisher's loop goes on (one turn per
        0.1 s); on waking, the I/O layer reads what arrived before any deadline is judged."""
        for _ in range(max(1, round(dt / 0.1))):
            self.pub.serve(self.pub.per_send)
        self.now += dt
        self.read_all()
        self.handle(self.m.tick(self.now))

    def settle(self) -> None:
        self.live_q.append(self.pub.publish())  # a last batch shows where the end is
        self.protected = 1
        for _ in range(400):
            self.pub.serve(None)
            self.read_all()
            if (self.m.phase == "live" and self.m.last_seq == self.pub.seq
                    and not self.pub.requests and self.pub.serving is None):
                return
            self.tick(0.6)
        raise AssertionError(f"no convergence: {self.m.stats()}")

    def idle(self) -> None:
        """0.1 s with nothing published: the publisher's loop serves whole answers."""
        self.pub.serve(None)
        self.now += 0.1
        self.read_all()
        self.handle(self.m.tick(self.now))

    def settle_quiet(self) -> None:
        """Stop publishing, with no last batch to show where the end is: whatever was
        dropped at the end is found only by asking. The consumer stalls once (so anything
        the publisher sent may be lost on the way), then only time passes, 0.1 s a turn,
        in which the idle publisher's loop serves whole answers (as vLLM's does). At every
        turn after the stall, ``exact`` means the application has every batch the publisher
        sent; in the end it has them all (exact, or inexact after an eviction)."""
        self.stall(self.m.config.tail_after + 0.5)
        for _ in range(600):
            self.idle()
            s = self.m.stats()
            if s.state == "exact":
                assert self.app.exact and self.app.next == self.pub.seq + 1, (
                    s, self.app.next, self.pub.seq)
            if self.pub.seq < self.pub.sim.first_seq and s.phase == "await_first":
                return  # nothing published at all
            if (s.state in ("exact", "inexact") and s.phase == "live"
                    and self.app.next == self.pub.seq + 1 and not self.pub.requests
                    and self.pub.serving is None and not self.pub.pipe):
                return
        raise AssertionError(f"no convergence: {self.m.stats()} app.next {self.app.next} "
                             f"publisher at {self.pub.seq}")


_ARGS = {
    "pub": st.integers(1, 8),
    "serve": st.just(0),
    "live": st.integers(1, 10),
    "reply": st.integers(1, 10),
    "drop": st.integers(1, 6),
    "tick": st.sampled_from([0.1, 0.3, 0.6]),
    "stall": st.sampled_from([1.5, 3.0]),
}
_KINDS = ["pub", "live", "reply", "drop"] * 4 + ["serve", "tick", "stall"]
op = st.sampled_from(_KINDS).flatmap(lambda k: st.tuples(st.just(k), _ARGS[k]))
# With restarts: the publisher dies and a new run starts while the consumer runs on (its
# requests meanwhile wait for whoever binds next), or while the consumer is stopped.
_ARGS_R = dict(_ARGS, restart=st.integers(1, 4), stalled_restart=st.integers(1, 6))
_KINDS_R = _KINDS + ["restart", "stalled_restart"]
# what every property test here draws besides its operations
_CHAOS = dict(seed=st.integers(0, 2**32), buffer_steps=st.sampled_from([3, 10, 40, 10_000]),
              per_send=st.sampled_from([None, 1, 3]))
op_r = st.sampled_from(_KINDS_R).flatmap(lambda k: st.tuples(st.just(k), _ARGS_R[k]))


def run(ops: list, seed: int, buffer_steps: int, per_send: int | None, pipe_cap: int,
        max_buffer: int, first_seq: int = 0, quiet: bool = False) -> RefSim:
    pub = RefPublisher(random.Random(seed), buffer_steps, per_send, pipe_cap, first_seq)
    sim = RefSim(pub, StreamConfig(request_timeout=1.0, info_timeout=0.5, retry_delay=0.2,
                                   max_buffer=max_buffer))
    sim.handle(sim.m.start(sim.now))
    for name, arg in ops:
        if name == "pub":
            sim.publish(arg)
        elif name == "serve":
            pub.serve(pub.per_send)
        elif name == "live":
            sim.live(arg)
        elif name == "reply":
            sim.reply(arg)
        elif name == "drop":
            sim.drop(arg)
        elif name == "tick":
            sim.tick(arg)
        elif name == "stall":
            sim.stall(arg)
        elif name == "restart":
            pub.die()
            sim.tick(1.5)  # a restart takes time: the consumer's requests time out
            pub.restart()
            sim.publish(arg)
        elif name == "stalled_restart":
            pub.die()
            pub.restart()
            sim.publish(arg)
            sim.stall(1.5)
    if quiet:
        sim.settle_quiet()
    else:
        sim.settle()
    return sim


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=10, max_size=150),
    **_CHAOS,
    pipe_cap=st.integers(1, 12),
    max_buffer=st.sampled_from([8, 100_000]),
    first=st.sampled_from([0, 1]),  # 1: Mooncake Store's publisher (RFC #1527)
)
def test_reference_stream_delivers_everything_the_publisher_holds(
        ops, seed, buffer_steps, per_send, pipe_cap, max_buffer, first):
    sim = run(ops, seed, buffer_steps, per_send, pipe_cap, max_buffer, first)
    s = sim.m.stats()
    assert s.phase == "live" and s.buffered == 0 and sim.app.next == sim.pub.seq + 1
    c = sim.app.cache.as_dict()
    if sim.app.exact:
        assert c == sim.pub.sim.truth.as_dict()
    if not sim.pub.evicted_ever:
        assert sim.app.exact and s.lost == 0, s
        assert c == sim.pub.sim.truth.as_dict()
    assert s.mode == "reference"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=10, max_size=150),
    **_CHAOS,
    pipe_cap=st.integers(1, 12),
    max_buffer=st.sampled_from([8, 100_000]),
)
def test_reference_stream_never_reads_exact_without_its_tail(
        ops, seed, buffer_steps, per_send, pipe_cap, max_buffer):
    """The same chaos, then the publisher goes quiet with its tail dropped and the consumer
    stalled: the stream finds the tail by asking (no batch after it ever comes), and says
    ``unconfirmed``, never ``exact``, until it has it."""
    sim = run(ops, seed, buffer_steps, per_send, pipe_cap, max_buffer, quiet=True)
    s = sim.m.stats()
    if s.phase == "await_first":
        return  # nothing was published
    assert s.phase == "live" and s.buffered == 0 and sim.app.next == sim.pub.seq + 1
    if not sim.pub.evicted_ever:
        assert s.state == "exact" and s.lost == 0, s
        assert sim.app.cache.as_dict() == sim.pub.sim.truth.as_dict()


def test_an_overflow_in_one_read_asks_the_publisher_once():
    """Found by the property above: 20 live batches in one read overflowed an 8-batch
    buffer twice, and each overflow asked again at once. The publisher still serves a
    recycled peer's requests (answers dropped), so two answers for nobody queued ahead of
    the real one; with the consumer stalled past its time-out three times, the replay
    then counted as unanswered and the stream started inexact at the live edge while the
    publisher still held it all from seq 18 (buffer of 10, one message per send, a
    ROUTER pipe of one)."""
    ops = ([("pub", 1)] * 8 + [("stall", 1.5)] + [("pub", 1)] * 20
           + [("tick", 0.1)] + [("stall", 1.5)] * 3)
    sim = run(ops, 0, 10, 1, 1, 8)  # RefSim.handle asserts every inexact snapshot
    s = sim.m.stats()
    assert s.buffer_overflows >= 2 and s.phase == "live", s
    assert sim.app.base == 17 and sim.app.next == sim.pub.seq + 1, s  # 0..17 evicted


def test_a_one_message_answer_pipe_still_fills_a_gap():
    """Found by the property above: a gap replay now asks from our last seq (to check it
    is still ours). Through a ROUTER pipe of one message the answer was ours alone, the
    rest and the end dropped, every time: a time-out, the same request again, for ever.
    Ours back confirms the run, so the request after a time-out asks past it."""
    ops = [("live", 1), ("live", 1), ("tick", 0.6)] + [("pub", 1)] * 6 + [("drop", 1)]
    sim = run(ops, 0, 3, None, 1, 8)
    s = sim.m.stats()
    assert s.phase == "live" and sim.app.next == sim.pub.seq + 1 and s.lost == 0, s
    assert sim.app.cache.as_dict() == sim.pub.sim.truth.as_dict()


def test_ours_alone_back_is_not_a_loss():
    """Found by the property above: a checked gap replay through a one-message pipe got our
    own seq and the end marker, the seq after it dropped on the way, and the stream called
    that seq lost (inexact) while the publisher still held it. It asks again past ours."""
    ops = ([("live", 1)] * 3 + [("stall", 1.5), ("serve", 0), ("pub", 4), ("serve", 0),
            ("tick", 0.3), ("pub", 1), ("drop", 1)])
    sim = run(ops, 0, 3, 3, 1, 8)  # RefSim.handle asserts every inexact snapshot
    s = sim.m.stats()
    assert s.phase == "live" and sim.app.next == sim.pub.seq + 1, s


def _stalled_with_router_drops(per_send: int | None) -> RefSim:
    """A fixed run of the shape seen with vLLM: a stall, live drops, a replay answer of 60 through
    a 7-message pipe (holes, lost end), live arriving meanwhile."""
    pub = RefPublisher(random.Random(3), 10_000, per_send, 7)
    sim = RefSim(pub, CFG)
    sim.handle(sim.m.start(0.0))
    sim.tick(0.6)
    sim.tick(0.6)  # no INFO answer: reference
    sim.publish(5)
    sim.read_all()
    sim.publish(60)
    sim.drop(58)  # the stall: only 2 of 60 made it past the HWM
    sim.publish(10)
    for _ in range(30):
        sim.live(1)
        sim.reply(2)
        sim.publish(1)
        sim.tick(0.3)
    sim.settle()
    return sim


@pytest.mark.parametrize("per_send", [None, 2])
def test_holes_in_a_replay_answer_are_asked_again_not_lost(per_send):
    sim = _stalled_with_router_drops(per_send)
    s = sim.m.stats()
    assert sim.app.exact and s.lost == 0 and s.resets == 1, s
    if per_send is None:  # the answer came all at once: holes and a lost end, continued
        assert s.replays >= 3, s
    assert sim.app.cache.as_dict() == sim.pub.sim.truth.as_dict()


def test_eviction_counts_only_what_is_gone():
    """The ring (10) evicted part of the gap: exactly those seqs are lost, the rest of the
    gap is replayed, and the check for a ring that still starts at 0 finds it does not."""
    pub = RefPublisher(random.Random(4), 10, None, 100)
    sim = RefSim(pub, CFG)
    sim.handle(sim.m.start(0.0))
    sim.tick(0.6)
    sim.tick(0.6)
    sim.publish(3)
    sim.read_all()  # 0..2 (replay from 0, exact)
    sim.publish(20)  # 3..22; the ring keeps 13..22
    sim.drop(19)  # only 3 arrives... then nothing
    sim.publish(1)  # 23 shows the gap 4..22
    sim.read_all()
    for _ in range(5):
        sim.tick(0.3)
    sim.settle()
    s = sim.m.stats()
    assert s.lost == 10, s  # 4..13 were gone when asked for (the ring then: 14..23)
    assert not sim.app.exact and sim.app.base == 13
    assert sim.app.resets[-1] == "seqs 4..13 lost and no snapshot available"


# --------------------------------------------------------------------------- hand-fed cases

_PUB = SimPublisher(random.Random(9), kvwire=False, buffer_steps=100)
_PAYLOADS = [_PUB.publish()[1] for _ in range(8)]


def _rep(seq: int) -> list[bytes]:
    return [b"", b"", protocol.pack_seq(seq), _PAYLOADS[seq]]


_END = [b"", b"", protocol.END_SEQ, b""]


def _at_gap() -> tuple[StreamMachine, App, list]:
    """A reference stream that has 0..1 and then sees live 5: seqs from 2 asked (from 1,
    our last, which must come back as we had it). (Its check after a quiet spell or a
    stall is off: each 1.1 s tick of these tests is a stall, and they are about replies.)"""
    m, app, sent = StreamMachine("r", config=replace(CFG, tail_after=math.inf)), App(), []

    def feed(outs: list) -> None:
        for o in outs:
            if isinstance(o, (SendInfo, SendReplay, SendSnapshot, RecycleRequests)):
                sent.append(o)
            else:
                app.feed(o)

    feed(m.start(0.0))
    feed(m.tick(0.6))  # no INFO answer: reference, replay from 0
    for f in (_rep(0), _rep(1), _END):
        feed(m.reply_frames(f, 0.7))
    feed(m.live_frames([b"", protocol.pack_seq(5), _PAYLOADS[5]], 0.8))
    assert sent[-1] == SendReplay(1) and app.next == 2
    return m, app, sent


def _feed_into(m: StreamMachine, app: App, sent: list, outs: list) -> None:
    for o in outs:
        if isinstance(o, (SendInfo, SendReplay, SendSnapshot, RecycleRequests)):
            sent.append(o)
        else:
            app.feed(o)


def test_unanswered_replay_is_retried_then_rebuilt_exactly_from_0():
    m, app, sent = _at_gap()
    t = 0.8
    for _ in range(CFG.replay_attempts - 1):
        t += 1.1
        _feed_into(m, app, sent, m.tick(t))
        assert sent[-1] == SendReplay(1)  # asked again: a stall is not a loss
    t += 1.1
    _feed_into(m, app, sent, m.tick(t))
    assert sent[-1] == SendReplay(0) and m.stats().lost == 0  # the rebuild check
    for s in range(6):
        _feed_into(m, app, sent, m.reply_frames(_rep(s), t))
    _feed_into(m, app, sent, m.reply_frames(_END, t))
    st_ = m.stats()
    assert app.resets[-1] == "seqs 2..4 not replayable; rebuilt exactly by a replay from seq 0"
    assert app.exact and app.next == 6 and st_.lost == 0 and st_.resyncs == 1
    assert st_.phase == "live"


def test_rebuild_answer_from_later_seq_counts_only_the_evicted():
    m, app, sent = _at_gap()
    t = 0.8
    for _ in range(CFG.replay_attempts):
        t += 1.1
        _feed_into(m, app, sent, m.tick(t))
    assert sent[-1] == SendReplay(0)
    for s in (3, 4, 5):  # the buffer starts at 3: only seq 2 is gone
        _feed_into(m, app, sent, m.reply_frames(_rep(s), t))
    _feed_into(m, app, sent, m.reply_frames(_END, t))
    st_ = m.stats()
    assert st_.lost == 1 and not app.exact and app.base == 2 and app.next == 6, st_
    assert app.resets[-1] == "seqs 2..2 lost and no snapshot available"
    # and no second rebuild check: the buffer is known not to start at 0 any more
    _feed_into(m, app, sent, m.live_frames([b"", protocol.pack_seq(7), _PAYLOADS[7]], t))
    assert sent[-1] == SendReplay(5)
    _feed_into(m, app, sent, m.reply_frames(_rep(7), t))  # (5, ours, evicted too)
    assert m.stats().lost == 2 and sent[-1] == SendReplay(5)


# --------------------------------------------------------------------------- runs from seq 1

@pytest.mark.parametrize("first_seq,exact", [(1, True), (0, False)])
def test_a_run_from_seq_1_is_an_exact_start_only_where_runs_begin_at_1(first_seq, exact):
    """Mooncake Store's publisher (RFC #1527) numbers a run from 1: a replay from 0 that
    answers 1.. holds its whole run. With ``first_seq=1`` that start is exact; with the
    engines' 0 it is a late start (seq 0 never came), as it must be for a vLLM stream."""
    m, app, sent = StreamMachine("moon", config=CFG, first_seq=first_seq), App(), []
    _feed_into(m, app, sent, m.start(0.0))
    _feed_into(m, app, sent, m.tick(0.6))  # no INFO answer: reference, replay from 0
    assert sent[-1] == SendReplay(0)
    for f in (_rep(1), _rep(2), _END):
        _feed_into(m, app, sent, m.reply_frames(f, 0.7))
    st_ = m.stats()
    assert app.exact is exact and app.base == 0 and app.next == 3, st_
    assert st_.lost == 0 and st_.phase == "live"


@pytest.mark.parametrize("first_seq,exact", [(1, True), (0, False)])
def test_live_only_run_from_seq_1(first_seq, exact):
    """No replay endpoint: the first live batch decides; seq 1 is a whole Mooncake run."""
    m, app, sent = StreamMachine("moon", has_replay=False, config=CFG,
                                 first_seq=first_seq), App(), []
    _feed_into(m, app, sent, m.start(0.0))
    _feed_into(m, app, sent, m.live_frames([b"", protocol.pack_seq(1), _PAYLOADS[1]], 0.1))
    assert app.exact is exact and app.next == 2


def test_rebuild_of_a_run_from_seq_1_is_exact():
    """A loss the replay cannot fill, on a Mooncake stream: the rebuild check (a replay
    from 0) answered from seq 1 rebuilds the whole run exactly."""
    m, app, sent = StreamMachine("moon", config=CFG, first_seq=1), App(), []
    _feed_into(m, app, sent, m.start(0.0))
    _feed_into(m, app, sent, m.tick(0.6))
    for f in (_rep(1), _rep(2), _END):
        _feed_into(m, app, sent, m.reply_frames(f, 0.7))
    _feed_into(m, app, sent, m.live_frames([b"", protocol.pack_seq(6), _PAYLOADS[6]], 0.8))
    assert sent[-1] == SendReplay(2)
    _feed_into(m, app, sent, m.reply_frames(_rep(5), 0.9))  # 2..4 are not there
    assert sent[-1] == SendReplay(0)  # the rebuild check
    for s in range(1, 7):
        _feed_into(m, app, sent, m.reply_frames(_rep(s), 1.0))
    _feed_into(m, app, sent, m.reply_frames(_END, 1.0))
    st_ = m.stats()
    assert app.exact and app.next == 7 and st_.lost == 0 and st_.resyncs == 1, st_
    assert app.resets[-1] == "seqs 3..4 not replayable; rebuilt exactly by a replay from seq 1"


def test_first_seq_must_be_a_seq():
    with pytest.raises(ValueError, match="first_seq must be an int >= 0"):
        StreamMachine("x", first_seq=-1)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op_r, min_size=10, max_size=150),
    **_CHAOS,
    pipe_cap=st.integers(4, 12),  # (see below)
    max_buffer=st.sampled_from([8, 100_000]),
    quiet=st.booleans(),
)
# Found by this test: a quiet stream's tail confirmed by an unchecked answer the new run
# gave; a new run picking up at our next seq after its first batch was lost; a replay
# asked of the old process answered by the new one.
@example(ops=[("pub", 1)] * 7 + [("serve", 0), ("restart", 1), ("drop", 1)], seed=0,
         buffer_steps=3, per_send=None, pipe_cap=1, max_buffer=8, quiet=True)
@example(ops=[("pub", 1), ("restart", 1), *[("live", 1)] * 5, ("tick", 0.1), ("restart", 1),
              ("drop", 1)],
         seed=0, buffer_steps=3, per_send=None, pipe_cap=1, max_buffer=8, quiet=False)
@example(ops=[("pub", 1), ("restart", 1), ("reply", 1), ("drop", 1), ("tick", 0.1),
              ("tick", 0.1), ("live", 1), ("live", 1), ("restart", 1), ("drop", 1)],
         seed=0, buffer_steps=3, per_send=None, pipe_cap=2, max_buffer=8, quiet=False)
def test_a_picture_never_joins_two_runs(ops, seed, buffer_steps, per_send, pipe_cap,
                                        max_buffer, quiet):
    """The same chaos with restarts at any moment: the new run's first batches lost (a PUB
    drops what it sends before the SUB has reconnected), answers of the old process still
    in our socket, requests asked of the old one answered by the new one, the consumer
    stopped through it all. A reference publisher has no epochs; whatever the stream says
    ``exact`` is the current run's cache, batch for batch, never part of one run continued
    by another (with ``quiet``, at every turn after the last stall as well), and it keeps
    up with the new run. (An answer pipe of 1 to 3 messages can drop our own batch and
    deliver the end marker after it: from such an answer a new run that is past our seq
    looks like ours, so those are drawn only in the examples above.)"""
    sim = run(ops, seed, buffer_steps, per_send, pipe_cap, max_buffer, quiet=quiet)
    for _ in range(30):  # then quiet: the tail is asked for, and confirmed or not
        sim.idle()
    s = sim.m.stats()
    if s.phase == "await_first":
        return  # nothing was published
    assert s.phase == "live" and s.buffered == 0 and sim.app.next == sim.pub.seq + 1
    if s.state == "exact":
        assert sim.app.cache.as_dict() == sim.pub.sim.truth.as_dict(), (s, sim.app.resets)
