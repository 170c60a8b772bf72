"""The tunables and counters of one consumed stream (:class:`~kvwire.consume.stream.StreamMachine`).

Plain frozen Structs: a config is passed in once, stats are a snapshot of counters that can
be serialized or exported (:mod:`kvwire.metrics`) without touching the machine."""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["Mode", "Phase", "StreamConfig", "StreamStats"]


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
    #: Reference publishers (no heartbeats): confirm the stream's tail, by a replay asked
    #: from its last seq, once the live stream has been quiet this long, and as soon as the
    #: live backlog is read after the consumer itself did not run for this long (ticks
    #: further apart). Until the answer comes, the stream's state is ``unconfirmed``.
    tail_after: float = 1.0


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
    to no request in flight; ``state``: ``syncing`` (no baseline yet), ``inexact`` (an
    inexact start, or a loss), ``unconfirmed`` (a reference stream quiet, or its consumer
    stalled, since its tail was last confirmed: batches dropped at its end would not show)
    or ``exact``; ``exact``: the state is ``exact``; ``unconfirmed``: it is ``unconfirmed``.
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
    lost: int | None  # None: not applicable (NATS streams: kvwire.nats.link)
    replays: int | None
    replayed: int | None
    snapshots: int
    resyncs: int
    resets: int
    restarts: int | None
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
    state: str = "unknown"
    unconfirmed: bool = False


_COUNTERS = (
    "live_messages", "batches", "events", "duplicates", "gaps", "lost", "replays", "replayed",
    "snapshots", "resyncs", "resets", "restarts", "buffer_overflows", "timeouts",
    "error_replies", "bad_frames", "bad_payloads", "stray_replies", "deaths", "tail_checks",
)
