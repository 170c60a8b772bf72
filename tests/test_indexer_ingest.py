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
from kvwire.publish.publisher import ZmqEventPublisher
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


def _longest(ix: Indexer, blocks: int) -> int:
    st, out = ix.handle("POST", "/query", json.dumps(
        {"token_ids": TOKENS[:blocks * BS], "model": "m"}).encode())
    assert st == 200, out
    return json.loads(out)["default"].get("1", {}).get("longest_matched", 0)


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
