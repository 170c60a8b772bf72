"""Reliable consumption of ONE publisher's stream, as a pure state machine (no I/O).

Like h11, the protocol logic is kept apart from the sockets: the I/O layer
(:mod:`kvwire.subscriber`, or a test) feeds in what arrived and the current time, and gets
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

Known limits with *reference* publishers (no INFO): a restart is seen only when the live
seq goes backwards; a restarted publisher whose seq has already passed ours when we first
hear from it is indistinguishable from a gap. kvwire publishers close that hole with epochs
(checked on every gap and every ``info_interval``). Without heartbeats a dropped *last*
batch is found by a tail check: a replay from the next seq after a quiet ``info_interval``.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from ..wire.events import FAST_DECODE_ERRORS as _DECODE_ERRORS
from ..wire.events import (
    BatchDecoder,
    BlockStored,
    DecodeError,
    EventError,
)
from ..wire.events import decode_fast as _decode_map

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


class StreamConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Tunables of one stream (seconds for times)."""

    #: A request is abandoned when no reply message arrived for this long.
    request_timeout: float = 2.0
    #: No INFO answer within this => a reference publisher (no snapshots, no epochs).
    info_timeout: float = 1.0
    #: Silence on the live stream => dead. None: 3 x the publisher's heartbeat interval.
    dead_after: float | None = None
    #: Epoch re-check period. None: 10 x heartbeat interval (10 s without heartbeats).
    info_interval: float | None = None
    #: Live batches held while a replay/snapshot is in flight; overflow restarts it.
    max_buffer: int = 100_000
    #: Blocks per snapshot chunk to ask for (None: the publisher's default).
    snapshot_chunk_blocks: int | None = None
    #: Use snapshots when the publisher offers them.
    use_snapshots: bool = True
    #: Wait before retrying after an ERR reply (e.g. "busy").
    retry_delay: float = 0.5
    #: Consecutive snapshot ERRs before bootstrapping without a snapshot.
    max_snapshot_errors: int = 3
    #: Deliver empty batches (heartbeats) too.
    deliver_empty: bool = True
    #: Replay requests in a row that time out without a single reply before the range
    #: they ask for counts as unreachable (a stall on either side must not lose it).
    replay_attempts: int = 3


Phase = Literal["idle", "probe", "snapshot", "replay", "await_first", "live"]
Mode = Literal["unknown", "kvwire", "reference", "live-only"]


class StreamStats(msgspec.Struct, frozen=True):
    """Counters of one stream; plain values, safe to serialize.

    ``gaps``: holes in seq that had to be filled; ``lost``: seqs the publisher no longer
    held (a replay answer started after them); ``duplicates``: seqs seen twice (live behind
    replay); ``resyncs``: exact re-bootstraps after loss (a snapshot, or for a stream without
    snapshots a rebuild by replay from seq 0); ``resets``: Reset items (the first bootstrap included);
    ``restarts``: publisher restarts detected; ``buffer_overflows``: resync attempts given
    up because more than ``max_buffer`` live batches piled up; ``stray_replies``: replies
    to no request in flight; ``exact``: the state is known completely (not an inexact start).
    """

    stream: str
    phase: str
    mode: str
    epoch: int | None
    last_seq: int | None
    exact: bool
    alive: bool
    live_messages: int
    batches: int
    events: int
    duplicates: int
    gaps: int
    lost: int
    replays: int
    replayed: int
    snapshots: int
    resyncs: int
    resets: int
    restarts: int
    buffer_overflows: int
    buffered: int
    timeouts: int
    error_replies: int
    bad_frames: int
    bad_payloads: int
    bad_events: int
    stray_replies: int
    deaths: int
    last_error: str | None
    #: Reference streams only: replays from the next seq asked after a quiet spell, because
    #: without heartbeats a batch dropped last (the stream's tail) is otherwise seen only
    #: when the next one comes.
    tail_checks: int = 0


