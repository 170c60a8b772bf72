"""Load reserved per engine by routed requests (pure, I/O-free: the caller serialises access
and gives the clock), and the prefill each engine has likely worked off since."""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable

__all__ = ["LoadTracker"]


class LoadTracker:
    """Load reserved per engine by routed requests, until released or expired.

    ``reserve`` on route, ``release`` on completion; a reservation whose release never comes
    (a crashed client) expires after ``expiry_s`` so load cannot leak forever. Not thread-safe:
    the caller serialises access (the service holds a lock)."""

    def __init__(self, expiry_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic,
                 busy_window: float = 600.0, drain: bool = True) -> None:
        if not math.isfinite(expiry_s) or expiry_s <= 0:
            raise ValueError(f"expiry_s must be > 0, got {expiry_s!r}")
        if not busy_window > 0:
            raise ValueError(f"busy_window must be > 0, got {busy_window!r}")
        self.expiry_s = float(expiry_s)
        self.clock = clock
        self.busy_window = float(busy_window)
        self.drain = bool(drain)
        self._busy: dict[str, tuple[float, float]] = {}  # name -> (decayed busy s, as of)
        # id -> (name, amount, deadline, prefill still outstanding)
        self._by_id: dict[str, tuple[str, float, float, float]] = {}
        self._drain: dict[str, _Drain] = {}  # name -> its prefill backlog and learned rate
        self._load: dict[str, float] = {}
        self._count: dict[str, int] = {}  # live reservations per engine (clears float residue)
        self._heap: list[tuple[float, str]] = []  # (deadline, id); stale entries skipped
        self.reserved = 0
        self.released = 0
        self.expired = 0
        self.unknown_releases = 0

    def reserve(self, request_id: str, name: str, amount: float,
                now: float | None = None, prefill: float = 0.0) -> None:
        """Add ``amount`` to ``name``'s load until ``release(request_id)`` or expiry.
        ``prefill`` (<= amount): the part of it that is prompt still to compute, which
        :meth:`reduce` at the first token ends; the engine works it off meanwhile (see
        :meth:`load`). Reserving an id again replaces its previous reservation."""
        if not math.isfinite(amount) or amount < 0:
            raise ValueError(f"load amount must be a finite number >= 0, got {amount!r}")
        if not (math.isfinite(prefill) and 0 <= prefill):
            raise ValueError(f"prefill must be a finite number >= 0, got {prefill!r}")
        now = self.clock() if now is None else now
        self.expire(now)
        if request_id in self._by_id:
            self._drop(request_id, now)
        deadline = now + self.expiry_s
        prefill = min(float(prefill), float(amount))
        self._by_id[request_id] = (name, float(amount), deadline, prefill)
        if prefill > 0:
            d = self._drain.get(name)
            if d is None:
                d = self._drain[name] = _Drain()
            d.add(prefill, now)
        self._load[name] = self._load.get(name, 0.0) + amount
        self._count[name] = self._count.get(name, 0) + 1
        if self._count[name] == 1:  # idle until now: busy from now on
            self._busy[name] = (self._busy_at(name, now, False), now)
        heapq.heappush(self._heap, (deadline, request_id))
        self.reserved += 1

    def release(self, request_id: str, now: float | None = None) -> bool:
        """Remove a reservation; False (and counted) if the id is unknown or already gone."""
        if request_id not in self._by_id:
            self.unknown_releases += 1
            return False
        self._drop(request_id, self.clock() if now is None else now)
        self.released += 1
        return True

    def reduce(self, request_id: str, amount: float, now: float | None = None) -> float:
        """Lower a live reservation by up to ``amount`` (a proxied request's prefill share,
        dropped at its first token); returns what was taken off (0.0 if the id is gone).
        The prefill reserved with it is done: it teaches the engine's prefill rate."""
        entry = self._by_id.get(request_id)
        if entry is None or not amount > 0:
            return 0.0
        name, held, deadline, prefill = entry
        take = min(float(amount), held)
        self._by_id[request_id] = (name, held - take, deadline, 0.0)
        self._load[name] = max(self._load[name] - take, 0.0)
        if prefill > 0:
            self._drain[name].done(prefill, self.clock() if now is None else now,
                                   self.busy_window, learn=True)
        return take

    def resize(self, request_id: str, amount: float, prefill: float,
               now: float | None = None) -> bool:
        """Set a live reservation's amount and, while its first token has not come, its
        prefill share (a prompt routed on an estimate of its length, now known); False
        (nothing changed) if the id is gone or its first token came."""
        entry = self._by_id.get(request_id)
        if entry is None or entry[3] <= 0:
            return False
        if not (math.isfinite(amount) and amount >= 0 and math.isfinite(prefill)
                and prefill >= 0):
            raise ValueError(f"load amount and prefill must be finite numbers >= 0, got "
                             f"{amount!r} and {prefill!r}")
        name, held, deadline, old = entry
        now = self.clock() if now is None else now
        prefill = min(float(prefill), float(amount))
        d = self._drain[name]
        left = d.backlog(now)
        d.outstanding = max(d.outstanding + prefill - old, 0.0)
        d.left = min(max(left + prefill - old, 0.0), d.outstanding)
        d.at = now
        self._by_id[request_id] = (name, float(amount), deadline, prefill)
        self._load[name] = max(self._load[name] + amount - held, 0.0)
        return True

    def prefill(self, request_id: str) -> float:
        """A live reservation's prefill still outstanding (0.0 after its first token, or
        if the id is gone)."""
        entry = self._by_id.get(request_id)
        return entry[3] if entry else 0.0

    def amount(self, request_id: str) -> float | None:
        """A live reservation's current amount, or None."""
        entry = self._by_id.get(request_id)
        return entry[1] if entry else None

    def expire(self, now: float | None = None) -> int:
        """Drop reservations whose deadline has passed; returns how many."""
        now = self.clock() if now is None else now
        n = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, rid = heapq.heappop(heap)
            entry = self._by_id.get(rid)
            if entry is not None and entry[2] == deadline:
                self._drop(rid, now)
                n += 1
        self.expired += n
        if len(heap) > 2 * len(self._by_id) + 64:  # stale entries from releases: compact
            self._heap = [(d, r) for r, (_, _, d, _) in self._by_id.items()]
            heapq.heapify(self._heap)
        return n

    def _drop(self, request_id: str, now: float) -> None:
        name, amount, _, prefill = self._by_id.pop(request_id)
        if prefill > 0:  # ended before its first token (failed, abandoned): not learned from
            self._drain[name].done(prefill, now, self.busy_window, learn=False)
        count = self._count[name] - 1
        if count == 0:  # exact zero, no float residue from += / -=
            self._busy[name] = (self._busy_at(name, now, True), now)
            del self._count[name]
            self._load.pop(name, None)
        else:
            self._count[name] = count
            self._load[name] = max(self._load[name] - amount, 0.0)

    def load(self, name: str, now: float | None = None) -> float:
        """``name``'s reserved load (0.0 if none), less the prefill it has likely worked
        off since: reserved prompts not yet at their first token drain as one queue at the
        engine's prefill rate, learned from the first tokens it delivered (blocks of
        prefill done / seconds it had prefill outstanding). Reserved load alone keeps a
        long prompt's whole prefill on its engine until the first token, seconds after
        most of it is done, which sent new prompts past engines about to be free. Until a
        first token has taught a rate (or with ``drain=False``) this is the reserved load."""
        held = self._load.get(name, 0.0)
        d = self._drain.get(name) if self.drain else None
        if d is None or d.outstanding <= 0 or d.rate <= 0:
            return held
        drained = d.outstanding - d.backlog(self.clock() if now is None else now)
        return max(held - drained, 0.0) if drained > 0 else held

    def prefill_rate(self, name: str) -> float:
        """The prefill rate learned for ``name`` (blocks of load per second; 0.0 if none)."""
        d = self._drain.get(name)
        return d.rate if d is not None else 0.0

    def busy(self, name: str, now: float | None = None) -> float:
        """Seconds ``name`` has had at least one reservation lately: the time it held
        requests, each second weighted exp(-age / busy_window), so an engine that joined
        late or sat idle is not made to catch up a whole history. The routers see when a
        request starts and ends, not what it costs: time held is the work an engine did
        whatever its cost model (prefill, decode steps, batching)."""
        return self._busy_at(name, self.clock() if now is None else now, name in self._count)

    def _busy_at(self, name: str, now: float, busy: bool) -> float:
        b = self._busy.get(name)
        if b is None:
            return 0.0
        age = now - b[1]
        if age <= 0:
            return b[0]
        k = math.exp(-age / self.busy_window)
        return b[0] * k + (self.busy_window * (1.0 - k) if busy else 0.0)

    def loads(self) -> dict[str, float]:
        """Every engine's current reserved load."""
        return dict(self._load)

    def holder(self, request_id: str) -> str | None:
        """The engine a live reservation is on, or None."""
        entry = self._by_id.get(request_id)
        return entry[0] if entry else None

    def __len__(self) -> int:
        return len(self._by_id)


