"""``kvwire index``'s ingest on its HTTP loop (router/indexer_ingest.LoopIngest), with a real
publisher and the real subscriber, on a real asyncio loop:

* an engine that already holds 5,000 blocks when it is registered (the subscriber gets
  them as one snapshot) is applied in bounded turns: between two turns of another callback
  on the loop (a query, in the server) the index grows by at most one piece (about
  ``SNAPSHOT_SLICE`` blocks), never by the whole snapshot;
* live batches after it are applied in order on the same loop: the whole chain matches;
* ``/unregister`` drops the stream's blocks after every item handed out for it.

(Gaps, replay, restarts: the subscriber's own code, the same as with a thread, tested in
tests/test_subscriber*.py; only who calls ``poll_many`` changes here.)
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time

from engine_helpers import TIMEOUT

from kvwire.indexer.indexer import Indexer
from kvwire.indexer.ingest import LoopIngest
from kvwire.publish.publisher import ZmqEventPublisher
from kvwire.routing.feed import Feed
from kvwire.routing.slices import SNAPSHOT_SLICE
from kvwire.wire.events import BlockStored, KVEventBatch

BS = 4
PER_BATCH = 100
BACKLOG = 50  # batches published before the registration: 5,000 blocks
TOKENS = [(i * 7919 + 13) % 50_000 for i in range((BACKLOG + 3) * PER_BATCH * BS)]


def _batch(j: int) -> KVEventBatch:
    """The j-th batch of one chain: blocks j*100 .. j*100+99, parent the one before."""
    lo = j * PER_BATCH
    return KVEventBatch(time.time(), [BlockStored(
        list(range(lo + 1, lo + PER_BATCH + 1)), lo if j else None,
        TOKENS[lo * BS:(lo + PER_BATCH) * BS], BS, None, "GPU")], 0)


def _longest(ix: Indexer, blocks: int, instance: str = "1") -> int:
    st, out = ix.handle("POST", "/query", json.dumps(
        {"token_ids": TOKENS[:blocks * BS], "model": "m"}).encode())
    assert st == 200, out
    return json.loads(out)["default"].get(instance, {}).get("longest_matched", 0)


def test_ingest_takes_turns_with_the_loop() -> None:
    where = tempfile.mkdtemp(prefix="kvw-ing-")
    live, replay = f"ipc://{where}/l", f"ipc://{where}/r"
    pub = ZmqEventPublisher(endpoint=live, replay_endpoint=replay, heartbeat_interval=0.2)
    ix = Indexer.standalone(on_loop=True)
    loop = asyncio.new_event_loop()
    try:
        for j in range(BACKLOG):
            pub.publish(_batch(j))
        st, out = ix.handle("POST", "/register", json.dumps({
            "endpoint": live, "replay_endpoint": replay, "modelname": "m", "instance_id": "1",
            "block_size": BS}).encode())
        assert st == 200, out
        ix.attach(loop)
        keys = ix.feed.index.walk.keys
        sizes: list[int] = []

        async def watch(until) -> None:
            """Another callback on the loop, one per turn, noting the index's size."""
            deadline = time.monotonic() + TIMEOUT
            while not until():
                assert time.monotonic() < deadline, f"timed out; sizes seen {sizes[-5:]}"
                sizes.append(len(ix.feed.index.walk.keys))
                await asyncio.sleep(0)
            sizes.append(len(ix.feed.index.walk.keys))

        loop.run_until_complete(watch(lambda: len(keys) >= BACKLOG * PER_BATCH))
        steps = [b - a for a, b in zip(sizes, sizes[1:]) if b != a]
        assert len(steps) >= 3 and max(steps) <= SNAPSHOT_SLICE + PER_BATCH, steps
        assert _longest(ix, BACKLOG * PER_BATCH) == BACKLOG * PER_BATCH * BS
        for j in range(BACKLOG, BACKLOG + 3):  # live batches, chained on the snapshot
            pub.publish(_batch(j))
        n = (BACKLOG + 3) * PER_BATCH
        loop.run_until_complete(watch(lambda: _longest(ix, n) == n * BS))
        # unregistered: every block of it gone (after whatever was handed out for it)
        st, out = ix.handle("POST", "/unregister", b'{"instance_id": "1"}')
        assert st == 200, out
        loop.run_until_complete(watch(lambda: not ix.feed.index.walk.keys))
        assert ix.feed.pumps >= 3
    finally:
        ix.close()
        loop.close()
        pub.shutdown(timeout=1)