_COUNTERS = (
    "live_messages", "batches", "events", "duplicates", "gaps", "lost", "replays", "replayed",
    "snapshots", "resyncs", "resets", "restarts", "buffer_overflows", "timeouts",
    "error_replies", "bad_frames", "bad_payloads", "stray_replies", "deaths", "tail_checks",
)


class StreamMachine:
    """Sequencing, gap filling, bootstrap and restart handling for one publisher stream.

    Every input method takes ``now`` (monotonic seconds) and returns the outputs it
    caused, in order. Call :meth:`start` once, then feed messages and call :meth:`tick`
    at least every few hundred milliseconds (timeouts and liveness are decided there).
    ``has_replay=False`` means the stream has no replay endpoint: nothing can be asked,
    so it starts at the first live batch and loss is reported, not repaired.
    """

    def __init__(
        self, name: str, *, has_replay: bool = True, config: StreamConfig | None = None,
        resume_after: tuple[int, int] | None = None,
    ) -> None:
        self.name = name
        #: ``(epoch, seq)`` the application already has (e.g. the NATS bridge after a restart):
        #: if the publisher still runs that epoch and buffers ``seq + 1``, deliveries begin
        #: with ``Batch(seq + 1)`` (no Reset/Snapshot); otherwise the usual bootstrap.
        self._resume_after = resume_after
        self.config = config or StreamConfig()
        self.has_replay = has_replay
        self._decoder = BatchDecoder(on_error=self._bad_event)
        self._c: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._last_error: str | None = None
        self._out: list[Output] = []
        self._phase: Phase = "idle"
        self._mode: Mode = "unknown" if has_replay else "live-only"
        self._epoch: int | None = None
        self._label: int | None = None
        self._want_resync = False
        self._hb: float | None = None
        self._snap_ok = False
        self._delivered: int | None = None  # last seq the application has (None: no baseline)
        self._exact = False
        self._live_high: int | None = None  # live seqs only ever grow within one publisher run
        self._buffer: dict[int, bytes] = {}
        self._req: Literal["info", "replay", "snapshot"] | None = None
        self._req_deadline = math.inf
        self._purpose = "boot"
        self._replay_from = 0
        self._replay_kind: Literal["boot", "gap", "rebuild"] = "boot"
        self._replay_got = 0  # replies received for the replay in flight
        self._fruitless = 0  # replay requests in a row that timed out unanswered
        self._from0_gone = False  # this run's replay buffer no longer starts at seq 0
        # First seqs of the losses already rebuilt once in this run: a seq the publisher never
        # buffered stays missing however often we rebuild (two of them used to alternate
        # forever when only the last one was remembered). At most one per buffered seq.
        self._rebuilt: set[int] = set()
        self._rebuild_gap = (0, 0)  # that loss: seqs [a, b) missing, b held
        self._snap_header: SnapshotHeader | None = None
        self._snap_parts: dict[int, bytes] = {}
        self._snap_errors = 0
        self._retry_at = math.inf
        self._reset_sent = False
        self._reset_reason = "bootstrap"
        self._last_live = 0.0
        self._checked_at = -math.inf  # when tick last made a periodic check
        self._tail_last = False  # that check was a tail check
        self._alive = True
        self._next_check = math.inf

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
        if self._phase == "live" and self._req is None:
            t = min(t, self._next_check)
        da = self._dead_after()
        if da is not None and self._alive and self._phase != "idle":
            t = min(t, self._last_live + da)
        return t

    def stats(self) -> StreamStats:
        return StreamStats(
            stream=self.name, phase=self._phase, mode=self._mode, epoch=self._epoch,
            last_seq=self._delivered, exact=self._exact, alive=self._alive,
            buffered=len(self._buffer), bad_events=self._decoder.bad_events,
            last_error=self._last_error, **self._c,
        )

    # ------------------------------------------------------------------ inputs

    def start(self, now: float) -> list[Output]:
        """Begin: probe the publisher (or, without replay, wait for the first batch)."""
        if self._phase != "idle":
            return []
        self._last_live = now
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
        for frames in messages:
            if (self._phase == "live" and self._alive and not self._want_resync
                    and len(frames) == 3):
                seq_f = frames[1]
                if len(seq_f) == 8:
                    seq = int.from_bytes(seq_f, "big")
                    high = self._live_high
                    if seq == self._delivered + 1 and (high is None or seq > high):  # type: ignore[operator]
                        c["live_messages"] += 1
                        self._last_live = now
                        self._live_high = self._delivered = seq
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
        self._last_live = now
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
        phase = self._phase
        if phase == "await_first" and self.has_replay and seq > 0:
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

    def replay(self, seq: int, payload: bytes, now: float) -> list[Output]:
        """One replayed batch arrived."""
        if self._req != "replay":
            self._c["stray_replies"] += 1
            return []
        self._req_deadline = now + self.config.request_timeout
        self._c["replayed"] += 1
        first = self._replay_got == 0
        self._replay_got += 1
        self._fruitless = 0
        if self._replay_kind == "rebuild" and self._rebuild_answer(seq, payload, now):
            return self._flush()
        if self._delivered is None:  # bootstrap without snapshot: replay from 0
            if self._replay_from == 0 and seq > 0:
                self._from0_gone = True
            self._baseline(seq, f"no snapshot available; starting at replayed seq {seq}")
            self._deliver(seq, payload)
            self._drain()
            return self._flush()
        nxt = self._delivered + 1
        if seq < nxt:
            self._c["duplicates"] += 1
        elif seq == nxt:
            self._deliver(seq, payload)
            self._drain_next(seq)
        elif first:
            # The answer starts after what we asked for: the publisher no longer has it.
            self._unfillable(nxt, seq, payload, now)
        else:
            # A hole inside the answer: lost on the way (the reference publisher's ROUTER
            # drops at its HWM) or evicted while being served. Keep what came; the rest
            # is asked for again when this answer ends.
            self._hold(seq, payload, now)
        return self._flush()

    def _rebuild_answer(self, seq: int, payload: bytes, now: float) -> bool:
        """First reply to the replay from 0 asked for after a loss; False: handle it (and
        the rest of the answer) as any replay reply."""
        a, b = self._rebuild_gap
        self._replay_kind = "gap"  # whatever follows continues like any replay
        if seq == 0:
            # The publisher still holds its whole run: start over from seq 0, exactly.
            self._c["resyncs"] += 1
            self._reset_reason = (
                f"seqs {a}..{b - 1} not replayable; rebuilt exactly by a replay from seq 0"
            )
            self._baseline(0, self._reset_reason)
            self._deliver(0, payload)
            self._drain()
            return True
        self._from0_gone = True
        if seq <= a:
            return False  # it holds the range after all (it was only unreachable): go on
        # The buffer starts at ``seq``: what we lack below it is gone.
        m = min(seq, min(self._buffer, default=seq))
        self._c["lost"] += m - a
        self._last_error = f"seqs {a}..{m - 1} lost"
        self._baseline(m, f"seqs {a}..{m - 1} lost and no snapshot available")
        if m == seq:
            self._deliver(seq, payload)
        else:
            self._deliver(m, self._buffer.pop(m))
            self._hold(seq, payload, now)  # a hole above what we held: asked again at the end
        self._drain()
        return True

    def _give_up(self, a: int, b: int, now: float) -> None:
        """Seqs ``a..b-1`` are gone for good (``b`` is held): go on inexact from ``b``."""
        self._c["lost"] += b - a
        self._last_error = f"seqs {a}..{b - 1} lost"
        self._baseline(b, f"seqs {a}..{b - 1} lost and no snapshot available")
        if b in self._buffer:
            self._deliver(b, self._buffer.pop(b))
        if self._req is None:
            self._resume(now)

    def replay_end(self, now: float) -> list[Output]:
        """The replay end marker arrived."""
        if self._req != "replay":
            self._c["stray_replies"] += 1
            return []
        self._req, self._req_deadline = None, math.inf
        if self._delivered is None:
            if self._buffer and self._replay_got == 0 and \
                    self._fruitless + 1 < self.config.replay_attempts:
                # Nothing buffered when it was served, but live batches came since: the
                # publisher holds them from where they started, so ask again.
                self._fruitless += 1
                self._start_replay(0, now, "boot")
            elif self._buffer:
                m = min(self._buffer)
                self._baseline(m, f"no snapshot available; starting at live seq {m}")
                self._resume(now)
            else:
                self._phase = "await_first"  # the first live batch decides (see live())
            return self._flush()
        if self._replay_kind == "rebuild":  # an empty answer from 0: nothing to rebuild from
            self._give_up(*self._rebuild_gap, now)
            return self._flush()
        self._drain()
        progress = self._delivered + 1 > self._replay_from
        if self._buffer and not progress:
            # The replay brought nothing we needed: whatever is missing is gone.
            m = min(self._buffer)
            self._unfillable(self._delivered + 1, m, self._buffer.pop(m), now)
            if self._req is None and self._phase == "replay":
                self._resume(now)
        elif progress:
            self._continue(now)
        else:
            self._enter_live(now)
        return self._flush()

    def info(self, info: InfoReply, now: float) -> list[Output]:
        """The publisher answered INFO."""
        if self._req != "info":
            self._c["stray_replies"] += 1
            return []
        self._req, self._req_deadline = None, math.inf
        upgraded = self._mode != "kvwire"
        self._mode = "kvwire"
        self._hb = info.heartbeat_interval
        self._snap_ok = bool(info.snapshot) and self.config.use_snapshots
        self._next_check = now + self._info_interval()
        purpose = self._purpose
        if self._epoch is not None and info.epoch != self._epoch:
            self._c["restarts"] += 1
            old, self._epoch = self._epoch, info.epoch
            self._live_high = None
            self._restart(f"publisher restarted (epoch {old:#x} -> {info.epoch:#x})", now)
            return self._flush()
        self._epoch = info.epoch
        if self._delivered is None and self._resume_after is not None:
            (r_epoch, r_seq), self._resume_after = self._resume_after, None
            if info.epoch == r_epoch and info.oldest != -1 and info.oldest <= r_seq + 1 \
                    and info.seq >= r_seq:
                self._label, self._delivered, self._exact = info.epoch, r_seq, True
                for s in [s for s in self._buffer if s <= r_seq]:
                    del self._buffer[s]
                self._start_replay(r_seq + 1, now, "gap")
                return self._flush()
        if self._delivered is None:
            self._bootstrap(now)
        elif upgraded:
            # What we hold was sequenced without epochs: it may mix runs. Start over.
            self._restart("publisher now answers INFO; re-bootstrapping with epochs", now)
        elif purpose == "gap":
            nxt = self._delivered + 1
            fillable = info.oldest != -1 and info.oldest <= nxt
            if self._snap_ok and not fillable:
                self._c["lost"] += max(0, (info.oldest if info.oldest != -1 else nxt) - nxt)
                self._reset_reason = f"seqs from {nxt} no longer replayable; resynced"
                self._resync(now)
            else:
                self._start_replay(nxt, now)
        elif purpose in ("suspect", "boot"):
            self._resume(now)
        return self._flush()

    def snapshot_chunk(self, header: SnapshotHeader, payload: bytes, now: float) -> list[Output]:
        """One SNAPSHOT chunk arrived."""
        if self._req != "snapshot":
            self._c["stray_replies"] += 1
            return []
        self._req_deadline = now + self.config.request_timeout
        h0 = self._snap_header
        if not (0 <= header.chunk < header.chunks) or (
            h0 is not None and (h0.epoch, h0.seq, h0.chunks) != (header.epoch, header.seq,
                                                              header.chunks)
        ):
            self._bad_frame(f"inconsistent snapshot chunk {header}")
            self._start_snapshot(now)
            return self._flush()
        self._snap_header = header
        self._snap_parts[header.chunk] = payload
        if len(self._snap_parts) == header.chunks:
            self._complete_snapshot(header, now)
        return self._flush()

    def error(self, message: str, now: float) -> list[Output]:
        """The publisher answered ERR (e.g. snapshots disabled, busy)."""
        self._c["error_replies"] += 1
        self._last_error = f"publisher error: {message}"
        if self._req is None:
            return []
        kind, self._req, self._req_deadline = self._req, None, math.inf
        if kind == "snapshot":
            self._snap_errors += 1
            if self._snap_errors >= self.config.max_snapshot_errors or "disabled" in message:
                self._snap_ok = False
                self._snap_errors = 0
                self._no_snapshot_fallback(now)
                return self._flush()
        self._retry_at = now + self.config.retry_delay
        return self._flush()

    def tick(self, now: float) -> list[Output]:
        """Let time pass: request timeouts, retries, liveness, periodic epoch checks."""
        if self._phase == "idle":
            return []
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
                # No heartbeats to say what the last seq is: ask for anything after ours.
                # An empty answer (just the end marker) means nothing was missed. Every
                # other quiet check is still an INFO probe: a kvwire publisher whose first
                # INFO answer was lost is recognised by it.
                self._c["tail_checks"] += 1
                self._next_check = now + self._info_interval()
                self._start_replay(self._delivered + 1, now, "gap")
            else:
                self._probe("check", now)  # kvwire: the epoch; reference: an upgrade
        return self._flush()

    # ------------------------------------------------------------------ decisions

    def _suspect_restart(self, seq: int, payload: bytes, old: int, now: float) -> None:
        reason = f"publisher restarted (live seq went back from {old} to {seq})"
        if self._mode == "kvwire":
            # Could be a duplicate; the epoch decides. Older buffered batches are moot.
            self._buffer = {seq: payload}
            self._probe("suspect", now)
        elif self._delivered is None and self._phase in ("probe", "replay"):
            self._buffer = {seq: payload}  # still bootstrapping: just start over from here
            self._from0_gone = False
            self._rebuilt.clear()
            if self._phase == "replay":
                self._start_replay(0, now)
        else:
            self._c["restarts"] += 1
            self._buffer = {seq: payload}
            self._restart(reason, now, keep_buffer=True)

    def _restart(self, reason: str, now: float, keep_buffer: bool = False) -> None:
        self._abort_request("publisher restarted")
        self._from0_gone = False
        self._rebuilt.clear()
        if not keep_buffer:
            self._buffer = {}
        self._emit_reset(reason)
        self._reset_reason = reason
        self._delivered = None
        self._exact = False
        self._bootstrap(now)

    def _bootstrap(self, now: float) -> None:
        """No baseline yet: get one (snapshot, replay from 0, or the first live batch)."""
        self._delivered = None
        if self._mode == "kvwire" and self._snap_ok:
            self._start_snapshot(now)
        elif self.has_replay:
            self._start_replay(0, now)
        elif self._buffer:
            m = min(self._buffer)
            self._baseline(m, f"started at live seq {m}")
            self._resume(now)
        else:
            self._phase = "await_first"

    def _resync(self, now: float) -> None:
        self._c["resyncs"] += 1
        self._start_snapshot(now)

    def _fill_gap(self, now: float) -> None:
        nxt = self._delivered + 1  # type: ignore[operator]
        if not self.has_replay:
            while self._buffer:
                m = min(self._buffer)
                self._unfillable(self._delivered + 1, m, self._buffer.pop(m), now)  # type: ignore[operator]
            self._enter_live(now)
        elif self._mode == "kvwire":
            self._probe("gap", now)  # re-check the epoch before trusting a replay
        else:
            self._start_replay(nxt, now)

    def _unfillable(self, nxt: int, seq: int, payload: bytes, now: float) -> None:
        """Seqs ``nxt..seq-1`` cannot be replayed; ``seq`` is the next one we have.

        With snapshots: resync. A reference stream, unless this run's buffer is known not to
        start at seq 0 (or this very loss was already rebuilt once: a seq the publisher never
        buffered), asks a replay from 0 first: if it starts at 0 the stream is rebuilt
        exactly; otherwise the range is lost and we go on inexact."""
        if self._mode == "reference" and not (self._from0_gone or nxt in self._rebuilt):
            self._buffer[seq] = payload
            self._rebuilt.add(nxt)
            self._rebuild_gap = (nxt, seq)
            self._start_replay(0, now, "rebuild")
            return
        self._c["lost"] += seq - nxt
        self._last_error = f"seqs {nxt}..{seq - 1} lost"
        if self._mode == "kvwire" and self._snap_ok:
            self._buffer[seq] = payload
            self._reset_reason = f"seqs {nxt}..{seq - 1} lost and not replayable; resynced"
            self._resync(now)
            return
        self._baseline(seq, f"seqs {nxt}..{seq - 1} lost and no snapshot available")
        self._deliver(seq, payload)
        self._drain()

    def _no_snapshot_fallback(self, now: float) -> None:
        if self._delivered is None:
            self._bootstrap(now)
        elif self._buffer:
            m = min(self._buffer)
            self._unfillable(self._delivered + 1, m, self._buffer.pop(m), now)
            if self._req is None:
                self._resume(now)
        else:
            self._enter_live(now)

    def _resume(self, now: float) -> None:
        """Baseline known, no request in flight: deliver what is held, fill what is not."""
        self._drain()
        if self._buffer:
            self._c["gaps"] += 1
            self._fill_gap(now)
        else:
            self._enter_live(now)

    def _continue(self, now: float, ended: bool = True) -> None:
        """A replay answered in part: ask again for what is still missing (not a new gap).
        ``ended=False``: its end never came, so where it would have ended is unknown."""
        self._drain()
        high = self._live_high
        if ended and not self._buffer and (high is None or high <= self._delivered):  # type: ignore[operator]
            self._enter_live(now)
        elif self._mode == "kvwire":
            self._probe("gap", now)
        else:
            self._start_replay(self._delivered + 1, now, "gap")  # type: ignore[operator]

    def _timeout(self, now: float) -> None:
        kind = self._req
        self._c["timeouts"] += 1
        self._last_error = f"{kind} request timed out"
        self._abort_request(f"{kind} request timed out")
        if kind == "info":
            if self._purpose == "check":
                self._next_check = now + self._info_interval()
            elif self._mode == "unknown":
                self._mode = "reference"  # no INFO answer: a reference publisher
                self._last_error = "no INFO reply: reference publisher (no snapshots/epochs)"
                if self._delivered is None:
                    self._bootstrap(now)
                else:
                    self._resume(now)
            else:
                self._probe(self._purpose, now)
        elif kind == "replay" and self._replay_got > 0 and self._delivered is not None:
            self._continue(now, ended=False)  # the rest (or its end) was lost on the way
        elif kind == "replay" and self._fruitless + 1 < self.config.replay_attempts:
            self._fruitless += 1  # unanswered: a stall on either side; ask again
            self._start_replay(self._replay_from, now, self._replay_kind)
        elif kind == "replay" and self._replay_kind == "rebuild":
            self._fruitless = 0
            self._give_up(*self._rebuild_gap, now)
        elif kind == "replay":
            self._fruitless = 0
            if self._mode == "kvwire":
                self._probe("boot" if self._delivered is None else "gap", now)
            elif self._delivered is None:
                if self._buffer:
                    m = min(self._buffer)
                    self._baseline(m, f"replay unavailable; starting at live seq {m}")
                    self._resume(now)
                else:
                    self._phase = "await_first"
            elif self._buffer:
                m = min(self._buffer)
                self._unfillable(self._delivered + 1, m, self._buffer.pop(m), now)
                if self._req is None:
                    self._resume(now)
            else:
                self._enter_live(now)
        else:
            self._probe("boot" if self._delivered is None else "gap", now)

    def _retry(self, now: float) -> None:
        if self._phase == "snapshot":
            self._start_snapshot(now)
        elif self._phase == "replay":
            self._start_replay(self._replay_from, now, self._replay_kind)
        elif self._phase == "probe":
            self._probe(self._purpose, now)

    # ------------------------------------------------------------------ requests

    def _send(self, kind: Literal["info", "replay", "snapshot"], action: Action,
              now: float, timeout: float) -> None:
        self._abort_request(f"superseded by {kind} request")
        self._req = kind
        self._req_deadline = now + timeout
        self._retry_at = math.inf
        self._out.append(action)

    def _abort_request(self, reason: str) -> None:
        if self._req is not None:
            self._req, self._req_deadline = None, math.inf
            self._out.append(RecycleRequests(reason))

    def _probe(self, purpose: str, now: float) -> None:
        if purpose != "check":
            self._phase = "probe"
        self._purpose = purpose
        if self._req == "info":
            return  # the INFO already in flight answers this too
        timeout = self.config.info_timeout if self._mode != "kvwire" else \
            self.config.request_timeout
        self._send("info", SendInfo(), now, timeout)

    def _start_replay(self, start: int, now: float,
                      kind: Literal["boot", "gap", "rebuild"] | None = None) -> None:
        self._phase = "replay"
        self._replay_from = start
        self._replay_kind = kind or ("boot" if self._delivered is None else "gap")
        self._replay_got = 0
        self._c["replays"] += 1
        self._send("replay", SendReplay(start), now, self.config.request_timeout)

    def _start_snapshot(self, now: float) -> None:
        self._phase = "snapshot"
        self._snap_header = None
        self._snap_parts = {}
        self._send("snapshot", SendSnapshot(self.config.snapshot_chunk_blocks), now,
                   self.config.request_timeout)

    def _complete_snapshot(self, header: SnapshotHeader, now: float) -> None:
        self._req, self._req_deadline = None, math.inf
        parts, self._snap_parts, self._snap_header = self._snap_parts, {}, None
        blocks: list[BlockStored] = []
        try:
            for i in range(header.chunks):
                blocks.extend(
                    e for e in self._decoder.decode(parts[i]).events if type(e) is BlockStored
                )
        except DecodeError as e:
            self._c["bad_payloads"] += 1
            self._last_error = f"bad snapshot chunk: {e}"
            self._retry_at = now + self.config.retry_delay
            return
        self._snap_errors = 0
        self._c["snapshots"] += 1
        if self._epoch is not None and header.epoch != self._epoch:
            # Restarted between INFO and SNAPSHOT: the snapshot is right for the new run,
            # but buffered live batches may belong to either run.
            self._c["restarts"] += 1
            self._reset_reason = (
                f"publisher restarted (epoch {self._epoch:#x} -> {header.epoch:#x})"
            )
            self._buffer = {}
        self._epoch = header.epoch
        self._emit_snapshot(header.seq, blocks, True, self._reset_reason)
        self._resume(now)

    # ------------------------------------------------------------------ deliveries

    def _emit_reset(self, reason: str) -> None:
        if not self._reset_sent:
            self._c["resets"] += 1
            self._out.append(Reset(self.name, reason, self._epoch))
            self._reset_sent = True

    def _emit_snapshot(self, seq: int, blocks: list[BlockStored], exact: bool,
                       reason: str) -> None:
        self._emit_reset(reason)
        self._out.append(Snapshot(self.name, seq, blocks, self._epoch, exact))
        self._label = self._epoch  # batches carry the epoch of their snapshot
        self._reset_sent = False
        self._reset_reason = "bootstrap"
        self._delivered = seq
        self._exact = exact
        for s in [s for s in self._buffer if s <= seq]:
            del self._buffer[s]

    def _baseline(self, seq: int, reason: str) -> None:
        """Start without a snapshot just before ``seq`` (exact only if nothing came before)."""
        self._emit_snapshot(seq - 1, [], seq == 0, reason if seq else self._reset_reason)

    def _deliver(self, seq: int, payload: bytes) -> None:
        self._delivered = seq
        try:
            batch = self._decoder.decode(payload)
        except DecodeError as e:
            # Its effect on the cache is unknown: say so, like any other loss.
            self._c["bad_payloads"] += 1
            self._last_error = f"seq {seq}: {e}"
            self._emit_snapshot(seq, [], False, f"seq {seq} is not a decodable batch ({e})")
            self._want_resync = True
            return
        self._c["batches"] += 1
        self._c["events"] += len(batch.events)
        if batch.events or self.config.deliver_empty:
            self._out.append(Batch(self.name, seq, batch, self._label))

    def _drain(self) -> None:
        buf = self._buffer
        if not buf:
            return
        d = self._delivered
        assert d is not None
        for s in [s for s in buf if s <= d]:
            del buf[s]
        while d + 1 in buf:
            d += 1
            self._deliver(d, buf.pop(d))

    def _drain_next(self, seq: int) -> None:
        """:meth:`_drain` right after delivering ``seq`` = the previous last + 1: held seqs
        are always above the last delivered, so only ``seq`` itself can have gone stale and
        the buffer is not scanned (a replay into a big live backlog was quadratic)."""
        buf = self._buffer
        if buf:
            buf.pop(seq, None)
            d = self._delivered
            while d + 1 in buf:  # type: ignore[operator]
                d += 1  # type: ignore[operator]
                self._deliver(d, buf.pop(d))

    def _hold(self, seq: int, payload: bytes, now: float) -> None:
        self._buffer[seq] = payload
        if len(self._buffer) > self.config.max_buffer:
            # Give up this attempt: start it again from scratch, with an empty buffer.
            self._c["buffer_overflows"] += 1
            self._last_error = f"more than {self.config.max_buffer} live batches held"
            self._buffer = {}
            self._abort_request("resync buffer overflow")
            if self._phase == "snapshot":
                self._start_snapshot(now)
            elif self._phase == "replay" and self._replay_kind == "rebuild":
                self._start_replay(0, now, "rebuild")
            elif self._phase == "replay":
                self._start_replay(0 if self._delivered is None else self._delivered + 1, now)
            elif self._phase == "probe":
                self._probe(self._purpose, now)

    def _enter_live(self, now: float) -> None:
        if self._want_resync and self._mode == "kvwire" and self._snap_ok:
            self._want_resync = False
            self._reset_reason = "resynced after an undecodable batch"
            self._resync(now)
            return
        self._phase = "live"

    # ------------------------------------------------------------------ helpers

    def _flush(self) -> list[Output]:
        out, self._out = self._out, []
        return out

    def _dead_after(self) -> float | None:
        if self.config.dead_after is not None:
            return self.config.dead_after
        return 3.0 * self._hb if self._hb else None

    def _info_interval(self) -> float:
        if self.config.info_interval is not None:
            return self.config.info_interval
        return 10.0 * self._hb if self._hb else 10.0

    def _bad_frame(self, msg: str) -> None:
        self._c["bad_frames"] += 1
        self._last_error = msg

    def _bad_event(self, err: EventError) -> None:
        self._last_error = err.message