class _Drain:
    """One engine's outstanding prefill seen as one queue the engine works off.

    ``outstanding``: prefill reserved and not yet at its first token (exact, from the
    reservations); ``backlog(now)``: what of it is likely left, draining at ``rate``
    since the last change and never above ``outstanding``. ``rate``: prefill done /
    seconds with prefill outstanding, both decayed exp(-age / window); 0 until a first
    token (then the backlog does not drain)."""

    __slots__ = ("outstanding", "left", "at", "n", "since", "done_blocks", "busy_s", "rate")

    def __init__(self) -> None:
        self.outstanding = 0.0
        self.left = 0.0  # the backlog as of ``at``
        self.at = 0.0
        self.n = 0  # reservations with prefill outstanding (ends float residue at 0)
        self.since = 0.0  # when outstanding last became > 0, or the last learn
        self.done_blocks = 0.0
        self.busy_s = 0.0
        self.rate = 0.0

    def backlog(self, now: float) -> float:
        left = self.left - self.rate * (now - self.at) if now > self.at else self.left
        return min(max(left, 0.0), self.outstanding)

    def add(self, prefill: float, now: float) -> None:
        self.left = self.backlog(now) + prefill
        self.at = now
        if self.n == 0:
            self.since = now
        self.n += 1
        self.outstanding += prefill

    def done(self, prefill: float, now: float, window: float, learn: bool) -> None:
        left = self.backlog(now)  # drained at the rate known until now
        if learn and now > self.since:
            k = math.exp(-(now - self.since) / window)
            self.busy_s = self.busy_s * k + (now - self.since)
            self.done_blocks = self.done_blocks * k + prefill
            self.since = now
            self.rate = self.done_blocks / self.busy_s
        self.n -= 1
        self.outstanding = self.outstanding - prefill if self.n else 0.0
        self.left = min(left, self.outstanding)
        self.at = now
