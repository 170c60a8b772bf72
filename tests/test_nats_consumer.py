"""kvwire's JetStream consumers (kvwire.nats.consumer) against a real nats-server: the items
equal what was written, gaps resync from the snapshot object, durable resume, bootstrap.
Every test runs twice: with nats-py's internals and on its public API only (``nats_api``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

pytest.importorskip("nats")

from nats_api import nats_api_fixture  # noqa: E402, F401 - the nats_api fixture
from nats_writer import Rebuild, Writer  # noqa: E402
from waiting import wait_for  # noqa: E402

from kvwire.consume.items import Batch, Reset, Snapshot  # noqa: E402
from kvwire.consume.subscriber import Subscriber  # noqa: E402
from kvwire.nats.streams import NatsStreams  # noqa: E402

pytestmark = pytest.mark.usefixtures("nats_api")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def consume(sub: Subscriber, rb: Rebuild, until: Any, timeout: float = 30.0,
            want: Any = "") -> None:
    """Apply items until ``until()`` (condition-based, bounded)."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, (
            f"timed out at {rb.last} (want {want() if callable(want) else want}); "
            f"stats {sub.nats_stats()}")
        for it in sub.poll_many(0.2):
            rb.apply(it)


def same(rb: Rebuild, w: Writer) -> None:
    for name, truth in w.truth.items():
        assert rb.caches[name].as_dict() == truth.as_dict(), name


async def _write(url: str, plan: Any, w: Writer | None = None, **limits: Any) -> Writer:
    w = await (w or Writer(url)).connect(**limits)
    try:
        await plan(w)
    finally:
        await w.close()
    return w


def test_items_equal_what_was_written(nats_server: Any) -> None:
    async def plan(w: Writer) -> None:
        await w.start("a", 0, epoch=7)
        await w.start("b", 1, epoch=3, chunks=1)
        await w.batches("a", 0, 50)
        await w.batches("b", 1, 30)

    w = run(_write(nats_server.url, plan))
    rb = Rebuild()
    with Subscriber([NatsStreams(nats_server.url)]) as sub:
        consume(sub, rb, lambda: rb.caught_up(w))
        st = sub.stats()
        nst = sub.nats_stats()[0]
    same(rb, w)
    kinds = [(type(i).__name__, i.stream) for i in rb.items if type(i) is not Batch]
    assert kinds.count(("Reset", "a/dp0")) == 1 and kinds.count(("Snapshot", "b/dp1")) == 1
    assert [i.seq for i in rb.items if type(i) is Batch and i.stream == "a/dp0"] == list(
        range(1, 51))
    assert st["a/dp0"].stream.batches == 50 and st["b/dp1"].stream.epoch == 3
    assert nst.gaps == 0 and nst.bad_messages == 0 and nst.batches == 80
    # what NATS streams cannot count is not applicable, never a measured zero
    a = st["a/dp0"].stream
    assert (a.lost, a.replays, a.replayed, a.restarts) == (None, None, None, None), a
    from kvwire.cli.view import COLUMNS, StreamTally

    row = dict(zip(COLUMNS, StreamTally("a/dp0").row(st["a/dp0"])))
    assert (row["gaps/lost"], row["replays"], row["resyncs/restarts"]) == (
        "0/n/a", "n/a", "0/n/a"), row


