"""What a NATS JetStream source of kvwire streams is (:class:`NatsStreams`, given to a
:class:`~kvwire.consume.Subscriber` beside ZeroMQ ``StreamSpec``s) and what it counts
(:class:`NatsStats`, defined in :mod:`.stats`); the reader itself is
:mod:`kvwire.nats.consumer`, run for a Subscriber by :mod:`kvwire.nats.link`, which
:meth:`NatsStreams.open_link` opens: the one module that reaches up to the reader (the
reader and the link do not import this one at run time)."""

from __future__ import annotations

from typing import Any

import msgspec

from . import subjects as S
from .stats import NatsStats

__all__ = ["NatsStats", "NatsStreams"]


class NatsStreams(msgspec.Struct, frozen=True):
    """Every kvwire stream on a JetStream stream, for :class:`~kvwire.consume.Subscriber`.

    ``subject`` filters (default ``<prefix>.>``); ``durable`` names a consumer that outlives
    the process (resumes where it acked); ``max_pending`` bounds items held in memory
    (twice: waiting in the source, and moved into the Subscriber's queue)."""

    url: str
    stream: str = S.DEFAULT_STREAM
    subject: str | None = None
    durable: str | None = None
    prefix: str = S.DEFAULT_PREFIX
    snapshot_bucket: str = S.DEFAULT_SNAPSHOT_BUCKET
    max_pending: int = 20_000
    fetch: int = 1000
    ack_wait: float = 30.0

    @property
    def name(self) -> str:
        return f"{self.url}/{self.stream}"

    @property
    def filter(self) -> str:
        return self.subject or f"{self.prefix}.>"

    def open_link(self, ctx: Any) -> Any:
        """Start the background thread feeding a Subscriber (wakes it through ``ctx``):
        a :class:`kvwire.nats.link.NatsLink`."""
        from .link import NatsLink

        return NatsLink(self, ctx)
