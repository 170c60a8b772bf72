"""Reliable consumption of ONE publisher's stream, as a pure state machine (no I/O).

Like h11, the protocol logic is kept apart from the sockets: the I/O layer
(:mod:`kvwire.consume.subscriber`, or a test) feeds in what arrived and the current time, and gets
back a list of outputs:

* **actions** for the I/O layer: :class:`SendInfo`, :class:`SendReplay`,
  :class:`SendSnapshot` (send ``action.frames()`` on the DEALER) and
  :class:`RecycleRequests` (close the DEALER and open a fresh one, so late replies to an
  abandoned request can never be mistaken for replies to the next one);
* **deliveries** for the application: :class:`Batch` (every batch exactly once, in seq
  order), :class:`Reset` (drop this engine's state, with the reason), :class:`Snapshot`
  (the engine's blocks as of ``seq``; batches continue at ``seq + 1``) and
  :class:`Liveness` changes.

Guarantee: deliveries of one stream always read ``Reset, Snapshot(N), Batch(N+1),
Batch(N+2), ...`` (repeated after every restart or unrecoverable loss). A ``Snapshot``
replaces the stream's state; ``exact=False`` says it is only "nothing known before N+1"
(reference publishers cannot send snapshots). Time is an argument, never read, so every
behaviour is reproducible in tests.

*Reference* publishers (no INFO, no epoch): a restart shows when the live seq goes
backwards. When we heard none of the new run live, the replay that continues after our last
seq (a gap's, or a tail check's: without heartbeats a dropped *last* batch is found by a
replay after a quiet ``info_interval``) is asked from our last seq itself: that batch must
come back as we had it (the publisher replays the bytes it sent). Changed, the run is new
and passed our seq; missing from a tail check's answer, the run is new and below our seq,
or the publisher keeps no buffer (a replay from 0 with anything in it tells the first).
What stays unknowable: a restart whose new run passed our seq after evicting it. kvwire
publishers have epochs (checked on every gap and every ``info_interval``).
"""

from __future__ import annotations

import math

__all__ = [
    "Action",
    "Batch",
    "Delivery",
    "ErrorReply",
    "FrameError",
    "InfoReply",
    "Liveness",
    "Output",
    "RecycleRequests",
    "ReplayEnd",
    "ReplayMessage",
    "Reset",
    "SendInfo",
    "SendReplay",
    "SendSnapshot",
    "Snapshot",
    "SnapshotChunk",
    "SnapshotHeader",
    "StreamConfig",
    "StreamMachine",
    "StreamStats",
    "parse_live",
    "parse_reply",
]

from ..wire.events import FAST_DECODE_ERRORS as _DECODE_ERRORS
from ..wire.events import decode_fast as _decode_map
from .config import StreamConfig, StreamStats
from .items import (
    Action,
    Batch,
    Delivery,
    Liveness,
    Output,
    RecycleRequests,
    Reset,
    SendInfo,
    SendReplay,
    SendSnapshot,
    Snapshot,
)
from .recovery import Recovery
from .replies import (
    ErrorReply,
    FrameError,
    InfoReply,
    ReplayEnd,
    ReplayMessage,
    SnapshotChunk,
    SnapshotHeader,
    parse_live,
    parse_reply,
)

# --------------------------------------------------------------------------- machine
#
# Three layers, one object: ``StreamState`` (delivery.py: the attributes, deliveries in seq
# order), ``Recovery`` (recovery.py: requests, replies, gap filling, bootstrap, timeouts)
# and ``StreamMachine`` here (the live path, time, introspection).