def test_an_idle_loop_sleeps_until_a_socket_says_something_came(monkeypatch) -> None:
    """Between turns the loop watches the subscriber's sockets rather than polling them: an
    idle ingest takes (almost) no turns, and a batch published then is applied at once,
    woken by its socket, though no deadline is near (no heartbeats: the next check is 10 s
    away; stats refreshed hourly). After a stream is unregistered and another registered,
    the new stream's sockets (which may reuse the closed ones' descriptor numbers) wake it
    the same way."""
    monkeypatch.setattr("kvwire.routing.ingest.STATS_EVERY", 3600.0)
    where = tempfile.mkdtemp(prefix="kvw-ing-")
    pubs = {k: ZmqEventPublisher(endpoint=f"ipc://{where}/l{k}",
                                 replay_endpoint=f"ipc://{where}/r{k}", heartbeat_interval=None)
            for k in (1, 2)}
    feed = Feed()
    feed.start(thread=False)
    ix = Indexer(feed)
    ingest = LoopIngest(feed)
    loop = asyncio.new_event_loop()

    def register(k: int) -> None:
        st, out = ix.handle("POST", "/register", json.dumps({
            "endpoint": f"ipc://{where}/l{k}", "replay_endpoint": f"ipc://{where}/r{k}",
            "modelname": "m", "instance_id": str(k), "block_size": BS}).encode())
        assert st == 200, out

    def run(cond, what: str) -> None:
        async def until() -> None:
            deadline = time.monotonic() + 5.0
            while not cond():
                assert time.monotonic() < deadline, f"not woken for {what}"
                await asyncio.sleep(0.005)
        loop.run_until_complete(until())

    def idle_then_live(k: int) -> None:
        """A second of quiet (the SUB's subscription settles meanwhile), then a live batch."""
        turns = ingest.turns
        loop.run_until_complete(asyncio.sleep(1.0))
        assert ingest.turns - turns <= 10, ingest.turns - turns  # (polling every 5 ms: ~200)
        pubs[k].publish(_batch(1))
        run(lambda: _longest(ix, 2 * PER_BATCH, str(k)) == 2 * PER_BATCH * BS,
            f"stream {k}'s live batch")

    try:
        for k in (1, 2):
            pubs[k].publish(_batch(0))  # (in the replay buffer: the bootstrap brings it)
        register(1)
        ingest.attach(loop)
        run(lambda: _longest(ix, PER_BATCH) == PER_BATCH * BS, "the first stream's bootstrap")
        idle_then_live(1)
        st, out = ix.handle("POST", "/unregister", b'{"instance_id": "1"}')
        assert st == 200, out
        run(lambda: not ix.feed.index.walk.keys, "the removal")
        register(2)
        run(lambda: _longest(ix, PER_BATCH, "2") == PER_BATCH * BS,
            "the second stream's bootstrap")
        idle_then_live(2)
    finally:
        ingest.stop()
        feed.close()
        loop.close()
        for p in pubs.values():
            p.shutdown(timeout=1)


def test_an_idle_ingest_thread_waits_for_its_sockets_and_stops_at_once(monkeypatch) -> None:
    """The subscriber thread (``kvwire serve``'s) waits for a delivery until the subscriber's
    next deadline or the stats' refresh, not in polls every 50 ms: with neither near (no
    heartbeats: the next check is 10 s away; the waits made hour-long), a second of quiet is
    at most a few waits, a batch published then is applied at once (its socket wakes the
    wait), and close() ends the wait at once instead of leaving the thread in it."""
    monkeypatch.setattr("kvwire.routing.ingest.STATS_EVERY", 3600.0)
    where = tempfile.mkdtemp(prefix="kvw-ing-")
    pub = ZmqEventPublisher(endpoint=f"ipc://{where}/l", replay_endpoint=f"ipc://{where}/r",
                            heartbeat_interval=None)
    ix = Indexer.standalone()
    ingest = ix.feed.ingest

    def until(cond, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.005)

    def quiet() -> None:
        polls = ingest.polls
        time.sleep(1.0)
        assert ingest.polls - polls <= 5, ingest.polls - polls  # (polling every 50 ms: ~20)

    try:
        pub.publish(_batch(0))  # (in the replay buffer: the bootstrap brings it)
        st, out = ix.handle("POST", "/register", json.dumps({
            "endpoint": f"ipc://{where}/l", "replay_endpoint": f"ipc://{where}/r",
            "modelname": "m", "instance_id": "1", "block_size": BS}).encode())
        assert st == 200, out
        until(lambda: _longest(ix, PER_BATCH) == PER_BATCH * BS, "the bootstrap")
        quiet()
        pub.publish(_batch(1))
        until(lambda: _longest(ix, 2 * PER_BATCH) == 2 * PER_BATCH * BS, "the live batch")
        quiet()
        ix.close()  # (the thread, in a wait of an hour: gone only if woken)
        assert not ingest.running, "close() left the thread waiting"
    finally:
        ix.close()
        pub.shutdown(timeout=1)
