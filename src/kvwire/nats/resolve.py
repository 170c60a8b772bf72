"""How a lane resumes after a failure, decided against the subject's last message: the
pure part of :class:`~kvwire.nats.writer.JsWriter`'s recovery (no I/O; the writer reads the
subject and sends what these leave held). ``tests/test_nats_guard.py`` drives them alone.

* :meth:`Resolver._resolve` (pipelined lanes): what the server stored is a prefix of what
  was sent, up to the last message's ``Nats-Msg-Id``; a hole (a refused message before a
  stored one) is healed with markers.
* :meth:`Resolver._resolve_guarded` (guarded lanes): our own message, another writer's of an
  epoch we have (what it reaches counts as stored), an epoch we left (ours go after it), or
  one we never had / a marker set left half-written (markers of our whole state).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..consume.cache import chain_events
from .lane import ACKED, FAILED, PENDING, Entry, Lane, apply_entry_effect, marker_entries
from .subjects import H_CHUNK, H_EPOCH, H_KIND, H_SEQ, header_int

__all__ = ["Resolver"]

log = logging.getLogger("kvwire.nats.writer")


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


def mid_set(last: tuple[str, int, dict[str, str]] | None) -> bool:
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


class Resolver:
    """The writer's recovery decisions (a base of :class:`~kvwire.nats.writer.JsWriter`)."""

    _inflight: dict[str, Entry]
    _room: asyncio.Event
    stats: Any
    max_payload: int

    def _commit(self, e: Entry) -> None:  # pragma: no cover - JsWriter's
        raise NotImplementedError

    def _resolve(self, lane: Lane, last: tuple[str, int, dict[str, str]] | None) -> None:
        """Decide, against the subject's last message, what was stored and what to re-send."""
        entries = list(lane.pending)
        lane.pending.clear()
        for e in entries:
            self._inflight.pop(e.token, None)
        self._room.set()
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
            self._commit(e)
        resend = [e for e in entries[k + 1:] if e.state != ACKED]
        for e in entries[k + 1:]:
            if e.state == ACKED:
                self._commit(e)  # another bridge is ahead on this subject (redundant mode)
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

    def _resolve_guarded(self, lane: Lane, last: tuple[str, int, dict[str, str]] | None
                         ) -> None:
        """Guarded lanes: against the subject's last message, commit what is stored (by this
        writer before, or by another one), hold the rest to be sent after it."""
        entries = list(lane.pending) + list(lane.held)
        lane.pending.clear()
        lane.held.clear()
        for e in entries:
            self._inflight.pop(e.token, None)
        self._room.set()
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
                self._commit(e)
            self._requeue(lane, _flat(entries[k + 1:]), last)
            return
        if not entries:
            return
        flat = _flat(entries)
        if mid_set(last):  # a set nobody finished (_after_set waited for it)
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
            self._skip_covered(lane)
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

    def _skip_covered(self, lane: Lane) -> None:
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
            self._commit(e)
            if e.kind == "batch":
                self.stats.superseded += 1

