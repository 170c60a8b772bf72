"""Checked JetStream publishing for the bridge: one :class:`~kvwire.nats.lane.Lane` per
subject, in one of two modes.

* ``pack=1``, pipelined: one message per batch, up to ``max_inflight`` unacknowledged at
  once (publishes go out as core NATS messages with a reply inbox; one wildcard
  subscription collects every PubAck). ``Nats-Msg-Id`` dedupe is what keeps a restarted or
  redundant bridge from storing a batch twice. (Only with nats-py's internals, see
  :meth:`JsWriter.on_disconnect`; without, ``pack=1`` lanes are guarded, one batch each.)
* ``pack=N > 1``, guarded: one message in flight per subject, each carrying
  ``Nats-Expected-Last-Subject-Sequence`` = the subject's last stream sequence as this
  writer knows it. What arrives meanwhile waits, and the next message takes up to N
  consecutive batches of it (a ``batches`` run): the round trip sets the run length, so a
  quiet stream sends each batch alone at once and a busy one pays per-message costs once
  per run. JetStream refuses a message when anything else (another bridge) wrote the
  subject since: two writers can cut different runs but never store a batch twice.

A lane applies what JetStream acknowledged, in subject order, to its
:class:`~kvwire.index.cache.BlockCache` (the state its object-store snapshots are taken
from, with the PubAck's stream sequence).

When an ack fails or times out (server restarted, JetStream not ready yet, a guard refused),
the lane *recovers*: it holds new items, lets what is in flight settle, reads the subject's
last message and re-sends, in order, exactly what came after it.
Pipelined, what the server stored is a prefix of what was sent, except when it refused one
(e.g. 503 while JetStream starts) and took a later one: that hole cannot be filled in order,
so the lane writes a reset marker and a snapshot marker of its whole state instead
(consumers resync from the subject itself). Guarded, the subject's last message says how far
it goes (its ``Nats-Msg-Id``, else its epoch and seq); if it comes from an epoch this writer
has never seen, the lane writes those markers too.

Composition: :class:`JsWriter` does the I/O (the connection, tasks, timers, reading a
subject's last message) and holds a :class:`~kvwire.nats.writer_state.WriterState`, the
pure part: lanes, messages in flight, counters, lag, and every decision above.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .client_internals import internals
from .inbox import subscribe_inline
from .lag import Lag
from .lane import (
    H_EXACT,
    H_EXPECT,
    PENDING,
    Entry,
    Lane,
    apply_entry_effect,
    marker_entries,
    pack_body,
)
from .subjects import H_MSG_ID
from .writer_state import LastMsg, WriterState, WriterStats, mid_set

__all__ = ["H_EXACT", "H_EXPECT", "Entry", "JsWriter", "Lane", "WriterState", "WriterStats",
           "apply_entry_effect", "marker_entries", "pack_body"]

log = logging.getLogger("kvwire.nats.writer")


class JsWriter:
    """Sends :class:`Entry` objects on lanes, checks their acks, recovers lanes: the I/O
    around a :class:`WriterState` (``state``)."""

    def __init__(self, nc: Any, js: Any, stream: str, *, max_inflight: int = 4096,
                 ack_timeout: float = 5.0, pack: int = 1) -> None:
        if not ack_timeout > 0:
            raise ValueError(f"ack_timeout must be > 0 seconds, got {ack_timeout!r}")
        # nats-py's internals (kvwire.nats.client_internals), or None: its public API
        self.fast = internals(nc)
        # Pipelined lanes stay a prefix of what was sent across a broken connection only by
        # dropping what nats-py still buffers (on_disconnect: internals). Without, nats-py
        # sends it after the reconnect, past what the dead server lost: every lane is then
        # guarded (pack 1: one single-batch message in flight per subject).
        self.state = WriterState(pack, pack > 1 or self.fast is None, max_inflight)
        self.nc, self.js, self.stream = nc, js, stream
        self.ack_timeout = ack_timeout
        self._room = asyncio.Event()
        self._inbox = ""
        self._inbox_b = b""
        self._sub: Any = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._watch_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ the state's face

    @property
    def pack(self) -> int:
        return self.state.pack

    @property
    def guarded(self) -> bool:
        return self.state.guarded

    @property
    def max_inflight(self) -> int:
        return self.state.max_inflight

    @property
    def max_payload(self) -> int:
        return self.state.max_payload

    @property
    def stats(self) -> WriterStats:
        return self.state.stats

    @property
    def lanes(self) -> dict[str, Lane]:
        return self.state.lanes

    @property
    def closing(self) -> bool:
        return self.state.closing

    @property
    def lag(self) -> Lag:
        """The lag of every batch committed since start (a copy: the windows merged)."""
        return self.state.lag

    @property
    def lag_window(self) -> Lag:
        return self.state.lag_window

    def take_lag_window(self) -> Lag:
        """The lag since the last call; the next window starts empty."""
        return self.state.take_lag_window()

    @property
    def inflight(self) -> int:
        return len(self.state.inflight)

    def lane(self, engine: str, rank: int, subject: str) -> Lane:
        """The lane of ``subject`` (made on first use; kept while the writer lives)."""
        return self.state.lane(engine, rank, subject)

    # ------------------------------------------------------------------ sending

    async def start(self) -> None:
        self.state.max_payload = int(getattr(self.nc, "max_payload", 1 << 20) or 1 << 20)
        self._inbox = self.nc.new_inbox()
        self._inbox_b = self._inbox.encode()
        self._sub = await subscribe_inline(self.nc, self._inbox + ".*", self._on_ack)
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    async def submit(self, entry: Entry, pump: bool = True) -> None:
        """Queue ``entry`` on its lane; waits while ``max_inflight`` are unacknowledged
        (guarded: while the lane holds ``4 * max_inflight``). A lane's submits must not
        overlap (await each, as the bridge does per stream): waiters are not queued in
        order.

        Guarded lanes, ``pump=False``: the entry waits until the lane holds a whole run or
        :meth:`pump` is called, so that batches that arrived together leave together (the
        bridge submits each read of its engines so, then pumps): a burst costs one round
        trip instead of its first batch's and then the rest's."""
        lane, st = entry.lane, self.state
        bound = 4 * st.max_inflight
        if st.guarded:
            if len(lane.held) >= bound:
                await self._pump(lane)  # a lane held back by pump=False must go on
                while len(lane.held) >= bound and not st.closing:
                    await asyncio.sleep(0.005)  # bounded: back-pressure upstream
            lane.held.append(entry)
            if pump or len(lane.held) >= st.pack:
                await self._pump(lane)
            return
        while lane.recovering and len(lane.held) >= bound and not st.closing:
            await asyncio.sleep(0.05)  # bounded while NATS is away: back-pressure upstream
        if lane.recovering or lane.held:
            lane.held.append(entry)
            return
        await self._send(entry)

    async def _send(self, e: Entry) -> None:
        st = self.state
        while len(st.inflight) >= st.max_inflight:
            self._room.clear()
            try:
                await asyncio.wait_for(self._room.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        cmd = self._register(e)
        if cmd is None or self._write_now(cmd):
            return
        nc = self.nc
        try:
            if self.fast is not None and nc.is_connected:
                await self.fast.send(cmd)
            else:
                await nc.publish(e.lane.subject, e.payload, reply=f"{self._inbox}.{e.token}",
                                 headers=e.send_headers())
        except Exception as ex:  # not handed to the connection at all (closed, buffer full)
            self._fail(e, f"publish failed: {ex!r}")

    def _register(self, e: Entry) -> bytes | None:
        cmd = self.state.register(e, self._inbox_b)
        if cmd is None:
            self._fail(e, e.error)
        return cmd

    def _write_now(self, cmd: bytes) -> bool:
        """Guarded lanes: hand ``cmd`` to the socket at once when nothing of nats-py's is
        queued ahead of it. Saves the wakeup of nats-py's flusher task per message, which a
        guarded lane (one message per round trip) pays in full; pipelined lanes keep the
        flusher, which writes many messages per wakeup."""
        if not (self.state.guarded and self._can_write_now()):
            return False
        self.fast.write_now(cmd)  # type: ignore[union-attr]
        return True

    def _can_write_now(self) -> bool:
        return self.fast is not None and self.fast.can_write_now()

    async def pump(self, lane: Lane) -> None:
        """Send what ``submit(..., pump=False)`` left held, if the lane may send now."""
        if self.state.guarded:
            await self._pump(lane)

    async def _pump(self, lane: Lane) -> None:
        """Guarded lanes: send the next message if none is in flight (its guard: the
        subject's last seq; unknown, the lane first reads it)."""
        e = self._take(lane)
        if e is None:
            return
        lane.busy = True
        try:
            await self._send(e)
        finally:
            lane.busy = False

    def _take(self, lane: Lane) -> Entry | None:
        """The lane's next guarded message, if it may send one now."""
        if self.state.blocked(lane):
            return None
        if lane.expect is None:
            self._recover(lane, "the subject's last sequence is not known", logging.INFO)
            return None
        return self.state.take(lane)

    def _pump_now(self, lane: Lane) -> None:
        """:meth:`_pump` from the read loop (an ack just came): sends at once when there is
        room and the socket can take it, else leaves it to a task (never waits here)."""
        st = self.state
        if st.blocked(lane):
            return
        if st.has_room() and self._can_write_now():
            e = self._take(lane)
            if e is not None:
                cmd = self._register(e)
                if cmd is not None:
                    self._write_now(cmd)
            return
        self._spawn(self._pump(lane))

    # ------------------------------------------------------------------ acks, failures

    def _on_ack(self, msg: Any) -> None:
        """Runs in nats-py's read loop (:func:`~kvwire.nats.inbox.subscribe_inline`)."""
        st = self.state
        lane, why, level = st.ack(msg.subject[len(self._inbox) + 1:], msg.data, msg.headers)
        if len(st.inflight) < st.max_inflight:
            self._room.set()
        if lane is None:
            return
        if why is not None:
            self._recover(lane, why, level)
        elif st.guarded:
            self._pump_now(lane)

    def _fail(self, e: Entry, why: str) -> None:
        self.state.fail(e, why)
        self._recover(e.lane, why)

    def _recover(self, lane: Lane, why: str, level: int = logging.WARNING) -> None:
        if lane.recovering or self.state.closing:
            return
        lane.recovering = True
        self.state.stats.recoveries += 1
        log.log(level, "%s: recovering (%s)", lane.subject, why)
        self._spawn(self._recovery(lane))

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def on_disconnect(self) -> None:
        """The connection broke: what the server got is a prefix of what was sent on it.

        Keep it a prefix: nats-py would send the publishes still queued in its buffer after
        the reconnect (ahead of anything a recovery decides), so they are dropped here
        (with nats-py's internals; without, every lane is guarded, and the guard refuses
        them if they land after the subject moved on), and every lane with messages in
        flight recovers (holding new ones) before anything else goes out."""
        lanes = self.state.lanes
        if self.fast is not None:
            self.fast.drop_queued(lambda c: c[:5] == b"HPUB " and c[5:].split(
                b" ", 1)[0].decode() in lanes)
        for lane in self.state.disconnected():
            self._recover(lane, "disconnected")

    async def _watch(self) -> None:
        """Ack time-outs: a lane whose oldest message waits too long recovers. And a
        guarded lane left holding entries with nothing in flight (``pump()`` never came:
        its caller failed mid-read) sends them: held is never stuck."""
        st = self.state
        while not st.closing:
            await asyncio.sleep(min(0.25, self.ack_timeout / 4))
            now = time.monotonic()
            for lane in list(st.lanes.values()):
                if st.guarded and not st.blocked(lane):
                    st.stats.late_pumps += 1
                    self._spawn(self._pump(lane))
                if st.timed_out(lane, now, self.ack_timeout):
                    st.stats.timeouts += 1
                    self._recover(lane, f"no ack for {self.ack_timeout:g}s")

    # ------------------------------------------------------------------ recovery

    async def _recovery(self, lane: Lane) -> None:
        st = self.state
        try:
            await self._settle(lane)
            last = await self._last_id(lane.subject)
            if st.guarded:
                last = await self._after_set(lane, last)
                st.resolve_guarded(lane, last)
                self._room.set()
                lane.recovering = False
                await self._pump(lane)
                return
            st.resolve(lane, last)
            self._room.set()
            while lane.held and not st.closing:
                await self._send(lane.held.popleft())
        except asyncio.CancelledError:
            raise
        except Exception as ex:  # keep the lane recovering; the watch retries it
            st.stats.last_error = f"{lane.subject}: recovery failed: {ex!r}"
            log.warning("%s", st.stats.last_error)
            lane.recovering = False
            if lane.pending or lane.held:
                await asyncio.sleep(0.5)
                self._recover(lane, "retry after failed recovery")
            return
        lane.recovering = False

    async def _settle(self, lane: Lane) -> None:
        """Until every in-flight message of the lane is answered or timed out, connected."""
        while not self.state.closing:
            newest = max((e.sent_at for e in lane.pending if e.state == PENDING), default=None)
            if self.nc.is_connected and (newest is None or lane.cut
                                         or time.monotonic() - newest > self.ack_timeout):
                lane.cut = False
                return
            await asyncio.sleep(0.05)

    async def _after_set(self, lane: Lane, last: LastMsg | None) -> LastMsg | None:
        """Guarded lanes: if the subject ends inside another writer's marker set (its reset,
        or a chunk short of n/n), wait for the set to be whole before writing after it,
        up to ``ack_timeout`` (then it is left half-written: its writer died, and the lane
        writes its own set over it). Never anything in the middle of a marker set."""
        deadline = time.monotonic() + self.ack_timeout
        while (mid_set(last) and not self.state.closing and time.monotonic() < deadline
               and not any(e.msg_id == last[0]  # type: ignore[index]
                           for e in (*lane.pending, *lane.held))):
            await asyncio.sleep(0.05)  # the other writer's next chunk is one round trip away
            last = await self._last_id(lane.subject)
        return last

    async def _last_id(self, subject: str) -> LastMsg | None:
        """``(Nats-Msg-Id, stream seq, headers)`` of the subject's last message (None:
        empty)."""
        from nats.js.errors import NotFoundError

        while True:
            try:
                m = await self.js.get_last_msg(self.stream, subject)
            except NotFoundError:
                return None
            except Exception as ex:  # JetStream not ready yet after a restart, a timeout
                if self.state.closing:
                    raise
                self.state.stats.last_error = f"{subject}: last message: {ex!r}"
                await asyncio.sleep(0.2)
                continue
            h = m.headers or {}
            return h.get(H_MSG_ID, ""), m.seq, h

    async def drain(self, timeout: float) -> bool:
        """Wait until nothing is in flight or held (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state.idle():
                return True
            await asyncio.sleep(0.02)
        return False

    async def close(self) -> None:
        self.state.closing = True
        for t in [*self._tasks, *([self._watch_task] if self._watch_task else [])]:
            t.cancel()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # the connection may be gone already
                pass
