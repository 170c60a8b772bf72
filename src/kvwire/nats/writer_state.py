"""The bridge writer's state and decisions, without I/O: :class:`WriterState` is held by
:class:`~kvwire.nats.writer.JsWriter`, which does the sending, the reading of a subject's
last message, the tasks and the timers, and asks this part what to do. ``tests/
test_nats_guard.py`` drives it alone.

It holds the lanes, the messages in flight (by reply token), the counters and the lag, and
decides:

* what goes out next (:meth:`WriterState.take`: a guarded lane's next run) and its HPUB
  command (:meth:`WriterState.register`);
* what a PubAck means (:meth:`WriterState.ack`): commit in subject order, a failure, or a
  guard's refusal (the lane must recover);
* how a lane resumes after a failure, against the subject's last message:
  :meth:`WriterState.resolve` (pipelined lanes: what the server stored is a prefix of what
  was sent, up to the last message's ``Nats-Msg-Id``; a hole, a refused message before a
  stored one, is healed with markers) and :meth:`WriterState.resolve_guarded` (guarded
  lanes: our own message, another writer's of an epoch we have (what it reaches counts as
  stored), an epoch we left (ours go after it), or one we never had / a marker set left
  half-written (markers of our whole state)).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from ..index.cache import chain_events
from .lag import Lag
from .lane import ACKED, FAILED, PENDING, Entry, Lane, apply_entry_effect, marker_entries
from .subjects import H_CHUNK, H_EPOCH, H_KIND, H_SEQ, header_int

__all__ = ["LastMsg", "WriterState", "WriterStats", "mid_set"]

log = logging.getLogger("kvwire.nats.writer")

#: The subject's last message as a recovery reads it: (Nats-Msg-Id, stream seq, headers).
LastMsg = tuple[str, int, dict[str, str]]


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


class _PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: dict[str, Any] | None = None


_ack_decoder = msgspec.json.Decoder(_PubAck)
_WRONG_LAST_SEQ = 10071  # JetStream's err_code: Nats-Expected-Last-Subject-Sequence failed


def _flat(entries: list[Entry]) -> list[Entry]:
    """Runs a guarded lane made, back into their batch entries (a recovery may split them)."""
    out: list[Entry] = []
    for e in entries:
        if e.parts is not None:
            for p in e.parts:
                p.state = PENDING
            out += e.parts
        else:
            e.state = PENDING
            out.append(e)
    return out


def mid_set(last: LastMsg | None) -> bool:
    """The subject's last message is a reset marker or a snapshot chunk short of n/n."""
    if last is None:
        return False
    h = last[2]
    kind = h.get(H_KIND)
    if kind == "reset":
        return True
    if kind == "snapshot":
        i, _, n = h.get(H_CHUNK, "0/1").partition("/")
        idx = header_int(i)
        return idx is not None and idx != (header_int(n) or 1) - 1
    return False


