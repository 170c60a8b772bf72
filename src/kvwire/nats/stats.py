"""What one NATS source of kvwire streams counts (:class:`NatsStats`): below the reader
(consumer.py, which fills it), its link and its config (streams.py, which re-exports it)."""

from __future__ import annotations

import msgspec

__all__ = ["NatsStats"]


class NatsStats(msgspec.Struct, frozen=True):
    """Counters of one NATS source (all subjects)."""

    connected: bool
    messages: int
    batches: int
    resets: int
    snapshots: int
    skipped: int
    duplicates: int
    gaps: int
    resyncs: int
    inexact: int
    bad_messages: int
    bad_events: int
    reconnects: int
    repositions: int
    acked: int
    unverified_resumes: int
    caught_up: int  # subjects that caught up on their own history at bootstrap
    last_error: str | None
    #: failed tries at setting up the consumer (its stream missing yet, a server restarting)
    setup_failures: int = 0