def test_chunked_snapshot_marker_and_engine_restart_reach_every_consumer(
        nats_server: Any) -> None:
    async def plan(w: Writer) -> None:
        await w.start("e", 0, epoch=1)
        await w.batches("e", 0, 40)
        await w.resync("e", 0, chunks=3)  # a resync mid-run: snapshot marker in 3 chunks
        # a repeat of its last chunk outside the server's dedupe (no Msg-Id): skipped
        await w.raw("e", 0, b"\x90", {"Kvwire-Kind": "snapshot", "Kvwire-Epoch": "1",
                                       "Kvwire-Seq": "40", "Kvwire-Chunk": "2/3"})
        await w.batches("e", 0, 5)
        await w.start("e", 0, epoch=2, reason="engine restarted")  # new epoch
        await w.batches("e", 0, 10)

    w = run(_write(nats_server.url, plan))
    rbs = [Rebuild(), Rebuild()]
    subs = [Subscriber([NatsStreams(nats_server.url)]),
            Subscriber([NatsStreams(nats_server.url, durable="two")])]
    try:
        for sub, rb in zip(subs, rbs, strict=True):
            consume(sub, rb, lambda rb=rb: rb.caught_up(w))
            same(rb, w)
            resets = [i for i in rb.items if type(i) is Reset]
            assert [r.reason for r in resets] == ["engine start", "resync", "engine restarted"]
            assert resets[2].epoch == 2
            snaps = [i for i in rb.items if type(i) is Snapshot]
            assert [s.seq for s in snaps] == [0, 40, 0] and all(s.exact for s in snaps)
            nst = sub.nats_stats()[0]
            assert nst.gaps == 0 and nst.duplicates == 1, nst
    finally:
        for sub in subs:
            sub.close()


def test_retention_gap_resyncs_from_the_snapshot_else_inexact(nats_server: Any) -> None:
    """A durable reads 20 batches per subject and stops; 200 more are written with at most 50
    kept per subject. On resume each subject has a gap: a snapshot that reaches past it
    resyncs exactly; none, or one older than the gap, gives a counted inexact Snapshot."""
    limits = {"max_msgs_per_subject": 50}

    async def first(w: Writer) -> None:
        for e in ("a", "b", "c"):
            await w.start(e, 0, epoch=1)
            await w.batches(e, 0, 20)

    w = run(_write(nats_server.url, first, **limits))
    spec = NatsStreams(nats_server.url, durable="slow")
    rb = Rebuild()
    with Subscriber([spec]) as sub:
        consume(sub, rb, lambda: rb.caught_up(w))
        assert sub.commit()
    same(rb, w)

    async def second(w: Writer) -> None:
        await w.batches("c", 0, 80)
        await w.snapshot_object("c", 0)  # at seq 100: older than what is kept (176..)
        await w.batches("c", 0, 125)
        for e in ("a", "b"):
            await w.batches(e, 0, 200)
        await w.snapshot_object("a", 0)  # at seq 220: past the gap
        await w.batches("a", 0, 5)
        await w.batches("b", 0, 5)

    run(_write(nats_server.url, second, w, **limits))
    before = len(rb.items)
    with Subscriber([spec]) as sub:
        consume(sub, rb, lambda: rb.caught_up(w))
        nst = sub.nats_stats()[0]
        st = sub.stats()
    resets = {i.stream: i for i in rb.items[before:] if type(i) is Reset}
    assert set(resets) == {"a/dp0", "b/dp0", "c/dp0"}
    # (their last acknowledged messages went with the history: the position is unknown)
    assert all(r.reason.startswith("gap: batch epoch 1 seq 176 after an unknown position")
               for r in resets.values()), resets
    assert rb.caches["a/dp0"].as_dict() == w.truth["a/dp0"].as_dict()  # exact again
    assert rb.inexact == {"b/dp0", "c/dp0"}
    assert st["a/dp0"].stream.exact and not st["b/dp0"].stream.exact
    assert nst.gaps == 3 and nst.resyncs == 1 and nst.inexact == 2, nst
    # what an inexact subject holds is right for what it was told (a subset of the truth)
    for name in ("b/dp0", "c/dp0"):
        got, truth = rb.caches[name].as_dict(), w.truth[name].as_dict()
        assert got and all(truth.get(k) == v for k, v in got.items())


def _lines(path: Any) -> list[list[Any]]:
    import json

    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("]")]



def _ack_floor(url: str, durable: str) -> int:
    import nats

    async def go() -> int:
        nc = await nats.connect(url)
        try:
            info = await nc.jetstream().consumer_info("KVWIRE", durable)
            return info.ack_floor.stream_seq
        finally:
            await nc.close()

    return run(go())


