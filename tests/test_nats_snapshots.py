"""Snapshot objects read back whole, or a clear error in bounded time (real nats-server).

The bridge replaces an engine's snapshot object on a schedule; replacing purges the old
version's chunks. A reader that looked up the old version then waits for chunks that will
never come: it used to wait forever (found by bench/jetstream.py hanging 8 minutes)."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from kvwire.index.cache import BlockCache
from kvwire.nats import snapshots
from kvwire.nats.snapshots import (
    SnapshotReadError,
    open_bucket,
    read_snapshot,
    snapshot_of,
    write_snapshot,
)
from kvwire.nats.subjects import snapshot_object
from kvwire.wire.events import BlockStored


def _cache(n: int, base: int) -> BlockCache:
    c = BlockCache()
    c.apply_events([BlockStored(list(range(base, base + n)), None, list(range(16 * n)), 16,
                                None, None, None)])
    return c


def test_a_replaced_object_is_read_again_never_waited_for_forever(nats_server) -> None:
    async def go() -> None:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        try:
            old = snapshot_of(_cache(20_000, 0), engine="e", rank=0, epoch=1, seq=10, js_seq=5)
            await write_snapshot(js, old)
            store = await open_bucket(js)
            stale = await store.get_info(snapshot_object("e", 0))
            new = snapshot_of(_cache(30_000, 10**6), engine="e", rank=0, epoch=1, seq=20,
                              js_seq=9)
            await write_snapshot(js, new)  # purges the chunks `stale` names
            t = time.monotonic()
            with pytest.raises(snapshots._Incomplete, match="no chunk for 0.5s"):
                await snapshots._fetch(js, "kvwire-snapshots", stale, chunk_timeout=0.5)
            assert time.monotonic() - t < 10
            got = await read_snapshot(js, "e", 0, chunk_timeout=0.5)
            assert got is not None and (got.seq, got.js_seq, got.block_count) == (20, 9, 30_000)
            assert got.cache().as_dict() == _cache(30_000, 10**6).as_dict()
        finally:
            await nc.close()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_unreadable_every_time_is_a_clear_error(nats_server, monkeypatch) -> None:
    """Forced fault (cannot be made to happen on every try for real): each read stalls."""
    async def stalled(js, bucket, info, chunk_timeout=0.0):
        raise snapshots._Incomplete(f"no chunk for {chunk_timeout:g}s (forced)")

    async def go() -> None:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        try:
            await write_snapshot(js, snapshot_of(_cache(10, 0), engine="e", rank=3, epoch=1,
                                                 seq=1, js_seq=1))
            monkeypatch.setattr(snapshots, "_fetch", stalled)
            with pytest.raises(SnapshotReadError, match=r"e\.3 .* not read whole in 3 tries"):
                await read_snapshot(js, "e", 3)
            assert await read_snapshot(js, "e", 4) is None  # no object: None, not an error
        finally:
            await nc.close()

    asyncio.run(asyncio.wait_for(go(), 60))
