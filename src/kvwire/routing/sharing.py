"""Router replicas that share their load (``kvwire serve --nats``, on by default): the pure
half (reports in, reservations out; reports out of what this replica did). The NATS I/O is
:mod:`kvwire.nats.load_channel`.

Replicas behind one load balancer read the same events, so they hold the same index, but
each sees only the requests it routed: with four replicas each routes on a quarter of the
fleet's load, and the balance the policy keeps is gone (the simulator at 3x the bundled
trace's rate: TTFT p99 2.80 s with one router, 3.75 s with four that do not share; at 4x
4.41 s and 7.64 s; docs/benchmarks.md). So each replica tells the others what it reserves,
what reached its first token and what it released, over core NATS (not JetStream: load is
of the moment, nothing to keep), and each keeps every replica's reservations in its own
:class:`~kvwire.routing.load.LoadTracker`: the load it routes on is the fleet's, and the
prefill rate it learns comes from every replica's first tokens. The same reports carry the
index's predictions (a prompt counted as held by the engine it went to, until that engine's
events store it) and the ``/release``s that reached a replica other than the one that
routed the request.

:class:`PeerLoads` (reports in, reservations out, no I/O): a peer's reservation ids are
prefixed with its name; a heartbeat carries the peer's live reservations whole, so whatever a
lost message left wrong (a reservation missing, one released, a first token) is put right at
the next heartbeat; a peer silent for ``ttl`` (stopped, killed, cut off) has all its
reservations dropped. :class:`Outbox` (this replica's operations as reports, no I/O): a
bounded queue the request path appends to (drops counted by the caller), cut into reports
of at most ``MAX_OPS`` operations, a heartbeat with this replica's live reservations.
:class:`~kvwire.nats.load_channel.LoadShare` is the thin I/O part: a thread with its own
event loop and NATS connection, which sends what the request path queued (never waiting on
the network) and applies what the others send under the router's lock.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import msgspec

from .load import LoadTracker

__all__ = ["MAX_KEY_BYTES", "MAX_OPS", "PREDICTION_BACKLOG", "Outbox", "PeerLoads", "Report",
           "decode_report", "encode_report"]


class Report(msgspec.Struct, array_like=True):
    """One message from a replica: its name, a sequence number (gaps are counted: core NATS
    may drop), its operations in order, and, on a heartbeat, its live reservations:
    ``{id: [engine, amount, prefill]}`` as they stand after those operations.

    Operations: ``["r", id, engine, amount, prefill]`` reserved; ``["f", id]`` first token
    (the prefill share dropped); ``["x", id, output_tokens | None]`` released; ``["q", id,
    owner, output_tokens | None]``: a ``/release`` that reached this replica for a request
    ``owner`` routed, asked of it (the decision API behind a load balancer); ``["p", stream,
    keys]``: a prompt predicted on ``stream`` (its blocks' own keys, 8 bytes each), held there
    until events confirm it."""

    replica: str
    seq: int
    ops: list[list[Any]]
    live: dict[str, list[Any]] | None = None


#: Operations in one report at most (about 60 bytes each: well under NATS's 1 MB payload)
MAX_OPS = 4096
#: Predicted keys' bytes in one report at most (a prediction is up to 32 KB)
MAX_KEY_BYTES = 256 * 1024
#: Queued operations past which predictions are dropped (bounds their memory to 32 MB)
PREDICTION_BACKLOG = 1000

#: A report's bytes on the wire (msgpack), and back (msgspec.DecodeError if malformed).
decode_report = msgspec.msgpack.Decoder(Report).decode
encode_report = msgspec.msgpack.Encoder().encode


class _Peer:
    __slots__ = ("seen", "seq", "ids", "asked")

    def __init__(self, now: float) -> None:
        self.seen = now
        self.seq = -1
        self.ids: set[str] = set()  # reservations held for it (its ids, unprefixed)
        self.asked: dict[str, int | None] = {}  # releases asked of it: id -> output tokens


class PeerLoads:
    """Other replicas' reservations, applied to ``loads`` (the caller holds whatever lock
    guards it). ``on_output(tokens)``: a peer's request ended with that many output tokens
    (teaches the expected decode work, as the replica's own releases do).
    ``on_release(id, output_tokens)``: a peer asks this replica to release one of its own
    reservations (a ``/release`` that reached the peer); True if it was held.
    ``on_predict(stream, keys)``: a peer predicted a prompt on ``stream``; True if taken.

    A release asked of a peer is kept until the peer's release of it arrives, and asked again
    at each of the peer's heartbeats that still lists the reservation (the ask was lost)."""

    def __init__(self, loads: LoadTracker, me: str, ttl: float = 2.0,
                 on_output: Callable[[int], None] | None = None,
                 on_release: Callable[[str, int | None], bool] | None = None,
                 on_predict: Callable[[str, bytes], bool] | None = None) -> None:
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0, got {ttl!r}")
        self.loads, self.me, self.ttl, self.on_output = loads, me, float(ttl), on_output
        self.on_release, self.on_predict = on_release, on_predict
        self.peers: dict[str, _Peer] = {}
        self.counts = {"reports": 0, "ops": 0, "gaps": 0, "bad": 0, "dropped_by_heartbeat": 0,
                       "corrected_by_heartbeat": 0, "peers_expired": 0, "releases_asked": 0,
                       "releases_asked_again": 0, "releases_answered": 0,
                       "releases_not_held": 0, "predictions": 0}

    def owner(self, rid: str) -> str | None:
        """The peer whose reservation ``rid`` is (as heard so far), if any."""
        for name, p in self.peers.items():
            if rid in p.ids:
                return name
        return None

    def ask_release(self, owner: str, rid: str, output_tokens: int | None) -> list[Any]:
        """The operation that asks ``owner`` to release its reservation ``rid``; remembered,
        so that a lost ask is asked again at the owner's next heartbeat."""
        self.peers[owner].asked[rid] = output_tokens
        self.counts["releases_asked"] += 1
        return ["q", rid, owner, output_tokens]

    def receive(self, report: Report, now: float) -> list[list[Any]]:
        """Apply one report (one's own is ignored). A malformed operation is counted and
        skipped; the rest of the report still applies. Returns the operations to send in
        answer: releases asked of this peer again (a heartbeat still lists them)."""
        if report.replica == self.me:
            return []
        peer = self.peers.get(report.replica)
        if peer is None:
            peer = self.peers[report.replica] = _Peer(now)
        self.counts["reports"] += 1
        if peer.seq >= 0 and report.seq != peer.seq + 1 and report.seq > peer.seq:
            self.counts["gaps"] += 1
        peer.seq = max(peer.seq, report.seq)
        peer.seen = now
        prefix = report.replica + ":"
        for op in report.ops:
            try:
                self._apply(peer, prefix, op, now)
            except (ValueError, TypeError, IndexError, KeyError):
                self.counts["bad"] += 1
        if report.live is None:
            return []
        self._settle(peer, prefix, report.live, now)
        again = []
        for rid in list(peer.asked):
            if rid in report.live:
                again.append(["q", rid, report.replica, peer.asked[rid]])
                self.counts["releases_asked_again"] += 1
            else:
                del peer.asked[rid]  # (released, or expired there)
        return again

    def _settle(self, peer: _Peer, prefix: str, live: dict[str, list[Any]],
                now: float) -> None:
        """A heartbeat: what the peer holds, whole. Held here and not there: released (its
        release was lost); there and not here, or held otherwise (a reservation or a first
        token whose message was lost): reserved as it stands there."""
        for rid in [r for r in peer.ids if r not in live]:
            peer.ids.discard(rid)
            if self._drop(prefix + rid, now):
                self.counts["dropped_by_heartbeat"] += 1
        loads = self.loads
        for rid, entry in live.items():
            pid = prefix + rid
            try:
                engine, amount, prefill = entry[0], float(entry[1]), float(entry[2])
                if (rid in peer.ids and loads.holder(pid) == engine
                        and abs((loads.amount(pid) or 0.0) - amount) <= 1e-9
                        and abs(loads.prefill(pid) - prefill) <= 1e-9):
                    continue  # (as it stands here: the usual case)
                self._apply(peer, prefix, ["r", rid, engine, amount, prefill], now)
                self.counts["corrected_by_heartbeat"] += 1
            except (ValueError, TypeError, IndexError):
                self.counts["bad"] += 1

    def _apply(self, peer: _Peer, prefix: str, op: list[Any], now: float) -> None:
        kind, rid = op[0], op[1]
        if not isinstance(rid, str):
            raise TypeError("id")
        if kind == "r":
            engine, amount, prefill = op[2], float(op[3]), float(op[4])
            if not isinstance(engine, str):
                raise TypeError("engine")
            self.loads.reserve(prefix + rid, engine, amount, now, prefill=prefill)
            peer.ids.add(rid)
        elif kind == "f":  # its prefill is done: only the decode share stays
            pid = prefix + rid
            prefill = self.loads.prefill(pid)
            if prefill > 0:
                self.loads.reduce(pid, prefill, now)
        elif kind == "x":
            peer.ids.discard(rid)
            peer.asked.pop(rid, None)
            if self._drop(prefix + rid, now):
                out = op[2] if len(op) > 2 else None
                if isinstance(out, int) and out >= 0 and self.on_output is not None:
                    self.on_output(out)
        elif kind == "p":
            keys = op[2]
            if not isinstance(keys, bytes) or len(keys) % 8:
                raise TypeError("keys")
            if self.on_predict is not None and self.on_predict(rid, keys):
                self.counts["predictions"] += 1
        elif kind == "q":
            if op[2] == self.me and self.on_release is not None:
                out = op[3] if len(op) > 3 else None
                out = out if isinstance(out, int) and out >= 0 else None
                held = self.on_release(rid, out)
                self.counts["releases_answered" if held else "releases_not_held"] += 1
        else:
            raise ValueError(f"unknown operation {kind!r}")
        self.counts["ops"] += 1

    def expire(self, now: float) -> list[str]:
        """Drop every reservation of the peers silent for ``ttl``; their names."""
        gone = [name for name, p in self.peers.items() if now - p.seen > self.ttl]
        for name in gone:
            peer = self.peers.pop(name)
            for rid in peer.ids:
                self._drop(f"{name}:{rid}", now)
            self.counts["peers_expired"] += 1
        return gone

    def _drop(self, pid: str, now: float) -> bool:
        # (asked first: a reservation that expired here is not an unknown release)
        return self.loads.holder(pid) is not None and self.loads.release(pid, now)

    def held(self) -> int:
        """Reservations held for peers now."""
        return sum(len(p.ids) for p in self.peers.values())


class Outbox:
    """This replica's operations for the others, as reports (no I/O, no clock of its own):
    :meth:`put` on the request path, :meth:`report` in the sending thread. ``live``: own
    reservations as sent (id -> [engine, amount, prefill, when]), which a heartbeat carries
    whole (those older than the load tracker's ``expiry_s`` left out: expired here)."""

    def __init__(self, replica: str, max_queue: int = 100_000) -> None:
        self.replica = replica
        self.max_queue = max_queue
        self.ops: collections.deque[list[Any]] = collections.deque()
        self.live: dict[str, list[Any]] = {}
        self.seq = 0

    def put(self, op: list[Any]) -> bool:
        """Queue one operation (any thread; never waits); False if it was dropped: the queue
        is full (the connection down for long: the next heartbeat corrects it), or it is a
        prediction and a backlog has formed (``PREDICTION_BACKLOG``: a prediction is of the
        moment, and up to 32 KB)."""
        n = len(self.ops)
        if n >= self.max_queue or (n >= PREDICTION_BACKLOG and op[0] == "p"):
            return False
        self.ops.append(op)
        return True

    def __len__(self) -> int:
        return len(self.ops)

    def report(self, beat: bool, now: float, expiry_s: float) -> Report:
        """What is queued, as one report (at most ``MAX_OPS`` operations and about
        ``MAX_KEY_BYTES`` of predicted keys); with ``beat``, this replica's live reservations
        too (own ones older than ``expiry_s``, expired here, left out)."""
        ops = []
        out, live = self.ops, self.live
        key_bytes = 0
        while out and len(ops) < MAX_OPS and key_bytes < MAX_KEY_BYTES:
            op = out.popleft()
            ops.append(op)
            kind = op[0]
            if kind == "p":
                key_bytes += len(op[2])
            elif kind == "r":
                live[op[1]] = [op[2], op[3], op[4], now]
            elif kind == "f" and (e := live.get(op[1])) is not None:
                e[1], e[2] = max(e[1] - e[2], 0.0), 0.0
            elif kind == "x":
                live.pop(op[1], None)
        if beat:
            old = now - expiry_s
            for rid in [r for r, e in live.items() if e[3] < old]:
                del live[rid]
        self.seq += 1
        whole = {r: e[:3] for r, e in live.items()} if beat else None
        return Report(self.replica, self.seq, ops, whole)