def test_durable_consumer_killed_and_restarted_resumes_exactly(
        nats_server: Any, tmp_path: Any) -> None:
    """A real consumer process (durable) is SIGKILLed mid-stream and restarted: every batch
    arrives, none twice except those it was killed between handing out and committing (at
    most its last slice); killed once all is committed, it resumes with not one repeat."""
    import os
    import signal
    import subprocess
    import sys

    url = nats_server.url
    script = os.path.join(os.path.dirname(__file__), "_nats_consume_proc.py")

    def spawn(out: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, script, url, "dur", str(out)],
                                stdout=subprocess.DEVNULL)

    async def first(w: Writer) -> None:
        for e in ("a", "b"):
            await w.start(e, 0, epoch=5)
        for _ in range(10):
            for e in ("a", "b"):
                await w.batches(e, 0, 100)

    w = run(_write(url, first))
    outs = [tmp_path / f"run{i}.jsonl" for i in range(3)]
    p = spawn(outs[0])
    try:
        wait_for(lambda: len(_lines(outs[0])) >= 600, "600 items", timeout=60, interval=0.05)
        os.kill(p.pid, signal.SIGKILL)  # mid-stream
        p.wait(10)

        async def more(w: Writer) -> None:
            for e in ("a", "b"):
                await w.batches(e, 0, 300)

        run(_write(url, more, w))
        p = spawn(outs[1])
        want = {("a/dp0", s) for s in range(1, 1301)} | {("b/dp0", s) for s in range(1, 1301)}

        def seen(paths: list[Any]) -> list[tuple[str, int]]:
            return [(x[1], x[3]) for p_ in paths for x in _lines(p_) if x[0] == "batch"]

        wait_for(lambda: set(seen(outs[:2])) >= want, "every batch after the restart", timeout=60, interval=0.05)
        l0, l1 = seen(outs[:1]), seen(outs[1:2])
        assert [x for x in _lines(outs[1]) if x[0] != "batch"] == []  # resumed, no bootstrap
        dup = set(l0) & set(l1)
        assert len(l0) == len(set(l0)) and len(l1) == len(set(l1))
        # repeats: only the tail handed out after the last commit (one slice at most)
        assert len(dup) <= 50 and all(l0.index(d) >= len(l0) - len(dup) for d in dup)
        # killed with everything committed: resumes with not one repeat
        last_js = max(w.last_js.values())
        wait_for(lambda: _ack_floor(url, "dur") >= last_js, "ack floor at the end", timeout=60, interval=0.05)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)

        async def last(w: Writer) -> None:
            for e in ("a", "b"):
                await w.batches(e, 0, 50)

        run(_write(url, last, w))
        p = spawn(outs[2])
        wait_for(lambda: len(_lines(outs[2])) >= 100, "the last 100 batches", timeout=60, interval=0.05)

        async def sentinel(w: Writer) -> None:  # written last: delivered after any repeat
            await w.batches("a", 0, 1)

        run(_write(url, sentinel, w))
        wait_for(lambda: ("a/dp0", 1351) in seen(outs[2:]), "the sentinel batch", timeout=60, interval=0.05)
        assert sorted(seen(outs[2:])) == sorted(
            [("a/dp0", s) for s in range(1301, 1352)] + [("b/dp0", s) for s in range(1301, 1351)])
    finally:
        p.kill()
        p.wait(10)
    # Ground truth: the three runs' items applied in order (a repeated batch, from the first
    # kill's uncommitted tail, applied once) rebuild both engines' caches exactly.
    import msgspec

    from kvwire.index.cache import BlockCache
    from kvwire.wire.events import BlockStored, decode_batch

    caches: dict[str, BlockCache] = {}
    done: set[tuple[str, int]] = set()
    for path in outs:
        for kind, stream, _ep, seq, body in _lines(path):
            if kind == "reset":
                caches[stream] = BlockCache()
            elif kind == "snapshot":
                caches[stream].apply_events(
                    msgspec.msgpack.decode(bytes.fromhex(body), type=list[BlockStored]))
            elif (stream, seq) not in done:
                done.add((stream, seq))
                caches[stream].apply(decode_batch(bytes.fromhex(body)))
    for name, truth in w.truth.items():
        assert caches[name].as_dict() == truth.as_dict(), name


