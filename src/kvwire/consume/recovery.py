"""How one stream machine recovers: requests to the publisher and what their answers mean.

The middle layer of :class:`kvwire.consume.stream.StreamMachine`, on top of
:class:`~kvwire.consume.delivery.StreamState`: the INFO/REPLAY/SNAPSHOT requests (one in
flight at a time, abandoned ones recycled), the reply inputs (:meth:`Recovery.replay`,
:meth:`Recovery.replay_end`, :meth:`Recovery.info`, :meth:`Recovery.snapshot_chunk`,
:meth:`Recovery.error`), and the decisions behind them: gap filling, rebuilds from seq 0,
snapshot bootstrap and resync, restarts, timeouts and retries, the held-batch buffer."""

from __future__ import annotations

import math
from typing import Literal

from ..wire.events import BlockStored, DecodeError
from .delivery import StreamState
from .items import Action, Output, RecycleRequests, SendInfo, SendReplay, SendSnapshot
from .replies import InfoReply, SnapshotHeader

__all__ = ["Recovery"]


class Recovery(StreamState):
    """Request, reply and recovery logic of :class:`~kvwire.consume.stream.StreamMachine`."""

    # ------------------------------------------------------------------ replies

    def replay(self, seq: int, payload: bytes, now: float) -> list[Output]:
        """One replayed batch arrived."""
        if self._req != "replay":
            self._c["stray_replies"] += 1
            return []
        self._req_deadline = now + self.config.request_timeout
        self._c["replayed"] += 1
        self._fruitless = 0
        chk = self._check_seq
        if chk is not None:  # asked from our last seq, to see it is still ours
            self._check_seq = None
            if seq == chk:
                self._check_seen = True
                self._drained = False  # (ours is the publisher's: so is what it drained)
                if self._check_payload is not None and payload != self._check_payload:
                    self._run_changed(f"its batch at seq {seq} is not the one we had", now)
                return self._flush()  # ours: the same run goes on
            # (ours evicted since: nothing to compare; the answer goes on as asked)
        if self._other_run(seq, payload, now):
            return self._flush()
        first = self._replay_got == 0
        self._replay_got += 1
        kind = self._replay_kind
        if kind == "rebuild" and self._rebuild_answer(seq, payload, now):
            return self._flush()
        if kind == "verify":
            # It keeps a buffer, and that buffer lacks our last seq, which a buffer of
            # the last N batches always holds for its own run: the seqs went back.
            self._run_changed(f"its replay no longer holds seq {self._delivered}", now)
            return self._flush()
        if self._delivered is None:  # bootstrap without snapshot: replay from 0
            if self._replay_from == 0 and seq > self.first_seq:
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
            self._drained = False
            self._drain_next(seq)
        elif first and not self._check_seen:
            # The answer starts after what we asked for: the publisher no longer has it.
            # (Not if ours came back in it: its ring holds what follows ours, so what is
            # missing was lost on the way, below.)
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
        if seq <= self.first_seq:
            # The publisher still holds its whole run: start over from its first seq, exactly.
            self._c["resyncs"] += 1
            self._reset_reason = (
                f"seqs {a}..{b - 1} not replayable; rebuilt exactly by a replay from seq {seq}"
            )
            self._baseline(seq, self._reset_reason)
            self._deliver(seq, payload)
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
        d = self._delivered
        sent, kind = self._req_sent, self._replay_kind
        # Nothing past our last seq (ours back, if it was asked for, and the end):
        # (Ours must have come back, in this answer or in the one it continues: an
        # unchecked answer past ours is empty as well from a publisher that restarted and
        # has not reached our seq again.)
        high = self._live_high
        nothing_past = (not self._replay_got and d is not None and self._replay_from == d + 1
                        and (self._check_seen or (self._check_seen is None and self._vouched))
                        and (high is None or high <= d))
        self._replay_ended(now)
        if self._req is None and self._phase == "live" and kind != "verify" \
                and self._mode == "reference":
            if nothing_past:
                # When the publisher served this, it held nothing past what we have. (An
                # answer that brought batches does not say so: its own tail may have been
                # dropped on the way.)
                self._confirmed_at = max(self._confirmed_at, sent)
                self._unconfirmed = self._stall_at > sent
            elif self._unconfirmed and self._last_live <= sent:
                # Still quiet: ask again, until an answer brings ours alone. (With live
                # batches arriving meanwhile, the check after the next quiet spell will.)
                self._ask_tail(now)
        return self._flush()

    def _replay_ended(self, now: float) -> None:
        """What a replay's end means, once its answer is all in."""
        if self._delivered is None:
            if (self._buffer or self._live_high is not None) and self._replay_got == 0 and \
                    self._fruitless + 1 < self.config.replay_attempts:
                # Nothing buffered when it was served, but live batches came since (held,
                # or dropped when the held ones overflowed): the publisher holds them from
                # where they started, so ask again.
                self._fruitless += 1
                self._start_replay(0, now, "boot")
            elif self._buffer:
                m = min(self._buffer)
                self._baseline(m, f"no snapshot available; starting at live seq {m}")
                self._resume(now)
            else:
                self._phase = "await_first"  # the first live batch decides (see live())
            return
        if self._replay_kind == "rebuild":  # an empty answer from 0: nothing to rebuild from
            self._give_up(*self._rebuild_gap, now)
            return
        if self._replay_kind == "tail" and self._check_seen is False and not self._replay_got:
            # Not even our last seq came back: either it keeps no buffer, or it restarted.
            # A replay from 0 tells which (anything at all in it: a restart, see replay()).
            self._start_replay(0, now, "verify")
            return
        if self._replay_kind == "verify":  # empty as well: no buffer, nothing to learn
            self._resume(now)
            return
        self._drain()
        progress = self._delivered + 1 > self._replay_from
        high = self._live_high
        behind = bool(self._buffer) or (high is not None and high > self._delivered)  # type: ignore[operator]
        if behind and not progress and self._check_seen and not self._replay_got:
            # Ours alone came back, yet we hold (or saw) later ones: what follows was
            # dropped on the way (a full ROUTER pipe), not gone. Ask past ours, unchecked,
            # before calling it lost.
            self._start_replay(self._delivered + 1, now, "gap", vouched=True)  # type: ignore[operator]
            return
        if self._buffer and not progress:
            # The replay brought nothing we needed: whatever is missing is gone.
            m = min(self._buffer)
            self._unfillable(self._delivered + 1, m, self._buffer.pop(m), now)
            if self._req is None and self._phase == "replay":
                self._resume(now)
        else:
            if not self._replay_got:
                self._fruitless += 1
            if not self._buffer and not self._replay_got and (
                    self._vouched or self._fruitless >= self.config.replay_attempts):
                # Asked past ours right after ours came back (or again and again), and
                # nothing: the live seq seen past ours was not this run's (a restart not
                # seen). Its tail decides.
                self._fruitless = 0
                self._live_high = self._delivered
                self._unconfirmed = True
            self._continue(now)  # (live, unless a live seq past ours was seen)

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
                self._count_lost(nxt, info.oldest if info.oldest != -1 else nxt)
                self._reset_reason = f"seqs from {nxt} no longer replayable; resynced"
                self._resync(now)
            else:
                self._start_replay(nxt, now)
        elif purpose in ("suspect", "boot"):
            if purpose == "suspect":  # same run: the batch that went back was a duplicate
                d = self._delivered
                self._c["duplicates"] += sum(1 for s in self._buffer if s <= d)
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

    # ------------------------------------------------------------------ decisions

    def _other_run(self, seq: int, payload: bytes, now: float) -> bool:
        """``seq`` came again with other bytes than the ones we hold or delivered for it.
        A reference publisher has no epochs: that is how its new run shows itself, and a
        picture must never join two runs. Restart from the new one; True if so."""
        if self._mode != "reference":
            return False  # kvwire: its epoch says it (INFO); unknown: INFO will tell
        had = self._buffer.get(seq)
        if had is None:
            had = self._recent_payload(seq)
        if had is None or had == payload:
            return False
        self._run_changed(f"its batch at seq {seq} is not the one we had", now)
        return True

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
            self._lost_upto = -1
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
        self._lost_upto = -1
        if not keep_buffer:
            self._buffer = {}
        self._emit_reset(reason)
        self._reset_reason = reason
        self._delivered = None
        self._exact = False
        # Where the new run ends is not known either: confirmed as after a stall.
        self._stall_at, self._unconfirmed = now, True
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
            self._start_replay(nxt, now, check=True)  # ...and a reference one checks ours

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
        self._count_lost(nxt, seq)
        self._last_error = f"seqs {nxt}..{seq - 1} lost"
        if self._mode == "kvwire" and self._snap_ok:
            self._buffer[seq] = payload
            self._reset_reason = f"seqs {nxt}..{seq - 1} lost and not replayable; resynced"
            self._resync(now)
            return
        self._baseline(seq, f"seqs {nxt}..{seq - 1} lost and no snapshot available")
        self._deliver(seq, payload)
        self._drain()

    def _count_lost(self, nxt: int, end: int) -> None:
        """Seqs ``nxt..end-1`` are lost: count those not counted yet in this run."""
        start = max(nxt, self._lost_upto + 1)
        if end > start:
            self._c["lost"] += end - start
            self._lost_upto = end - 1

    def _no_snapshot_fallback(self, now: float) -> None:
        if self._delivered is None:
            self._bootstrap(now)
        else:
            self._past_gap(now)

    def _past_gap(self, now: float) -> None:
        """Baseline known, the gap before the first held batch cannot be filled: jump to it
        (``_unfillable`` decides how) and go on; nothing held: back to live."""
        if self._buffer:
            m = min(self._buffer)
            self._unfillable(self._delivered + 1, m, self._buffer.pop(m), now)  # type: ignore[operator]
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
            # Unchecked only where ours came back in the answer this continues (or the one
            # that continues): otherwise a publisher that restarted since would answer with
            # its new run, and we would take it for the rest of ours.
            # (Nor past batches held from live: they may be another run's.)
            vouched = (bool(self._check_seen) or self._vouched) and not self._drained
            self._start_replay(self._delivered + 1, now, "gap",  # type: ignore[operator]
                               check=not vouched, vouched=vouched)

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
        elif kind == "replay" and (self._replay_got > 0 or self._check_seen) \
                and self._delivered is not None:
            # The rest (or its end) was lost on the way. Our own seq back counts: the run
            # is confirmed, so what follows is asked for without it (a check every time
            # could fill a small answer pipe with ours alone, and never progress).
            self._continue(now, ended=False)
        elif kind == "replay" and self._fruitless + 1 < self.config.replay_attempts:
            self._fruitless += 1  # unanswered: a stall on either side; ask again
            # (checked: the publisher may have died and another run answer the next one)
            self._start_replay(self._replay_from, now, self._replay_kind, check=True)
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
            else:
                self._past_gap(now)
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
        self._req_sent = now
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
                      kind: Literal["boot", "gap", "rebuild", "tail", "verify"] | None = None,
                      check: bool = False, vouched: bool = False) -> None:
        """Ask for seqs from ``start``. ``check`` (reference publishers, ``start`` right
        after our last seq): ask from our last seq instead, and check that what comes back
        for it is the batch we had (:meth:`replay`): a restarted publisher whose new run
        has passed our seq otherwise looks like a gap, and its batches would continue the
        old run's state. ``vouched``: it continues an answer in which ours came back (an
        empty answer to it then confirms the tail, :meth:`replay_end`)."""
        self._phase = "replay"
        self._replay_from = start
        self._replay_kind = kind or ("boot" if self._delivered is None else "gap")
        self._replay_got = 0
        self._check_seq, self._check_seen = None, None
        self._vouched = vouched
        d = self._delivered
        if check and d is not None and d >= 0 and start == d + 1:
            self._check_seq, self._check_seen = d, False
            self._check_payload = self._recent_payload(d)
            start = d
        self._c["replays"] += 1
        self._send("replay", SendReplay(start), now, self.config.request_timeout)

    def _ask_tail(self, now: float) -> None:
        """Confirm a reference stream's tail: ask from our last seq (checked, see
        :meth:`_start_replay`); ``unconfirmed`` until the answer is ours alone."""
        self._unconfirmed = True
        self._tail_sent = now
        self._c["tail_checks"] += 1
        self._start_replay(self._delivered + 1, now, "tail", check=True)  # type: ignore[operator]

    def _run_changed(self, why: str, now: float) -> None:
        """A reference publisher's replay shows a new run: restart from it."""
        self._c["restarts"] += 1
        self._live_high = None
        self._restart(f"publisher restarted ({why})", now)

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

    # ------------------------------------------------------------------ held batches

    def _hold(self, seq: int, payload: bytes, now: float) -> None:
        self._buffer[seq] = payload
        if len(self._buffer) > self.config.max_buffer:
            # Give up this attempt: start it again from scratch, with an empty buffer.
            self._c["buffer_overflows"] += 1
            self._last_error = f"more than {self.config.max_buffer} live batches held"
            self._buffer = {}
            if self._req is not None and self._req_sent == now:
                # Asked in this same read: the publisher has not even seen it, and its
                # answer serves as well as a new one would. Asking again would only queue
                # one more answer at the publisher for nobody (a reference publisher
                # still serves a recycled peer's requests), ahead of the one we wait for.
                return
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
