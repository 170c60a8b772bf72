"""kvwire's JetStream consumers (kvwire.nats.consumer) against a real nats-server: the items
equal what was written, gaps resync from the snapshot object, durable resume, bootstrap."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

pytest.importorskip("nats")

from nats_writer import Rebuild, Writer  # noqa: E402

from kvwire.consume.items import Batch, Reset, Snapshot  # noqa: E402
from kvwire.consume.subscriber import Subscriber  # noqa: E402
from kvwire.nats.consumer import NatsStreams  # noqa: E402


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def consume(sub: Subscriber, rb: Rebuild, until: Any, timeout: float = 30.0) -> None:
    """Apply items until ``until()`` (condition-based, bounded)."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"timed out; stats {sub.nats_stats()}"
        for it in sub.poll_many(0.2):
            rb.apply(it)


def same(rb: Rebuild, w: Writer) -> None:
    for name, truth in w.truth.items():
        assert rb.caches[name].as_dict() == truth.as_dict(), name


async def _write(url: str, plan: Any, **limits: Any) -> Writer:
    w = await Writer(url).connect(**limits)
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


def test_chunked_snapshot_marker_and_engine_restart_reach_every_consumer(
        nats_server: Any) -> None:
    async def plan(w: Writer) -> None:
        await w.start("e", 0, epoch=1)
        await w.batches("e", 0, 40)
        await w.snapshot_marker("e", 0, 1, 40, chunks=3)  # a re-snapshot mid-run, chunked
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
            assert [r.reason for r in resets] == ["engine start", "engine restarted"]
            assert resets[1].epoch == 2
            snaps = [i for i in rb.items if type(i) is Snapshot]
            assert [s.seq for s in snaps] == [0, 40, 0] and all(s.exact for s in snaps)
            assert sub.nats_stats()[0].gaps == 0
    finally:
        for sub in subs:
            sub.close()