class StreamMachine(Recovery):
    """Sequencing, gap filling, bootstrap and restart handling for one publisher stream.

    Every input method takes ``now`` (monotonic seconds) and returns the outputs it
    caused, in order. Call :meth:`start` once, then feed messages and call :meth:`tick`
    at least every few hundred milliseconds (timeouts and liveness are decided there).
    ``has_replay=False`` means the stream has no replay endpoint: nothing can be asked,
    so it starts at the first live batch and loss is reported, not repaired.
    """
    # ------------------------------------------------------------------ introspection

    @property
    def phase(self) -> str:
        return self._phase

    @property
    def mode(self) -> str:
        """``kvwire`` (INFO answered), ``reference``, ``live-only`` or ``unknown`` (yet)."""
        return self._mode

    @property
    def epoch(self) -> int | None:
        return self._epoch

    @property
    def last_seq(self) -> int | None:
        """Seq of the last batch the application has (covered by a snapshot or delivered)."""
        return self._delivered

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def next_deadline(self) -> float:
        """Earliest time at which :meth:`tick` may have something to do."""
        t = min(self._req_deadline, self._retry_at)
        if self._phase == "live" and self._req is None and self.has_replay:
            # (the check tick() runs; without a replay endpoint there is none, and a check
            # time that never moves on would be a deadline in the past: a spinning poller)
            t = min(t, self._next_check)
        da = self._dead_after()
        if da is not None and self._alive and self._phase != "idle":
            t = min(t, self._last_live + da)
        if self._tail_wanted():
            # (after a stall: at the next tick, which looks for the backlog's end)
            t = min(t, self._last_tick if self._stall_pending() else
                    self._last_live + self.config.tail_after)
        return t

    @property
    def state(self) -> str:
        """``syncing``, ``inexact``, ``unconfirmed`` or ``exact`` (see :class:`StreamStats`)."""
        if self._delivered is None:
            return "syncing"
        if not self._exact:
            return "inexact"
        return "unconfirmed" if self._unconfirmed and self._mode == "reference" else "exact"

    def stats(self) -> StreamStats:
        state = self.state
        return StreamStats(
            stream=self.name, phase=self._phase, mode=self._mode, epoch=self._epoch,
            last_seq=self._delivered, exact=state == "exact", alive=self._alive,
            buffered=len(self._buffer), bad_events=self._decoder.bad_events,
            last_error=self._last_error, state=state, unconfirmed=state == "unconfirmed",
            **self._c,
        )

    def _stall_pending(self) -> bool:
        """A stall of the consumer was seen after the last tail check and confirmation."""
        return self._stall_at > self._tail_sent and self._stall_at > self._confirmed_at

    def _resumed(self, last_live: float, now: float) -> bool:
        """A reference stream's live batches resume after a quiet spell (see :meth:`live`)."""
        return (self._mode == "reference" and now - last_live > self.config.tail_after
                and self._recent_payload(self._delivered) is not None)  # type: ignore[arg-type]

    def _tail_wanted(self) -> bool:
        """A reference stream, live and idle, whose tail needs confirming: a stall since,
        or live batches since the last check (the quiet spell is timed by the caller)."""
        return (
            self._mode == "reference" and self._phase == "live" and self._req is None
            and self._delivered is not None and (
                self._stall_pending() or (self._last_live > self._tail_sent
                                          and self._last_live > self._confirmed_at))
        )

    # ------------------------------------------------------------------ inputs

    def start(self, now: float) -> list[Output]:
        """Begin: probe the publisher (or, without replay, wait for the first batch)."""
        if self._phase != "idle":
            return []
        self._last_live = self._last_tick = now
        self._next_check = now + self._info_interval()
        if self.has_replay:
            self._probe("boot", now)
        else:
            self._phase = "await_first"
        return self._flush()

    def live_frames(self, frames: list[bytes], now: float) -> list[Output]:
        """A multipart message from the SUB socket."""
        try:
            _, seq, payload = parse_live(frames)
        except FrameError as e:
            self._bad_frame(f"live: {e}")
            return []
        return self.live(seq, payload, now)

    def live_messages(self, messages: list[list[bytes]], now: float) -> list[Output]:
        """Several messages from the SUB socket, in arrival order (the I/O layer reads in
        slices). Same result as :meth:`live_frames` on each in turn, faster: the next batch
        in order while live, the common case, takes a short path here."""
        res: list[Output] = []
        out, c = self._out, self._c
        decode = _decode_map
        tail_after = self.config.tail_after
        for frames in messages:
            if (self._phase == "live" and self._alive and not self._want_resync
                    and len(frames) == 3):
                seq_f = frames[1]
                if len(seq_f) == 8:
                    seq = int.from_bytes(seq_f, "big")
                    high = self._live_high
                    if seq == self._delivered + 1 and (high is None or seq > high) and (  # type: ignore[operator]
                            now - self._last_live <= tail_after
                            or not self._resumed(self._last_live, now)):
                        c["live_messages"] += 1
                        self._last_live = now
                        self._live_high = self._delivered = seq
                        self._recent.append(frames[2])
                        try:
                            batch = decode(frames[2])
                        except _DECODE_ERRORS:
                            pass  # the general path below tells what is wrong with it
                        else:
                            c["batches"] += 1
                            n = len(batch.events)
                            c["events"] += n
                            if n or self.config.deliver_empty:
                                out.append(Batch(self.name, seq, batch, self._label))
                            continue
                        self._deliver(seq, frames[2])  # other dialects, bad events
                        if self._want_resync:
                            self._enter_live(now)
                        continue
            res.extend(self.live_frames(frames, now))  # flushes what the short path queued
            out = self._out
        res.extend(self._flush())
        return res

    def reply_frames(self, frames: list[bytes], now: float) -> list[Output]:
        """A multipart message from the DEALER (replay/INFO/SNAPSHOT/ERR)."""
        try:
            msg = parse_reply(frames)
        except FrameError as e:
            self._bad_frame(f"reply: {e}")
            return []
        t = type(msg)
        if t is ReplayMessage:
            return self.replay(msg.seq, msg.payload, now)
        if t is ReplayEnd:
            return self.replay_end(now)
        if t is InfoReply:
            return self.info(msg, now)
        if t is SnapshotChunk:
            return self.snapshot_chunk(msg.header, msg.payload, now)
        return self.error(msg.message, now)

    def live(self, seq: int, payload: bytes, now: float) -> list[Output]:
        """A live batch ``seq`` arrived."""
        self._c["live_messages"] += 1
        quiet_since, self._last_live = self._last_live, now
        if not self._alive:
            self._alive = True
            self._out.append(Liveness(self.name, True, f"live message seq {seq}"))
        if self._phase == "idle":
            return self._flush()
        if self._live_high is not None and seq <= self._live_high:
            old, self._live_high = self._live_high, seq
            self._suspect_restart(seq, payload, old, now)
            return self._flush()
        self._live_high = seq
        if self._other_run(seq, payload, now):
            return self._flush()
        phase = self._phase
        if phase == "await_first" and self.has_replay and seq > self.first_seq:
            # The publisher had nothing when asked; it has this and what came before now.
            self._hold(seq, payload, now)
            self._start_replay(0, now, "boot")
        elif phase == "await_first":
            self._baseline(seq, f"started at live seq {seq}")
            self._deliver(seq, payload)
            self._enter_live(now)
        elif phase == "live":
            nxt = self._delivered + 1  # type: ignore[operator]
            if seq < nxt:
                self._c["duplicates"] += 1
            elif seq == nxt and self._resumed(quiet_since, now):
                # A reference publisher quiet for a while may have restarted meanwhile, and
                # its new run's first batches never reached us (a PUB drops what it sends
                # before the SUB has reconnected): a new run that picks up at our next seq
                # looks like ours. Check ours is still its batch at our last seq first.
                self._hold(seq, payload, now)
                self._start_replay(seq, now, "gap", check=True)
            elif seq == nxt:
                self._deliver(seq, payload)
                if self._want_resync:
                    self._enter_live(now)
            else:
                self._c["gaps"] += 1
                self._hold(seq, payload, now)
                if self._phase == "live":
                    self._fill_gap(now)
        elif self._delivered is not None and seq <= self._delivered:
            self._c["duplicates"] += 1
        elif (phase == "replay" and self._delivered is not None and seq == self._delivered + 1
              and self._replay_kind != "rebuild"):
            self._deliver(seq, payload)
            self._drain()
        else:
            self._hold(seq, payload, now)
        return self._flush()
    def tick(self, now: float) -> list[Output]:
        """Let time pass: request timeouts, retries, liveness, periodic epoch checks."""
        if self._phase == "idle":
            return []
        prev, self._last_tick = self._last_tick, now
        if now - prev > self.config.tail_after:
            # The consumer did not run for a while: whatever the publisher sent meanwhile
            # may have been dropped, the tail included, and nothing live may ever show it.
            # (Said of reference streams only, but noted before the mode is known.)
            self._stall_at = now
            self._unconfirmed = True
        if self._req is not None and now >= self._req_deadline:
            self._timeout(now)
        if self._req is None and now >= self._retry_at:
            self._retry_at = math.inf
            self._retry(now)
        da = self._dead_after()
        if da is not None and self._alive and now - self._last_live > da:
            self._alive = False
            self._c["deaths"] += 1
            self._out.append(
                Liveness(self.name, False, f"no live message for {now - self._last_live:.1f}s")
            )
        if (
            self._phase == "live" and self._req is None and self.has_replay
            and now >= self._next_check
        ):
            quiet = self._last_live < self._checked_at
            self._checked_at = now
            tail = (self._mode == "reference" and quiet and self._delivered is not None
                    and not self._tail_last)
            self._tail_last = tail
            if tail:
                # No heartbeats to say what the last seq is: ask from ours. Ours alone back
                # means nothing was missed; not even ours, maybe a restart (replay_end).
                # Every other quiet check is still an INFO probe: a kvwire publisher whose
                # first INFO answer was lost is recognised by it.
                self._c["tail_checks"] += 1
                self._next_check = now + self._info_interval()
                self._start_replay(self._delivered + 1, now, "tail", check=True)
            else:
                self._probe("check", now)  # kvwire: the epoch; reference: an upgrade
        elif (self._phase == "await_first" and self._req is None and self.has_replay
              and now >= self._next_check):
            # Nothing when asked, and no live batch since: the first ones may all have been
            # dropped (the PUB's HWM) with nothing after them. Ask again now and then.
            self._next_check = now + self._info_interval()
            self._start_replay(0, now, "boot")
        elif self._tail_wanted() and (
            self._last_live <= prev if self._stall_pending()  # the backlog is read
            else now - self._last_live >= self.config.tail_after
        ):
            self._ask_tail(now)  # quiet, or stalled: confirm the tail
        return self._flush()