def test_new_consumer_after_1e5_batches_bootstraps_from_the_snapshot(nats_server: Any) -> None:
    """10^5 batches over 4 engines (written straight with nats-py: the bridge path is not
    what is tested here), snapshot objects (e0's 5,000 batches older), then 100 more each:
    a new consumer loads the snapshots, reads only what follows each, and ends exactly at
    the engines' state."""
    engines = ("e0", "e1", "e2", "e3")

    async def plan(w: Writer) -> None:
        for e in engines:
            await w.start(e, 0, epoch=9)
        for r in range(5):
            if r == 4:
                await w.snapshot_object("e0", 0)  # an older one: e0 catches up 5,000
            for e in engines:
                await w.batches(e, 0, 5000)
        for e in engines[1:]:
            await w.snapshot_object(e, 0)
        for e in engines:
            await w.batches(e, 0, 100)

    t0 = time.monotonic()
    w = run(_write(nats_server.url, plan))
    wrote = time.monotonic() - t0
    rb = Rebuild()
    t0 = time.monotonic()
    with Subscriber([NatsStreams(nats_server.url)]) as sub:
        consume(sub, rb, lambda: rb.caught_up(w), timeout=60)
        took = time.monotonic() - t0
        nst = sub.nats_stats()[0]
    same(rb, w)
    snaps = [i for i in rb.items if type(i) is Snapshot]
    assert sorted(s.seq for s in snaps) == [20_000] + [25_000] * 3
    assert all(s.exact for s in snaps)
    assert sum(type(i) is Batch for i in rb.items) == 5400
    # each subject read from its own snapshot on (direct gets for e0's 5,000 before the
    # newest snapshot): nothing of the other 10^5 read, nothing read only to be skipped
    assert nst.messages == 5400 and nst.skipped == 0 and nst.caught_up == 3, nst
    assert nst.gaps == 0
    print(f"wrote 10^5 batches in {wrote:.1f} s; bootstrap of "
          f"{sum(s.block_count for s in snaps)} blocks + 5,400 batches in {took:.2f} s")


def test_malformed_messages_are_counted_named_and_never_crash(nats_server: Any) -> None:
    """Bad headers, an unknown kind, a bad chunk header, a subject outside the layout and an
    undecodable batch body: each counted and named; the consumer keeps going, and the batch
    lost to a bad body is a gap (no snapshot object here: an inexact restart, counted)."""
    from kvwire.nats import subjects as S

    def h(kind: str | None = "batch", epoch: str | None = "1", seq: str | None = "6",
          **extra: str) -> dict[str, str]:
        out = {S.H_KIND: kind, S.H_EPOCH: epoch, S.H_SEQ: seq, **extra}
        return {k: v for k, v in out.items() if v is not None}

    async def plan(w: Writer) -> None:
        await w.start("a", 0, epoch=1)
        await w.batches("a", 0, 5)
        await w.raw("a", 0, b"x", h(kind=None))
        await w.raw("a", 0, b"x", h(kind="bogus"))
        await w.raw("a", 0, b"x", h(epoch="one"))
        await w.raw("a", 0, b"x", h(seq="-3"))
        await w.raw("a", 0, b"x", None)
        await w.raw("a", 0, b"x", h(kind="snapshot", **{S.H_CHUNK: "7/2"}))
        await w.js.publish("kvwire.events.not-a-rank", b"x", headers=h())
        await w.js.publish("kvwire.events.a.0.extra", b"x", headers=h())
        await w.raw("a", 0, b"\xc1 not msgpack", h(seq="6"))  # seq 6's real body is lost
        await w.batches("a", 0, 1, publish=False)  # (seq 6 in the truth)
        await w.batches("a", 0, 7)

    w = run(_write(nats_server.url, plan))
    rb = Rebuild()
    with Subscriber([NatsStreams(nats_server.url)]) as sub:
        consume(sub, rb, lambda: rb.caught_up(w))
        nst = sub.nats_stats()[0]
        st = sub.stats()["a/dp0"].stream
    assert nst.bad_messages == 9, nst
    assert st.bad_payloads == 7  # the two with foreign subjects have no stream of their own
    assert nst.gaps == 1 and nst.inexact == 1 and nst.resyncs == 0, nst
    assert "no snapshot" in (nst.last_error or ""), nst.last_error
    resync = [i for i in rb.items if type(i) is Reset][-1]
    assert resync.reason.startswith("gap: batch epoch 1 seq 7 after epoch 1 seq 5"), resync
    tail = rb.items[rb.items.index(resync) + 1:]
    assert type(tail[0]) is Snapshot and not tail[0].exact and tail[0].seq == 6
    assert [i.seq for i in tail[1:]] == list(range(7, 14))


