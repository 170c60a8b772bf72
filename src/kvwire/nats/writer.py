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
:class:`~kvwire.consume.cache.BlockCache` (the state its object-store snapshots are taken
from, with the PubAck's stream sequence).

When an ack fails or times out (server restarted, JetStream not ready yet, a guard refused),
the lane *recovers*: it holds new items, lets what is in flight settle, reads the subject's
last message and re-sends, in order, exactly what came after it (:meth:`JsWriter._resolve`).
Pipelined, what the server stored is a prefix of what was sent, except when it refused one
(e.g. 503 while JetStream starts) and took a later one: that hole cannot be filled in order,
so the lane writes a reset marker and a snapshot marker of its whole state instead
(consumers resync from the subject itself). Guarded, the subject's last message says how far
it goes (its ``Nats-Msg-Id``, else its epoch and seq); if it comes from an epoch this writer
has never seen, the lane writes those markers too. (Those decisions, no I/O in them, are in
:mod:`kvwire.nats.resolve`.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec

from .client_internals import internals
from .inbox import subscribe_inline
from .lag import Lag
from .lane import (
    ACKED,
    FAILED,
    H_EXACT,
    H_EXPECT,
    PENDING,
    Entry,
    Lane,
    apply_entry_effect,
    marker_entries,
    pack_body,
)
from .resolve import Resolver, mid_set
from .subjects import H_MSG_ID

__all__ = ["H_EXACT", "H_EXPECT", "Entry", "JsWriter", "Lane", "WriterStats",
           "apply_entry_effect", "marker_entries", "pack_body"]

log = logging.getLogger("kvwire.nats.writer")


class _PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: dict[str, Any] | None = None


_ack_decoder = msgspec.json.Decoder(_PubAck)


class WriterStats(msgspec.Struct):
    sent: int = 0
    acked: int = 0
    duplicates: int = 0
    failed: int = 0
    timeouts: int = 0
    resent: int = 0
    recoveries: int = 0
    holes: int = 0
    stray_acks: int = 0
    bytes: int = 0
    runs: int = 0  # messages carrying a run of >= 2 batches (guarded lanes)
    late_pumps: int = 0  # held entries found idle by the watch (a pump() that never came)
    refused: int = 0  # messages a guard refused: the subject had moved on (another writer)
    superseded: int = 0  # batches found stored (or passed) by another writer: not re-sent
    last_error: str | None = None


_WRONG_LAST_SEQ = 10071  # JetStream's err_code: Nats-Expected-Last-Subject-Sequence failed


class JsWriter(Resolver):
    """Sends :class:`Entry` objects on lanes, checks their acks, recovers lanes."""

    def __init__(self, nc: Any, js: Any, stream: str, *, max_inflight: int = 4096,
                 ack_timeout: float = 5.0, pack: int = 1) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if not isinstance(pack, int) or pack < 1:
            raise ValueError(f"pack must be an int >= 1, got {pack!r}")
        if not ack_timeout > 0:
            raise ValueError(f"ack_timeout must be > 0 seconds, got {ack_timeout!r}")
        self.pack = pack
        # nats-py's internals (kvwire.nats.client_internals), or None: its public API
        self.fast = internals(nc)
        # Pipelined lanes stay a prefix of what was sent across a broken connection only by
        # dropping what nats-py still buffers (on_disconnect: internals). Without, nats-py
        # sends it after the reconnect, past what the dead server lost: every lane is then
        # guarded (pack 1: one single-batch message in flight per subject).
        self.guarded = pack > 1 or self.fast is None
        self.nc, self.js, self.stream = nc, js, stream
        self.max_inflight, self.ack_timeout = max_inflight, ack_timeout
        self.stats = WriterStats()
        self.max_payload = 1 << 20
        self._inflight: dict[str, Entry] = {}
        self._room = asyncio.Event()
        # engine ts -> PubAck of each batch committed (kvwire.nats.lag): counted once, in the
        # current window; a window taken (a stats log, a report) is merged into the rest
        self.lag_window = Lag()
        self._lag_taken = Lag()
        self._n = 0
        self._inbox = ""
        self._sub: Any = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._watch_task: asyncio.Task[None] | None = None
        self._inbox_b = b""
        self.lanes: dict[str, Lane] = {}
        self.closing = False

    def lane(self, engine: str, rank: int, subject: str) -> Lane:
        """The lane of ``subject`` (made on first use; kept while the writer lives)."""
        ln = self.lanes.get(subject)
        if ln is None:
            ln = self.lanes[subject] = Lane(subject, engine, rank)
        return ln

    async def start(self) -> None:
        self.max_payload = int(getattr(self.nc, "max_payload", 1 << 20) or 1 << 20)
        self._inbox = self.nc.new_inbox()
        self._inbox_b = self._inbox.encode()
        self._sub = await subscribe_inline(self.nc, self._inbox + ".*", self._on_ack)
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    @property
    def lag(self) -> Lag:
        """The lag of every batch committed since start (a copy: the windows merged)."""
        total = Lag()
        total.merge(self._lag_taken)
        total.merge(self.lag_window)
        return total

    def take_lag_window(self) -> Lag:
        """The lag since the last call; the next window starts empty."""
        w = self.lag_window
        self._lag_taken.merge(w)
        self.lag_window = Lag()
        return w

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    async def submit(self, entry: Entry, pump: bool = True) -> None:
        """Queue ``entry`` on its lane; waits while ``max_inflight`` are unacknowledged
        (guarded: while the lane holds ``4 * max_inflight``). A lane's submits must not
        overlap (await each, as the bridge does per stream): waiters are not queued in
        order.

        Guarded lanes, ``pump=False``: the entry waits until the lane holds a whole run or
        :meth:`pump` is called, so that batches that arrived together leave together (the
        bridge submits each read of its engines so, then pumps): a burst costs one round
        trip instead of its first batch's and then the rest's."""
        lane = entry.lane
        if self.guarded:
            if len(lane.held) >= 4 * self.max_inflight:
                await self._pump(lane)  # a lane held back by pump=False must go on
                while len(lane.held) >= 4 * self.max_inflight and not self.closing:
                    await asyncio.sleep(0.005)  # bounded: back-pressure upstream
            lane.held.append(entry)
            if pump or len(lane.held) >= self.pack:
                await self._pump(lane)
            return
        while lane.recovering and len(lane.held) >= 4 * self.max_inflight and not self.closing:
            await asyncio.sleep(0.05)  # bounded while NATS is away: back-pressure upstream
        if lane.recovering or lane.held:
            lane.held.append(entry)
            return
        await self._send(entry)

    async def _send(self, e: Entry) -> None:
        while len(self._inflight) >= self.max_inflight:
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
        """Make ``e`` in flight; returns its HPUB command (built here in one go: nats-py's
        ``publish`` validates and encodes the header dict key by key, which was most of the
        bridge's cost per batch), or None when it cannot go out at all."""
        self._n += 1
        e.token = tok = str(self._n)
        e.state, e.js_seq, e.sent_at = PENDING, None, time.monotonic()
        self._inflight[tok] = e
        e.lane.pending.append(e)
        self.stats.sent += 1
        self.stats.bytes += len(e.payload)
        if len(e.payload) + 1024 > self.max_payload:
            # The server would drop the connection; cannot go out as one message.
            e.oversize = True
            self._fail(e, f"{e.msg_id}: {len(e.payload)} bytes, over the server's max "
                          f"payload {self.max_payload}")
            return None
        hdr = e.raw_headers()
        p = e.payload
        return b"HPUB %s %s.%s %d %d\r\n%s%s\r\n" % (
            e.lane.subject_b, self._inbox_b, tok.encode(), len(hdr), len(hdr) + len(p), hdr, p)

    def _write_now(self, cmd: bytes) -> bool:
        """Guarded lanes: hand ``cmd`` to the socket at once when nothing of nats-py's is
        queued ahead of it. Saves the wakeup of nats-py's flusher task per message, which a
        guarded lane (one message per round trip) pays in full; pipelined lanes keep the
        flusher, which writes many messages per wakeup."""
        if not (self.guarded and self._can_write_now()):
            return False
        self.fast.write_now(cmd)  # type: ignore[union-attr]
        return True

    async def pump(self, lane: Lane) -> None:
        """Send what ``submit(..., pump=False)`` left held, if the lane may send now."""
        if self.guarded:
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

    def _blocked(self, lane: Lane) -> bool:
        """A guarded lane that may not send now: a message in flight (or being sent),
        recovering, nothing held, or closing."""
        return bool(lane.busy or lane.pending or lane.recovering or not lane.held
                    or self.closing)

    def _take(self, lane: Lane) -> Entry | None:
        """The lane's next guarded message, if it may send one now."""
        if self._blocked(lane):
            return None
        if lane.expect is None:
            self._recover(lane, "the subject's last sequence is not known", logging.INFO)
            return None
        if lane.pos is not None:
            self._skip_covered(lane)
            if not lane.held:
                return None
        e = lane.next_message(self.pack, self.max_payload - 4096)
        if e.parts is not None:
            self.stats.runs += 1
        e.expect = lane.expect
        return e

    def _pump_now(self, lane: Lane) -> None:
        """:meth:`_pump` from the read loop (an ack just came): sends at once when there is
        room and the socket can take it, else leaves it to a task (never waits here)."""
        if self._blocked(lane):
            return
        if len(self._inflight) < self.max_inflight and self._can_write_now():
            e = self._take(lane)
            if e is not None:
                cmd = self._register(e)
                if cmd is not None:
                    self._write_now(cmd)
            return
        self._spawn(self._pump(lane))

    def _can_write_now(self) -> bool:
        return self.fast is not None and self.fast.can_write_now()

    def _on_ack_sync(self, subject: str, data: bytes, headers: dict[str, str] | None
                     ) -> Lane | None:
        """Apply one PubAck; returns the lane (guarded: it may send its next message)."""
        e = self._inflight.pop(subject[len(self._inbox) + 1:], None)
        if e is None:
            self.stats.stray_acks += 1  # late answer to a message a recovery re-sent
            return None
        if len(self._inflight) < self.max_inflight:
            self._room.set()
        if headers and headers.get("Status"):
            self._fail(e, f"JetStream status {headers.get('Status')} "
                          f"{headers.get('Description', '')}".strip())
            return None
        try:
            ack = _ack_decoder.decode(data)
        except msgspec.DecodeError:
            self._fail(e, f"unreadable PubAck {data[:80]!r}")
            return None
        if ack.error is not None:
            if ack.error.get("err_code") == _WRONG_LAST_SEQ:
                # Not a failure: another writer (a redundant bridge, the last owner of a
                # lease) wrote the subject since; the recovery finds how far it went.
                self.stats.refused += 1
                e.state, e.error = FAILED, "refused by the guard"
                self._recover(e.lane, "the subject moved on (another writer)", logging.INFO)
                return None
            self._fail(e, f"JetStream refused {e.msg_id}: {ack.error.get('description', ack.error)}")
            return None
        e.state, e.js_seq = ACKED, ack.seq
        self.stats.acked += 1
        lane = e.lane
        if ack.duplicate:
            self.stats.duplicates += 1
            # Stored before, not necessarily last: where the subject ends is read again.
            lane.expect = None
        elif self.guarded:
            lane.expect, lane.pos = ack.seq, None  # the subject ends with our message
        if lane.pending and lane.pending[0] is e:
            self._advance(lane)
        return lane

    def _on_ack(self, msg: Any) -> None:
        """Runs in nats-py's read loop (:func:`~kvwire.nats.inbox.subscribe_inline`)."""
        lane = self._on_ack_sync(msg.subject, msg.data, msg.headers)
        if lane is not None and self.guarded:
            self._pump_now(lane)

    def _advance(self, lane: Lane) -> None:
        """Apply acked messages at the head of the lane, in subject order."""
        pending = lane.pending
        while pending and pending[0].state == ACKED:
            self._commit(pending.popleft())

    def _commit(self, e: Entry) -> None:
        lane = e.lane
        if e.kind == "batch" or e.kind == "batches":
            now, add = time.time(), self.lag_window.add
            for b in (e.effect,) if e.kind == "batch" else e.effect:
                ts = b.ts
                if type(ts) is float:
                    add(now - ts)
        apply_entry_effect(lane.cache, e.kind, e.effect)
        if e.kind == "snapshot":
            lane.exact = e.exact
        lane.last = (e.epoch, e.seq)
        lane.epochs.add(e.epoch)
        lane.last_js_seq = e.js_seq  # None (ack lost): no object-store snapshot until known
        lane.dirty = True

    def _fail(self, e: Entry, why: str) -> None:
        e.state, e.error = FAILED, why
        self.stats.failed += 1
        self.stats.last_error = why
        self._recover(e.lane, why)

    def _recover(self, lane: Lane, why: str, level: int = logging.WARNING) -> None:
        if lane.recovering or self.closing:
            return
        lane.recovering = True
        self.stats.recoveries += 1
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
        if self.fast is not None:
            self.fast.drop_queued(lambda c: c[:5] == b"HPUB " and c[5:].split(
                b" ", 1)[0].decode() in self.lanes)
        for lane in self.lanes.values():
            lane.cut = True  # acks of what is in flight went with the connection
            if lane.pending or lane.held:
                self._recover(lane, "disconnected")

    async def _watch(self) -> None:
        """Ack time-outs: a lane whose oldest message waits too long recovers. And a
        guarded lane left holding entries with nothing in flight (``pump()`` never came:
        its caller failed mid-read) sends them: held is never stuck."""
        while not self.closing:
            await asyncio.sleep(min(0.25, self.ack_timeout / 4))
            now = time.monotonic()
            for lane in list(self.lanes.values()):
                if self.guarded and not self._blocked(lane):
                    self.stats.late_pumps += 1
                    self._spawn(self._pump(lane))
                if (not lane.recovering and lane.pending and lane.pending[0].state == PENDING
                        and now - lane.pending[0].sent_at > self.ack_timeout):
                    self.stats.timeouts += 1
                    self._recover(lane, f"no ack for {self.ack_timeout:g}s")

    async def _recovery(self, lane: Lane) -> None:
        try:
            await self._settle(lane)
            last = await self._last_id(lane.subject)
            if self.guarded:
                last = await self._after_set(lane, last)
                self._resolve_guarded(lane, last)
                lane.recovering = False
                await self._pump(lane)
                return
            self._resolve(lane, last)
            while lane.held and not self.closing:
                await self._send(lane.held.popleft())
        except asyncio.CancelledError:
            raise
        except Exception as ex:  # keep the lane recovering; the watch retries it
            self.stats.last_error = f"{lane.subject}: recovery failed: {ex!r}"
            log.warning("%s", self.stats.last_error)
            lane.recovering = False
            if lane.pending or lane.held:
                await asyncio.sleep(0.5)
                self._recover(lane, "retry after failed recovery")
            return
        lane.recovering = False

    async def _settle(self, lane: Lane) -> None:
        """Until every in-flight message of the lane is answered or timed out, connected."""
        while not self.closing:
            newest = max((e.sent_at for e in lane.pending if e.state == PENDING), default=None)
            if self.nc.is_connected and (newest is None or lane.cut
                                         or time.monotonic() - newest > self.ack_timeout):
                lane.cut = False
                return
            await asyncio.sleep(0.05)

    async def _after_set(self, lane: Lane, last: tuple[str, int, dict[str, str]] | None
                         ) -> tuple[str, int, dict[str, str]] | None:
        """Guarded lanes: if the subject ends inside another writer's marker set (its reset,
        or a chunk short of n/n), wait for the set to be whole before writing after it,
        up to ``ack_timeout`` (then it is left half-written: its writer died, and the lane
        writes its own set over it). Never anything in the middle of a marker set."""
        deadline = time.monotonic() + self.ack_timeout
        while (mid_set(last) and not self.closing and time.monotonic() < deadline
               and not any(e.msg_id == last[0]  # type: ignore[index]
                           for e in (*lane.pending, *lane.held))):
            await asyncio.sleep(0.05)  # the other writer's next chunk is one round trip away
            last = await self._last_id(lane.subject)
        return last

    async def _last_id(self, subject: str) -> tuple[str, int, dict[str, str]] | None:
        """``(Nats-Msg-Id, stream seq, headers)`` of the subject's last message (None:
        empty)."""
        from nats.js.errors import NotFoundError

        while True:
            try:
                m = await self.js.get_last_msg(self.stream, subject)
            except NotFoundError:
                return None
            except Exception as ex:  # JetStream not ready yet after a restart, a timeout
                if self.closing:
                    raise
                self.stats.last_error = f"{subject}: last message: {ex!r}"
                await asyncio.sleep(0.2)
                continue
            h = m.headers or {}
            return h.get(H_MSG_ID, ""), m.seq, h

    async def drain(self, timeout: float) -> bool:
        """Wait until nothing is in flight or held (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._inflight and not any(
                    ln.held or ln.recovering or ln.pending for ln in self.lanes.values()):
                return True
            await asyncio.sleep(0.02)
        return False

    async def close(self) -> None:
        self.closing = True
        for t in [*self._tasks, *([self._watch_task] if self._watch_task else [])]:
            t.cancel()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # the connection may be gone already
                pass
