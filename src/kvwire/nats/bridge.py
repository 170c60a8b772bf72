"""``kvwire bridge``: follow engines with the reliable Subscriber, write their streams to
JetStream (layout: :mod:`kvwire.nats.subjects`), keep per-stream snapshots in the object store.

Per engine DP rank one subject; every delivered ``Batch`` becomes a ``batch`` message
(re-encoded with :func:`kvwire.wire.events.encode_batch`), every ``Reset`` + ``Snapshot`` a
reset marker and snapshot marker chunks. Exact across bridge restarts: before following
a rank, the bridge reads the subject's last message ``(epoch, seq)`` and rebuilds its state
(:func:`~kvwire.nats.snapshots.rebuild_subject`), then

* kvwire publishers: the Subscriber resumes after ``(epoch, seq)`` (from the engine's
  replay buffer) when the engine still runs that epoch and holds ``seq + 1``; otherwise a
  Reset + Snapshot comes and, if it does not continue the subject, goes on as markers;
* reference publishers (no epoch): their run is numbered by the bridge (``0``, ``+1`` per
  reset marker). The Subscriber replays from seq 0; batches up to ``seq`` are skipped, and
  the batch at ``seq`` must be byte-identical to the subject's last one, else the engine
  restarted while the bridge was away and the skipped run goes on as markers.

Redundant bridges may follow the same engines; ``share=True`` splits the engines by
leases (:mod:`kvwire.nats.leases`) instead.

``pack=N`` (default 256; :mod:`kvwire.nats.writer`): each subject has one message in flight,
guarded by ``Nats-Expected-Last-Subject-Sequence``; the batches that arrive meanwhile go
out as one ``batches`` run of up to N. A quiet stream sends each batch alone at once; a busy
one pays the per-message costs of the bridge, nats-server and consumers once per run. The
guard is what keeps redundant bridges (or a lease changing hands) from storing a batch twice
even though they cut different runs. ``pack=1``: one message per batch, pipelined, and
``Nats-Msg-Id`` dedupe is what keeps redundant bridges exact (identical messages).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import time
import uuid
from typing import Any

import msgspec
import zmq.asyncio

from ..consume.stream import Batch, Liveness, Reset, Snapshot
from ..consume.subscriber import StreamSpec, Subscriber
from ..index.cache import BlockCache, chain_events
from ..wire.events import encode_batch
from .bridge_config import BridgeConfig, BridgeError, ensure_stream
from .connect import connect as connect_nats
from .leases import LeaseTable
from .snapshots import open_bucket, rebuild_subject, snapshot_of, write_snapshot
from .subjects import check_token, subject_for
from .writer import Entry, JsWriter, Lane, marker_entries

_raw_list = msgspec.msgpack.Decoder(list[msgspec.Raw])


def last_batch_body(headers: dict[str, str], data: bytes, seq: int | None) -> bytes | None:
    """The encoded batch at ``seq`` if the message (a ``batch`` or a ``batches`` run) ends
    there: what a reference run's check compares the engine's batch with."""
    kind = headers.get("Kvwire-Kind")
    if seq is None or headers.get("Kvwire-Seq") != str(seq):
        return None  # (a redundant bridge's late, overlapping run: no check possible)
    if kind == "batch":
        return data
    if kind == "batches":
        try:
            parts = _raw_list.decode(data)
        except msgspec.DecodeError:
            return None
        return bytes(parts[-1]) if parts else None
    return None

__all__ = ["Bridge", "BridgeConfig", "BridgeError", "BridgeStats", "ensure_stream"]

log = logging.getLogger("kvwire.nats.bridge")
#: Seconds close() gives each of its steps, and the final snapshot writes.
CLOSE_STEP_S = 5.0
CLOSE_SNAPSHOTS_S = 10.0


class BridgeStats(msgspec.Struct):
    streams: int = 0
    batches: int = 0  # batches submitted
    markers: int = 0  # reset + snapshot marker sets submitted
    skipped: int = 0  # delivered batches already on the subject (restart, redundancy)
    resumed: int = 0  # streams continued exactly from the subject's last message
    diverged: int = 0  # reference runs found different from the subject's (restarted)
    discontinuities: int = 0  # a batch not following the subject's seq (should stay 0)
    liveness: int = 0
    follower_restarts: int = 0
    snapshots_written: int = 0
    snapshot_bytes: int = 0
    snapshot_errors: int = 0
    leases_held: int = 0
    last_error: str | None = None


class _Follow:
    """One engine DP rank: where its subject stands and how the next items continue it."""

    def __init__(self, engine: str, rank: int, lane: Lane) -> None:
        self.engine, self.rank, self.lane = engine, rank, lane
        self.epoch: int | None = None
        self.seq: int | None = None
        self.complete = True
        self.last_body: bytes | None = None
        self.reset: Reset | None = None
        self.skip_to: int | None = None
        self.skip_cache: BlockCache | None = None  # reference run check in progress
        self.skip_seq = -1
        self.skip_exact = True
        self.skip_since = 0.0
        self.fresh = True  # nothing delivered since the follower started
        self.boot = True  # no Snapshot since the follower started

    def resume_point(self) -> tuple[int, int] | None:
        if self.complete and self.epoch is not None and self.seq is not None:
            return (self.epoch, self.seq)
        return None


class Bridge:
    """Engines -> JetStream. ``engines``: :class:`kvwire.consume.engine_spec.EngineSpec` values."""

    def __init__(self, engines: list[Any], config: BridgeConfig | None = None) -> None:
        self.config = cfg = config or BridgeConfig()
        cfg.check()
        names = [e.name for e in engines]
        if not engines or len(set(names)) != len(names):
            raise BridgeError(f"engines must be given, each name once: {names}")
        for e in engines:
            try:
                check_token(e.name, "engine name")
            except ValueError as ex:
                raise BridgeError(str(ex)) from None
        self.engines = list(engines)
        self.stats = BridgeStats()
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.nc: Any = None
        self.js: Any = None
        self.writer: JsWriter | None = None
        self.leases: LeaseTable | None = None
        self._ctx = zmq.asyncio.Context()
        self._follows: dict[str, _Follow] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}  # engine -> its follower
        self._bg: list[asyncio.Task[None]] = []
        self._store: Any = None
        self._closing = False
        self.connected = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        cfg = self.config

        async def on_error(e: Exception) -> None:
            self.stats.last_error = f"nats: {e!r}"

        async def on_disconnect() -> None:
            if not self._closing:
                log.warning("disconnected from NATS; reconnecting")
            if self.writer is not None:
                self.writer.on_disconnect()

        async def on_reconnect() -> None:
            log.warning("reconnected to NATS")

        try:  # the first connect gives up after connect_timeout, naming the last reason
            self.nc = await connect_nats(
                cfg.nats, timeout=cfg.connect_timeout, name="kvwire-bridge",
                error_cb=on_error, disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect, pending_size=64 << 20)
        except (OSError, ValueError) as e:  # NatsConnectError, a bad URL (the cause tells)
            raise BridgeError(str(e)) from e
        self.js = self.nc.jetstream(timeout=5)
        await ensure_stream(self.js, cfg)
        self.writer = JsWriter(self.nc, self.js, cfg.stream, max_inflight=cfg.max_inflight,
                               ack_timeout=cfg.ack_timeout, pack=cfg.pack)
        await self.writer.start()
        if cfg.snapshot_interval:
            self._store = await open_bucket(self.js, cfg.snapshot_bucket, create=True)
            self._spawn(self._snapshot_loop())
        if cfg.log_interval:
            self._spawn(self._log_loop())
        if cfg.share:
            self.leases = LeaseTable(self.js, self.owner, bucket=cfg.lease_bucket,
                                     ttl=cfg.lease_ttl)
            await self.leases.open()
            self._spawn(self._share_loop())
        else:
            for spec in self.engines:
                self._start_follow(spec)
        self.connected.set()

    def _spawn(self, coro: Any) -> None:
        self._bg.append(asyncio.get_running_loop().create_task(coro))

    async def run(self, stop: asyncio.Event) -> None:
        """Start, run until ``stop`` is set, close cleanly."""
        try:
            await self.start()
            await stop.wait()
        finally:
            await self.close()

    async def close(self, drain: float = 5.0) -> None:
        """Stop following, let in-flight publishes be acked (up to ``drain`` s), write the
        last snapshots, give leases back, disconnect."""
        if self._closing:
            return
        self._closing = True
        # Every step is bounded: a SIGTERMed bridge must exit (a step stuck on a NATS reply
        # or a socket left open once kept one from exiting at all, seen under load in CI).
        for name in list(self._tasks):
            await self._stop_follow(name)
        for t in self._bg:
            t.cancel()
        if self.writer is not None:
            await self.writer.drain(drain)
            if self.config.snapshot_interval and self.nc is not None and self.nc.is_connected:
                await self._bounded("final snapshots", self._write_snapshots(final=True),
                                    CLOSE_SNAPSHOTS_S)
            await self._bounded("writer close", self.writer.close(), CLOSE_STEP_S)
        if self.leases is not None:
            try:
                await asyncio.wait_for(self.leases.release_all(), CLOSE_STEP_S)
            except Exception as e:  # NATS gone: the leases expire by themselves
                log.info("leases not released: %r", e)
        if self.nc is not None:
            await self._bounded("NATS close", self.nc.close(), CLOSE_STEP_S)
        self._ctx.destroy(linger=0)  # closes any socket still open (term() would wait on it)

    async def _bounded(self, what: str, aw: Any, timeout: float) -> None:
        try:
            await asyncio.wait_for(aw, timeout)
        except asyncio.TimeoutError:
            self.stats.last_error = f"close: {what} took over {timeout:g} s, skipped"
            log.warning("bridge close: %s took over %g s, skipped", what, timeout)
        except Exception as e:  # NATS gone etc.: closing goes on
            log.info("bridge close: %s: %r", what, e)

    # ------------------------------------------------------------------ following

    def _start_follow(self, spec: Any) -> None:
        t = asyncio.get_running_loop().create_task(self._supervise(spec))
        self._tasks[spec.name] = t

    async def _supervise(self, spec: Any) -> None:
        """A follower that fails (a bug, an unexpected error) starts over from the subject
        after a second, rather than leaving its engine unfollowed."""
        while True:
            try:
                await self._follow(spec)
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                self.stats.follower_restarts += 1
                await asyncio.sleep(1.0)

    async def _stop_follow(self, name: str) -> None:
        t = self._tasks.pop(name, None)
        if t is not None:
            t.cancel()
            try:
                await asyncio.wait_for(t, CLOSE_STEP_S)
            except (asyncio.CancelledError, Exception):
                pass

    async def _follow(self, spec: Any) -> None:
        cfg, w = self.config, self.writer
        assert w is not None
        specs: list[StreamSpec] = []
        by_name: dict[str, _Follow] = {}
        for s, rank in zip(spec.streams(), range(spec.ranks)):
            subject = subject_for(cfg.prefix, spec.name, rank)
            lane = w.lane(spec.name, rank, subject)
            while lane.pending or lane.held or lane.recovering:  # a previous follower's
                await asyncio.sleep(0.05)
            f = _Follow(spec.name, rank, lane)
            await self._load(f)
            by_name[s.name] = self._follows[subject] = f
            specs.append(msgspec.structs.replace(s, resume=f.resume_point()))
        self.stats.streams = len(self._follows)
        sub = Subscriber(specs, config=cfg.stream_config, ctx=self._ctx)
        try:
            while True:
                items = await sub.apoll_many(0.25, 1000)
                for it in items:
                    await self._on_item(by_name[it.stream], it)
                if items:  # what arrived together leaves together (JsWriter.submit)
                    for f in by_name.values():
                        await w.pump(f.lane)
                now = time.monotonic()
                for f in by_name.values():
                    if f.skip_cache is not None and now - f.skip_since > cfg.skip_timeout:
                        await self._diverged(f, "no batch reached the subject's seq in time")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.stats.last_error = f"{spec.name}: {e!r}"
            log.exception("follower of %s failed", spec.name)
            raise
        finally:  # (stopped mid-read: what it held goes on by the writer's watch)
            sub.close()

    async def _load(self, f: _Follow) -> None:
        """Where the subject stands: its state rebuilt from snapshot + messages."""
        cfg = self.config
        while True:
            try:
                st = await rebuild_subject(self.js, cfg.stream, f.lane.subject, f.engine,
                                           f.rank, bucket=cfg.snapshot_bucket)
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:  # NATS away: wait for it
                self.stats.last_error = f"{f.lane.subject}: rebuild: {e!r}"
                await asyncio.sleep(0.5)
        lane = f.lane
        lane.cache, lane.exact, lane.dirty = st.cache, st.exact, False
        lane.last = None if st.epoch is None else (st.epoch, st.seq)  # type: ignore[assignment]
        lane.last_js_seq = st.js_seq
        if st.epoch is not None:
            lane.epochs.add(st.epoch)
        lane.expect = None  # read again before the first guarded message
        f.epoch, f.seq = st.epoch, st.seq
        # Inexact (history discarded) or a half-written marker set: start over with markers.
        f.complete = st.complete and st.exact
        if st.seq is not None and f.complete:
            try:
                m = await self.js.get_last_msg(cfg.stream, lane.subject)
                f.last_body = last_batch_body(m.headers or {}, m.data, st.seq)
            except Exception:
                f.last_body = None

    async def _on_item(self, f: _Follow, it: Any) -> None:
        t = type(it)
        if f.fresh and t is not Liveness:
            f.fresh = False
            if t is Batch:  # the Subscriber resumed after the subject's (epoch, seq)
                self.stats.resumed += 1
        if t is Batch:
            await self._on_batch(f, it)
        elif t is Reset:
            f.reset = it
        elif t is Snapshot:
            await self._on_snapshot(f, it)
        elif t is Liveness:
            self.stats.liveness += 1
            log.info("%s: %s (%s)", it.stream, "alive" if it.alive else "silent", it.reason)

    async def _on_snapshot(self, f: _Follow, s: Snapshot) -> None:
        reason = f.reset.reason if f.reset is not None else "bootstrap"
        f.reset, f.skip_to, f.skip_cache = None, None, None
        # Only the first Snapshot after (re)starting may continue the subject: later ones
        # follow a Reset the engine caused (restart, loss) and always go on as markers.
        cur = f.seq if f.complete and f.boot else None
        f.boot = False
        if s.epoch is not None:  # a kvwire publisher: its epoch says whether it continues
            if cur is not None and f.epoch == s.epoch and s.seq <= cur:
                f.skip_to = cur
                self.stats.resumed += 1
                return
            await self._markers(f, s.epoch, s.seq, s.blocks, s.exact, reason)
            return
        if cur is not None and f.epoch is not None and s.seq <= cur:
            f.skip_to = cur
            if s.seq < cur and f.last_body is not None:
                f.skip_cache = BlockCache()
                f.skip_cache.apply_events(s.blocks)
                f.skip_seq, f.skip_exact, f.skip_since = s.seq, s.exact, time.monotonic()
            else:
                self.stats.resumed += 1
            return
        epoch = 0 if f.epoch is None else f.epoch + 1
        await self._markers(f, epoch, s.seq, s.blocks, s.exact, reason)

    async def _on_batch(self, f: _Follow, b: Batch) -> None:
        if f.skip_to is not None:
            if b.seq <= f.skip_to:
                self.stats.skipped += 1
                if f.skip_cache is not None:
                    f.skip_cache.apply(b.batch)
                    f.skip_seq = b.seq
                    if b.seq == f.skip_to:
                        if encode_batch(b.batch) == f.last_body:
                            f.skip_cache, f.skip_to = None, None
                            self.stats.resumed += 1
                        else:
                            await self._diverged(f, "its batch at the subject's seq differs")
                return
            f.skip_to = None
        e = self._next_entry(f, b)
        if e is not None:
            assert self.writer is not None
            await self.writer.submit(e, pump=False)  # _follow pumps after each read

    def _next_entry(self, f: _Follow, b: Batch) -> Entry | None:
        """The message entry of a batch that continues the subject (None: not written)."""
        epoch = b.epoch if b.epoch is not None else f.epoch
        if epoch is None:  # cannot happen: a Snapshot always comes first
            self.stats.discontinuities += 1
            return None
        if f.seq is not None and epoch == f.epoch and b.seq != f.seq + 1:
            self.stats.discontinuities += 1
            self.stats.last_error = f"{f.lane.subject}: batch {b.seq} after {f.seq}"
        self.stats.batches += 1
        f.epoch, f.seq, f.complete, f.last_body = epoch, b.seq, True, None
        return f.lane.batch_entry(epoch, b.seq, b.batch, encode_batch(b.batch))

    async def _diverged(self, f: _Follow, why: str) -> None:
        """A reference engine restarted while the bridge was away: its run goes on as a new
        incarnation, from what was skipped."""
        cache = f.skip_cache or BlockCache()
        self.stats.diverged += 1
        epoch = 0 if f.epoch is None else f.epoch + 1
        f.skip_cache, f.skip_to = None, None
        await self._markers(f, epoch, f.skip_seq, chain_events(cache.raw_copy()),
                            f.skip_exact, f"reference publisher restarted ({why})")

    async def _markers(self, f: _Follow, epoch: int, seq: int, blocks: list[Any], exact: bool,
                       reason: str) -> None:
        w = self.writer
        assert w is not None
        for e in marker_entries(f.lane, epoch, seq, blocks, exact, reason, w.max_payload):
            await w.submit(e)
        self.stats.markers += 1
        f.epoch, f.seq, f.complete, f.last_body = epoch, seq, True, None

    # ------------------------------------------------------------------ share mode

    async def _share_loop(self) -> None:
        """Renew what we hold; take free leases up to a fair share (engines / live bridges);
        give back one above it per round, so a bridge that joins gets work."""
        leases = self.leases
        assert leases is not None
        every = leases.ttl / 3
        bridges = 1
        while not self._closing:
            try:
                bridges = await leases.heartbeat()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # NATS away: keep what we follow, retry
                self.stats.last_error = f"lease heartbeat: {e!r}"
            fair = -(-len(self.engines) // bridges)
            for spec in self.engines:
                name = spec.name
                try:
                    if name in self._tasks:
                        if not await leases.renew(name):
                            await self._stop_follow(name)
                        elif len(leases.held) > fair:
                            await self._stop_follow(name)
                            await leases.release(name)
                    elif len(leases.held) < fair and await leases.try_acquire(name):
                        self._start_follow(spec)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # NATS away: keep what we follow, retry
                    self.stats.last_error = f"lease {name}: {e!r}"
            self.stats.leases_held = len(leases.held)
            await asyncio.sleep(every)

    # ------------------------------------------------------------------ snapshots, stats

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.snapshot_interval)
            await self._write_snapshots()

    async def _write_snapshots(self, final: bool = False) -> None:
        """Each lane changed since its last snapshot. ``final`` (close): also each lane whose
        stored object is not at its last message, e.g. when the periodic write that had
        taken the lane's last state (and marked it clean) was cut short by close()."""
        loop = asyncio.get_running_loop()
        for f in list(self._follows.values()):
            lane = f.lane
            if lane.last is None or lane.last_js_seq is None or not (
                    lane.dirty or final and lane.snapshot_js_seq != lane.last_js_seq):
                continue
            records = lane.cache.raw_copy()  # consistent with (last, last_js_seq) right now
            (epoch, seq), js_seq, exact = lane.last, lane.last_js_seq, lane.exact
            lane.dirty = False
            try:
                snap = await loop.run_in_executor(None, functools.partial(
                    snapshot_of, records, engine=lane.engine, rank=lane.rank, epoch=epoch,
                    seq=seq, js_seq=js_seq, exact=exact))
                self.stats.snapshot_bytes += await write_snapshot(
                    self.js, snap, self.config.snapshot_bucket, self._store)
                lane.snapshot_js_seq = js_seq
                self.stats.snapshots_written += 1
            except asyncio.CancelledError:
                lane.dirty = True  # (cut short, e.g. by close(): not written)
                raise
            except Exception as e:
                lane.dirty = True
                self.stats.snapshot_errors += 1
                self.stats.last_error = f"snapshot {lane.subject}: {e!r}"

    def summary(self) -> dict[str, Any]:
        w = self.writer
        out = msgspec.to_builtins(self.stats)
        if w is not None:
            out["writer"] = msgspec.to_builtins(w.stats)
            out["nats_api"] = "public" if w.fast is None else "internals"  # client_internals
            out["inflight"] = w.inflight
            out["lag"] = w.lag.summary()
        return out

    def report(self) -> dict[str, Any]:
        """:meth:`summary` plus ``lag_window``: the lag of the batches stored since the last
        report or stats log (then forgotten). ``kvwire bridge`` prints it on SIGUSR2."""
        out = self.summary()
        if self.writer is not None:
            out["lag_window"] = self.writer.take_lag_window().summary()
        return out

    async def _log_loop(self) -> None:
        last, t0 = 0, time.monotonic()
        while True:
            await asyncio.sleep(self.config.log_interval)
            s, w = self.stats, self.writer
            now = time.monotonic()
            rate = (s.batches - last) / max(1e-9, now - t0)
            last, t0 = s.batches, now
            ws = w.stats if w is not None else None
            log.warning(
                "bridge: %d streams, %d batches (%.0f/s), %d marker sets, %d skipped, "
                "acked %d (dup %d, runs %d, refused %d), inflight %d, recoveries %d, "
                "snapshots %d, %s%s",
                s.streams, s.batches, rate, s.markers, s.skipped, ws.acked if ws else 0,
                ws.duplicates if ws else 0, ws.runs if ws else 0, ws.refused if ws else 0,
                w.inflight if w else 0, ws.recoveries if ws else 0, s.snapshots_written,
                w.take_lag_window().text() if w else "lag n/a",
                f", last error: {s.last_error or (ws.last_error if ws else None)}"
                if (s.last_error or (ws and ws.last_error)) else "")