class WriterState:
    """Lanes, messages in flight, counters and lag of one writer; every decision, no I/O.
    ``guarded``: one message in flight per subject, each carrying the guard (``pack > 1``,
    or any pack where the writer cannot keep pipelined lanes a prefix)."""

    def __init__(self, pack: int = 1, guarded: bool | None = None,
                 max_inflight: int = 4096) -> None:
        if not isinstance(pack, int) or pack < 1:
            raise ValueError(f"pack must be an int >= 1, got {pack!r}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.pack = pack
        self.guarded = pack > 1 if guarded is None else guarded
        self.max_inflight = max_inflight
        self.max_payload = 1 << 20
        self.stats = WriterStats()
        self.lanes: dict[str, Lane] = {}
        self.inflight: dict[str, Entry] = {}  # reply token -> message
        self.closing = False
        # engine ts -> PubAck of each batch committed (kvwire.nats.lag): counted once, in the
        # current window; a window taken (a stats log, a report) is merged into the rest
        self.lag_window = Lag()
        self._lag_taken = Lag()
        self._n = 0

    # ------------------------------------------------------------------ lanes, lag

    def lane(self, engine: str, rank: int, subject: str) -> Lane:
        """The lane of ``subject`` (made on first use; kept while the writer lives)."""
        ln = self.lanes.get(subject)
        if ln is None:
            ln = self.lanes[subject] = Lane(subject, engine, rank)
        return ln

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

    def has_room(self) -> bool:
        return len(self.inflight) < self.max_inflight

    def idle(self) -> bool:
        """Nothing in flight, held or recovering on any lane."""
        return not self.inflight and not any(
            ln.held or ln.recovering or ln.pending for ln in self.lanes.values())

    # ------------------------------------------------------------------ sending

    def blocked(self, lane: Lane) -> bool:
        """A guarded lane that may not send now: a message in flight (or being sent),
        recovering, nothing held, or closing."""
        return bool(lane.busy or lane.pending or lane.recovering or not lane.held
                    or self.closing)

    def take(self, lane: Lane) -> Entry | None:
        """The guarded lane's next message (call when not :meth:`blocked` and the subject's
        last seq is known: ``lane.expect``)."""
        if lane.pos is not None:
            self.skip_covered(lane)
            if not lane.held:
                return None
        e = lane.next_message(self.pack, self.max_payload - 4096)
        if e.parts is not None:
            self.stats.runs += 1
        e.expect = lane.expect
        return e

    def register(self, e: Entry, inbox: bytes) -> bytes | None:
        """Make ``e`` in flight; returns its HPUB command with reply ``inbox.<token>``
        (built here in one go: nats-py's ``publish`` validates and encodes the header dict
        key by key, which was most of the bridge's cost per batch), or None when it cannot
        go out at all (``e.error`` says why: fail it)."""
        self._n += 1
        e.token = tok = str(self._n)
        e.state, e.js_seq, e.sent_at = PENDING, None, time.monotonic()
        self.inflight[tok] = e
        e.lane.pending.append(e)
        self.stats.sent += 1
        self.stats.bytes += len(e.payload)
        if len(e.payload) + 1024 > self.max_payload:
            # The server would drop the connection; cannot go out as one message.
            e.oversize = True
            e.error = (f"{e.msg_id}: {len(e.payload)} bytes, over the server's max payload "
                       f"{self.max_payload}")
            return None
        hdr = e.raw_headers()
        p = e.payload
        return b"HPUB %s %s.%s %d %d\r\n%s%s\r\n" % (
            e.lane.subject_b, inbox, tok.encode(), len(hdr), len(hdr) + len(p), hdr, p)

    def fail(self, e: Entry, why: str) -> None:
        """``e`` failed (its lane must recover)."""
        e.state, e.error = FAILED, why
        self.stats.failed += 1
        self.stats.last_error = why

    # ------------------------------------------------------------------ acks

    def ack(self, token: str, data: bytes, headers: dict[str, str] | None
            ) -> tuple[Lane | None, str | None, int]:
        """Apply one PubAck: ``(lane, None, _)`` when stored (a guarded lane may send its
        next message), ``(lane, why, log level)`` when the lane must recover (a failure, or
        a guard's refusal), ``(None, None, _)`` for a stray ack."""
        e = self.inflight.pop(token, None)
        if e is None:
            self.stats.stray_acks += 1  # late answer to a message a recovery re-sent
            return None, None, 0
        if headers and headers.get("Status"):
            why = (f"JetStream status {headers.get('Status')} "
                   f"{headers.get('Description', '')}").strip()
            self.fail(e, why)
            return e.lane, why, logging.WARNING
        try:
            ack = _ack_decoder.decode(data)
        except msgspec.DecodeError:
            why = f"unreadable PubAck {data[:80]!r}"
            self.fail(e, why)
            return e.lane, why, logging.WARNING
        if ack.error is not None:
            if ack.error.get("err_code") == _WRONG_LAST_SEQ:
                # Not a failure: another writer (a redundant bridge, the last owner of a
                # lease) wrote the subject since; the recovery finds how far it went.
                self.stats.refused += 1
                e.state, e.error = FAILED, "refused by the guard"
                return e.lane, "the subject moved on (another writer)", logging.INFO
            why = f"JetStream refused {e.msg_id}: {ack.error.get('description', ack.error)}"
            self.fail(e, why)
            return e.lane, why, logging.WARNING
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
            self.advance(lane)
        return lane, None, 0

    def advance(self, lane: Lane) -> None:
        """Apply acked messages at the head of the lane, in subject order."""
        pending = lane.pending
        while pending and pending[0].state == ACKED:
            self.commit(pending.popleft())

    def commit(self, e: Entry) -> None:
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

    def timed_out(self, lane: Lane, now: float, ack_timeout: float) -> bool:
        """The lane's oldest message has waited for its ack longer than ``ack_timeout``."""
        return bool(not lane.recovering and lane.pending and lane.pending[0].state == PENDING
                    and now - lane.pending[0].sent_at > ack_timeout)

    def disconnected(self) -> list[Lane]:
        """The connection broke: every lane's acks in flight went with it; the lanes with
        messages in flight or held (they must recover)."""
        out = []
        for lane in self.lanes.values():
            lane.cut = True
            if lane.pending or lane.held:
                out.append(lane)
        return out

    # ------------------------------------------------------------------ recovery

    def resolve(self, lane: Lane, last: LastMsg | None) -> None:
        """Pipelined lanes: decide, against the subject's last message, what was stored and
        what to re-send (held, in order)."""
        entries = list(lane.pending)
        lane.pending.clear()
        for e in entries:
            self.inflight.pop(e.token, None)
        k = -1
        if last is not None:
            for i, e in enumerate(entries):
                if e.msg_id == last[0]:
                    k = i
        hole = any(e.state == FAILED for e in entries[:k + 1]) or any(
            e.oversize for e in entries)
        if hole:
            self.stats.holes += 1
            self._heal(lane, entries, last)
            return
        for e in entries[:k + 1]:  # stored: acked, or its ack was lost on the way
            if e.state != ACKED:
                e.state = ACKED
                e.js_seq = last[1] if e is entries[k] else None  # type: ignore[index]
            self.commit(e)
        resend = [e for e in entries[k + 1:] if e.state != ACKED]
        for e in entries[k + 1:]:
            if e.state == ACKED:
                self.commit(e)  # another bridge is ahead on this subject (redundant mode)
        self.stats.resent += len(resend)
        lane.held.extendleft(reversed(resend))

    def _heal(self, lane: Lane, entries: list[Entry], last: Any,
              why: str = "a message was refused before a stored one",
              reason: str = "bridge: messages refused by JetStream out of order; resynced"
              ) -> None:
        """The subject cannot be continued in order: write the whole state as markers."""
        todo = entries + list(lane.held)
        lane.held.clear()
        for e in todo:
            apply_entry_effect(lane.cache, e.kind, e.effect)
        newest = todo[-1]
        events = chain_events(lane.cache.raw_copy())
        log.warning("%s: %s; resync markers at (%d, %d)", lane.subject, why, newest.epoch,
                    newest.seq)
        lane.last_js_seq = None  # the cache is ahead of the subject until the markers land
        lane.held.extend(marker_entries(lane, newest.epoch, newest.seq, events, lane.exact,
                                        reason, self.max_payload))

    def resolve_guarded(self, lane: Lane, last: LastMsg | None) -> None:
        """Guarded lanes: against the subject's last message, commit what is stored (by this
        writer before, or by another one), hold the rest to be sent after it."""
        entries = list(lane.pending) + list(lane.held)
        lane.pending.clear()
        lane.held.clear()
        for e in entries:
            self.inflight.pop(e.token, None)
        if last is None:  # an empty subject (or all of it aged out): everything goes
            lane.expect, lane.pos = 0, None
            self._requeue(lane, _flat(entries), last)
            return
        mid, js, h = last
        lane.expect = js
        kind, epoch, seq = h.get(H_KIND), header_int(h.get(H_EPOCH)), header_int(h.get(H_SEQ))
        lane.pos = None if epoch is None or seq is None else (kind or "", epoch, seq)
        k = next((i for i in range(len(entries) - 1, -1, -1) if entries[i].msg_id == mid), -1)
        if k >= 0:  # the last message is one of ours: what came up to it is stored
            for i, e in enumerate(entries[:k + 1]):
                e.state, e.js_seq = ACKED, js if i == k else None
                self.commit(e)
            self._requeue(lane, _flat(entries[k + 1:]), last)
            return
        if not entries:
            return
        flat = _flat(entries)
        if mid_set(last):  # a set nobody finished (the writer waited for it)
            self._heal(lane, flat, last, why=f"the subject ends in a marker set left "
                       f"half-written ({mid!r})",
                       reason="bridge: a marker set on the subject was left unfinished; "
                              "resynced")
            return
        pos = lane.pos
        if pos is not None and (any(e.epoch == pos[1] for e in flat) or pos[1] in lane.epochs):
            # Another writer's message of an epoch we have: what it reaches is stored or
            # passed (the pump skips it); an epoch we left: ours go after it.
            self._requeue(lane, flat, last)
            self.skip_covered(lane)
            return
        # An epoch this writer has never had (or not a kvwire message): which is newer is
        # unknown, so the subject restarts from our whole state, guarded after that message.
        self._heal(lane, flat, last, why=f"the subject's last message {mid!r} is of an epoch "
                   "this bridge never wrote",
                   reason="bridge: the subject went on in an epoch this bridge never saw; "
                          "resynced")

    def _requeue(self, lane: Lane, flat: list[Entry], last: Any) -> None:
        """Hold ``flat`` to be sent again; a batch too big for one message can never be
        sent: the lane's whole state goes as chunked markers instead."""
        if any(e.oversize for e in flat):
            self._heal(lane, flat, last, why="a batch is over the server's max payload",
                       reason="bridge: a batch too large for one message; resynced")
        else:
            lane.held.extend(flat)

    def skip_covered(self, lane: Lane) -> None:
        """Commit, unsent, the held entries the subject already holds or has passed: of its
        last message's epoch, at or before its seq (a marker there holds the state of every
        batch up to it). Another writer put them there; sending them would store them twice."""
        pos = lane.pos
        if pos is None:
            return
        kind, epoch, seq = pos
        held = lane.held
        while held:
            e = held[0]
            if not (e.epoch == epoch and (e.seq < seq or e.seq == seq and (
                    e.kind == "batch" or kind in ("batch", "batches")))):
                return
            held.popleft()
            at_end = e.seq == seq and kind in ("batch", "batches") and e.kind == "batch"
            e.state, e.js_seq = ACKED, lane.expect if at_end else None
            self.commit(e)
            if e.kind == "batch":
                self.stats.superseded += 1