def test_consumer_reconnects_when_nats_server_restarts(nats_server: Any) -> None:
    """nats-server SIGKILLed and restarted on the same port and store: the consumer (ephemeral
    and durable) reconnects by itself and continues exactly, no gap."""
    async def first(w: Writer) -> None:
        await w.start("a", 0, epoch=2)
        await w.batches("a", 0, 100)

    w = run(_write(nats_server.url, first))
    rbs = [Rebuild(), Rebuild()]
    subs = [Subscriber([NatsStreams(nats_server.url)]),
            Subscriber([NatsStreams(nats_server.url, durable="d")])]
    try:
        for sub, rb in zip(subs, rbs, strict=True):
            consume(sub, rb, lambda rb=rb: rb.caught_up(w))
        nats_server.kill()
        for sub in subs:  # keep polling while the server is down: no crash, no items
            assert sub.poll_many(0.3) == []
        nats_server.start()

        async def more(w: Writer) -> None:
            await w.batches("a", 0, 100)

        run(_write(nats_server.url, more, w))
        for sub, rb in zip(subs, rbs, strict=True):
            consume(sub, rb, lambda rb=rb: rb.caught_up(w), timeout=120)
            same(rb, w)
            nst = sub.nats_stats()[0]
            assert nst.gaps == 0 and nst.reconnects >= 1, nst
    finally:
        for sub in subs:
            sub.close()


def test_asyncio_face_and_bounded_memory(nats_server: Any) -> None:
    """``async for`` delivers the same items; while the application does not take items,
    the source stops asking (flow control, nothing dropped): about 2 x ``max_pending``
    (source + Subscriber queue) at most, not the 3,000 waiting in the stream."""
    async def plan(w: Writer) -> None:
        await w.start("a", 0, epoch=1)
        await w.batches("a", 0, 3000)

    w = run(_write(nats_server.url, plan))
    spec = NatsStreams(nats_server.url, max_pending=100, fetch=50)

    async def go() -> tuple[Rebuild, int]:
        rb = Rebuild()
        async with Subscriber([spec]) as sub:
            first = await sub.apoll(30)  # the source is running; now leave it alone
            rb.apply(first)
            t0 = time.monotonic()
            while sub.nats_stats()[0].messages < 100 and time.monotonic() - t0 < 30:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # (an upper bound: slowness cannot make this fail)
            held = sub.nats_stats()[0].messages
            async for it in sub:
                rb.apply(it)
                if rb.caught_up(w):
                    break
        return rb, held

    rb, held = run(go())
    # at most max_pending in the source + one request in flight, and as much again moved
    # into the Subscriber's queue by the one apoll (the application's side of the bound)
    assert 100 <= held <= 2 * (100 + 50 + 25), held
    same(rb, w)


