"""Pipelined, checked JetStream publishing for the bridge: one :class:`Lane` per subject.

Publishes go out as core NATS messages with a reply inbox (one wildcard subscription
collects every PubAck), so the bridge never waits a round trip per batch; at most
``max_inflight`` are unacknowledged at once. A lane applies what JetStream acknowledged,
in subject order, to its :class:`~kvwire.consume.cache.BlockCache` (the state its
object-store snapshots are taken from, with the PubAck's stream sequence).

When an ack fails or times out (server restarted, JetStream not ready yet), the lane
*recovers*: it holds new items, lets what is in flight settle, reads the subject's last
message and re-sends, in order and with the same ``Nats-Msg-Id``, exactly what came after
it. Messages of one connection arrive in order, so what the server stored is a prefix of
what was sent, except when it refused one (e.g. 503 while JetStream starts) and took a
later one: that hole cannot be filled in order, so the lane writes a reset marker and a
snapshot marker of its whole state instead (consumers resync from the subject itself).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import msgspec

from ..consume.cache import BlockCache, chain_events
from ..wire.events import BlockStored, KVEventBatch
from .subjects import (
    H_CHUNK,
    H_EPOCH,
    H_FIRST_SEQ,
    H_KIND,
    H_MSG_ID,
    H_REASON,
    H_SEQ,
    msg_id,
    run_msg_id,
)

__all__ = ["H_EXACT", "Entry", "JsWriter", "Lane", "WriterStats", "apply_entry_effect",
           "marker_entries", "pack_body"]

log = logging.getLogger("kvwire.nats.writer")

#: On inexact snapshot markers only ("0"): the Subscriber's Snapshot had exact=False.
H_EXACT = "Kvwire-Exact"

PENDING, ACKED, FAILED = 0, 1, 2
_CHUNK_SLACK = 4096  # headers and protocol overhead under the server's max payload


class _PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: dict[str, Any] | None = None


_ack_decoder = msgspec.json.Decoder(_PubAck)
_event_list = msgspec.msgpack.Encoder()


def pack_body(payloads: list[bytes]) -> bytes:
    """A ``batches`` body: a msgpack array of the encoded batches (header + concatenation)."""
    n = len(payloads)
    head = bytes((0x90 | n,)) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
    return head + b"".join(payloads)


class Entry:
    """One message for a lane: a batch, a run of batches (``batches``), a reset marker or one
    snapshot marker chunk. ``seq`` is the last seq it covers, ``first`` the first."""

    __slots__ = ("lane", "kind", "epoch", "seq", "first", "msg_id", "headers", "payload",
                 "effect", "exact", "state", "js_seq", "sent_at", "token", "error", "oversize")

    def __init__(self, lane: Lane, kind: str, epoch: int, seq: int, mid: str,
                 headers: dict[str, str] | None, payload: bytes, effect: Any,
                 exact: bool = True) -> None:
        self.lane, self.kind, self.epoch, self.seq = lane, kind, epoch, seq
        self.first = seq
        self.msg_id, self.headers, self.payload, self.effect = mid, headers, payload, effect
        self.exact = exact
        self.state = PENDING
        self.js_seq: int | None = None
        self.sent_at = 0.0
        self.token = ""
        self.error = ""
        self.oversize = False

    def raw_headers(self) -> bytes:
        """The NATS/1.0 header block (values are one line: see :func:`_header_text`)."""
        if self.kind == "batch":
            return _BATCH_HDR % (self.epoch, self.seq, self.msg_id.encode())
        if self.kind == "batches":
            return _RUN_HDR % (self.epoch, self.first, self.seq, self.msg_id.encode())
        return b"NATS/1.0\r\n" + b"".join(
            b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in self.header_dict().items()
        ) + b"\r\n"

    def header_dict(self) -> dict[str, str]:
        if self.headers is None:  # a batch or a run: its headers are made when needed
            self.headers = {H_KIND: self.kind, H_EPOCH: str(self.epoch), H_SEQ: str(self.seq),
                            H_MSG_ID: self.msg_id}
            if self.kind == "batches":
                self.headers[H_FIRST_SEQ] = str(self.first)
        return self.headers


_BATCH_HDR = (f"NATS/1.0\r\n{H_KIND}: batch\r\n{H_EPOCH}: %d\r\n{H_SEQ}: %d\r\n"
              f"{H_MSG_ID}: %s\r\n\r\n").encode()
_RUN_HDR = (f"NATS/1.0\r\n{H_KIND}: batches\r\n{H_EPOCH}: %d\r\n{H_FIRST_SEQ}: %d\r\n"
            f"{H_SEQ}: %d\r\n{H_MSG_ID}: %s\r\n\r\n").encode()


def apply_entry_effect(cache: BlockCache, kind: str, effect: Any) -> None:
    """What a message does to the subject's state: batch applies, reset clears, a snapshot
    chunk stores its blocks (after the reset that precedes it)."""
    if kind == "batch":
        cache.apply(effect)
    elif kind == "batches":
        for b in effect:
            cache.apply(b)
    elif kind == "reset":
        cache.clear()
    elif effect:
        cache.apply_events(effect)


class Lane:
    """One subject: what is in flight (send order), what waits, and the acked state."""

    def __init__(self, subject: str, engine: str, rank: int) -> None:
        self.subject, self.engine, self.rank = subject, engine, rank
        self.subject_b = subject.encode()
        self.pending: deque[Entry] = deque()
        self.held: deque[Entry] = deque()
        self.recovering = False
        self.cut = False  # the connection broke with messages of this lane in flight
        self.cache = BlockCache()
        self.exact = True
        self.last: tuple[int, int] | None = None  # (epoch, seq) of the last acked message
        self.last_js_seq: int | None = None
        self.dirty = False  # acked messages since the last object-store snapshot
        self.snapshot_js_seq: int | None = None  # js_seq of the last snapshot written

    def batch_entry(self, epoch: int, seq: int, batch: KVEventBatch, payload: bytes) -> Entry:
        return Entry(self, "batch", epoch, seq, f"{self.engine}/{self.rank}/{epoch}/{seq}",
                     None, payload, batch)

    def run_entry(self, epoch: int, first: int, batches: list[KVEventBatch],
                  payloads: list[bytes]) -> Entry:
        """Consecutive batches ``first..`` of one epoch as one message (one: a ``batch``)."""
        if len(batches) == 1:
            return self.batch_entry(epoch, first, batches[0], payloads[0])
        last = first + len(batches) - 1
        e = Entry(self, "batches", epoch, last,
                  run_msg_id(self.engine, self.rank, epoch, first, last), None,
                  pack_body(payloads), batches)
        e.first = first
        return e


def marker_entries(lane: Lane, epoch: int, seq: int, events: list[BlockStored], exact: bool,
                   reason: str, max_payload: int) -> list[Entry]:
    """A reset marker and the snapshot marker chunks of state ``events`` at ``(epoch, seq)``."""
    mid = msg_id(lane.engine, lane.rank, epoch, seq, "reset")
    base = {H_EPOCH: str(epoch), H_SEQ: str(seq)}
    out = [Entry(lane, "reset", epoch, seq, mid,
                 {H_KIND: "reset", **base, H_REASON: _header_text(reason), H_MSG_ID: mid},
                 b"", None, exact)]
    chunks = _chunks(events, max(1024, max_payload - _CHUNK_SLACK))
    for i, (evs, body) in enumerate(chunks):
        cid = msg_id(lane.engine, lane.rank, epoch, seq, "snapshot", i)
        h = {H_KIND: "snapshot", **base, H_CHUNK: f"{i}/{len(chunks)}", H_MSG_ID: cid}
        if not exact:
            h[H_EXACT] = "0"
        out.append(Entry(lane, "snapshot", epoch, seq, cid, h, body, evs, exact))
    return out


def _header_text(text: str) -> str:
    return " ".join(text.split())[:400]  # one line: a header value cannot hold CR/LF


def _chunks(events: list[BlockStored], limit: int) -> list[tuple[list[BlockStored], bytes]]:
    """Events cut into msgpack lists of at most ``limit`` bytes (an event too big alone is
    split into sub-chains); always at least one chunk (an empty state is ``[]``)."""
    enc = _event_list.encode
    out: list[tuple[list[BlockStored], bytes]] = []
    cur: list[BlockStored] = []
    size = 1
    todo = list(reversed(events))
    while todo:
        ev = todo.pop()
        n = len(enc(ev))
        if n + 8 > limit and len(ev.block_hashes) > 1:
            half = len(ev.block_hashes) // 2
            bs = ev.block_size
            a = msgspec.structs.replace(ev, block_hashes=ev.block_hashes[:half],
                                        token_ids=ev.token_ids[:half * bs], extra_keys=None,
                                        lookahead_token_ids=None)
            b = msgspec.structs.replace(ev, block_hashes=ev.block_hashes[half:],
                                        parent_block_hash=ev.block_hashes[half - 1],
                                        token_ids=ev.token_ids[half * bs:], extra_keys=None,
                                        lookahead_token_ids=None)
            todo += [b, a]
            continue
        if cur and size + n + 8 > limit:
            out.append((cur, enc(cur)))
            cur, size = [], 1
        cur.append(ev)
        size += n
    out.append((cur, enc(cur)))
    return out


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
    last_error: str | None = None


class JsWriter:
    """Sends :class:`Entry` objects on lanes, checks their acks, recovers lanes."""

    def __init__(self, nc: Any, js: Any, stream: str, *, max_inflight: int = 4096,
                 ack_timeout: float = 5.0) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if not ack_timeout > 0:
            raise ValueError(f"ack_timeout must be > 0 seconds, got {ack_timeout!r}")
        self.nc, self.js, self.stream = nc, js, stream
        self.max_inflight, self.ack_timeout = max_inflight, ack_timeout
        self.stats = WriterStats()
        self.max_payload = 1 << 20
        self._inflight: dict[str, Entry] = {}
        self._room = asyncio.Event()
        self._n = 0
        self._inbox = ""
        self._sub: Any = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._watch_task: asyncio.Task[None] | None = None
        self._fast = all(hasattr(nc, a) for a in ("_send_command", "_flush_queue",
                                                   "_flush_pending"))
        self.lanes: dict[str, Lane] = {}
        self.closing = False

    def lane(self, engine: str, rank: int, subject: str) -> Lane:
        """The lane of ``subject`` (made on first use; kept while the writer lives)."""
        ln = self.lanes.get(subject)
        if ln is None:
            ln = self.lanes[subject] = Lane(subject, engine, rank)
        return ln

    async def start(self) -> None:
        self.max_payload = int(getattr(self.nc, "max_payload", 1 << 20) or 1 << 20)
        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(self._inbox + ".*", cb=self._on_ack)
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    async def submit(self, entry: Entry) -> None:
        """Queue ``entry`` on its lane; waits while ``max_inflight`` are unacknowledged."""
        lane = entry.lane
        while lane.recovering and len(lane.held) >= 4 * self.max_inflight and not self.closing:
            await asyncio.sleep(0.05)  # bounded while NATS is away: back-pressure upstream
        if lane.recovering or lane.held:
            lane.held.append(entry)
            return
        await self._send(entry)

    async def _send(self, e: Entry) -> None:
        while len(self._inflight) >= self.max_inflight:
            self._room.clear()
            try:
                await asyncio.wait_for(self._room.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        self._n += 1
        e.token = tok = str(self._n)
        e.state, e.js_seq, e.sent_at = PENDING, None, time.monotonic()
        self._inflight[tok] = e
        e.lane.pending.append(e)
        self.stats.sent += 1
        self.stats.bytes += len(e.payload)
        nc = self.nc
        if len(e.payload) + 1024 > self.max_payload:
            # The server would drop the connection; cannot go out as one message.
            e.oversize = True
            self._fail(e, f"{e.msg_id}: {len(e.payload)} bytes, over the server's max "
                          f"payload {self.max_payload}")
            return
        try:
            if self._fast and nc.is_connected:
                await self._hpub(e, f"{self._inbox}.{tok}")
            else:
                await nc.publish(e.lane.subject, e.payload, reply=f"{self._inbox}.{tok}",
                                 headers=e.header_dict())
        except Exception as ex:  # not handed to the connection at all (closed, buffer full)
            self._fail(e, f"publish failed: {ex!r}")

    async def _hpub(self, e: Entry, reply: str) -> None:
        """The HPUB command built here in one go: nats-py's ``publish`` validates and
        encodes the header dict key by key (its cost was most of the bridge's per batch).
        Uses nats-py's command queue the way ``publish`` does."""
        hdr = e.raw_headers()
        p = e.payload
        nc = self.nc
        await nc._send_command(b"HPUB %s %s %d %d\r\n%s%s\r\n" % (
            e.lane.subject_b, reply.encode(), len(hdr), len(hdr) + len(p), hdr, p))
        if nc._flush_queue is not None and nc._flush_queue.empty():
            await nc._flush_pending()

    def _on_ack_sync(self, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        e = self._inflight.pop(subject[len(self._inbox) + 1:], None)
        if e is None:
            self.stats.stray_acks += 1  # late answer to a message a recovery re-sent
            return
        if len(self._inflight) < self.max_inflight:
            self._room.set()
        if headers and headers.get("Status"):
            self._fail(e, f"JetStream status {headers.get('Status')} "
                          f"{headers.get('Description', '')}".strip())
            return
        try:
            ack = _ack_decoder.decode(data)
        except msgspec.DecodeError:
            self._fail(e, f"unreadable PubAck {data[:80]!r}")
            return
        if ack.error is not None:
            self._fail(e, f"JetStream refused {e.msg_id}: {ack.error.get('description', ack.error)}")
            return
        e.state, e.js_seq = ACKED, ack.seq
        self.stats.acked += 1
        if ack.duplicate:
            self.stats.duplicates += 1
        lane = e.lane
        if lane.pending and lane.pending[0] is e:
            self._advance(lane)

    async def _on_ack(self, msg: Any) -> None:
        self._on_ack_sync(msg.subject, msg.data, msg.headers)

    def _advance(self, lane: Lane) -> None:
        """Apply acked messages at the head of the lane, in subject order."""
        pending = lane.pending
        while pending and pending[0].state == ACKED:
            self._commit(pending.popleft())

    def _commit(self, e: Entry) -> None:
        lane = e.lane
        apply_entry_effect(lane.cache, e.kind, e.effect)
        if e.kind == "snapshot":
            lane.exact = e.exact
        lane.last = (e.epoch, e.seq)
        lane.last_js_seq = e.js_seq  # None (ack lost): no object-store snapshot until known
        lane.dirty = True

    def _fail(self, e: Entry, why: str) -> None:
        e.state, e.error = FAILED, why
        self.stats.failed += 1
        self.stats.last_error = why
        self._recover(e.lane, why)

    def _recover(self, lane: Lane, why: str) -> None:
        if lane.recovering or self.closing:
            return
        lane.recovering = True
        self.stats.recoveries += 1
        log.warning("%s: recovering (%s)", lane.subject, why)
        t = asyncio.get_running_loop().create_task(self._recovery(lane))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def on_disconnect(self) -> None:
        """The connection broke: what the server got is a prefix of what was sent on it.

        Keep it a prefix: nats-py would send the publishes still queued in its buffer after
        the reconnect (ahead of anything a recovery decides), so they are dropped here (its
        private ``_pending`` list; one bytes command per publish), and every lane with
        messages in flight recovers (holding new ones) before anything else goes out."""
        pending = getattr(self.nc, "_pending", None)
        if isinstance(pending, list):
            keep = [c for c in pending if not (
                c[:5] == b"HPUB " and c[5:].split(b" ", 1)[0].decode() in self.lanes)]
            if len(keep) != len(pending):
                self.nc._pending = keep
                self.nc._pending_data_size = sum(len(c) for c in keep)
        for lane in self.lanes.values():
            lane.cut = True  # acks of what is in flight went with the connection
            if lane.pending or lane.held:
                self._recover(lane, "disconnected")

    async def _watch(self) -> None:
        """Ack time-outs: a lane whose oldest message waits too long recovers."""
        while not self.closing:
            await asyncio.sleep(min(0.25, self.ack_timeout / 4))
            now = time.monotonic()
            for lane in list(self.lanes.values()):
                if (not lane.recovering and lane.pending and lane.pending[0].state == PENDING
                        and now - lane.pending[0].sent_at > self.ack_timeout):
                    self.stats.timeouts += 1
                    self._recover(lane, f"no ack for {self.ack_timeout:g}s")

    async def _recovery(self, lane: Lane) -> None:
        try:
            await self._settle(lane)
            last = await self._last_id(lane.subject)
            self._resolve(lane, last)
            while lane.held and not self.closing:
                await self._send(lane.held.popleft())
        except asyncio.CancelledError:
            raise
        except Exception as ex:  # keep the lane recovering; the watch retries it
            self.stats.last_error = f"{lane.subject}: recovery failed: {ex!r}"
            log.warning("%s", self.stats.last_error)
            lane.recovering = False
            if lane.pending or lane.held:
                await asyncio.sleep(0.5)
                self._recover(lane, "retry after failed recovery")
            return
        lane.recovering = False

    async def _settle(self, lane: Lane) -> None:
        """Until every in-flight message of the lane is answered or timed out, connected."""
        while not self.closing:
            newest = max((e.sent_at for e in lane.pending if e.state == PENDING), default=None)
            if self.nc.is_connected and (newest is None or lane.cut
                                         or time.monotonic() - newest > self.ack_timeout):
                lane.cut = False
                return
            await asyncio.sleep(0.05)

    async def _last_id(self, subject: str) -> tuple[str, int] | None:
        """``(Nats-Msg-Id, stream seq)`` of the subject's last message (None: empty)."""
        from nats.js.errors import NotFoundError

        while True:
            try:
                m = await self.js.get_last_msg(self.stream, subject)
            except NotFoundError:
                return None
            except Exception as ex:  # JetStream not ready yet after a restart, a timeout
                if self.closing:
                    raise
                self.stats.last_error = f"{subject}: last message: {ex!r}"
                await asyncio.sleep(0.2)
                continue
            return (m.headers or {}).get(H_MSG_ID, ""), m.seq

    def _resolve(self, lane: Lane, last: tuple[str, int] | None) -> None:
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

    def _heal(self, lane: Lane, entries: list[Entry], last: tuple[str, int] | None) -> None:
        """A refused message sits before a stored one: write the whole state as markers."""
        todo = entries + list(lane.held)
        lane.held.clear()
        for e in todo:
            apply_entry_effect(lane.cache, e.kind, e.effect)
        newest = todo[-1]
        events = chain_events(lane.cache.raw_copy())
        log.warning("%s: a message was refused before a stored one; resync markers at "
                    "(%d, %d)", lane.subject, newest.epoch, newest.seq)
        lane.held.extend(marker_entries(
            lane, newest.epoch, newest.seq, events, lane.exact,
            "bridge: messages refused by JetStream out of order; resynced", self.max_payload))

    async def drain(self, timeout: float) -> bool:
        """Wait until nothing is in flight or held (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._inflight and not any(
                    ln.held or ln.recovering or ln.pending for ln in self.lanes.values()):
                return True
            await asyncio.sleep(0.02)
        return False

    async def close(self) -> None:
        self.closing = True
        for t in [*self._tasks, *([self._watch_task] if self._watch_task else [])]:
            t.cancel()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # the connection may be gone already
                pass
