"""Two bridges writing one subject (redundant mode, or a lease changing hands), settled on a
real nats-server with two writers (each a bridge's :class:`JsWriter`) driven step by step,
so the race that the process tests leave to timing happens every time:

* both guarded (``--pack N > 1``, the default): the second writer's run, cut differently,
  is refused and never stored; every seq is on the subject once;
* a pipelined writer (``--pack 1``: no guard) beside a guarded one: a batch it writes after
  the other's run covered it is stored again (their Msg-Ids differ: ``e/0/7/2`` is not
  ``e/0/7/1-4``); readers deliver it once (they drop seqs they already have).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

nats = pytest.importorskip("nats")

from waiting import until  # noqa: E402

from kvwire.consume.items import Batch  # noqa: E402
from kvwire.consume.subscriber import Subscriber  # noqa: E402
from kvwire.index.cache import BlockCache  # noqa: E402
from kvwire.nats.bridge_config import BridgeConfig, ensure_stream  # noqa: E402
from kvwire.nats.streams import NatsStreams  # noqa: E402
from kvwire.nats.subjects import H_FIRST_SEQ, H_SEQ  # noqa: E402
from kvwire.nats.writer import JsWriter, marker_entries  # noqa: E402
from kvwire.wire import events as E  # noqa: E402

EPOCH = 7
SUBJECT = "kvwire.events.e.0"


def _batch(seq: int) -> E.KVEventBatch:
    return E.KVEventBatch(time.time(), [E.BlockStored([seq + 1], seq or None, [1] * 4, 4,
                                                      None)], None)


async def _writer(nc: Any, pack: int) -> JsWriter:
    w = JsWriter(nc, nc.jetstream(), "KVWIRE", ack_timeout=5.0, pack=pack)
    await w.start()
    return w


async def _stored(js: Any, n: int) -> list[tuple[str, int, int]]:
    """The first ``n`` messages of the subject: (kind, first seq, last seq)."""
    out = []
    sub = await js.subscribe(SUBJECT, ordered_consumer=True)
    for _ in range(n):
        m = await sub.next_msg(timeout=10)
        last = int(m.headers[H_SEQ])
        out.append((m.headers["Kvwire-Kind"], int(m.headers.get(H_FIRST_SEQ) or last), last))
    await sub.unsubscribe()
    return out


async def _start(url: str, pack_b: int) -> tuple[Any, JsWriter, JsWriter, Any, Any]:
    """Writer A (guarded) puts the markers and a run of batches 1..4 on the subject; writer B
    (``pack_b``) holds the same engine's batches 1..6, behind (it has not seen A's run)."""
    nc_a, nc_b = await nats.connect(url), await nats.connect(url)
    await ensure_stream(nc_a.jetstream(), BridgeConfig(nats=url))
    a, b = await _writer(nc_a, 4), await _writer(nc_b, pack_b)
    la = a.lane("e", 0, SUBJECT)
    for e in marker_entries(la, EPOCH, 0, [], True, "start", a.max_payload):
        await a.submit(e)
    await until(lambda: la.last == (EPOCH, 0) and not la.pending, "A's markers")
    for s in range(1, 5):
        b_ = _batch(s)
        await a.submit(la.batch_entry(EPOCH, s, b_, E.encode_batch(b_)), pump=False)
    await a.pump(la)
    await until(lambda: la.last == (EPOCH, 4), "A's run 1..4")
    lb = b.lane("e", 0, SUBJECT)
    lb.epochs.add(EPOCH)
    return nc_a, a, b, lb, nc_b


def test_two_guarded_writers_never_store_a_batch_twice(nats_server: Any) -> None:
    async def main() -> None:
        nc_a, a, b, lb, nc_b = await _start(nats_server.url, pack_b=3)
        try:
            lb.expect, lb.last = 2, (EPOCH, 0)  # B's view: the subject ends at the markers
            for s in range(1, 7):
                b_ = _batch(s)
                await b.submit(lb.batch_entry(EPOCH, s, b_, E.encode_batch(b_)), pump=False)
            await b.pump(lb)  # run 1..3, guarded by a stale last seq: refused
            await until(lambda: lb.last == (EPOCH, 6) and not lb.held and not lb.pending,
                         "B committed 1..6")
            assert b.stats.refused == 1 and b.stats.superseded == 4, b.stats
            stored = await _stored(nc_a.jetstream(), 4)
            assert stored[2:] == [("batches", 1, 4), ("batches", 5, 6)], stored
        finally:
            for w, nc in ((a, nc_a), (b, nc_b)):
                await w.close()
                await nc.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_pipelined_writer_beside_a_guarded_one_may_store_a_batch_twice(
        nats_server: Any) -> None:
    async def main() -> None:
        nc_a, a, b, lb, nc_b = await _start(nats_server.url, pack_b=1)
        assert not b.guarded  # pipelined: with nats-py's internals only (client_internals)
        try:
            b_ = _batch(2)
            await b.submit(lb.batch_entry(EPOCH, 2, b_, E.encode_batch(b_)))
            await until(lambda: lb.last == (EPOCH, 2), "B's batch 2 acked")
            assert b.stats.duplicates == 0, b.stats  # stored: not the same Msg-Id as 1..4
            stored = await _stored(nc_a.jetstream(), 4)
            assert stored[2:] == [("batches", 1, 4), ("batch", 2, 2)], stored
        finally:
            for w, nc in ((a, nc_a), (b, nc_b)):
                await w.close()
                await nc.close()

    asyncio.run(asyncio.wait_for(main(), 60))
    # a reader delivers seq 2 once: the repeat is dropped (counted as a duplicate)
    truth = BlockCache()
    for s in range(1, 5):
        truth.apply(_batch(s))
    got: list[int] = []
    cache = BlockCache()
    with Subscriber([NatsStreams(nats_server.url)]) as sub:
        deadline = time.monotonic() + 30
        while not got or got[-1] < 4 or sub.nats_stats()[0].duplicates < 1:
            assert time.monotonic() < deadline, (got, sub.nats_stats())
            for it in sub.poll_many(0.2):
                if type(it) is Batch:
                    got.append(it.seq)
                    cache.apply(it.batch)
    assert got == [1, 2, 3, 4] and cache.as_dict() == truth.as_dict(), got