def test_real_bridge_engine_restart_reaches_every_consumer_as_reset(
        nats_server: Any, tmp_path: Any) -> None:
    """End to end with the real pieces: a kvwire engine process -> ``kvwire bridge`` (a real
    process) -> JetStream -> two consumers (ephemeral and durable), live the whole time. The
    engine restarts (new epoch): both get a Reset with the new epoch, and both end exactly
    at the new engine's cache.

    A kvwire engine keeps publishing after a run: an empty heartbeat batch (a new seq) every
    0.2 s of silence. So a consumer's end is "at or past the run's last seq, in its epoch",
    never "at it" (one ``poll_many`` can hand out the run's last batch and heartbeats after
    it together, and a consumer waited on second holds seconds of heartbeats by then); what
    follows the run's last seq must be empty batches, which keeps the cache check exact.
    The waits for a heartbeat on the subject make that tail present every time."""
    from bridge_helpers import BridgeProc, wait_subject_seq
    from fault_helpers import Engine

    subject = "kvwire.events.k.0"

    def reached(rb: Rebuild, epoch: int, seq: int) -> bool:
        at = rb.last.get("k/dp0")
        return at is not None and at[0] == epoch and at[1] >= seq

    def tail_is_heartbeats(rb: Rebuild, epoch: int, seq: int) -> None:
        late = [i for i in rb.items if type(i) is Batch and i.stream == "k/dp0"
                and i.epoch == epoch and i.seq > seq]
        assert late and all(not i.batch.events for i in late), late[:3]

    e = Engine(7, workload="small")
    made = [e]
    b = BridgeProc(tmp_path, nats_server.url, [f"k={e.endpoint},replay={e.replay_endpoint}"])
    subs = [Subscriber([NatsStreams(nats_server.url)]),
            Subscriber([NatsStreams(nats_server.url, durable="d")])]
    rbs = [Rebuild(), Rebuild()]
    try:
        b.wait_started()
        e.run(1500, 3000)
        d = e.wait_done(120)
        wait_subject_seq(nats_server.url, subject, d.last_seq + 1, 60, procs=[b],
                         epoch=e.epoch)  # a heartbeat after the run is on the subject
        for sub, rb in zip(subs, rbs, strict=True):
            consume(sub, rb, lambda rb=rb: reached(rb, e.epoch, d.last_seq + 1), 120,
                    lambda: f"seq >= {d.last_seq + 1} of epoch {e.epoch}; "
                            f"bridge log: {b.log()[-1500:]}")
            tail_is_heartbeats(rb, e.epoch, d.last_seq)
        e.kill()
        e2 = Engine(8, port=e.port, rport=e.rport, workload="small")
        made.append(e2)
        e2.run(1000, 3000)
        d2 = e2.wait_done(120)
        assert e2.epoch != e.epoch
        wait_subject_seq(nats_server.url, subject, d2.last_seq + 1, 60, procs=[b],
                         epoch=e2.epoch)
        for sub, rb in zip(subs, rbs, strict=True):
            consume(sub, rb, lambda rb=rb: reached(rb, e2.epoch, d2.last_seq + 1), 120,
                    lambda: f"seq >= {d2.last_seq + 1} of epoch {e2.epoch}; "
                            f"bridge log: {b.log()[-1500:]}")
            tail_is_heartbeats(rb, e2.epoch, d2.last_seq)
            resets = [i for i in rb.items if type(i) is Reset]
            assert [r.epoch for r in resets] == [e.epoch, e2.epoch], resets
            assert rb.caches["k/dp0"].as_dict() == d2.truth
            assert sub.nats_stats()[0].gaps == 0
    finally:
        for sub in subs:
            sub.close()
        b.kill()
        for x in made:
            x.close()


def test_durable_closed_cleanly_resumes_after_what_it_handed_out(nats_server: Any) -> None:
    """Closing a durable Subscriber acks what the application took (no commit needed): the
    next one continues after it, nothing repeated, no new Reset."""
    async def first(w: Writer) -> None:
        await w.start("a", 0, epoch=3)
        await w.batches("a", 0, 50)

    w = run(_write(nats_server.url, first))
    rb = Rebuild()
    spec = NatsStreams(nats_server.url, durable="tidy")
    with Subscriber([spec]) as sub:
        consume(sub, rb, lambda: rb.caught_up(w))

    async def more(w: Writer) -> None:
        await w.batches("a", 0, 10)

    run(_write(nats_server.url, more, w))
    before = len(rb.items)
    with Subscriber([spec]) as sub:
        consume(sub, rb, lambda: rb.caught_up(w))  # (a repeat would break its seq check)
    assert [(type(i).__name__, i.seq) for i in rb.items[before:]] == [
        ("Batch", s) for s in range(51, 61)]
    same(rb, w)


