"""What every publisher shares: the engine-facing interface, its stats and reports."""

from __future__ import annotations

import abc
from typing import Any

import msgspec

from ..wire.events import EventBatch
from .config import KVEventsConfig

__all__ = [
    "EventPublisher",
    "NullEventPublisher",
    "PublisherClosedError",
    "PublisherStats",
    "ShutdownReport",
]


class PublisherClosedError(RuntimeError):
    """``publish()`` was called after ``shutdown()``."""


class PublisherStats(msgspec.Struct, frozen=True):
    """Counters of one publisher; all monotonic except the levels ``queue_depth``,
    ``last_seq``, ``sender_alive`` and ``snapshot_exact`` (see docs/operations.md)."""

    published: int = 0
    sent: int = 0
    dropped: int = 0
    heartbeats: int = 0
    encode_errors: int = 0
    replay_requests: int = 0
    replayed: int = 0
    info_requests: int = 0
    snapshot_requests: int = 0
    snapshot_chunks: int = 0
    bad_requests: int = 0
    busy_rejections: int = 0
    snapshots_unavailable: int = 0
    foreign_batches: int = 0
    model_errors: int = 0
    model_unknown_events: int = 0
    dropped_sender_dead: int = 0
    queue_depth: int = 0
    last_seq: int = -1
    epoch: int = 0
    sender_alive: bool = True
    snapshot_exact: bool = True


class ShutdownReport(msgspec.Struct, frozen=True):
    """What ``shutdown()`` managed: ``unsent`` batches were accepted but never sent live."""

    sent: int
    unsent: int
    timed_out: bool


class EventPublisher(abc.ABC):
    """Publishes KV event batches; engines call ``publish`` once per step that changed the cache."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self._data_parallel_rank = data_parallel_rank
        self._config: KVEventsConfig | None = None

    def get_publisher_config(self) -> KVEventsConfig:
        """The resolved config of this publisher (this rank's endpoints); a copy."""
        if self._config is None:
            return KVEventsConfig(publisher="null")
        return msgspec.structs.replace(self._config)

    @abc.abstractmethod
    def publish(self, events: EventBatch) -> None:
        """Hand over one batch; must never block the caller."""

    @abc.abstractmethod
    def shutdown(self) -> Any:
        """Flush and release resources; idempotent."""

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class NullEventPublisher(EventPublisher):
    """Accepts and discards batches: what an engine gets with events disabled."""

    def publish(self, events: EventBatch) -> None:
        return None

    def shutdown(self, timeout: float | None = None) -> ShutdownReport:
        return ShutdownReport(sent=0, unsent=0, timed_out=False)
