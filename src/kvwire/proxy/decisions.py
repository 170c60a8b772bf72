"""The proxy's pure decisions (no I/O, no clock of its own): per engine a circuit breaker,
per request the load lifecycle and whether a failure is retried. :mod:`.proxy` holds them.

Load lifecycle of one proxied request (the exact accounting)::

    reserved (route) --first byte of the answer--> decoding --end--> released
          \\____________________ fail / disconnect / retry ____________/

``route`` reserves ``prefill + decode`` blocks; the first token drops the prefill share
(the prompt is computed); the end releases the rest and teaches the decode model the output
length. Every step is idempotent, and ``end`` is reached on every path (the I/O layer calls
it from ``finally``), so no reservation outlives its request.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Breaker", "Lifecycle", "Outcome", "Phase", "should_retry"]


class Phase(Enum):
    RESERVED = "reserved"
    DECODING = "decoding"
    RELEASED = "released"


class Lifecycle:
    """One request's reservation: ``first_token`` and ``end`` say what to do to the load,
    at most once each, whatever order the I/O layer reports them in."""

    __slots__ = ("phase", "prefill", "request_id")

    def __init__(self, request_id: str, prefill: float) -> None:
        self.request_id = request_id
        self.prefill = prefill
        self.phase = Phase.RESERVED

    def first_token(self) -> float:
        """The prefill share to drop now (0.0 after the first call or after the end)."""
        if self.phase is not Phase.RESERVED:
            return 0.0
        self.phase = Phase.DECODING
        return self.prefill

    def end(self) -> bool:
        """True exactly once: the caller releases the reservation then."""
        if self.phase is Phase.RELEASED:
            return False
        self.phase = Phase.RELEASED
        return True


class Outcome(Enum):
    """How an attempt at an engine went, as far as retrying cares."""

    OK = "ok"  # an answer (any status below 500) or a stream that started
    REFUSED = "refused"  # connect error
    SERVER_ERROR = "server_error"  # 5xx before the client saw a byte
    TIMEOUT = "timeout"  # no first byte in time
    CLIENT_GONE = "client_gone"
    NOT_HERE = "not_here"  # 404 from an engine asked whether it holds a stored response
    ABANDONED = "abandoned"  # a pair's decode side ended because its prefill side failed


def should_retry(outcome: Outcome, attempt: int, retries: int, sent_to_client: bool) -> bool:
    """Retry on the next-best engine: only failures of the engine, only before the client
    got a byte (after that the answer is committed), at most ``retries`` times."""
    return (outcome in (Outcome.REFUSED, Outcome.SERVER_ERROR, Outcome.TIMEOUT)
            and not sent_to_client and attempt < retries)


def marks_down(outcome: Outcome) -> bool:
    """Whether an attempt's outcome opens the engine's breaker."""
    return outcome in (Outcome.REFUSED, Outcome.SERVER_ERROR, Outcome.TIMEOUT)


@dataclass
class Breaker:
    """An engine's circuit breaker. A failed request or probe marks the engine down for
    ``cooloff`` seconds; after that, the next successful health probe brings it back (a
    request never tests a down engine). ``now`` comes from the caller's clock."""

    cooloff: float = 5.0
    down_until: float | None = None  # None: up
    opened: int = 0  # times it went down
    failures: int = 0  # failed requests and probes

    @property
    def up(self) -> bool:
        return self.down_until is None

    def failure(self, now: float) -> None:
        self.failures += 1
        if self.down_until is None:
            self.opened += 1
        self.down_until = max(self.down_until or 0.0, now + self.cooloff)

    def probe(self, ok: bool, now: float) -> None:
        """A health probe's result: a failure marks down (or extends it); a success brings
        a down engine back once its cool-off is over."""
        if not ok:
            self.failure(now)
        elif self.down_until is not None and now >= self.down_until:
            self.down_until = None