def test_durable_resume_without_direct_get_resyncs_never_trusts(nats_server: Any) -> None:
    """On a stream without allow_direct a restarted durable cannot read where each subject
    stood: it says so (counted) and each subject resyncs from its snapshot object."""
    async def first(w: Writer) -> None:
        await w.start("a", 0, epoch=1)
        await w.batches("a", 0, 20)

    w = run(_write(nats_server.url, first, allow_direct=False))
    rb = Rebuild()
    spec = NatsStreams(nats_server.url, durable="blind")
    with Subscriber([spec]) as sub:
        consume(sub, rb, lambda: rb.caught_up(w))

    async def more(w: Writer) -> None:
        await w.batches("a", 0, 5)
        await w.snapshot_object("a", 0)
        await w.batches("a", 0, 5)

    run(_write(nats_server.url, more, w, allow_direct=False))
    before = len(rb.items)
    with Subscriber([spec]) as sub:
        consume(sub, rb, lambda: rb.caught_up(w))
        nst = sub.nats_stats()[0]
    assert nst.unverified_resumes == 1 and nst.resyncs == 1 and nst.gaps == 1, nst
    assert [(type(i).__name__, i.seq if type(i) is not Reset else None)
            for i in rb.items[before:]] == [("Reset", None), ("Snapshot", 25)] + [
                ("Batch", s) for s in range(26, 31)]
    same(rb, w)


def test_closing_after_the_consumer_thread_ended_raises_nothing(nats_server: Any) -> None:
    """The NATS thread's event loop closes when the thread ends (stopped, or failed), at any
    moment: waking it then must not raise. A raise in ``close()`` once left the Subscriber's
    sockets and context open, and a later garbage collection hung in ``Context.term()``."""
    sub = Subscriber([NatsStreams(nats_server.url)])
    link = sub._core.links[0]  # (reached into: the thread has to be gone first, for real)
    link._in_loop(link._stop_in_loop)
    link._thread.join(10)
    assert not link._thread.is_alive() and link._loop is not None and link._loop.is_closed()
    link._in_loop(link._stop_in_loop)  # what close() and drain() do: no RuntimeError
    assert sub.poll_many(0.05) == []
    sub.close()
    assert link.socket.closed and link._tx.closed


def test_a_consumer_started_before_its_stream_waits_for_it_and_says_so_once(
        nats_server: Any, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A router started before its bridge: the consumer retries until the stream exists
    (each failed try counted), says so at WARNING once rather than at every try, then
    delivers what is written and says how many tries failed."""
    import logging

    from kvwire.nats import consumer

    monkeypatch.setattr(consumer, "SETUP_RETRY", 0.02)  # (a tunable: more tries, sooner)
    caplog.set_level(logging.INFO, logger="kvwire.nats.consumer")

    async def plan(w: Writer) -> None:
        await w.start("a", 0, epoch=1)
        await w.batches("a", 0, 5)

    rb = Rebuild()
    with Subscriber([NatsStreams(nats_server.url)]) as sub:
        wait_for(lambda: (sub.poll_many(0.01), sub.nats_stats()[0].setup_failures >= 5)[1],
                 timeout=30, interval=0.01, what="five failed tries: no stream yet")
        w = run(_write(nats_server.url, plan))
        consume(sub, rb, lambda: rb.caught_up(w))
        failures = sub.nats_stats()[0].setup_failures
    same(rb, w)
    said = [r for r in caplog.records if r.name == "kvwire.nats.consumer"]
    warned = [r for r in said if "cannot set up consumer on KVWIRE" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING, said
    assert "retrying every 0.02 s, 1 failed so far" in warned[0].getMessage()
    done = [r.getMessage() for r in said if "set up after" in r.getMessage()]
    assert done == [f"consumer on KVWIRE set up after {failures} failed attempts"], said
