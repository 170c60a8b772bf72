"""The state of one stream machine and the in-order delivery of what it holds.

The bottom layer of :class:`kvwire.consume.stream.StreamMachine`: every attribute the
machine has is set here, and so is everything that emits a delivery (``Reset``,
``Snapshot``, ``Batch``) or drains held batches in seq order. Nothing here sends a request
or decides how to recover; :mod:`kvwire.consume.recovery` builds on it."""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

from ..wire.events import BatchDecoder, BlockStored, DecodeError, EventError
from .config import _COUNTERS, Mode, Phase, StreamConfig
from .items import Batch, Output, Reset, Snapshot
from .replies import SnapshotHeader

__all__ = ["StreamState"]

#: How many delivered payloads a stream keeps to compare a seq that comes again.
RECENT = 64


class StreamState:
    """Attributes, deliveries and small helpers shared by the machine's layers.

    Not used alone: :class:`~kvwire.consume.stream.StreamMachine` is the public class (its
    constructor is this one)."""

    def __init__(
        self, name: str, *, has_replay: bool = True, config: StreamConfig | None = None,
        resume_after: tuple[int, int] | None = None, first_seq: int = 0,
    ) -> None:
        if not isinstance(first_seq, int) or first_seq < 0:
            raise ValueError(f"first_seq must be an int >= 0, got {first_seq!r}")
        self.name = name
        #: the seq a publisher's run begins at: 0 (vLLM, SGLang, kvwire), 1 (Mooncake's
        #: RFC #1527 publisher). Replays are still asked from 0 (a publisher answers from
        #: the oldest it holds); a run followed from a seq <= this one is an exact start.
        self.first_seq = first_seq
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
        self._req_sent = -math.inf  # when the request in flight was sent
        self._purpose = "boot"
        self._replay_from = 0
        self._replay_kind: Literal["boot", "gap", "rebuild", "tail", "verify"] = "boot"
        self._replay_got = 0  # replies received for the replay in flight (ours not counted)
        # The payloads of the last seqs delivered as batches, oldest first, the last one
        # ``_delivered``'s: a reference publisher has no epochs, so the same seq arriving
        # again with other bytes is how a new run shows itself (Recovery._other_run).
        self._recent: deque[bytes] = deque(maxlen=RECENT)
        # A replay asked from our last seq (``check``): that seq, until its reply comes;
        # the payload we had for it; whether it came back (None: no check asked).
        self._check_seq: int | None = None
        self._check_payload: bytes | None = None
        self._check_seen: bool | None = None
        self._vouched = False  # the replay in flight continues one in which ours came back
        self._drained = False  # our last seq was delivered from the held ones, not a reply
        # Replay requests in a row that timed out unanswered, or whose answer brought nothing
        # while a later live seq was seen (Recovery._replay_ended); any reply resets it.
        self._fruitless = 0
        self._from0_gone = False  # this run's replay buffer no longer starts at its first seq
        # First seqs of the losses already rebuilt once in this run: a seq the publisher never
        # buffered stays missing however often we rebuild (two of them used to alternate
        # forever when only the last one was remembered). At most one per buffered seq.
        self._rebuilt: set[int] = set()
        self._rebuild_gap = (0, 0)  # that loss: seqs [a, b) missing, b held
        # The last seq counted as lost in this run: a resync whose snapshot then fails falls
        # back to the same gap, which must not be counted twice.
        self._lost_upto = -1
        self._snap_header: SnapshotHeader | None = None
        self._snap_parts: dict[int, bytes] = {}
        self._snap_errors = 0
        self._retry_at = math.inf
        self._reset_sent = False
        self._reset_reason = "bootstrap"
        self._last_live = 0.0
        self._checked_at = -math.inf  # when tick last made a periodic check
        self._tail_last = False  # that check was a tail check
        # Reference streams have no heartbeats: their tail is confirmed by a replay asked
        # from our last seq (tick). Times below are ``now`` values.
        self._last_tick = -math.inf  # a long gap between ticks is a stall of the consumer
        self._stall_at = -math.inf  # when tick last saw such a stall
        self._tail_sent = -math.inf  # when the last tail check was asked
        self._confirmed_at = -math.inf  # sending time of the last answer that confirmed it
        self._unconfirmed = False  # quiet (or stalled) since, and not confirmed yet
        self._alive = True
        self._next_check = math.inf

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
        self._recent.clear()
        self._exact = exact
        for s in [s for s in self._buffer if s <= seq]:
            del self._buffer[s]

    def _baseline(self, seq: int, reason: str) -> None:
        """Start without a snapshot just before ``seq`` (exact only if nothing came before)."""
        first = seq <= self.first_seq
        self._emit_snapshot(seq - 1, [], first, self._reset_reason if first else reason)

    def _deliver(self, seq: int, payload: bytes) -> None:
        self._delivered = seq
        self._recent.append(payload)
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

    def _recent_payload(self, seq: int) -> bytes | None:
        """The payload delivered for ``seq``, if it is among the last ones kept."""
        back = self._delivered - seq if self._delivered is not None else -1
        recent = self._recent
        return recent[-1 - back] if 0 <= back < len(recent) else None

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
            self._drained = True

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
                self._drained = True

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
