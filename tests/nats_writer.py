"""Writes kvwire's JetStream layout (kvwire.nats.subjects) directly with nats-py: what the
bridge writes, without engines, so consumer tests control every message (gaps, bad input,
10^5 batches in seconds). Also the ground truth: a BlockCache per subject of what was written,
and the consumer-side rebuild from delivered items."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import msgspec

from kvwire.consume.items import Batch, Reset, Snapshot
from kvwire.index.cache import BlockCache
from kvwire.nats import subjects as S
from kvwire.nats.snapshots import snapshot_of, write_snapshot
from kvwire.wire.events import BlockRemoved, BlockStored, KVEventBatch, encode_batch

_enc = msgspec.msgpack.Encoder()


class Writer:
    """One JetStream stream in kvwire's layout; ``truth[stream_name]`` follows every batch."""

    def __init__(self, url: str, stream: str = S.DEFAULT_STREAM,
                 prefix: str = S.DEFAULT_PREFIX, seed: int = 0) -> None:
        self.url, self.stream, self.prefix = url, stream, prefix
        self.truth: dict[str, BlockCache] = {}
        self.hashes: dict[str, list[int]] = {}  # cached hashes per stream (picks, evictions)
        self.pos: dict[str, tuple[int, int]] = {}  # stream name -> (epoch, last seq)
        self.last_js: dict[str, int] = {}
        self.rng = random.Random(seed)
        self.nc: Any = None
        self.js: Any = None
        self._next_hash = 1

    async def connect(self, **limits: Any) -> Writer:
        import nats
        from nats.js.api import StorageType, StreamConfig

        self.nc = await nats.connect(self.url)
        self.js = self.nc.jetstream(timeout=10)
        cfg = StreamConfig(name=self.stream, subjects=[f"{self.prefix}.>"],
                           storage=StorageType.FILE, **{"allow_direct": True, **limits})
        await self.js.add_stream(cfg)
        return self

    async def close(self) -> None:
        await self.nc.close()

    async def _pub(self, engine: str, rank: int, kind: str, epoch: int, seq: int,
                   body: bytes, extra: dict[str, str] | None = None,
                   chunk: int | None = None) -> int:
        h = {S.H_KIND: kind, S.H_EPOCH: str(epoch), S.H_SEQ: str(seq),
             S.H_MSG_ID: S.msg_id(engine, rank, epoch, seq, kind, chunk)}
        h.update(extra or {})
        ack = await self.js.publish(S.subject_for(self.prefix, engine, rank), body, headers=h)
        self.last_js[S.stream_name(engine, rank)] = ack.seq
        return ack.seq

    def events(self, name: str) -> list[Any]:
        """A random step: store a chain (sometimes on a cached parent), maybe evict one."""
        have = self.hashes.setdefault(name, [])
        rng = self.rng
        out: list[Any] = []
        if have and rng.random() < 0.3:
            i = rng.randrange(len(have))
            have[i], have[-1] = have[-1], have[i]
            out.append(BlockRemoved([have.pop()], None))
        n = rng.randint(1, 3)
        hashes = list(range(self._next_hash, self._next_hash + n))
        self._next_hash += n
        parent = rng.choice(have) if have and rng.random() < 0.5 else None
        out.append(BlockStored(hashes, parent, [rng.randint(0, 999) for _ in range(4 * n)],
                               4, None))
        have.extend(hashes)
        return out

    async def start(self, engine: str, rank: int, epoch: int, reason: str = "engine start",
                    chunks: int = 1) -> None:
        """Reset marker + snapshot marker of what the engine holds (nothing after a reset)."""
        name = S.stream_name(engine, rank)
        self.truth[name] = BlockCache()
        self.hashes[name] = []
        await self._pub(engine, rank, "reset", epoch, 0, b"", {S.H_REASON: reason})
        await self.snapshot_marker(engine, rank, epoch, 0, chunks=chunks)
        self.pos[name] = (epoch, 0)

    async def resync(self, engine: str, rank: int, chunks: int = 1,
                     reason: str = "resync") -> None:
        """What the bridge writes when its Subscriber resynced (same epoch): a reset marker
        and a snapshot marker of the current blocks at the current seq."""
        epoch, seq = self.pos[S.stream_name(engine, rank)]
        await self._pub(engine, rank, "reset", epoch, seq, b"", {S.H_REASON: reason})
        await self.snapshot_marker(engine, rank, epoch, seq, chunks=chunks)

    async def snapshot_marker(self, engine: str, rank: int, epoch: int, seq: int,
                              chunks: int = 1, exact: bool = True) -> int:
        blocks = [b.as_event() for b in self.truth[S.stream_name(engine, rank)].blocks()]
        per = max(1, -(-len(blocks) // chunks))
        js = 0
        for i in range(chunks):
            part = blocks[i * per:(i + 1) * per]
            extra = {S.H_CHUNK: f"{i}/{chunks}"}
            if not exact:
                extra["Kvwire-Exact"] = "0"
            js = await self._pub(engine, rank, "snapshot", epoch, seq, _enc.encode(part), extra,
                                 chunk=i)
        return js

    async def batches(self, engine: str, rank: int, n: int, publish: bool = True) -> None:
        """``n`` batches continuing the subject (pipelined; ``publish`` False: truth only,
        i.e. history that never reached the stream)."""
        name = S.stream_name(engine, rank)
        epoch, seq = self.pos[name]
        subject = S.subject_for(self.prefix, engine, rank)
        # Core publishes without a reply (JetStream stores them all the same), then one flush
        # and the subject's last message: the fastest way to fill a stream with nats-py. The
        # last message's seq header proves none was lost on the way.
        sent = 0
        pub = self.nc.publish
        for _ in range(n):
            seq += 1
            evs = self.events(name)
            batch = KVEventBatch(float(seq), evs, rank)
            self.truth[name].apply(batch)
            if not publish:
                continue
            h = {S.H_KIND: "batch", S.H_EPOCH: str(epoch), S.H_SEQ: str(seq),
                 S.H_MSG_ID: S.msg_id(engine, rank, epoch, seq)}
            await pub(subject, encode_batch(batch), headers=h)
            sent += 1
            if sent % 5000 == 0:
                await self.nc.flush(timeout=30)
        if sent:
            await self.nc.flush(timeout=30)
            for _ in range(200):  # stored asynchronously: wait for the last one
                last = await self.js.get_last_msg(self.stream, subject)
                if last.headers and last.headers.get(S.H_SEQ) == str(seq):
                    break
                await asyncio.sleep(0.05)
            else:
                raise RuntimeError(f"{subject}: seq {seq} never reached the stream")
            self.last_js[name] = last.seq
        self.pos[name] = (epoch, seq)

    async def batch(self, engine: str, rank: int, events: list[Any]) -> int:
        """One given batch continuing the subject; its js seq."""
        name = S.stream_name(engine, rank)
        epoch, seq = self.pos[name]
        batch = KVEventBatch(float(seq + 1), events, rank)
        self.truth[name].apply(batch)
        js = await self._pub(engine, rank, "batch", epoch, seq + 1, encode_batch(batch))
        self.pos[name] = (epoch, seq + 1)
        return js

    async def snapshot_object(self, engine: str, rank: int) -> int:
        """Store the subject's truth as its snapshot object, as of its last message."""
        name = S.stream_name(engine, rank)
        epoch, seq = self.pos[name]
        snap = snapshot_of(self.truth[name], engine=engine, rank=rank, epoch=epoch, seq=seq,
                           js_seq=self.last_js[name])
        return await write_snapshot(self.js, snap)

    async def raw(self, engine: str, rank: int, body: bytes,
                  headers: dict[str, str] | None) -> int:
        ack = await self.js.publish(S.subject_for(self.prefix, engine, rank), body,
                                    headers=headers)
        return ack.seq


class Rebuild:
    """What an application holds after applying delivered items (per stream)."""

    def __init__(self) -> None:
        self.caches: dict[str, BlockCache] = {}
        self.items: list[Any] = []
        self.last: dict[str, tuple[int | None, int]] = {}
        self.inexact: set[str] = set()

    def apply(self, it: Any) -> None:
        self.items.append(it)
        if type(it) is Reset:
            self.caches[it.stream] = BlockCache()
        elif type(it) is Snapshot:
            c = self.caches[it.stream] = BlockCache()
            c.apply_events(it.blocks)
            self.last[it.stream] = (it.epoch, it.seq)
            if not it.exact:
                self.inexact.add(it.stream)
        elif type(it) is Batch:
            ep, seq = self.last[it.stream]
            assert (it.epoch, it.seq) == (ep, seq + 1), (it.stream, ep, seq, it.epoch, it.seq)
            self.caches[it.stream].apply(it.batch)
            self.last[it.stream] = (it.epoch, it.seq)

    def caught_up(self, w: Writer) -> bool:
        return all(self.last.get(n) == p for n, p in w.pos.items())
